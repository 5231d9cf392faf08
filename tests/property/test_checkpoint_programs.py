"""Random programs, randomly checkpointed, must give bitwise the unchecked gradients.

A program is a DAG of 3-10 differentiable ops on 4x4 tensors (each op reads
earlier values by index). Contiguous spans of ops are wrapped in checkpoints,
nested up to depth 3, each with a random early-stop setting and
preserve_rng_state=True (dropout included). Gradients w.r.t. the inputs and a
closed-over parameter, taken in a random way (autograd.grad, backward,
repeated backward with retain_graph, double backward), must match the same
program run unchecked from the same seed, and remat must match torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import (
    IMPL_NAMES,
    PLAIN,
    TORCH,
    Impl,
    assert_same,
    draw_nested_blocks,
    draw_ops,
    get_impl,
    remat_impl,
)

SIZE = 4
UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sin": torch.sin,
    "cos": torch.cos,
    "tanh": torch.tanh,
    "exp": lambda v: v.clamp(-3, 3).exp(),
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "dropout": lambda v: F.dropout(v, p=0.3, training=True),
    "sum0": lambda v: v.sum(0, keepdim=True).expand(SIZE, SIZE),
    "sum1": lambda v: v.sum(1, keepdim=True).expand(SIZE, SIZE),
}
BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mul": torch.mul,
    "add": torch.add,
    "matmul": torch.matmul,
}
OPS = sorted(UNARY) + sorted(BINARY) + ["param_matmul"]
N_INPUTS = 3  # x0 and x1 require grad, c does not

Op = tuple[str, tuple[int, ...]]
# ("op", i) or ("ck", early_stop, blocks)
Block = tuple[str, int] | tuple[str, bool, list[Any]]


@st.composite
def programs(draw: st.DrawFn) -> tuple[list[Op], list[Block]]:
    n_ops = draw(st.integers(3, 10))
    ops: list[Op] = draw_ops(draw, OPS, BINARY, N_INPUTS, n_ops)
    depth = draw(st.integers(0, 3))
    return ops, draw_nested_blocks(draw, 0, n_ops, depth)


def _execute(
    ck: Impl, ops: list[Op], blocks: list[Block], values: list[torch.Tensor], w: torch.Tensor
) -> None:
    for block in blocks:
        if block[0] == "op":
            name, args = ops[block[1]]
            if name == "param_matmul":
                values.append(values[args[0]] @ w)
            else:
                fn = UNARY.get(name) or BINARY[name]
                values.append(fn(*(values[a] for a in args)))
        else:
            _, early_stop, inner = block
            values.extend(
                ck.checkpoint(
                    _region,
                    ck,
                    ops,
                    inner,
                    w,
                    *values,
                    early_stop=early_stop,
                    preserve_rng_state=True,
                )
            )


def _region(
    ck: Impl, ops: list[Op], blocks: list[Block], w: torch.Tensor, *values: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """A checkpointed span: takes every value so far, returns the new ones."""
    all_values = list(values)
    _execute(ck, ops, blocks, all_values, w)
    return tuple(all_values[len(values) :])


def run(ck: Impl, program: tuple[list[Op], list[Block]], seed: int, how: str) -> Any:
    ops, blocks = program
    torch.manual_seed(seed)
    x0, x1 = (
        torch.randn(SIZE, SIZE, requires_grad=True),
        torch.randn(SIZE, SIZE, requires_grad=True),
    )
    c = torch.randn(SIZE, SIZE)
    w = torch.randn(SIZE, SIZE, requires_grad=True)  # a parameter reached by closure
    values = [x0, x1, c]
    _execute(ck, ops, blocks, values, w)
    # every value feeds the loss (x0 makes sure something requires grad)
    loss = x0.sum() + sum(v.sum() * 0.5**k for k, v in enumerate(reversed(values[N_INPUTS:])))
    wrt = (x0, x1, w)
    if how == "grad":
        return values[N_INPUTS:], torch.autograd.grad(loss, wrt, allow_unused=True)
    if how == "backward-twice":
        loss.backward(retain_graph=True)
        first = [None if t.grad is None else t.grad.clone() for t in wrt]
        loss.backward()
        return values[N_INPUTS:], first, [t.grad for t in wrt]
    # double backward: the gradient of the gradients' squared norm
    first = torch.autograd.grad(loss, wrt, allow_unused=True, create_graph=True)
    differentiable = [g for g in first if g is not None and g.requires_grad]
    if not differentiable:
        return values[N_INPUTS:], first
    norm = sum((g * g).sum() for g in differentiable)
    return values[N_INPUTS:], first, torch.autograd.grad(norm, wrt, allow_unused=True)


HOW = st.sampled_from(["grad", "backward-twice", "double"])
SEED = st.integers(0, 2**31 - 1)


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
@settings(max_examples=200, deadline=None)
@given(program=programs(), seed=SEED, how=HOW)
def test_random_checkpointed_program_matches_unchecked(
    impl_name: str, program: tuple[list[Op], list[Block]], seed: int, how: str
) -> None:
    assert_same(run(get_impl(impl_name), program, seed, how), run(PLAIN, program, seed, how))


@settings(max_examples=200, deadline=None)
@given(program=programs(), seed=SEED, how=HOW)
def test_random_program_remat_matches_upstream(
    program: tuple[list[Op], list[Block]], seed: int, how: str
) -> None:
    assert_same(run(remat_impl(), program, seed, how), run(TORCH, program, seed, how))
