"""checkpoint_sequential (what it accepts, what it computes), and argument validation of
checkpoint.

Gradients must equal the unchecked run exactly for every segment count, with
torch's checkpoint_sequential as the second oracle (via the ``impl`` fixture).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import PLAIN, CallCounter, Impl, assert_same

LAYERS = 6


def model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Dropout(0.3),
        nn.Linear(16, 8),
        nn.Sigmoid(),
    )


def callables() -> list[Callable[[torch.Tensor], torch.Tensor]]:
    w = torch.randn(8, 8, requires_grad=True)
    return [
        torch.sin,
        lambda x: x @ w,
        torch.tanh,
        lambda x: F.dropout(x, 0.3),
        torch.exp,
        torch.cos,
    ]


def differential(impl: Impl, program: Callable[[Impl], Any]) -> None:
    torch.manual_seed(0)
    expected = program(PLAIN)
    torch.manual_seed(0)
    assert_same(program(impl), expected)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("segments", range(1, LAYERS + 1))
def test_sequential_module(impl: Impl, segments: int, use_reentrant: bool) -> None:
    def program(ck: Impl) -> Any:
        net = model()
        x = torch.randn(4, 8, requires_grad=True)
        out = ck.checkpoint_sequential(net, segments, x, use_reentrant=use_reentrant)
        out.pow(2).sum().backward()
        return out, x.grad, {n: p.grad for n, p in net.named_parameters()}

    differential(impl, program)


@pytest.mark.parametrize("segments", range(1, LAYERS + 1))
def test_list_of_callables(impl: Impl, segments: int) -> None:
    def program(ck: Impl) -> Any:
        functions = callables()
        x = torch.randn(4, 8, requires_grad=True)
        out = ck.checkpoint_sequential(functions, segments, x, preserve_rng_state=True)
        return out, torch.autograd.grad(out.sum(), x)

    differential(impl, program)


@pytest.mark.parametrize("segments", [1, 2, 3, 6])
def test_last_segment_runs_unchecked(impl: Impl, segments: int) -> None:
    # Forward: every function once. Backward: each checkpointed segment's
    # functions once more; the last segment's functions never.
    functions = [
        CallCounter(f)
        for f in (torch.sin, torch.exp, torch.tanh, torch.sigmoid, torch.cos, torch.exp)
    ]
    x = torch.randn(4, 4, requires_grad=True)
    out = impl.checkpoint_sequential(functions, segments, x)
    assert [f.calls for f in functions] == [1] * LAYERS
    out.sum().backward()
    size = LAYERS // segments
    checkpointed = size * (segments - 1)
    assert [f.calls for f in functions] == [2] * checkpointed + [1] * (LAYERS - checkpointed)


# torch.utils.checkpoint.checkpoint_sequential does not validate `segments`:
# 0 raises ZeroDivisionError, a negative count silently runs everything
# unchecked, and more segments than functions dies in range() with
# "range() arg 3 must not be zero" (a ValueError by accident). remat rejects
# all of them with a ValueError that names the argument.
@pytest.mark.parametrize("segments", [0, -1, LAYERS + 1])
def test_remat_rejects_bad_segment_counts(segments: int) -> None:
    import remat

    with pytest.raises(ValueError, match="segments"):
        remat.checkpoint_sequential(model(), segments, torch.randn(2, 8, requires_grad=True))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_non_callable_function_is_type_error(impl: Impl, use_reentrant: bool) -> None:
    with pytest.raises(TypeError):
        impl.checkpoint(42, torch.randn(2, requires_grad=True), use_reentrant=use_reentrant)


# checkpoint_sequential says what it accepts.


def test_single_module_is_a_clear_type_error() -> None:
    import remat
    from remat.errors import CheckpointTypeError

    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(
        CheckpointTypeError,
        match=r"nn\.Sequential, or a list, tuple or nn\.ModuleList of callables.*got Linear\. "
        r"To checkpoint one Linear, call remat\.checkpoint",
    ):
        remat.checkpoint_sequential(torch.nn.Linear(4, 4), 1, x)
    with pytest.raises(CheckpointTypeError, match=r"element 1 is int, not callable"):
        remat.checkpoint_sequential([torch.nn.Linear(4, 4), 3], 1, x)


@pytest.mark.parametrize("container", [list, tuple, torch.nn.ModuleList])
def test_accepted_containers_match_unchecked(container: Callable[[Any], Any]) -> None:
    import remat

    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(4, 4).double(),
        torch.nn.LayerNorm(4).double(),
        torch.nn.GELU(),
        torch.nn.Linear(4, 4).double(),
    ]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = remat.checkpoint_sequential(container(layers), 2, x)
    params = [p for layer in layers for p in layer.parameters()]
    got = torch.autograd.grad(out.sum(), (x, *params))
    want_out = x
    for layer in layers:
        want_out = layer(want_out)
    assert_same(got, torch.autograd.grad(want_out.sum(), (x, *params)))
