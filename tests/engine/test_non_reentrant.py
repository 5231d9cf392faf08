"""Non-reentrant checkpoint: same program, three ways.

Every test runs a program unchecked (``PLAIN``, the oracle) and checkpointed by
the ``impl`` fixture (torch.utils.checkpoint and remat), and compares results
and gradients exactly on CPU. Error tests assert the builtin class torch raises,
so remat stays catchable by code written for torch.
"""

from __future__ import annotations

import pathlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import PLAIN, CallCounter, Impl, OpCounter, assert_same, builtin_base

Ck = Callable[..., Any]


def leaf(*shape: int, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_(requires_grad)


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = (x @ w).tanh()
    h = h.sin() * x
    return h.exp().sigmoid()


def differential(impl: Impl, program: Callable[[Impl], Any]) -> Any:
    """Run ``program`` with ``impl`` and unchecked from the same seed; they must agree exactly."""
    torch.manual_seed(0)
    expected = program(PLAIN)
    torch.manual_seed(0)
    actual = program(impl)
    assert_same(actual, expected)
    return actual


def test_autograd_grad(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        out = ck.checkpoint(chain, x, w)
        return out, torch.autograd.grad(out.sum(), (x, w))

    differential(impl, program)


def test_backward_with_inputs(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        ck.checkpoint(chain, x, w).sum().backward(inputs=[w])
        return x.grad, w.grad

    x_grad, w_grad = differential(impl, program)
    assert x_grad is None and w_grad is not None


def test_kwargs(impl: Impl) -> None:
    def fn(x: torch.Tensor, *, w: torch.Tensor, scale: float, act: str) -> torch.Tensor:
        return getattr(torch, act)(x @ w) * scale

    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        out = ck.checkpoint(fn, x, w=w, scale=2.5, act="tanh")
        return out, torch.autograd.grad(out.sum(), (x, w))

    differential(impl, program)


def test_nested_structures_in_inputs_and_outputs(impl: Impl) -> None:
    def fn(d: dict[str, Any], pair: tuple[torch.Tensor, list[torch.Tensor]]) -> dict[str, Any]:
        a = (d["a"] * d["b"][0]).sin()
        b = pair[1][0].exp() @ pair[0]
        return {"sum": a + b, "parts": [a.tanh(), (b.cos(), 7)], "tag": d["tag"]}

    def program(ck: Impl) -> Any:
        a, b0, p0, p1 = leaf(3, 3), leaf(3, 3), leaf(3, 3), leaf(3, 3)
        out = ck.checkpoint(fn, {"a": a, "b": [b0], "tag": "t"}, (p0, [p1]))
        loss = out["sum"].sum() + out["parts"][0].sum() + 2 * out["parts"][1][0].sum()
        return out, torch.autograd.grad(loss, (a, b0, p0, p1))

    out, _ = differential(impl, program)
    assert out["tag"] == "t" and out["parts"][1][1] == 7


def test_inputs_not_requiring_grad(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4, requires_grad=False), leaf(4, 4)
        linear = nn.Linear(4, 4)
        # x is constant; w and linear's parameters reach the region only as
        # an argument and through a closure.
        out = ck.checkpoint(lambda x, w: linear(chain(x, w)), x, w)
        out.sum().backward()
        return out, w.grad, linear.weight.grad, linear.bias.grad

    differential(impl, program)


def test_all_inputs_constant_parameters_inside(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        x = leaf(2, 4, requires_grad=False)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        out = ck.checkpoint(model, x)
        out.sum().backward()
        return out, {n: p.grad for n, p in model.named_parameters()}

    differential(impl, program)


def test_non_tensor_args(impl: Impl) -> None:
    def fn(x: torch.Tensor, n: int, act: str, none: None, scale: float) -> torch.Tensor:
        assert none is None
        for _ in range(n):
            x = getattr(torch, act)(x) * scale
        return x

    def program(ck: Impl) -> Any:
        x = leaf(4, 4)
        out = ck.checkpoint(fn, x, 3, "sin", None, 1.5)
        return out, torch.autograd.grad(out.sum(), x)

    differential(impl, program)


def test_module_parameter_grads(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        model = nn.Sequential(
            nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
        )
        x = leaf(5, 8)
        out = ck.checkpoint(model, x)
        out.pow(2).sum().backward()
        return out, x.grad, {n: p.grad for n, p in model.named_parameters()}

    differential(impl, program)


@pytest.mark.parametrize("early_stop", [True, False])
def test_backward_inside_checkpointed_function(impl: Impl, early_stop: bool) -> None:
    # torch's "Rule 6" examples: grad inside the region forces a recompute of
    # the region itself while it is still running its forward.
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        z = y.cos()
        (gx,) = torch.autograd.grad(z.sum(), x, create_graph=True)
        (gx_detached,) = torch.autograd.grad(x.exp().sum(), x)
        return x.cos() * gx + z * gx_detached

    def program(ck: Impl) -> Any:
        x = leaf(4, 4)
        out = ck.checkpoint(fn, x, early_stop=early_stop)
        out.sum().backward()
        return out, x.grad

    differential(impl, program)


def test_retain_graph_and_repeated_backward(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        out = ck.checkpoint(chain, x, w)
        loss = out.sum()
        loss.backward(retain_graph=True)
        first = (x.grad.clone(), w.grad.clone())
        loss.backward(retain_graph=True)
        (out * 3).sum().backward()  # a third backward, releasing the graph
        return first, x.grad, w.grad

    (first_x, first_w), x_grad, w_grad = differential(impl, program)
    assert torch.allclose(x_grad, first_x * 5) and torch.allclose(w_grad, first_w * 5)


def test_double_backward(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        out = ck.checkpoint(chain, x, w)
        gx, gw = torch.autograd.grad(out.sum(), (x, w), create_graph=True)
        ggx, ggw = torch.autograd.grad((gx * gw).sum(), (x, w))
        return gx, gw, ggx, ggw

    differential(impl, program)


def _nested(ck: Impl, depth: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """depth levels of checkpoints, with ops between every level."""
    if depth == 0:
        return chain(x, w)
    y = (x * 1.5).cos()
    z = ck.checkpoint(_nested, ck, depth - 1, y, w)
    return (z.tanh() + y) @ w


@pytest.mark.parametrize("depth", [3, 4])
@pytest.mark.parametrize("early_stop", [True, False])
def test_nesting(impl: Impl, depth: int, early_stop: bool) -> None:
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        with ck.set_checkpoint_early_stop(early_stop):
            out = ck.checkpoint(_nested, ck, depth, x, w)
        loss = out.sum()
        first = torch.autograd.grad(loss, (x, w), retain_graph=True)
        return out, first, torch.autograd.grad(loss, (x, w))

    differential(impl, program)


def test_nested_double_backward(impl: Impl) -> None:
    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        out = ck.checkpoint(_nested, ck, 3, x, w)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return gx, torch.autograd.grad(gx.sum(), (x, w))

    differential(impl, program)


@pytest.mark.parametrize("via", ["argument", "context"])
@pytest.mark.parametrize("enabled", [True, False])
def test_early_stop_setting_keeps_gradients(impl: Impl, via: str, enabled: bool) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.exp()
        return y - 1.0, (y * x).sum(0)

    def program(ck: Impl) -> Any:
        x = leaf(4, 4)
        if via == "argument":
            a, b = ck.checkpoint(fn, x, early_stop=enabled)
        else:
            with ck.set_checkpoint_early_stop(enabled):
                a, b = ck.checkpoint(fn, x)
        return torch.autograd.grad(a.sum() + b.sum(), x)

    differential(impl, program)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_without_grad_just_runs_the_function(impl: Impl, mode: Callable[[], Any]) -> None:
    fn = CallCounter(chain)
    x, w = leaf(4, 4), leaf(4, 4)
    with mode():
        out = impl.checkpoint(fn, x, w)
        expected = chain(x, w)
    assert fn.calls == 1
    assert not out.requires_grad and out.grad_fn is None
    assert_same(out, expected)


def _dropout_program(
    preserve_rng_state: bool, reseed_before_backward: bool
) -> Callable[[Impl], Any]:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.dropout((x @ w).tanh(), p=0.5, training=True).sin()

    def program(ck: Impl) -> Any:
        x, w = leaf(16, 16), leaf(16, 16)
        torch.manual_seed(1234)
        out = ck.checkpoint(fn, x, w, preserve_rng_state=preserve_rng_state)
        if reseed_before_backward:
            torch.manual_seed(1234)
        state_before_backward = torch.get_rng_state()
        grad = torch.autograd.grad(out.sum(), (x, w))
        rng_untouched = torch.equal(torch.get_rng_state(), state_before_backward)
        return grad, rng_untouched

    return program


def test_dropout_with_preserved_rng_state(impl: Impl) -> None:
    # The recompute replays the forward's RNG state inside a fork: same mask,
    # and the caller's RNG stream is left exactly where it was.
    (_, rng_untouched) = differential(impl, _dropout_program(True, False))
    assert rng_untouched


def test_dropout_without_preserved_rng_state(impl: Impl) -> None:
    # preserve_rng_state=False: the recompute draws from the global RNG as it
    # is at backward time. With the generator reset to the forward's seed the
    # mask (and so the gradient) is the same...
    torch.manual_seed(0)
    expected, _ = _dropout_program(False, True)(PLAIN)
    torch.manual_seed(0)
    actual, _ = _dropout_program(False, True)(impl)
    assert_same(actual, expected)
    # ...otherwise the mask differs from the forward's (silently wrong
    # gradients) and the recompute advances the caller's RNG.
    torch.manual_seed(0)
    expected, _ = _dropout_program(False, False)(PLAIN)
    torch.manual_seed(0)
    actual, rng_untouched = _dropout_program(False, False)(impl)
    assert not torch.equal(actual[0], expected[0])
    assert not rng_untouched


@pytest.mark.parametrize("determinism_check", ["default", "none"])
@pytest.mark.parametrize("forward_autocast", [True, False], ids=["forward-bf16", "forward-off"])
def test_autocast_state_of_the_forward_is_replayed_in_backward(
    impl: Impl, determinism_check: str, forward_autocast: bool
) -> None:
    # Forward under bf16 autocast, backward outside it: the region saves bf16
    # casts of x and w for mm, and a recompute outside autocast would save
    # float32 tensors. Forward outside, backward inside: the reverse; remat
    # keeps "autocast off" as one shared state with no dtype, and entering it
    # must still turn autocast off. Either mistake is a metadata mismatch
    # ("default") or different gradients ("none").
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).sin() @ w

    def program(ck: Impl) -> Any:
        x, w = leaf(8, 8), leaf(8, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=forward_autocast):
            out = ck.checkpoint(fn, x, w, determinism_check=determinism_check)
        assert out.dtype == (torch.bfloat16 if forward_autocast else torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not forward_autocast):
            grads = torch.autograd.grad(out.float().sum(), (x, w))
        return out, grads

    differential(impl, program)


def _shape_changing(calls: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Saves a (4,) constant in the forward and a (1,) constant when recomputed."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        c = torch.full((4,), 2.0) if len(calls) == 1 else torch.full((1,), 3.0)
        return x * c  # mul saves c for x's gradient

    return fn


def test_determinism_check_default_raises_on_shape_mismatch(impl: Impl) -> None:
    x = leaf(4)
    out = impl.checkpoint(_shape_changing([]), x)
    with pytest.raises(RuntimeError) as info:
        out.sum().backward()
    assert isinstance(info.value, impl.CheckpointError)
    assert "shape" in str(info.value).lower()


def test_determinism_check_none_disables_the_check(impl: Impl) -> None:
    x = leaf(4)
    impl.checkpoint(_shape_changing([]), x, determinism_check="none").sum().backward()
    # No error: the backward used the recomputed (1,)-shaped constant 3.0.
    assert torch.equal(x.grad, torch.full((4,), 3.0))


def test_invalid_determinism_check_is_value_error(impl: Impl) -> None:
    x = leaf(4)
    with pytest.raises(ValueError, match="determinism_check"):
        impl.checkpoint(torch.sin, x, determinism_check="shapes").sum().backward()


@pytest.mark.parametrize("how", ["argument", "context"])
def test_debug_error_lists_forward_and_recompute_ops(impl: Impl, how: str) -> None:
    x = leaf(4)
    if how == "argument":
        out = impl.checkpoint(_shape_changing([]), x, debug=True)
    else:
        with impl.set_checkpoint_debug_enabled(True):  # overrides debug=False
            out = impl.checkpoint(_shape_changing([]), x, debug=False)
    with pytest.raises(RuntimeError) as info:
        out.sum().backward()
    message = str(info.value)
    assert isinstance(info.value, impl.CheckpointError)
    assert "aten.full.default" in message and "aten.mul.Tensor" in message
    assert pathlib.Path(__file__).name in message  # stack traces of the ops


def test_debug_disabled_by_context_overrides_argument(impl: Impl) -> None:
    x = leaf(4)
    with impl.set_checkpoint_debug_enabled(False):
        out = impl.checkpoint(_shape_changing([]), x, debug=True)
    with pytest.raises(RuntimeError) as info:
        out.sum().backward()
    assert isinstance(info.value, impl.CheckpointError)
    assert "aten.full.default" not in str(info.value)


class ReadsSavedTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        (b,) = ctx.saved_tensors
        return grad * 2 + 0 * (a - b)


def test_double_unpack_raises_checkpoint_error(impl: Impl) -> None:
    x = leaf(4)
    ReadsSavedTwice.apply(x).sum().backward()  # fine without checkpointing
    out = impl.checkpoint(lambda t: ReadsSavedTwice.apply(t.sin()), x)
    with pytest.raises(RuntimeError) as info:
        out.sum().backward()
    # torch also raises its CheckpointError ("already unpacked once").
    assert isinstance(info.value, impl.CheckpointError)


def test_graph_exec_group_gradients(impl: Impl) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * w).sin(), (x @ w).tanh()

    def program(ck: Impl) -> Any:
        x, w = leaf(4, 4), leaf(4, 4)
        a, b = ck.checkpoint(fn, x, w)
        with ck.graph_exec_group():
            a.sum().backward()
            b.sum().backward()
        return x.grad, w.grad

    differential(impl, program)


def test_exception_in_forward_propagates_and_leaves_no_state(impl: Impl) -> None:
    def fails(x: torch.Tensor) -> torch.Tensor:
        x.sin()
        raise KeyError("boom")

    x = leaf(4)
    with pytest.raises(KeyError, match="boom"):
        impl.checkpoint(fails, x)
    # No saved-tensor hooks left behind (a private probe, absent on torch 2.4).
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top_hooks is not None:
        assert top_hooks(False) is None
    # The next region works as usual.
    differential(
        impl,
        lambda ck: torch.autograd.grad(ck.checkpoint(chain, leaf(4, 4), x.expand(4, 4)).sum(), x),
    )


def test_error_types_match_torch_builtins(impl: Impl) -> None:
    assert builtin_base(impl.CheckpointError) is RuntimeError


# ---- remat only -----------------------------------------------------------


def test_remat_does_not_warn_when_use_reentrant_is_omitted() -> None:
    import remat

    x = leaf(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.checkpoint(torch.sin, x).sum().backward()
        remat.checkpoint_sequential([torch.sin, torch.cos], 2, x).sum().backward()


def test_remat_settings_are_not_shared_across_threads() -> None:
    # Settings are context-local (docs/design/architecture.md, "Principles the code cites"). torch's set_checkpoint_early_stop
    # is a module global, so this test is remat-only.
    import remat

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.exp() - 1.0  # exp saves its output; sub saves nothing

    counts: dict[str, int] = {}

    def worker() -> None:
        x = leaf(4)
        out = remat.checkpoint(fn, x)  # default early_stop=True
        with OpCounter() as ops:
            out.sum().backward()
        counts["sub"] = ops.counts["aten.sub.Tensor"]

    with remat.set_checkpoint_early_stop(False):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert counts == {"sub": 0}  # the worker's region stopped early
