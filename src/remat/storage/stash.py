"""The base of every stash: saved tensors kept block by block, and brought back.

Layer: storage (imports ``_compat`` and ``errors``). A :class:`Stash` keeps the
saved tensors of one forward somewhere other than as they are and hands back
a :class:`StoredTensor` for each. Two stashes exist: the host transfer
(:mod:`remat.storage.host`) and the compressor
(:mod:`remat.storage.compressed`). Which of them a tensor goes to is decided
elsewhere, once (:func:`remat.storage.choice.decide`); a stash only keeps. The
protocol is in ``docs/design/offload.md``; in short:

* What is stored is a *block*: a contiguous element range of the saved
  tensor's storage, :func:`block_extent`'s answer (the whole storage, or
  only the span the tensor covers when that is less than half of it). A
  :class:`StoredTensor` is the saved tensor's size, stride and offset into
  its block, so views come back with their exact layout, and several views
  of one storage (``q, k, v`` split from one projection) share one block
  (:meth:`Stash.store`).
* Identity is an object, never an address: blocks are found through the
  saved tensor's base *object* (weakly keyed, so a dead tensor's entry
  disappears with it) and its version counter.
* A tensor whose storage cannot be read as a flat range (a wrapper subclass,
  a conjugate or negative view, another layout), and every tensor under a
  tracer, is kept by value in a *compact* block of its own.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from remat._compat.autograd import base_of, version_of, version_witness
from remat._compat.dispatch import detach_sharing_version, no_dispatch_modes, tracing_modes_active
from remat.errors import CheckpointError

__all__ = ["Block", "Stash", "StoredTensor", "block_extent"]


def _span(tensor: torch.Tensor) -> int:
    """Elements of storage between the tensor's first and last element, inclusive."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))


def flat_range(tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
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


def block_extent(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The storage range ``(start, length)`` a stash keeps for ``tensor``; None: by value.

    The whole storage when the tensor spans at least half of it (offsets stay
    exact, and other views of the storage find their values there), else
    only the span the tensor covers. None for a tensor whose storage cannot
    be read as a flat range (it is kept by value, in a compact block).

    Example:
        >>> x = torch.zeros(8, 4)
        >>> block_extent(x[1:]), block_extent(x[:2])
        ((0, 32), (0, 8))
    """
    if not _plain_strided(tensor):
        return None
    start, length = int(tensor.storage_offset()), _span(tensor)
    storage_elements = tensor.untyped_storage().nbytes() // tensor.element_size()
    if 2 * length >= storage_elements:
        return 0, storage_elements
    return start, length


class Block:
    """Elements ``[start, start + length)`` of one storage, kept by a stash.

    A stash's own subclass holds the kept values (host memory, or compressed
    on the device). ``compact``: the block holds one tensor's values by
    value, with no storage range. ``restored`` refers weakly to the block
    back on its device, so views of one block restored together share one
    buffer, as in the forward; ``views`` finds the stored tensor of a view
    saved twice.
    """

    __slots__ = ("__weakref__", "compact", "device", "dtype", "length", "restored", "start", "version", "views")

    def __init__(self, device: torch.device, dtype: torch.dtype, start: int, length: int, version: int) -> None:
        self.device = device
        self.dtype = dtype
        self.start = start
        self.length = length
        self.version = version
        self.restored: weakref.ref[torch.Tensor] | None = None
        self.views: dict[tuple[Any, ...], weakref.ref[StoredTensor]] = {}
        self.compact = False

    def covers(self, start: int, length: int, version: int) -> bool:
        return version == self.version and self.start <= start and start + length <= self.start + self.length


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
        traced = tracing_modes_active()
        extent = None if traced else block_extent(tensor)
        if extent is None:
            # By value, one block per saved tensor. Under a tracer the work is
            # recorded into its graph (storages and offsets may be symbolic
            # there, and the graph's compiler plans its own memory;
            # docs/design/tracing.md).
            return self._new_copy(self._compact_block(tensor, version), tensor, version, traced=traced)
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
            block = self._new_block(tensor, *extent, version)
            if blocks is None:
                blocks = self._blocks[base] = []
            else:
                blocks[:] = [ref for ref in blocks if ref() is not None]
            blocks.append(weakref.ref(block))
        copy = self._new_copy(block, tensor, version)
        block.views[(tensor.shape, tensor.stride(), start)] = weakref.ref(copy)
        return copy

    def _new_copy(self, block: Block, tensor: torch.Tensor, version: int, traced: bool = False) -> StoredTensor:
        copy = self.stored_type(self, len(self._copies), block, tensor, version, traced)
        self._copies.append(weakref.ref(copy))
        return copy

    def _new_block(self, tensor: torch.Tensor, start: int, length: int, version: int) -> Block:
        """A block for elements ``[start, start + length)`` of ``tensor``'s storage (:func:`block_extent`)."""
        raise NotImplementedError("remat bug: a stash makes its own blocks")

    def _compact_block(self, tensor: torch.Tensor, version: int) -> Block:
        """A block holding ``tensor``'s values in its own layout (no flat storage range)."""
        raise NotImplementedError("remat bug: a stash makes its own blocks")

    def restore(self, copy: StoredTensor) -> torch.Tensor:
        """``copy`` back on its device, as a view of its block's restored values."""
        raise NotImplementedError("remat bug: a stash restores its own blocks")
