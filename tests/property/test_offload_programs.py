"""Random programs mixing offload, offloading policies, names and nesting: bitwise the unchecked gradients.

A program is a tree over a residual stream ``x`` (float64, 6x8). Leaves are
layers people write (a pre-norm residual MLP with named ``fc1``/``ln``
outputs, a small attention whose q/k/v are strided views of one projection
and whose scores are named, strided views and in-place writes, a residual
loop reusing one weight). Inner nodes wrap their children in
``remat.offload(min_bytes=...)``, ``remat.no_offload()``, a checkpoint with a
policy (none, ``save_matmuls``, ``offload_names``, a decision table with
``MUST_OFFLOAD``/``PREFER_OFFLOAD``, a combination), or
``checkpoint_sequential``. Gradients of the inputs and every parameter are
compared with ``torch.equal`` to the same layers run plainly, and the checked
program is run twice in one process, so that freed addresses are reused (a saved
tensor must never be found by its address).

``REMAT_OFFLOAD_EXAMPLES`` raises the example count (e.g. 5000 locally).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remat
import remat.policies as P

ROWS, D = 6, 8
KINDS = ("mlp", "attention", "views", "inplace", "loop")

Node = tuple[Any, ...]
# ("layer", kind, slot) | ("offload", min_bytes, children) | ("no_offload", children)
# | ("ck", policy, early_stop, children) | ("seq", segments, children)


def _table(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> P.CheckpointPolicy:
    return _TABLE.get(op, P.CheckpointPolicy.PREFER_RECOMPUTE)


_TABLE = {
    torch.ops.aten.mm.default: P.CheckpointPolicy.MUST_OFFLOAD,
    torch.ops.aten.addmm.default: P.CheckpointPolicy.PREFER_OFFLOAD,
    torch.ops.aten.native_layer_norm.default: P.CheckpointPolicy.MUST_OFFLOAD,
    torch.ops.aten.gelu.default: P.CheckpointPolicy.MUST_SAVE,
    torch.ops.aten.tanh.default: P.CheckpointPolicy.PREFER_OFFLOAD,
}

POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "save_matmuls": P.save_matmuls,
    "offload_names": P.offload_names("fc1", "scores", "ln"),
    "table": _table,
    "names_then_matmuls": P.first_of(P.offload_names("fc1", "scores"), P.save_matmuls),
}


@st.composite
def programs(draw: st.DrawFn) -> list[Node]:
    slots = iter(range(100))
    return _draw_children(draw, 3, slots)


def _draw_children(draw: st.DrawFn, depth: int, slots: Any) -> list[Node]:
    return [_draw_node(draw, depth, slots) for _ in range(draw(st.integers(1, 3)))]


def _draw_node(draw: st.DrawFn, depth: int, slots: Any) -> Node:
    wrapper = draw(st.sampled_from(["layer", "layer", "offload", "no_offload", "ck", "seq"])) if depth else "layer"
    if wrapper == "layer":
        return ("layer", draw(st.sampled_from(KINDS)), next(slots))
    children = _draw_children(draw, depth - 1, slots)
    if wrapper == "offload":
        return ("offload", draw(st.sampled_from([0, 256, 10**9])), children)
    if wrapper == "no_offload":
        return ("no_offload", children)
    if wrapper == "ck":
        return ("ck", draw(st.sampled_from(sorted(POLICIES))), draw(st.booleans()), children)
    return ("seq", draw(st.integers(1, len(children))), children)


def make_params(seed: int, slots: list[int]) -> dict[int, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)

    def param(*shape: int) -> torch.Tensor:
        scale = 1 / math.sqrt(shape[-1])
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).requires_grad_()

    return {
        slot: [param(D), param(D), param(2 * D, D), param(2 * D), param(D, 2 * D), param(3 * D, D), param(D, D)]
        for slot in slots
    }


def _slots(nodes: list[Node]) -> list[int]:
    found: list[int] = []
    for node in nodes:
        if node[0] == "layer":
            found.append(node[2])
        else:
            found.extend(_slots(node[-1]))
    return found


def layer(kind: str, p: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        h = remat.name(F.layer_norm(x, (D,), p[0], p[1]), "ln")
        h = remat.name(F.linear(h, p[2], p[3]), "fc1")
        return x + F.linear(F.gelu(h), p[4])
    if kind == "attention":
        q, k, v = F.linear(x, p[5]).split(D, dim=-1)
        scores = remat.name(q @ k.t() / math.sqrt(D), "scores")
        return x + scores.softmax(-1) @ v
    if kind == "views":
        # x[:, 1::2] is saved twice by one mul (aliasing saves); tanh keeps long chains finite
        odd = (x[:, 1::2] * x[:, 1::2]).tanh()
        return x + torch.cat([x[:, ::2].tanh(), odd], dim=1) + x.t().diagonal().sin()[: x.shape[0], None]
    if kind == "inplace":
        y = x * 1.5
        y.sin_()
        y[:, ::2].mul_(0.5)
        return x + y
    for _ in range(3):  # a residual loop over one weight
        x = x + (x @ p[6]).tanh()
    return x


def execute(nodes: list[Node], params: dict[int, list[torch.Tensor]], x: torch.Tensor, checked: bool) -> torch.Tensor:
    for node in nodes:
        x = _run_node(node, params, x, checked)
    return x


def _run_node(node: Node, params: dict[int, list[torch.Tensor]], x: torch.Tensor, checked: bool) -> torch.Tensor:
    kind = node[0]
    if kind == "layer":
        return layer(node[1], params[node[2]], x)
    children = node[-1]
    if not checked:
        return execute(children, params, x, checked)
    if kind == "offload":
        with remat.offload(min_bytes=node[1]):
            return execute(children, params, x, checked)
    if kind == "no_offload":
        with remat.no_offload():
            return execute(children, params, x, checked)
    if kind == "ck":

        def region(t: torch.Tensor) -> torch.Tensor:
            return execute(children, params, t, checked)

        return remat.checkpoint(region, x, policy=POLICIES[node[1]], early_stop=node[2])  # type: ignore[no-any-return]
    functions = [_bound(child, params) for child in children]
    return remat.checkpoint_sequential(functions, node[1], x, use_reentrant=False)  # type: ignore[no-any-return]


def _bound(node: Node, params: dict[int, list[torch.Tensor]]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: _run_node(node, params, t, True)


def gradients(program: list[Node], seed: int, how: str, checked: bool) -> list[torch.Tensor]:
    params = make_params(seed, _slots(program))
    torch.manual_seed(seed)
    x = torch.randn(ROWS, D, dtype=torch.float64, requires_grad=True)
    used = [x, *(t for p in params.values() for t in p)]
    out = execute(program, params, x * 1.0, checked)
    loss = (out * out).sum()
    grad = functools.partial(torch.autograd.grad, allow_unused=True, materialize_grads=True)
    if how == "grad":
        return list(grad(loss, used))
    if how == "retain":
        first = grad(loss, used, retain_graph=True)
        return [*first, *grad(loss, used)]
    first = grad(loss, used, create_graph=True)
    norm = sum((g * g).sum() for g in first if g.requires_grad)
    if not isinstance(norm, torch.Tensor):
        return list(first)
    return [*first, *grad(norm, used)]


EXAMPLES = int(os.environ.get("REMAT_OFFLOAD_EXAMPLES", "300"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), seed=st.integers(0, 2**31 - 1), how=st.sampled_from(["grad", "retain", "double"]))
def test_random_offload_program_matches_unchecked(program: list[Node], seed: int, how: str) -> None:
    want = gradients(program, seed, how, checked=False)
    for _ in range(2):
        got = gradients(program, seed, how, checked=True)
        assert all(_bitwise_equal(a, b) for a, b in zip(got, want, strict=True))


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, except that NaN equals NaN (a long random chain may overflow in both runs)."""
    inf = float("inf")
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(0.0, inf, -inf), b.nan_to_num(0.0, inf, -inf)
    )
