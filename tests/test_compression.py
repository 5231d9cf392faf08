"""The formats of compressed saved tensors (``remat/compression.py``): arithmetic, bytes, bad input.

The bounds are the formats' own: a per-row scaled value is off by at most half
a step of its row's grid (int8: ``amax / 254``; fp8 e4m3: 2**-4 of the value's
own magnitude, plus the subnormal floor), a cast by the target's rounding.
"""

from __future__ import annotations

import pytest
import torch

from remat.compression import FORMATS, Compression, compression
from remat.errors import CheckpointTypeError, CheckpointUsageError


def rows(seed: int = 0, shape: tuple[int, int] = (16, 96)) -> torch.Tensor:
    """Rows of very different magnitudes: per-row scales must keep them apart."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 3, shape[0]).unsqueeze(1)
    return torch.randn(shape, generator=g) * magnitudes


def round_trip(fmt: str, x: torch.Tensor, *, scale: str | None = None) -> torch.Tensor:
    spec = compression(fmt, scale=scale)  # type: ignore[arg-type]
    payload, scales = spec.compress(x.reshape(-1), x.shape[-1])
    return spec.decompress(payload, scales, x.dtype, x.shape[-1]).reshape(x.shape)


def test_int8_rows_are_within_half_a_step_of_their_own_scale() -> None:
    x = rows()
    error = (round_trip("int8", x) - x).abs()
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert bool((error <= step / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize(("fmt", "mantissa"), [("fp8", 3), ("fp8_e5m2", 2)])
def test_fp8_keeps_each_value_to_its_mantissa(fmt: str, mantissa: int) -> None:
    x = rows()
    error = (round_trip(fmt, x) - x).abs()
    scale = x.abs().amax(dim=1, keepdim=True) / (448.0 if fmt == "fp8" else 57344.0)
    # relative rounding of a normal number, and the smallest subnormal step of the row's grid
    floor = scale * (2.0**-9 if fmt == "fp8" else 2.0**-16)
    assert bool((error <= x.abs() * 2.0 ** -(mantissa + 1) + floor).all())


def test_per_row_scales_do_better_than_one_scale_on_rows_of_different_sizes() -> None:
    x = rows()
    per_row = (round_trip("int8", x) - x).norm() / x.norm()
    small_rows = x[:4]
    per_tensor_small = (round_trip("int8", x, scale="tensor")[:4] - small_rows).norm() / small_rows.norm()
    per_row_small = (round_trip("int8", x)[:4] - small_rows).norm() / small_rows.norm()
    assert per_row < 0.01
    assert per_tensor_small > 100 * per_row_small  # one scale wipes out the small rows


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_casts_round_float32_like_the_target_dtype(fmt: str) -> None:
    x = rows()[4:12]  # within fp16's range
    target = torch.bfloat16 if fmt == "bf16" else torch.float16
    assert torch.equal(round_trip(fmt, x), x.to(target).float())


def test_fp16_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([[1e6, -1e6, 3.0]])
    assert round_trip("fp16", x).tolist() == [[65504.0, -65504.0, 3.0]]


def test_zero_rows_stay_zero() -> None:
    x = torch.zeros(3, 64)
    for fmt in ("fp8", "fp8_e5m2", "int8"):
        assert torch.equal(round_trip(fmt, x), x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stored_bytes_are_the_bytes_compress_makes(fmt: str, dtype: torch.dtype) -> None:
    spec = compression(fmt)
    x = rows().to(dtype)
    if not spec.applies_to(dtype):
        assert spec.stored_bytes(x.numel(), dtype, 96) == x.numel() * x.element_size()
        return
    payload, scales = spec.compress(x.reshape(-1), 96)
    made = payload.numel() * payload.element_size() + (0 if scales is None else scales.numel() * 4)
    assert spec.stored_bytes(x.numel(), dtype, 96) == made


def test_which_dtypes_each_format_shrinks() -> None:
    assert compression("bf16").applies_to(torch.float32)
    assert not compression("bf16").applies_to(torch.bfloat16)  # as small already
    assert compression("fp8").applies_to(torch.bfloat16)
    for fmt in FORMATS:
        for dtype in (torch.int64, torch.int8, torch.bool, torch.float8_e4m3fn):
            assert not compression(fmt).applies_to(dtype)


def test_format_names_and_scales_parse_once() -> None:
    assert compression("FP8") == Compression("fp8", "row")
    assert compression("fp8", scale="tensor") == Compression("fp8", "tensor")
    assert compression(compression("int8")) == Compression("int8", "row")
    assert str(compression("int8", scale="tensor")) == "int8 (tensor scale)"


@pytest.mark.parametrize(
    ("spec", "scale", "error", "words"),
    [
        ("fp4", None, CheckpointUsageError, "unknown compression format 'fp4'"),
        (8, None, CheckpointTypeError, "must be a string such as 'fp8'"),
        ("bf16", "row", CheckpointUsageError, "has no scale"),
        ("int8", "column", CheckpointUsageError, "scale must be 'row' or 'tensor'"),
    ],
)
def test_bad_formats_say_what_is_accepted(spec: object, scale: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        compression(spec, scale=scale, api="my_api")  # type: ignore[arg-type]
