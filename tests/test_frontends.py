"""Front-end regressions of issue 13 (items 7-11, 13): each test names its item.

Oracles: the same program run without checkpointing (bitwise on CPU), and
torch's own selective checkpointing where the torch version has it.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import remat
import remat.policies as P
from remat.errors import PolicyError

MM = torch.ops.aten.mm.default


def attention_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Self-attention with a residual and a norm, written with operators (``@``, ``+``)."""
    q = x @ w
    scores = (q @ x.transpose(-1, -2)).softmax(-1)
    return torch.nn.functional.layer_norm(x + scores @ q, x.shape[-1:])


# --- item 10: a bad policy is a PolicyError, never "unsupported operand" -----------------


def _returns_none(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return None


def _returns_string(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return "save"


def _wrong_signature(op: Any) -> bool:
    return True


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (_returns_none, r"_returns_none returned None for op aten\.mm\.default"),
        (_returns_string, r"_returns_string returned 'save' for op aten\.mm\.default"),
        (_wrong_signature, r"_wrong_signature raised TypeError for op aten\.mm\.default.*takes 1"),
        (P.first_of(_returns_none), r"_returns_none returned None"),
    ],
)
@pytest.mark.parametrize("via", ["policy", "context_fn"])
def test_item10_bad_policy_under_an_operator_names_policy_op_and_value(
    policy: Any, expected: str, via: str
) -> None:
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    options: dict[str, Any] = (
        {"policy": policy}
        if via == "policy"
        else {"context_fn": functools.partial(remat.create_selective_checkpoint_contexts, policy)}
    )
    with pytest.raises(PolicyError, match=expected) as info:
        remat.checkpoint(attention_block, x, w, **options)
    assert not isinstance(info.value, TypeError)  # a TypeError would become "unsupported operand"
    assert info.value.op is MM
    assert "policy(ctx, op, *args, **kwargs)" in str(info.value)
    # The failed region left nothing behind: the same program then runs and matches.
    out = remat.checkpoint(attention_block, x, w, policy=P.save_matmuls)
    got = torch.autograd.grad(out.sum(), (x, w))
    want = torch.autograd.grad(attention_block(x, w).sum(), (x, w))
    assert all(torch.equal(g, r) for g, r in zip(got, want, strict=True))
