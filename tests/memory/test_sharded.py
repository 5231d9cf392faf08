"""Memory per rank: the tracker under sharding engines and the sharded estimate (one process).

The ranks are simulated (torch's "fake" process group: collectives move no
data) so that FSDP2 and tensor parallelism run their real code here. The
oracle of the estimate (fake tensors) is the same step on real tensors under
the same simulated group: byte for byte. Real multi-process runs are in
``tests/test_memory_sharded_ranks.py``. Design: ``docs/design/memory.md``
("Sharded training").
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import tiny_llama_config
from remat._compat import (
    collectives_run_on_fake_tensors,
    sharding_api_available,
    simulated_process_group,
)
from remat.cli.loader import ModelRequest
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError
from remat.memory import (
    MemoryReport,
    Sharding,
    estimate_sharded_step,
    render_memory_report,
    shard_model,
    tensor_parallel_plan,
    track,
    track_training_step,
)
from remat.models import GPT, GPTConfig

needs_sharding = pytest.mark.skipif(
    not sharding_api_available(), reason="FSDP2 and MixedPrecisionPolicy are public from torch 2.6"
)
needs_estimate = pytest.mark.skipif(
    not (sharding_api_available() and collectives_run_on_fake_tensors()),
    reason="the sharded estimate runs collectives on fake tensors: torch 2.11 and newer (not 2.7)",
)


@pytest.fixture
def tiny_llama(tmp_path: pathlib.Path) -> pathlib.Path:
    config = tiny_llama_config()
    path = tmp_path / "llama.json"
    config.to_json_file(path)
    return path


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


@needs_estimate
def test_fsdp2_parameters_gathers_and_buffers_have_their_own_categories(tiny_llama: pathlib.Path) -> None:
    reports = {n: _estimate(tiny_llama, Sharding(world_size=n, fsdp=True)) for n in (2, 4)}
    two, four = (reports[n] for n in (2, 4))
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(str(tiny_llama))
        )
    for n, report in reports.items():
        # FSDP2 splits each parameter on dim 0 into equal chunks, padded: rank 0
        # holds a full chunk of each; buffers are not sharded.
        shards = sum(-(-p.shape[0] // n) * (p.numel() // p.shape[0]) * 4 for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        assert report.category("parameter").at_peak_bytes == shards + buffers
    for report in (two, four):
        # A block's gathered parameters live while it runs: never at the end.
        assert report.category("unsharded_parameter").allocated_bytes > 0
        assert report.category("unsharded_parameter").at_end_bytes == 0
        assert report.category("communication").allocated_bytes > 0
        assert report.world_size in (2, 4)
    # Gathered blocks are full size whatever the world size.
    assert (
        two.category("unsharded_parameter").allocated_bytes
        == four.category("unsharded_parameter").allocated_bytes
    )


SHARDINGS = [
    Sharding(world_size=1, fsdp=True),
    Sharding(world_size=2, fsdp=True),
    Sharding(world_size=4, fsdp=True, mixed_precision="bf16"),
    Sharding(world_size=2, fsdp=True, reshard_after_forward=False),
    Sharding(world_size=2, tp=2),
    Sharding(world_size=4, fsdp=True, tp=2),
    Sharding(world_size=2, fsdp=True, tp=2),
]


@needs_estimate
@pytest.mark.parametrize("sharding", SHARDINGS, ids=[s.describe() for s in SHARDINGS])
@pytest.mark.parametrize("strategy", ["none", "remat", "remat:save_matmuls"])
def test_estimate_on_fake_tensors_equals_the_step_on_real_ones(
    tiny_llama: pathlib.Path, sharding: Sharding, strategy: str
) -> None:
    # Same simulated ranks, same FSDP2/TP code: fake tensors change nothing the tracker counts.
    estimated = _estimate(tiny_llama, sharding, strategy)
    measured = _real_under_simulated_ranks(tiny_llama, sharding, strategy)
    assert_same_memory(estimated, measured)


@needs_estimate
def test_the_embedded_gpt_with_names_under_fsdp2_and_tensor_parallel() -> None:
    request = ModelRequest(command="test", gpt=GPTConfig(n_layers=2, seq_len=32), batch=2)
    sharding = Sharding(world_size=4, fsdp=True, tp=2, mixed_precision="bf16")
    from remat.cli.estimate import ShardedCase

    case = ShardedCase(request, "remat:names", sharding)
    estimated = case.estimate()
    with ranks(4):
        model, loss = case.build("cpu")
        shard_model(model, sharding, tp_plan=case.tp_plan)
        measured = track_training_step(model, loss)
    assert_same_memory(estimated, measured)


@needs_estimate
def test_frozen_parameters_have_no_gradient_and_no_optimizer_state(tiny_llama: pathlib.Path) -> None:
    pytest.importorskip("peft")
    sharding = Sharding(world_size=2, fsdp=True)
    full = _estimate(tiny_llama, sharding)
    lora = _estimate(tiny_llama, sharding, lora_rank=4)
    frozen = _estimate(tiny_llama, sharding, freeze=("model.*",))  # all but the output layer
    assert_same_memory(lora, _real_under_simulated_ranks(tiny_llama, sharding, "none", lora_rank=4))
    # Adam keeps two moments per trainable parameter (plus a step count per tensor).
    trainable = _trainable_bytes(tiny_llama, sharding, lora_rank=4)
    moments = lora.category("optimizer_state").at_end_bytes
    assert 2 * trainable <= moments < 2 * trainable + 4 * 64
    assert moments < full.category("optimizer_state").at_end_bytes / 5
    assert frozen.category("gradient").allocated_bytes < full.category("gradient").allocated_bytes
    assert lora.peak_bytes < full.peak_bytes


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


def test_tensor_parallel_plans_of_known_models(tiny_llama: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    # The embedded GPT's plan is the application's (remat.models.GPT_TP_PLAN), not the library's.
    with pytest.raises(CheckpointUsageError, match="no known tensor-parallel plan"):
        tensor_parallel_plan(GPT(GPTConfig(n_layers=1)))
    config = transformers.AutoConfig.from_pretrained(str(tiny_llama))
    plan = tensor_parallel_plan(transformers.AutoModelForCausalLM.from_config(config))
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    with pytest.raises(CheckpointUsageError, match="no known tensor-parallel plan"):
        tensor_parallel_plan(nn.Linear(2, 2))


# -------------------------------------------------------------------- helpers


def _request(config: pathlib.Path, **adapt: Any) -> ModelRequest:
    return ModelRequest(command="test", hf_config=config, batch=2, seq=16, **adapt)


def _estimate(config: pathlib.Path, sharding: Sharding, strategy: str = "none", **adapt: Any) -> MemoryReport:
    from remat.cli.estimate import ShardedCase

    return ShardedCase(_request(config, **adapt), strategy, sharding).estimate()


def _real_under_simulated_ranks(
    config: pathlib.Path, sharding: Sharding, strategy: str, **adapt: Any
) -> MemoryReport:
    from remat.cli.estimate import ShardedCase

    case = ShardedCase(_request(config, **adapt), strategy, sharding)
    with ranks(sharding.world_size):
        model, loss = case.build("cpu")
        shard_model(model, sharding)
        return track_training_step(model, loss)


def _trainable_bytes(config: pathlib.Path, sharding: Sharding, **adapt: Any) -> int:
    """Bytes of this rank's shards of the trainable parameters (after the step's warm-up)."""
    from remat.cli.estimate import ShardedCase

    case = ShardedCase(_request(config, **adapt), "none", sharding)
    with ranks(sharding.world_size):
        model, _ = case.build("cpu")
        shard_model(model, sharding)
        return sum(
            p.to_local().untyped_storage().nbytes() if hasattr(p, "to_local") else p.untyped_storage().nbytes()
            for p in model.parameters()
            if p.requires_grad
        )


def assert_same_memory(estimated: MemoryReport, measured: MemoryReport) -> None:
    assert (estimated.peak_bytes, estimated.forward_end_bytes, estimated.end_bytes) == (
        measured.peak_bytes,
        measured.forward_end_bytes,
        measured.end_bytes,
    )
    # By category at those three moments (the bytes allocated in between also
    # count kernels' transient scratch, which real data can change: the
    # attention of a real run builds a few small masks the fake one skips).
    def moments(report: MemoryReport) -> list[tuple[str, int, int, int]]:
        return [(u.name, u.at_peak_bytes, u.at_forward_end_bytes, u.at_end_bytes) for u in report.by_category]

    assert moments(estimated) == moments(measured)
    assert (estimated.rank, estimated.world_size) == (measured.rank, measured.world_size)
