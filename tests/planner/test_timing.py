"""The time model of estimated plans: remat.planner.timing (rates, the modelled clock, graphs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat._compat.versions import static_compile_supported
from remat.errors import CheckpointUsageError
from remat.memory import statically_compiled
from remat.placement import BlockSetting, CompileSpec, place
from remat.planner.timing import DEVICES, DeviceRates, ModelledClock, graph_seconds

H100 = DeviceRates.named("h100")


def test_named_rates_and_a_clear_error_for_an_unknown_device() -> None:
    assert DeviceRates.named("H100") is DEVICES["h100"]
    assert H100.flops_per_s(torch.bfloat16) > H100.flops_per_s(torch.float32)
    assert H100.flops_per_s(torch.float64) == H100.flops_per_s(torch.float32)  # the fallback
    with pytest.raises(CheckpointUsageError, match=r"no rates for a device named 'tpu'.*h100"):
        DeviceRates.named("tpu")
    with pytest.raises(CheckpointUsageError, match="float32"):
        DeviceRates("x", {torch.bfloat16: 1e12}, 1e12, 0.0, 0.0)
    with pytest.raises(CheckpointUsageError, match="positive"):
        DeviceRates("x", {torch.float32: 1e12}, 0.0, 0.0, 0.0)
    with pytest.raises(CheckpointUsageError, match=r"policy_op_overhead_s must be 0 or more"):
        DeviceRates("x", {torch.float32: 1e12}, 1e12, 0.0, 0.0, policy_op_overhead_s=-1e-6)


def test_measured_rates_are_positive_and_say_so() -> None:
    rates = DeviceRates.measure()
    assert rates.measured and "measured here" in rates.describe()
    assert rates.flops_per_s(torch.float32) > 0 and rates.memory_bytes_per_s > 0 and rates.op_overhead_s > 0
    assert rates.policy_op_overhead_s >= 0 and H100.policy_op_overhead_s > 0


def test_a_matmul_is_priced_by_its_flops_and_a_copy_by_its_bytes() -> None:
    a, b = torch.randn(256, 512), torch.randn(512, 1024)
    with ModelledClock(H100) as clock:
        a @ b
    flops = 2 * 256 * 512 * 1024
    assert clock.seconds() == pytest.approx(flops / 66.9e12 + H100.op_overhead_s)
    x = torch.randn(1 << 20)
    with ModelledClock(H100) as clock:
        x.clone()
    assert clock.seconds() == pytest.approx(2 * x.nbytes / 3.35e12 + H100.op_overhead_s)
    with ModelledClock(H100) as clock:
        x.view(1024, 1024).t()  # views move no bytes
    assert clock.seconds() == pytest.approx(2 * H100.op_overhead_s)


def test_bf16_matmuls_are_priced_at_the_bf16_rate() -> None:
    a = torch.randn(1024, 1024, dtype=torch.bfloat16)
    with ModelledClock(H100) as clock:
        a @ a
    assert clock.seconds() == pytest.approx(2 * 1024**3 / 989.4e12 + H100.op_overhead_s)


class _CountOps(TorchDispatchMode):
    """Counts the ops a function dispatches (entered inside it: above a region's modes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_selective_region_pays_its_modes_per_op_and_a_replayed_op_too() -> None:
    # A policy's modes cost Python per op on the host: a plan that priced selective blocks
    # without it chose them where a fully checkpointed block was faster (issue 45's ZBV
    # plans). Every op the function runs, in its forward and in its recomputation (the
    # replayed matmul included: served from the cache, it runs no kernel), is charged once.
    charged = DeviceRates("x", {torch.float32: 1e12}, 1e12, 0.0, 0.0, policy_op_overhead_s=1.0)
    counters: list[_CountOps] = []

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        counter = _CountOps()
        counters.append(counter)
        with counter:
            return (x @ w).tanh().sum(0)

    def step(policy: Callable[..., Any] | None, fake: bool = False) -> float:
        counters.clear()
        with contextlib.ExitStack() as stack:
            if fake:
                stack.enter_context(FakeTensorMode())
            x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
            with ModelledClock(charged) as clock:
                remat.checkpoint(block, x, w, policy=policy).sum().backward()
        return clock.seconds()

    # (The kernels' own time at these rates is nanoseconds: the whole seconds are the modes'.)
    assert step(None) < 1e-6  # full checkpointing: no per-op mode
    seconds = step(remat.policies.save_matmuls)
    assert len(counters) == 2  # the forward and the recomputation
    ops = sum(counter.ops for counter in counters)
    assert ops >= 5 and seconds == pytest.approx(ops, abs=1e-6)  # mm, tanh, sum; mm (replayed), tanh
    # A simulation on fake tensors is charged what the real run is: a fake tensor's
    # tensor.device() queries (more numerous there than any op) are no ops of the run.
    assert step(remat.policies.save_matmuls, fake=True) == pytest.approx(seconds, abs=1e-6)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)) * 2 + 1)


@pytest.mark.compile
@pytest.mark.skipif(not static_compile_supported(), reason="static compilation needs torch 2.11+")
def test_a_compiled_graph_is_priced_by_its_kernels_not_its_ops() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_MLP())
    place(model, {"0": BlockSetting(checkpoint=False, compile=CompileSpec())})
    x = torch.randn(128, 64, requires_grad=True)
    with statically_compiled(model) as compilation, ModelledClock(H100) as clock:
        model(x).sum().backward()
    graphs = sum(graph_seconds(plan.graph, plan.realized, H100) for plan in compilation.plans)
    eager_sum_and_backward = clock.seconds() - graphs
    assert 0 < eager_sum_and_backward < 20 * H100.op_overhead_s  # sum, ones_like, accumulation
    forward = compilation.plans[0]
    # Two matmuls (with their biases) and one fused gelu*2+1 kernel: fewer kernels than ops.
    kernels = len(forward.realized)
    ops = sum(1 for node in forward.graph.graph.nodes if node.op == "call_function")
    assert kernels < ops
    flops = 2 * 128 * 64 * 256 * 2
    assert graph_seconds(forward.graph, forward.realized, H100) >= flops / 66.9e12 + kernels * H100.kernel_overhead_s
