"""A simulated asynchronous device for testing the offload protocol on a CPU.

Layer: storage (imports ``_compat`` and ``copies``). Used by tests and by the
CPU dry run of ``scripts/gpu-check.sh``; nothing in the library creates one.

:class:`SimulatedCopies` implements :class:`~remat.storage.copies.DeviceCopies`
for CPU tensors, with CUDA's rules and none of its luck: work on the two side
streams (``"d2h"``, ``"h2d"``) is queued, not run, and completes *late* (only
when something waits for it, or at random later moments) and *out of order*
across streams (in order within one, as on CUDA). The compute stream is the
CPU itself: it runs at once, so waiting on it means finishing the awaited
copies now. What a wrong protocol does shows up as wrong values:

* **no use before the copy lands**: device buffers (:meth:`~SimulatedCopies.empty`)
  and pinned buffers start filled with garbage (NaN for floats), so a buffer
  used before the compute stream waited for its copy reads garbage;
* **no free before it finishes**: a queued copy holds its source's storage
  weakly; unless :meth:`~SimulatedCopies.keep_until_done` was called (the
  allocator's ``record_stream``), a source freed before the copy runs is read
  as garbage, as reused device memory would be;
* **no reuse of a pinned buffer before its last copy**: a copy queued on one
  side stream that writes a buffer a copy on the other side stream still
  reads or writes (or reads one it still writes), with nothing ordering the
  two, is a race; the device records it in :attr:`~SimulatedCopies.hazards`;
* **ordering**: a host-to-device copy that does not wait for its
  device-to-host copy may run first and read a buffer not yet filled.

:attr:`~SimulatedCopies.issued` records every copy in issue order (for
prefetch order), :meth:`~SimulatedCopies.pending_bytes` the bytes a stream
still has to move (for the stash bound).

Example:
    >>> import torch
    >>> from remat.storage.copies import simulate_copies
    >>> from remat.storage.host import HostTransfer
    >>> sim = SimulatedCopies(seed=1)
    >>> with simulate_copies(sim):
    ...     transfer = HostTransfer()
    ...     t = torch.arange(6.0)
    ...     saved = transfer.to_host(t)
    >>> torch.equal(saved.restore(), torch.arange(6.0))
    True
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from remat._compat.dispatch import no_dispatch_modes
from remat.storage.copies import PinnedPool

__all__ = ["Issued", "SimulatedCopies"]


@dataclass(eq=False)
class _Op:
    """One queued copy: ``dst.copy_(source)``, the source held weakly by its storage."""

    stream: _Stream
    dst: torch.Tensor
    source: weakref.ref[torch.UntypedStorage]
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    after: list[_Op]
    index: int = 0  # issue order on the device
    done: bool = False
    kept: list[Any] = field(default_factory=list)  # storages held until done (record_stream)

    def run(self, garbage: torch.Generator) -> None:
        storage = self.source()
        with no_dispatch_modes(), torch.no_grad():
            if storage is None:  # freed before the copy read it: reused memory
                _fill_with_garbage(self.dst, garbage)
            else:
                view = torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)
                self.dst.copy_(view)
        self.done = True
        self.kept.clear()


@dataclass(frozen=True)
class Issued:
    """A copy as it was issued: its direction, bytes, and (weakly) the source tensor object."""

    direction: str
    nbytes: int
    source: weakref.ref[torch.Tensor]


def _fill_with_garbage(tensor: torch.Tensor, garbage: torch.Generator) -> None:
    with no_dispatch_modes(), torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.fill_(float("nan"))
        else:
            noise = torch.randint(0, 256, (tensor.numel() * tensor.element_size(),), generator=garbage, dtype=torch.uint8)
            tensor.view(-1).view(torch.uint8).copy_(noise)


class _Event:
    """Recorded after one queued copy."""

    __slots__ = ("_device", "_op")

    def __init__(self, device: SimulatedCopies, op: _Op | None) -> None:
        self._device = device
        self._op = op

    def query(self) -> bool:
        self._device.progress()
        return self._op is None or self._op.done

    def synchronize(self) -> None:
        if self._op is not None:
            self._device.finish(self._op)


class _Stream:
    """A queue of copies run in order; the compute stream runs at once."""

    def __init__(self, device: SimulatedCopies, name: str) -> None:
        self.device = device
        self.name = name
        self.queue: list[_Op] = []  # not done yet, in issue order
        self.waits: list[_Op] = []  # what the next queued copy must wait for

    def wait_stream(self, other: _Stream) -> None:
        self._wait([op for op in other.queue if not op.done])

    def wait_event(self, event: _Event) -> None:
        op = event._op
        if op is not None and not op.done:
            self._wait([op])

    def _wait(self, ops: list[_Op]) -> None:
        if self.name == "compute":  # the CPU cannot run ahead: finish them now
            for op in ops:
                self.device.finish(op)
        else:
            self.waits.extend(ops)


class SimulatedCopies:
    """See the module docstring.

    Args:
        seed: seeds which queued copy completes when, and the garbage.
        eagerness: chance that a call into the device completes one more ready
            copy on its own (0: copies complete only when waited for).
    """

    def __init__(self, seed: int = 0, eagerness: float = 0.3) -> None:
        self._rng = random.Random(seed)
        self._garbage = torch.Generator().manual_seed(seed)
        self.eagerness = eagerness
        self._compute = _Stream(self, "compute")
        self._sides: dict[str, _Stream] = {}
        self.issued: list[Issued] = []
        """Every copy queued on a side stream, in issue order."""
        self.hazards: list[str] = []
        """Races between copies on different streams over one buffer (should stay empty)."""
        self.pool = PinnedPool(self.allocate_pinned)
        """Where transfers on this device take their host buffers."""

    # DeviceCopies -------------------------------------------------------------

    def compute_stream(self) -> _Stream:
        self.progress()
        return self._compute

    def side_stream(self, direction: str) -> _Stream:
        stream = self._sides.get(direction)
        if stream is None:
            stream = self._sides[direction] = _Stream(self, direction)
        return stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: _Stream) -> _Event:
        self.progress()
        nbytes = src.numel() * src.element_size()
        if stream is self._compute:  # runs at once
            with no_dispatch_modes(), torch.no_grad():
                dst.copy_(src)
            return _Event(self, None)
        op = _Op(
            stream=stream,
            dst=dst,
            source=weakref.ref(src.untyped_storage()),
            offset=int(src.storage_offset()),
            size=tuple(src.shape),
            stride=src.stride(),
            dtype=src.dtype,
            nbytes=nbytes,
            after=stream.waits,
        )
        op.index = len(self.issued)
        stream.waits = []
        self._check_races(op)
        stream.queue.append(op)
        self.issued.append(Issued(stream.name, nbytes, weakref.ref(src)))
        return _Event(self, op)

    def keep_until_done(self, tensor: torch.Tensor, stream: _Stream) -> None:
        pending = [op for op in stream.queue if not op.done]
        if pending:
            pending[-1].kept.append(tensor.untyped_storage())  # done last: in order

    def empty(self, length: int, dtype: torch.dtype, stream: _Stream) -> torch.Tensor:
        buffer = torch.empty(length, dtype=dtype)
        _fill_with_garbage(buffer, self._garbage)
        return buffer

    def allocate_pinned(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        _fill_with_garbage(buffer, self._garbage)
        return buffer

    # the simulation -------------------------------------------------------------

    def pending_bytes(self, direction: str) -> int:
        """Bytes the side stream of ``direction`` has queued and not moved yet."""
        stream = self._sides.get(direction)
        return 0 if stream is None else sum(op.nbytes for op in stream.queue if not op.done)

    def progress(self) -> None:
        """Maybe complete one ready copy, on a stream picked at random."""
        if self._rng.random() >= self.eagerness:
            return
        ready = []
        for stream in self._sides.values():
            head = next((op for op in stream.queue if not op.done), None)
            if head is not None and all(op.done for op in head.after):
                ready.append(head)
        if ready:
            self._run(self._rng.choice(ready))

    def finish(self, op: _Op) -> None:
        """Complete ``op`` now, with everything it waits for."""
        while not op.done:
            queue = op.stream.queue
            head = next(earlier for earlier in queue if not earlier.done)
            blocking = next((dep for dep in head.after if not dep.done), None)
            if blocking is not None:
                self.finish(blocking)
            else:
                self._run(head)

    def synchronize(self) -> None:
        """Complete every queued copy."""
        for stream in list(self._sides.values()):
            for op in list(stream.queue):
                self.finish(op)

    def _check_races(self, op: _Op) -> None:
        """Record a race of ``op`` with an unfinished copy on another stream it is not ordered after."""
        writes = op.dst.untyped_storage()
        reads = op.source()
        for stream in self._sides.values():
            if stream is op.stream:
                continue
            for other in stream.queue:
                if other.done or _ordered_before(other, op):
                    continue
                other_writes = other.dst.untyped_storage()
                if other_writes is writes or other.source() is writes or (reads is not None and other_writes is reads):
                    self.hazards.append(
                        f"{op.stream.name} copy #{op.index} and {stream.name} copy #{other.index} "
                        "touch one buffer with nothing ordering them"
                    )

    def _run(self, op: _Op) -> None:
        op.run(self._garbage)
        queue = op.stream.queue
        while queue and queue[0].done:
            queue.pop(0)


def _ordered_before(earlier: _Op, op: _Op) -> bool:
    """Whether ``earlier`` completes before ``op`` starts: ``op`` waits, directly or
    through what it waits for, for a copy queued after ``earlier`` on its stream."""
    pending = list(op.after)
    seen: set[int] = set()
    while pending:
        dep = pending.pop()
        if id(dep) in seen:
            continue
        seen.add(id(dep))
        if dep.stream is earlier.stream and dep.index >= earlier.index:
            return True
        pending.extend(dep.after)
    return False
