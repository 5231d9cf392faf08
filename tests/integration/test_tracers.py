"""Every remat form under the tracers people put around training steps.

The oracle is the plain, unchecked eager step. Each tracer captures a step
once (on one set of inputs and parameters) and runs it on new ones:

* ``make_fx`` of a whole step (plain, symbolic, non-strict; gradients taken
  with ``torch.autograd.grad`` and with ``.backward()``): bitwise equal to
  the plain run on the new inputs, and the graph holds no tensor captured at
  trace time;
* compiled autograd (``aot_eager`` and ``inductor``), forward eager or
  compiled: equal to the plain gradients (inductor to rounding);
* ``torch.export`` (strict and non-strict) of a module using remat in its
  forward, and its decomposed (ATen) program: equal to the plain module;
* ``torch.func`` transforms: the default variant runs under ``vmap``,
  ``jvp``, ``grad``, ``vjp``, ``jacrev`` and ``vmap(grad)`` (every form and
  transform: ``tests/integration/test_func.py``); the reentrant variant and
  a backward after ``vmap`` returned are refused with remat's own error.

``python tests/integration/test_tracers.py`` prints the whole table, remat
beside torch.utils.checkpoint (docs/guide/tracing.md quotes it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import remat
from remat import policies
from remat._compat.versions import dynamo_traces_policy_objects
from remat.errors import RematError, UnsupportedCheckpointError

MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default]
HAS_NON_STRICT = hasattr(torch.compiler, "_non_strict_tracing_context")
TORCH_HAS_SAC = hasattr(tuc, "create_selective_checkpoint_contexts")


class Block(nn.Module):
    """A pre-norm transformer block: norm, attention (views), MLP with an in-place op, residuals."""

    def __init__(self, width: int = 8, heads: int = 2, attention: bool = True) -> None:
        super().__init__()
        self.with_attention = attention  # compiled autograd traces without it: fewer graph breaks
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.heads = heads

    def attention(self, x: torch.Tensor, name: Callable[[torch.Tensor, str], torch.Tensor]) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = torch.softmax(q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5, dim=-1)
        out = name((scores @ v).transpose(1, 2).reshape(b, s, d), "attn")
        return x + self.proj(out)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(self.norm2(x)))
        h.mul_(0.5)  # an in-place op on a saved activation's neighbour
        return x + self.down(h)

    def forward(self, x: torch.Tensor, name: Callable[[torch.Tensor, str], torch.Tensor] | None = None) -> torch.Tensor:
        return self.mlp(self.pre(x, name or _unnamed))

    def pre(self, x: torch.Tensor, name: Callable[[torch.Tensor, str], torch.Tensor]) -> torch.Tensor:
        return self.attention(x, name) if self.with_attention else x


def _unnamed(tensor: torch.Tensor, label: str) -> torch.Tensor:
    return tensor


Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Form:
    """One way to checkpoint the block: builds its forward for "plain", "torch" or "remat"."""

    name: str
    build: Callable[[str, Block], Forward | None]
    torch_has_it: bool = True


def _policy_fn(enum: Any) -> Callable[..., Any]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return enum.MUST_SAVE if op in MATMULS else enum.PREFER_RECOMPUTE

    return policy


def _checkpoint(impl: str) -> Callable[..., Any]:
    return tuc.checkpoint if impl == "torch" else remat.checkpoint


def _full(impl: str, block: Block) -> Forward:
    return lambda x: _checkpoint(impl)(block, x, use_reentrant=False)


def _reentrant(impl: str, block: Block) -> Forward:
    return lambda x: _checkpoint(impl)(block, x, use_reentrant=True)


def _op_list(impl: str, block: Block) -> Forward | None:
    if impl == "torch":
        if not TORCH_HAS_SAC:
            return None
        contexts = functools.partial(tuc.create_selective_checkpoint_contexts, MATMULS)
        return lambda x: tuc.checkpoint(block, x, use_reentrant=False, context_fn=contexts)
    return lambda x: remat.checkpoint(block, x, policy=list(MATMULS))


def _policy_function(impl: str, block: Block) -> Forward | None:
    if impl == "torch" and not TORCH_HAS_SAC:
        return None
    api: Any = tuc if impl == "torch" else remat
    contexts = functools.partial(api.create_selective_checkpoint_contexts, _policy_fn(api.CheckpointPolicy))
    return lambda x: api.checkpoint(block, x, use_reentrant=False, context_fn=contexts)


def _remat_only(build: Callable[[Block], Forward]) -> Callable[[str, Block], Forward | None]:
    def for_impl(impl: str, block: Block) -> Forward | None:
        return None if impl == "torch" else build(block)

    return for_impl


def _named(policy: Any) -> Callable[[Block], Forward]:
    return lambda block: lambda x: remat.checkpoint(lambda t: block(t, remat.name), x, policy=policy)


def _offload_everything(block: Block) -> Forward:
    def forward(x: torch.Tensor) -> torch.Tensor:
        with remat.offload(min_bytes=0):
            return block(x)

    return forward


def _offload_inputs(block: Block) -> Forward:
    def forward(x: torch.Tensor) -> torch.Tensor:
        with remat.offload(min_bytes=0):
            return remat.checkpoint(block, x)

    return forward


def _nested(impl: str, block: Block) -> Forward:
    checkpoint = _checkpoint(impl)

    def outer(x: torch.Tensor) -> torch.Tensor:
        return block.mlp(checkpoint(lambda t: block.pre(t, _unnamed), x, use_reentrant=False))

    return lambda x: checkpoint(outer, x, use_reentrant=False)


def _wrapper(impl: str, block: Block) -> Forward:
    if impl == "torch":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        return checkpoint_wrapper(block)  # type: ignore[no-any-return]
    return remat.checkpoint_wrapper(block)


def _composable(impl: str, block: Block) -> Forward:
    if impl == "torch":
        from torch.distributed._composable import checkpoint

        checkpoint(block)
    else:
        remat.checkpoint_module(block)
    return block


FORMS = {
    form.name: form
    for form in (
        Form("full", _full),
        Form("op list", _op_list),
        Form("policy function", _policy_function),
        Form("policy object", _remat_only(lambda b: lambda x: remat.checkpoint(b, x, policy=policies.save_matmuls)), False),
        Form("names", _remat_only(_named(policies.save_only_names("attn"))), False),
        Form("offload policy", _remat_only(_named(policies.first_of(policies.offload_names("attn"), policies.save_matmuls))), False),
        Form("offload", _remat_only(_offload_everything), False),
        Form("offload inputs", _remat_only(_offload_inputs), False),
        Form("nested", _nested),
        Form("reentrant", _reentrant),
        Form("wrapper", _wrapper),
        Form("composable", _composable),
    )
}


CORE_FORMS = ("full", "policy object", "offload policy", "reentrant", "composable")
SELECTIVE_FORMS = ("op list", "policy function", "policy object", "names", "offload policy")
POLICY_OBJECT_FORMS = ("policy object", "names", "offload policy")  # remat.policies objects
"""The forms every torch release of the CI matrix runs; the rest run once, on the main release."""


KIND_FORMS = ("full", "policy object", "names", "offload policy", "offload inputs", "nested", "reentrant", "composable")
"""One form of each kind (function, selective policy, names, offload by policy, offload
by context, nesting, the reentrant variant, the module forms): the tracers whose
cases cost seconds each run these; make_fx, the tracer the others build on, runs
every form (``test_make_fx_step_reruns_bitwise_on_new_inputs``), and so does
``test_random_stacks_of_forms_trace_and_rerun``. The forms left out share their
kind's path through the engine (an op list and a policy function are selective
policies as a policy object is; offloading everything is the context's hooks as
offloading a region's inputs is; the wrapper runs the region the composable
hooks run)."""


def form_params() -> list[Any]:
    return [form if form in CORE_FORMS else pytest.param(form, marks=pytest.mark.slow) for form in FORMS]


def build(form: str, impl: str, attention: bool = True) -> tuple[Block, Forward] | None:
    """The block (seeded: every call makes the same one) and its forward, or None if ``impl`` lacks the form."""
    torch.manual_seed(0)
    block = Block(attention=attention)
    if impl == "plain":
        return block, block
    forward = FORMS[form].build(impl, block)
    return None if forward is None else (block, forward)


def new_inputs(block: Block, seed: int) -> list[torch.Tensor]:
    """Fresh parameters (same shapes as the block's) and a fresh input, all requiring grad."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(p.shape, generator=generator) for p in block.parameters()]
    tensors.append(torch.randn(2, 5, 8, generator=generator))
    return [t.requires_grad_() for t in tensors]


class Step(nn.Module):
    """One training step as a module, so ``torch.func.functional_call`` swaps the
    parameters for graph inputs around the forward *and* the backward (the
    recomputation reads them again in backward)."""

    def __init__(self, block: Block, forward: Forward, style: str) -> None:
        super().__init__()
        self.block = block
        self.runs = [forward]  # a list: a forward that is a module is not registered twice
        self.style = style

    def forward(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        loss = self.runs[0](tensors[-1]).pow(2).sum()
        if self.style == "grad":
            return list(torch.autograd.grad(loss, tensors))
        loss.backward()
        return [t.grad for t in tensors]  # type: ignore[misc]


def step_function(block: Block, forward: Forward, style: str) -> Callable[..., list[torch.Tensor]]:
    step = Step(block, forward, style)
    names = [f"block.{n}" for n, _ in block.named_parameters()]

    def run(*tensors: torch.Tensor) -> list[torch.Tensor]:
        return torch.func.functional_call(step, dict(zip(names, tensors[:-1], strict=True)), tensors)  # type: ignore[no-any-return]

    return run


def plain_grads(form: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    block, forward = build(form, "plain")  # type: ignore[misc]
    return step_function(block, forward, "grad")(*fresh(tensors))


def fresh(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def max_relative_error(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> float:
    """The largest error relative to the tensor's largest value; infinite where only one side is None."""
    errors = [0.0]
    for g, w in zip(got, want, strict=True):
        if g is None or w is None:
            errors.append(0.0 if g is w else float("inf"))
        else:
            errors.append(float(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()))
    return max(errors)


# ---------------------------------------------------------------- make_fx


@contextlib.contextmanager
def tracing_mode_context(mode: str) -> Iterator[str]:
    """make_fx's tracing mode; "non-strict" is export's way of tracing (plain make_fx under torch's non-strict context)."""
    if mode != "non-strict":
        yield mode
        return
    with torch.compiler._non_strict_tracing_context(), torch.compiler._patch_autograd_grad():
        yield "real"


def trace_step(form: str, impl: str, mode: str, style: str) -> Any:
    made = build(form, impl)
    assert made is not None
    block, forward = made
    with tracing_mode_context(mode) as tracing_mode:
        return make_fx(step_function(block, forward, style), tracing_mode=tracing_mode)(*new_inputs(block, 1))


def graph_constants(graph_module: Any) -> list[str]:
    """Tensors the traced graph captured at trace time (get_attr nodes)."""
    return [str(node.target) for node in graph_module.graph.nodes if node.op == "get_attr"]


MAKE_FX_MODES = [
    "real",
    pytest.param("symbolic", marks=pytest.mark.slow),  # fake tensors: a few seconds a cell
    pytest.param("non-strict", marks=pytest.mark.skipif(
        not HAS_NON_STRICT, reason=f"torch {torch.__version__} has no non-strict tracing context (2.13+)")),
]


@pytest.mark.parametrize("style", ["grad", "backward"])
@pytest.mark.parametrize("mode", MAKE_FX_MODES)
@pytest.mark.parametrize("form", form_params())
def test_make_fx_step_reruns_bitwise_on_new_inputs(form: str, mode: str, style: str) -> None:
    graph = trace_step(form, "remat", mode, style)
    assert graph_constants(graph) == []
    tensors = new_inputs(Block(), 2)
    got = graph(*fresh(tensors))
    want = plain_grads(form, tensors)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (form, mode, style, max_relative_error(got, want))


@pytest.mark.parametrize("form", [f if f in CORE_FORMS else pytest.param(f, marks=pytest.mark.slow) for f in KIND_FORMS])
def test_a_traced_step_leaves_no_region_behind(form: str) -> None:
    """Once the traced graph is dropped, no region's bookkeeping is alive.

    An offloaded output replayed by a selective recomputation was handed to
    autograd as the stash's own tensor, which took the recomputation's
    history: a cycle through C++ that kept the region (and its tensors) for
    the life of the process.
    """
    import gc

    from remat._engine.frame import Frame

    gc.collect()
    before = sum(type(obj) is Frame for obj in gc.get_objects())
    graph = trace_step(form, "remat", "real", "grad")
    graph(*fresh(new_inputs(Block(), 2)))
    del graph
    gc.collect()
    assert sum(type(obj) is Frame for obj in gc.get_objects()) == before


def test_the_sac_repro_traces_the_recomputed_matmul() -> None:
    """The reported case: a policy recomputing mm, saving the rest, traced step rerun on new values."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op == torch.ops.aten.mm.default:
            return remat.CheckpointPolicy.PREFER_RECOMPUTE
        return remat.CheckpointPolicy.MUST_SAVE

    def step(w: torch.Tensor, x: torch.Tensor) -> Any:
        out = remat.checkpoint(lambda t: torch.sin(t @ w), x, policy=policy)
        return torch.autograd.grad(out.sum(), (w,))

    graph = make_fx(step)(torch.randn(4, 4, requires_grad=True), torch.randn(2, 4))
    assert graph_constants(graph) == []
    assert str(graph.code).count("aten.mm.default") == 3  # forward, recomputation, gradient
    w, x = torch.randn(4, 4, requires_grad=True), torch.randn(2, 4)
    (want,) = torch.autograd.grad(torch.sin(x @ w).sum(), (w,))
    assert torch.equal(graph(w, x)[0], want)


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(
    forms=st.lists(st.sampled_from(list(FORMS)), min_size=1, max_size=3),
    mode=st.sampled_from(["real", "symbolic"] + (["non-strict"] if HAS_NON_STRICT else [])),
    style=st.sampled_from(["grad", "backward"]),
    seed=st.integers(0, 2**16),
)
def test_random_stacks_of_forms_trace_and_rerun(forms: list[str], mode: str, style: str, seed: int) -> None:
    """Blocks stacked, each with its own form, traced as one step and rerun on new values."""
    stack = [build(form, "remat") for form in forms]
    plain_stack = [build(form, "plain") for form in forms]

    class Stack(nn.Module):
        def __init__(self, made: list[Any]) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(block for block, _ in made)
            self.forwards = [forward for _, forward in made]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for forward in self.forwards:
                x = forward(x)
            return x

    model, plain = Stack(stack), Stack(plain_stack)

    def step(model: nn.Module) -> Callable[..., list[torch.Tensor]]:
        names = [f"block.{n}" for n, _ in model.named_parameters()]
        wrapped = Step(model, model, style)  # type: ignore[arg-type]
        return lambda *t: torch.func.functional_call(wrapped, dict(zip(names, t[:-1], strict=True)), t)  # type: ignore[no-any-return]

    shapes = [p.shape for p in model.parameters()]

    def inputs(offset: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed + offset)
        tensors = [torch.randn(shape, generator=generator) for shape in shapes]
        return [t.requires_grad_() for t in [*tensors, torch.randn(2, 5, 8, generator=generator)]]

    with tracing_mode_context(mode) as tracing_mode:
        graph = make_fx(step(model), tracing_mode=tracing_mode)(*inputs(0))
    assert graph_constants(graph) == []
    tensors = inputs(1)
    for g, w in zip(graph(*fresh(tensors)), step(plain)(*fresh(tensors)), strict=True):
        assert torch.equal(g, w)


# ---------------------------------------------------------------- compiled autograd


@contextlib.contextmanager
def compiled_autograd(backend: str) -> Iterator[None]:
    from torch._dynamo import compiled_autograd as ca

    enable = getattr(ca, "_enable", None) or ca.enable  # 2.4 names it enable
    torch._dynamo.reset()
    try:
        with enable(torch.compile(backend=backend)):
            yield
    finally:
        torch._dynamo.reset()


class Mixed(nn.Module):
    """One block per form (torch's own forms left out when ``impl`` lacks them)."""

    def __init__(self, impl: str, forms: list[str]) -> None:
        super().__init__()
        # MLP blocks: compiled autograd's compile time grows with the square of
        # the unpack hooks it meets (each one is a graph break).
        made = [(form, build(form, impl, attention=False)) for form in forms]
        made = [(form, m) for form, m in made if m is not None]
        self.forms = [form for form, _ in made]
        self.blocks = nn.ModuleList(m[0] for _, m in made)
        self.forwards = [m[1] for _, m in made]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for forward in self.forwards:
            x = forward(x)
        return x


def compiled_autograd_grads(impl: str, forms: list[str], backend: str, compile_forward: bool, steps: int = 2) -> tuple[list[Any], list[Any]]:
    """(gradients under compiled autograd, plain eager gradients) after ``steps`` steps."""
    model, plain = Mixed(impl, forms), Mixed("plain", Mixed(impl, forms).forms)
    plain.load_state_dict(model.state_dict())
    run = torch.compile(model, backend=backend) if compile_forward else model
    got, want = [], []
    with compiled_autograd(backend):
        for step in range(steps):
            x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(step), requires_grad=True)
            model.zero_grad()
            run(x).pow(2).sum().backward()
            got.append([x.grad, *(p.grad for p in model.parameters())])  # None: a parameter the MLP blocks skip
    for step in range(steps):
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(step), requires_grad=True)
        plain.zero_grad()
        plain(x).pow(2).sum().backward()
        want.append([x.grad, *(p.grad for p in plain.parameters())])
    return got, want


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("form", KIND_FORMS)
def test_compiled_autograd_gives_the_plain_gradients(form: str) -> None:
    got, want = compiled_autograd_grads("remat", [form], "aot_eager", False)
    for got_step, want_step in zip(got, want, strict=True):
        assert max_relative_error(got_step, want_step) == 0.0


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize(
    # inductor under an eager forward compiles one graph per hook call (minutes on a CPU):
    # in the table (python tests/integration/test_tracers.py), not here
    ("backend", "compile_forward"), [("aot_eager", True), ("inductor", True)]
)
def test_compiled_autograd_with_inductor_and_a_compiled_forward(backend: str, compile_forward: bool) -> None:
    got, want = compiled_autograd_grads("remat", ["full", "policy object", "offload policy", "composable"], backend, compile_forward)
    for got_step, want_step in zip(got, want, strict=True):
        assert max_relative_error(got_step, want_step) <= 1e-5  # the compiler reorders sums


@pytest.mark.compile
def test_compiled_autograd_runs_a_plain_region() -> None:
    """The reported case: remat.checkpoint(f, x).sum().backward() under compiled autograd."""
    got, want = compiled_autograd_grads("remat", ["full"], "aot_eager", False, steps=1)
    assert max_relative_error(got[0], want[0]) == 0.0


# ---------------------------------------------------------------- torch.export


class Exported(nn.Module):
    def __init__(self, form: str, impl: str) -> None:
        super().__init__()
        made = build(form, impl)
        assert made is not None
        self.block, self.run = made

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def export_outputs(form: str, impl: str, strict: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exported program's output, its ATen decomposition's output, the plain module's), on a new input."""
    module = Exported(form, impl)
    program = torch.export.export(module, (torch.randn(2, 5, 8, requires_grad=True),), strict=strict)
    x = torch.randn(2, 5, 8)
    plain = Exported(form, "plain")
    return program.module()(x), program.run_decompositions().module()(x), plain(x)


@pytest.mark.parametrize(
    "strict", [pytest.param(True, marks=[pytest.mark.compile, pytest.mark.slow]), False], ids=["strict", "non-strict"]
)
@pytest.mark.parametrize("form", form_params())
def test_exported_program_equals_the_plain_module(form: str, strict: bool) -> None:
    # Before 2.13 torch.export traces a region through torch's compiler door both ways:
    # the compiled path's documented limits (docs/guide/tracing.md, the table) apply.
    if not TORCH_HAS_SAC and form in SELECTIVE_FORMS:
        with pytest.raises(UnsupportedCheckpointError, match=r"needs torch >= 2\.5"):
            export_outputs(form, "remat", strict)
        return
    if not dynamo_traces_policy_objects() and form in POLICY_OBJECT_FORMS:
        with pytest.raises(UnsupportedCheckpointError, match=r"from torch 2\.9 on"):
            export_outputs(form, "remat", strict)
        return
    exported, decomposed, plain = export_outputs(form, "remat", strict)
    assert torch.equal(exported, plain)
    torch.testing.assert_close(decomposed, plain, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- torch.func

W = torch.randn(8, 8)


def _region(impl: str, reentrant: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _checkpoint(impl)(lambda a, b: F.gelu(a @ b).sum(-1), x, w, use_reentrant=reentrant)

    return region


def _plain_region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w).sum(-1)


FUNC_TRANSFORMS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "grad": lambda f: torch.func.grad(lambda x, w: f(x, w).sum())(torch.randn(3, 8), W),
    "vjp": lambda f: torch.func.vjp(f, torch.randn(3, 8), W)[1](torch.ones(3)),
    "jacrev": lambda f: torch.func.jacrev(f)(torch.randn(3, 8), W),
    "vmap(grad)": lambda f: torch.func.vmap(torch.func.grad(lambda x, w: f(x, w).sum()), in_dims=(0, None))(torch.randn(2, 3, 8), W),
    "vmap": lambda f: torch.func.vmap(f, in_dims=(0, None))(torch.randn(2, 3, 8), W.clone().requires_grad_()),
    "jvp": lambda f: torch.func.jvp(f, (torch.randn(3, 8), W.clone().requires_grad_()), (torch.randn(3, 8), torch.randn(8, 8))),
}


def run_transform(transform: str, f: Callable[..., Any]) -> Any:
    torch.manual_seed(0)
    return FUNC_TRANSFORMS[transform](f)


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "vmap(grad)"])
def test_grad_transforms_refuse_the_reentrant_variant_with_remats_error(transform: str) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=r"use_reentrant=True\) under torch\.func\.grad"):
        run_transform(transform, _region("remat", True))


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "vmap(grad)"])
def test_grad_transforms_run_the_default_variant(transform: str) -> None:
    # The region runs as one recomputing autograd.Function there
    # (remat._engine.transformed; tests/integration/test_func.py covers the forms).
    got = run_transform(transform, _region("remat", False))
    want = run_transform(transform, _plain_region)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        assert torch.equal(g, w)


VMAP_KEEPS_HOOKS = torch.__version__ >= "2.7"  # 2.4 turns saved-tensor hooks off under vmap and jvp too
needs_hooks_under_vmap = pytest.mark.skipif(
    not VMAP_KEEPS_HOOKS, reason=f"torch {torch.__version__} turns saved-tensor hooks off under vmap and jvp"
)


@pytest.mark.parametrize("transform", ["vmap", "jvp"])
def test_vmap_and_jvp_run_the_region(transform: str) -> None:
    # On its hooks from torch 2.7; on 2.4, which turns the hooks off under vmap
    # and jvp too, as one recomputing Function (remat._engine.transformed).
    got = run_transform(transform, _region("remat", False))
    want = run_transform(transform, _plain_region)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        assert torch.equal(g, w)


@needs_hooks_under_vmap
def test_backward_after_vmap_returned_is_refused_before_recomputing() -> None:
    w = W.clone().requires_grad_()
    out = torch.func.vmap(_region("remat", False), in_dims=(0, None))(torch.randn(2, 3, 8), w)
    with pytest.raises(UnsupportedCheckpointError, match="after the transform returned"):
        out.sum().backward()


def test_reentrant_region_under_vmap_runs_when_it_differentiates_nothing() -> None:
    xs = torch.randn(2, 3, 8)
    got = torch.func.vmap(_region("remat", True), in_dims=(0, None))(xs, W)
    assert torch.equal(got, torch.func.vmap(_plain_region, in_dims=(0, None))(xs, W))


@pytest.mark.parametrize("transform", ["vmap", "jvp"])
def test_reentrant_region_under_a_transform_is_refused_when_it_would_differentiate(transform: str) -> None:
    w = W.clone().requires_grad_()  # read by closure: the region's node would need autograd

    def region(x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(lambda a: F.gelu(a @ w).sum(-1), x, use_reentrant=True)

    with pytest.raises(UnsupportedCheckpointError, match=f"use_reentrant=True\\) under torch.func.{transform}"):
        run_transform(transform, region)


# ---------------------------------------------------------------- the table


def outcome(run: Callable[[], Any]) -> str:
    """"works", "error: <its type>" (remat's own or torch's) or "WRONG <error>"."""
    # torch.utils.checkpoint that fails under make_fx leaves its recompute tag in
    # torch.fx.traceback's current node metadata (2.13), and every later trace in
    # the process (compiled autograd's) inherits it: each cell starts clean.
    meta = getattr(torch.fx.traceback, "current_meta", None)
    before = dict(meta) if meta is not None else {}
    try:
        error = run()
    except RematError as exc:
        return f"remat error ({type(exc).__name__})"
    except Exception as exc:  # torch's own refusals, in the table only
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        said = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
        return f"torch error ({type(exc).__name__}: {said[:90]})"
    finally:
        if meta is not None:
            meta.clear()
            meta.update(before)
    return "works" if error is None else f"WRONG ({error})"


def make_fx_cell(form: str, impl: str, mode: str, style: str) -> str:
    if build(form, impl) is None:
        return "n/a"

    def run() -> str | None:
        graph = trace_step(form, impl, mode, style)
        tensors = new_inputs(Block(), 2)
        got, want = graph(*fresh(tensors)), plain_grads(form, tensors)
        constants = graph_constants(graph)
        if constants:
            return f"graph holds {constants}"
        error = max_relative_error(got, want)
        return None if error == 0.0 else f"max relative error {error:.2g}"

    return outcome(run)


def compiled_autograd_cell(form: str, impl: str, backend: str, compile_forward: bool) -> str:
    if build(form, impl) is None:
        return "n/a"
    if impl == "torch" and form == "reentrant" and not TORCH_HAS_SAC:
        # torch 2.4.1: torch's reentrant backward under compiled autograd waits
        # on a lock forever (seen: 10 minutes idle in CheckpointFunction.backward)
        return "hangs (torch 2.4: deadlock, not run)"

    def run() -> str | None:
        got, want = compiled_autograd_grads(impl, [form], backend, compile_forward, steps=1)
        error = max_relative_error(got[0], want[0])
        return None if error <= 1e-5 else f"max relative error {error:.2g}"

    return outcome(run)


def export_cell(form: str, impl: str, strict: bool) -> str:
    if build(form, impl) is None:
        return "n/a"

    def run() -> str | None:
        exported, decomposed, plain = export_outputs(form, impl, strict)
        error = max_relative_error([exported, decomposed], [plain, plain])
        return None if error <= 1e-6 else f"max relative error {error:.2g}"

    return outcome(run)


def func_cell(transform: str, impl: str, reentrant: bool) -> str:
    def run() -> str | None:
        got = run_transform(transform, _region(impl, reentrant))
        want = run_transform(transform, _plain_region)
        leaves = zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True)
        error = max_relative_error(*map(list, zip(*leaves, strict=True)))
        return None if error <= 1e-6 else f"max relative error {error:.2g}"

    return outcome(run)


def print_table(out: Any = sys.stdout, only: tuple[str, ...] = ()) -> None:
    """The tracer x form table, remat beside torch.utils.checkpoint.

    ``only``: the tracers whose label starts with one of these (all when
    empty). A torch compiler failure can leave the process unable to compile
    again (torch 2.4.1's inductor, after compiled autograd failed), so a
    section can be run in a process of its own.
    """
    print(f"torch {torch.__version__}", file=out)
    print("| tracer | form | remat | torch |", file=out)
    print("|---|---|---|---|", file=out)

    def row(tracer: str, form: str, cell: Callable[[str], str]) -> None:
        if only and not tracer.startswith(only):
            return
        print(f"| {tracer} | {form} | {cell('remat')} | {cell('torch')} |", file=out, flush=True)

    modes = ["real", "symbolic"] + (["non-strict"] if HAS_NON_STRICT else [])
    for mode in modes:
        for style in ("grad", "backward"):
            for form in FORMS:
                row(f"make_fx {mode}, {style}", form, functools.partial(lambda i, f, m, s: make_fx_cell(f, i, m, s), f=form, m=mode, s=style))
    # inductor under an eager forward compiles one small graph per hook call: minutes per cell here
    for backend, compile_forward in (("aot_eager", False), ("aot_eager", True), ("inductor", True)):
        label = f"compiled autograd {backend}, {'compiled' if compile_forward else 'eager'} forward"
        for form in FORMS:
            row(label, form, functools.partial(lambda i, f, b, c: compiled_autograd_cell(f, i, b, c), f=form, b=backend, c=compile_forward))
    for strict in (True, False):
        for form in FORMS:
            row(f"torch.export {'strict' if strict else 'non-strict'}", form, functools.partial(lambda i, f, s: export_cell(f, i, s), f=form, s=strict))
    for transform in FUNC_TRANSFORMS:
        for reentrant in (False, True):
            row(f"torch.func.{transform}", "reentrant" if reentrant else "full", functools.partial(lambda i, t, r: func_cell(t, i, r), t=transform, r=reentrant))


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    print_table(only=tuple(sys.argv[1:]))  # e.g. "torch.export" "torch.func"
