"""A tensor a region read without receiving it (a closure, a module's parameter), changed
in place between the forward and the backward: the recomputation would read the new value,
so remat raises, naming the tensor and where it was saved, instead of giving a silently
wrong gradient; tensors the region itself changes are no false alarm.

The watch is ``remat._engine.frame.ReadWatch``, the error ``remat._engine.verify.stale_read``
(docs/design/lifetimes.md). Every test compares with the unchecked program (the oracle),
bitwise on CPU.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat
from helpers import PLAIN, Program, assert_same, squared_loss_grads
from remat.errors import CheckpointError


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


# A tensor read from outside the region and changed in place before backward: autograd
# refuses it without checkpointing, and every front-end of remat refuses it too.


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
    assert pathlib.Path(__file__).name in str(info.value)  # where the tensor was saved


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


@pytest.mark.parametrize("name", list(_no_false_alarm_programs(PLAIN.checkpoint)))
@pytest.mark.parametrize("early_stop", [True, False])
def test_tensors_changed_inside_the_region_are_no_false_alarm(name: str, early_stop: bool) -> None:
    x = torch.randn(3, 8, dtype=torch.float64)
    program, params = _no_false_alarm_programs(functools.partial(remat.checkpoint, early_stop=early_stop))[name]
    got = squared_loss_grads(program, x, params, backwards=2)
    program, params = _no_false_alarm_programs(PLAIN.checkpoint)[name]
    expected = squared_loss_grads(program, x, params, backwards=2)
    assert_same(got, expected)
