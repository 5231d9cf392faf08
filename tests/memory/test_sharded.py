"""Memory per rank: the tracker under sharding engines and the sharded estimate (one process).

The ranks are simulated (torch's "fake" process group: collectives move no
data) so that FSDP2 and tensor parallelism run their real code here. The
oracle of the estimate (fake tensors) is the same step on real tensors under
the same simulated group: byte for byte. The command's sharded cases (the
loader's models, its strategies) are ``tests/cli/test_estimate_sharded.py``;
real multi-process runs ``tests/cli/test_estimate_ranks.py``. Design:
``docs/design/memory.md`` ("Sharded training").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import assert_same_memory, tiny_llama_config
from remat._compat.distributed import (
    collectives_run_on_fake_tensors,
    sharding_api_available,
    simulated_process_group,
)
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError
from remat.memory import (
    Sharding,
    estimate_sharded_step,
    render_memory_report,
    shard_model,
    tensor_parallel_plan,
    track,
    track_training_step,
)
from remat.models import GPT, GPT_TP_PLAN, GPTConfig, lm_loss
from remat.placement import BlockSetting, place
from remat.policies import save_only_names

needs_sharding = pytest.mark.skipif(
    not sharding_api_available(), reason="FSDP2 and MixedPrecisionPolicy are public from torch 2.6"
)
needs_estimate = pytest.mark.skipif(
    not (sharding_api_available() and collectives_run_on_fake_tensors()),
    reason="the sharded estimate runs collectives on fake tensors: torch 2.11 and newer (not 2.7)",
)


@contextlib.contextmanager
def ranks(world_size: int) -> Iterator[None]:
    with simulated_process_group(world_size):
        yield


# ---------------------------------------------------------------- the tracker


class Gathered(nn.Module):
    """A linear layer whose weight is "gathered" by hooks the way FSDP2 does it.

    A storage kept by the module grows to the full weight before each forward
    and shrinks to nothing after: ``UntypedStorage.resize_`` from Python, which
    no dispatched op returns.
    """

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = features
        self.buffer = torch.empty(0)
        self.register_forward_pre_hook(self._gather)
        self.register_forward_hook(self._release)
        self.weight = nn.Parameter(torch.empty(0))

    def _gather(self, module: nn.Module, args: Any) -> None:
        self.buffer.untyped_storage().resize_(self.features * self.features * 4)
        full = torch.empty(0).set_(self.buffer.untyped_storage(), 0, (self.features, self.features))
        with torch.no_grad():
            full.fill_(0.01)
        self.weight = nn.Parameter(full)

    def _release(self, module: nn.Module, args: Any, output: Any) -> None:
        self.weight = nn.Parameter(torch.empty(0))
        self.buffer.untyped_storage().resize_(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_a_storage_resized_outside_ops_is_counted_while_gathered() -> None:
    model = nn.Sequential(Gathered(64), Gathered(64))
    weight = 64 * 64 * 4
    x = torch.randn(8, 64, requires_grad=True)
    with track(model) as t:
        model(x).sum()
        t.mark("after")
    report = t.report()
    gathered = report.category("unsharded_parameter")
    assert gathered.allocated_bytes == 2 * weight  # each layer gathered once
    assert gathered.at_end_bytes == 0 and t.marks["after"] < weight
    # The two gathers never overlap: the first is released before the second grows.
    kinds = [(e.kind, e.delta_bytes) for e in report.timeline if abs(e.delta_bytes) == weight]
    assert kinds == [("alloc", weight), ("free", -weight)] * 2
    assert report.peak_bytes >= weight


@needs_sharding
def test_a_wrapper_subclass_counts_its_local_shard() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with ranks(4):
        mesh = init_device_mesh("cpu", (4,))
        layer = nn.Linear(64, 64, bias=False)
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        with track(layer) as t:
            pass
        report = t.report()
    assert report.start_bytes == 64 * 64 * 4 // 4  # the local quarter, not the global shape
    assert (report.rank, report.world_size) == (0, 4)
    assert render_memory_report(report).splitlines()[0].endswith(", rank 0 of 4")


def placed_gpt() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The embedded GPT, its blocks checkpointed keeping the attention outputs (by name), and
    its loss on one batch (token ids as ``make_batch`` lays them out)."""
    config = GPTConfig(n_layers=2, seq_len=32)
    torch.manual_seed(0)
    model = GPT(config)
    setting = BlockSetting(policy=save_only_names("attn_out"))
    place(model, {f"blocks.{i}": setting for i in range(config.n_layers)})
    tokens = torch.zeros(2, config.seq_len + 1, dtype=torch.long)
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    return model, lambda: lm_loss(model(idx), targets)


PLACED_SHARDINGS = [
    Sharding(world_size=2, fsdp=True),
    Sharding(world_size=4, fsdp=True, tp=2, mixed_precision="bf16"),
]


@needs_estimate
@pytest.mark.parametrize("sharding", PLACED_SHARDINGS, ids=[s.describe() for s in PLACED_SHARDINGS])
def test_estimate_of_a_placed_gpt_equals_its_step_on_real_tensors(sharding: Sharding) -> None:
    # Same simulated ranks, same FSDP2/TP code: fake tensors change nothing the tracker counts.
    estimated = estimate_sharded_step(placed_gpt, sharding=sharding, tp_plan=GPT_TP_PLAN)
    with ranks(sharding.world_size):
        model, loss = placed_gpt()
        shard_model(model, sharding, tp_plan=GPT_TP_PLAN)
        measured = track_training_step(model, loss)
    assert_same_memory(estimated, measured)


@needs_estimate
def test_sharded_estimate_of_64_ranks_runs_here() -> None:
    def build() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
        model = GPT(GPTConfig(n_layers=2, seq_len=32, d_model=256, n_heads=4))
        idx = torch.zeros(1, 32, dtype=torch.long)
        return model, lambda: model(idx).float().mean()

    report = estimate_sharded_step(build, sharding=Sharding(world_size=64, fsdp=True))
    assert report.world_size == 64
    params = GPTConfig(n_layers=2, seq_len=32, d_model=256, n_heads=4).parameter_count()
    assert report.category("parameter").at_peak_bytes < params * 4 / 32


# ------------------------------------------------------------------ bad input


def test_sharding_rejects_bad_values() -> None:
    with pytest.raises(CheckpointUsageError, match="world_size must be an int >= 1"):
        Sharding(world_size=0, fsdp=True)
    with pytest.raises(CheckpointUsageError, match="tp=3 must divide world_size=4"):
        Sharding(world_size=4, fsdp=True, tp=3)
    with pytest.raises(CheckpointUsageError, match="pass fsdp=True with it"):
        Sharding(world_size=2, tp=2, mixed_precision="bf16")
    with pytest.raises(CheckpointUsageError, match="mixed_precision must be one of"):
        Sharding(world_size=2, fsdp=True, mixed_precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(CheckpointUsageError, match="would each hold a full replica"):
        Sharding(world_size=4)
    assert Sharding(world_size=8, fsdp=True, tp=2).describe() == "8 ranks: FSDP2 x 4, TP x 2"


@pytest.mark.skipif(
    not sharding_api_available() or collectives_run_on_fake_tensors(),
    reason="only where FSDP2 is public and collectives do not run on fake tensors (torch 2.6-2.8)",
)
def test_the_estimate_says_which_torch_it_needs() -> None:
    with pytest.raises(UnsupportedCheckpointError, match=r"2\.11 and newer"):
        estimate_sharded_step(lambda: (nn.Linear(2, 2), lambda: torch.zeros(())), sharding=Sharding(2, fsdp=True))
    assert not dist.is_initialized()


@needs_estimate
def test_estimate_refuses_a_process_group_already_in_this_process() -> None:
    with ranks(2), pytest.raises(CheckpointUsageError, match="already initialized"):
        estimate_sharded_step(lambda: (nn.Linear(2, 2), lambda: torch.zeros(())), sharding=Sharding(2, fsdp=True))
    assert not dist.is_initialized()  # the failed call left nothing behind
    with pytest.raises(CheckpointTypeError, match="build\\(\\) must return"):
        estimate_sharded_step(lambda: nn.Linear(2, 2), sharding=Sharding(2, fsdp=True))  # type: ignore[arg-type, return-value]
    assert not dist.is_initialized()


@needs_sharding
def test_shard_model_needs_a_matching_process_group() -> None:
    with pytest.raises(CheckpointUsageError, match="there is no process group"):
        shard_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), Sharding(2, fsdp=True))
    with ranks(4), pytest.raises(CheckpointUsageError, match="a process group of 4 ranks"):
        shard_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), Sharding(2, fsdp=True))


def test_tensor_parallel_plans_of_known_models() -> None:
    transformers = pytest.importorskip("transformers")
    # The embedded GPT's plan is the application's (remat.models.GPT_TP_PLAN), not the library's.
    with pytest.raises(CheckpointUsageError, match="no known tensor-parallel plan"):
        tensor_parallel_plan(GPT(GPTConfig(n_layers=1)))
    plan = tensor_parallel_plan(transformers.AutoModelForCausalLM.from_config(tiny_llama_config()))
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    with pytest.raises(CheckpointUsageError, match="no known tensor-parallel plan"):
        tensor_parallel_plan(nn.Linear(2, 2))
