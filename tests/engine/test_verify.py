"""remat/_engine/verify.py: the determinism check and the debug log.

A recomputation that saves something other than the forward did is a
``RecomputeMismatchError`` at the first difference; with ``debug=True`` the
error names the first operator that differs and the user's source line.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import remat
from helpers import live_frames
from remat.errors import RecomputeMismatchError


def test_mismatch_error_has_structured_fields() -> None:
    sizes = iter([4, 2])
    x = torch.randn(4, 3, requires_grad=True)
    y = remat.checkpoint(lambda t: t[: next(sizes)].sin(), x)
    with pytest.raises(RecomputeMismatchError) as info:
        y.sum().backward()
    err = info.value
    assert err.index == 0
    assert err.forward is not None and err.forward.shape == (4, 3)
    assert err.recompute is not None and err.recompute.shape == (2, 3)
    assert "debug=True" in str(err)
    assert live_frames() == [] or all(not f.stores for f in live_frames())


def test_debug_names_first_differing_op_and_source_line() -> None:
    sizes = iter([4, 2])

    def fn(t: torch.Tensor) -> torch.Tensor:
        cut = t[: next(sizes)]  # the line the error must point at
        return cut.exp()

    x = torch.randn(4, 3, requires_grad=True)
    with remat.set_checkpoint_debug_enabled(True):
        y = remat.checkpoint(fn, x)
    with pytest.raises(RecomputeMismatchError) as info:
        y.sum().backward()
    text = str(info.value)
    assert "First operator that differs" in text
    assert "aten.slice.Tensor" in text
    assert f"{__file__}:" in text and "in fn" in text
    assert info.value.op_hint is not None and "aten.slice" in info.value.op_hint


def test_debug_argument_overridden_by_context() -> None:
    sizes = iter([4, 2])
    x = torch.randn(4, 3, requires_grad=True)
    with remat.set_checkpoint_debug_enabled(False):
        y = remat.checkpoint(lambda t: t[: next(sizes)].exp(), x, debug=True)
    with pytest.raises(RecomputeMismatchError) as info:
        y.sum().backward()
    text = str(info.value)
    assert "First operator that differs" not in text
    # The user did pass debug=True: the tip names what turned it off instead.
    assert "pass debug=True" not in text
    assert "set_checkpoint_debug_enabled(False)" in text and "overrides" in text


# Debug logs name the first real divergence: both logs leave out
# the detaches checkpointing adds, and the error points at the line where the
# recomputation first ran something else. Each function below diverges on
# its second call at the line marked "diverges".


def _shape(x: torch.Tensor, first: bool) -> torch.Tensor:
    y = x.sin()
    return (y if first else y[:2]).exp()  # diverges: exp (forward) vs slice


def _op(x: torch.Tensor, first: bool) -> torch.Tensor:
    y = x * 2 if first else x.sin()  # diverges: mul saves nothing, sin saves x
    return y.exp()


def _dtype(x: torch.Tensor, first: bool) -> torch.Tensor:
    y = x.to(torch.float64 if first else torch.float16)  # diverges: the copy's dtype
    return y.exp()


def _more(x: torch.Tensor, first: bool) -> torch.Tensor:
    y = x if first else x.sin()  # diverges: an extra op
    return y.exp()


def _fewer(x: torch.Tensor, first: bool) -> torch.Tensor:
    y = x.exp()
    return y.sin() if first else y  # diverges: the forward's sin is not rerun


@pytest.mark.parametrize(
    ("function", "forward_op", "recompute_op", "heading"),
    [
        (_shape, "aten.exp.default", "aten.slice.Tensor", "First operator that differs (#1)"),
        (_op, "aten.mul.Tensor", "aten.sin.default", "First operator that differs (#0)"),
        (_dtype, "aten._to_copy.default", "aten._to_copy.default", "First operator that differs (#0)"),
        (_more, "aten.exp.default", "aten.sin.default", "First operator that differs (#0)"),
        (_fewer, "aten.sin.default", None, "did not run operator #1"),
    ],
    ids=["shape", "op", "dtype", "count-more", "count-fewer"],
)
def test_debug_names_the_real_first_divergence(
    function: Any, forward_op: str, recompute_op: str | None, heading: str
) -> None:
    lines, start = inspect.getsourcelines(function)
    line = start + next(i for i, text in enumerate(lines) if "# diverges" in text)
    calls = iter([True, False])
    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(lambda t: function(t, next(calls)), x, debug=True, early_stop=False)
    with pytest.raises(RecomputeMismatchError) as info:
        y.float().sum().backward()
    text = str(info.value)
    assert heading in text
    hint = info.value.op_hint
    assert hint is not None
    assert hint.startswith(recompute_op or forward_op)
    assert f"{__file__}:{line} in {function.__name__}" in hint
    divergence = text.split("Operators of the original forward")[0]
    assert forward_op in divergence
    assert "aten.detach" not in text  # neither log lists checkpointing's own detaches


def test_fewer_saved_tensors_is_reported() -> None:
    flags = iter([True, False])

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t.exp().sin() if next(flags) else t * 2

    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(fn, x, early_stop=False)
    with pytest.raises(remat.CheckpointError, match="fewer"):
        y.sum().backward()


def test_determinism_check_none_skips_the_check() -> None:
    scales = iter([2.0, 3.0])
    x = torch.randn(3, requires_grad=True)
    # Same shapes, different values: no check can see it; "none" must not raise.
    y = remat.checkpoint(lambda t: (t * next(scales)).sin(), x, determinism_check="none")
    y.sum().backward()
    assert x.grad is not None
