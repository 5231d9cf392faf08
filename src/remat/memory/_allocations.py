"""Live bytes as the allocator counts them: compiled code included.

:func:`remat.memory.track` sees every tensor an aten op returns to Python,
through a dispatch mode. Code that torch.compile made runs its kernels
without the dispatcher: inductor allocates its buffers (the activations a
compiled forward saves for backward among them) straight from the
allocator, and a dispatch mode never sees them. An :class:`AllocationMeter`
counts what the allocator hands out instead: every allocation and free that
torch's profiler records with ``profile_memory=True``, on every device.

It counts what is allocated inside the block, as :func:`track` does:
memory allocated before it (parameters, data) is not counted, and neither
are its frees. Marks split the block into stretches, and
:meth:`AllocationMeter.storage_index` tells which allocation holds a live
tensor, so the planner's windows (``remat.planner.phases``) read a
compiled step the way they read an eager one. The meter's timeline has an
event per allocation, free and mark; where the dispatch tracker counts a
storage once per tensor, this one counts allocator blocks (on CUDA, the
caching allocator's rounded sizes). What it sees and how it was checked:
``docs/design/memory.md`` ("Compiled code").

Example:
    >>> import torch
    >>> from remat.memory import track_allocations
    >>> double = torch.compile(lambda t: t * 2)
    >>> x = torch.ones(1024)
    >>> _ = double(x)                              # compile once, outside the meter
    >>> with track_allocations() as meter:
    ...     y = double(x)                          # inductor's output buffer: 4096 bytes
    ...     meter.mark("made")
    ...     del y
    >>> meter.marks["made"], meter.peak_bytes, meter.live_bytes
    (4096, 4096, 0)
"""

from __future__ import annotations

import itertools
import weakref
from types import TracebackType
from typing import Any

import torch

from remat._compat.dispatch import wrapped_tensors
from remat._compat.profiler import profiler_allocations
from remat._silence import silenced
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.memory._report import StorageLifetime, Timeline

__all__ = ["AllocationMeter", "track_allocations"]

_PREFIX = "remat.memory:"
_MARK = _PREFIX + "mark:"
_QUERY = _PREFIX + "storage:"
# One meter's ranges stay its own when meters nest or follow each other.
_serial = itertools.count()


class AllocationMeter:
    """Bytes the allocator hands out inside a ``with`` block (see the module docstring).

    ``quiet=True`` points the process's standard error at the null device
    for the whole block: for steps that ran before, unmetered, so that
    anything they print was seen already (the planner's metered steps).

    Attributes:
        marks: live bytes at each :meth:`mark`, by name (the latest mark of a
            name wins), filled in when the block ends.
    """

    def __init__(self, device: str | None = None, *, quiet: bool = False) -> None:
        if device is not None and not isinstance(device, str):
            raise CheckpointTypeError(
                f"remat.memory.track_allocations: device must be a device type such as "
                f"'cuda' or 'cpu', or None for every device; got {device!r}."
            )
        self._device = device
        self._quiet = silenced(2) if quiet else None
        self._tag = f"{next(_serial)}:"
        self._profiler: Any = None
        self._used = False
        self._mark_names: list[str] = []
        # Storages asked about: id(storage) -> (weak reference, query number).
        self._asked: dict[int, tuple[weakref.ReferenceType[Any], int]] = {}
        self._queries: list[tuple[int, int]] = []  # (address, bytes) per query number
        self._timeline: Timeline | None = None
        self._peak_bytes = 0
        self._live_bytes = 0
        self.marks: dict[str, int] = {}

    @property
    def peak_bytes(self) -> int:
        """The most bytes live at once inside the block (known when it has ended)."""
        self._ended("peak_bytes")
        return self._peak_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes allocated inside the block and not freed when it ended."""
        self._ended("live_bytes")
        return self._live_bytes

    def mark(self, name: str) -> None:
        """Note this moment as ``name``: :attr:`marks` and the timeline's marks.

        Example:
            >>> from remat.memory import track_allocations
            >>> with track_allocations() as meter:
            ...     meter.mark("start")
            >>> meter.marks
            {'start': 0}
        """
        self._running("mark")
        with torch.profiler.record_function(f"{_MARK}{self._tag}{len(self._mark_names)}"):
            pass
        self._mark_names.append(name)

    def storage_index(self, tensor: torch.Tensor) -> int:
        """Where a live tensor's allocation will be in :attr:`Timeline.storages`.

        The timeline of a meter lists the storages it was asked about, in the
        order first asked; an entry is None when the storage was allocated
        before the block (not counted). A wrapper subclass (``DTensor``)
        answers for the first tensor it wraps.

        Example:
            >>> import torch
            >>> from remat.memory import track_allocations
            >>> before = torch.zeros(8)
            >>> with track_allocations() as meter:
            ...     made = torch.zeros(256)
            ...     inside, outside = meter.storage_index(made), meter.storage_index(before)
            >>> timeline = meter.timeline()
            >>> timeline.storages[inside].nbytes, timeline.storages[outside]
            (1024, None)
        """
        self._running("storage_index")
        inner = wrapped_tensors(tensor)
        storage = (inner[0] if inner else tensor).untyped_storage()
        known = self._asked.get(id(storage))
        if known is not None and known[0]() is storage:
            return known[1]
        number = len(self._queries)
        self._asked[id(storage)] = (weakref.ref(storage), number)
        self._queries.append((storage.data_ptr(), storage.nbytes()))
        with torch.profiler.record_function(f"{_QUERY}{self._tag}{number}"):
            pass
        return number

    def timeline(self) -> Timeline:
        """The block's timeline: live bytes after each event, marks, the storages asked about."""
        self._ended("timeline")
        assert self._timeline is not None, "remat bug: a finished meter has a timeline"
        return self._timeline

    def __enter__(self) -> AllocationMeter:
        if self._used:
            raise CheckpointUsageError(
                "remat.memory: an AllocationMeter measures one block only and this one was "
                "already used; create a new one with remat.memory.track_allocations()."
            )
        self._used = True
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        with silenced(2):  # some builds print a line when the profiler starts and stops
            profiler.__enter__()  # type: ignore[no-untyped-call]
        self._profiler = profiler
        if self._quiet is not None:
            self._quiet.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._quiet is not None:
            self._quiet.__exit__(exc_type, exc, tb)
        profiler, self._profiler = self._profiler, None
        with silenced(2):
            profiler.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self._read(profiler_allocations(profiler, _PREFIX))

    def _running(self, what: str) -> None:
        if self._profiler is None:
            raise CheckpointUsageError(
                f"remat.memory: AllocationMeter.{what}() works inside its `with` block only."
            )

    def _ended(self, what: str) -> None:
        if self._timeline is None:
            raise CheckpointUsageError(
                f"remat.memory: the meter's {what} is known once its `with` block has ended."
            )

    def _read(self, events: list[tuple[int, int, int, int, str, str]]) -> None:
        """Replay the allocator's events into a timeline, marks and the storages asked about."""
        mark_prefix, query_prefix = f"{_MARK}{self._tag}", f"{_QUERY}{self._tag}"
        live_bytes = [0]  # event 0: the block starts
        marks: list[tuple[str, int]] = []
        live = 0
        # address -> (bytes, event that made it, its lifetime's slot or None)
        blocks: dict[int, tuple[int, int, int | None]] = {}
        lifetimes: list[StorageLifetime | None] = [None] * len(self._queries)
        for _, _, address, delta, device, name in events:
            if name:
                if name.startswith(mark_prefix):
                    marks.append((self._mark_names[int(name[len(mark_prefix):])], len(live_bytes)))
                    live_bytes.append(live)
                elif name.startswith(query_prefix):
                    number = int(name[len(query_prefix):])
                    self._resolve(number, blocks, lifetimes)
                continue
            if self._device is not None and device != self._device:
                continue
            if delta > 0:
                stale = blocks.pop(address, None)
                if stale is not None:
                    # The allocator hands out only free addresses, so the block that held
                    # this one was freed unseen: on a thread the profiler does not follow
                    # (gloo's worker dropping a collective's last reference). It was gone
                    # by now at the latest (docs/design/memory.md, "Compiled code").
                    size, created, slot = stale
                    live -= size
                    if slot is not None:
                        lifetimes[slot] = StorageLifetime(size, created, len(live_bytes))
                live += delta
                blocks[address] = (delta, len(live_bytes), None)
                live_bytes.append(live)
            elif address in blocks:  # frees of memory allocated before the block are not counted
                size, created, slot = blocks.pop(address)
                live -= size
                if slot is not None:
                    lifetimes[slot] = StorageLifetime(size, created, len(live_bytes))
                live_bytes.append(live)
        self._live_bytes = live
        self._peak_bytes = max(live_bytes)
        self.marks = {name: live_bytes[index] for name, index in marks}
        self._timeline = Timeline(
            live_bytes=tuple(live_bytes), marks=tuple(marks), storages=tuple(lifetimes)
        )

    def _resolve(
        self,
        number: int,
        blocks: dict[int, tuple[int, int, int | None]],
        lifetimes: list[StorageLifetime | None],
    ) -> None:
        """Tie query ``number`` to the live allocation holding its storage at the moment asked."""
        address, _ = self._queries[number]
        entry = blocks.get(address)
        if entry is None:  # allocated before the block, or by a device not counted
            return
        size, created, _ = entry
        blocks[address] = (size, created, number)
        lifetimes[number] = StorageLifetime(size, created, None)


def track_allocations(device: str | None = None, *, quiet: bool = False) -> AllocationMeter:
    """Count the bytes the allocator hands out inside a ``with`` block, compiled code included.

    Returns a fresh :class:`AllocationMeter`. Use it where :func:`track`
    cannot see: code made by ``torch.compile`` (inductor's buffers) and
    native code that allocates without returning tensors. With ``device``
    (``"cuda"``), only that device type's allocations count. Its numbers are
    known when the block has ended (``peak_bytes``, ``marks``,
    ``timeline()``). It runs torch's profiler for the length of the block,
    so the code inside runs a little slower; the first time memory
    allocated before such a block is freed inside one, torch's CPU
    allocator logs a warning that it cannot count that free (it is not
    counted: it was not allocated inside the block).

    Example:
        >>> import torch
        >>> from remat.memory import track_allocations
        >>> w = torch.randn(64, 64, requires_grad=True)
        >>> with track_allocations() as meter:
        ...     loss = torch.sigmoid(w).sum()   # sigmoid keeps its output: 16384 bytes
        ...     meter.mark("forward_end")
        ...     loss.backward()
        >>> meter.marks["forward_end"]
        16388
    """
    return AllocationMeter(device, quiet=quiet)
