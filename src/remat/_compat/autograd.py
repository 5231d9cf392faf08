"""The autograd engine: which backward call is running, what runs when it ends,
nested backward from a gradient edge, the order autograd nodes are made in,
the saved-tensor hooks' C bindings, grad mode, and tensors' version counters
and views.

Private names used here: ``torch._C``'s graph-task, exec-group, sequence-number,
saved-tensor-hook and grad-mode functions, ``torch._C._functions.AccumulateGrad``,
``torch.autograd._is_checkpoint_valid``, ``torch.cuda._is_in_bad_fork``,
``torch.autograd.grad_mode._unsafe_preserve_version_counter``, the engine's
``queue_callback``, and the private attributes of tensors and nodes
(``_version``, ``_base``, ``_is_view``, ``_sequence_nr``). The functions every
region calls are the C functions themselves, bound once, so a call costs no
Python frame (``docs/design/performance.md``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from remat._compat.dispatch import detach_sharing_version, is_traceable_wrapper_subclass

__all__ = [
    "AccumulateGrad",
    "accumulate_through",
    "backward_key",
    "base_of",
    "current_backward_id",
    "get_exec_group",
    "is_checkpoint_valid",
    "is_edgeless_view",
    "next_sequence_nr",
    "node_sequence_nr",
    "on_backward_end",
    "pop_saved_tensor_hooks",
    "push_saved_tensor_hooks",
    "read_root",
    "saved_tensor_hooks_enabled",
    "saved_tensor_hooks_may_be_active",
    "set_exec_group",
    "set_grad_mode",
    "version_of",
    "version_witness",
]


AccumulateGrad: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
"""The class of the autograd node that accumulates a leaf's gradient (its
``variable`` is the leaf). Only the private ``torch._C._functions`` names it
(checked 2.4.1-2.15.0); a reentrant region tells the leaves its recomputed
graph reaches by it (``_engine/reentrant.py``)."""


def current_backward_id() -> int:
    """Id of the autograd graph task running on this thread, or -1 outside backward.

    ``torch._C._current_graph_task_id`` (torch >= 1.13; checked 2.4.1-2.15.0) is the
    only way to tell one backward call from another; recomputed tensors are kept
    per backward call so that ``retain_graph=True`` recomputes again.
    """
    return int(torch._C._current_graph_task_id())


def on_backward_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the current backward call finishes.

    Uses the engine's ``queue_callback`` (what FSDP and DDP use; there is no
    public spelling). Lets a region drop recomputed tensors that a partial
    backward never consumed. Returns False when unavailable.
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return False
    queue(callback)
    return True


# Where the current "exec group" lives. torch >= 2.9 keeps it in a C++
# thread-local that the autograd engine propagates to its device threads, which
# a Python ContextVar cannot do; older torch falls back to the ContextVar (right
# for CPU backward, which runs on the calling thread).
_FALLBACK_GROUP: ContextVar[object | None] = ContextVar("remat_exec_group", default=None)
_HAS_NATIVE_GROUP = hasattr(torch._C, "_get_graph_exec_group") and hasattr(
    torch._C, "_set_graph_exec_group"
)


def get_exec_group() -> object | None:
    """The active ``GraphExecGroup`` (torch._C._get_graph_exec_group, torch >= 2.9)."""
    if _HAS_NATIVE_GROUP:
        return torch._C._get_graph_exec_group()
    return _FALLBACK_GROUP.get()


def set_exec_group(group: object | None) -> None:
    """Set the active exec group (torch._C._set_graph_exec_group, torch >= 2.9)."""
    if _HAS_NATIVE_GROUP:
        torch._C._set_graph_exec_group(group)  # type: ignore[arg-type]
    else:
        _FALLBACK_GROUP.set(group)


def backward_key() -> object | None:
    """Which backward call is running: the active exec group (:func:`get_exec_group`),
    else the graph task id (:func:`current_backward_id`), else None.

    Asked on every unpack of a checkpointed tensor, so both questions are put
    in one call.
    """
    group = _get_group()
    if group is not None:
        return group
    task = _graph_task_id()
    return task if task != -1 else None


# The C functions behind backward_key, bound once.
_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
_get_group: Callable[[], object | None] = (
    torch._C._get_graph_exec_group if _HAS_NATIVE_GROUP else _FALLBACK_GROUP.get
)


def is_checkpoint_valid() -> bool:
    """False inside ``torch.autograd.grad`` / ``backward(inputs=...)``.

    ``torch.autograd._is_checkpoint_valid`` (checked 2.4.1-2.15.0) is how the
    reentrant variant knows it cannot run a nested ``backward``.
    """
    return bool(torch.autograd._is_checkpoint_valid())  # type: ignore[no-untyped-call]


def accumulate_through(way: torch.Tensor | torch.autograd.graph.GradientEdge, grad: torch.Tensor) -> None:
    """A nested backward from ``way`` (a leaf, or a gradient edge into a graph)
    with ``grad``, accumulating into leaves' ``.grad``: what torch's reentrant
    checkpoint does with every gradient its nested backward reaches.

    A reentrant region uses it only for the gradient of a tensor its node has
    no edge to. From an edge, the nested backward keeps the graph where the
    running backward keeps it (``retain_graph=True``) or will run that node
    itself (the tensor is also used outside the region): then the outer
    backward runs it again instead of failing on freed buffers, as torch's
    would. Both questions are private:
    ``torch._C._autograd._get_current_graph_task_keep_graph`` and
    ``torch._C._will_engine_execute_node`` (checked 2.7.1, 2.11.0, 2.13.0,
    2.15.0; edges are only used from 2.7, see
    :func:`remat._compat.versions.backward_from_edges_supported`).
    """
    if isinstance(way, torch.Tensor):
        torch.autograd.backward([way], [grad])
        return
    keep = torch._C._autograd._get_current_graph_task_keep_graph() or torch._C._will_engine_execute_node(way.node)
    torch.autograd.backward([way], [grad], retain_graph=keep)


def node_sequence_nr(node: Any) -> int:
    """Creation order of an autograd node (``Node._sequence_nr()``, checked 2.4-2.15).

    Nodes made later on the same thread have larger numbers. A region reads
    the number of its input-saver node when it starts, to tell tensors made
    inside it from tensors it only read.
    """
    return int(node._sequence_nr())


# The number the next autograd node made on this thread will get:
# ``torch._C._autograd._get_sequence_nr`` (private; checked 2.4.1-2.15.0). A
# region that saves its inputs without a node of its own reads it instead. The
# C function itself: every region asks.
next_sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr


# What ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` does on enter
# and exit: ``torch._C._autograd._push_saved_tensors_default_hooks`` and
# ``_pop_saved_tensors_default_hooks`` (private; the public context manager is a
# thin Python class around them; checked 2.4.1-2.15.0). A region pushes hooks for
# its forward and for each recomputation; the C functions themselves are bound
# here, so a push costs no Python frame (docs/design/performance.md).
push_saved_tensor_hooks: Callable[[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]], None] = (
    torch._C._autograd._push_saved_tensors_default_hooks
)
pop_saved_tensor_hooks: Callable[[], None] = torch._C._autograd._pop_saved_tensors_default_hooks


def saved_tensor_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be pushed here (functorch's transforms turn them off:
    the grad transform on every release, vmap and jvp too on 2.4.1; checked 2.4.1, 2.7.1,
    2.11.0, 2.13.0, 2.15.0). ``torch._C._autograd._saved_tensors_hooks_is_enabled``, private."""
    return bool(torch._C._autograd._saved_tensors_hooks_is_enabled())  # type: ignore[attr-defined]


_TOP_SAVED_TENSOR_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _hooks_may_be_active() -> object:
    return True


# Whether saved-tensor default hooks (any ``saved_tensors_hooks``) may be
# active: truthy if so. ``torch._C._autograd._top_saved_tensors_default_hooks``
# (private; present in 2.11.0 and 2.15.0, absent in 2.4.1 and 2.7.1) returns the
# innermost hooks or None; where it is missing the answer is always True, the
# safe side. Bound without a Python frame where it exists: every region asks.
saved_tensor_hooks_may_be_active: Callable[[], object] = (
    _hooks_may_be_active if _TOP_SAVED_TENSOR_HOOKS is None else functools.partial(_TOP_SAVED_TENSOR_HOOKS, True)
)


# ``torch._C._set_grad_enabled`` (private; what ``torch.enable_grad`` and
# ``torch.set_grad_enabled`` call, checked 2.4.1-2.15.0): a recomputation turns
# grad mode on and back without building a grad-mode object.
set_grad_mode: Callable[[bool], None] = torch._C._set_grad_enabled


# The value of a tensor's version counter (bumped by every in-place write).
# ``Tensor._version`` is private by name but is the counter autograd's own
# saved-tensor check reads; no public spelling exists (checked 2.4-2.15). An
# attrgetter: read several times per region, and a Python function around it
# would cost a frame each time (docs/design/performance.md).
version_of: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


def base_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``tensor`` views (itself when it is not a view).

    ``Tensor._base`` (private by name, documented in the view semantics notes;
    checked 2.4-2.15). A view keeps its base alive, so the base object stands
    for the storage while the view lives: identity without an address.
    """
    base = tensor._base
    return tensor if base is None else base


def read_root(tensor: torch.Tensor, sequence_nr: int) -> tuple[torch.Tensor, int] | None:
    """The tensor whose data ``tensor`` is (its base if a view) and that
    tensor's version, if it existed before the autograd node numbered
    ``sequence_nr``; else None.

    "Existed before": a leaf, or its ``grad_fn`` is older than that node.

    Views are judged by their base (``Tensor._is_view`` / ``_base``, checked
    2.4-2.15): ``w.t()`` taken inside a region reads ``w``'s data and shares its
    version counter. A leaf made inside the region also counts (no node tells
    when it was made); watching it costs a little and never misfires, since
    autograd itself forbids changing a saved leaf. Tensors made on another
    thread may carry larger numbers and are then not watched (a missed check,
    never a false one). Asked for every tensor a region's forward saves, so
    the version comes in the same call (``Tensor._version``, as in
    :func:`version_of`).
    """
    if tensor._is_view():
        tensor = tensor._base  # type: ignore[assignment]
    node = tensor.grad_fn
    if node is None or node._sequence_nr() < sequence_nr:
        return tensor, tensor._version
    return None


def is_edgeless_view(tensor: torch.Tensor) -> bool:
    """A view that requires grad yet has no gradient edge (``Tensor._is_view``,
    checked 2.4-2.15): taken under ``no_grad`` of a tensor that requires grad.

    Autograd treats it as a constant (ops do not save what its gradient would
    need), but saving and unpacking it through hooks returns a plain leaf that
    requires grad, which ops do differentiate: a recomputation fed that leaf
    saves more tensors than the forward did.
    """
    return tensor._is_view() and tensor.requires_grad and tensor.grad_fn is None


def version_witness(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor sharing ``tensor``'s version counter but not its memory.

    Offloading replaces a saved tensor by a host copy, and autograd skips its
    in-place check when saved-tensor hooks are active; the witness lets the
    unpack hook make that check without keeping the device memory alive.
    ``detach()`` shares the counter, but only where the ADInplaceOrView key is
    active: inside a ``TorchDispatchMode`` (a selective region's recorder) it
    gives a fresh counter at version 0, so the key is re-included as in
    :func:`remat._compat.dispatch.detach_sharing_version`. ``set_()`` then drops the storage, and the
    version bump that ``set_()`` itself causes is undone with the private
    ``torch.autograd._unsafe_preserve_version_counter`` (checked 2.4.1-2.15.0).
    """
    witness = detach_sharing_version(tensor)
    if is_traceable_wrapper_subclass(witness):
        # A wrapper subclass (DTensor, TwoTensor) keeps its memory in inner
        # tensors and need not implement set_() (DTensor has no sharding rule
        # for it). The detached wrapper keeps the outer counter; each inner
        # tensor it holds is replaced by that tensor's own witness. The
        # attribute names come from the subclass protocol's
        # ``__tensor_flatten__``, which may also name opaque objects (DTensor's
        # device mesh on 2.13 and 2.15, not on 2.4.1-2.11.0; checked).
        for attribute in witness.__tensor_flatten__()[0]:
            inner = getattr(witness, attribute)
            if isinstance(inner, torch.Tensor):
                setattr(witness, attribute, version_witness(inner))
        return witness
    with _unsafe_preserve_version_counter(witness):
        witness.set_()  # type: ignore[call-overload]  # the no-argument form is valid
    return witness


def autograd_runs_in_this_process() -> bool:
    """Whether a backward can run here. False in a forked child where torch refuses every
    backward ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"): the parent's autograd engine had started its device threads. Probed
    with a one-element backward: torch exposes no query for that state.

    False too in a child forked after the parent touched the CUDA runtime (any
    ``torch.cuda.is_available()`` does) on a machine with a GPU: there the engine's CUDA
    device thread fails ("CUDA error: initialization error", seen on an H200 with
    2.11.0+cu130). ``torch.cuda._is_in_bad_fork`` says the runtime was touched (private;
    present and unchanged from 2.4 to 2.15), but a CUDA build marks the child on a machine
    without a GPU all the same, where its backward runs: so a marked child answers no only
    where ``torch.cuda.device_count()`` sees a device (NVML's count, or the parent's once it
    initialized CUDA; 0 on a machine without a driver), and where its probe fails. Before,
    every pipeline simulation of a CUDA build on a CPU machine (the CI matrix's 2.11 and
    2.15, any test process that asked for CUDA) ran in one process.
    """
    touched_cuda = torch.cuda._is_in_bad_fork()
    if touched_cuda and torch.cuda.device_count() > 0:
        return False
    probe = torch.ones(1, requires_grad=True)
    try:
        torch.autograd.grad(probe.sum(), probe)
    except RuntimeError as exc:
        if touched_cuda or "fork" in str(exc):
            return False
        raise
    return True

