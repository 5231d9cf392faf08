"""Tensor lifetimes under checkpointing (docs/design/lifetimes.md), by storage-level accounting on CPU.

``LiveStorages`` (tests/helpers.py) counts the bytes of storages created under
it and still alive. Chains of elementwise ops on 1024x1024 float32 tensors
(N = 4 MiB each) make every activation one N; small extra storages (scalars,
RNG states) fit in ``SLACK``.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from helpers import PLAIN, Impl, LiveStorages

N = 1024 * 1024 * 4
SLACK = 64 * 1024

# Every op's output is saved for backward, by the op itself (tanh, exp,
# sigmoid save their output) or by the next op (sin, cos save their input),
# so an unchecked chain keeps all of its activations.
SAVE_ALL = (
    torch.tanh,
    torch.exp,
    torch.sigmoid,
    torch.sin,
    torch.cos,
    torch.sin,
    torch.cos,
    torch.sin,
)
# Each op saves its own output and nothing else: one saved tensor per op.
SAVE_OWN_OUTPUT = (torch.tanh, torch.exp, torch.sigmoid) * 2 + (torch.tanh, torch.exp)
# 16 ops, all activations saved (an output of sin/cos must feed sin/cos).
CHAIN16 = SAVE_OWN_OUTPUT + (torch.sin, torch.cos) * 4


def big_leaf() -> torch.Tensor:
    return torch.randn(1024, 1024, requires_grad=True)


def run_ops(ops: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    for op in ops:
        x = op(x)
    return x


def segmented(
    impl: Impl, ops: Sequence[Any], segments: int, x: torch.Tensor, **options: Any
) -> torch.Tensor:
    size = len(ops) // segments
    for start in range(0, len(ops), size):
        x = impl.checkpoint(run_ops, ops[start : start + size], x, **options)
    return x


def test_forward_keeps_only_the_output(impl: Impl) -> None:
    x = big_leaf()
    with LiveStorages() as plain:
        plain_out = PLAIN.checkpoint(run_ops, SAVE_ALL, x)
    assert plain.live_bytes == len(SAVE_ALL) * N  # the oracle keeps all 8 activations
    with LiveStorages() as mem:
        out = impl.checkpoint(run_ops, SAVE_ALL, x)
    assert N <= mem.live_bytes <= N + SLACK  # only the output (x existed before)
    assert mem.peak_bytes <= 2 * N + SLACK  # one op's input and output at a time
    assert torch.equal(out, plain_out)


class _NormDropAttend(torch.nn.Module):
    """Ops that save tensors made without gradients inside the region: layer norm's
    statistics, dropout's mask, attention's log-sum-exp."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.proj = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.proj(self.norm(x)))
        q = h.unflatten(-1, (4, -1)).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)


def test_forward_keeps_no_tensor_made_without_grad_inside(impl: Impl) -> None:
    # Such tensors are leaves, so the forward watches them for in-place changes
    # as if read from outside; a watch that held them kept every dropout mask
    # until backward (seen in the GPT's end-of-forward bytes).
    torch.manual_seed(0)
    block = _NormDropAttend(256)
    x = torch.randn(16, 128, 256, requires_grad=True)  # 2 MiB; the mask is as large
    with LiveStorages() as plain:
        plain_out = PLAIN.checkpoint(block, x)
    with LiveStorages() as mem:
        out = impl.checkpoint(block, x)
    output_bytes = out.numel() * out.element_size()
    assert plain_out.shape == out.shape and plain.live_bytes > 3 * output_bytes  # unchecked: the mask and more stay
    assert output_bytes <= mem.live_bytes <= output_bytes + SLACK


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("retain_graph", [False, True])
def test_recomputed_tensors_are_freed_as_backward_consumes_them(
    impl: Impl, early_stop: bool, retain_graph: bool
) -> None:
    # One region over SAVE_OWN_OUTPUT: the backward node of op i consumes the
    # recomputed y_i and nothing after it needs y_i again. When the gradient
    # of y_j arrives (nodes j+1..8 have run), at most y_1..y_j are still
    # needed, plus that gradient itself: (j + 1) * N, whatever retain_graph.
    # Keeping recomputed tensors until the region's backward ends would hold
    # all 8 at every step.
    x = big_leaf()
    seen: dict[int, int] = {}
    mem = LiveStorages()

    def backward_bytes() -> int:
        return sum(s.nbytes() for s in mem.alive("backward"))

    def record(j: int) -> Callable[[torch.Tensor], None]:
        return lambda grad: seen.setdefault(j, backward_bytes()) and None

    def fn(x: torch.Tensor) -> torch.Tensor:
        for j, op in enumerate(SAVE_OWN_OUTPUT):
            # (hooks on the recompute's tensors never fire: backward runs the forward's graph)
            if j > 0:
                x.register_hook(record(j))
            x = op(x)
        return x

    with mem:
        mem.phase("forward")
        out = impl.checkpoint(fn, x, early_stop=early_stop)
        mem.phase("backward")
        out.sum().backward(retain_graph=retain_graph)
    assert sorted(seen) == list(range(1, len(SAVE_OWN_OUTPUT))), (
        "hooks of the forward's y_1..y_7 fire"
    )
    for j, live in seen.items():
        assert live <= (j + 1) * N + SLACK, (
            f"gradient of y_{j} arrived with {live / N:.2f} N of backward tensors alive"
        )
    # After backward only x.grad remains of what backward created.
    assert [s.data_ptr() for s in mem.alive("backward")] == [x.grad.untyped_storage().data_ptr()]


@pytest.mark.parametrize("retain_graph", [False, True])
def test_segmented_backward_peak_is_one_segment_above_forward_end(
    impl: Impl, retain_graph: bool
) -> None:
    ops, segments = CHAIN16, 4
    per_segment = len(ops) // segments
    x = big_leaf()
    with LiveStorages() as plain:
        plain_out = PLAIN.checkpoint(run_ops, ops, x)
    unchecked_forward_end = plain.live_bytes
    del plain_out
    assert unchecked_forward_end == len(ops) * N

    with LiveStorages() as mem:
        out = segmented(impl, ops, segments, x)
        forward_end = mem.live_bytes
        mem.reset_peak()
        mem.phase("backward")
        out.sum().backward(retain_graph=retain_graph)
    # 3 segment boundaries (saved as the next segment's input) + the output
    assert segments * N <= forward_end <= segments * N + SLACK
    # At most one segment's recomputed activations, plus the gradient flowing
    # in, one temporary and the gradient flowing out (sin's backward: cos(x),
    # then the product).
    assert mem.peak_bytes <= forward_end + (per_segment + 3) * N + SLACK
    assert mem.peak_bytes < unchecked_forward_end
    # What stays: the output and x.grad, plus the boundaries if the graph is retained.
    kept = forward_end if retain_graph else N
    assert kept + N <= mem.live_bytes <= kept + N + SLACK


def test_repeated_backward_with_retain_graph_returns_to_baseline(impl: Impl) -> None:
    x = big_leaf()
    with LiveStorages() as mem:
        loss = segmented(impl, SAVE_ALL, 2, x).sum()
        loss.backward(retain_graph=True)  # allocates x.grad
        baseline = mem.live_bytes
        for _ in range(3):
            mem.phase("backward")
            loss.backward(retain_graph=True)  # accumulates into x.grad in place
            assert mem.live_bytes == baseline
            assert mem.alive("backward") == []


@pytest.mark.parametrize("phase", ["after-forward", "after-backward", "after-retained-backward"])
def test_no_leak_after_outputs_are_deleted(impl: Impl, phase: str) -> None:
    class Fn:  # the region must keep the function (to recompute) only while needed
        def __call__(self, x: torch.Tensor, tag: object) -> torch.Tensor:
            return run_ops(SAVE_ALL, x)

    class Tag:  # a non-tensor argument, kept for the recompute
        pass

    fn, tag = Fn(), Tag()
    x = big_leaf()
    with LiveStorages() as mem:
        # nested: the outer region's function is the inner checkpoint call
        out = impl.checkpoint(impl.checkpoint, fn, x, tag)
        if phase != "after-forward":
            out.sum().backward(retain_graph=phase == "after-retained-backward")
        x.grad = None
    objects = [weakref.ref(fn), weakref.ref(tag)]
    storages = [weakref.ref(s) for s in mem.alive()]
    assert storages, "at least the output is alive before deleting it"
    del fn, tag, out
    gc.collect()
    assert [ref() for ref in objects] == [None, None]
    assert [ref() for ref in storages] == [None] * len(storages)
    assert mem.live_bytes == 0


def test_region_is_freed_by_reference_counting_alone(impl: Impl) -> None:
    # torch frees a region's state without the cyclic GC (pytorch#154642 fixed
    # the last cycle), so activations go away the moment the graph does.
    x = big_leaf()
    gc.collect()
    gc.disable()
    try:
        with LiveStorages() as mem:
            out = impl.checkpoint(run_ops, SAVE_ALL, x)
            out.sum().backward(retain_graph=True)
            x.grad = None
        del out
        assert mem.live_bytes == 0
    finally:
        gc.enable()


# ---- remat only -----------------------------------------------------------


def test_remat_memory_tracker_agrees_on_the_segmented_chain() -> None:
    from helpers import remat_impl
    from remat.memory import track

    ops, segments, remat = CHAIN16, 4, remat_impl()
    x = big_leaf()
    with LiveStorages() as mine:
        out = segmented(remat, ops, segments, x)
        mine_forward_end = mine.live_bytes
        out.sum().backward()
    del out
    x.grad = None
    with track() as t:
        out = segmented(remat, ops, segments, x)
        t.mark("forward_end")
        out.sum().backward()
    assert abs(t.marks["forward_end"] - mine_forward_end) <= SLACK
    assert abs(t.peak_bytes - mine.peak_bytes) <= SLACK
    assert abs(t.live_bytes - 2 * N) <= SLACK  # out + x.grad
