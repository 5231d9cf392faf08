"""The windows of one profiled training step, and the live bytes of each.

A step is cut into windows at the candidate regions' boundaries: each
region's forward, the suffix (the rest of the model and the loss), each
region's backward, the prefix's backward. Forward hooks mark the forward
boundaries; identity autograd functions on a region's input and output mark
its backward's end and start. With a :class:`~remat.memory.MemoryTracker`,
each boundary is a :meth:`~remat.memory.MemoryTracker.mark` on its timeline,
and once the step is over each window's live bytes (start, end, highest) are
read off the tracker's read-only :class:`~remat.memory.Timeline`
(:func:`window_bytes`). A compiled step is measured the same way with an
:class:`~remat.memory.AllocationMeter` (the allocator's count, inductor's
buffers included), and a region whose call is compiled gets its markers
around the compiled call instead of as hooks, which would be traced into it. These windows are the planner's; the tracker's own
phases (``forward``, ``backward``, ...) are coarser (``docs/design/memory.md``).

Tensors made before the first region and passed to several regions (a
padding mask, rotary tables, position ids) are *shared inputs*: which
regions keep them alive depends on each region's option, so they are taken
out of every window's bytes here and modelled on their own
(``docs/design/planner.md``, "Shared inputs").

Example:
    >>> import torch
    >>> from remat.memory import track
    >>> from remat.planner.phases import StepRecorder, instrumented
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    >>> regions = list(model.named_children())
    >>> with track() as tracker:
    ...     recorder = StepRecorder(2, tracker=tracker)
    ...     with instrumented(regions, recorder):
    ...         loss = model(torch.randn(4, 8)).sum()
    ...         recorder.loss_done()
    ...         loss.backward()
    ...         recorder.finish()
    >>> recorder.measure()
    >>> recorder.order, recorder.forward[1].end_bytes > recorder.forward[1].start_bytes
    ([0, 1], True)
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from remat._compat.autograd import current_backward_id
from remat._compat.modules import compiled_call, set_compiled_call
from remat._compat.pytree import tree_flatten, tree_unflatten
from remat.errors import UnsupportedCheckpointError
from remat.memory import StorageLifetime, Timeline

__all__ = ["Meter", "StepRecorder", "Window", "instrumented", "window_bytes"]


class Meter(Protocol):
    """What counts a profiled step's bytes: :class:`~remat.memory.MemoryTracker`
    (eager steps) or :class:`~remat.memory.AllocationMeter` (compiled ones)."""

    def mark(self, name: str) -> None: ...

    def storage_index(self, tensor: Tensor) -> int | None: ...

    def timeline(self) -> Timeline: ...

_MARK = "remat.planner:"


def window_bytes(
    timeline: Timeline, start: int, end: int, excluding: Collection[StorageLifetime] = ()
) -> tuple[int, int, int]:
    """Live bytes right after timeline events ``start`` and ``end - 1``, and the largest between.

    Each value leaves out the storages of ``excluding`` that were live at
    that event: what the window would have looked like without them (the
    shared inputs, modelled on their own).

    Example:
        >>> import torch
        >>> from remat.memory import track
        >>> with track() as t:
        ...     shared = torch.zeros(1024)      # 4096 bytes
        ...     t.mark("window")
        ...     x = torch.zeros(512)            # 2048 bytes
        ...     del shared, x
        ...     t.mark("end")
        >>> timeline = t.timeline()
        >>> start, end = (index for _, index in timeline.marks)
        >>> window_bytes(timeline, start + 1, end), window_bytes(
        ...     timeline, start + 1, end, excluding=[timeline.storages[0]])
        ((6144, 0, 6144), (2048, 0, 2048))
    """
    assert 0 <= start < end <= len(timeline.live_bytes), f"remat bug: window [{start}, {end})"
    values = list(timeline.live_bytes[start:end])
    for storage in excluding:
        first = max(storage.created, start)
        last = end if storage.freed is None else min(storage.freed, end)
        for index in range(first, last):
            values[index - start] -= storage.nbytes
    return values[0], values[-1], max(values)


@dataclass(eq=False)
class Window:
    """Live bytes at the start and end of a stretch of the step, its highest point, its wall time.

    Byte counts leave the shared inputs out (see the module docstring).
    ``high_after_input_free`` is set for a region's backward that freed its
    input (the previous region's output): its highest point from that free on.
    ``start_index`` and ``end_index`` (exclusive) are its events on the
    tracker's timeline, known once the step is over.
    """

    start_bytes: int = 0
    end_bytes: int = 0
    high_bytes: int = 0
    high_after_input_free: int | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    start_index: int = 0
    end_index: int = 0

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass
class StepRecorder:
    """Window boundaries of one step; memory only when a tracker is attached.

    Attributes:
        regions: number of candidate regions.
        tracker: the meter counting this step, or None for a timed step.
        sync: called before every clock reading (a CUDA synchronize).
        clock: seconds now: the wall clock, or a time model's
            (:class:`~remat.planner.timing.ModelledClock` for a step on fake tensors).
        order: regions in the order their forwards ran.
        released: per region, in whose backward its output was freed:
            ``"own"``, ``"next"`` or ``"other"``.
        shared: the shared inputs alive when the last region's forward
            ended, in the order they were made: ``(regions that took it,
            bytes, kept until a region's backward)``; the others died with
            the model's forward.
        suffix_high: highest point of the suffix (after the last region's
            forward, before its backward); only up to the return of the
            model's forward when that moment was reported.
        suffix_after_model_high: highest point of the suffix after the model's
            forward returned (None when that moment was not reported).
    """

    regions: int
    tracker: Meter | None = None
    sync: Callable[[], None] | None = None
    clock: Callable[[], float] = time.perf_counter
    forward: list[Window] = field(default_factory=list)
    backward: list[Window] = field(default_factory=list)
    suffix_forward: Window = field(default_factory=Window)
    suffix_backward: Window = field(default_factory=Window)
    prefix_backward: Window = field(default_factory=Window)
    order: list[int] = field(default_factory=list)
    released: dict[int, str] = field(default_factory=dict)
    shared: list[tuple[tuple[int, ...], int, bool]] = field(default_factory=list)
    suffix_high: int = 0
    suffix_after_model_high: int | None = None
    step_start_s: float = 0.0
    step_end_s: float = 0.0

    def __post_init__(self) -> None:
        self.forward = [Window() for _ in range(self.regions)]
        self.backward = [Window() for _ in range(self.regions)]
        self._current: Window | None = None
        self._watches: list[weakref.finalize[Any, Any]] = []
        # Storages (their index on the tracker's timeline) of each region's
        # output, and the regions that took each storage as an input.
        self._outputs: dict[int, list[int]] = {}
        self._inputs: dict[int, set[int]] = {}
        # Boundaries marked on the timeline, in order: the mark named
        # f"{_MARK}{i}" is the i-th; its event index is filled in at the end.
        self._boundaries: list[tuple[Window | None, Literal["start", "end", "model"]]] = []
        self._model_end_index: int | None = None

    # -- what the hooks report -------------------------------------------------

    def watch_inputs(self, index: int, value: Any) -> None:
        """Note the counted storages region ``index`` takes as inputs."""
        if self.tracker is None:
            return
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, Tensor):
                storage = self.tracker.storage_index(leaf)
                if storage is not None:
                    self._inputs.setdefault(storage, set()).add(index)

    def watch_output(self, index: int, value: Any) -> None:
        """Note in whose backward the storages of region ``index``'s output are freed."""
        if self.tracker is None:
            return
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, Tensor):
                self._watches.append(weakref.finalize(leaf.untyped_storage(), self._released, index))
                storage = self.tracker.storage_index(leaf)
                if storage is not None:
                    self._outputs.setdefault(index, []).append(storage)

    def _released(self, index: int) -> None:
        current = self._current
        if current is self.backward[index]:
            self.released[index] = "own"
        elif index + 1 < self.regions and current is self.backward[index + 1]:
            self.released[index] = "next"
        else:
            self.released.setdefault(index, "other")

    def forward_start(self, index: int) -> None:
        self.order.append(index)
        self._open(self.forward[index])

    def forward_end(self, index: int) -> None:
        self._close()
        if index == self.regions - 1:
            self._open(self.suffix_forward)

    def model_done(self) -> None:
        """The model's forward returned; the loss is next."""
        if self._current is self.suffix_forward:
            self._boundary(None, "model")

    def loss_done(self) -> None:
        self._close()
        self._open(self.suffix_backward)

    def backward_start(self, index: int) -> None:
        self._open(self.backward[index])

    def backward_end(self, index: int) -> None:
        self._close()
        if index == 0:
            self._open(self.prefix_backward)

    def start(self) -> None:
        """The step starts (its clock)."""
        self.step_start_s = self._now()

    def finish(self) -> None:
        """End the step: close the open window, stop its clock."""
        self._close()
        for watch in self._watches:
            watch.detach()  # frees after the step say nothing about it
        self.step_end_s = self._now()

    def measure(self) -> None:
        """Read every window's bytes off the meter's timeline, once the meter's block has ended."""
        if self.tracker is not None:
            self._measure(self.tracker.timeline())

    # -- clock and timeline ----------------------------------------------------

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return self.clock()

    def _boundary(self, window: Window | None, side: Literal["start", "end", "model"]) -> None:
        """Mark a boundary on the tracker's timeline (where it falls is read at the end)."""
        if self.tracker is not None:
            self.tracker.mark(f"{_MARK}{len(self._boundaries)}")
            self._boundaries.append((window, side))

    def _open(self, window: Window) -> None:
        self._close()
        self._boundary(window, "start")
        window.start_s = self._now()
        self._current = window

    def _close(self) -> None:
        window, self._current = self._current, None
        if window is None:
            return
        window.end_s = self._now()
        self._boundary(window, "end")

    def _place_boundaries(self, timeline: Timeline) -> None:
        """Each window's events: from its start mark, up to (not including) its end mark.

        The mark that reports the model's forward returned is not part of the
        suffix after it: that starts with the next event.
        """
        at = dict(timeline.marks)
        for number, (window, side) in enumerate(self._boundaries):
            index = at[f"{_MARK}{number}"]
            if window is None:
                self._model_end_index = index + 1
            elif side == "start":
                window.start_index = index
            else:
                window.end_index = index

    def _measure(self, timeline: Timeline) -> None:
        self._place_boundaries(timeline)
        found = self._shared_inputs(timeline)
        self.shared = [(takers, storage.nbytes, held) for storage, takers, held in found]
        shared = [storage for storage, _, _ in found]
        every = (*self.forward, *self.backward)
        for window in (*every, self.suffix_forward, self.suffix_backward, self.prefix_backward):
            if window.end_index > window.start_index:  # windows that never opened keep zeros
                window.start_bytes, window.end_bytes, window.high_bytes = window_bytes(
                    timeline, window.start_index, window.end_index, shared
                )
        for index, window in enumerate(self.backward):
            window.high_after_input_free = self._high_after_input_free(index, timeline, shared)
        # The suffix: split where the model's forward returned, when known.
        self.suffix_high = max(self.suffix_forward.high_bytes, self.suffix_backward.high_bytes)
        start, split = self.suffix_forward.start_index, self._model_end_index
        end = max(self.suffix_forward.end_index, self.suffix_backward.end_index)
        if split is not None and start < split < end:
            self.suffix_high = window_bytes(timeline, start, split, shared)[2]
            self.suffix_after_model_high = window_bytes(timeline, split, end, shared)[2]

    def _shared_inputs(
        self, timeline: Timeline
    ) -> list[tuple[StorageLifetime, tuple[int, ...], bool]]:
        """The shared inputs in the order they were made: ``(storage, takers, held)``.

        Made before the first region, taken by two regions or more, alive
        when the last region's forward ended and freed in a region's
        backward (held) or in the suffix (the model's forward let go).
        Anything else stays in the windows' bytes as it was measured.
        """
        if not self.regions or self.forward[0].end_index == 0:
            return []
        first, last = self.forward[0].start_index, self.forward[-1].end_index

        def freed_in(windows: Sequence[Window], index: int) -> bool:
            return any(w.start_index <= index < w.end_index for w in windows)

        found = []
        for storage_index, takers in self._inputs.items():
            storage = timeline.storages[storage_index]
            if storage is None:  # allocated before the step: not counted
                continue
            freed = storage.freed
            if len(takers) < 2 or storage.created >= first or freed is None or freed < last:
                continue
            held = freed_in(self.backward, freed)
            if held or freed_in((self.suffix_forward, self.suffix_backward), freed):
                found.append((storage, tuple(sorted(takers)), held))
        return sorted(found, key=lambda entry: entry[0].created)

    def _high_after_input_free(
        self, index: int, timeline: Timeline, shared: list[StorageLifetime]
    ) -> int | None:
        """Highest point of region ``index``'s backward from the free of its input on.

        Mixed with a previous region that holds that tensor itself, the
        tensor outlives this backward: what ran after its free then runs with
        it still alive. Several output storages: from the earliest free (an
        upper bound).
        """
        window = self.backward[index]
        if index == 0 or self.released.get(index - 1) != "next":
            return None
        outputs = [timeline.storages[storage] for storage in self._outputs.get(index - 1, [])]
        frees = [storage.freed for storage in outputs if storage is not None]
        highs = [
            window_bytes(timeline, freed, window.end_index, shared)[2]
            for freed in frees
            if freed is not None and window.start_index <= freed < window.end_index
        ]
        return max(highs) if highs else None


class _Boundary(torch.autograd.Function):
    """Identity on tensors whose backward reports that gradients reached this point."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.callback = callback
        ctx.set_materialize_grads(False)  # no zero tensors for outputs without gradients
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.callback()
        return (None, *grads)


def _mark(value: Any, callback: Callable[[], None]) -> tuple[Any, bool]:
    """``value`` with its grad-requiring tensors passed through a boundary."""
    leaves, spec = tree_flatten(value)
    slots = [
        i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and leaf.requires_grad
    ]
    if not slots:
        return value, False
    marked = _Boundary.apply(callback, *(leaves[i] for i in slots))  # type: ignore[no-untyped-call]
    for slot, tensor in zip(slots, marked, strict=True):
        leaves[slot] = tensor
    return tree_unflatten(leaves, spec), True


@contextlib.contextmanager
def instrumented(
    regions: Sequence[tuple[str, nn.Module]], recorder: StepRecorder
) -> Iterator[list[bool]]:
    """Hooks on every region that report its phases to ``recorder``.

    Yields, per region, whether its input carried gradients (else its backward
    end is the end of the step).
    """
    handles: list[Any] = []
    input_marked = [False] * len(regions)

    for index, (_, module) in enumerate(regions):

        def before(
            module: nn.Module, args: Any, kwargs: dict[str, Any], index: int = index
        ) -> Any:
            if current_backward_id() >= 0:
                return None  # a checkpoint recomputing the region: not a new call
            recorder.forward_start(index)
            recorder.watch_inputs(index, (args, kwargs))
            marked, input_marked[index] = _mark(args, lambda: recorder.backward_end(index))
            return marked, kwargs

        def after(module: nn.Module, args: Any, output: Any, index: int = index) -> Any:
            if current_backward_id() >= 0:
                return None
            recorder.watch_output(index, output)
            marked, has_grad = _mark(output, lambda: recorder.backward_start(index))
            recorder.forward_end(index)
            if not has_grad:
                raise UnsupportedCheckpointError(
                    f"remat.planner: the output of region {regions[index][0]!r} does not "
                    "require grad; the planner plans regions that backward runs through. "
                    "Leave frozen parts out of candidates."
                )
            return marked

        compiled = compiled_call(module)
        if compiled is not None:
            # A compiled region: hooks would run inside the compiled call
            # (traced into its graph); the markers go around it instead.
            handles.append(_Around(module, compiled, before, after))
            continue
        # First of the pre-hooks, so the input boundary sits outside a
        # checkpoint_module region; last of the forward hooks, for the output.
        handles.append(module.register_forward_pre_hook(before, prepend=True, with_kwargs=True))
        handles.append(module.register_forward_hook(after))
    try:
        yield input_marked
    finally:
        for handle in handles:
            handle.remove()


class _Around:
    """Runs a region's pre-hook and forward hook around its compiled call, until removed."""

    def __init__(
        self,
        module: nn.Module,
        compiled: Callable[..., Any],
        before: Callable[..., Any],
        after: Callable[..., Any],
    ) -> None:
        self._module, self._compiled = module, compiled
        self._before, self._after = before, after
        set_compiled_call(module, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        changed = self._before(self._module, args, kwargs)
        if changed is not None:
            args, kwargs = changed
        output = self._compiled(*args, **kwargs)
        replaced = self._after(self._module, args, output)
        return output if replaced is None else replaced

    def remove(self) -> None:
        set_compiled_call(self._module, self._compiled)
