"""Every non-reentrant remat form under the ``torch.func`` transforms, on real models.

The oracle is the same transform of the same model without checkpointing.
Under ``grad``, ``vjp``, ``jacrev``, ``hessian`` and ``vmap(grad)`` saved-tensor
hooks are off, and a region runs as one recomputing ``autograd.Function``
(``remat._engine.transformed``; docs/design/tracing.md, "The torch.func
path"); under ``vmap``, ``jvp`` and ``jacfwd`` alone it runs on its hooks
(torch >= 2.7). The recomputation repeats the plain forward's ops on the same
values, and its backward is the plain backward of those ops, so results are
bitwise equal, except where the comparison says why not.

``python tests/integration/test_func.py`` prints the transform x form table,
remat beside torch.utils.checkpoint (docs/guide/tracing.md quotes it).
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn
from torch.func import functional_call, grad, grad_and_value, hessian, jacfwd, jacrev, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import remat
from helpers import LiveStorages, OpCounter
from remat.composable import checkpoint_module
from remat.errors import RematError, UnsupportedCheckpointError
from remat.memory import track_allocations
from remat.models import GPT, GPTConfig
from remat.names import NAMES_BATCH
from remat.nn import checkpoint_wrapper
from remat.policies import save_matmuls, save_only_names

TORCH_HAS_SAC = hasattr(tuc, "create_selective_checkpoint_contexts")
# torch 2.4 turns saved-tensor hooks off under vmap and jvp too: the region takes
# the Function path there as well (measured: every cell works on 2.4.1).
CONFIG = GPTConfig(vocab_size=11, seq_len=4, d_model=8, n_heads=2, n_layers=2, d_ff=16)
# The parameter the second-order transforms differentiate by: inside the first
# block's region, so every derivative goes through a recomputation.
PROBE = "blocks.0.ln_1.weight"


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).double().eval()


MODEL = _model()
PARAMS = {name: p.detach().clone() for name, p in MODEL.named_parameters()}
IDX = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.seq_len), generator=torch.Generator().manual_seed(1))
TARGETS = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.seq_len), generator=torch.Generator().manual_seed(2))

OPS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]


def _wrapped(wrap: Callable[[nn.Module], nn.Module]) -> GPT:
    model = copy.deepcopy(MODEL)
    model.blocks = nn.ModuleList(wrap(block) for block in model.blocks)
    return model


def _nested_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    # One region around both blocks, each block a region inside it.
    h = model.tok_emb(idx) + model.pos_emb(torch.arange(idx.shape[1]))

    def body(h: torch.Tensor) -> torch.Tensor:
        for block in model.blocks:
            h = remat.checkpoint(block, h)
        return h

    return model.head(model.ln_f(remat.checkpoint(body, h)))


def _sequential_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    h = model.tok_emb(idx) + model.pos_emb(torch.arange(idx.shape[1]))
    chain = [*model.blocks, model.ln_f]
    return model.head(remat.checkpoint_sequential(chain, 2, h))


class _Forward(nn.Module):
    """``model`` called through ``forward``: functional_call swaps its parameters."""

    def __init__(self, model: nn.Module, forward: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.run = forward

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.run(self.model, idx)


def _by_fn(checkpoint_fn: Callable[..., Any] | None) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    return lambda model, idx: model(idx, checkpoint_fn=checkpoint_fn)


def _torch_ckpt(**options: Any) -> Callable[..., Any]:
    return functools.partial(tuc.checkpoint, use_reentrant=False, **options)


def _torch_ops_context() -> Any:
    return functools.partial(tuc.create_selective_checkpoint_contexts, OPS)


FORMS: dict[str, Callable[[], tuple[nn.Module, Callable[[Any, torch.Tensor], torch.Tensor]]]] = {
    "plain": lambda: (MODEL, _by_fn(None)),
    "full": lambda: (MODEL, _by_fn(remat.checkpoint)),
    "policy": lambda: (MODEL, _by_fn(functools.partial(remat.checkpoint, policy=save_matmuls))),
    "ops": lambda: (MODEL, _by_fn(functools.partial(remat.checkpoint, policy=OPS))),
    "names": lambda: (MODEL, _by_fn(functools.partial(remat.checkpoint, policy=save_only_names("attn_out")))),
    "nested": lambda: (MODEL, _nested_forward),
    "wrapper": lambda: (_wrapped(checkpoint_wrapper), _by_fn(None)),
    "composable": lambda: (_wrapped(checkpoint_module), _by_fn(None)),
    "sequential": lambda: (MODEL, _sequential_forward),
}
TORCH_FORMS: dict[str, Callable[[], tuple[nn.Module, Callable[[Any, torch.Tensor], torch.Tensor]]]] = {
    "full": lambda: (MODEL, _by_fn(_torch_ckpt())),
    "ops": lambda: (MODEL, _by_fn(_torch_ckpt(context_fn=_torch_ops_context()))),
}
CHECKPOINTED = [form for form in FORMS if form != "plain"]


@functools.cache
def _built(form: str, impl: str = "remat") -> tuple[nn.Module, Callable[..., Any]]:
    module, forward = (FORMS if impl == "remat" else TORCH_FORMS)[form]()
    return _Forward(module, forward), forward


def _logits_fn(form: str, impl: str = "remat") -> Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]:
    module, _ = _built(form, impl)

    def logits(params: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        return functional_call(module, {f"model.{k}": v for k, v in params.items()}, (idx,))

    return logits


def _loss_fn(form: str, impl: str = "remat") -> Callable[..., torch.Tensor]:
    logits = _logits_fn(form, impl)

    def loss(params: dict[str, torch.Tensor], idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = logits(params, idx)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))

    return loss


def _probe_loss(form: str, impl: str = "remat") -> Callable[[torch.Tensor], torch.Tensor]:
    loss = _loss_fn(form, impl)
    return lambda w: loss({**PARAMS, PROBE: w}, IDX, TARGETS)


def _probe_logits(form: str, impl: str = "remat") -> Callable[[torch.Tensor], torch.Tensor]:
    logits = _logits_fn(form, impl)
    return lambda w: logits({**PARAMS, PROBE: w}, IDX[:1])


def _grad_and_aux(form: str, impl: str) -> Any:
    logits = _logits_fn(form, impl)

    def loss_and_logits(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = logits(params, IDX)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), TARGETS.reshape(-1)), out

    return grad_and_value(loss_and_logits, has_aux=True)(PARAMS)


def _per_example(form: str, impl: str) -> Any:
    loss = _loss_fn(form, impl)
    one = lambda p, i, t: loss(p, i[None], t[None])  # noqa: E731
    return vmap(grad(one), in_dims=(None, 0, 0))(PARAMS, IDX, TARGETS)


def _grad_grad(form: str, impl: str) -> Any:
    inner = grad(_probe_loss(form, impl))
    return grad(lambda w: inner(w).pow(2).sum())(PARAMS[PROBE])


TRANSFORMS: dict[str, Callable[[str, str], Any]] = {
    "grad": lambda form, impl: grad(_loss_fn(form, impl))(PARAMS, IDX, TARGETS),
    "grad_and_value(has_aux)": _grad_and_aux,
    "vjp": lambda form, impl: vjp(lambda p: _logits_fn(form, impl)(p, IDX), PARAMS)[1](
        torch.linspace(-1, 1, IDX.numel() * CONFIG.vocab_size, dtype=torch.float64).reshape(*IDX.shape, -1)
    ),
    "jacrev": lambda form, impl: jacrev(_probe_logits(form, impl))(PARAMS[PROBE]),
    "jacfwd": lambda form, impl: jacfwd(_probe_logits(form, impl))(PARAMS[PROBE]),
    "hessian": lambda form, impl: hessian(_probe_loss(form, impl))(PARAMS[PROBE]),
    "vmap": lambda form, impl: vmap(_loss_fn(form, impl), in_dims=(None, 0, 0))(PARAMS, IDX[:, None], TARGETS[:, None]),
    "vmap(grad)": _per_example,
    "jacfwd(jacrev)": lambda form, impl: jacfwd(jacrev(_probe_loss(form, impl)))(PARAMS[PROBE]),
    "grad(grad)": _grad_grad,
}

# Where the checkpointed result is not bitwise the plain one, and why. jacrev
# and hessian run the backward under vmap over the cotangents: the plain
# backward is batched by torch's own rules, the region's by vmap over its
# vjp, which batches the recomputation's matmuls differently (float64 rounding).
ROUNDING = {"jacrev", "hessian", "jacfwd(jacrev)", "grad(grad)"}


def _leaves(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _max_error(got: Any, want: Any) -> float:
    pairs = list(zip(_leaves(got), _leaves(want), strict=True))
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-300)).item() for g, w in pairs)


def run(transform: str, form: str, impl: str = "remat") -> Any:
    # The math attention kernel: the CPU flash kernel has neither forward-mode
    # AD nor a double backward, with or without checkpointing.
    with sdpa_kernel(SDPBackend.MATH):
        return TRANSFORMS[transform](form, impl)


@functools.cache
def _plain(transform: str) -> Any:
    return run(transform, "plain")


def _check(transform: str, got: Any) -> None:
    want = _plain(transform)
    if transform in ROUNDING:
        assert _max_error(got, want) <= 1e-12
    else:
        for g, w in zip(_leaves(got), _leaves(want), strict=True):
            assert torch.equal(g, w)


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("form", CHECKPOINTED)
def test_form_under_transform_equals_the_plain_transform(form: str, transform: str) -> None:
    if form == "names" and transform == "jacrev" and not NAMES_BATCH:
        # torch 2.4 cannot batch remat.name: the region, made outside vmap, is
        # recomputed under jacrev's vmap, where names are not seen.
        with pytest.raises(UnsupportedCheckpointError, match=r"names policy .* needs torch >= 2\.5"):
            run(transform, form)
        return
    _check(transform, run(transform, form))


def test_per_sample_gradients_of_a_checkpointed_gpt_equal_each_example_alone() -> None:
    got = _per_example("full", "remat")
    for example in range(IDX.shape[0]):
        model = copy.deepcopy(MODEL)
        logits = model(IDX[example : example + 1])
        F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), TARGETS[example]).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None
            # vmap batches the example's matmuls with the others' (float64 rounding)
            torch.testing.assert_close(got[name][example], p.grad, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------- a residual block


class Residual(nn.Module):
    """LayerNorm, attention through views, an MLP with in-place ops, residuals."""

    def __init__(self, width: int = 6, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        split = lambda t: t.reshape(batch, seq, self.heads, -1).transpose(1, 2)  # noqa: E731
        scores = split(q) @ split(k).transpose(-1, -2) / (width // self.heads) ** 0.5
        y = (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(batch, seq, width)
        h = x + y
        hidden = self.up(h)
        hidden.mul_(torch.sigmoid(hidden))  # in place on an intermediate
        hidden[..., 0].zero_()  # in place through a view
        return h + self.down(hidden)


RESIDUAL = Residual().double()
RES_PARAMS = {name: p.detach().clone() for name, p in RESIDUAL.named_parameters()}
RES_X = torch.randn(2, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def _residual_loss(checkpointed: bool) -> Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        run = lambda t: functional_call(RESIDUAL, params, (t,))  # noqa: E731
        out = remat.checkpoint(run, x) if checkpointed else run(x)
        return out.tanh().sum()

    return loss


@pytest.mark.parametrize(
    "transform",
    ["grad", "vmap(grad)", "hessian_x", "grad(grad)"],
)
def test_residual_block_with_in_place_ops_and_views(transform: str) -> None:
    def run(checkpointed: bool) -> Any:
        loss = _residual_loss(checkpointed)
        if transform == "grad":
            return grad(loss, argnums=(0, 1))(RES_PARAMS, RES_X)
        if transform == "vmap(grad)":
            return vmap(grad(lambda p, x: loss(p, x[None])), in_dims=(None, 0))(RES_PARAMS, RES_X)
        if transform == "hessian_x":
            return hessian(lambda x: loss(RES_PARAMS, x))(RES_X[:1, :2])
        inner = grad(loss, argnums=1)
        return grad(lambda p: inner(p, RES_X).pow(2).sum())(RES_PARAMS)

    got, want = run(True), run(False)
    if transform in ("hessian_x", "grad(grad)"):  # see ROUNDING
        assert _max_error(got, want) <= 1e-12
    else:
        for g, w in zip(_leaves(got), _leaves(want), strict=True):
            assert torch.equal(g, w)


# ------------------------------------------------------ recomputation, memory


def _mlp_region(policy: Any = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        body = lambda t: torch.mm(torch.mm(t, w).sin(), w).sin()  # noqa: E731
        out = body(x) if policy == "plain" else remat.checkpoint(body, x, policy=policy)
        return out.sum()

    return loss


W8 = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
X8 = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
COUNTED: dict[str, Callable[[Callable[..., torch.Tensor]], Any]] = {
    "grad": lambda loss: grad(loss)(W8, X8),
    "vmap(grad)": lambda loss: vmap(grad(lambda w, x: loss(w, x[None])), in_dims=(None, 0))(W8, X8),
    "hessian": lambda loss: hessian(loss)(W8[:2, :2].clone(), X8[:, :2]),
}


def _counts(transform: str, policy: Any) -> Any:
    with OpCounter() as counter:
        COUNTED[transform](_mlp_region(policy))
    return counter.counts


@pytest.mark.parametrize("transform", list(COUNTED))
def test_the_region_is_recomputed_in_backward(transform: str) -> None:
    plain, full = _counts(transform, "plain"), _counts(transform, None)
    # Each forward op of the region runs once more: both sin and both mm. Under
    # hessian (jacfwd over jacrev) the one recomputation runs under forward-mode
    # AD: each mm is run on the tangent too, and each sin's tangent is a cos.
    tangents = 2 if transform == "hessian" else 0
    assert full["aten.sin.default"] == plain["aten.sin.default"] + 2
    assert full["aten.mm.default"] == plain["aten.mm.default"] + 2 + tangents
    assert full["aten.cos.default"] == plain["aten.cos.default"] + tangents


@pytest.mark.parametrize("transform", list(COUNTED))
def test_a_policys_saved_ops_are_not_recomputed(transform: str) -> None:
    plain, selective = _counts(transform, "plain"), _counts(transform, [torch.ops.aten.mm.default])
    assert selective["aten.mm.default"] == plain["aten.mm.default"]  # served from the forward's cache
    assert selective["aten.sin.default"] == plain["aten.sin.default"] + 2  # recomputed


def _kept_after_forward(checkpointed: bool, transform: str) -> int:
    """Bytes of the storages made in the forward that are still alive when it returns."""
    kept: list[int] = []
    width = 64

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        body = lambda t: torch.mm(torch.mm(t, w).sin().cos(), w).exp()  # noqa: E731
        with LiveStorages() as live:
            live.phase("forward")
            out = (remat.checkpoint(body, x) if checkpointed else body(x)).sum()
            kept.append(sum(storage.nbytes() for storage in live.alive("forward")))
        return out

    w = torch.randn(width, width, dtype=torch.float64) / width
    x = torch.randn(32, width, dtype=torch.float64)
    if transform == "grad":
        grad(loss)(w, x)
    else:
        vmap(grad(lambda w, x: loss(w, x[None])), in_dims=(None, 0))(w, x[:4])
    return kept[0]


@pytest.mark.parametrize("transform", ["grad", "vmap(grad)"])
def test_intermediates_are_not_kept_between_forward_and_backward(transform: str) -> None:
    plain, checkpointed = _kept_after_forward(False, transform), _kept_after_forward(True, transform)
    # Plain keeps the four intermediates autograd saves; the region keeps its output only
    # (and the scalar sum), a quarter or less.
    assert checkpointed * 3 < plain, (checkpointed, plain)


def _peak(checkpointed: bool, transform: str) -> int:
    w = [torch.randn(64, 64, dtype=torch.float64) / 8 for _ in range(6)]
    x = torch.randn(128, 64, dtype=torch.float64)
    block = lambda h, v: (h @ v).tanh().sin().cos() + h  # noqa: E731

    def loss(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = x
        for v in ws:
            h = remat.checkpoint(block, h, v) if checkpointed else block(h, v)
        return h.sum()

    with track_allocations(quiet=True) as meter:
        if transform == "grad":
            grad(loss)(w, x)
        else:
            vmap(grad(loss), in_dims=(None, 0))(w, x.reshape(4, 32, 64))
    return int(meter.peak_bytes)


@pytest.mark.parametrize("transform", ["grad", "vmap(grad)"])
def test_the_peak_falls_under_the_transform(transform: str) -> None:
    # functorch's grad runs its backward with create_graph: a recomputation
    # recorded there would live to the end of the backward. First-order
    # transforms recompute from detached tensors, so each region's recomputed
    # activations go as soon as its backward is done (measured: 36.5 MiB
    # unchecked, 8.5 MiB checkpointed, for eight 512x256 regions).
    plain, checkpointed = _peak(False, transform), _peak(True, transform)
    assert checkpointed * 2 < plain, (checkpointed, plain)


# ------------------------------------------------------------------ refusals


def test_the_reentrant_variant_is_refused_under_grad_before_any_value() -> None:
    with pytest.raises(UnsupportedCheckpointError, match=r"use_reentrant=True\) under torch\.func\.grad.*use_reentrant=False"):
        grad(lambda w: remat.checkpoint(lambda t: (t @ w).sin(), X8, use_reentrant=True).sum())(W8)


def test_compressed_inputs_are_refused_under_grad() -> None:
    with pytest.raises(UnsupportedCheckpointError, match=r"compress_inputs=\.\.\.\) under torch\.func\.grad"):
        grad(lambda x: remat.checkpoint(torch.sin, x, compress_inputs="bf16").sum())(X8)


def test_a_recomputation_that_runs_other_calls_is_refused() -> None:
    calls = []

    def body(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t.sin() if len(calls) == 1 else t.cos().sin()  # a different forward each time

    with pytest.raises(remat.errors.RecomputeMismatchError, match=r"under a torch\.func transform"):
        grad(lambda x: remat.checkpoint(body, x).sum())(X8)


def test_a_region_under_no_grad_inside_the_transform_runs_plainly() -> None:
    def loss(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            constant = remat.checkpoint(torch.cos, x)
        return (remat.checkpoint(torch.sin, x) * constant).sum()

    assert torch.equal(grad(loss)(X8), grad(lambda x: (x.sin() * x.cos().detach()).sum())(X8))


def test_dropout_draws_the_same_mask_in_the_recomputation() -> None:
    def loss(x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
        body = lambda t: F.dropout(t.sin(), 0.5, training=True) * t  # noqa: E731
        return (remat.checkpoint(body, x) if checkpointed else body(x)).sum()

    torch.manual_seed(7)
    want = grad(loss)(X8, False)
    torch.manual_seed(7)
    assert torch.equal(grad(loss)(X8, True), want)


# ---------------------------------------------------------------- the table


def outcome(run: Callable[[], Any]) -> str:
    """"works", "remat error", "torch error" or "WRONG (...)" for one cell."""
    try:
        error = run()
    except RematError as exc:
        return f"remat error ({type(exc).__name__})"
    except Exception as exc:  # torch's own refusals, in the table only
        line = (str(exc).strip().splitlines() or [""])[0]
        return f"torch error ({type(exc).__name__}: {line[:80]})"
    return "works" if error is None else f"WRONG ({error})"


def func_cell(transform: str, form: str, impl: str) -> str:
    if impl == "torch" and form not in TORCH_FORMS:
        return "n/a"
    if impl == "torch" and form == "ops" and not TORCH_HAS_SAC:
        return "n/a"

    def cell() -> str | None:
        error = _max_error(run(transform, form, impl), _plain(transform))
        return None if error <= 1e-12 else f"max relative error {error:.2g}"

    return outcome(cell)


def print_table(out: Any = sys.stdout) -> None:
    """The torch.func transform x form table, remat beside torch.utils.checkpoint."""
    print(f"torch {torch.__version__}", file=out)
    print("| transform | form | remat | torch |", file=out)
    print("|---|---|---|---|", file=out)
    for transform in TRANSFORMS:
        for form in CHECKPOINTED:
            remat_cell = func_cell(transform, form, "remat")
            torch_cell = func_cell(transform, form, "torch")
            print(f"| {transform} | {form} | {remat_cell} | {torch_cell} |", file=out, flush=True)


if __name__ == "__main__":
    print_table()
