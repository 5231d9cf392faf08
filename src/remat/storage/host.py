"""Saved tensors kept in host memory: the host transfer, offload's stash.

Layer: storage (imports ``stash``, ``_compat`` and, with the first block it
copies, the device-copy interface ``copies``). Every host copy goes through a
:class:`HostTransfer`, whatever asked for it: a policy's offload decision, the
``remat.offload`` context, a region whose inputs live on the host
(:func:`remat.storage.choice.decide` chose, :class:`remat.storage.store.Stashes`
hands the tensor here). The protocol is in ``docs/design/offload.md``; in short:

* All the work runs with the user's dispatch modes stepped over
  (:func:`remat._compat.dispatch.no_dispatch_modes`): a selective region's recorder or
  a user's op counter never sees offload's buffers and copies. A tracer's
  modes (``make_fx``, ``torch.export``) do see them, and under a tracer each
  saved tensor is copied by value, so the graph holds the copies
  (``docs/design/tracing.md``).
* **CPU tensors** are copied into a host block and views of that block are
  handed back: no memory saved, every step runs.
* **CUDA tensors** are copied on a side stream into pinned buffers taken from
  a pool (:class:`~remat.storage.copies.PinnedPool`), and brought back on a
  second side stream with prefetch in backward order. Streams, events and
  memory come from a :class:`~remat.storage.copies.DeviceCopies` backend, so
  the same protocol runs on a simulated device that completes copies late
  and out of order (:mod:`remat.storage.simulated`: how it is tested without
  a GPU). Stream semantics: see the design note.
* **Other devices** copy synchronously: correct, no overlap.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from remat._compat.dispatch import no_dispatch_modes
from remat.storage.stash import Block, Stash, StoredTensor, flat_range

if TYPE_CHECKING:
    from remat.storage.copies import DeviceCopies, PinnedPool

__all__ = ["HostBlock", "HostCopy", "HostTransfer"]

_DEFAULT_STASH_BYTES = 1 << 30
"""At most this many device bytes may wait for their host copy before the forward blocks."""


class HostBlock(Block):
    """A block kept in host memory (``host``).

    ``ready`` (asynchronous copies) records the device-to-host copy, made
    through ``copies``; ``last_use`` the latest copy that read the host
    buffer (the pool waits for it before reuse). ``pending`` holds a
    prefetched device buffer and its event until it is asked for.
    """

    __slots__ = ("copies", "host", "last_use", "pending", "ready")

    def __init__(self, device: torch.device, dtype: torch.dtype, start: int, length: int, version: int) -> None:
        super().__init__(device, dtype, start, length, version)
        self.host: torch.Tensor = torch.empty(0)
        self.ready: Any = None
        self.copies: DeviceCopies | None = None
        self.last_use: list[Any] = [None]  # shared with the pool's finalizer
        self.pending: tuple[torch.Tensor, Any] | None = None


def _device_copies(device: torch.device) -> DeviceCopies | None:
    # The device backend loads with the first block a transfer copies: a
    # program that never offloads does not import it (tests/repo/test_layers.py
    # bounds what `import remat` loads).
    from remat.storage.copies import copies_for

    return copies_for(device)


def _give_back(pool: PinnedPool, buffer: torch.Tensor, last_use: list[Any]) -> None:
    pool.release(buffer, last_use[0])


class HostCopy(StoredTensor):
    """A saved tensor kept in host memory (:class:`HostTransfer`)."""

    __slots__ = ()

    @property
    def host(self) -> torch.Tensor:
        """The saved values in host memory, with the saved tensor's layout: a new tensor object.

        Never the block's own tensor: autograd attaches the history of the op
        that returns it (a selective recomputation replays an offloaded output
        so) to the object itself, and that history's hooks reference the
        region, which references this block: a cycle through C++ that gc
        cannot collect, and a stored value with a graph attached.
        """
        block = self.block
        assert isinstance(block, HostBlock), "remat bug: a host copy of another kind of block"
        if block.compact:
            return block.host.detach()
        return block.host.as_strided(self.size, self.stride, self.offset)


class HostTransfer(Stash):
    """Host copies for one forward: see the module docstring.

    Args:
        pin_memory: pin host buffers of accelerator tensors (default: yes when
            the tensor is on CUDA). Pinned memory is what makes the copies
            asynchronous.
        use_streams: copy asynchronously on side streams where the device has
            them (CUDA; :func:`~remat.storage.copies.copies_for`) (default: yes).
        prefetch: how many upcoming blocks to start copying back in backward.
        backward_order: the tensors come back in reverse save order (autograd's
            backward); ``False`` for save order (a selective recomputation
            replays its cached outputs forward).
        stash_bytes: device bytes allowed to wait for their copy in forward.
        guard_writes: make the compute stream wait for each device-to-host
            copy, so that a later in-place write cannot race with it (for
            caches that allow writes after saving; costs the overlap).
        pool: where pinned buffers come from (default: the device backend's,
            for CUDA the process-wide pool).
    """

    def __init__(
        self,
        *,
        pin_memory: bool | None = None,
        use_streams: bool = True,
        prefetch: int = 2,
        stash_bytes: int = _DEFAULT_STASH_BYTES,
        backward_order: bool = True,
        guard_writes: bool = False,
        pool: PinnedPool | None = None,
    ) -> None:
        super().__init__()
        self.pin_memory = pin_memory
        self.use_streams = use_streams
        self.prefetch = prefetch
        self.stash_bytes = stash_bytes
        self.backward_order = backward_order
        self.guard_writes = guard_writes
        self.pool = pool
        self._in_flight: deque[tuple[Any, int]] = deque()  # (d2h event, bytes)
        self._in_flight_bytes = 0
        self.copied_bytes = 0
        """Bytes copied to the host so far (each block once)."""

    # forward ---------------------------------------------------------------

    stored_type = HostCopy
    kept_as = "offloaded to host memory"

    def store(self, tensor: torch.Tensor) -> StoredTensor:
        """Start copying ``tensor`` to host memory; the copy is ready by backward (:meth:`Stash.store`)."""
        with no_dispatch_modes():
            return super().store(tensor)

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """:meth:`store`, typed as the host copy it makes."""
        copy = self.store(tensor)
        assert isinstance(copy, HostCopy), "remat bug: a host transfer made another kind of copy"
        return copy

    def _new_block(self, tensor: torch.Tensor, start: int, length: int, version: int) -> HostBlock:
        block = HostBlock(tensor.device, tensor.dtype, start, length, version)
        source = flat_range(tensor.detach(), start, length)
        device = tensor.device
        copies = _device_copies(device) if self.use_streams else None
        pin = self.pin_memory if self.pin_memory is not None else (device.type == "cuda" or copies is not None)
        if copies is not None and pin:
            self._copy_to_host_async(block, source, copies)
        else:
            block.host = torch.empty(length, dtype=tensor.dtype, pin_memory=pin)
            block.host.copy_(source)
        self.copied_bytes += length * tensor.element_size()
        return block

    def _compact_block(self, tensor: torch.Tensor, version: int) -> HostBlock:
        """Tensors whose storage cannot be read as a flat range (subclasses,
        conjugate or negative views, other layouts) are copied by value."""
        block = HostBlock(tensor.device, tensor.dtype, -1, 0, version)
        block.host = torch.empty_like(tensor, device="cpu")
        block.host.copy_(tensor.detach())
        block.compact = True
        self.copied_bytes += tensor.numel() * tensor.element_size()
        return block

    def _copy_to_host_async(self, block: HostBlock, source: torch.Tensor, copies: DeviceCopies) -> None:
        nbytes = source.numel() * source.element_size()
        pool = self.pool if self.pool is not None else copies.pool
        buffer = pool.acquire(nbytes)
        block.host = buffer[:nbytes].view(source.dtype)
        block.copies = copies
        # The buffer goes back to the pool when the block dies; the pool reuses
        # it once the block's last copy (``last_use``) has finished.
        weakref.finalize(block, _give_back, pool, buffer, block.last_use)
        compute = copies.compute_stream()
        side = copies.side_stream("d2h")
        side.wait_stream(compute)  # the tensor's producer must have run
        ready = copies.copy(block.host, source, side)
        # The allocator must not hand the device memory out again before the
        # side stream has read it, even if autograd drops it now.
        copies.keep_until_done(source, side)
        block.ready = block.last_use[0] = ready
        if self.guard_writes:
            compute.wait_event(ready)
        self._bound_in_flight(ready, nbytes)

    def _bound_in_flight(self, ready: Any, nbytes: int) -> None:
        """Block the forward while more than ``stash_bytes`` wait for their copy."""
        flight = self._in_flight
        while flight and flight[0][0].query():
            self._in_flight_bytes -= flight.popleft()[1]
        flight.append((ready, nbytes))
        self._in_flight_bytes += nbytes
        while len(flight) > 1 and self._in_flight_bytes > self.stash_bytes:
            event, size = flight.popleft()
            event.synchronize()
            self._in_flight_bytes -= size

    # backward --------------------------------------------------------------

    def restore(self, copy: StoredTensor) -> torch.Tensor:
        """``copy`` back on its device, ready for use on the current stream."""
        with no_dispatch_modes():
            return self._restore(copy)

    def _restore(self, copy: StoredTensor) -> torch.Tensor:
        block = copy.block
        assert isinstance(block, HostBlock), "remat bug: a host transfer restores its own blocks"
        if block.ready is None:  # copied synchronously
            if block.device.type == "cpu":
                assert isinstance(copy, HostCopy), "remat bug: a host block with another kind of copy"
                return copy.host
            if block.compact:
                return block.host.to(block.device)
        flat = block.restored() if block.restored is not None else None
        if flat is None:
            if block.ready is not None:
                flat = self._take_restored(block)
                self._prefetch_after(copy.index)
            else:
                flat = block.host.to(block.device)
            block.restored = weakref.ref(flat)
        return flat.as_strided(copy.size, copy.stride, copy.offset)

    def _take_restored(self, block: HostBlock) -> torch.Tensor:
        copies = block.copies
        assert copies is not None, "remat bug: an asynchronous block without its device"
        pending = block.pending or self._start_restore(block)
        block.pending = None
        flat, ready = pending
        compute = copies.compute_stream()
        compute.wait_event(ready)  # no use before the copy has landed
        copies.keep_until_done(flat, compute)  # allocated for the side stream, used here
        return flat

    def _start_restore(self, block: HostBlock) -> tuple[torch.Tensor, Any]:
        copies = block.copies
        assert copies is not None, "remat bug: an asynchronous block without its device"
        side = copies.side_stream("h2d")
        side.wait_event(block.ready)  # the host copy must be complete
        flat = copies.empty(block.length, block.dtype, side)
        ready = copies.copy(flat, block.host, side)
        block.last_use[0] = ready  # the pinned buffer is read until then
        return flat, ready

    def _prefetch_after(self, index: int) -> None:
        """Start bringing back the blocks needed next (earlier saves in backward order)."""
        started = 0
        positions = range(index - 1, -1, -1) if self.backward_order else range(index + 1, len(self._copies))
        for position in positions:
            if started >= self.prefetch:
                break
            upcoming = self._copies[position]()
            if upcoming is None:
                continue
            block = upcoming.block
            assert isinstance(block, HostBlock), "remat bug: a host transfer keeps its own blocks"
            if block.ready is None or (block.restored is not None and block.restored() is not None):
                continue
            if block.pending is None:
                block.pending = self._start_restore(block)
            started += 1
