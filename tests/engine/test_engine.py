"""remat-specific behaviour of the core engine: a region's lifecycle (stop signals, exceptions,
what is freed when), devices, decorators, inputs and nesting.

Errors are in ``tests/test_errors.py``, the knobs in ``tests/test_settings.py``, the
determinism check and the debug log in ``tests/engine/test_verify.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat
from helpers import PLAIN, Program, assert_same, live_frames, squared_loss_grads
from remat.errors import (
    DeviceStateError,
)


def test_public_names_sorted_and_exported() -> None:
    assert remat.__all__ == sorted(remat.__all__)
    for name in remat.__all__:
        assert hasattr(remat, name), name


def test_stop_signal_not_swallowed_by_user_except() -> None:
    def fn(t: torch.Tensor) -> torch.Tensor:
        try:
            a = t.sin()
        except Exception:  # a user's broad handler must not eat the stop signal
            a = torch.zeros_like(t)
        return a.cos()

    x = torch.randn(5, requires_grad=True)
    remat.checkpoint(fn, x).sum().backward()
    expected = -torch.sin(torch.sin(x)) * torch.cos(x)
    assert torch.allclose(x.grad, expected)  # type: ignore[arg-type]


def test_exception_in_forward_leaves_no_hooks() -> None:
    def boom(t: torch.Tensor) -> torch.Tensor:
        t.sin()
        raise KeyError("boom")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(KeyError):
        remat.checkpoint(boom, x)
    y = x.exp()  # saves its result; must be a real tensor, not a holder
    assert torch.equal(y.grad_fn._saved_result, y)  # type: ignore[union-attr]


def test_context_fn_suppressing_exception_is_an_error() -> None:
    def context_fn():  # type: ignore[no-untyped-def]
        return contextlib.suppress(KeyError), contextlib.nullcontext()

    def boom(t: torch.Tensor) -> torch.Tensor:
        raise KeyError("boom")

    with pytest.raises(RuntimeError, match="suppressed"):
        remat.checkpoint(boom, torch.randn(2, requires_grad=True), context_fn=context_fn)


def test_partial_backward_drops_unconsumed_recomputed_tensors() -> None:
    x = torch.randn(8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y = remat.checkpoint(lambda a, b: (a.sin() * b.cos()).exp(), x, w)
    (gx,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    frames = live_frames()
    assert len(frames) == 1
    assert frames[0].stores == {}  # nothing left behind after the backward call
    y.sum().backward()
    assert torch.equal(x.grad, gx)  # type: ignore[arg-type]
    del y, frames
    assert live_frames() == []


def test_unpack_outside_backward_recomputes() -> None:
    x = torch.randn(4, requires_grad=True)
    y = remat.checkpoint(lambda t: t.sin().exp(), x)
    assert torch.equal(y.grad_fn._saved_result, x.sin().exp())  # type: ignore[union-attr]


@pytest.mark.parametrize("fn", [lambda t: t.sin().cos(), lambda t: t.exp().tanh().sigmoid()])
def test_region_objects_are_freed_after_backward(fn) -> None:  # type: ignore[no-untyped-def]
    # exp/tanh/sigmoid save their *outputs*: the recompute graph must not form
    # a C++ reference cycle through them (a leak gc cannot collect).
    x = torch.randn(16, requires_grad=True)
    y = remat.checkpoint(fn, x)
    frame_ref = weakref.ref(live_frames()[0])
    y.sum().backward()
    del y
    gc.collect()
    assert frame_ref() is None


def test_device_first_initialized_in_forward_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"initialized": False}
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: state["initialized"])

    def fn(t: torch.Tensor) -> torch.Tensor:
        state["initialized"] = True  # what creating the first device tensor would do
        return t.sin()

    def run() -> None:
        remat.DefaultDeviceType.set_device_type("xpu")
        remat.checkpoint(fn, torch.randn(2, requires_grad=True))

    with pytest.raises(DeviceStateError, match="initialized inside"):
        contextvars.copy_context().run(run)
    state["initialized"] = False
    contextvars.copy_context().run(
        lambda: (
            remat.DefaultDeviceType.set_device_type("xpu"),
            remat.checkpoint(fn, torch.randn(2, requires_grad=True), preserve_rng_state=False),
        )
    )


def test_checkpointed_decorator_keeps_name_and_options() -> None:
    calls: list[int] = []

    @remat.checkpointed(early_stop=False)
    def block(t: torch.Tensor, *, scale: float) -> torch.Tensor:
        """Doc."""
        calls.append(1)
        return t.sin() * scale

    x = torch.randn(3, requires_grad=True)
    block(x, scale=2.0).sum().backward()
    assert block.__name__ == "block" and block.__doc__ == "Doc."
    assert calls == [1, 1]
    assert torch.allclose(x.grad, 2 * torch.cos(x))  # type: ignore[arg-type]


def test_pytree_inputs_are_version_checked() -> None:
    x = torch.randn(3, requires_grad=True)
    inner = x * 1
    y = remat.checkpoint(lambda d: d["a"].sin(), {"a": inner})
    inner.add_(1)  # modifying a saved input in place must not give a silent wrong grad
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_long_chain_of_tiny_regions() -> None:
    x = torch.randn(4, requires_grad=True)
    h = x
    for _ in range(100):
        h = remat.checkpoint(torch.sin, h)
    h.sum().backward()
    ref = x.detach().clone().requires_grad_()
    r = ref
    for _ in range(100):
        r = torch.sin(r)
    r.sum().backward()
    assert torch.equal(x.grad, ref.grad)  # type: ignore[arg-type]


def test_recompute_runs_under_the_forwards_default_device() -> None:
    # Factory calls inside the function must land on the device of the
    # forward's `with torch.device(...)` block even though backward runs outside.
    x = torch.randn(3, device="meta", requires_grad=True)
    with torch.device("meta"):
        y = remat.checkpoint(lambda t: (t * torch.ones(3)).sin(), x)
    y.sum().backward()
    assert x.grad is not None and x.grad.device.type == "meta"


@pytest.mark.parametrize("outer_hooks", [False, True], ids=["frame-keeps-inputs", "saver-node"])
def test_both_ways_of_keeping_inputs(outer_hooks: bool) -> None:
    # With no saved-tensor hooks outside, the frame keeps the region's inputs
    # itself (checking their versions by hand); with hooks outside, an autograd
    # node saves them so the hooks see them. Same gradients, same in-place error.
    import contextlib

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).sin() @ w

    seen: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    def outer() -> contextlib.AbstractContextManager[object]:
        if outer_hooks:
            return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        return contextlib.nullcontext()

    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True)
    expected = torch.autograd.grad(block(x, w).sum(), (x, w))
    with outer():
        out = remat.checkpoint(block, x, w)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out.sum(), (x, w)), expected, strict=True))
    # The enclosing hooks saw the region's inputs only on the saver-node path.
    assert any(t is x for t in seen) == outer_hooks

    y = x.detach().clone().requires_grad_()
    source = y * 1  # a non-leaf input, changed in place after the forward
    with outer():
        out = remat.checkpoint(block, source, w)
    source.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# Nesting: a view taken under no_grad of a tensor that requires grad, passed into a
# nested checkpoint, gives the unchecked run's gradients.


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

    got = squared_loss_grads(program(functools.partial(remat.checkpoint, early_stop=early_stop)), x, params, 2)
    assert_same(got, squared_loss_grads(program(PLAIN.checkpoint), x, params, 2))
