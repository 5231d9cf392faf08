"""Issue 13: no silent wrong gradient. One regression test (or a few) per item.

Every test compares with the unchecked program (the oracle), bitwise on CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat
from remat.errors import CheckpointError

Program = Callable[[torch.Tensor], torch.Tensor]


def _grads(program: Program, x: torch.Tensor, params: list[torch.Tensor], backwards: int = 1) -> list[torch.Tensor]:
    """Gradients of ``program(x)`` after ``backwards`` retained backward calls."""
    x = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    loss = program(x).pow(2).sum()
    for _ in range(backwards):
        loss.backward(retain_graph=True)
    grads = [x.grad] + [p.grad for p in params]
    return [g.clone() if g is not None else torch.zeros(0) for g in grads]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        assert torch.equal(left, right)


class _Block(torch.nn.Module):
    """Residual block with layer norm and in-place ops: the usual transformer shape."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        h[:, :2].mul_(0.5)  # in-place on a view of a tensor made in the region
        return x + self.down(h.relu_())


# Item 1: a tensor read from outside the region, changed in place before backward.


def test_closure_changed_in_place_before_backward_raises() -> None:
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    # Oracle: autograd itself refuses.
    y = (x @ w).sin()
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y = remat.checkpoint(lambda t: (t @ w).sin(), x)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(CheckpointError, match=r"shape=\[4, 4\], dtype=torch.float64") as info:
        y.sum().backward()
    assert "without receiving it as an argument" in str(info.value)
    assert x.grad is None


def test_optimizer_step_between_forward_and_backward_raises_with_source_line() -> None:
    block = _Block()
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
    x = torch.randn(3, 8, requires_grad=True)
    y = remat.checkpoint(block, x, debug=True)
    block(x).sum().backward()
    optimizer.step()  # updates the weights the region read, in place
    with pytest.raises(CheckpointError, match="optimizer step") as info:
        y.sum().backward()
    assert "test_correctness.py" in str(info.value)  # where the tensor was saved


def test_closure_changed_between_two_retained_backwards_raises() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    y = remat.checkpoint(lambda t: (t @ w.t()).tanh(), x)  # saved: a view of w
    y.sum().backward(retain_graph=True)
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(CheckpointError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("front_end", ["wrapper", "composable", "nested"])
def test_every_front_end_refuses_a_weight_updated_before_backward(front_end: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    if front_end == "wrapper":
        remat.apply_activation_checkpointing(model)
        run: Program = model
    elif front_end == "composable":
        remat.checkpoint_module(model[1])
        run = model
    else:
        run = lambda t: remat.checkpoint(lambda u: model[1](remat.checkpoint(model[0], u)), t)  # noqa: E731
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    y = run(torch.randn(3, 8, requires_grad=True))
    optimizer.zero_grad()
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    with pytest.raises(CheckpointError, match="optimizer step"):
        y.sum().backward()


def test_changed_closure_of_a_tensor_subclass_raises() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    w = TwoTensor(torch.randn(3, 3), torch.randn(3, 3)).requires_grad_()
    x = TwoTensor(torch.randn(2, 3), torch.randn(2, 3)).requires_grad_()
    y = remat.checkpoint(lambda t: (t @ w.t()).sin(), x)
    y.sum().backward(retain_graph=True)  # unchanged: fine
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(CheckpointError, match="modified by an inplace operation"):
        y.sum().backward()


def test_determinism_check_none_skips_the_read_check() -> None:
    w = torch.randn(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    y = remat.checkpoint(lambda t: t @ w, x, determinism_check="none")
    w.mul_(2)
    y.sum().backward()  # the documented opt-out: unchecked, the recompute reads the new w
    assert torch.equal(x.grad, torch.ones(3, 4) @ w.t())  # type: ignore[arg-type]


def _plain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    for option in ("context_fn", "use_reentrant", "debug", "determinism_check", "early_stop"):
        kwargs.pop(option, None)
    return fn(*args, **kwargs)


def _no_false_alarm_programs(ck: Callable[..., Any]) -> dict[str, tuple[Program, list[torch.Tensor]]]:
    torch.manual_seed(0)
    block = _Block().double()
    norm = torch.nn.BatchNorm1d(8)
    saved = functools.partial(remat.create_selective_checkpoint_contexts, [torch.ops.aten.native_layer_norm.default, torch.ops.aten.relu_.default])
    params = list(block.parameters())
    return {
        "block": (lambda x: ck(block, x), params),
        "nested blocks": (lambda x: ck(lambda u: block(ck(block, u.sin())) * u.exp(), x), params),
        "batch norm": (lambda x: ck(lambda t: norm(block(t).float()).tanh(), x), params),
        "view of a parameter under no_grad": (
            lambda x: ck(lambda t: t * block.up.weight.detach()[0, :8], x),
            params[:0],
        ),
        "selective": (lambda x: ck(lambda t: block(t).sin(), x, context_fn=saved), params),
        "constant made in region": (
            lambda x: ck(lambda t: t * torch.ones(8, dtype=torch.float64).expand(3, 8), x),
            params[:0],
        ),
    }


@pytest.mark.parametrize("name", list(_no_false_alarm_programs(_plain)))
@pytest.mark.parametrize("early_stop", [True, False])
def test_tensors_changed_inside_the_region_are_no_false_alarm(name: str, early_stop: bool) -> None:
    x = torch.randn(3, 8, dtype=torch.float64)
    program, params = _no_false_alarm_programs(functools.partial(remat.checkpoint, early_stop=early_stop))[name]
    got = _grads(program, x, params, backwards=2)
    program, params = _no_false_alarm_programs(_plain)[name]
    expected = _grads(program, x, params, backwards=2)
    _assert_same(got, expected)


# Item 6: a selective policy that saves the output of an in-place op (on a view).


def _scale_a_slice(t: torch.Tensor) -> torch.Tensor:
    h = t * 3
    h[:, :2].mul_(0.5)  # in-place op on a view: its write must happen again in recompute
    return h.sin()


def _save_in_place_muls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> remat.CheckpointPolicy:
    if op in (torch.ops.aten.mul_.Tensor, torch.ops.aten.mul_.Scalar):
        return remat.CheckpointPolicy.MUST_SAVE
    return remat.CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("allow_mutation", [False, True])
def test_selective_policy_saving_an_in_place_op_on_a_view_matches_unchecked(allow_mutation: bool) -> None:
    x = torch.randn(3, 4, dtype=torch.float64)
    context_fn = functools.partial(
        remat.create_selective_checkpoint_contexts,
        _save_in_place_muls,
        allow_cache_entry_mutation=allow_mutation,
    )
    got = _grads(lambda t: remat.checkpoint(_scale_a_slice, t, context_fn=context_fn), x, [])
    _assert_same(got, _grads(_scale_a_slice, x, []))


# Item 2: second-order gradients through a reentrant region.


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
    _assert_same(got[:1], want[:1])
    torch.testing.assert_close(got[1], want[1], rtol=1e-13, atol=1e-13)


def test_double_backward_through_non_reentrant_region_matches_unchecked() -> None:
    def second_order_grads(program: Program) -> list[torch.Tensor]:
        x = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        x.requires_grad_()
        (g,) = torch.autograd.grad((program(x) + x.pow(3)).pow(2).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        return [g.detach(), gg]

    got = second_order_grads(lambda t: remat.checkpoint(_second_order, t))
    _assert_same(got, second_order_grads(_second_order))


# Item 3: reentrant regions with structured or unused outputs.


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
    _assert_same([g for g in got if g is not None], [g for g in expected if g is not None])


# Item 12: autograd inside a reentrant region.


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


# Item 5: a view taken under no_grad of a tensor that requires grad, into a nested checkpoint.


def _gate(t: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return (t * gate).exp() + gate.cos()


def _no_grad_view(u: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return u[:, 4:]  # requires_grad is True, yet autograd never differentiates it


def _gated_block(ck: Callable[..., Any], norm: torch.nn.Module) -> Program:
    def outer(u: torch.Tensor) -> torch.Tensor:
        return ck(_gate, norm(u)[:, :4], _no_grad_view(u)) * u[:, :4]

    return lambda x: ck(outer, x)


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("base", ["leaf", "non-leaf"])
def test_no_grad_view_into_nested_checkpoint_matches_unchecked(early_stop: bool, base: str) -> None:
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    params = list(norm.parameters())

    def program(ck: Callable[..., Any]) -> Program:
        block = _gated_block(ck, norm)
        return block if base == "leaf" else (lambda t: block(t * 2))

    got = _grads(program(functools.partial(remat.checkpoint, early_stop=early_stop)), x, params, 2)
    _assert_same(got, _grads(program(_plain), x, params, 2))


# Item 4: a non-reentrant checkpoint inside a reentrant one, backward(retain_graph=True) twice.


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
    got = _grads(build(remat.checkpoint), x, params, backwards=2)
    torch.manual_seed(3)
    _assert_same(got, _grads(build(_plain), x, params, backwards=2))


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
    expected = _grads(build(_plain), x, params, backwards=2)
    torch.manual_seed(3)
    _assert_same(_grads(build(remat.checkpoint), x, params, backwards=2), expected)

    def non_reentrant(fn: Callable[..., Any], *args: Any, use_reentrant: bool) -> Any:
        return remat.checkpoint(fn, *args, use_reentrant=False)

    torch.manual_seed(3)
    _assert_same(_grads(build(non_reentrant), x, params, backwards=2), expected)
