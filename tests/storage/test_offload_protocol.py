"""The asynchronous offload protocol, on a simulated device that copies late and out of order.

``remat.storage.simulated.SimulatedCopies`` stands in for a CUDA device on the
CPU (docs/design/offload.md, "Testing the protocol without a GPU"): side-stream
copies complete only when something waits for them or at random later
moments, buffers start as garbage, a copy's source is held only as long as the
allocator contract (``record_stream``) says. So each rule of the protocol is a
value that comes out wrong when the rule is broken:

* no use before the copy lands (the compute stream waits for each copy back);
* no free before it finishes (the source is kept until its copy has read it);
* a pinned buffer is reused only after its last copy;
* a copy back waits for the copy out;
* prefetch starts the next blocks in backward order, a bounded number ahead;
* at most ``stash_bytes`` wait for their copy in the forward.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import remat
import remat.policies as P
from remat.storage.copies import simulate_copies
from remat.storage.host import HostTransfer
from remat.storage.simulated import SimulatedCopies

SEEDS = range(6)
LATE = (0.0, 0.3, 1.0)  # never on their own, sometimes, at every chance


def simulated(seed: int, eagerness: float = 0.3) -> SimulatedCopies:
    return SimulatedCopies(seed=seed, eagerness=eagerness)


def h2d_sources(sim: SimulatedCopies) -> list[Any]:
    return [issued.source() for issued in sim.issued if issued.direction == "h2d"]


# values ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eagerness", LATE)
def test_restored_values_are_the_saved_values(seed: int, eagerness: float) -> None:
    torch.manual_seed(seed)
    sim = simulated(seed, eagerness)
    with simulate_copies(sim):
        transfer = HostTransfer(prefetch=2)
        base = torch.randn(6, 8)
        tensors = [torch.randn(32), base, base[:, ::2], base.t(), torch.randn(3, 3).expand(2, 3, 3)]
        expected = [(t.clone(), t.shape, t.stride()) for t in tensors]
        saved = [transfer.to_host(t) for t in tensors]
    assert len(sim.issued) >= 3  # copies went through the simulated streams
    del tensors, base  # autograd keeps the host copies only
    for copy, (want, shape, stride) in zip(reversed(saved), reversed(expected), strict=True):
        got = copy.restore()
        assert (got.shape, got.stride()) == (shape, stride)
        assert torch.equal(got, want)
    assert not sim.hazards


def test_a_buffer_read_before_its_copy_landed_is_garbage() -> None:
    # What the tests below rely on: the simulator does not hand out the truth early.
    sim = simulated(0, eagerness=0.0)
    side = sim.side_stream("h2d")
    buffer = sim.empty(16, torch.float32, side)
    source = torch.ones(16)
    done = sim.copy(buffer, source, side)
    assert torch.isnan(buffer).all()
    assert not done.query()
    sim.compute_stream().wait_event(done)
    assert torch.equal(buffer, source)


def test_copies_racing_over_one_buffer_are_recorded() -> None:
    sim = simulated(0, eagerness=0.0)
    host = torch.zeros(16)
    source = torch.ones(16)
    out = sim.copy(host, source, sim.side_stream("d2h"))
    back = sim.empty(16, torch.float32, sim.side_stream("h2d"))
    sim.copy(back, host, sim.side_stream("h2d"))  # reads `host` without waiting for `out`
    assert len(sim.hazards) == 1
    sim.side_stream("h2d").wait_event(out)
    sim.copy(back, host, sim.side_stream("h2d"))  # ordered: no new race
    assert len(sim.hazards) == 1


def test_a_source_freed_before_its_copy_ran_is_read_as_garbage() -> None:
    sim = simulated(0, eagerness=0.0)
    side = sim.side_stream("d2h")
    host = torch.zeros(16)
    source = torch.ones(16)
    done = sim.copy(host, source, side)
    del source  # no keep_until_done: the memory may be reused
    done.synchronize()
    assert torch.isnan(host).all()


# gradients -------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        q, k = h.split(x.shape[-1], dim=-1)  # two views of one storage
        return x + self.down(torch.cat([q.sigmoid() * k, k.t().t().tanh()], dim=-1))


def offload_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> P.CheckpointPolicy:
    if op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
        return P.CheckpointPolicy.MUST_OFFLOAD
    return P.CheckpointPolicy.PREFER_RECOMPUTE


FORMS = {
    "offload": lambda blocks: [functools.partial(_offloaded, block) for block in blocks],
    "offload+checkpoint": lambda blocks: [remat.offload_wrapper(remat.checkpoint_wrapper(b)) for b in blocks],
    "policy offload": lambda blocks: [remat.checkpoint_wrapper(b, policy=offload_matmuls) for b in blocks],
}


def _offloaded(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with remat.offload(min_bytes=0, prefetch=2):
        out: torch.Tensor = block(x)
    return out


def _gradients(run: list[Any], blocks: torch.nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    h = x
    for step in run:
        h = step(h)
    return list(torch.autograd.grad(h.pow(2).sum(), [x, *blocks.parameters()]))


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("seed", SEEDS)
def test_gradients_are_bitwise_with_copies_late_and_out_of_order(form: str, seed: int) -> None:
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList(Block() for _ in range(3))
    x = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    blocks.double()
    want = _gradients(list(blocks), blocks, x)
    sim = simulated(seed, eagerness=LATE[seed % len(LATE)])
    with simulate_copies(sim):
        got = _gradients(FORMS[form](blocks), blocks, x)
    assert sim.issued, "the simulated device was not used"
    assert not sim.hazards
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_many_steps_reuse_pinned_buffers_only_after_their_copies() -> None:
    # Each step's host buffers return to the pool when its graph dies; with
    # copies completing late, a buffer still read by a copy must wait.
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block() for _ in range(3)).double()
    x = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    want = _gradients(list(blocks), blocks, x)
    sim = simulated(3, eagerness=0.2)
    with simulate_copies(sim):
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(_gradients(FORMS["offload"](blocks), blocks, x), want, strict=True))
        allocated = sim.pool.allocated_bytes
        for _ in range(4):
            assert all(torch.equal(a, b) for a, b in zip(_gradients(FORMS["offload"](blocks), blocks, x), want, strict=True))
    assert 0 < sim.pool.allocated_bytes <= 2 * allocated  # reused, not allocated per step
    assert not sim.hazards


# lifetimes ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_sources_dropped_right_after_saving_are_copied_intact(seed: int) -> None:
    sim = simulated(seed, eagerness=0.0)  # nothing moves until something waits
    with simulate_copies(sim):
        transfer = HostTransfer()
        expected = []
        saved = []
        for step in range(4):
            tensor = torch.full((64,), float(step)) + torch.randn(64)
            expected.append(tensor.clone())
            saved.append(transfer.to_host(tensor))
            del tensor  # autograd drops the device tensor at once
        assert sim.pending_bytes("d2h") > 0
    for copy, want in zip(reversed(saved), reversed(expected), strict=True):
        assert torch.equal(copy.restore(), want)
    assert not sim.hazards


@pytest.mark.parametrize("seed", SEEDS)
def test_a_buffer_reused_by_a_later_transfer_keeps_the_earlier_copy(seed: int) -> None:
    # One transfer's blocks die (their buffers go back to the pool) while their
    # copies back may still be queued; the next transfer must not get them early.
    sim = simulated(seed, eagerness=0.0)
    with simulate_copies(sim):
        first = HostTransfer(prefetch=3)
        copies = [first.to_host(torch.full((256,), float(i))) for i in range(4)]
        restored = copies[-1].restore()  # starts prefetching the others
        del copies  # the prefetched copies back are still queued
        second = HostTransfer(prefetch=0)
        later = [second.to_host(torch.full((256,), 10.0 + i)) for i in range(4)]
    assert torch.equal(restored, torch.full((256,), 3.0))
    for i, copy in reversed(list(enumerate(later))):
        assert torch.equal(copy.restore(), torch.full((256,), 10.0 + i))
    assert not sim.hazards  # no buffer handed out while a copy back still read it


def test_writes_after_saving_race_with_the_copy_unless_guarded() -> None:
    for guard, want in ((True, 1.0), (False, 2.0)):
        sim = simulated(0, eagerness=0.0)
        with simulate_copies(sim):
            transfer = HostTransfer(guard_writes=guard)
            tensor = torch.ones(64)
            saved = transfer.to_host(tensor)
            tensor.add_(1.0)  # a write the forward makes after saving
        # guarded: the compute stream waited for the copy before the write
        assert torch.equal(saved.restore(check_version=False), torch.full((64,), want))


# order and bounds -----------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 1, 2, 4])
@pytest.mark.parametrize("backward_order", [True, False])
def test_prefetch_runs_in_use_order_within_its_window(prefetch: int, backward_order: bool) -> None:
    sim = simulated(1)
    with simulate_copies(sim):
        transfer = HostTransfer(prefetch=prefetch, backward_order=backward_order)
        saved = [transfer.to_host(torch.randn(128) + i) for i in range(8)]
    order = list(reversed(saved)) if backward_order else saved
    hosts = [copy.block.host for copy in order]
    for used, copy in enumerate(order):
        copy.restore()
        issued = h2d_sources(sim)
        positions = [next(i for i, host in enumerate(hosts) if host is source) for source in issued]
        assert positions == list(range(len(positions)))  # started in the order they are used
        assert len(positions) - 1 - used <= prefetch  # at most `prefetch` ahead of use
        assert len(positions) == min(len(order), used + 1 + prefetch)


@pytest.mark.parametrize("bound", [0, 600, 2048, 1 << 20])
def test_bytes_waiting_for_their_copy_stay_within_the_stash_bound(bound: int) -> None:
    sim = simulated(2, eagerness=0.0)  # copies leave only when the transfer waits for them
    largest = 0
    with simulate_copies(sim):
        transfer = HostTransfer(stash_bytes=bound)
        kept = []
        for size in (64, 200, 128, 512, 32, 256, 64, 300):
            tensor = torch.randn(size)
            largest = max(largest, tensor.numel() * tensor.element_size())
            kept.append((tensor.clone(), transfer.to_host(tensor)))
            assert sim.pending_bytes("d2h") <= max(bound, largest)
    for want, copy in reversed(kept):
        assert torch.equal(copy.restore(), want)
    assert not sim.hazards
