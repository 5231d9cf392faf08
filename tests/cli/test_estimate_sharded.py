"""`remat estimate`'s sharded cases (remat.cli.estimate.ShardedCase) in one process: the
estimate of a case on fake tensors equals the same case's step on real tensors under the same
simulated ranks, byte for byte, for the loader's models (a tiny Llama from ``--hf-config``,
the embedded GPT with names), with LoRA and frozen parameters. The tracker and the sharded
estimate on their own: ``tests/memory/test_sharded.py``; real multi-process runs:
``test_estimate_ranks.py``. Design: ``docs/design/memory.md`` ("Sharded training").
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from helpers import assert_same_memory, tiny_llama_config
from remat._compat.distributed import (
    collectives_run_on_fake_tensors,
    sharding_api_available,
    simulated_process_group,
)
from remat.cli.loader import ModelRequest
from remat.memory import MemoryReport, Sharding, shard_model, track_training_step
from remat.models import GPTConfig

needs_estimate = pytest.mark.skipif(
    not (sharding_api_available() and collectives_run_on_fake_tensors()),
    reason="the sharded estimate runs collectives on fake tensors: torch 2.11 and newer (not 2.7)",
)


@pytest.fixture
def llama_json(tmp_path: pathlib.Path) -> pathlib.Path:
    """The tiny Llama's config (``helpers.TINY_LLAMA``) as a file ``--hf-config`` reads."""
    path = tmp_path / "llama.json"
    tiny_llama_config().to_json_file(path)
    return path


@needs_estimate
def test_fsdp2_parameters_gathers_and_buffers_have_their_own_categories(llama_json: pathlib.Path) -> None:
    reports = {n: _estimate(llama_json, Sharding(world_size=n, fsdp=True)) for n in (2, 4)}
    two, four = (reports[n] for n in (2, 4))
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(str(llama_json))
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
    llama_json: pathlib.Path, sharding: Sharding, strategy: str
) -> None:
    # Same simulated ranks, same FSDP2/TP code: fake tensors change nothing the tracker counts.
    estimated = _estimate(llama_json, sharding, strategy)
    measured = _real_under_simulated_ranks(llama_json, sharding, strategy)
    assert_same_memory(estimated, measured)


@needs_estimate
def test_the_embedded_gpt_with_names_under_fsdp2_and_tensor_parallel() -> None:
    request = ModelRequest(command="test", gpt=GPTConfig(n_layers=2, seq_len=32), batch=2)
    sharding = Sharding(world_size=4, fsdp=True, tp=2, mixed_precision="bf16")
    from remat.cli.estimate import ShardedCase

    case = ShardedCase(request, "remat:names", sharding)
    estimated = case.estimate()
    with simulated_process_group(4):
        model, loss = case.build("cpu")
        shard_model(model, sharding, tp_plan=case.tp_plan)
        measured = track_training_step(model, loss)
    assert_same_memory(estimated, measured)


@needs_estimate
def test_frozen_parameters_have_no_gradient_and_no_optimizer_state(llama_json: pathlib.Path) -> None:
    pytest.importorskip("peft")
    sharding = Sharding(world_size=2, fsdp=True)
    full = _estimate(llama_json, sharding)
    lora = _estimate(llama_json, sharding, lora_rank=4)
    frozen = _estimate(llama_json, sharding, freeze=("model.*",))  # all but the output layer
    assert_same_memory(lora, _real_under_simulated_ranks(llama_json, sharding, "none", lora_rank=4))
    # Adam keeps two moments per trainable parameter (plus a step count per tensor).
    trainable = _trainable_bytes(llama_json, sharding, lora_rank=4)
    moments = lora.category("optimizer_state").at_end_bytes
    assert 2 * trainable <= moments < 2 * trainable + 4 * 64
    assert moments < full.category("optimizer_state").at_end_bytes / 5
    assert frozen.category("gradient").allocated_bytes < full.category("gradient").allocated_bytes
    assert lora.peak_bytes < full.peak_bytes


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
    with simulated_process_group(sharding.world_size):
        model, loss = case.build("cpu")
        shard_model(model, sharding)
        return track_training_step(model, loss)


def _trainable_bytes(config: pathlib.Path, sharding: Sharding, **adapt: Any) -> int:
    """Bytes of this rank's shards of the trainable parameters (after the step's warm-up)."""
    from remat.cli.estimate import ShardedCase

    case = ShardedCase(_request(config, **adapt), "none", sharding)
    with simulated_process_group(sharding.world_size):
        model, _ = case.build("cpu")
        shard_model(model, sharding)
        return sum(
            p.to_local().untyped_storage().nbytes() if hasattr(p, "to_local") else p.untyped_storage().nbytes()
            for p in model.parameters()
            if p.requires_grad
        )


def _tensor_parallel_stages() -> Any:
    import transformers

    from remat.memory import StagedModel
    from remat.models import llama_stages, lm_loss

    torch.manual_seed(0)
    tokens = torch.randint(64, (8, 17))
    config = tiny_llama_config(vocab_size=64, num_hidden_layers=4, max_position_embeddings=16, use_cache=False)
    llama = transformers.LlamaForCausalLM(config).train()
    return StagedModel(llama_stages(llama, 4), (tokens[:, :-1],), tokens[:, 1:], lm_loss, model=llama)


@needs_estimate
def test_a_tensor_parallel_pipeline_simulated_first_leaves_no_stale_mesh(llama_json: pathlib.Path) -> None:
    """A tensor-parallel pipeline simulated earlier in this process once broke this case: DTensor's
    C++ sharding cache kept decisions made on that simulation's meshes, which equal the new ones
    (same ranks, layout and names) and name process groups destroyed since ("Could not resolve
    the process group registered under the name 7"). ``simulated_process_group`` clears it on exit."""
    pytest.importorskip("transformers")
    from remat._compat.pipelining import schedule_class
    from remat.memory import Pipeline, estimate_pipeline_step

    if schedule_class("ScheduleZBVZeroBubble") is None:
        pytest.skip(f"torch {torch.__version__} has no ScheduleZBVZeroBubble")
    pipeline = Pipeline(ranks=2, schedule="ZBVZeroBubble", microbatches=4, tensor_parallel=2)
    estimate_pipeline_step(_tensor_parallel_stages, pipeline=pipeline, processes=1)  # in this process
    sharding = Sharding(world_size=4, fsdp=True, tp=2)
    assert_same_memory(_estimate(llama_json, sharding, "remat"), _real_under_simulated_ranks(llama_json, sharding, "remat"))
