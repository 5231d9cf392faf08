"""SPEC §1, reentrant checkpoint (use_reentrant=True): torch's autograd.Function variant.

Same grads as unchecked for ``.backward()`` and its documented limits, each
compared with torch's own reentrant checkpoint via the ``impl`` fixture.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from helpers import PLAIN, TORCH, CallCounter, Impl, OpCounter, assert_same


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
    times inside), the region's input gradient is summed inside the
    recompute's own backward and only then added to the outer contributions:
    the sum is reassociated, so torch's reentrant checkpoint itself differs
    from the unchecked run in the last bits. Then the oracle for exactness is
    torch's reentrant checkpoint, and the unchecked run agrees to rounding.
    """
    torch.manual_seed(0)
    expected = program(PLAIN)
    torch.manual_seed(0)
    actual = program(impl)
    if not inputs_reused:
        assert_same(actual, expected)
        return actual
    torch.manual_seed(0)
    assert_same(actual, program(TORCH))
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
def test_grad_or_backward_inputs_is_a_clear_error(impl: Impl, call: str) -> None:
    x, w = leaf(4, 4), leaf(4, 4)
    loss = reentrant(impl, chain, x, w).sum()
    with pytest.raises(RuntimeError) as info:
        if call == "autograd.grad":
            torch.autograd.grad(loss, (x, w))
        else:
            loss.backward(inputs=[w])
    message = str(info.value)
    assert "use_reentrant=False" in message and "inputs" in message


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


def test_constant_inputs_leave_parameters_without_grad(impl: Impl) -> None:
    # The classic reentrant pitfall (torch warns "None of the inputs have
    # requires_grad=True"): the output does not require grad, so backward
    # fails instead of reaching the parameters.
    model = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = reentrant(impl, model, leaf(2, 4, requires_grad=False))
    assert not out.requires_grad
    with pytest.raises(RuntimeError):
        out.sum().backward()
    assert model.weight.grad is None
