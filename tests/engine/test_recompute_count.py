"""How often a checkpointed region and its ops run (once per backward, early stop).

Two counters: ``CallCounter`` around the region's Python function, and
``OpCounter``, a dispatch mode counting aten ops by name. The counted ops are
chosen so that no backward formula calls them: exp (backward: mul), tanh
(tanh_backward), sigmoid (sigmoid_backward) and sub with a Python scalar, which
saves nothing for backward (its backward is the identity).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from helpers import TORCH, CallCounter, Impl, OpCounter

EXP, TANH, SIGMOID, SUB = (
    "aten.exp.default",
    "aten.tanh.default",
    "aten.sigmoid.default",
    "aten.sub.Tensor",
)


def leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def three_saving_ops(x: torch.Tensor) -> torch.Tensor:
    return x.exp().tanh().sigmoid()  # each saves its output


def saves_then_trails(x: torch.Tensor) -> torch.Tensor:
    y = x.exp()  # the region's only saved tensor
    return y - 1.0  # trailing op: saves nothing, so early stop skips it


def counts(ops: OpCounter, *names: str) -> tuple[int, ...]:
    taken = ops.take()
    return tuple(taken[name] for name in names)


def test_one_forward_then_one_recompute_per_backward(impl: Impl) -> None:
    fn = CallCounter(three_saving_ops)
    x = leaf(4, 4)
    with OpCounter() as ops:
        out = impl.checkpoint(fn, x)
        assert (fn.calls, *counts(ops, EXP, TANH, SIGMOID)) == (1, 1, 1, 1)
        torch.autograd.grad(out.sum(), x)
        assert (fn.calls, *counts(ops, EXP, TANH, SIGMOID)) == (2, 1, 1, 1)


def test_retain_graph_recomputes_once_per_backward(impl: Impl) -> None:
    fn = CallCounter(three_saving_ops)
    x = leaf(4, 4)
    with OpCounter() as ops:
        loss = impl.checkpoint(fn, x).sum()
        ops.take()
        for backward in (1, 2, 3):
            loss.backward(retain_graph=backward < 3)
            assert (fn.calls, *counts(ops, EXP, TANH, SIGMOID)) == (1 + backward, 1, 1, 1)


def test_no_recompute_when_nothing_was_saved(impl: Impl) -> None:
    fn = CallCounter(lambda x: (x - 1.0).sum(0) + x.t())  # sub/sum/add/t save no tensor
    x = leaf(4, 4)
    impl.checkpoint(fn, x).sum().backward()
    assert fn.calls == 1


def test_no_recompute_when_backward_does_not_reach_the_region(impl: Impl) -> None:
    fn = CallCounter(three_saving_ops)
    x, w = leaf(4, 4), leaf(4, 4)
    out = impl.checkpoint(fn, x) * w.exp()
    out.sum().backward(inputs=[w])  # w's gradient needs the region's output only
    assert fn.calls == 1 and x.grad is None and w.grad is not None


def _forward_with_early_stop(
    impl: Impl, via: str, enabled: bool, fn: Callable[..., Any], x: torch.Tensor
) -> Any:
    if via == "argument":
        return impl.checkpoint(fn, x, early_stop=enabled)
    if via == "context":
        with impl.set_checkpoint_early_stop(enabled):
            return impl.checkpoint(fn, x)
    # the context overrides the argument
    with impl.set_checkpoint_early_stop(enabled):
        return impl.checkpoint(fn, x, early_stop=not enabled)


@pytest.mark.parametrize("via", ["argument", "context", "context-over-argument"])
@pytest.mark.parametrize("enabled", [True, False])
def test_early_stop_skips_trailing_ops(impl: Impl, via: str, enabled: bool) -> None:
    x = leaf(4, 4)
    with OpCounter() as ops:
        out = _forward_with_early_stop(impl, via, enabled, saves_then_trails, x)
        assert counts(ops, EXP, SUB) == (1, 1)
        # backward runs outside the setting's context: the region froze it at entry
        out.sum().backward()
        assert counts(ops, EXP, SUB) == (1, 0 if enabled else 1)


def test_early_stop_with_several_saved_tensors_stops_after_the_last(impl: Impl) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        a = x.exp()  # saved
        b = a - 1.0  # not saved
        c = b.tanh()  # saved: the last saved tensor
        return c - 2.0  # not saved: skipped

    x = leaf(4, 4)
    with OpCounter() as ops:
        out = impl.checkpoint(fn, x)
        ops.take()
        out.sum().backward()
        assert counts(ops, EXP, SUB, TANH) == (1, 1, 1)


def _inner(a: torch.Tensor) -> torch.Tensor:
    return a.sigmoid()


def test_nested_regions_recompute_each_needed_op_once_per_backward(impl: Impl) -> None:
    # outer saves exp's output and (as its own saved tensor) the inner region's
    # input; the inner region saves sigmoid's output; the trailing sub saves
    # nothing. Backward reaches the inner region first; recomputing its input
    # replays the outer region only up to the inner region's entry.
    def outer(x: torch.Tensor) -> torch.Tensor:
        return impl.checkpoint(_inner, x.exp()) - 1.0

    x = leaf(4, 4)
    with OpCounter() as ops:
        loss = impl.checkpoint(outer, x).sum()
        assert counts(ops, EXP, SIGMOID, SUB) == (1, 1, 1)
        for retain in (True, False):
            loss.backward(retain_graph=retain)
            assert counts(ops, EXP, SIGMOID, SUB) == (1, 1, 0)


def _deep(ck: Callable[..., Any], depth: int, x: torch.Tensor) -> torch.Tensor:
    if depth == 0:
        return x.sigmoid()
    y = x.exp()
    return ck(_deep, ck, depth - 1, y).tanh() - 1.0


def _per_backward_counts(
    ck: Callable[..., Any], depth: int, early_stop: bool
) -> list[tuple[int, ...]]:
    x = leaf(4, 4)
    with OpCounter() as ops:
        loss = ck(_deep, ck, depth, x, early_stop=early_stop).sum()
        per_backward = [counts(ops, EXP, TANH, SIGMOID, SUB)]
        for retain in (True, False):
            loss.backward(retain_graph=retain)
            per_backward.append(counts(ops, EXP, TANH, SIGMOID, SUB))
    return per_backward


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_recompute_no_more_than_torch(impl: Impl, depth: int, early_stop: bool) -> None:
    # Here the outer regions' saved tanh outputs sit after their inner
    # regions, so recomputing an outer region runs the inner bodies too, and
    # each inner region is then recomputed for its own saved tensors: torch
    # reruns sigmoid depth+1 times per backward. The promise is only "once per
    # backward" per needed region, so remat must match torch's forward counts,
    # rerun every needed op at least once per backward, never more than torch
    # does, and the same in every backward.
    forward, first, second = _per_backward_counts(impl.checkpoint, depth, early_stop)
    torch_forward, torch_first, _ = _per_backward_counts(TORCH.checkpoint, depth, early_stop)
    assert forward == torch_forward == (depth, depth, 1, depth)
    assert first == second
    assert all(1 <= n <= t for n, t in zip(first[:3], torch_first[:3], strict=True)), (
        first,
        torch_first,
    )
    assert first[3] <= torch_first[3]
    if depth == 1:
        # one region inside another: torch reruns sigmoid twice (the outer
        # recompute, then the inner region's own recompute)
        assert torch_first == (1, 1, 2, 0 if early_stop else 1)


def test_graph_exec_group_recomputes_once_for_disjoint_backwards(impl: Impl) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.exp(), x.tanh()  # disjoint outputs, each saving itself

    for grouped, expected in ((False, (3, 3, 3)), (True, (2, 2, 2))):
        counted = CallCounter(fn)
        x = leaf(4, 4)
        with OpCounter() as ops:
            a, b = impl.checkpoint(counted, x)
            with impl.graph_exec_group() if grouped else _nothing():
                a.sum().backward()
                b.sum().backward()
        assert (counted.calls, ops.counts[EXP], ops.counts[TANH]) == expected, f"grouped={grouped}"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---- remat only -----------------------------------------------------------


def test_remat_checkpointed_decorator_checkpoints_every_call() -> None:
    import remat

    fn = CallCounter(saves_then_trails)
    region = remat.checkpointed(fn, early_stop=False)
    x = leaf(4, 4)
    with OpCounter() as ops:
        loss = region(x).sum() + region(x * 2).sum()
        assert (fn.calls, *counts(ops, EXP, SUB)) == (2, 2, 2)
        loss.backward()
        # each call is its own region, recomputed once; early_stop=False was honoured
        assert (fn.calls, *counts(ops, EXP, SUB)) == (4, 2, 2)
