"""Formats for keeping saved tensors smaller: the fourth storage choice's arithmetic.

Layer: bottom (imports ``errors`` only). What a format does to one flat range
of a storage, and what it costs in bytes. Which tensors are compressed is
decided in one place (``storage/choice.py``, ``decide``), for a policy, the
``remat.compress`` context and a region's ``compress_inputs`` alike; where
they are kept and when they are restored is ``storage/compressed.py``'s
(``docs/design/compression.md``).

Formats, by their short names:

========== ============================== =======================================
name       stored as                      scale
========== ============================== =======================================
``bf16``   bfloat16 (from float32 only)   none
``fp16``   float16 (from float32 only)    none; values beyond +-65504 saturate
``fp8``    float8 e4m3 (448 at most)      per row (default) or per tensor
``fp8_e5m2`` float8 e5m2 (57344 at most)  per row (default) or per tensor
``int8``   int8, symmetric, round to      per row (default) or per tensor
           nearest
========== ============================== =======================================

A *row* is the innermost dimension of the storage the tensor lives in (the
last dimension of a contiguous base): views of one storage share its rows
and its scales. A storage range that is not whole rows is scaled per tensor.
Scales are float32 (4 bytes a row). Compressing and restoring run in float32.

Example:
    >>> import torch
    >>> fp8 = compression("fp8")
    >>> x = torch.randn(4, 64)
    >>> payload, scales = fp8.compress(x.reshape(-1), row=64)
    >>> payload.dtype, tuple(scales.shape)
    (torch.float8_e4m3fn, (4,))
    >>> restored = fp8.decompress(payload, scales, torch.float32, row=64)
    >>> bool((restored - x.reshape(-1)).abs().max() < 0.1 * x.abs().max())
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from remat.errors import CheckpointTypeError, CheckpointUsageError

__all__ = ["FORMATS", "Compression", "FormatName", "Scale", "compression"]

FormatName = Literal["bf16", "fp16", "fp8", "fp8_e5m2", "int8"]
Scale = Literal["row", "tensor", "none"]

FORMATS: tuple[str, ...] = ("bf16", "fp16", "fp8", "fp8_e5m2", "int8")
"""The format names ``remat.compress`` and the policies accept."""

_STORED = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
_LARGEST = {"fp8": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0, "fp16": 65504.0}
_SCALE_BYTES = 4  # float32 scales


@dataclass(frozen=True)
class Compression:
    """One format for compressed saved tensors (see the module docstring).

    Build it with :func:`compression` (``"fp8"``, ``"int8"``...); the fields are
    the format's name and how its scales are kept.

    Example:
        >>> compression("int8").stored_bytes(numel=4096, dtype=torch.float32, row=64)
        4352
    """

    format: FormatName
    scale: Scale

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of the compressed values."""
        return _STORED[self.format]

    @property
    def casts(self) -> bool:
        """bf16 and fp16: a cast of float32 values, no scale."""
        return self.scale == "none"

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Whether a tensor of ``dtype`` gets smaller in this format.

        Casts apply to float32 only (a bf16 or fp16 tensor is as small
        already); scaled formats to every floating dtype wider than a byte.
        """
        if self.casts:
            return dtype == torch.float32
        return dtype.is_floating_point and _itemsize(dtype) > 1

    def stored_bytes(self, numel: int, dtype: torch.dtype, row: int) -> int:
        """Bytes that ``numel`` values of ``dtype`` take compressed, with rows of ``row``
        values (0: one scale for the whole range)."""
        if not self.applies_to(dtype):
            return numel * _itemsize(dtype)
        values = numel * _itemsize(self.stored_dtype)
        if self.casts:
            return values
        rows = numel // row if self.scale == "row" and row and numel % row == 0 else 1  # as _rows splits
        return values + rows * _SCALE_BYTES

    def compress(self, flat: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The compressed values of a 1-D tensor and their scales (None for a cast).

        ``row`` is the row length (0 or a length that does not divide the
        range: one scale for all). Runs without grad; the input is not changed.
        """
        with torch.no_grad():
            if self.casts:
                wide = flat.float()
                if self.format == "fp16":
                    wide = wide.clamp(-_LARGEST["fp16"], _LARGEST["fp16"])
                return wide.to(self.stored_dtype), None
            rows = self._rows(flat.float(), row)
            largest = rows.abs().amax(dim=1, keepdim=True)
            scales = torch.where(largest > 0, largest / _LARGEST[self.format], torch.ones_like(largest))
            scaled = rows / scales
            if self.format == "int8":
                scaled = scaled.round_().clamp_(-127.0, 127.0)
            return scaled.to(self.stored_dtype).reshape(-1), scales.reshape(-1)

    def decompress(
        self, payload: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype, row: int
    ) -> torch.Tensor:
        """The values again, as a 1-D tensor of ``dtype`` (the inverse of :meth:`compress`)."""
        with torch.no_grad():
            if scales is None:
                return payload.to(dtype)
            rows = self._rows(payload.float(), row if scales.numel() > 1 else 0)
            return (rows * scales.reshape(-1, 1)).reshape(-1).to(dtype)

    def _rows(self, flat: torch.Tensor, row: int) -> torch.Tensor:
        if self.scale == "row" and row and flat.numel() % row == 0:
            return flat.reshape(-1, row)
        return flat.reshape(1, -1)

    def __str__(self) -> str:
        default = "none" if self.format in ("bf16", "fp16") else "row"
        return self.format if self.scale == default else f"{self.format} ({self.scale} scale)"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def compression(spec: str | Compression, *, scale: Scale | None = None, api: str = "remat.compress") -> Compression:
    """The :class:`Compression` a short name stands for (``"fp8"``, ``"int8"``, ...).

    ``scale`` picks per-row (default) or per-tensor scales for the scaled
    formats. Unknown names and impossible combinations raise an error naming
    ``api`` and the accepted values.

    Example:
        >>> compression("fp8", scale="tensor")
        Compression(format='fp8', scale='tensor')
    """
    if isinstance(spec, Compression):
        if scale is not None and scale != spec.scale:
            return compression(spec.format, scale=scale, api=api)
        return spec
    if not isinstance(spec, str):
        raise CheckpointTypeError(
            f"{api}: the format must be a string such as 'fp8', got {type(spec).__name__}. "
            f"Formats: {', '.join(FORMATS)}."
        )
    name = spec.lower()
    if name not in _STORED:
        raise CheckpointUsageError(
            f"{api}: unknown compression format {spec!r}. Formats: {', '.join(FORMATS)} "
            "('fp8' is e4m3 with per-row scales; pass scale='tensor' for one scale per tensor)."
        )
    if name in ("bf16", "fp16"):
        if scale not in (None, "none"):
            raise CheckpointUsageError(
                f"{api}: {name} is a cast of float32 values and has no scale; got scale={scale!r}."
            )
        return Compression(name, "none")  # type: ignore[arg-type]
    if scale not in (None, "row", "tensor"):
        raise CheckpointUsageError(f"{api}: scale must be 'row' or 'tensor', got {scale!r}.")
    return Compression(name, scale or "row")  # type: ignore[arg-type]
