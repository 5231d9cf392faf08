"""Random programs of nested reentrant regions with closures, differentiated every way.

A program is a list of 3-10 ops on float64 4x4 values (two inputs that
require grad and a constant, then each op's output), as models are written:
parameters, layer norm, a custom ``autograd.Function``, dropout, matmuls, and
an activation with history outside every region (``memory``). Contiguous
spans of ops are wrapped, nested up to depth 3, in ``use_reentrant=True``
checkpoints, or in plain (non-reentrant) ones with or without early stop, so
that a plain region may lie between two reentrant ones. A region takes some
of the values so far as arguments, drawn at random: it may never use some of
them, and it reads every other value it needs by closure, as do the regions
inside it. It may read nothing that requires grad (a span over the constant).

Gradients are taken in each way training code takes them: ``backward``,
``backward`` twice with ``retain_graph``, two losses over one graph,
``autograd.grad``, ``backward(inputs=...)``, a gradient penalty (the input
gradient of one forward, differentiated again beside the loss of a second
forward, as WGAN-GP does), and the gradient of all gradients' norm.

The oracle is the same program without checkpoints, from the same seed. Every
value and every first-order gradient (those a double backward starts from
included) must be equal to the bit. Second-order gradients must be equal to
rounding: the second backward goes through the regions' recomputations,
made in the first backward, so some terms reach a target in another order
than through the unchecked graph, made in the forward
(docs/design/reentrant.md, "Double backward"; the WGAN-GP and R1 steps of
``test_gradient_penalty.py`` are bitwise).

``REMAT_REENTRANT_EXAMPLES`` raises the example count (e.g. 3000 locally).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import remat
from helpers import assert_same, draw_ops

SIZE = 4
N_INPUTS = 3  # x0 and x1 require grad, c does not
HOWS = ["backward", "retain_twice", "two_losses", "grad", "inputs", "penalty", "double"]


class Model:
    """What the program reads by closure: parameters and an activation with
    history outside every region."""

    def __init__(self, x1: torch.Tensor) -> None:
        self.w = torch.randn(SIZE, SIZE, dtype=torch.float64, requires_grad=True)
        self.gain = torch.randn(SIZE, dtype=torch.float64, requires_grad=True)
        self.bias = torch.randn(SIZE, dtype=torch.float64, requires_grad=True)
        self.memory = (x1 @ self.w).tanh()

    def leaves(self) -> list[torch.Tensor]:
        return [self.w, self.gain, self.bias]


class _Scale(torch.autograd.Function):
    """A custom Function that reads its weight in Python, as most do.

    It passes "no gradient" on as None (``set_materialize_grads(False)``): a
    region's node has an edge to each tensor it used, and in a backward where
    none of its gradient reaches that tensor, autograd still runs the tensor's
    node, with None. A Function that turns that into zeros gives the tensors
    behind it zeros where the unchecked run leaves None, here as under torch's
    reentrant checkpoint (docs/design/reentrant.md, "What the stand-ins miss").
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        ctx.set_materialize_grads(False)
        return h * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if grad is None:
            return None, None
        h, w = ctx.saved_tensors
        return grad * w, (grad * h).sum(0)


UNARY: dict[str, Callable[[torch.Tensor, Model], torch.Tensor]] = {
    "sin": lambda v, m: v.sin(),
    "tanh": lambda v, m: v.tanh(),
    "exp": lambda v, m: v.clamp(-3, 3).exp(),
    "dropout": lambda v, m: F.dropout(v, p=0.3, training=True),
    "layer_norm": lambda v, m: F.layer_norm(v, (SIZE,), m.gain, m.bias),
    "param_matmul": lambda v, m: v @ m.w,
    "memory": lambda v, m: v * m.memory + m.memory.sum(0),
    "scale": lambda v, m: _Scale.apply(v, m.gain),
    "transpose": lambda v, m: v.t(),
}
BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "mul": torch.mul,
    "matmul": torch.matmul,
}
OPS = sorted(UNARY) + sorted(BINARY)

Op = tuple[str, tuple[int, ...]]
# ("op", index) or ("region", indices of the values passed as arguments, blocks,
# kind: "reentrant" or "plain", early stop (plain regions), carry (see _Region))
Block = tuple[Any, ...]
KINDS = ["reentrant", "plain"]


@st.composite
def programs(draw: st.DrawFn) -> tuple[list[Op], list[Block], str]:
    n_ops = draw(st.integers(3, 10))
    ops = draw_ops(draw, OPS, BINARY, N_INPUTS, n_ops)
    depth = draw(st.integers(1, 3))
    return ops, _draw_blocks(draw, 0, n_ops, depth), draw(st.sampled_from(HOWS))


def _draw_blocks(draw: st.DrawFn, lo: int, hi: int, depth: int) -> list[Block]:
    blocks: list[Block] = []
    i = lo
    while i < hi:
        if depth > 0 and draw(st.booleans()):
            j = draw(st.integers(i + 1, hi))
            available = list(range(N_INPUTS + i))  # the values made before the region starts
            passed = draw(st.lists(st.sampled_from(available), min_size=1, max_size=3, unique=True))
            inner = _draw_blocks(draw, i, j, depth - 1)
            kind = draw(st.sampled_from(KINDS))
            early_stop = kind == "plain" and draw(st.booleans())
            blocks.append(("region", tuple(passed), inner, kind, early_stop, draw(st.booleans())))
            i = j
        else:
            blocks.append(("op", i))
            i += 1
    return blocks


def _execute(ops: list[Op], blocks: list[Block], values: list[torch.Tensor], model: Model, checked: bool) -> None:
    for block in blocks:
        if block[0] == "op":
            name, args = ops[block[1]]
            if name in BINARY:
                values.append(BINARY[name](values[args[0]], values[args[1]]))
            else:
                values.append(UNARY[name](values[args[0]], model))
            continue
        _, passed, inner, kind, early_stop, carry = block
        region = _Region(ops, inner, values, passed, model, checked, carry)
        arguments = [values[index] for index in passed]
        if not checked:
            produced = region(*arguments)
        elif kind == "reentrant":
            produced = remat.checkpoint(region, *arguments, use_reentrant=True)
        else:
            produced = remat.checkpoint(region, *arguments, use_reentrant=False, early_stop=early_stop)
        values.extend(produced[:-1] if carry else produced)  # the carry is last (see _Region)


class _Region:
    """A checkpointed span: gets the ``passed`` values as arguments, reads every
    other value it needs from ``outer`` by closure, returns the values it made."""

    def __init__(
        self,
        ops: list[Op],
        blocks: list[Block],
        outer: list[torch.Tensor],
        passed: tuple[int, ...],
        model: Model,
        checked: bool,
        carry: bool,
    ) -> None:
        # The values made before the region started (the caller's list grows later).
        self.ops, self.blocks, self.outer, self.passed = ops, blocks, list(outer), passed
        self.model, self.checked, self.carry = model, checked, carry

    def __call__(self, *arguments: torch.Tensor) -> tuple[torch.Tensor, ...]:
        local = list(self.outer)  # closures...
        for index, argument in zip(self.passed, arguments, strict=True):
            local[index] = argument  # ...but what came in as an argument
        start = len(local)
        _execute(self.ops, self.blocks, local, self.model, self.checked)
        if not self.carry:
            # It may read nothing that requires grad: a reentrant region's
            # outputs require grad all the same, and nothing flows back.
            return tuple(local[start:])
        # Drawn: it also returns its first argument, scaled and shifted by a
        # parameter. (Always carrying, every reentrant region read a target, and
        # one reading none inside a plain region in a recomputation was missed.)
        return (*local[start:], arguments[0] * 1.5 + self.model.bias)


def _forward(program: tuple[list[Op], list[Block], str], inputs: list[torch.Tensor], model: Model, checked: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    ops, blocks, _ = program
    values = list(inputs)
    _execute(ops, blocks, values, model, checked)
    produced = values[N_INPUTS:]
    loss = inputs[0].sum() + inputs[1].sum() + sum((v.sum() * 0.5**k for k, v in enumerate(reversed(produced))), torch.zeros((), dtype=torch.float64))
    return produced, loss


def run(program: tuple[list[Op], list[Block], str], seed: int, checked: bool) -> dict[str, Any]:
    """The program's values and gradients; second-order ones under "second"."""
    how = program[2]
    torch.manual_seed(seed)
    x0, x1 = (torch.randn(SIZE, SIZE, dtype=torch.float64, requires_grad=True) for _ in range(2))
    c = torch.randn(SIZE, SIZE, dtype=torch.float64)
    model = Model(x1)
    produced, loss = _forward(program, [x0, x1, c], model, checked)
    loss = loss + model.memory.cos().sum()  # the closure also feeds the loss directly
    wrt = [x0, x1, *model.leaves()]
    out: dict[str, Any] = {"values": produced}
    if how == "backward":
        loss.backward()
        out["grads"] = [t.grad for t in wrt]
    elif how == "retain_twice":
        loss.backward(retain_graph=True)
        out["first"] = [None if t.grad is None else t.grad.clone() for t in wrt]
        loss.backward()
        out["grads"] = [t.grad for t in wrt]
    elif how == "two_losses":
        first_loss: torch.Tensor = sum(v.sum() for v in produced[::2])  # type: ignore[assignment]
        # Unchecked, a sum of constants has no graph; checked, the outputs of a
        # reentrant region that read nothing requiring grad do, and nothing flows.
        if first_loss.requires_grad:
            first_loss.backward(retain_graph=True)
        out["first"] = [None if t.grad is None else t.grad.clone() for t in wrt]
        loss.backward()
        out["grads"] = [t.grad for t in wrt]
    elif how == "grad":
        out["grads"] = torch.autograd.grad(loss, wrt, allow_unused=True)
    elif how == "inputs":
        loss.backward(inputs=wrt[1:])
        out["grads"] = [t.grad for t in wrt]
    elif how == "penalty":  # WGAN-GP: the input gradient of one forward, then a second forward
        (grad,) = torch.autograd.grad(loss, x0, create_graph=True)
        penalty = (grad.pow(2).sum(1) - 1).pow(2).mean()
        _, other = _forward(program, [x0.detach() * 0.5, x1, c], model, checked)
        out["grads"] = [grad]
        out["second"] = torch.autograd.grad(penalty + other, wrt, allow_unused=True)
    else:  # the gradient of the gradients' norm, the loss's own regions in the same pass
        first = torch.autograd.grad(loss, wrt, allow_unused=True, create_graph=True)
        out["grads"] = first
        differentiable = [g for g in first if g is not None and g.requires_grad]
        if differentiable:
            norm = sum(g.pow(2).sum() for g in differentiable)
            out["second"] = torch.autograd.grad(norm, wrt, allow_unused=True)  # type: ignore[arg-type]
        else:  # (checked, a gradient may have a graph through a region that read no
            # target, as its outputs require grad: it leads to no input, no second order)
            out["second"] = (None,) * len(wrt)
    return out


def assert_matches_unchecked(program: tuple[list[Op], list[Block], str], seed: int) -> None:
    got, want = run(program, seed, checked=True), run(program, seed, checked=False)
    second_got, second_want = got.pop("second", None), want.pop("second", None)
    assert_same(got, want)
    if second_want is None:
        assert second_got is None
        return
    for a, e in zip(second_got, second_want, strict=True):
        assert (a is None) == (e is None)
        if e is not None:
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


EXAMPLES = int(os.environ.get("REMAT_REENTRANT_EXAMPLES", "150"))


# Found by this test once regions could be plain and read only the constant:
# a reentrant region over the constant, inside a plain region inside a
# reentrant one, had outputs that required grad in the plain region's forward
# (made in the outer recomputation) but not in its recomputation, which saved
# fewer tensors (RecomputeMismatchError); directly inside the reentrant region,
# its backward raised "none of the outputs requires grad".
_DROPOUTS: list[Op] = [("dropout", (0,))] * 4 + [("dropout", (2,))]
_READS_NO_INPUT = (
    _DROPOUTS,
    [*(("op", i) for i in range(4)),
     ("region", (0,), [("region", (0,), [("region", (0,), [("op", 4)], "reentrant", False, False)], "plain", False, False)],
      "reentrant", False, False)],
    "backward",
)
_READS_NO_INPUT_NESTED = (
    _DROPOUTS,
    [*(("op", i) for i in range(4)),
     ("region", (0,), [("region", (0,), [("op", 4)], "reentrant", False, False)], "reentrant", False, False)],
    "backward",
)

# Found the same way: under a penalty, a reentrant region inside a plain region
# made what a region nested in another reentrant region gets (and never reads).
# The nested region's backward, in its enclosing region's nested backward,
# replaced the producer's kept recomputation: the producer then unpacked its
# saved tensors twice in one backward call (CheckpointError).
_PRODUCER_IN_PLAIN = (
    [("dropout", (0,))] * 9,
    [("region", (0,), [("region", (0,), [("op", 0)], "reentrant", False, False)], "plain", False, False),
     ("region", (0,), [("region", (3,), [("op", i) for i in range(1, 9)], "reentrant", False, False)],
      "reentrant", False, False)],
    "penalty",
)

# And: a plain region's pack hook asked Tensor._is_view() of the parameter it
# saved, in the enclosing reentrant region's recomputation only; counted as a
# use, x0's gradient from the custom Function was added at another edge
# (equal to rounding, not bitwise).
_QUERY_IN_PLAIN = (
    [("dropout", (0,)), ("scale", (0,)), ("dropout", (0,))],
    [("region", (0,), [("region", (0,), [("op", 0), ("op", 1)], "plain", False, False)], "reentrant", False, False),
     ("op", 2)],
    "backward",
)

# And: a reentrant region that drops the carry of a plain region inside it
# (x0 * 1.5 + bias: dead code) returns only constants; its backward raised
# "none of the outputs requires grad" where the unchecked program runs.
_DEAD_CODE = (
    [("dropout", (2,))] * 2 + [("dropout", (0,))] * 6,
    [("region", (0,), [("region", (0,), [("op", 0), ("op", 1)], "plain", False, True)], "reentrant", False, False),
     *(("op", i) for i in range(2, 8))],
    "backward",
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(program=programs(), seed=st.integers(0, 2**31 - 1))
@example(program=_READS_NO_INPUT, seed=0)
@example(program=_READS_NO_INPUT_NESTED, seed=0)
@example(program=_PRODUCER_IN_PLAIN, seed=0)
@example(program=_QUERY_IN_PLAIN, seed=0)
@example(program=_DEAD_CODE, seed=0)
def test_random_reentrant_program_matches_unchecked(program: tuple[list[Op], list[Block], str], seed: int) -> None:
    assert_matches_unchecked(program, seed)
