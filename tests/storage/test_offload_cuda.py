"""Offload on a CUDA device: streams, pinned pool, prefetch, memory. Run with ``pytest -m cuda``.

Skipped without CUDA. What is checked: gradients equal to the unchecked run
(fp32 bitwise; bf16 autocast no worse than torch's ``save_on_cpu``), the
pairing with checkpoints lowering end-of-forward device bytes as torch's does,
pinned buffers reused across steps (no new pinned memory after the first),
in-flight device bytes bounded by ``stash_bytes``, copies landing before use
when the compute stream is slow, and policy offload inside selective regions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import remat
import remat.policies as P
from remat.storage.copies import PINNED_POOL
from remat.storage.host import HostTransfer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

D, HIDDEN, ROWS = 512, 2048, 1024


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.fc1 = torch.nn.Linear(D, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def stack(wrap: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m, n: int = 6) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[wrap(Block()) for _ in range(n)]).cuda()


def grads(model: torch.nn.Module, x: torch.Tensor, run: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    out = run()
    return list(torch.autograd.grad(out.float().pow(2).sum(), [x, *model.parameters()]))


def test_residual_stack_fp32_is_bitwise() -> None:
    model = stack()
    x = torch.randn(ROWS, D, device="cuda", requires_grad=True)
    want = grads(model, x, lambda: model(x))
    for kwargs in ({}, {"min_bytes": 0}, {"prefetch": 0}, {"stash_bytes": 0}, {"use_streams": False}):
        for _ in range(3):

            def run(kwargs: dict[str, Any] = kwargs) -> torch.Tensor:
                with remat.offload(**kwargs):
                    return model(x)

            got = grads(model, x, run)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), kwargs


def test_bf16_autocast_no_worse_than_save_on_cpu() -> None:
    model = stack()
    x = torch.randn(ROWS, D, device="cuda", requires_grad=True)

    def under(context: Callable[[], Any]) -> list[torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16), context():
                return model(x)

        return grads(model, x, run)

    want = under(contextlib.nullcontext)
    ours = under(remat.offload)
    theirs = under(lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
    for a, b, w in zip(ours, theirs, want, strict=True):
        assert (a - w).abs().max() <= (b - w).abs().max()


def _forward_end_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = model(x * 1.0)
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # the allocator takes back blocks freed behind side-stream copies
    return torch.cuda.memory_allocated() - before, out


def test_offload_wrapper_around_checkpoint_wrapper_lowers_device_bytes() -> None:
    x = torch.randn(ROWS, D, device="cuda", requires_grad=True)
    checkpointed = stack(remat.checkpoint_wrapper)
    paired = stack(lambda m: remat.offload_wrapper(remat.checkpoint_wrapper(m)))
    ck_bytes, ck_out = _forward_end_bytes(checkpointed, x)
    pair_bytes, pair_out = _forward_end_bytes(paired, x)
    block_input = ROWS * D * 4
    assert pair_bytes <= ck_bytes - 4 * block_input
    got = torch.autograd.grad(pair_out.sum(), [x, *paired.parameters()])
    want = torch.autograd.grad(ck_out.sum(), [x, *checkpointed.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_offload_around_checkpoint_and_policy_offload_lower_device_bytes() -> None:
    x = torch.randn(ROWS, D, device="cuda", requires_grad=True)
    plain = stack()
    plain_bytes, _ = _forward_end_bytes(plain, x)
    offloaded = stack()

    class Offloaded(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            with remat.offload():
                return offloaded(t)

    off_bytes, _ = _forward_end_bytes(Offloaded(), x)
    assert off_bytes < plain_bytes / 4
    table = P.first_of(P.save_ops(torch.ops.aten.native_layer_norm.default), P.save_nothing)

    def offload_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> P.CheckpointPolicy:
        if op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            return P.CheckpointPolicy.MUST_OFFLOAD
        return table(ctx, op, *args, **kwargs)  # type: ignore[no-any-return]

    saved = stack(lambda m: remat.checkpoint_wrapper(m, policy=P.save_matmuls))
    policy = stack(lambda m: remat.checkpoint_wrapper(m, policy=offload_mm))
    saved_bytes, _ = _forward_end_bytes(saved, x)
    policy_bytes, out = _forward_end_bytes(policy, x)
    assert policy_bytes < saved_bytes
    want = torch.autograd.grad(plain(x * 1.0).sum(), [x, *plain.parameters()])
    got = torch.autograd.grad(out.sum(), [x, *policy.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_pinned_buffers_are_reused_across_steps() -> None:
    model = stack()
    x = torch.randn(ROWS, D, device="cuda", requires_grad=True)

    def step() -> None:
        with remat.offload():
            out = model(x)
        out.sum().backward()
        torch.cuda.synchronize()

    step()
    allocated = PINNED_POOL.allocated_bytes
    assert allocated > 0
    for _ in range(3):
        step()
    assert PINNED_POOL.allocated_bytes == allocated


def test_in_flight_device_bytes_stay_bounded() -> None:
    bound = 8 << 20
    transfer = HostTransfer(stash_bytes=bound)
    tensors = [torch.randn(1 << 20, device="cuda") for _ in range(16)]  # 4 MiB each
    copies = []
    for t in tensors:
        copies.append(transfer.to_host(t))
        assert transfer._in_flight_bytes <= max(bound, 4 << 20)
    for copy, t in zip(reversed(copies), reversed(tensors), strict=True):
        assert torch.equal(copy.restore(), t)


def test_copies_land_before_use_on_a_busy_stream() -> None:
    # A long kernel queue on the compute stream: the side-stream copies must
    # still wait for the producers, and backward must wait for the copies.
    a = torch.randn(4096, 4096, device="cuda")
    x = torch.randn(ROWS, D, device="cuda", requires_grad=True)
    model = stack()
    want = grads(model, x, lambda: model(x))
    for _ in range(3):

        def run() -> torch.Tensor:
            for _ in range(20):
                a @ a  # keep the compute stream busy before each saved tensor is produced
            with remat.offload(min_bytes=0, prefetch=4):
                return model(x)

        got = grads(model, x, run)
        assert all(torch.equal(p, q) for p, q in zip(got, want, strict=True))


def test_copies_are_queued_behind_compute_not_waited_for() -> None:
    # Overlap, not only equality: with the compute stream busy, to_host returns
    # at once (the CPU does not wait for the queued work), its copy is queued on
    # the side stream behind the tensor's producer (not finished yet), and the
    # compute stream is free to go on. restore() does not wait on the host either:
    # the copy back is queued behind the copy out (a stream waits on its event),
    # and the compute stream behind the copy back, so reading the result is right.
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    tensor = torch.randn(1 << 22, device="cuda")  # 16 MiB
    busy_until = torch.cuda.Event()
    for _ in range(30):
        a @ a  # tens of milliseconds of queued work
    busy_until.record()
    transfer = HostTransfer()
    copy = transfer.to_host(tensor)
    ready = copy.block.ready
    assert ready is not None, "a CUDA tensor is copied on a side stream"
    assert not busy_until.query() and not ready.query()  # both still queued: nothing waited
    restored = copy.restore()
    assert not busy_until.query()  # restore() queued its work; the host went on at once
    assert torch.equal(restored, tensor)  # on the compute stream: after both copies
    assert ready.query()


def test_strided_views_and_shared_storage_on_cuda() -> None:
    transfer = HostTransfer()
    qkv = torch.randn(64, 3 * 128, device="cuda")
    views = [*qkv.split(128, dim=1), qkv[:, ::3], qkv.t(), qkv[5:9]]
    copies = [transfer.to_host(v) for v in views]
    for copy, v in zip(reversed(copies), reversed(views), strict=True):
        restored = copy.restore()
        assert (restored.shape, restored.stride()) == (v.shape, v.stride())
        assert torch.equal(restored, v)
