"""Reentrant checkpoint (use_reentrant=True): torch's autograd.Function variant.

Same grads as unchecked for ``.backward()`` and its documented limits, each
compared with torch's own reentrant checkpoint via the ``impl`` fixture.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

import remat
import remat._engine.reentrant_uses as reentrant_uses
from helpers import (
    PLAIN,
    CallCounter,
    Impl,
    OpCounter,
    Program,
    ScaleByWeight,
    assert_same,
    get_impl,
    squared_loss_grads,
)
from remat._compat.versions import backward_from_edges_supported
from remat.errors import CheckpointError


def leaf(*shape: int, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_(requires_grad)


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = (x @ w).tanh()
    return (h.sin() * x).exp().sigmoid()


def reentrant(ck: Impl, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return ck.checkpoint(fn, *args, use_reentrant=True, **kwargs)


def differential(impl: Impl, program: Callable[[Impl], Any], *, inputs_reused: bool = False) -> Any:
    """Exact agreement with the unchecked run.

    With ``inputs_reused`` (a region input also used elsewhere, or several
    times inside), torch's reentrant checkpoint sums the input's gradient
    inside its nested backward and only then adds the outer contributions:
    reassociated, so torch differs from the unchecked run in the last bits
    and agrees to rounding. remat gives each use its own edge and is exact
    (docs/design/reentrant.md).
    """
    torch.manual_seed(0)
    expected = program(PLAIN)
    torch.manual_seed(0)
    actual = program(impl)
    if not inputs_reused or impl.name == "remat":
        assert_same(actual, expected)
        return actual
    for a, e in zip(tree_flatten(actual)[0], tree_flatten(expected)[0], strict=True):
        assert torch.allclose(a, e, rtol=1e-5, atol=1e-6)
    return actual


def test_backward_matches_unchecked(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        out = reentrant(ck, chain, x, w) * x.exp()  # x also used outside the region
        out.sum().backward()
        return out, x.grad, w.grad

    differential(impl, program, inputs_reused=True)


def test_region_input_used_once(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        out = reentrant(ck, lambda x, w: (x @ w).tanh().exp() @ w, x.sin(), w)
        out.sum().backward()
        return out, x.grad

    differential(impl, program)


def test_tuple_outputs_non_tensor_args_and_constant_inputs(impl: Impl) -> None:
    def fn(x: torch.Tensor, c: torch.Tensor, n: int, act: str) -> tuple[torch.Tensor, torch.Tensor]:
        for _ in range(n):
            x = getattr(torch, act)(x * c)
        return x, (x @ c).cos()

    def program(ck: Impl) -> Any:
        x, c = leaf(4, 4), leaf(4, 4, requires_grad=False)
        a, b = reentrant(ck, fn, x, c, 3, "tanh")
        (a.sum() + b.sum()).backward()
        return a, b, x.grad, c.grad

    differential(impl, program)


def test_module_parameters(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        x = leaf(3, 8)  # reentrant gives parameters grads only if an input requires grad
        reentrant(ck, model, x).pow(2).sum().backward()
        return x.grad, {n: p.grad for n, p in model.named_parameters()}

    differential(impl, program)


def test_retain_graph_repeated_backward(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        loss = reentrant(ck, chain, x, w).sum()
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
        return first, x.grad, w.grad

    differential(impl, program)


def test_nested_reentrant(impl: Impl) -> None:
    def level(ck: Impl, depth: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if depth == 0:
            return chain(x, w)
        y = x.cos() * 1.5
        return (reentrant(ck, level, ck, depth - 1, y, w).tanh() + y) @ w

    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        reentrant(ck, level, ck, 3, x, w).sum().backward()
        return x.grad, w.grad

    differential(impl, program, inputs_reused=True)


def test_dropout_with_preserved_rng_state(impl: Impl) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x.tanh(), p=0.5, training=True).exp()

    def program(ck: Impl) -> Any:
        x = leaf(16, 16)
        reentrant(ck, fn, x).sum().backward()
        return x.grad, torch.get_rng_state()

    differential(impl, program)


def test_recompute_runs_the_whole_function_once_per_backward(impl: Impl) -> None:
    # No early stop in the reentrant variant: the trailing sub is rerun too.
    fn = CallCounter(lambda x: x.exp() - 1.0)
    x = leaf(4, 4)
    with OpCounter() as ops:
        loss = reentrant(impl, fn, x).sum()
        for backward in (1, 2):
            loss.backward(retain_graph=True)
            assert fn.calls == 1 + backward
        assert (ops.counts["aten.exp.default"], ops.counts["aten.sub.Tensor"]) == (3, 3)


def test_without_grad_just_runs_the_function(impl: Impl) -> None:
    fn = CallCounter(chain)
    x, w = leaf(4, 4), leaf(4, 4)
    with torch.no_grad():
        out = reentrant(impl, fn, x, w)
    assert fn.calls == 1 and not out.requires_grad
    assert_same(out, chain(x, w).detach())


@pytest.mark.parametrize("call", ["autograd.grad", "backward(inputs=...)"])
def test_grad_and_backward_inputs(impl: Impl, call: str) -> None:
    # torch's nested backward cannot honour them and says so; remat's region
    # hands its gradients to the outer backward like any node, so both work
    # and match the unchecked run (docs/design/reentrant.md).
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        loss = (reentrant(ck, chain, x, w) * w.cos()).sum()  # w also used outside
        if call == "autograd.grad":
            return torch.autograd.grad(loss, (x, w)), x.grad, w.grad
        loss.backward(inputs=[w])
        return x.grad, w.grad

    if impl.name == "torch":
        with pytest.raises(RuntimeError) as info:
            program(impl)
        message = str(info.value)
        assert "use_reentrant=False" in message and "inputs" in message
        return
    differential(impl, program)


def test_kwargs_are_rejected(impl: Impl) -> None:
    x = leaf(4)
    with pytest.raises(ValueError, match="scale"):
        reentrant(impl, lambda x, scale: x * scale, x, scale=2.0)


@pytest.mark.parametrize(
    "option",
    [
        {"context_fn": lambda: (contextlib.nullcontext(), contextlib.nullcontext())},
        {"debug": True},
    ],
    ids=["context_fn", "debug"],
)
def test_context_fn_and_debug_are_rejected(impl: Impl, option: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        reentrant(impl, torch.sin, leaf(4), **option)


def test_no_output_requiring_grad_fails_at_backward(impl: Impl) -> None:
    # The region's output requires grad (its input does), but the recompute
    # produces nothing differentiable.
    out = reentrant(impl, lambda x: x.detach() * 2, leaf(4))
    with pytest.raises(RuntimeError):
        out.sum().backward()


def test_outputs_made_from_constants_beside_dead_code() -> None:
    # What the function makes from x it does not return (dead code): its
    # outputs are constants, the unchecked program runs, and so does this one
    # (no gradient flows through the region). Unlike the test above, its
    # recomputation made a graph: it did not cut its own gradient. (torch's
    # reentrant variant raises "this checkpoint() is not necessary".)
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        constant = torch.randn(4, 4, dtype=torch.float64)

        def fn(h: torch.Tensor) -> torch.Tensor:
            unused = (h @ w).tanh()  # noqa: F841 (the dead code)
            return F.dropout(constant, p=0.3, training=True).cos()

        out = (reentrant(ck, fn, x) * x).sum() + w.sum()
        out.backward()
        return out, x.grad, w.grad

    differential(get_impl("remat"), program)


def test_constant_inputs_still_train_the_parameters(impl: Impl) -> None:
    # The classic reentrant pitfall: no input requires grad, so torch's node
    # has no edge and the parameters get no gradient (torch warns "None of the
    # inputs have requires_grad=True" and backward fails). remat's node has an
    # edge per use of every tensor that requires grad, parameters included:
    # the unchecked run's gradients, and no warning.
    def program(ck: Impl) -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 4))
        out = reentrant(ck, model, leaf(2, 4, requires_grad=False))
        out.sum().backward()
        return out, {name: p.grad for name, p in model.named_parameters()}

    if impl.name == "torch":
        model = nn.Linear(4, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out = reentrant(impl, model, leaf(2, 4, requires_grad=False))
        assert not out.requires_grad
        with pytest.raises(RuntimeError):
            out.sum().backward()
        assert model.weight.grad is None
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        differential(impl, program)


# --- Closures that reach the outer graph -------------------------------------
# torch's reentrant backward walks from the recomputed graph into the graph
# outside the region through tensors the region reads without taking them as
# arguments, and frees what the outer backward still needs ("backward through
# the graph a second time"). remat's nested backward stops at the region's
# edge; these run with torch only where torch can (docs/design/reentrant.md).

REMAT = get_impl("remat")


class CrossBlock(nn.Module):
    """Pre-norm residual block: attention from ``x`` to a ``memory`` it reads
    by closure (an activation with history outside the region), then an MLP
    with an in-place activation; views for the heads."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.memory: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.memory is not None
        rows, dim = x.shape
        q = self.q(self.norm1(x)).view(rows, self.heads, -1).transpose(0, 1)
        k, v = self.kv(self.memory).view(-1, 2, self.heads, dim // self.heads).unbind(1)
        scores = q @ k.permute(1, 2, 0) / (dim // self.heads) ** 0.5
        attended = (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1).reshape(rows, dim)
        x = x + attended
        h = self.up(self.norm2(x))
        h.relu_()
        return x + self.down(h)


def _cross_program(ck: Impl, how: str, nested: bool = False) -> Any:
    torch.manual_seed(0)
    blocks = nn.ModuleList(CrossBlock() for _ in range(2)).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    source = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    memory = (source @ blocks[0].q.weight).tanh()  # history outside every region
    for block in blocks:
        block.memory = memory

    def stack(h: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            h = reentrant(ck, block, h) if nested else block(h)
        return h

    out = reentrant(ck, stack, x.sin())
    loss = (out * memory.sum(0)).sum() + memory.cos().sum()  # memory used outside too
    params = (x, source, *blocks.parameters())
    if how == "backward":
        loss.backward()
        return out, [p.grad for p in params]
    if how == "retain_twice":
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in params]
        loss.backward()
        return out, first, [p.grad for p in params]
    if how == "two_losses":
        (out.pow(2).sum()).backward(retain_graph=True)
        first = [None if p.grad is None else p.grad.clone() for p in params]
        loss.backward()
        return out, first, [p.grad for p in params]
    if how == "grad":
        return out, torch.autograd.grad(loss, params)
    loss.backward(inputs=[source, *blocks[1].parameters()])
    return out, [p.grad for p in params]


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "reentrant_in_reentrant"])
@pytest.mark.parametrize("how", ["backward", "retain_twice", "two_losses", "grad", "inputs"])
def test_closure_with_history_outside_matches_unchecked_bitwise(how: str, nested: bool) -> None:
    torch.manual_seed(0)
    expected = _cross_program(PLAIN, how, nested)
    assert_same(_cross_program(REMAT, how, nested), expected)


def test_torch_fails_where_remat_runs() -> None:
    # The reason for the section above (if torch ever learns it, this fails).
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _cross_program(get_impl("torch"), "retain_twice")


@pytest.mark.parametrize("segments", [1, 2, 3])
def test_checkpoint_sequential_with_closures_matches_unchecked_bitwise(segments: int) -> None:
    def program(ck: Impl) -> Any:
        torch.manual_seed(0)
        blocks = [CrossBlock().double() for _ in range(3)]
        x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
        with torch.no_grad():
            shared = x[:3]  # a view made under no_grad: a constant, read by closure
        memory = x[:3].exp() + shared
        for block in blocks:
            block.memory = memory
        out = ck.checkpoint_sequential(nn.Sequential(*blocks), segments, x * 2, use_reentrant=True)
        loss = out.sum() + memory.sum()
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
        return out, first, x.grad, [b.kv.weight.grad for b in blocks]

    assert_same(program(REMAT), program(PLAIN))


def test_no_grad_view_input_and_returned_closure_match_unchecked() -> None:
    def program(ck: Impl) -> Any:
        torch.manual_seed(0)
        x, w = (torch.randn(4, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
        with torch.no_grad():
            frozen = x[1:]  # requires grad, no edge: a constant for autograd
        def fn(v: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (v @ w).tanh() + c.sum(), w, v  # w and v returned as they came in
        a, b, c = reentrant(ck, fn, x.sin(), frozen)
        (a.sum() + (b * w).sum() + c.pow(3).sum()).backward()
        return a, x.grad, w.grad

    assert_same(program(REMAT), program(PLAIN))


class _Opaque(ScaleByWeight):
    """A custom Function whose forward never shows its weight to Python torch
    calls (like a C++ extension): remat cannot see the weight in the forward."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        with torch._C.DisableTorchFunction():
            return h * w


def _custom_program(ck: Impl, function: type[ScaleByWeight], how: str, w: torch.Tensor | None = None) -> Any:
    torch.manual_seed(0)
    norm = nn.LayerNorm(4).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True) if w is None else w
    out = reentrant(ck, lambda h: function.apply(norm(h), w).tanh() + h, x.cos())
    loss = out.sum() + w.sum()
    if how == "grad":
        return torch.autograd.grad(loss, (x, w))
    loss.backward()
    return x.grad, w.grad, norm.weight.grad


def test_custom_function_taking_a_closure_matches_unchecked_bitwise() -> None:
    for how in ("backward", "grad"):
        assert_same(_custom_program(REMAT, ScaleByWeight, how), _custom_program(PLAIN, ScaleByWeight, how))


def test_custom_function_hiding_a_leaf_gets_its_gradient_as_torch_gives_it() -> None:
    # The weight reaches the recomputed graph only through the custom node's
    # edge: a nested backward accumulates it, as torch's reentrant backward
    # does (equal to rounding: accumulated before the outer contribution).
    got, expected = _custom_program(REMAT, _Opaque, "backward"), _custom_program(PLAIN, _Opaque, "backward")
    assert_same(got[0], expected[0])
    torch.testing.assert_close(got[1:], expected[1:], rtol=1e-13, atol=1e-15)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        _custom_program(REMAT, _Opaque, "grad")


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_custom_function_hiding_a_tensor_with_history_gets_its_gradient_as_torch_gives_it() -> None:
    # The region's node has no edge to the weight, an activation: a nested
    # backward from its gradient edge (torch >= 2.7) goes into the graph
    # outside, as torch's reentrant backward does. That graph is kept for the
    # outer backward, which also runs it (the weight is used outside too):
    # torch frees it first and fails. Under autograd.grad neither can run.
    def program(ck: Impl, how: str) -> Any:
        base = torch.randn(4, dtype=torch.float64, requires_grad=True, generator=torch.Generator().manual_seed(1))
        return _custom_program(ck, _Opaque, how, w=base * 2), base.grad

    if not backward_from_edges_supported():
        with pytest.raises(CheckpointError, match=r"2\.7"):
            program(REMAT, "backward")
        return
    assert_same(program(REMAT, "backward"), program(PLAIN, "backward"))
    with pytest.raises(CheckpointError, match="argument"):
        program(REMAT, "grad")


def test_closure_changed_in_place_before_backward_raises() -> None:
    # An optimizer step between forward and backward: the recomputation would
    # read the new weight (torch's reentrant variant silently does).
    layer = nn.Linear(4, 4)
    out = remat.checkpoint(lambda h: layer(h).tanh(), leaf(2, 4), use_reentrant=True)
    with torch.no_grad():
        layer.weight.add_(1.0)
    with pytest.raises(CheckpointError, match="modified by an inplace operation"):
        out.sum().backward()


def test_region_keeps_nothing_alive_after_backward() -> None:
    # The node refers to what the function reads weakly; a closure activation,
    # the stand-ins and the recomputed graph are gone with the graph.
    layer = nn.Linear(8, 8)
    x = leaf(4, 8)

    def step() -> tuple[torch.Tensor, weakref.ref[torch.Tensor]]:
        memory = x.exp()
        out = remat.checkpoint(lambda h: layer(h) * memory, x.sin(), use_reentrant=True)
        return (out + memory).sum(), weakref.ref(memory)

    loss, watch = step()
    assert watch() is not None
    loss.backward()
    del loss  # no reference cycle: freed at once, without the garbage collector
    assert watch() is None
    assert reentrant_uses.active_frames.get() == ()


def test_an_error_in_the_forward_leaves_no_mode_behind() -> None:
    def broken(h: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        remat.checkpoint(broken, leaf(3), use_reentrant=True)
    assert reentrant_uses.active_frames.get() == ()
    assert torch.sin(leaf(3)).requires_grad  # no mode left to swallow anything


# Second-order gradients through a reentrant region: torch silently drops the region's
# second-order terms (or raises); remat keeps the recomputation's graph for them.


def _second_order(t: torch.Tensor) -> torch.Tensor:
    return (t.sin() * t).sum(dim=-1, keepdim=True) * t


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("outside", [False, True])
def test_double_backward_through_reentrant_region_matches_unchecked(outside: bool) -> None:
    # With part of the gradient flowing outside the region, x.grad has a graph
    # and torch silently drops the region's second-order terms (without it,
    # torch raises). remat keeps the recomputation's graph for the second
    # backward (docs/design/reentrant.md, "Double backward"): the first-order
    # gradient is bitwise; the second backward also goes through the region's
    # output (x.grad is 2 y dy/dx), whose terms meet the recomputation's at x,
    # in another order: equal to rounding.
    def grads(program: Program) -> list[torch.Tensor]:
        x = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        x.requires_grad_()
        y = program(x) + (x.pow(3) if outside else 0)
        y.pow(2).sum().backward(create_graph=True)
        first = x.grad
        assert first is not None
        (second,) = torch.autograd.grad(first.sum(), x)
        return [first.detach(), second]

    got = grads(lambda t: remat.checkpoint(_second_order, t, use_reentrant=True))
    want = grads(_second_order)
    assert_same(got[:1], want[:1])
    torch.testing.assert_close(got[1], want[1], rtol=1e-13, atol=1e-13)


def test_double_backward_through_non_reentrant_region_matches_unchecked() -> None:
    def second_order_grads(program: Program) -> list[torch.Tensor]:
        x = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        x.requires_grad_()
        (g,) = torch.autograd.grad((program(x) + x.pow(3)).pow(2).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        return [g.detach(), gg]

    got = second_order_grads(lambda t: remat.checkpoint(_second_order, t))
    assert_same(got, second_order_grads(_second_order))


# Reentrant regions with structured or unused outputs.


def test_reentrant_dict_output_warns_naming_non_reentrant() -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="use_reentrant=False") as record:
        out = remat.checkpoint(lambda t: {"a": t.sin()}, x, use_reentrant=True)
    assert record[0].filename == __file__  # points at the caller
    assert out["a"].grad_fn is None  # what the warning is about


def test_reentrant_tuple_output_does_not_warn() -> None:
    import warnings

    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, b = remat.checkpoint(lambda t: (t.sin(), t.cos()), x, use_reentrant=True)
    assert a.grad_fn is not None and b.grad_fn is not None


def test_reentrant_output_unused_by_the_loss_leaves_grad_none() -> None:
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    only_second = torch.randn(2, 4, requires_grad=True)

    def two_heads(t: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return first(t), second(u)

    def grads(run: Callable[..., Any]) -> list[torch.Tensor | None]:
        for p in (*first.parameters(), *second.parameters()):
            p.grad = None
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        only_second.grad = None
        a, _ = run(two_heads, x, only_second)
        a.sum().backward()
        return [x.grad, first.weight.grad, second.weight.grad, second.bias.grad, only_second.grad]

    got = grads(functools.partial(remat.checkpoint, use_reentrant=True))
    expected = grads(lambda fn, *args: fn(*args))
    assert [g is None for g in got] == [g is None for g in expected] == [False, False, True, True, True]
    assert_same([g for g in got if g is not None], [g for g in expected if g is not None])


# autograd.grad or backward inside a reentrant region: an error naming the fix.


@pytest.mark.parametrize("style", ["grad", "backward"])
def test_autograd_inside_reentrant_region_names_non_reentrant(style: str) -> None:
    def with_inner_gradient(t: torch.Tensor) -> torch.Tensor:
        inner = t.pow(2).sum()
        if style == "grad":
            (g,) = torch.autograd.grad(inner, t)
        else:
            inner.backward()
            g = t.grad  # type: ignore[assignment]
        return t * g

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(CheckpointError, match="use_reentrant=False") as info:
        remat.checkpoint(with_inner_gradient, x, use_reentrant=True)
    assert "inside the region" in str(info.value)
    y = remat.checkpoint(with_inner_gradient, x, use_reentrant=False)  # the named fix works
    assert y.grad_fn is not None


# A non-reentrant checkpoint inside a reentrant one, backward(retain_graph=True) twice.


def _reentrant_around_non_reentrant(shared: bool) -> tuple[Callable[[Callable[..., Any]], Program], list[torch.Tensor]]:
    torch.manual_seed(0)
    inner_layer, outer_layer = torch.nn.Linear(8, 8).double(), torch.nn.Linear(8, 8).double()
    norm = torch.nn.LayerNorm(8).double()
    after = inner_layer if shared else outer_layer

    def build(ck: Callable[..., Any]) -> Program:
        def block(t: torch.Tensor) -> torch.Tensor:
            h = ck(lambda u: torch.nn.functional.dropout(inner_layer(norm(u)), 0.2).tanh(), t.sin(), use_reentrant=False)
            return h * t

        return lambda x: after(ck(block, x, use_reentrant=True)).sin()

    params = [*inner_layer.parameters(), *norm.parameters(), *outer_layer.parameters()]
    return build, params


def test_non_reentrant_inside_reentrant_retained_twice_matches_unchecked() -> None:
    build, params = _reentrant_around_non_reentrant(shared=False)
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.manual_seed(3)
    got = squared_loss_grads(build(remat.checkpoint), x, params, backwards=2)
    torch.manual_seed(3)
    assert_same(got, squared_loss_grads(build(PLAIN.checkpoint), x, params, backwards=2))


def test_reentrant_parameter_shared_outside_is_bitwise_the_unchecked_sum() -> None:
    # A parameter used inside a reentrant region and outside it gets two
    # contributions per backward. torch's reentrant variant adds its part to
    # .grad in a nested backward first: on the second retained backward that
    # is (g + a) + b versus g + (a + b), equal only up to rounding. remat's
    # reentrant node hands each use's gradient to the outer backward, which
    # adds them as the unchecked run does: bitwise, like the non-reentrant
    # variant (docs/design/reentrant.md).
    build, params = _reentrant_around_non_reentrant(shared=True)
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.manual_seed(3)
    expected = squared_loss_grads(build(PLAIN.checkpoint), x, params, backwards=2)
    torch.manual_seed(3)
    assert_same(squared_loss_grads(build(remat.checkpoint), x, params, backwards=2), expected)

    def non_reentrant(fn: Callable[..., Any], *args: Any, use_reentrant: bool) -> Any:
        return remat.checkpoint(fn, *args, use_reentrant=False)

    torch.manual_seed(3)
    assert_same(squared_loss_grads(build(non_reentrant), x, params, backwards=2), expected)


def test_a_tensor_returned_twice_gets_the_unchecked_sum_bitwise() -> None:
    # A region that returns one tensor in two places (a name tag, a tuple of
    # "hidden" and "residual" that are the same object): without checkpointing
    # every user's gradient is summed into that one tensor in the order autograd
    # runs the users. The node gives the tensor one output, not one per
    # position, so the sum is the same, to the bit.
    def block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = F.dropout(x, p=0.3, training=True)
        return h, x * 1.0, h

    def program(checkpoint: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
        h, carried, again = checkpoint(block, x, use_reentrant=True)
        attention = torch.softmax(x @ h.transpose(0, 1) / 2.0, dim=-1) @ h
        return h.sum() * 0.5 + attention.sum() + F.dropout(again, p=0.3, training=True).sum() + carried.sum()

    for seed in range(8):
        torch.manual_seed(seed)
        x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        torch.manual_seed(seed + 100)
        (want,) = torch.autograd.grad(program(PLAIN.checkpoint, x), x)
        torch.manual_seed(seed + 100)
        (got,) = torch.autograd.grad(program(remat.checkpoint, x), x)
        assert_same(got, want)
