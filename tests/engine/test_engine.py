"""remat-specific behaviour of the core engine: errors, settings, lifetimes, debug, nesting."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat
from helpers import PLAIN, Program, assert_same, squared_loss_grads
from remat._engine.frame import Frame
from remat.errors import (
    CheckpointTypeError,
    CheckpointUsageError,
    DeviceStateError,
    RecomputeMismatchError,
    RematError,
)


def live_frames() -> list[Frame]:
    gc.collect()
    return [obj for obj in gc.get_objects() if type(obj) is Frame]


def test_public_names_sorted_and_exported() -> None:
    assert remat.__all__ == sorted(remat.__all__)
    for name in remat.__all__:
        assert hasattr(remat, name), name


def test_error_hierarchy_matches_builtins() -> None:
    assert issubclass(remat.CheckpointError, RuntimeError)
    assert issubclass(RecomputeMismatchError, remat.CheckpointError)
    assert issubclass(CheckpointUsageError, ValueError)
    assert issubclass(CheckpointTypeError, TypeError)
    assert issubclass(DeviceStateError, RuntimeError)
    for cls in (CheckpointUsageError, CheckpointTypeError, DeviceStateError):
        assert issubclass(cls, RematError)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda x: remat.checkpoint(42, x), TypeError),
        (lambda x: remat.checkpoint(torch.sin, x, determinism_check="strict"), ValueError),
        (lambda x: remat.checkpoint(torch.sin, x, use_reentrant="yes"), TypeError),
        (lambda x: remat.checkpoint(torch.sin, x, context_fn=3), TypeError),
        (lambda x: remat.checkpoint(torch.sin, x, context_fn=lambda: 3), TypeError),
        (lambda x: remat.checkpoint(torch.sin, x, use_reentrant=True, debug=True), ValueError),
        (lambda x: remat.checkpoint(torch.add, x, use_reentrant=True, other=x), ValueError),
        (lambda x: remat.checkpointed(torch.sin, early_stopp=True), ValueError),
        (lambda x: remat.checkpoint_sequential([torch.sin], 0, x), ValueError),
        (lambda x: remat.checkpoint_sequential([torch.sin], 2, x), ValueError),
        (lambda x: remat.checkpoint_sequential([torch.sin], 1, x, foo=1), ValueError),
    ],
)
def test_bad_input_gets_a_clear_error(call, error) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(error) as info:
        call(x)
    assert isinstance(info.value, RematError)
    assert "remat." in str(info.value)


def test_mismatch_error_has_structured_fields() -> None:
    sizes = iter([4, 2])
    x = torch.randn(4, 3, requires_grad=True)
    y = remat.checkpoint(lambda t: t[: next(sizes)].sin(), x)
    with pytest.raises(RecomputeMismatchError) as info:
        y.sum().backward()
    err = info.value
    assert err.index == 0
    assert err.forward is not None and err.forward.shape == (4, 3)
    assert err.recompute is not None and err.recompute.shape == (2, 3)
    assert "debug=True" in str(err)
    assert live_frames() == [] or all(not f.stores for f in live_frames())


def test_debug_names_first_differing_op_and_source_line() -> None:
    sizes = iter([4, 2])

    def fn(t: torch.Tensor) -> torch.Tensor:
        cut = t[: next(sizes)]  # the line the error must point at
        return cut.exp()

    x = torch.randn(4, 3, requires_grad=True)
    with remat.set_checkpoint_debug_enabled(True):
        y = remat.checkpoint(fn, x)
    with pytest.raises(RecomputeMismatchError) as info:
        y.sum().backward()
    text = str(info.value)
    assert "First operator that differs" in text
    assert "aten.slice.Tensor" in text
    assert f"{__file__}:" in text and "in fn" in text
    assert info.value.op_hint is not None and "aten.slice" in info.value.op_hint


def test_debug_argument_overridden_by_context() -> None:
    sizes = iter([4, 2])
    x = torch.randn(4, 3, requires_grad=True)
    with remat.set_checkpoint_debug_enabled(False):
        y = remat.checkpoint(lambda t: t[: next(sizes)].exp(), x, debug=True)
    with pytest.raises(RecomputeMismatchError) as info:
        y.sum().backward()
    text = str(info.value)
    assert "First operator that differs" not in text
    # The user did pass debug=True: the tip names what turned it off instead.
    assert "pass debug=True" not in text
    assert "set_checkpoint_debug_enabled(False)" in text and "overrides" in text


# Debug logs name the first real divergence: both logs leave out
# the detaches checkpointing adds, and the error points at the line where the
# recomputation first ran something else. Each function below diverges on
# its second call at the line marked "diverges".


def _shape(x: torch.Tensor, first: bool) -> torch.Tensor:
    y = x.sin()
    return (y if first else y[:2]).exp()  # diverges: exp (forward) vs slice


def _op(x: torch.Tensor, first: bool) -> torch.Tensor:
    y = x * 2 if first else x.sin()  # diverges: mul saves nothing, sin saves x
    return y.exp()


def _dtype(x: torch.Tensor, first: bool) -> torch.Tensor:
    y = x.to(torch.float64 if first else torch.float16)  # diverges: the copy's dtype
    return y.exp()


def _more(x: torch.Tensor, first: bool) -> torch.Tensor:
    y = x if first else x.sin()  # diverges: an extra op
    return y.exp()


def _fewer(x: torch.Tensor, first: bool) -> torch.Tensor:
    y = x.exp()
    return y.sin() if first else y  # diverges: the forward's sin is not rerun


@pytest.mark.parametrize(
    ("function", "forward_op", "recompute_op", "heading"),
    [
        (_shape, "aten.exp.default", "aten.slice.Tensor", "First operator that differs (#1)"),
        (_op, "aten.mul.Tensor", "aten.sin.default", "First operator that differs (#0)"),
        (_dtype, "aten._to_copy.default", "aten._to_copy.default", "First operator that differs (#0)"),
        (_more, "aten.exp.default", "aten.sin.default", "First operator that differs (#0)"),
        (_fewer, "aten.sin.default", None, "did not run operator #1"),
    ],
    ids=["shape", "op", "dtype", "count-more", "count-fewer"],
)
def test_debug_names_the_real_first_divergence(
    function: Any, forward_op: str, recompute_op: str | None, heading: str
) -> None:
    lines, start = inspect.getsourcelines(function)
    line = start + next(i for i, text in enumerate(lines) if "# diverges" in text)
    calls = iter([True, False])
    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(lambda t: function(t, next(calls)), x, debug=True, early_stop=False)
    with pytest.raises(RecomputeMismatchError) as info:
        y.float().sum().backward()
    text = str(info.value)
    assert heading in text
    hint = info.value.op_hint
    assert hint is not None
    assert hint.startswith(recompute_op or forward_op)
    assert f"{__file__}:{line} in {function.__name__}" in hint
    divergence = text.split("Operators of the original forward")[0]
    assert forward_op in divergence
    assert "aten.detach" not in text  # neither log lists checkpointing's own detaches


def test_fewer_saved_tensors_is_reported() -> None:
    flags = iter([True, False])

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t.exp().sin() if next(flags) else t * 2

    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(fn, x, early_stop=False)
    with pytest.raises(remat.CheckpointError, match="fewer"):
        y.sum().backward()


def test_determinism_check_none_skips_the_check() -> None:
    scales = iter([2.0, 3.0])
    x = torch.randn(3, requires_grad=True)
    # Same shapes, different values: no check can see it; "none" must not raise.
    y = remat.checkpoint(lambda t: (t * next(scales)).sin(), x, determinism_check="none")
    y.sum().backward()
    assert x.grad is not None


def test_settings_are_context_local() -> None:
    seen: list[bool] = []

    def other_thread() -> None:
        from remat._settings import resolve_early_stop

        seen.append(resolve_early_stop(True))

    with remat.set_checkpoint_early_stop(False):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert seen == [True]


def test_early_stop_setting_frozen_at_forward() -> None:
    ran: list[str] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        a = t.sin()
        ran.append("after-sin")
        return a * 3  # mul by a python scalar saves nothing

    x = torch.randn(3, requires_grad=True)
    with remat.set_checkpoint_early_stop(True):
        y = remat.checkpoint(fn, x)
    with remat.set_checkpoint_early_stop(False):
        y.sum().backward()
    assert ran == ["after-sin"]  # early stop cut the recompute before the append


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
