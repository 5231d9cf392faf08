"""The fourth storage choice: saved tensors kept smaller, by the ``remat.compress`` context,
by a policy's :class:`~remat.policies.Compress` and by a region's ``compress_inputs``.

Oracle: the plain run. The forward must be bitwise equal; the gradients are
approximate, within the tolerance each format states below (relative error of
all parameter gradients together, measured on the embedded GPT in float32 and
under bf16 autocast: about half of each bound). Which tensors are compressed
is checked with the saved-tensor observer; bytes with the memory tracker.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import remat
import remat.policies as P
from remat._scope import observe_saved_tensors
from remat.errors import (
    CheckpointError,
    CheckpointTypeError,
    CheckpointUsageError,
    UnsupportedCheckpointError,
)
from remat.memory import track
from remat.models import GPT, GPTConfig
from remat.models.gpt import lm_loss, make_batch

# Relative error of all gradients together (||g - g_plain|| / ||g_plain||), the
# stated tolerance of each format; measured values are in docs/guide/compression.md.
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-2, "fp8": 8e-2, "fp8_e5m2": 1.6e-1, "int8": 3e-2}
CONFIG = GPTConfig(n_layers=2, seq_len=32, d_model=64, n_heads=4, d_ff=256)


def gpt_step(around: Callable[[], Any] = contextlib.nullcontext, *, checkpoint_fn: Any = None, autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, every parameter gradient flattened) of one GPT step."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    idx, targets = make_batch(CONFIG, 4, torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with around():
            logits = model(idx, checkpoint_fn=checkpoint_fn)
        loss = lm_loss(logits.float(), targets)
    loss.backward()
    return logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
@pytest.mark.parametrize("fmt", list(TOLERANCE))
def test_compress_context_on_a_gpt_forward_is_bitwise_and_its_gradients_are_within_tolerance(fmt: str, autocast: bool) -> None:
    plain_logits, plain = gpt_step(autocast=autocast)
    logits, grads = gpt_step(lambda: remat.compress(fmt), autocast=autocast)
    assert torch.equal(logits, plain_logits)
    assert 0 < relative_error(grads, plain) <= TOLERANCE[fmt]


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize(
    "policy",
    [lambda f: P.compressed(P.save_matmuls, f), lambda f: P.compress_names("attn_out", "mlp_out", format=f)],
    ids=["compressed(save_matmuls)", "compress_names"],
)
def test_compressing_policies_in_checkpointed_gpt_blocks(fmt: str, policy: Any) -> None:
    plain_logits, plain = gpt_step()
    logits, grads = gpt_step(checkpoint_fn=functools.partial(remat.checkpoint, policy=policy(fmt)))
    assert torch.equal(logits, plain_logits)
    assert 0 < relative_error(grads, plain) <= TOLERANCE[fmt]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
def test_compressed_region_inputs(fmt: str) -> None:
    plain_logits, plain = gpt_step()
    logits, grads = gpt_step(checkpoint_fn=functools.partial(remat.checkpoint, compress_inputs=fmt))
    assert torch.equal(logits, plain_logits)
    assert 0 < relative_error(grads, plain) <= TOLERANCE[fmt]


def events_of(fn: Callable[[], Any], *wanted: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    seen: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    with observe_saved_tensors(lambda event, t: seen.append((event, tuple(t.shape), t.dtype)) if event in wanted else None):
        fn()
    return seen


def test_only_activations_are_compressed() -> None:
    torch.manual_seed(0)
    emb, norm, lin = torch.nn.Embedding(10, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)
    idx = torch.randint(10, (4, 8))
    x = torch.randn(4, 8, 64, requires_grad=True)

    def forward() -> None:
        with remat.compress("int8", min_bytes=0):
            h = norm(emb(idx) + x)  # embedding saves idx (int64); layer_norm its input and statistics
            lin(h).relu().sum().backward()  # linear saves h and its weight (a parameter)

    compressed = events_of(forward, "compressed")
    # what changed: the norm's input (an activation), h (the linear's input, seen by addmm
    # as a 32 x 64 view) and relu's output; not idx (int64), not the weight, not x (an
    # input), not the norm's mean and rstd
    float32 = torch.float32
    assert sorted(compressed) == sorted(
        [("compressed", (4, 8, 64), float32), ("compressed", (32, 64), float32), ("compressed", (4, 8, 64), float32)]
    )


def test_an_exact_block_keeps_its_saved_tensors() -> None:
    x = torch.randn(32, 64, requires_grad=True)
    with remat.compress("fp8") as block:
        with remat.exact():
            kept = x.exp()  # saved by exp: as it is
        y = torch.relu(kept - 2.0)  # saved by relu: compressed (only the sign of its result matters)
    assert block.original_bytes == 32 * 64 * 4
    (y * kept).sum().backward()
    want = torch.autograd.grad((torch.relu(x.exp() - 2.0) * x.exp()).sum(), x)[0]
    assert relative_error(x.grad, want) < 1e-2  # values below fp8's smallest step become 0


def test_min_bytes_keeps_small_tensors() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with remat.compress("int8", min_bytes=1024) as block:
        (x.exp() * 2).sum().backward()
    assert block.original_bytes == 0


def test_region_inputs_stay_exact_under_a_compress_block() -> None:
    """The recomputation starts from exact inputs unless the region asks (compress_inputs)."""
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    h = x.sin()
    with remat.compress("int8", min_bytes=0) as block:
        y = remat.checkpoint(lambda t: lin(t).relu(), h)
    assert block.original_bytes == 0
    y.sum().backward()
    want = torch.autograd.grad(lin(x.sin()).relu().sum(), x)[0]
    assert torch.equal(x.grad, want)


def test_views_of_one_storage_are_compressed_once() -> None:
    qkv = torch.randn(4, 16, 3 * 64, requires_grad=True) * 1.0
    with remat.compress("fp8", min_bytes=0) as block:
        q, k, v = qkv.split(64, dim=-1)
        out = (q * k).sum() + (k * v).sum()  # q, k, v saved: three views of qkv's storage
    assert block.original_bytes == qkv.numel() * 4
    assert block.stored_bytes == qkv.numel() + 4 * 16 * 4  # one byte a value, a scale per row
    out.backward()


@pytest.mark.parametrize(
    "view",
    [lambda t: t.t(), lambda t: t[1:, ::2], lambda t: t.unsqueeze(0).expand(3, -1, -1), lambda t: t.view(-1, 8)],
    ids=["transposed", "strided", "expanded", "reshaped"],
)
def test_compressed_views_keep_their_layout(view: Any) -> None:
    x = torch.randn(16, 32, requires_grad=True)
    with remat.compress("bf16", min_bytes=0):
        y = view(x * 1.0)
        out = (y * y).sum()
    out.backward()
    want = torch.autograd.grad((view(x * 1.0) ** 2).sum(), x)[0]
    assert relative_error(x.grad, want) < TOLERANCE["bf16"]


def test_an_in_place_change_after_compression_is_caught() -> None:
    x = torch.randn(8, 64, requires_grad=True)
    with remat.compress("int8", min_bytes=0):
        h = x * 2
        y = h.sin()  # saves h
    h.add_(1)
    with pytest.raises(CheckpointError, match="compressed is at version 1"):
        y.sum().backward()


def test_retain_graph_serves_a_second_backward() -> None:
    x = torch.randn(8, 64, requires_grad=True)
    with remat.compress("fp8", min_bytes=0):
        y = (x * 3).tanh()
    first = torch.autograd.grad(y.sum(), x, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(y.sum(), x)[0], first)


def test_memory_at_the_end_of_the_forward_is_what_the_block_says() -> None:
    """Bytes kept = plain bytes - what was compressed + what it takes now (the tracker's count)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256), torch.nn.GELU())
    x = torch.randn(64, 256, requires_grad=True)

    def end_of_forward(compressing: bool) -> tuple[int, Any]:
        block = remat.compress("int8") if compressing else contextlib.nullcontext()
        with track() as tracker:
            with block:
                out = model(x)
            kept = tracker.live_bytes  # the output and what the graph saved for backward
        del out
        return kept, block

    plain, _ = end_of_forward(False)
    compressed, block = end_of_forward(True)
    assert block.original_bytes > 0
    assert compressed == plain - block.original_bytes + block.stored_bytes


def test_compress_bad_input() -> None:
    with pytest.raises(CheckpointUsageError, match="unknown compression format 'fp6'"):
        remat.compress("fp6")
    with pytest.raises(CheckpointTypeError, match="min_bytes must be an int"):
        remat.compress("fp8", min_bytes=1.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------- policies


def test_a_name_on_an_integer_tensor_is_an_error() -> None:
    x = torch.randn(8, 64, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        position = remat.name(t.argmax(dim=-1), "position")
        return t.sin() * position.unsqueeze(-1)

    with pytest.raises(CheckpointUsageError, match=r"compresses the tensor named 'position'.*no float tensor.*int64"):
        remat.checkpoint(block, x, policy=P.compress_names("position"))


def test_an_op_with_float_and_integer_outputs_keeps_its_integers() -> None:
    x = torch.randn(8, 64, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        values, indices = t.max(dim=-1)
        return (values * indices).sum()

    policy = P.compressed(P.save_ops(torch.ops.aten.max.dim), "int8")
    got = torch.autograd.grad(remat.checkpoint(block, x, policy=policy), x)[0]
    want = torch.autograd.grad(block(x), x)[0]
    assert relative_error(got, want) < TOLERANCE["int8"]


def test_compress_decisions_from_a_plain_policy_function() -> None:
    x = torch.randn(16, 64, requires_grad=True)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return P.Compress("bf16") if op is torch.ops.aten.exp.default else P.CheckpointPolicy.PREFER_RECOMPUTE

    events = events_of(lambda: remat.checkpoint(lambda t: t.exp().sin(), x, policy=policy), "policy_compressed")
    assert events == [("policy_compressed", (16, 64), torch.float32)]


def test_compressed_keeps_a_policys_other_answers() -> None:
    policy = P.compressed(P.first_of(P.offload_names("a"), P.save_ops(torch.ops.aten.mm.default)), "int8")
    assert policy.decide(torch.ops.aten.mm.default, (), {}) == P.Compress("int8")
    assert policy.decide(torch.ops.aten.sin.default, (), {}) is None
    assert P.compressed(P.save_matmuls, "fp8").decides_by_op_only()


def test_compress_decision_bad_input() -> None:
    with pytest.raises(CheckpointUsageError, match=r"remat\.policies\.Compress: unknown compression format"):
        P.Compress("fp3")
    with pytest.raises(CheckpointTypeError, match="must must be True or False"):
        P.Compress("fp8", must=1)  # type: ignore[arg-type]
    with pytest.raises(CheckpointTypeError, match=r"remat\.policies\.compressed: every policy must be callable"):
        P.compressed("save_matmuls")  # type: ignore[arg-type]


# ---------------------------------------------------------------- region inputs


def test_compressed_inputs_hold_fewer_bytes_and_refuse_an_in_place_change() -> None:
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    h = x * 1.0  # an activation: the region's input
    y = remat.checkpoint(lambda t: lin(t).relu(), h, compress_inputs="int8")
    h.mul_(2)
    with pytest.raises(CheckpointError, match="compressed is at version 1"):
        y.sum().backward()


def test_compress_inputs_bad_input() -> None:
    with pytest.raises(CheckpointUsageError, match="compress_inputs work only with use_reentrant=False"):
        remat.checkpoint(torch.sin, torch.randn(3, requires_grad=True), use_reentrant=True, compress_inputs="fp8")
    with pytest.raises(CheckpointUsageError, match=r"remat\.checkpoint: compress_inputs: unknown compression format"):
        remat.checkpoint(torch.sin, torch.randn(3, requires_grad=True), compress_inputs="fp12")


@pytest.mark.compile
def test_under_torch_compile_compression_is_refused_not_dropped() -> None:
    x = torch.randn(8, 8, requires_grad=True)
    inputs = torch.compile(lambda t: remat.checkpoint(torch.sin, t, compress_inputs="fp8"), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="compress_inputs") as caught:
        inputs(x)
    assert isinstance(caught.value, UnsupportedCheckpointError) or "UnsupportedCheckpointError" in str(caught.value)


@contextlib.contextmanager
def no_grad_everywhere() -> Iterator[None]:
    with torch.no_grad():
        yield


def test_nothing_is_compressed_without_grad() -> None:
    x = torch.randn(8, 64, requires_grad=True)
    with no_grad_everywhere(), remat.compress("int8", min_bytes=0) as block:
        x.exp().sin()
    assert block.original_bytes == 0


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x * x
        ctx.save_for_backward(y)  # an intermediate: no autograd history here
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * 2 * y.sqrt()


def test_what_a_custom_function_saves_is_kept() -> None:
    """Without autograd history remat cannot tell a Function's intermediates from buffers."""
    x = (torch.rand(32, 64) + 0.5).requires_grad_()
    with remat.compress("int8") as block:
        y = _Square.apply(x)
    assert block.original_bytes == 0
    y.sum().backward()
    assert torch.equal(x.grad, torch.autograd.grad(_Square.apply(x).sum(), x)[0])


@pytest.mark.compile
def test_a_compiled_region_inside_a_compress_block() -> None:
    """From torch 2.11 the compiled graph compresses its intermediates; before, remat refuses."""
    from remat._compat.tracers import graph_saved_tensor_hooks_inline

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 256)
    compiled = torch.compile(lambda t: F.gelu(lin(t)).sum(-1), backend="aot_eager")
    x = torch.randn(32, 64, requires_grad=True)
    if not graph_saved_tensor_hooks_inline():
        with pytest.raises(UnsupportedCheckpointError, match=r"needs torch 2\.11 or newer"), remat.compress("int8"):
            compiled(x)
        return
    with remat.compress("int8"):
        out = compiled(x)
    out.sum().backward()
    want = torch.autograd.grad(F.gelu(lin(x)).sum(), x)[0]
    assert 0 < relative_error(x.grad, want) < TOLERANCE["int8"]


@pytest.mark.parametrize("outer", ["none", "plain", "reentrant"])
@pytest.mark.parametrize("inner", ["policy", "inputs"])
def test_compression_inside_an_enclosing_region_is_what_it_is_alone(outer: str, inner: str) -> None:
    # Compressing reads the region's input (a target of an enclosing reentrant
    # region's recomputation): that read must be no use of it, so gradients are
    # bitwise those of the same compression with no enclosing region.
    torch.manual_seed(0)
    first, second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    leaves = [x, *first.parameters(), *second.parameters()]

    def block(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(second(torch.relu(first(h))))

    def region(h: torch.Tensor) -> torch.Tensor:
        if inner == "policy":
            kept = remat.checkpoint(block, h, policy=P.compressed(P.save_matmuls, "bf16"), use_reentrant=False)
        else:
            kept = remat.checkpoint(block, h, compress_inputs="bf16", use_reentrant=False)
        return kept + h

    def gradients(enclosing: str) -> list[torch.Tensor]:
        out = region(x) if enclosing == "none" else remat.checkpoint(
            region, x, use_reentrant=enclosing == "reentrant"
        )
        return list(torch.autograd.grad(out.square().sum(), leaves))

    expected, got = gradients("none"), gradients(outer)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


# ---------------------------------------------------------------- under a tracer


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_make_fx_traces_the_compression_into_the_step(fmt: str) -> None:
    """A traced step with ``remat.compress`` around the forward reruns on new inputs
    and parameters exactly as the eager compressed step, with no trace-time constant."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> Any:
        with remat.compress(fmt, min_bytes=0):
            h = torch.nn.functional.layer_norm(x, x.shape[-1:])
            y = (torch.tanh(h @ w1) @ w2 + x).pow(2).sum()
        return torch.autograd.grad(y, (w1, w2))

    def inputs(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(16, 32, generator=g, requires_grad=True), torch.randn(32, 16, generator=g, requires_grad=True),
                torch.randn(4, 16, generator=g)]

    graph = make_fx(step)(*inputs(0))
    assert [n.target for n in graph.graph.nodes if n.op == "get_attr"] == []
    got, want = graph(*inputs(1)), step(*inputs(1))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    w1, w2, x = inputs(1)
    loss = (torch.tanh(torch.nn.functional.layer_norm(x, x.shape[-1:]) @ w1) @ w2 + x).pow(2).sum()
    exact = torch.autograd.grad(loss, (w1, w2))
    assert not all(torch.equal(a, b) for a, b in zip(got, exact, strict=True))  # compression reached them
