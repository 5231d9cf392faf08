"""The phases of one profiled training step, and the live bytes of each.

A step is cut into phases at the candidate regions' boundaries: each
region's forward, the suffix (the rest of the model and the loss), each
region's backward, the prefix's backward. Forward hooks mark the forward
boundaries; identity autograd functions on a region's input and output mark
its backward's end and start. With a :class:`~remat.memory.MemoryTracker`,
each phase's live bytes (start, end, highest) are read off the tracker's
timeline once the step is over.

Tensors made before the first region and passed to several regions (a
padding mask, rotary tables, position ids) are *shared inputs*: which
regions keep them alive depends on each region's option, so they are taken
out of every phase's bytes here and modelled on their own
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
    >>> recorder.order, recorder.forward[1].end_bytes > recorder.forward[1].start_bytes
    ([0, 1], True)
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from remat._compat import current_backward_id, tree_flatten, tree_unflatten
from remat.errors import UnsupportedCheckpointError
from remat.memory import MemoryTracker
from remat.memory._tracker import StorageRecord

__all__ = ["Phase", "StepRecorder", "instrumented"]

_PHASE_MARK = "remat.planner:phase"


@dataclass(eq=False)
class Phase:
    """Live bytes at the start and end of a phase, its highest point, its wall time.

    Byte counts leave the shared inputs out (see the module docstring).
    ``high_after_input_free`` is set for a region's backward that freed its
    input (the previous region's output): its highest point from that free on.
    """

    start_bytes: int = 0
    end_bytes: int = 0
    high_bytes: int = 0
    high_after_input_free: int | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    start_index: int = 0  # timeline positions: the phase's mark, and the end (exclusive)
    end_index: int = 0

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass
class StepRecorder:
    """Phase boundaries of one step; memory only when a tracker is attached.

    Attributes:
        regions: number of candidate regions.
        tracker: the tracker counting this step, or None for a timed step.
        sync: called before every clock reading (a CUDA synchronize).
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
    tracker: MemoryTracker | None = None
    sync: Callable[[], None] | None = None
    forward: list[Phase] = field(default_factory=list)
    backward: list[Phase] = field(default_factory=list)
    suffix_forward: Phase = field(default_factory=Phase)
    suffix_backward: Phase = field(default_factory=Phase)
    prefix_backward: Phase = field(default_factory=Phase)
    order: list[int] = field(default_factory=list)
    released: dict[int, str] = field(default_factory=dict)
    shared: list[tuple[tuple[int, ...], int, bool]] = field(default_factory=list)
    suffix_high: int = 0
    suffix_after_model_high: int | None = None
    step_start_s: float = 0.0
    step_end_s: float = 0.0

    def __post_init__(self) -> None:
        self.forward = [Phase() for _ in range(self.regions)]
        self.backward = [Phase() for _ in range(self.regions)]
        self._current: Phase | None = None
        self._watches: list[weakref.finalize[Any, Any]] = []
        self._outputs: dict[int, list[StorageRecord]] = {}
        # id(record) -> (record, regions that took it as an input)
        self._inputs: dict[int, tuple[StorageRecord, set[int]]] = {}
        self._model_end_index: int | None = None

    # -- what the hooks report -------------------------------------------------

    def watch_inputs(self, index: int, value: Any) -> None:
        """Note the counted storages region ``index`` takes as inputs."""
        if self.tracker is None:
            return
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, Tensor):
                record = self.tracker.record_of(leaf)
                if record is not None:
                    self._inputs.setdefault(id(record), (record, set()))[1].add(index)

    def watch_output(self, index: int, value: Any) -> None:
        """Note in whose backward the storages of region ``index``'s output are freed."""
        if self.tracker is None:
            return
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, Tensor):
                self._watches.append(weakref.finalize(leaf.untyped_storage(), self._released, index))
                record = self.tracker.record_of(leaf)
                if record is not None:
                    self._outputs.setdefault(index, []).append(record)

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
        if self.tracker is not None and self._current is self.suffix_forward:
            self._model_end_index = self.tracker.position

    def loss_done(self) -> None:
        self._close()
        self._open(self.suffix_backward)

    def backward_start(self, index: int) -> None:
        self._open(self.backward[index])

    def backward_end(self, index: int) -> None:
        self._close()
        if index == 0:
            self._open(self.prefix_backward)

    def finish(self) -> None:
        """End the step: close the open phase, then read every phase's bytes."""
        self._close()
        for watch in self._watches:
            watch.detach()  # frees after the step say nothing about it
        if self.tracker is not None:
            self._measure(self.tracker)

    # -- clock and timeline ----------------------------------------------------

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def _open(self, phase: Phase) -> None:
        self._close()
        if self.tracker is not None:
            self.tracker.mark(_PHASE_MARK)
            phase.start_index = self.tracker.position - 1
        phase.start_s = self._now()
        self._current = phase

    def _close(self) -> None:
        phase, self._current = self._current, None
        if phase is None:
            return
        phase.end_s = self._now()
        if self.tracker is not None:
            phase.end_index = self.tracker.position

    def _measure(self, tracker: MemoryTracker) -> None:
        found = self._shared_inputs()
        self.shared = [(takers, record.nbytes, held) for record, takers, held in found]
        shared = [record for record, _, _ in found]
        every = (*self.forward, *self.backward)
        for phase in (*every, self.suffix_forward, self.suffix_backward, self.prefix_backward):
            if phase.end_index > phase.start_index:  # phases that never opened keep zeros
                phase.start_bytes, phase.end_bytes, phase.high_bytes = tracker.live_between(
                    phase.start_index, phase.end_index, excluding=shared
                )
        for index, phase in enumerate(self.backward):
            phase.high_after_input_free = self._high_after_input_free(index, shared)
        # The suffix: split where the model's forward returned, when known.
        self.suffix_high = max(self.suffix_forward.high_bytes, self.suffix_backward.high_bytes)
        start, split = self.suffix_forward.start_index, self._model_end_index
        end = max(self.suffix_forward.end_index, self.suffix_backward.end_index)
        if split is not None and start < split < end:
            self.suffix_high = tracker.live_between(start, split, excluding=shared)[2]
            self.suffix_after_model_high = tracker.live_between(split, end, excluding=shared)[2]

    def _shared_inputs(self) -> list[tuple[StorageRecord, tuple[int, ...], bool]]:
        """The shared inputs in the order they were made: ``(record, takers, held)``.

        Made before the first region, taken by two regions or more, alive
        when the last region's forward ended and freed in a region's
        backward (held) or in the suffix (the model's forward let go).
        Anything else stays in the phases' bytes as it was measured.
        """
        if not self.regions or self.forward[0].end_index == 0:
            return []
        first, last = self.forward[0].start_index, self.forward[-1].end_index

        def freed_in(phases: Sequence[Phase], index: int) -> bool:
            return any(p.start_index <= index < p.end_index for p in phases)

        found = []
        for record, takers in self._inputs.values():
            freed = record.freed
            if len(takers) < 2 or record.created >= first or freed is None or freed < last:
                continue
            held = freed_in(self.backward, freed)
            if held or freed_in((self.suffix_forward, self.suffix_backward), freed):
                found.append((record, tuple(sorted(takers)), held))
        return sorted(found, key=lambda entry: entry[0].created)

    def _high_after_input_free(self, index: int, shared: list[StorageRecord]) -> int | None:
        """Highest point of region ``index``'s backward from the free of its input on.

        Mixed with a previous region that holds that tensor itself, the
        tensor outlives this backward: what ran after its free then runs with
        it still alive. Several output storages: from the earliest free (an
        upper bound).
        """
        phase = self.backward[index]
        if index == 0 or self.released.get(index - 1) != "next" or self.tracker is None:
            return None
        highs = [
            self.tracker.live_between(record.freed, phase.end_index, excluding=shared)[2]
            for record in self._outputs.get(index - 1, [])
            if record.freed is not None and phase.start_index <= record.freed < phase.end_index
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
    handles = []
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

        # First of the pre-hooks, so the input boundary sits outside a
        # checkpoint_module region; last of the forward hooks, for the output.
        handles.append(module.register_forward_pre_hook(before, prepend=True, with_kwargs=True))
        handles.append(module.register_forward_hook(after))
    try:
        yield input_marked
    finally:
        for handle in handles:
            handle.remove()
