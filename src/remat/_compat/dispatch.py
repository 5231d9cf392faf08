"""Dispatch and modes: ``TorchDispatchMode`` and the operator classes, the
dispatch-mode stacks (stepping over the user's modes, telling a tracer's
modes apart), dispatch-key guards (below autograd, detaching unseen or
sharing a version counter), operator schemas (what an op writes) and the
wrapper-subclass protocol (``__tensor_flatten__``).

Public extension points that torch only exposes from private modules (checked
2.4.1-2.15.0) are imported here and nowhere else: dispatch modes (documented
under ``torch.utils._python_dispatch``), the operator classes a policy
receives (``torch._ops``) and the wrapper-subclass check. Private names used:
``torch._C``'s dispatch-stack functions (``_len_torch_dispatch_stack``,
``_pop_torch_dispatch_stack``, ``_push_on_torch_dispatch_stack``,
``_get_dispatch_mode``, ``_get_dispatch_stack_at``, ``_TorchDispatchModeKey``), its dispatch-key guards,
``torch._ops._len_torch_dispatch_stack_pre_dispatch`` and ``OpOverload._schema``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = [
    "DEVICE_QUERY",
    "HigherOrderOperator",
    "OpAnswer",
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "answered_or_run",
    "answering_ops",
    "below_autograd",
    "checked_on_exit",
    "detach_sharing_version",
    "detach_unseen",
    "dispatch_modes_active",
    "dispatch_modes_on_stack",
    "dispatch_modes_pushed",
    "is_compiler_tracing",
    "is_traceable_wrapper_subclass",
    "no_dispatch_modes",
    "tracing_modes_active",
    "unwrapped",
    "user_dispatch_modes_popped",
    "wrapped_tensors",
    "writes_arguments",
    "written_arguments",
]

DEVICE_QUERY: OpOverload = torch.ops.prim.device.default
"""TorchScript's ``prim::device`` (in every supported torch): how a tensor subclass with a
device of its own, a fake tensor above all, answers C++'s every ``tensor.device()``. Plain
tensors never dispatch it; under fake tensors it is most of a step's ops (15,230 of a
pipelined Llama-3.1-8B rank's 25,293), so modes that watch ops pass it straight through."""


OpAnswer = Callable[[tuple[Any, ...], Mapping[str, Any]], Any]
"""``answer(args, kwargs)``: what an op returns on a simulated rank in place of what its
kernel would, or ``NotImplemented`` to run the kernel (a collective's wait, a pipeline
schedule's vote: ``remat._compat.distributed``, ``remat._compat.pipelining``)."""


class _AnsweringOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, answers: dict[Any, OpAnswer]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.answers = answers

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return answered_or_run(self.answers, func, args, kwargs or {})


def answered_or_run(answers: Mapping[Any, OpAnswer], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``func`` returns for ``args``: its answer in ``answers`` where it has one that
    does not decline (``NotImplemented``), else what its kernel returns. For a mode's
    ``__torch_dispatch__`` (:func:`answering_ops`; the memory tracker's own mode)."""
    answer = answers.get(func) if answers else None
    if answer is not None:
        result = answer(args, kwargs)
        if result is not NotImplemented:
            return result
    return func(*args, **kwargs)


def answering_ops(answers: Mapping[Any, OpAnswer]) -> contextlib.AbstractContextManager[Any]:
    """A dispatch mode under which the ops in ``answers`` (``OpOverload`` to
    :data:`OpAnswer`) are answered by them; a null context for no answers. Where a memory
    tracker is the lowest mode of a simulated step, it takes the answers itself
    (``MemoryTracker.answer_ops``): every op passes through each mode on the stack."""
    if not answers:
        return contextlib.nullcontext()
    return _AnsweringOps(dict(answers))


def dispatch_modes_active() -> bool:
    """Whether any ``TorchDispatchMode`` is on the stack (user modes and torch's
    own, such as ``FakeTensorMode``).

    ``torch._C._len_torch_dispatch_stack`` has no public spelling; checked
    2.4.1, 2.13 and 2.15 (a mode entered counts, FakeTensorMode included).
    :func:`remat.name` asks it to skip its operator when nothing could see it.
    """
    return bool(torch._C._len_torch_dispatch_stack())


def dispatch_modes_on_stack() -> list[Any]:
    """Every ``TorchDispatchMode`` on the stack now, torch's own (``FakeTensorMode``)
    included, in no promised order; empty, at once, when there is none.

    torch has no public spelling; ``torch._C._get_dispatch_stack_at`` indexes the
    modes ``_len_torch_dispatch_stack`` counts (checked 2.4.1, 2.7.1, 2.11.0,
    2.13.0, 2.15.0). A selective region asks it once per forward and per
    recomputation, for a mode that meters its ops (:func:`remat._scope.policy_op_meter`).
    """
    count = torch._C._len_torch_dispatch_stack()
    if not count:
        return []
    return [torch._C._get_dispatch_stack_at(index) for index in range(count)]


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


def below_autograd() -> Any:
    """A guard under which ops skip the autograd dispatch keys.

    ``remat.name``'s autograd kernel re-dispatches to its plain kernel, which
    returns its input unchanged, so no autograd node is needed. The public
    ``torch.library.register_autograd`` accepts only functional ops (ours
    returns an alias), so the private guard
    ``torch._C._AutoDispatchBelowAutograd`` (checked 2.4.1-2.15.0) is used.
    """
    return torch._C._AutoDispatchBelowAutograd()


def detach_sharing_version(tensor: torch.Tensor) -> torch.Tensor:
    """Detach a tensor inside a ``TorchDispatchMode`` keeping its version counter.

    Below autograd the ADInplaceOrView key is excluded, and a plain ``detach()``
    there gets a fresh version counter, so later in-place writes to the
    original would go unnoticed. Re-including the key with the private
    ``_SetExcludeDispatchKeyGuard`` is the only way (checked 2.4.1-2.15.0).
    """
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


def detach_unseen(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.detach()`` that no active ``TorchDispatchMode`` sees (plain tensors only).

    A recomputation detaches what it saves; inside a selective region the
    replay mode would see each ``detach`` and pay a Python dispatch for it;
    under this guard no mode sees it. ``torch._C._DisableTorchDispatch``
    (private; what ``torch.utils._mode_utils.no_dispatch`` uses; checked
    2.4.1-2.15.0) also skips tensor subclasses' own dispatch, so callers use it
    for plain ``torch.Tensor`` objects only, and only where no tracer records
    tensors (:func:`tracing_modes_active`): a tracer must see every tensor
    that reaches autograd, or it bakes the value into its graph.

    functorch is off inside too (``torch._C._DisableFuncTorch``, private,
    checked 2.4.1, 2.13.0, 2.15.0): a selective region's cache settles
    its entries under ``torch.func.grad``, and there functorch lifted the
    detach of a region's output into a wrapper of the transform's level, which
    the backward's recomputation then could not return (an internal assert).
    """
    with torch._C._DisableTorchDispatch(), torch._C._DisableFuncTorch():
        return tensor.detach()


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


def unwrapped(
    tensor: torch.Tensor,
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], torch.Tensor]] | None:
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
    inner = {
        name: getattr(tensor, name) for name in names
    }  # a DTensor's mesh too, on 2.13 and 2.15
    size, stride = tensor.shape, tensor.stride()

    def rebuild(parts: dict[str, Any]) -> torch.Tensor:
        built: torch.Tensor = cls.__tensor_unflatten__(parts, context, size, stride)
        return built

    return inner, rebuild


def checked_on_exit(mode: TorchDispatchMode, check: Callable[[], None]) -> TorchDispatchMode:
    """``mode`` itself, whose ``with`` block, once left without an error, runs ``check``.

    Why: an error raised inside a mode's ``__torch_dispatch__`` while AOTAutograd
    traces a checkpointed region leaves torch's checkpoint generator suspended
    inside ``with forward_context`` (torch 2.7.1 and 2.11.0; not 2.13 or 2.15).
    While the error's traceback lives (``pytest.raises``, a notebook's last
    traceback), so does the generator; when the garbage collector closes it
    later, its exit pops whatever mode is then on top of the stack, and the
    next compilation fails with "Attempted to unset FakeTensorMode". ``check``
    raises after the mode has left the stack, so the generator finishes.

    The mode keeps its class's behaviour: the instance is given a subclass of
    its own class (torch's private ``_CachingTorchDispatchMode`` for selective
    checkpointing) that only adds the check to ``__exit__``.

    Example:
        >>> seen = []
        >>> with checked_on_exit(TorchDispatchMode(), lambda: seen.append("checked")):
        ...     pass
        >>> seen
        ['checked']
    """
    mode.__class__ = _exit_checked(type(mode))  # type: ignore[arg-type]  # (classes hash)
    mode._remat_exit_check = check  # type: ignore[attr-defined]
    return mode


@functools.cache
def _exit_checked(cls: type[TorchDispatchMode]) -> type[TorchDispatchMode]:
    class ExitChecked(cls):  # type: ignore[valid-type, misc]
        def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> Any:
            result = super().__exit__(exc_type, exc, traceback)
            if exc_type is None:
                self._remat_exit_check()
            return result

    ExitChecked.__name__ = ExitChecked.__qualname__ = cls.__name__
    return ExitChecked
