"""remat.policies: a policy that answers badly is a PolicyError naming the policy, the op and
what it returned (never Python's "unsupported operand"); combinators check their policies
when built.

Oracle: the same program run without checkpointing, after the failed region.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import remat
import remat.policies as P
from helpers import attention_block
from remat.errors import CheckpointTypeError, PolicyError

MM = torch.ops.aten.mm.default


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
def test_bad_policy_under_an_operator_names_policy_op_and_value(
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


@pytest.mark.parametrize("combine", [P.first_of, P.save_any_of])
def test_combinator_of_a_non_callable_fails_when_built(combine: Any) -> None:
    with pytest.raises(
        CheckpointTypeError, match=r"every policy must be callable.*policy 1 is str"
    ):
        combine(P.save_matmuls, "save")


def test_policy_error_names_a_builtin_policy_by_its_reason() -> None:
    class Undecided(P.Policy):
        def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            return None

    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(
        PolicyError, match=r"policy Undecided\('never decides'\) returned None"
    ) as info:
        remat.checkpoint(lambda t: t @ t, x, policy=Undecided(reason="never decides"))
    assert len(str(info.value)) < 400
