"""Offload, every way in, on realistic models: gradients bitwise equal to the unchecked run.

Each model is a list of stages (so a wrapping can treat a part differently);
each wrapping runs the stages under some mix of ``remat.offload``,
``remat.no_offload``, checkpoints and offloading policies. The oracle is the
same stages run plainly; float64 on CPU, compared with ``torch.equal``.
Gradients are taken with ``autograd.grad``, twice with ``retain_graph``, and
as a double backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import remat
import remat.policies as P

Stage = Callable[[torch.Tensor], torch.Tensor]
D = 16


def _params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    return [(torch.randn(*shape, dtype=dtype) / math.sqrt(shape[-1])).requires_grad_() for shape in shapes]


def residual_model(dtype: torch.dtype = torch.float64) -> tuple[list[Stage], list[torch.Tensor]]:
    shapes = ((D,), (D,), (4 * D, D), (4 * D,), (D, 4 * D), (D,))
    stages_params = [_params(*shapes, dtype=dtype) for _ in range(2)]

    def block(p: list[torch.Tensor]) -> Stage:
        def run(x: torch.Tensor) -> torch.Tensor:
            h = F.layer_norm(x, (D,), p[0], p[1])
            h = remat.name(F.linear(h, p[2], p[3]), "fc1")
            return x + F.linear(F.gelu(h), p[4], p[5])

        return run

    return [block(p) for p in stages_params], [t for p in stages_params for t in p]


def attention_model(use_sdpa: bool) -> tuple[list[Stage], list[torch.Tensor]]:
    heads = 2
    w_qkv, w_out, g, b = _params((3 * D, D), (D, D), (D,), (D,))

    def attend(x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = F.layer_norm(x, (D,), g, b)
        q, k, v = F.linear(h, w_qkv).split(D, dim=-1)  # strided views of one storage
        q, k, v = (t.view(batch, seq, heads, D // heads).transpose(1, 2) for t in (q, k, v))
        if use_sdpa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = remat.name(q @ k.transpose(-2, -1) / math.sqrt(D // heads), "scores")
            mask = torch.ones(seq, seq, dtype=torch.bool).tril()
            out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return out.transpose(1, 2).reshape(batch, seq, D)

    def project(a: torch.Tensor) -> torch.Tensor:
        return a + F.linear(a, w_out).tanh()

    return [attend, project], [w_qkv, w_out, g, b]


def views_inplace_model() -> tuple[list[Stage], list[torch.Tensor]]:
    (w,) = _params((D, D))

    def first(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        h[..., ::2].mul_(2)  # in place through a strided view
        h = h.relu_()
        d = h.flatten(0, -2)
        return (d[:, 1::2].exp() * d[:, ::2]).repeat(1, 2).view_as(h) + h.transpose(-1, -2).diagonal(dim1=-2, dim2=-1).unsqueeze(-1)

    def second(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x.sin_()
        return (x * x).cumsum(-1) + torch.cat([x, x], -1)[..., :D].sigmoid() + x.expand(2, *x.shape).sum(0)

    return [first, second], [w]


MODELS: dict[str, Callable[[], tuple[list[Stage], list[torch.Tensor]]]] = {
    "residual": residual_model,
    "attention": lambda: attention_model(False),
    "attention-sdpa": lambda: attention_model(True),
    "views-inplace": views_inplace_model,
}


def offload_table(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> P.CheckpointPolicy:
    """A per-op decision table mixing offload, save and recompute."""
    return _TABLE.get(op, P.CheckpointPolicy.PREFER_RECOMPUTE)


_TABLE = {
    torch.ops.aten.mm.default: P.CheckpointPolicy.MUST_OFFLOAD,
    torch.ops.aten.addmm.default: P.CheckpointPolicy.PREFER_OFFLOAD,
    torch.ops.aten.bmm.default: P.CheckpointPolicy.MUST_OFFLOAD,
    torch.ops.aten.native_layer_norm.default: P.CheckpointPolicy.MUST_OFFLOAD,
    torch.ops.aten.gelu.default: P.CheckpointPolicy.MUST_SAVE,
}


def _chain(stages: list[Stage], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


def _offloaded(stages: list[Stage], x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with remat.offload(**kwargs):
        return _chain(stages, x)


def _offload_then_keep(stages: list[Stage], x: torch.Tensor) -> torch.Tensor:
    with remat.offload(min_bytes=0):
        x = stages[0](x)
        with remat.no_offload():
            return _chain(stages[1:], x)


def _offload_around_checkpoints(stages: list[Stage], x: torch.Tensor) -> torch.Tensor:
    with remat.offload(min_bytes=0):
        for stage in stages:
            x = remat.checkpoint(stage, x)
        return x


def _checkpoint_around_offload(stages: list[Stage], x: torch.Tensor) -> torch.Tensor:
    return remat.checkpoint(lambda t: _offloaded(stages, t, min_bytes=0), x)


def _policy_table(stages: list[Stage], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = remat.checkpoint(stage, x, policy=offload_table)
    return x


def _offload_names(stages: list[Stage], x: torch.Tensor) -> torch.Tensor:
    policy = P.first_of(P.offload_names("fc1", "scores"), P.save_matmuls)
    return remat.checkpoint(lambda t: _chain(stages, t), x, policy=policy)


def _nested(stages: list[Stage], x: torch.Tensor) -> torch.Tensor:
    def inner(t: torch.Tensor) -> torch.Tensor:
        t = remat.checkpoint(stages[0], t, policy=offload_table)
        return remat.checkpoint(lambda u: _chain(stages[1:], u), t)

    with remat.offload(min_bytes=0):
        return remat.checkpoint(inner, x, policy=P.save_ops(torch.ops.aten.native_layer_norm.default))


def _sequential(stages: list[Stage], x: torch.Tensor) -> torch.Tensor:
    with remat.offload(min_bytes=0):
        return remat.checkpoint_sequential([*stages, torch.nn.Identity()], 2, x, use_reentrant=False)


WRAPPINGS: dict[str, Callable[[list[Stage], torch.Tensor], torch.Tensor]] = {
    "offload-all": lambda s, x: _offloaded(s, x, min_bytes=0),
    "offload-default": _offloaded,
    "offload-then-no-offload": _offload_then_keep,
    "offload-around-checkpoints": _offload_around_checkpoints,
    "checkpoint-around-offload": _checkpoint_around_offload,
    "policy-table": _policy_table,
    "offload-names": _offload_names,
    "nested": _nested,
    "sequential": _sequential,
}


def _grads(run: Callable[[], torch.Tensor], inputs: list[torch.Tensor], mode: str) -> list[torch.Tensor]:
    out = run()
    loss = (out * out).sum()
    if mode == "grad":
        return list(torch.autograd.grad(loss, inputs))
    if mode == "retain":
        first = torch.autograd.grad(loss, inputs, retain_graph=True)
        second = torch.autograd.grad(loss, inputs)
        return [*first, *second]
    first = torch.autograd.grad(loss, inputs, create_graph=True)
    total = sum((g * g).sum() for g in first)
    assert isinstance(total, torch.Tensor)
    return [*first, *torch.autograd.grad(total, inputs, allow_unused=True, materialize_grads=True)]


@pytest.mark.parametrize("mode", ["grad", "retain", "double"])
@pytest.mark.parametrize("wrapping", sorted(WRAPPINGS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_offload_matches_unchecked(model: str, wrapping: str, mode: str) -> None:
    if mode == "double" and model == "attention-sdpa":
        pytest.skip("torch has no double backward for CPU flash attention")
    torch.manual_seed(0)
    stages, params = MODELS[model]()
    x = torch.randn(2, 6, D, dtype=torch.float64, requires_grad=True)
    inputs = [x, *params]
    if model == "views-inplace" and wrapping == "offload-names":
        # save_matmuls keeps the mm output on device; the model then writes
        # into it in place through matmul's _unsafe_view alias, which has a
        # version counter of its own. The cache notices the write to its
        # storage: a clear error instead of a stale value (torch's SAC gives
        # silently wrong gradients here).
        with pytest.raises(remat.CheckpointError, match="modified in place afterwards"):
            _grads(lambda: WRAPPINGS[wrapping](stages, x * 1.0), inputs, mode)
        return
    want = _grads(lambda: _chain(stages, x * 1.0), inputs, mode)
    for _ in range(3):  # addresses get reused across repetitions
        got = _grads(lambda: WRAPPINGS[wrapping](stages, x * 1.0), inputs, mode)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("wrapping", ["offload-all", "offload-around-checkpoints", "policy-table", "nested"])
def test_offload_under_cpu_autocast_matches_unchecked(wrapping: str) -> None:
    torch.manual_seed(0)
    stages, params = residual_model(torch.float32)
    x = torch.randn(2, 6, D, requires_grad=True)

    def under_autocast(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def go() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run().float()

        return go

    inputs = [x, *params]
    want = _grads(under_autocast(lambda: _chain(stages, x * 1.0)), inputs, "grad")
    got = _grads(under_autocast(lambda: WRAPPINGS[wrapping](stages, x * 1.0)), inputs, "grad")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
