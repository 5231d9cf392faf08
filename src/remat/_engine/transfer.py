"""Saved tensors kept elsewhere and brought back: host copies, and the base of every stash.

Layer: engine (imports ``_compat``, ``errors`` and the device-copy interface
``copies``; the engine's selective modes and the ``remat.offload`` and
``remat.compress`` contexts above it plug into it). A :class:`Stash` keeps the
saved tensors of one forward somewhere other than as they are, *block* by
block, and hands back a :class:`StoredTensor` for each; two stashes exist:
:class:`HostTransfer` (host memory, here) and ``Compressor`` (smaller, on the
device: ``_engine/compressed.py``). Both offload paths use the host one: the
``remat.offload`` context (every saved tensor above a size) and selective
policies that answer ``MUST_OFFLOAD`` / ``PREFER_OFFLOAD`` (one op output). The
protocol is in ``docs/design/offload.md``; in short:

* What is stored is a *block*: a contiguous element range of the saved
  tensor's storage (the whole storage, or only the span the tensor covers
  when that is less than half of it). A :class:`StoredTensor` is the saved
  tensor's size, stride and offset into its block, so views come back with
  their exact layout, and several views of one storage (``q, k, v`` split
  from one projection) share one block (:meth:`Stash.store`).
* Identity is an object, never an address: blocks are found through the
  saved tensor's base *object* (weakly keyed, so a dead tensor's entry
  disappears with it) and its version counter.
* All the work runs with the user's dispatch modes stepped over
  (:func:`remat._compat.no_dispatch_modes`): a selective region's recorder or
  a user's op counter never sees offload's buffers and copies. A tracer's
  modes (``make_fx``, ``torch.export``) do see them, and under a tracer each
  saved tensor is copied by value, so the graph holds the copies
  (``docs/design/tracing.md``).
* **CPU tensors** are copied into a host block and views of that block are
  handed back: no memory saved, every step runs.
* **CUDA tensors** are copied on a side stream into pinned buffers taken from
  a pool (:class:`~remat._engine.copies.PinnedPool`), and brought back on a
  second side stream with prefetch in backward order. Streams, events and
  memory come from a :class:`~remat._engine.copies.DeviceCopies` backend, so
  the same protocol runs on a simulated device that completes copies late
  and out of order (:mod:`remat._engine.simulated`: how it is tested without
  a GPU). Stream semantics: see the design note.
* **Other devices** copy synchronously: correct, no overlap.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from remat._compat.autograd import base_of, version_of, version_witness
from remat._compat.dispatch import detach_sharing_version, no_dispatch_modes, tracing_modes_active
from remat.errors import CheckpointError

if TYPE_CHECKING:
    from remat._engine.copies import DeviceCopies, PinnedPool

__all__ = ["Block", "HostCopy", "HostTransfer", "Stash", "StoredTensor"]

_DEFAULT_STASH_BYTES = 1 << 30
"""At most this many device bytes may wait for their host copy before the forward blocks."""

def _span(tensor: torch.Tensor) -> int:
    """Elements of storage between the tensor's first and last element, inclusive."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))


def _flat_range(tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Elements ``[start, start + length)`` of ``tensor``'s storage, as a 1-D tensor."""
    return tensor.as_strided((length,), (1,), start)


def _plain_strided(tensor: torch.Tensor) -> bool:
    """Whether the storage of ``tensor`` can be read as a flat range of its dtype."""
    return (
        type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
        and tensor.layout is torch.strided
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


class Block:
    """Elements ``[start, start + length)`` of one storage, kept by a stash.

    Host copies keep them in ``host``; a compressed block (a subclass, in
    ``_engine/compressed.py``) keeps its own fields.

    ``ready`` (asynchronous copies) records the device-to-host copy, made
    through ``copies``; ``last_use`` the latest copy that read the host
    buffer (the pool waits for it before reuse).
    ``restored`` refers weakly to the block back on its device, so views of
    one block restored together share one device buffer; ``pending`` holds a
    prefetched device buffer and its event until it is asked for.
    """

    __slots__ = (
        "__weakref__",
        "compact",
        "copies",
        "device",
        "dtype",
        "host",
        "last_use",
        "length",
        "pending",
        "ready",
        "restored",
        "start",
        "version",
        "views",
    )

    def __init__(self, device: torch.device, dtype: torch.dtype, start: int, length: int, version: int) -> None:
        self.device = device
        self.dtype = dtype
        self.start = start
        self.length = length
        self.version = version
        self.host: torch.Tensor = torch.empty(0)
        self.ready: Any = None
        self.copies: DeviceCopies | None = None
        self.last_use: list[Any] = [None]  # shared with the pool's finalizer
        self.restored: weakref.ref[torch.Tensor] | None = None
        self.pending: tuple[torch.Tensor, Any] | None = None
        self.views: dict[tuple[Any, ...], weakref.ref[StoredTensor]] = {}
        self.compact = False  # host holds the values with their own layout (no flat range)

    def covers(self, start: int, length: int, version: int) -> bool:
        return version == self.version and self.start <= start and start + length <= self.start + self.length


def _device_copies(device: torch.device) -> DeviceCopies | None:
    # The device backend loads with the first block a transfer copies: a
    # program that never offloads does not import it (`import remat` loads at
    # most 19 modules, tests/repo/test_layers.py).
    from remat._engine.copies import copies_for

    return copies_for(device)


def _give_back(pool: PinnedPool, buffer: torch.Tensor, last_use: list[Any]) -> None:
    pool.release(buffer, last_use[0])


class StoredTensor:
    """A saved tensor a stash keeps, restored to its device on demand.

    ``restore()`` may be called again (``retain_graph=True``): the stored
    block stays until the graph drops this object.
    """

    __slots__ = ("__weakref__", "block", "index", "offset", "size", "stash", "stride", "version", "witness")

    def __init__(
        self,
        stash: Stash,
        index: int,
        block: Block,
        original: torch.Tensor,
        version: int,
        traced: bool = False,
    ) -> None:
        self.stash = stash
        self.index = index
        self.block = block
        self.size = original.shape
        self.stride = original.stride()
        self.offset = original.storage_offset() - block.start
        # Autograd does not check saved tensors for in-place changes when hooks
        # are active; a witness of the original's version counter lets us.
        # Under a tracer it is an alias: the witness's memory trick (set_)
        # would be recorded, and functionalization would apply it to the
        # original (docs/design/tracing.md).
        if traced:
            self.witness = detach_sharing_version(original)
        else:
            with no_dispatch_modes():  # remat's bookkeeping: no user mode sees it
                self.witness = version_witness(original)
        self.version = version

    @property
    def device(self) -> torch.device:
        return self.block.device

    def modified(self) -> bool:
        """Whether the original was written in place after it was saved."""
        return version_of(self.witness) != self.version

    def restore(self, *, check_version: bool = True) -> torch.Tensor:
        """The tensor on its original device (waits for any copy in flight).

        Raises ``CheckpointError`` if the original was modified in place after
        it was saved, as autograd does for tensors it keeps itself (unless
        ``check_version=False``: a selective cache checks on its own terms).
        """
        now = version_of(self.witness)
        if check_version and now != self.version:
            raise CheckpointError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a {tuple(self.size)} {self.block.dtype} tensor saved "
                f"for backward and {self.stash.kept_as} is at version {now}; expected version "
                f"{self.version}. Avoid the in-place change, or clone the tensor before "
                "changing it."
            )
        return self.stash.restore(self)


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
        if block.compact:
            return block.host.detach()
        return block.host.as_strided(self.size, self.stride, self.offset)


class Stash:
    """Where one forward's saved tensors are kept, block by block (see the module docstring).

    A subclass says how a block is made (:meth:`_new_block`,
    :meth:`_compact_block`) and brought back (:meth:`restore`), what its
    stored tensors are (``stored_type``) and how a message names the place
    (``kept_as``).
    """

    stored_type: type[StoredTensor] = StoredTensor
    kept_as = "stored elsewhere"

    def __init__(self) -> None:
        self._copies: list[weakref.ref[StoredTensor]] = []
        # base tensor object -> its blocks (weak key: the entry dies with the tensor)
        self._blocks: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def store(self, tensor: torch.Tensor) -> StoredTensor:
        """Keep ``tensor`` in this stash.

        The same storage saved twice at the same version (an op saving an
        input and an output that alias, two ops saving one tensor, views of
        one projection) is stored once.
        """
        version = version_of(tensor)
        if tracing_modes_active():
            # A tracer records the work into its graph: by value, one per saved
            # tensor (storages and offsets may be symbolic there, and the
            # graph's compiler plans its own memory; docs/design/tracing.md).
            return self._new_copy(self._compact_block(tensor, version), tensor, version, traced=True)
        base = base_of(tensor)
        start, length = int(tensor.storage_offset()), _span(tensor)
        blocks: list[weakref.ref[Block]] | None = self._blocks.get(base)  # type: ignore[no-untyped-call]
        block = None
        if blocks is not None:
            for ref in blocks:
                known = ref()
                if known is not None and known.covers(start, length, version):
                    block = known
                    break
        if block is not None:
            key = (tensor.shape, tensor.stride(), start)
            same = block.views.get(key)
            copy = same() if same is not None else None
            if copy is not None:
                return copy
        else:
            block = self._new_block(tensor, start, length, version)
            if blocks is None:
                blocks = self._blocks[base] = []
            else:
                blocks[:] = [ref for ref in blocks if ref() is not None]
            blocks.append(weakref.ref(block))
        copy = self._new_copy(block, tensor, version)
        block.views[(tensor.shape, tensor.stride(), start)] = weakref.ref(copy)
        return copy

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether this stash keeps ``tensor`` (else its owner keeps it as it is)."""
        return True

    def _new_copy(self, block: Block, tensor: torch.Tensor, version: int, traced: bool = False) -> StoredTensor:
        copy = self.stored_type(self, len(self._copies), block, tensor, version, traced)
        self._copies.append(weakref.ref(copy))
        return copy

    def _new_block(self, tensor: torch.Tensor, start: int, length: int, version: int) -> Block:
        """A block for elements ``[start, start + length)`` of ``tensor``'s storage."""
        raise NotImplementedError("remat bug: a stash makes its own blocks")

    def _compact_block(self, tensor: torch.Tensor, version: int) -> Block:
        """A block holding ``tensor``'s values in its own layout (no flat storage range)."""
        raise NotImplementedError("remat bug: a stash makes its own blocks")

    def restore(self, copy: StoredTensor) -> torch.Tensor:
        """``copy`` back on its device, as a view of its block's restored values."""
        raise NotImplementedError("remat bug: a stash restores its own blocks")


class HostTransfer(Stash):
    """Host copies for one forward: see the module docstring.

    Args:
        pin_memory: pin host buffers of accelerator tensors (default: yes when
            the tensor is on CUDA). Pinned memory is what makes the copies
            asynchronous.
        use_streams: copy asynchronously on side streams where the device has
            them (CUDA; :func:`~remat._engine.copies.copies_for`) (default: yes).
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

    def _new_block(self, tensor: torch.Tensor, start: int, length: int, version: int) -> Block:
        if not _plain_strided(tensor):
            return self._compact_block(tensor, version)
        storage_elements = tensor.untyped_storage().nbytes() // tensor.element_size()
        if 2 * length >= storage_elements:  # copy the whole storage: offsets stay exact
            start, length = 0, storage_elements
        block = Block(tensor.device, tensor.dtype, start, length, version)
        source = _flat_range(tensor.detach(), start, length)
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

    def _compact_block(self, tensor: torch.Tensor, version: int) -> Block:
        """Tensors whose storage cannot be read as a flat range (subclasses,
        conjugate or negative views, other layouts) are copied by value."""
        block = Block(tensor.device, tensor.dtype, -1, 0, version)
        block.host = torch.empty_like(tensor, device="cpu")
        block.host.copy_(tensor.detach())
        block.compact = True
        self.copied_bytes += tensor.numel() * tensor.element_size()
        return block

    def _copy_to_host_async(self, block: Block, source: torch.Tensor, copies: DeviceCopies) -> None:
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

    def _take_restored(self, block: Block) -> torch.Tensor:
        copies = block.copies
        assert copies is not None, "remat bug: an asynchronous block without its device"
        pending = block.pending or self._start_restore(block)
        block.pending = None
        flat, ready = pending
        compute = copies.compute_stream()
        compute.wait_event(ready)  # no use before the copy has landed
        copies.keep_until_done(flat, compute)  # allocated for the side stream, used here
        return flat

    def _start_restore(self, block: Block) -> tuple[torch.Tensor, Any]:
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
            if block.ready is None or (block.restored is not None and block.restored() is not None):
                continue
            if block.pending is None:
                block.pending = self._start_restore(block)
            started += 1
