"""remat.errors: every error remat raises on purpose is a RematError that is also the
built-in a caller would catch, and bad input to the front-ends says what was wrong.

That no bare built-in is raised on purpose in ``src/`` is checked in
``tests/repo/test_error_tree.py``.
"""

from __future__ import annotations

import pytest
import torch

import remat
from remat.errors import (
    CheckpointTypeError,
    CheckpointUsageError,
    DeviceStateError,
    RecomputeMismatchError,
    RematError,
)


def test_error_hierarchy_matches_builtins() -> None:
    assert issubclass(remat.CheckpointError, RuntimeError)
    assert issubclass(RecomputeMismatchError, remat.CheckpointError)
    assert issubclass(CheckpointUsageError, ValueError)
    assert issubclass(CheckpointTypeError, TypeError)
    assert issubclass(DeviceStateError, RuntimeError)
    for cls in (CheckpointUsageError, CheckpointTypeError, DeviceStateError):
        assert issubclass(cls, RematError)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda x: remat.checkpoint(42, x), TypeError),
        (lambda x: remat.checkpoint(torch.sin, x, determinism_check="strict"), ValueError),
        (lambda x: remat.checkpoint(torch.sin, x, use_reentrant="yes"), TypeError),
        (lambda x: remat.checkpoint(torch.sin, x, context_fn=3), TypeError),
        (lambda x: remat.checkpoint(torch.sin, x, context_fn=lambda: 3), TypeError),
        (lambda x: remat.checkpoint(torch.sin, x, use_reentrant=True, debug=True), ValueError),
        (lambda x: remat.checkpoint(torch.add, x, use_reentrant=True, other=x), ValueError),
        (lambda x: remat.checkpointed(torch.sin, early_stopp=True), ValueError),
        (lambda x: remat.checkpoint_sequential([torch.sin], 0, x), ValueError),
        (lambda x: remat.checkpoint_sequential([torch.sin], 2, x), ValueError),
        (lambda x: remat.checkpoint_sequential([torch.sin], 1, x, foo=1), ValueError),
    ],
)
def test_bad_input_gets_a_clear_error(call, error) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(error) as info:
        call(x)
    assert isinstance(info.value, RematError)
    assert "remat." in str(info.value)
