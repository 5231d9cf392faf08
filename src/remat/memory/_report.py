"""What a :class:`~remat.memory.MemoryTracker` measured, as plain data.

Units are in the field names (``*_bytes``). Categories and phases are
defined in ``docs/design/memory.md`` ("Categories", "Phases").

Example:
    >>> from remat.memory import Usage
    >>> Usage("blocks.0", at_peak_bytes=4096, at_forward_end_bytes=4096,
    ...       at_end_bytes=0, allocated_bytes=8192).at_peak_bytes
    4096
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from remat.errors import CheckpointKeyError

__all__ = [
    "CATEGORIES",
    "OUTSIDE_MODULES",
    "Category",
    "EventKind",
    "MemoryReport",
    "Phase",
    "StorageLifetime",
    "Timeline",
    "TimelineEvent",
    "Usage",
]

Category = Literal[
    "parameter",
    "unsharded_parameter",
    "gradient",
    "optimizer_state",
    "activation",
    "communication",
    "temporary",
]
CATEGORIES: tuple[Category, ...] = get_args(Category)
"""Every category, in the order reports list them."""

Phase = Literal["forward", "backward", "optimizer", "other"]

EventKind = Literal["start", "alloc", "free", "resize", "phase", "enter", "exit", "backward_enter", "mark"]
"""``alloc``/``free``/``resize`` change live bytes; the others are markers:
``phase`` (a new phase starts), ``enter``/``exit`` (a module's forward),
``backward_enter`` (the gradient of a module's output arrived), ``mark``."""

OUTSIDE_MODULES = "(outside modules)"
"""Module path of memory made while no module of the tracked model was running."""


@dataclass(frozen=True)
class TimelineEvent:
    """One point of a tracked block's timeline.

    Attributes:
        index: position in the timeline (0 is the start).
        kind: what happened (see :data:`EventKind`).
        name: the op for ``alloc``/``free``/``resize`` (e.g. ``aten.mm.default``),
            the module path for ``enter``/``exit``/``backward_enter``, the
            phase for ``phase``, the mark's name for ``mark``.
        live_bytes: live bytes right after the event.
        delta_bytes: change of live bytes made by the event.
        phase: the phase the event happened in.
        module: module path the memory is attributed to (``alloc``/``free``).
    """

    index: int
    kind: EventKind
    name: str
    live_bytes: int
    delta_bytes: int
    phase: Phase
    module: str


@dataclass(frozen=True)
class StorageLifetime:
    """One storage a tracker counted: its bytes, and the timeline events that made and freed it.

    Attributes:
        nbytes: its size (the latest, for a storage resized in place).
        created: index of the event that counted it.
        freed: index of the event that freed it; None while it was live when
            the timeline was read (or when the tracked block ended).
    """

    nbytes: int
    created: int
    freed: int | None


@dataclass(frozen=True)
class Timeline:
    """A tracker's timeline as immutable values (:meth:`MemoryTracker.timeline`).

    Lighter than :attr:`MemoryReport.timeline`: numbers only, for tools that
    measure stretches of it (the planner reads its phases' bytes this way).

    Attributes:
        live_bytes: live bytes right after each event (the index is the event's).
        marks: ``(name, event index)`` of every :meth:`MemoryTracker.mark`, in order.
        storages: every counted storage, in order of creation;
            :meth:`MemoryTracker.storage_index` gives a live tensor's position.
            An allocation meter (:func:`remat.memory.track_allocations`) lists
            the storages it was asked about instead, in the order asked, with
            None for one allocated before its block.

    Example:
        >>> import torch
        >>> from remat.memory import track
        >>> with track() as t:
        ...     t.mark("start")
        ...     x = torch.zeros(256)                # 1024 bytes
        ...     where = t.storage_index(x)
        ...     del x
        >>> timeline = t.timeline()
        >>> timeline.marks, timeline.storages[where], timeline.live_bytes
        ((('start', 1),), StorageLifetime(nbytes=1024, created=2, freed=3), (0, 0, 1024, 0))
    """

    live_bytes: tuple[int, ...]
    marks: tuple[tuple[str, int], ...]
    storages: tuple[StorageLifetime | None, ...]


@dataclass(frozen=True)
class Usage:
    """Bytes of one module path or one category at the moments that matter.

    Attributes:
        name: the module path (``""`` is the tracked model itself) or category.
        at_peak_bytes: its live bytes when the block's live bytes peaked.
        at_forward_end_bytes: its live bytes at the end of the forward.
        at_end_bytes: its live bytes when the block ended.
        allocated_bytes: bytes of all storages it created inside the block,
            freed or not (storages that existed before the block count 0).
    """

    name: str
    at_peak_bytes: int
    at_forward_end_bytes: int
    at_end_bytes: int
    allocated_bytes: int


@dataclass(frozen=True)
class MemoryReport:
    """Everything a tracked block measured.

    Attributes:
        peak_bytes: the largest live byte count (includes ``start_bytes``).
        forward_end_bytes: live bytes at the end of the forward (see
            ``docs/design/memory.md``, "End of forward").
        end_bytes: live bytes when the block ended.
        start_bytes: bytes counted from the start: the tracked model's
            parameters, buffers and gradients and the optimizer's state.
        peak_bytes_by_device: the peak of each device's own live bytes, e.g.
            ``{"cuda:0": ..., "cpu": ...}``: on an accelerator, offloaded
            tensors leave its entry. Offload's host copies are remat's own
            work, which no dispatch mode sees (this tracker included), so
            they are not counted (``docs/design/offload.md``).
        peak_index: timeline index of the event that reached the peak.
        forward_end_index: timeline index at the end of the forward.
        timeline: every event, in order.
        by_category: one :class:`Usage` per category, in :data:`CATEGORIES` order.
        by_module: one :class:`Usage` per module path that holds or made
            memory, largest at the peak first.
        rank: this process's rank when a process group was initialized
            (under ``torch.distributed``), else None.
        world_size: the number of ranks when a process group was
            initialized, else None.

    Example:
        >>> import torch
        >>> from remat.memory import track
        >>> with track() as t:
        ...     x = torch.ones(1024)
        >>> report = t.report()
        >>> report.peak_bytes, report.category("activation").at_peak_bytes
        (4096, 4096)
    """

    peak_bytes: int
    forward_end_bytes: int
    end_bytes: int
    start_bytes: int
    peak_bytes_by_device: Mapping[str, int]
    peak_index: int
    forward_end_index: int
    timeline: tuple[TimelineEvent, ...]
    by_category: tuple[Usage, ...]
    by_module: tuple[Usage, ...]
    rank: int | None = None
    world_size: int | None = None

    def category(self, name: Category) -> Usage:
        """The :class:`Usage` of one category."""
        for usage in self.by_category:
            if usage.name == name:
                return usage
        raise CheckpointKeyError(f"unknown category {name!r}; expected one of {list(CATEGORIES)}")

    def module(self, path: str) -> Usage:
        """The :class:`Usage` of one module path (all zeros if it made nothing)."""
        for usage in self.by_module:
            if usage.name == path:
                return usage
        return Usage(path, 0, 0, 0, 0)
