"""Saved tensors kept smaller on their device: the compressed stash.

Layer: engine (imports ``transfer``, ``_compat`` and the bottom layer's
``compression``). Loaded with the first compressed tensor: a program that never
compresses does not import it.

A :class:`Compressor` is the stash of one forward (a ``remat.compress`` block,
a selective region's cache, a region's inputs) for one format. Like the host
transfer it works on *blocks*, contiguous ranges of a storage shared by all
the views saved from it (:meth:`~remat._engine.transfer.Stash.store`): ``q``,
``k`` and ``v`` split from one projection are compressed once, with the rows
and scales of the projection's output. Restoring decompresses the whole
block once per backward and hands out views of it, so views restored
together share one buffer again, as in the forward.

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
from remat._engine.transfer import Block, Stash, StoredTensor, _flat_range, _plain_strided
from remat.compression import Compression

__all__ = ["CompressedBlock", "Compressor"]


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

    @property
    def stored_bytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.payload.numel() * self.payload.element_size() + scales


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

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Float tensors that the format makes smaller (never integer or bool tensors)."""
        return self.format.applies_to(tensor.dtype)

    def _new_block(self, tensor: torch.Tensor, start: int, length: int, version: int) -> CompressedBlock:
        if not _plain_strided(tensor):
            return self._compact_block(tensor, version)
        base = base_of(tensor)
        storage_elements = tensor.untyped_storage().nbytes() // tensor.element_size()
        if 2 * length >= storage_elements:  # the whole storage: offsets stay exact, rows line up
            start, length = 0, storage_elements
        block = CompressedBlock(tensor.device, tensor.dtype, start, length, version)
        row = _row_of(base)
        block.row = row if row and start % row == 0 and length % row == 0 else 0
        self._compress(block, _flat_range(tensor.detach(), start, length))
        return block

    def _compact_block(self, tensor: torch.Tensor, version: int) -> CompressedBlock:
        block = CompressedBlock(tensor.device, tensor.dtype, -1, tensor.numel(), version)
        block.compact = True
        parts = unwrapped(tensor.detach())
        if parts is not None:
            inner, block.rebuild = parts
            block.inner = {
                name: self.store(value) if isinstance(value, torch.Tensor) and self.accepts(value) else _Kept(value)
                for name, value in inner.items()
            }
            return block
        block.row = tensor.shape[-1] if tensor.dim() else 0
        self._compress(block, tensor.detach().reshape(-1))
        return block

    def _compress(self, block: CompressedBlock, flat: torch.Tensor) -> None:
        block.payload, block.scales = self.format.compress(flat, block.row)
        original, stored = flat.numel() * flat.element_size(), block.stored_bytes
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


class _Kept:
    """What a subclass holds that the format does not shrink (an integer tensor, a
    ``DTensor``'s device mesh on newer torch): as it is."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def restore(self, *, check_version: bool = True) -> Any:
        return self.value


def _row_of(base: torch.Tensor) -> int:
    """The row length of a storage: its base tensor's last dimension, when that is contiguous."""
    if base.dim() == 0 or not base.is_contiguous():
        return 0
    return int(base.shape[-1])
