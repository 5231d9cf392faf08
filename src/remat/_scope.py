"""Where code runs, and who watches: the protocol other layers plug into.

Layer: bottom (imports ``_compat`` and ``errors``): the engine's regions set
this state and the storage contexts read it, so it sits below both.

**Inside a region**: whether code runs inside a checkpointed region's forward or recomputation.

Saved-tensor contexts that would steal a region's tensors (``remat.offload``
and its opt-out) consult this when they are entered: inside a region every
saved tensor already belongs to the region, and a context entered there must
stand aside, or the recomputation would save fewer tensors than the forward.

"Inside a region" is exactly "a region's saved-tensor hooks are active", so
the hooks themselves mark it (:class:`RegionHooks`); nothing else is pushed.

**Observers**: tools see what checkpointed regions do with saved tensors.

Saved-tensor hooks nest: the innermost set wins, so a tool's own outer hooks
never see tensors saved inside a remat region or under ``remat.offload``. A
tool that wants to (the saved-tensor report in :mod:`remat.memory`) installs a
callback with :func:`observe_saved_tensors`; regions and offload contexts
*entered* while it is active read it once, at entry, and call it during the
forward with one of these events:

``"region_saved"``
    autograd saved this tensor inside a checkpointed region; it is not
    stored: backward recomputes it (or replays a policy's cached output).
``"policy_saved"``
    a selective policy kept this op output on its device (usually reported
    as ``region_saved`` too, right after; match the two by storage).
``"policy_offloaded"``
    a selective policy kept a host copy of this op output.
``"offloaded"``
    ``remat.offload`` moved this saved tensor to host memory.
``"policy_compressed"``
    a selective policy kept this op output compressed on its device.
``"compressed"``
    ``remat.compress`` kept this saved tensor compressed on its device.

Nothing is reported when no callback is installed; the hot path then pays one
``None`` check per saved tensor.

Example:
    >>> import torch, remat
    >>> from remat._scope import observe_saved_tensors
    >>> events = []
    >>> x = torch.randn(3, requires_grad=True)
    >>> with observe_saved_tensors(lambda event, t: events.append(event)):
    ...     y = remat.checkpoint(torch.sin, x)
    >>> events
    ['region_saved']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from typing import Any, Literal, Protocol

import torch

from remat._compat.autograd import pop_saved_tensor_hooks, push_saved_tensor_hooks
from remat._compat.dispatch import dispatch_modes_on_stack
from remat.errors import CheckpointTypeError

__all__ = [
    "COMPILED_GRAPH_RAN",
    "INSIDE_REGION",
    "METERS_POLICY_OPS",
    "SAVING_REGION_INPUTS",
    "Nested",
    "OpObserver",
    "RegionHooks",
    "SavedTensorEvent",
    "SavedTensorObserver",
    "current_observer",
    "in_region",
    "observe_saved_tensors",
    "policy_op_meter",
]

INSIDE_REGION: ContextVar[bool] = ContextVar("remat_inside_region", default=False)
"""True while a region's hooks are active (:class:`RegionHooks` and the engine's
recomputation set it)."""


def in_region() -> bool:
    """True inside a remat region's forward or recomputation."""
    return INSIDE_REGION.get()


SAVING_REGION_INPUTS: ContextVar[bool] = ContextVar("remat_saving_region_inputs", default=False)
"""True while a region saves its inputs through autograd (``Frame.save_inputs``):
the tensors an enclosing context packs then are a region's inputs, which a
``remat.compress`` context keeps exact (a recomputation from approximate
inputs happens only where a region asks for it: ``compress_inputs``)."""


class RegionHooks:
    """Saved-tensor hooks of a region; while active, :func:`in_region` is True.

    A subclass defines ``pack`` and ``unpack`` as methods and keeps their state
    in its slots. Entering pushes the bound methods directly
    (:func:`remat._compat.autograd.push_saved_tensor_hooks`), as
    ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` would. The
    methods are bound at entry, never stored on the object: a stored bound
    method would make a cycle that only the garbage collector frees, and every
    saved tensor keeps the unpack hook until backward
    (docs/design/performance.md, "Objects a region keeps").
    """

    __slots__ = ("_token",)
    _token: Token[bool] | None  # a subclass's __init__ sets it to None

    def pack(self, tensor: torch.Tensor) -> Any:
        raise NotImplementedError

    def unpack(self, packed: Any) -> torch.Tensor:
        raise NotImplementedError

    def __enter__(self) -> None:
        push_saved_tensor_hooks(self.pack, self.unpack)
        self._token = INSIDE_REGION.set(True)

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            INSIDE_REGION.reset(self._token)
            self._token = None
        pop_saved_tensor_hooks()


class Nested:
    """Context managers entered in order and exited in reverse, as one.

    What ``contextlib.ExitStack`` does for a fixed tuple, at a fraction of its
    cost: a selective region enters its dispatch mode around its hooks in
    every forward and recomputation (docs/design/performance.md). An exception
    a context suppresses is gone for the contexts outside it; one raised by an
    ``__exit__`` replaces the one in flight (chained to it), as in nested
    ``with`` statements. ``__exit__`` returns True when an exception was
    suppressed.

    Example:
        >>> import contextlib
        >>> with Nested((contextlib.nullcontext(), contextlib.suppress(KeyError))):
        ...     raise KeyError("gone")
    """

    __slots__ = ("_contexts", "_entered")

    def __init__(self, contexts: tuple[AbstractContextManager[Any], ...]) -> None:
        self._contexts = contexts
        self._entered = 0

    def __enter__(self) -> None:
        try:
            for context in self._contexts:
                context.__enter__()
                self._entered += 1
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)
            raise

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> bool:
        entered, self._entered = self._entered, 0
        original = exc
        for context in reversed(self._contexts[:entered]):
            try:
                if context.__exit__(kind, exc, traceback):
                    kind = exc = traceback = None
            except BaseException as error:
                if error is not exc and error.__context__ is None:
                    error.__context__ = exc
                kind, exc, traceback = type(error), error, error.__traceback__
        if exc is not None and exc is not original:
            raise exc
        return original is not None and exc is None


SavedTensorEvent = Literal[
    "region_saved", "policy_saved", "policy_offloaded", "offloaded", "policy_compressed", "compressed"
]
SavedTensorObserver = Callable[[SavedTensorEvent, torch.Tensor], None]

_observer: ContextVar[SavedTensorObserver | None] = ContextVar("remat_saved_tensor_observer", default=None)


def current_observer() -> SavedTensorObserver | None:
    """The callback regions entered now should report to, if any."""
    return _observer.get()


@contextlib.contextmanager
def observe_saved_tensors(callback: SavedTensorObserver) -> Iterator[None]:
    """Report saved-tensor events of regions entered inside the block to ``callback``."""
    if not callable(callback):
        raise CheckpointTypeError(
            f"observe_saved_tensors: callback must be callable as callback(event, tensor), "
            f"got {type(callback).__name__}"
        )
    token = _observer.set(callback)
    try:
        yield
    finally:
        _observer.reset(token)


class OpObserver(Protocol):
    """Told of every op a memory tracker's dispatch mode sees, after it ran (a fake
    tensor's ``tensor.device()`` excepted): ``op_ran(func, args, kwargs, out)``.

    What a mode of its own directly above the tracker would see, without a second mode
    on the stack that every op passes through (the planner's modelled clock,
    ``remat.planner.timing.ModelledClock``; a dispatch mode costs a simulated op about a
    tenth of its time). A tracker's mode also answers for the observer's
    :data:`METERS_POLICY_OPS` and ``compiled_graph_ran`` methods, where it has them.
    """

    def op_ran(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None: ...


PolicyOpMeter = Callable[[Any], None]
"""Called with the op, once for every op a selective policy's dispatch mode handles (see
:func:`policy_op_meter`)."""

METERS_POLICY_OPS = "meter_policy_op"
"""The method a dispatch mode defines to be told of every op a selective policy's mode
handles while the mode is on the stack: :class:`remat.planner.timing.ModelledClock`
charges that mode's Python cost per op, which no kernel it sees carries (and an op the
recomputation replays from the cache runs no kernel at all)."""


COMPILED_GRAPH_RAN = "compiled_graph_ran"
"""The method a dispatch mode defines to take a statically compiled graph whole
(``compiled_graph_ran(graph, realized)``, ``remat.memory._compiled``) rather than see
its ops: the modelled clock costs it kernel by kernel."""


def policy_op_meter() -> PolicyOpMeter | None:
    """The ``meter_policy_op`` method of a dispatch mode on the stack that defines one,
    else None.

    A selective region's dispatch modes (``remat._engine.selective``) ask once when
    entered, for its forward and for each recomputation, and call the meter for every
    op they handle. The mode stack, not a context variable, carries it: a
    recomputation may run on autograd's device thread, which inherits the dispatch
    modes of the backward's caller but not its context variables.
    """
    for mode in dispatch_modes_on_stack():
        meter = getattr(mode, METERS_POLICY_OPS, None)
        if meter is not None:
            return meter  # type: ignore[no-any-return]
    return None
