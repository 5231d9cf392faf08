"""remat.offload / no_offload and the transfer they share with offloading policies.

On CPU the copies save no memory but run end to end, so what is tested here
is correctness: exact gradients, which tensors are moved, autograd's in-place
check, nesting with checkpoints, repeated backward. The CUDA stream path is
exercised on a GPU (see the closing note of the offload work).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import remat
import remat.policies as P
from remat._engine.observe import observe_saved_tensors
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.offload import HostCopy, HostTransfer


def mlp() -> tuple[torch.nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    return model, torch.randn(8, 16, requires_grad=True)


def grads(model: torch.nn.Module, x: torch.Tensor, **kwargs: Any) -> list[torch.Tensor]:
    with remat.offload(**kwargs):
        out = model(x).tanh()
    return list(torch.autograd.grad(out.sum(), [x, *model.parameters()]))


def test_offload_gives_identical_gradients() -> None:
    model, x = mlp()
    want = list(torch.autograd.grad(model(x).tanh().sum(), [x, *model.parameters()]))
    for got, expected in zip(grads(model, x, min_bytes=0), want, strict=True):
        assert torch.equal(got, expected)


def offloaded_shapes(fn: Any, **kwargs: Any) -> list[tuple[int, ...]]:
    events: list[tuple[int, ...]] = []
    with observe_saved_tensors(lambda event, t: events.append(tuple(t.shape)) if event == "offloaded" else None):
        with remat.offload(**kwargs):
            fn()
    return events


def test_small_tensors_and_parameters_stay() -> None:
    model, x = mlp()
    # Linear saves its input and its weight (a parameter, never moved); GELU saves its input.
    shapes = offloaded_shapes(lambda: model(x), min_bytes=0)
    assert sorted(shapes) == [(8, 16), (8, 32), (8, 32)]
    assert offloaded_shapes(lambda: model(x), min_bytes=8 * 32 * 4) == [(8, 32), (8, 32)]
    assert offloaded_shapes(lambda: model(x), min_bytes=10**9) == []


def test_saved_values_are_host_copies() -> None:
    x = torch.randn(64, requires_grad=True)
    with remat.offload(min_bytes=0):
        y = x.exp()
    packed = y.grad_fn._raw_saved_result  # type: ignore[union-attr]
    assert isinstance(packed, torch._C._autograd.SavedTensor)
    y.sum().backward()
    assert torch.equal(x.grad, x.exp())  # type: ignore[arg-type]


def test_in_place_change_after_offload_is_caught() -> None:
    x = torch.randn(64, requires_grad=True)
    with remat.offload(min_bytes=0):
        h = x * 2
        y = h.sin()
    h.add_(1)  # sin saved h; backward would use a stale value
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_retain_graph_and_second_backward() -> None:
    model, x = mlp()
    with remat.offload(min_bytes=0):
        out = model(x).sum()
    first = torch.autograd.grad(out, x, retain_graph=True)[0]
    second = torch.autograd.grad(out, x)[0]
    assert torch.equal(first, second)


def test_no_offload_keeps_its_part() -> None:
    model, x = mlp()

    def step() -> None:
        h = model[0](x)
        with remat.no_offload():
            model[1](h)

    # Linear's input is offloaded; GELU's input (inside no_offload) is not.
    assert offloaded_shapes(step, min_bytes=0) == [(8, 16)]


def test_offload_around_a_checkpoint_moves_its_inputs_only() -> None:
    model, x = mlp()
    h = x * 1.0
    shapes = offloaded_shapes(lambda: remat.checkpoint(model, h), min_bytes=0)
    assert shapes == [(8, 16)]  # the region's input; its inner tensors are recomputed
    want = list(torch.autograd.grad(model(x).sum(), [x, *model.parameters()]))
    with remat.offload(min_bytes=0):
        out = remat.checkpoint(model, x * 1.0)
    got = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_offload_inside_a_checkpoint_stands_aside() -> None:
    model, x = mlp()

    def block(t: torch.Tensor) -> torch.Tensor:
        with remat.offload(min_bytes=0):
            return model(t)

    want = list(torch.autograd.grad(model(x).sum(), [x, *model.parameters()]))
    got = torch.autograd.grad(remat.checkpoint(block, x).sum(), [x, *model.parameters()])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_offload_policy_reports_host_copies() -> None:
    events: list[str] = []
    x = torch.randn(8, 8, requires_grad=True)
    with observe_saved_tensors(lambda event, t: events.append(event)):
        y = remat.checkpoint(lambda t: (t @ t).sin(), x, policy=P.save_ops(torch.ops.aten.mm.default))
    assert "policy_saved" in events
    events.clear()
    def offload_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> P.CheckpointPolicy:
        return P.CheckpointPolicy.MUST_OFFLOAD if op == torch.ops.aten.mm.default else P.CheckpointPolicy.PREFER_RECOMPUTE

    with observe_saved_tensors(lambda event, t: events.append(event)):
        y = remat.checkpoint(lambda t: (t @ t).sin(), x, policy=offload_mm)
    assert "policy_offloaded" in events
    y.sum().backward()
    assert torch.allclose(x.grad, torch.autograd.grad((x @ x).sin().sum(), x)[0])  # type: ignore[arg-type]


def test_transfer_restores_in_order_with_prefetch_bookkeeping() -> None:
    transfer = HostTransfer(prefetch=2)
    tensors = [torch.randn(4) for _ in range(3)]
    copies = [transfer.to_host(t) for t in tensors]
    assert all(isinstance(c, HostCopy) for c in copies)
    for copy, tensor in zip(reversed(copies), reversed(tensors), strict=True):
        restored = copy.restore()
        assert torch.equal(restored, tensor)
        assert restored.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"min_bytes": -1}, CheckpointUsageError),
        ({"min_bytes": "1k"}, CheckpointTypeError),
        ({"prefetch": 1.5}, CheckpointTypeError),
        ({"pin_memory": "yes"}, CheckpointTypeError),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error, match=r"remat\.offload"):
        remat.offload(**kwargs)


def test_a_context_cannot_be_entered_twice() -> None:
    context = remat.offload()
    with context, pytest.raises(CheckpointUsageError, match="already active"):
        context.__enter__()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_overlaps_and_matches() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    x = torch.randn(256, 1024, device="cuda", requires_grad=True)
    want = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    with remat.offload():
        out = model(x)
    got = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "make",
    [
        lambda x, w: (x.expand(8, 16) * w).sin(),  # an expanded (stride 0) tensor is saved
        lambda x, w: (w.t()[::2] * 3).exp(),  # a strided view
        lambda x, w: (w * w).relu(),  # one tensor saved twice by one op
    ],
    ids=["expanded", "strided-view", "saved-twice"],
)
def test_views_and_aliases_round_trip(make: Any) -> None:
    x = torch.randn(8, 1, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    want = torch.autograd.grad(make(x, w).sum(), [x, w], allow_unused=True)
    with remat.offload(min_bytes=0):
        out = make(x, w)
    got = torch.autograd.grad(out.sum(), [x, w], allow_unused=True)
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_a_tensor_saved_twice_is_copied_once() -> None:
    transfer = HostTransfer()
    t = torch.randn(16)
    first = transfer.to_host(t)
    assert transfer.to_host(t) is first
    assert transfer.to_host(t.t()) is first  # same data, shape and strides
    assert transfer.to_host(t[1:]) is not first
