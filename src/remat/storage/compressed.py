"""Saved tensors kept smaller on their device: the compressor, compression's stash.

Layer: storage (imports ``stash``, ``_compat`` and the bottom layer's
``compression``). Loaded with the first compressed tensor: a program that never
compresses does not import it.

A :class:`Compressor` is the stash of one forward for one format, whatever
asked for it: a policy's ``Compress`` decision, the ``remat.compress``
context, a region's ``compress_inputs`` (:func:`remat.storage.choice.decide`
chose; :class:`remat.storage.store.Stashes` hands the tensor here). Like the
host transfer it works on *blocks*, contiguous ranges of a storage shared by
all the views saved from it (:meth:`~remat.storage.stash.Stash.store`): ``q``,
``k`` and ``v`` split from one projection are compressed once, with the rows
and scales of the projection's output. Restoring decompresses the whole
block once per backward and hands out views of it, so views restored
together share one buffer again, as in the forward.

What a block costs is one rule, :func:`compressed_bytes`: the stash counts
with it, and :class:`CompressedSizes` (the same blocks, counted without
compressing) gives the compression report its predicted bytes. A compiled
graph keeps what it saves as plain tensors (:meth:`Compressor.pack_in_graph`):
a compact block's payload and scales, made by the same arithmetic.

The compression runs under ``no_grad`` and is seen by dispatch modes (unlike
the host copies): a memory tracker counts the compressed bytes where they
live, and a tracer records the arithmetic into its graph. What it costs and
why it is allowed where: ``docs/design/compression.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from remat._compat.autograd import base_of
from remat._compat.dispatch import unwrapped
from remat.compression import Compression
from remat.storage.stash import Block, Stash, StoredTensor, block_extent, flat_range

__all__ = ["CompressedBlock", "CompressedSizes", "Compressor", "compressed_bytes"]


def compressed_row(tensor: torch.Tensor, start: int, length: int) -> int:
    """The row length of the block ``[start, start + length)`` of ``tensor``'s storage.

    The last dimension of the storage's base tensor, when that is contiguous
    and the block is whole rows of it; 0 otherwise (one scale for the block).
    """
    base = base_of(tensor)
    if base.dim() == 0 or not base.is_contiguous():
        return 0
    row = int(base.shape[-1])
    return row if row and start % row == 0 and length % row == 0 else 0


def compressed_bytes(tensor: torch.Tensor, format: Compression) -> tuple[int, int]:
    """``(original, stored)`` bytes of the block a compressor keeps for ``tensor``.

    The one byte rule of compression: the block is :func:`~remat.storage.stash.block_extent`'s
    range of the tensor's storage (or the tensor itself, for one kept by
    value), its rows :func:`compressed_row`'s, and the format prices it
    (:meth:`~remat.compression.Compression.stored_bytes`). A tensor of a dtype
    the format does not shrink stays as large as it is.

    Example:
        >>> from remat.compression import compression
        >>> compressed_bytes(torch.zeros(4, 64), compression("int8"))  # 64-value rows, a scale each
        (1024, 272)
    """
    extent = block_extent(tensor)
    if extent is None:
        numel, row = tensor.numel(), tensor.shape[-1] if tensor.dim() else 0
    else:
        numel, row = extent[1], compressed_row(tensor, *extent)
    return numel * tensor.element_size(), format.stored_bytes(numel, tensor.dtype, row)


class CompressedBlock(Block):
    """A block kept as ``payload`` (the compressed values) and ``scales``, with rows of ``row`` values.

    A wrapper subclass (``DTensor``) is kept as the tensors it holds, each
    stored on its own (``inner``), and built again from them (``rebuild``):
    compressing a ``DTensor`` through its own operators would redistribute
    it, a collective in the middle of autograd's saving.
    """

    __slots__ = ("inner", "payload", "rebuild", "row", "scales")

    def __init__(self, device: torch.device, dtype: torch.dtype, start: int, length: int, version: int) -> None:
        super().__init__(device, dtype, start, length, version)
        self.payload = torch.empty(0)
        self.scales: torch.Tensor | None = None
        self.row = 0
        self.inner: dict[str, StoredTensor | _Kept] | None = None
        self.rebuild: Callable[[dict[str, Any]], torch.Tensor] | None = None


class Compressor(Stash):
    """Compressed copies of saved tensors for one forward, in one format.

    Args:
        format: what a block becomes (:class:`~remat.compression.Compression`).

    ``original_bytes`` and ``stored_bytes`` count each block once: what the
    compressed tensors took before, and take now; ``bytes_by_dtype`` splits
    them by the tensors' dtype (``{dtype: (original, stored)}``).
    """

    kept_as = "compressed"

    def __init__(self, format: Compression) -> None:
        super().__init__()
        self.format = format
        self.original_bytes = 0
        self.stored_bytes = 0
        self.bytes_by_dtype: dict[torch.dtype, tuple[int, int]] = {}

    def _new_block(self, tensor: torch.Tensor, start: int, length: int, version: int) -> CompressedBlock:
        block = CompressedBlock(tensor.device, tensor.dtype, start, length, version)
        block.row = compressed_row(tensor, start, length)
        self._compress(block, flat_range(tensor.detach(), start, length))
        return block

    def _compact_block(self, tensor: torch.Tensor, version: int) -> CompressedBlock:
        block = CompressedBlock(tensor.device, tensor.dtype, -1, tensor.numel(), version)
        block.compact = True
        parts = unwrapped(tensor.detach())
        if parts is not None:
            inner, block.rebuild = parts
            block.inner = {
                name: self.store(value)
                if isinstance(value, torch.Tensor) and self.format.applies_to(value.dtype)
                else _Kept(value)
                for name, value in inner.items()
            }
            return block
        block.row = tensor.shape[-1] if tensor.dim() else 0
        self._compress(block, tensor.detach().reshape(-1))
        return block

    def _compress(self, block: CompressedBlock, flat: torch.Tensor) -> None:
        block.payload, block.scales = self.format.compress(flat, block.row)
        self._count(flat, block.row)

    def _count(self, flat: torch.Tensor, row: int) -> None:
        original = flat.numel() * flat.element_size()
        stored = self.format.stored_bytes(flat.numel(), flat.dtype, row)
        self.original_bytes += original
        self.stored_bytes += stored
        before = self.bytes_by_dtype.get(flat.dtype, (0, 0))
        self.bytes_by_dtype[flat.dtype] = (before[0] + original, before[1] + stored)

    def restore(self, copy: StoredTensor) -> torch.Tensor:
        """``copy`` decompressed on its device (a view of its block, decompressed once per use)."""
        block = copy.block
        assert isinstance(block, CompressedBlock), "remat bug: a compressor restores its own blocks"
        if block.inner is not None:
            assert block.rebuild is not None, "remat bug: a subclass block without its constructor"
            return block.rebuild({name: part.restore(check_version=False) for name, part in block.inner.items()})
        flat = block.restored() if block.restored is not None else None
        if flat is None:
            flat = self.format.decompress(block.payload, block.scales, block.dtype, block.row)
            block.restored = weakref.ref(flat)
        if block.compact:
            return flat.view(copy.size)
        return flat.as_strided(copy.size, copy.stride, copy.offset)

    # compiled graphs ---------------------------------------------------------

    def pack_in_graph(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a compiled graph saves of ``tensor``: a compact block as plain tensors.

        AOTAutograd traces this into the graph (a graph can save only
        tensors): the compressed values, their scales (an empty tensor for a
        cast), and two empty tensors carrying the dtype and the shape. No
        block sharing or version witness: the graph is functional, and its
        compiler plans its buffers. Nothing is counted: the trace runs once
        for every later call of the graph.
        """
        row = tensor.shape[-1] if tensor.dim() else 0
        payload, scales = self.format.compress(tensor.reshape(-1), row)
        none = payload.new_empty(0) if scales is None else scales
        return payload, none, tensor.new_empty(0), torch.empty(tensor.shape, device="meta")

    def unpack_in_graph(self, packed: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The inverse of :meth:`pack_in_graph`."""
        payload, scales, dtype, shape = packed
        row = shape.shape[-1] if shape.dim() else 0
        restored = self.format.decompress(payload, None if self.format.casts else scales, dtype.dtype, row)
        return restored.reshape(shape.shape)


class CompressedSizes(Compressor):
    """A compressor that only counts: the blocks a :class:`Compressor` would keep, and their
    bytes (:func:`compressed_bytes`'s rule), with nothing compressed.

    Example:
        >>> from remat.compression import compression
        >>> sizes = CompressedSizes(compression("fp8"))
        >>> x = torch.randn(8, 64)
        >>> _ = sizes.store(x[:4]), sizes.store(x[4:])   # views of one storage: one block
        >>> sizes.original_bytes, sizes.stored_bytes
        (2048, 544)
    """

    def _compress(self, block: CompressedBlock, flat: torch.Tensor) -> None:
        self._count(flat, block.row)

    def restore(self, copy: StoredTensor) -> torch.Tensor:
        raise AssertionError("remat bug: a size count has nothing to restore")


class _Kept:
    """What a subclass holds that the format does not shrink (an integer tensor, a
    ``DTensor``'s device mesh on newer torch): as it is."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def restore(self, *, check_version: bool = True) -> Any:
        return self.value
