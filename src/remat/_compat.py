"""The only module that touches torch internals or gates on torch versions.

Each function names the private API it uses, why no public one does the job,
and the versions checked. "Checked" means the test suite passes on those
releases: the CI matrix runs 2.4.1, 2.7.1, 2.11.0, 2.13.0 and 2.15.0
(``scripts/test-matrix.sh``). Version gates for features that need a newer
torch live here too, each with the error the caller raises below it.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import torch
import torch.utils._pytree as _pytree
import torch.utils.checkpoint
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

# Public extension points that torch only exposes from private modules (checked
# 2.4.1-2.15.0): dispatch modes (documented under torch.utils._python_dispatch) and
# the operator classes a policy receives. Everything in remat imports them from here.

__all__ = [
    "AccumulateGrad",
    "accumulate_through",
    "backward_from_edges_supported",
    "HigherOrderOperator",
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "backward_key",
    "base_of",
    "below_autograd",
    "current_backward_id",
    "current_device_context",
    "detach_sharing_version",
    "detach_unseen",
    "device_is_initialized",
    "distributed_rank",
    "fake_mode_of",
    "fake_tensor_mode",
    "outside_fake_mode",
    "collectives_run_on_fake_tensors",
    "compile_cache_room",
    "compile_errors",
    "compiled_call",
    "module_call",
    "dispatch_modes_pushed",
    "inductor_front_end",
    "static_compile_supported",
    "partitioner_changes",
    "partitioner_defaults",
    "partitioner_settings",
    "graph_break_errors",
    "user_dispatch_modes_popped",
    "profiler_allocations",
    "region_memory_budget",
    "region_memory_budgets_available",
    "set_compiled_call",
    "waits_return_their_input",
    "sharding_api_available",
    "simulated_process_group",
    "dynamo_traces_policy_objects",
    "function_mode_count",
    "functorch_transform",
    "get_exec_group",
    "graph_hook",
    "graph_saved_tensor_hooks_inline",
    "inlining_saved_tensor_hook",
    "inside_compiled_function",
    "is_checkpoint_valid",
    "is_compiler_tracing",
    "is_edgeless_view",
    "no_dispatch_modes",
    "node_sequence_nr",
    "on_backward_end",
    "outside_compiler",
    "compiled_autograd_active",
    "pop_saved_tensor_hooks",
    "push_saved_tensor_hooks",
    "read_root",
    "register_load_state_dict_pre_hook",
    "register_state_dict_post_hook",
    "set_exec_group",
    "set_grad_mode",
    "torch_has_selective_checkpointing",
    "tracing_modes_active",
    "tree_flatten",
    "tree_unflatten",
    "version_of",
    "version_witness",
    "writes_arguments",
    "unwrapped",
    "wrapped_tensors",
    "written_arguments",
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


def functorch_transform() -> str | None:
    """The innermost active ``torch.func`` transform, lower case (``"grad"``,
    ``"vmap"``, ``"jvp"``, ``"functionalize"``), or None outside any.

    ``torch._C._functorch.peek_interpreter_stack`` (private; the only way to
    ask, checked 2.4.1-2.15.0); grad, vjp, jacrev and hessian all run functorch's
    ``Grad`` transform. Asked once per region that saves for backward.
    """
    interpreter = _peek_interpreter()
    return None if interpreter is None else str(interpreter.key().name).lower()


_peek_interpreter: Callable[[], Any] = torch._C._functorch.peek_interpreter_stack


def saved_tensor_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be pushed here (functorch's transforms turn them off:
    the grad transform on every release, vmap and jvp too on 2.4.1; checked 2.4.1, 2.7.1,
    2.11.0, 2.13.0, 2.15.0). ``torch._C._autograd._saved_tensors_hooks_is_enabled``, private."""
    return bool(torch._C._autograd._saved_tensors_hooks_is_enabled())  # type: ignore[attr-defined]


def compiled_autograd_active() -> bool:
    """Whether compiled autograd is on: Dynamo may then trace or compile the
    saved-tensor hooks a backward runs.

    Compiled autograd (``torch._dynamo.compiled_autograd``, private) puts
    unpack hooks into the backward graph it hands to Dynamo, and Dynamo
    compiles the hooks' frames when the graph calls them. Its module flags
    ``compiled_autograd_enabled`` (2.4.1-2.15.0) and ``in_compiled_autograd_region``
    (2.7.1-2.15.0) say so; a process that never imported the module has it
    off. Asked once per unpack: two dictionary reads where it is off.
    """
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(
        module.compiled_autograd_enabled or getattr(module, "in_compiled_autograd_region", False)
    )


def outside_compiler(function: Callable[[Any], Any], argument: Any) -> Any:
    """``function(argument)``, run as Python even where Dynamo traces the caller.

    Compiled autograd hands the backward graph, saved-tensor unpack hooks
    included, to Dynamo; a hook that recomputes a region must run eagerly
    there, as an opaque call in the graph. ``torch.compiler.disable`` is
    public (torch >= 2.1; checked 2.4.1-2.15.0); it imports Dynamo, so the
    disabled call is made on first use, not when remat is imported. Called
    only under compiled autograd: the wrapper costs about 0.6 us per call.
    """
    return _disabled_call()(function, argument)


@functools.cache
def _disabled_call() -> Callable[[Callable[[Any], Any], Any], Any]:
    def call(function: Callable[[Any], Any], argument: Any) -> Any:
        return function(argument)

    disabled: Callable[[Callable[[Any], Any], Any], Any] = torch.compiler.disable(call)  # type: ignore[no-untyped-call]
    return disabled


def graph_saved_tensor_hooks_inline() -> bool:
    """Whether AOTAutograd inlines saved-tensor hooks that are ``torch.fx.GraphModule``\\ s into
    the graphs it compiles (``torch._functorch._aot_autograd.utils.saved_tensors_hooks_are_inlineable``,
    private; present in 2.11.0 and 2.15.0, absent in 2.4.1 and 2.7.1, checked).

    Where it does, a ``remat.compress`` block compresses a compiled region's
    saved activations inside its compiled graphs (:func:`graph_hook`).
    """
    return _GRAPH_HOOKS_INLINE


def _graph_hooks_inline() -> bool:
    try:
        from torch._functorch._aot_autograd import utils
    except ImportError:
        return False
    return hasattr(utils, "saved_tensors_hooks_are_inlineable")


_GRAPH_HOOKS_INLINE = _graph_hooks_inline()


class _GraphHook(torch.fx.GraphModule):
    """A saved-tensor hook AOTAutograd takes for a graph: an (empty) ``GraphModule``
    whose call is a Python function.

    AOTAutograd checks ``isinstance(hook, GraphModule)`` and then traces the hook
    with ``make_fx`` on each intermediate a compiled graph saves, inlining the
    traced work into the forward and backward graphs (checked 2.11.0, 2.13.0,
    2.15.0); eager autograd calls it as the function. ``GraphModule`` calls a
    subclass's own ``__call__`` (its per-instance class defers to it).
    """

    def __init__(self, function: Callable[..., Any]) -> None:
        graph = torch.fx.Graph()
        graph.output(graph.placeholder("saved"))
        super().__init__({}, graph)
        self.function = function

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


def inlining_saved_tensor_hook() -> bool:
    """Whether AOTAutograd is tracing a saved-tensor hook into a compiled graph right now.

    It sets a thread-local state around those calls, read by the private
    ``torch._functorch._aot_autograd.graph_compile._get_saved_tensor_hook_context``
    (checked 2.11.0, 2.13.0, 2.15.0; False where it is missing). A hook also runs
    under a tracer when a user traces an eager step (``make_fx``): there it
    must decide as in eager.
    """
    if not _GRAPH_HOOKS_INLINE:
        return False
    from torch._functorch._aot_autograd import graph_compile

    return graph_compile._get_saved_tensor_hook_context() is not None


def inside_compiled_function() -> bool:
    """Whether the caller runs inside the autograd Function of a region compiled by
    torch.compile (AOTAutograd's runtime wrappers are on the Python stack).

    A saved-tensor hook asks it where torch does not inline graph hooks
    (before 2.11): there a compiled graph's saved intermediates reach the hook
    without autograd history. The modules live under
    ``torch/_functorch/_aot_autograd/`` (checked 2.4.1, 2.7.1); walking the
    frames costs microseconds, and is done only for such a tensor.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if "_aot_autograd" in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def graph_hook(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` as a saved-tensor hook that compiled graphs inline where torch does
    (:func:`graph_saved_tensor_hooks_inline`), else ``function`` itself."""
    return _GraphHook(function) if _GRAPH_HOOKS_INLINE else function


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


def backward_from_edges_supported() -> bool:
    """Whether ``torch.autograd.backward`` starts from a ``GradientEdge`` (a node
    and an output number, with no tensor): torch >= 2.7 (pytorch#144744; checked
    2.4.1: absent, 2.7.1, 2.11.0, 2.13.0, 2.15.0: present). Below it a reentrant
    region cannot give the gradient of a tensor it has only the edge of, and
    says so.
    """
    return _BACKWARD_FROM_EDGES


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
    2.15.0; edges are only used from 2.7, see :func:`backward_from_edges_supported`).
    """
    if isinstance(way, torch.Tensor):
        torch.autograd.backward([way], [grad])
        return
    keep = torch._C._autograd._get_current_graph_task_keep_graph() or torch._C._will_engine_execute_node(way.node)
    torch.autograd.backward([way], [grad], retain_graph=keep)


def device_is_initialized(module: Any) -> bool:
    """Whether a device module (``torch.cuda``, ``torch.xpu``...) has a context.

    Public ``is_initialized()`` where the module has it; some backends only
    expose the private ``_initialized`` flag (checked 2.4.1-2.15.0).
    """
    probe = getattr(module, "is_initialized", None)
    if callable(probe):
        return bool(probe())
    return bool(getattr(module, "_initialized", False))


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """Flatten nested containers with torch's pytree registry.

    ``torch.utils._pytree`` is private by name but is the registry that
    libraries (transformers' ModelOutput, ...) register their containers with;
    no public equivalent exists (checked 2.4.1-2.15.0).
    """
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """Inverse of :func:`tree_flatten`."""
    return _pytree.tree_unflatten(leaves, spec)


def detach_sharing_version(tensor: torch.Tensor) -> torch.Tensor:
    """Detach a tensor inside a ``TorchDispatchMode`` keeping its version counter.

    Below autograd the ADInplaceOrView key is excluded, and a plain ``detach()``
    there gets a fresh version counter, so later in-place writes to the
    original would go unnoticed. Re-including the key with the private
    ``_SetExcludeDispatchKeyGuard`` is the only way (checked 2.4.1-2.15.0).
    """
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


# How many torch function modes are active (``torch._C._len_torch_function_stack``,
# private, checked 2.4.1-2.15.0): the C function, so that the usual answer (0)
# costs no Python frame.
function_mode_count: Callable[[], int] = torch._C._len_torch_function_stack


def current_device_context() -> Any:
    """The innermost active ``with torch.device(...)`` mode, or None.

    ``torch.device`` as a context manager is a ``DeviceContext`` function mode;
    finding it needs ``torch.overrides._get_current_function_mode_stack`` and
    ``torch.utils._device.DeviceContext`` (both private, checked 2.4.1-2.15.0). The
    recomputation re-enters it so factory calls land on the same device. The
    private ``torch._C._len_torch_function_stack`` (checked 2.4.1-2.15.0) answers
    the usual case, no mode at all, without building the stack.
    """
    # Every region asks: answer the usual case (no function mode at all) from
    # the mode stack's length alone.
    if function_mode_count() == 0:
        return None
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
    except ImportError:
        return None
    for mode in reversed(_get_current_function_mode_stack()):  # type: ignore[no-untyped-call]
        if isinstance(mode, DeviceContext):
            return mode
    return None


def below_autograd() -> Any:
    """A guard under which ops skip the autograd dispatch keys.

    ``remat.name``'s autograd kernel re-dispatches to its plain kernel, which
    returns its input unchanged, so no autograd node is needed. The public
    ``torch.library.register_autograd`` accepts only functional ops (ours
    returns an alias), so the private guard
    ``torch._C._AutoDispatchBelowAutograd`` (checked 2.4.1-2.15.0) is used.
    """
    return torch._C._AutoDispatchBelowAutograd()


def is_compiler_tracing() -> bool:
    """Whether torch.compile is tracing ops right now (a fake or proxy dispatch mode is on).

    remat.compile needs to tell torch.compile's trace of a checkpointed region
    (where torch requires its two TorchDispatchModes and replays RNG through
    the compiler) from an eager run of that region (``backend="eager"``, or a
    region that fell back after a graph break). torch.utils.checkpoint tells
    them apart with the private ``torch._C._get_dispatch_mode`` and
    ``_TorchDispatchModeKey``. A proxy mode (make_fx) is on while AOTAutograd
    traces; torch 2.5.1 also runs the region under a fake mode alone, for
    metadata, and checks the contexts there too (2.11 and later do not; checked
    2.4.1, 2.5.1, 2.7.1, 2.11.0, 2.13.0, 2.15.0). Where the API is missing, report tracing: the safe answer
    (torch's modes pass unchanged).
    """
    get_mode = getattr(torch._C, "_get_dispatch_mode", None)
    keys = getattr(torch._C, "_TorchDispatchModeKey", None)
    if get_mode is None or keys is None:
        return True
    return get_mode(keys.PROXY) is not None or get_mode(keys.FAKE) is not None


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


def dispatch_modes_active() -> bool:
    """Whether any ``TorchDispatchMode`` is on the stack (user modes and torch's
    own, such as ``FakeTensorMode``).

    ``torch._C._len_torch_dispatch_stack`` has no public spelling; checked
    2.4.1, 2.13 and 2.15 (a mode entered counts, FakeTensorMode included).
    :func:`remat.name` asks it to skip its operator when nothing could see it.
    """
    return bool(torch._C._len_torch_dispatch_stack())


def no_dispatch_modes() -> contextlib.AbstractContextManager[Any]:
    """A context under which the user's ``TorchDispatchMode``\\ s (and remat's own) do
    not see ops, while a tracer's modes still do.

    remat's own tensor work (offload's host buffers and copies, private
    copies of cached outputs) must be invisible to the dispatch modes of
    user regions (selective checkpointing counts ops) and to any user mode.
    It must stay visible to the modes a tracer records tensors with
    (:func:`tracing_modes_active`): a tensor made out of their sight is a
    constant to them, baked into the graph (``docs/design/tracing.md``).
    torch keeps those "infra" modes below every user mode, so popping the
    user modes steps over exactly the right ones. torch has no public way to
    step below the mode stack; ``torch._C._pop_torch_dispatch_stack`` pops
    the innermost user mode first and ``_push_on_torch_dispatch_stack`` puts
    it back, and the infra modes are counted with ``_get_dispatch_mode``
    (checked 2.4.1, 2.7.1, 2.11.0, 2.13.0, 2.15.0).
    """
    users = _user_mode_count()
    if users <= 0:
        return contextlib.nullcontext()
    return _UserModesPopped(users)


def user_dispatch_modes_popped() -> contextlib.AbstractContextManager[list[Any]]:
    """:func:`no_dispatch_modes`, handing over the user modes it popped (innermost first).

    A static compiled estimate runs a compiled block with them popped, as
    torch.compile needs (Dynamo does not compile a frame while a user mode is
    active), and shows its graphs' buffers to the memory trackers among
    them (``docs/design/compile.md``, "Static estimates").
    """
    return _UserModesPopped(max(_user_mode_count(), 0))


@contextlib.contextmanager
def dispatch_modes_pushed(modes: Sequence[Any]) -> Iterator[None]:
    """Push ``modes`` (innermost first, as :func:`user_dispatch_modes_popped` gives them)
    back for a block, and pop them again after it (same private calls as there)."""
    for mode in reversed(modes):
        torch._C._push_on_torch_dispatch_stack(mode)
    try:
        yield
    finally:
        for _ in modes:
            torch._C._pop_torch_dispatch_stack(None)


class _UserModesPopped:
    """Pops ``count`` user dispatch modes on entry and pushes them back on exit."""

    __slots__ = ("_count", "_popped")

    def __init__(self, count: int) -> None:
        self._count = count
        self._popped: list[Any] = []

    def __enter__(self) -> list[Any]:
        pop = torch._C._pop_torch_dispatch_stack
        self._popped = [pop(None) for _ in range(self._count)]
        return self._popped  # __exit__ replaces the attribute, never mutates this list

    def __exit__(self, *exc: object) -> None:
        popped, self._popped = self._popped, []
        for mode in reversed(popped):
            torch._C._push_on_torch_dispatch_stack(mode)


_INFRA_MODE_KEYS: tuple[Any, ...] = tuple(
    getattr(torch._C._TorchDispatchModeKey, name)
    for name in ("FAKE", "PROXY", "FUNCTIONAL")
    if hasattr(torch._C._TorchDispatchModeKey, name)
)


def _user_mode_count() -> int:
    return torch._C._len_torch_dispatch_stack() - _infra_mode_count()


def _infra_mode_count() -> int:
    get_mode = torch._C._get_dispatch_mode
    return sum(get_mode(key) is not None for key in _INFRA_MODE_KEYS)


def tracing_modes_active() -> bool:
    """Whether a tracer records tensors by identity here: a proxy mode (``make_fx``,
    ``torch.export``, AOTAutograd), a fake-tensor mode or a functionalization
    mode, on the dispatch stack or torch's pre-dispatch stack (export's
    training IR).

    Under such a tracer every tensor remat hands to autograd must come from
    an op the tracer saw (``docs/design/tracing.md``). Uses the private
    ``torch._C._get_dispatch_mode`` and ``torch._ops._len_torch_dispatch_stack_pre_dispatch``
    (checked 2.4.1, 2.7.1, 2.11.0, 2.13.0, 2.15.0). Asked once per recomputation,
    not per tensor.
    """
    if _infra_mode_count():
        return True
    from torch._ops import _len_torch_dispatch_stack_pre_dispatch

    return bool(_len_torch_dispatch_stack_pre_dispatch())  # type: ignore[no-untyped-call]


def detach_unseen(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.detach()`` that no active ``TorchDispatchMode`` sees (plain tensors only).

    A recomputation detaches what it saves; inside a selective region the
    replay mode would see each ``detach`` and pay a Python dispatch for it,
    about three times the cost of this guard. ``torch._C._DisableTorchDispatch``
    (private; what ``torch.utils._mode_utils.no_dispatch`` uses; checked
    2.4.1-2.15.0) also skips tensor subclasses' own dispatch, so callers use it
    for plain ``torch.Tensor`` objects only, and only where no tracer records
    tensors (:func:`tracing_modes_active`): a tracer must see every tensor
    that reaches autograd, or it bakes the value into its graph.
    """
    with torch._C._DisableTorchDispatch():
        return tensor.detach()


def version_witness(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor sharing ``tensor``'s version counter but not its memory.

    Offloading replaces a saved tensor by a host copy, and autograd skips its
    in-place check when saved-tensor hooks are active; the witness lets the
    unpack hook make that check without keeping the device memory alive.
    ``detach()`` shares the counter, but only where the ADInplaceOrView key is
    active: inside a ``TorchDispatchMode`` (a selective region's recorder) it
    gives a fresh counter at version 0, so the key is re-included as in
    :func:`detach_sharing_version`. ``set_()`` then drops the storage, and the
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


def torch_has_selective_checkpointing() -> bool:
    """Whether ``torch.utils.checkpoint`` has its public selective-checkpoint API.

    ``CheckpointPolicy`` and ``create_selective_checkpoint_contexts`` appeared
    in torch 2.5 (absent on 2.4.1, present on 2.5.1-2.15.0, checked). remat's
    eager selective checkpointing is its own and works on every release; only
    the torch.compile path needs torch's, because the compiler's partitioner
    reads nothing but the decisions of torch's own dispatch modes.
    """
    return _TORCH_HAS_SELECTIVE_CHECKPOINTING


def register_state_dict_post_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> None:
    """``module.register_state_dict_post_hook(hook)``, also on torch 2.4.

    The public method arrived in torch 2.5 (checked 2.5.1-2.15.0); 2.4 has the
    same hook, with the same ``(module, state_dict, prefix, local_metadata)``
    arguments, under the private ``_register_state_dict_hook`` (checked 2.4.1).
    """
    register = getattr(module, "register_state_dict_post_hook", None)
    if register is None:
        register = module._register_state_dict_hook
    register(hook)


def register_load_state_dict_pre_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> None:
    """``module.register_load_state_dict_pre_hook(hook)``, also on torch 2.4.

    The public method arrived in torch 2.5 (checked 2.5.1-2.15.0); on 2.4 the
    private ``_register_load_state_dict_pre_hook(hook, with_module=True)`` calls
    the hook with the same arguments, module first (checked 2.4.1).
    """
    register = getattr(module, "register_load_state_dict_pre_hook", None)
    if register is None:
        module._register_load_state_dict_pre_hook(hook, with_module=True)  # type: ignore[no-untyped-call]
    else:
        register(hook)


def dynamo_traces_policy_objects() -> bool:
    """Whether torch.compile can carry a :mod:`remat.policies` object into a region.

    remat's ready-made policies are frozen dataclasses holding frozensets of
    ops. Dynamo before torch 2.9 cannot treat them as constants ("is not a
    constant"; checked 2.5.1 and 2.7.1 fail, 2.9.1-2.15.0 pass), so the
    compiled path needs 2.9 for them; plain policy functions and op lists work
    from 2.5.
    """
    return _DYNAMO_TRACES_POLICY_OBJECTS


# Facts about the installed torch, read once: both gates run inside code Dynamo
# traces, where it cannot build a TorchVersion (a str subclass) on any release.
_TORCH_HAS_SELECTIVE_CHECKPOINTING = hasattr(
    torch.utils.checkpoint, "create_selective_checkpoint_contexts"
)
_DYNAMO_TRACES_POLICY_OBJECTS = bool(torch.torch_version.TorchVersion(torch.__version__) >= "2.9")
_FLASH_CPU_GQA_BACKWARD = bool(torch.torch_version.TorchVersion(torch.__version__) >= "2.11")
_BACKWARD_FROM_EDGES = bool(torch.torch_version.TorchVersion(torch.__version__) >= "2.7")
_DYNAMO_REFAKES_FAKE_INPUTS = bool(torch.torch_version.TorchVersion(torch.__version__) >= "2.11")


def flash_cpu_takes_grouped_heads() -> bool:
    """Whether the CPU flash-attention op differentiates grouped key/value heads.

    Its forward accepts fewer key/value heads than query heads, but on torch
    2.7.1 its backward returns a gradient of the query's head count for them
    (an error); 2.11.0, 2.13.0 and 2.15.0 are right. Releases in between were
    not checked, so they repeat the heads as transformers does without
    ``enable_gqa``.
    """
    return _FLASH_CPU_GQA_BACKWARD


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


# ``torch._C._set_grad_enabled`` (private; what ``torch.enable_grad`` and
# ``torch.set_grad_enabled`` call, checked 2.4.1-2.15.0): a recomputation turns
# grad mode on and back without building a grad-mode object.
set_grad_mode: Callable[[bool], None] = torch._C._set_grad_enabled


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


def written_arguments(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments an operator writes in place (``self`` of ``mul_``, ``out=``...).

    Read from the operator's schema (``OpOverload._schema``: its arguments'
    ``alias_info.is_write``), which has no public spelling (checked
    2.4.1-2.15.0). Called only for ops whose schema is mutable.
    """
    written = []
    for position, argument in enumerate(op._schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        if position < len(args):
            written.append(args[position])
        elif argument.name in kwargs:
            written.append(kwargs[argument.name])
    return written


def writes_arguments(op: Any) -> bool:
    """Whether an operator writes into (or changes the metadata of) an argument.

    ``OpOverload._schema.is_mutable`` (no public spelling; checked
    2.4.1-2.15.0): true for ``mul_``, ``out=`` variants and ``squeeze_``.
    """
    return bool(op._schema.is_mutable)


def wrapped_tensors(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors a traceable wrapper subclass holds (a ``DTensor``'s local
    shard); None for a tensor that is not one.

    Wrapper subclasses (``_make_wrapper_subclass``) report a storage sized by
    their outer shape that owns no memory; what they cost is what they wrap,
    named by ``__tensor_flatten__`` (the protocol torch.compile uses, on
    DTensor since torch 2.1; checked 2.4.1, 2.7.1, 2.11.0, 2.13.0, 2.15.0).
    The check is by class: FakeTensor and FunctionalTensor do not define it.
    """
    cls = type(tensor)
    if not (hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__")):
        return None
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [getattr(tensor, name) for name in names]
    return [value for value in inner if isinstance(value, torch.Tensor)]


def unwrapped(tensor: torch.Tensor) -> tuple[dict[str, Any], Callable[[dict[str, Any]], torch.Tensor]] | None:
    """A traceable wrapper subclass (``DTensor``) as the tensors it holds, and how to
    build it again from new ones; None for a tensor that is not one.

    The ``__tensor_flatten__`` / ``__tensor_unflatten__`` protocol (see
    :func:`wrapped_tensors`; checked 2.4.1-2.15.0): a stash keeps a
    ``DTensor``'s local shard, so restoring it needs no collective.
    """
    cls = type(tensor)
    if not (hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__")):
        return None
    names, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {name: getattr(tensor, name) for name in names}  # a DTensor's mesh too, on 2.13 and 2.15
    size, stride = tensor.shape, tensor.stride()

    def rebuild(parts: dict[str, Any]) -> torch.Tensor:
        built: torch.Tensor = cls.__tensor_unflatten__(parts, context, size, stride)
        return built

    return inner, rebuild


def distributed_rank() -> tuple[int, int] | None:
    """(rank, world size) of the default process group; None when there is none
    (or ``torch.distributed`` is not built in)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return None
    return distributed.get_rank(), distributed.get_world_size()


def sharding_api_available() -> bool:
    """Whether FSDP2 and its ``MixedPrecisionPolicy`` are public (torch >= 2.6).

    torch 2.4 and 2.5 have ``fully_shard`` only under
    ``torch.distributed._composable.fsdp``; remat's sharded estimate and
    planning need the public one (checked 2.4.1: absent; 2.7.1 onwards:
    present). Callers raise ``UnsupportedCheckpointError`` below it.
    """
    distributed = torch.distributed
    if not distributed.is_available():
        return False
    import torch.distributed.fsdp as fsdp

    return hasattr(fsdp, "fully_shard") and hasattr(fsdp, "MixedPrecisionPolicy")


@contextlib.contextmanager
def simulated_process_group(world_size: int) -> Iterator[None]:
    """Make this process rank 0 of ``world_size`` ranks that do not exist.

    Uses torch's "fake" process-group backend: collectives complete at once
    and move no data, so FSDP2 and tensor parallelism run their real code
    (shard sizes, gathers, buffers) for any world size in one process. The
    backend is registered by a module of torch's test utilities
    (``torch.testing._internal.distributed.fake_pg``, the same that
    torchtitan's memory estimation uses); no public module offers it
    (checked 2.7.1, 2.11.0, 2.13.0, 2.15.0). The default process group is
    destroyed on exit.
    """
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg as fake_pg

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def collectives_run_on_fake_tensors() -> bool:
    """Whether c10d's collectives have Meta kernels, which fake tensors run.

    torch registers them in ``torch.distributed._meta_registrations``
    (present in 2.11.0, 2.13.0, 2.15.0; absent in 2.7.1, where a collective on
    a fake tensor raises ``UnsupportedOperatorException``).
    """
    import importlib.util

    return importlib.util.find_spec("torch.distributed._meta_registrations") is not None


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode``: tensors with shapes, dtypes and storage sizes but no data.

    Unlike the ``meta`` device, fake tensors report a real device (``cpu``),
    which FSDP2 requires of the parameters it shards (it refuses meta ones).
    ``torch._subclasses.fake_tensor`` has no public home (checked 2.4.1-2.15.0).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real (meta) tensors may come in: the model's parameters are converted
    # by ``to_empty`` under the mode, which reads them first.
    return FakeTensorMode(allow_non_fake_inputs=True)


class _WaitsReturnTheirInput(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, wait: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.wait = wait

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is self.wait:
            return args[0]
        return func(*args, **(kwargs or {}))


def waits_return_their_input() -> contextlib.AbstractContextManager[Any]:
    """Under a fake mode, make ``_c10d_functional.wait_tensor`` return its input.

    On real tensors the op hands back the very tensor it waited for; its fake
    implementation returns a new tensor with a storage of its own (checked
    2.13.0, 2.15.0), which a memory tracker counts as one more allocation,
    and which the real run never makes. Entered inside the fake mode, below
    the tracker, so the tracker sees what a real run does. A no-op where the
    functional collectives are not registered.
    """
    namespace = getattr(torch.ops, "_c10d_functional", None)
    packet = getattr(namespace, "wait_tensor", None) if namespace is not None else None
    if packet is None:
        return contextlib.nullcontext()
    return _WaitsReturnTheirInput(packet.default)


def fake_mode_of(values: Sequence[Any]) -> Any:
    """The fake-tensor mode of the first fake tensor in ``values`` if that mode is not
    active already, else None. ``FakeTensor`` and its ``fake_mode`` are private
    (``torch._subclasses.fake_tensor``; checked 2.4.1-2.15.0)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for value in values:
        if isinstance(value, FakeTensor):
            mode = value.fake_mode
            active = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
            return None if active is mode else mode
    return None


def outside_fake_mode() -> contextlib.AbstractContextManager[Any]:
    """Leave the active fake-tensor mode for a block (tensors made there are real).

    A sharded estimate builds its model inside a fake mode, but ``Module.to``
    (dtype changes, peft's adapters) cannot convert fake parameters: it swaps
    them, which the mode's own references forbid (torch 2.13). The loader
    builds on real meta tensors out here, then makes them fake.
    ``unset_fake_temporarily`` is private (checked 2.4.1, 2.7.1, 2.13.0, 2.15.0).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    manager: contextlib.AbstractContextManager[Any] = unset_fake_temporarily()
    return manager


# -- compiled code: the allocator's view, per-module compiled calls, region budgets --


def static_compile_supported() -> bool:
    """Whether torch.compile can compile a module whose tensors are fake ones of another mode.

    Dynamo re-wraps fake inputs in its own fake-tensor mode from 2.11
    (checked 2.11.0, 2.13.0, 2.15.0); 2.4.1 and 2.7.1 pass the caller's fake
    tensors through, and inductor's front end refuses the two modes
    ("fake mode from tracing context doesn't match").
    """
    return _DYNAMO_REFAKES_FAKE_INPUTS


def inductor_front_end(
    graph: torch.fx.GraphModule, example_inputs: Sequence[Any], inner_compile: Callable[..., Any]
) -> Callable[..., Any]:
    """Compile a Dynamo graph as inductor does up to its code generation: ``inner_compile``
    gets each partitioned graph instead of inductor's kernel generator.

    Inductor's ``compile_fx`` decomposes the graph with inductor's own table,
    runs its joint-graph passes and its min-cut partitioner (what the
    forward saves for backward is decided there), then hands the forward
    and the backward graph to ``inner_compile`` (its keyword argument, whose
    default generates the kernels). A static estimate passes its own, which
    runs no code generator and needs no real tensor (``docs/design/compile.md``,
    "Static estimates"). ``torch._inductor.compile_fx`` is private; the
    keyword and the graphs it receives (aten graphs whose nodes carry fake
    values) were checked on 2.4.1, 2.7.1, 2.11.0, 2.13.0 and 2.15.0.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # The compile caches would serve a graph compiled for real before (same
    # graph, same settings) with its kernels, and never call inner_compile:
    # the "static" block would run real code. Their switches are private
    # configs (enable_autograd_cache from 2.5; fx_graph_cache in every
    # checked release).
    caches_off = {"fx_graph_cache": False}
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(caches_off))
        if hasattr(functorch_config, "enable_autograd_cache"):
            stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        compiled: Any = compile_fx(graph, list(example_inputs), inner_compile=inner_compile)
    assert callable(compiled), "remat bug: inductor's front end returned no callable"
    return compiled  # type: ignore[no-any-return]


class _TimelineReady(BaseException):
    """Carries the buffer timeline out of inductor's code generator, which it stops
    before any kernel is compiled (a BaseException: inductor wraps ``Exception``s)."""

    def __init__(self, events: list[tuple[str, int, int]]) -> None:
        super().__init__("remat: inductor's buffer timeline (internal signal)")
        self.events = events


def inductor_buffer_timeline(
    graph: torch.fx.GraphModule, example_inputs: Sequence[Any], **graph_kwargs: Any
) -> list[tuple[str, int, int]] | None:
    """What inductor's generated code for one partitioned graph allocates and frees, in order.

    Inductor lowers the graph, fuses and orders its kernels and plans its
    buffers (reusing a freed buffer of the same size) before it writes any
    code; this runs all of that on ``example_inputs`` (fake tensors are
    enough) and stops once the buffer plan is made, so no kernel is compiled.
    Returns events ``("allocate", storage, nbytes)``, ``("free", storage,
    0)`` and ``("free_input", index, 0)`` (the code drops its reference to
    input ``index``), storages numbered from 0; the storages not freed at the
    end are the graph's outputs. None where inductor's lowering cannot run
    here (an op it cannot lower on these inputs). ``graph`` is not changed.

    Private: ``compile_fx_inner`` and the wrapper's memory-planning lines
    (``torch._inductor.codegen.wrapper``: allocate, free, reuse, reinterpret,
    multi-output), read after ``memory_plan_reuse``. Checked on 2.11.0,
    2.13.0 and 2.15.0 (static estimates need 2.11, ``static_compile_supported``).
    """
    import torch._inductor.config as inductor_config
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper as codegen
    from torch._inductor.compile_fx import compile_fx_inner

    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph.graph, {}))
    module = torch.fx.GraphModule(graph, copy)  # post-grad passes rewrite the graph they get
    inputs = [node.target for node in copy.nodes if node.op == "placeholder"]
    with _PLANNING_LOCK:  # one patch at a time: a second would restore the first's hook
        planned: Callable[[Any], None] = codegen.PythonWrapperCodegen.memory_plan_reuse

        def stop_after_planning(wrapper: Any) -> None:
            planned(wrapper)
            if _PLANNING_ONLY.get():  # another thread's real compile goes on to its kernels
                raise _TimelineReady(_buffer_events(wrapper.lines, inputs, ir, codegen))

        codegen.PythonWrapperCodegen.memory_plan_reuse = stop_after_planning  # type: ignore[method-assign]
        token = _PLANNING_ONLY.set(True)
        try:
            # A backward graph is compiled when backward first runs, outside the front
            # end's switches: the FX-graph cache would hand back a real compile's code.
            # Unvectorized C++ kernels: their code is written faster, and vector
            # width changes a kernel's loops, not which buffers it reads and writes.
            with inductor_config.patch({"fx_graph_cache": False, "cpp.simdlen": 1}):
                compile_fx_inner(module, list(example_inputs), **graph_kwargs)
        except _TimelineReady as ready:
            return ready.events
        finally:
            _PLANNING_ONLY.reset(token)
            codegen.PythonWrapperCodegen.memory_plan_reuse = planned  # type: ignore[method-assign]
    return None  # no Python wrapper code was written (inductor's C++ wrapper is on)


_PLANNING_LOCK = threading.Lock()
_PLANNING_ONLY: ContextVar[bool] = ContextVar("remat_inductor_planning_only", default=False)
"""Whether inductor's code generator, in this context, stops once its buffers are planned."""


def _buffer_events(lines: Sequence[Any], inputs: Sequence[Any], ir: Any, codegen: Any) -> list[tuple[str, int, int]]:
    """Follow the wrapper's names through its planned lines: which storage each name
    holds, and when the last name holding a storage lets go of it."""
    events: list[tuple[str, int, int]] = []
    holders: dict[str, list[tuple[str, int]]] = {}
    counts: dict[tuple[str, int], int] = {}
    storages_of_outputs: dict[str, int] = {}
    allocated = [0]

    def bind(name: str, keys: list[tuple[str, int]]) -> None:
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        drop(name)
        holders[name] = keys

    def drop(name: str) -> None:
        for key in holders.pop(name, ()):
            counts[key] -= 1
            if counts[key] == 0:
                events.append(("free_input", key[1], 0) if key[0] == "input" else ("free", key[1], 0))

    def allocate(node: Any) -> tuple[str, int]:
        storage = allocated[0]
        allocated[0] += 1
        events.append(("allocate", storage, _buffer_nbytes(node, ir)))
        return ("buffer", storage)

    for index, name in enumerate(inputs):
        bind(str(name), [("input", index)])
    for line in lines:
        if isinstance(line, codegen.AllocateLine):
            bind(line.node.get_name(), [allocate(line.node)])
        elif isinstance(line, codegen.ExternKernelAllocLine):
            if isinstance(line.node.layout, ir.MultiOutputLayout):
                keys = []
                for output in getattr(line.node, "outputs", ()):
                    if isinstance(output, ir.MultiOutput):
                        key = allocate(output)
                        storages_of_outputs[output.get_name()] = key[1]
                        keys.append(key)
                bind(line.node.get_name(), keys)
            else:
                bind(line.node.get_name(), [allocate(line.node)])
        elif isinstance(line, codegen.MultiOutputLine):
            storage = storages_of_outputs.get(line.result_name)
            keys = [("buffer", storage)] if storage is not None else list(holders.get(line.arg_name, ()))
            bind(line.result_name, keys)
        elif isinstance(line, (codegen.ReuseLine, codegen.ReinterpretLine)):
            old = line.node.get_name()
            bind(line.reused_as.get_name(), list(holders.get(old, ())))
            if isinstance(line, codegen.ReuseLine) and line.delete_old:
                drop(old)
        elif isinstance(line, codegen.FreeIfNotReusedLine):
            if not line.is_reused:
                drop(line.node.get_name())
        elif isinstance(line, codegen.FreeLine):
            drop(line.node.get_name())
    return events


def _buffer_nbytes(node: Any, ir: Any) -> int:
    layout = node.get_layout()
    if not isinstance(layout, ir.Layout) or isinstance(layout, ir.NonOwningLayout):
        return 0
    return int(layout.storage_size()) * int(layout.dtype.itemsize)


def profiler_allocations(profiler: Any, prefix: str) -> list[tuple[int, int, int, int, str, str]]:
    """What a finished ``torch.profiler.profile(profile_memory=True)`` saw, in time order.

    One tuple per event: ``(time_ns, order, address, signed bytes, device
    type, name)``: an allocation (positive bytes) or a free (negative) with
    ``name == ""``, or a ``record_function`` range whose name starts with
    ``prefix`` (bytes 0, address 0). ``order`` is the event's position in the
    profiler's tree, which breaks ties of equal times.

    The public ``profile.events()`` folds each allocation into the op that
    made it and gives no address; what an allocation meter needs (every
    allocation and free, its address and time, inductor's buffers included)
    is only in the profiler's event tree: ``kineto_results
    .experimental_event_tree()`` and its ``_ExtraFields_Allocation`` fields
    ``ptr``, ``alloc_size``, ``device`` (checked 2.4.1, 2.7.1, 2.11.0, 2.13.0,
    2.15.0).
    """
    events: list[tuple[int, int, int, int, str, str]] = []
    stack = list(reversed(profiler.profiler.kineto_results.experimental_event_tree()))
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            events.append(
                (node.start_time_ns, len(events), int(fields.ptr), int(fields.alloc_size),
                 fields.device.type, "")
            )
        elif node.name.startswith(prefix):
            events.append((node.start_time_ns, len(events), 0, 0, "", node.name))
        stack.extend(reversed(node.children))
    events.sort()
    return events


def set_compiled_call(module: torch.nn.Module, call: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Make ``module(...)`` run ``call`` instead of its hooks and forward; returns what was there.

    ``nn.Module.compile()`` stores its compiled ``_call_impl`` in the private
    attribute ``_compiled_call_impl``, which ``Module.__call__`` runs when it
    is set (checked 2.4.1-2.15.0; the attribute exists since 2.2). A planner
    compiling blocks the way users do, with markers around each compiled
    call, sets it through here; None restores the eager call.
    """
    previous: Callable[..., Any] | None = module.__dict__.get("_compiled_call_impl")
    module._compiled_call_impl = call
    return previous


def compiled_call(module: torch.nn.Module) -> Callable[..., Any] | None:
    """What ``module(...)`` runs instead of its hooks and forward when it is compiled, or None.

    The private ``_compiled_call_impl`` that ``nn.Module.compile()`` sets
    (see :func:`set_compiled_call`; checked 2.4.1-2.15.0).
    """
    call: Callable[..., Any] | None = module.__dict__.get("_compiled_call_impl")
    return call


def module_call(module: torch.nn.Module) -> Callable[..., Any]:
    """The function ``Module.compile()`` compiles: the module's hooks and forward.

    ``nn.Module._call_impl`` (private; checked 2.4.1-2.15.0).
    """
    call: Callable[..., Any] = module._call_impl
    return call


@contextlib.contextmanager
def compile_cache_room(entries: int) -> Iterator[None]:
    """Let torch.compile keep ``entries`` compiled versions of one function for a while.

    Blocks compiled with ``module.compile()`` share one code object
    (``nn.Module._call_impl``), and Dynamo keeps at most ``recompile_limit``
    (``cache_size_limit`` before 2.6) versions of a code object; a planner
    that compiles every option of a block in one process needs more for the
    length of its profile. Its private config is the only switch (checked
    2.4.1, 2.7.1, 2.11.0, 2.13.0, 2.15.0).
    """
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    with dynamo_config.patch(**{name: max(entries, getattr(dynamo_config, name))}):
        yield


def compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions torch.compile raises when it cannot compile a function as asked.

    ``torch._dynamo.exc.TorchDynamoException`` is the base of Dynamo's
    errors (graph breaks under ``fullgraph=True``, backend failures); its
    module is private (checked 2.4.1-2.15.0).
    """
    from torch._dynamo.exc import TorchDynamoException

    return (TorchDynamoException,)


def graph_break_errors() -> tuple[type[BaseException], ...]:
    """The compile errors that are graph breaks: Dynamo could not trace the code (``fullgraph=True``).

    ``torch._dynamo.exc.Unsupported`` and ``UserError`` (private module;
    checked 2.4.1-2.15.0). ``UserError`` subclasses ``Unsupported`` up to 2.11
    but not from 2.13, where a Python branch on a tensor's value (``float(t) >
    0``) is captured as an unbacked scalar and refused as ``UserError``: the
    same break in the traced code. Every other :func:`compile_errors` error is
    a failure of the compiler (a backend or inductor error).
    """
    from torch._dynamo.exc import Unsupported, UserError

    return (Unsupported, UserError)


_PARTITIONER_SETTINGS = (
    "activation_memory_budget",
    "activation_memory_budget_runtime_estimator",
    "activation_memory_budget_solver",
    "_sync_decision_cross_ranks",
    "aggressive_recomputation",
    "ban_recompute_long_fusible_chains",
    "ban_recompute_materialized_backward",
    "ban_recompute_not_in_allowlist",
    "ban_recompute_reductions",
    "ban_recompute_used_far_apart",
    "cse",
    "enable_activation_offloading",
    "max_dist_from_bw",
    "recompute_views",
    "treat_parameters_as_free_to_save",
)
"""The settings in ``torch._functorch.config`` that change what the min-cut
partitioner saves for backward (read from ``partitioners.py`` and
``_activation_checkpointing/``, 2.4.1-2.15.0; a name a release lacks is
skipped). Debug outputs (pareto plots, logs) are left out: they change no graph."""


def partitioner_defaults() -> dict[str, Any]:
    """torch's declared default of every partitioner setting this torch has.

    The partitioner reads process-wide settings in the private
    ``torch._functorch.config`` when it splits a compiled graph, and Dynamo
    does not recompile when they change. The defaults come from the config
    module's private tables: ``_default`` (2.4) or each ``_ConfigEntry``'s
    ``default`` (2.5 and newer; checked 2.4.1, 2.7.1, 2.11.0, 2.13.0, 2.15.0).
    """
    import torch._functorch.config as config

    table: dict[str, Any] = getattr(config, "_config")  # noqa: B009 (private, not in the stubs)
    old_defaults: dict[str, Any] | None = getattr(config, "_default", None)
    defaults = {}
    for name in _PARTITIONER_SETTINGS:
        if name not in table:
            continue
        entry = table[name]
        defaults[name] = old_defaults[name] if old_defaults is not None else entry.default
    return defaults


def partitioner_changes(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The partitioner settings whose process-wide value differs from ``settings``, by value now."""
    import torch._functorch.config as config

    changed = {}
    for name, value in settings.items():
        now = getattr(config, name)
        if now != value:
            changed[name] = now
    return changed


def partitioner_settings(settings: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """Set the partitioner settings to ``settings`` for a while (``config.patch``, private; checked 2.4.1-2.15.0)."""
    import torch._functorch.config as config

    manager: contextlib.AbstractContextManager[Any] = config.patch(**settings)
    return manager


def region_memory_budget(budget: float) -> contextlib.AbstractContextManager[Any] | None:
    """torch's activation memory budget for the compiled region traced inside, or None.

    ``torch.autograd.graph.region_activation_memory_budget`` (public, a
    prototype; torch 2.13 and newer): the min-cut partitioner's knapsack
    under ``budget`` for the graph of the region traced under it. None where
    this torch has no such API (2.11 and older: only the process-wide
    ``torch._functorch.config.activation_memory_budget``).
    """
    api = getattr(torch.autograd.graph, "region_activation_memory_budget", None)
    if api is None:
        return None
    manager: contextlib.AbstractContextManager[Any] = api(budget)
    return manager


def region_memory_budgets_available() -> bool:
    """Whether this torch has per-region compile budgets (see :func:`region_memory_budget`)."""
    return hasattr(torch.autograd.graph, "region_activation_memory_budget")
