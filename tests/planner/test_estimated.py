"""Plans made without running the model: remat.plan(..., estimate=DeviceRates).

The oracle is the measured planner on the same model: an estimated profile
counts the same bytes as a measured one where the tracker is exact (eager,
one process), and an estimated plan applied to the real model fits its
budget when it runs (docs/design/planner.md, "Estimated plans").
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from remat._compat.distributed import collectives_run_on_fake_tensors, sharding_api_available
from remat._compat.fake import fake_tensor_mode
from remat._compat.versions import static_compile_supported
from remat.errors import CheckpointUsageError, UnsupportedCheckpointError
from remat.memory import Sharding, simulated_rank
from remat.models import GPT, GPTConfig, lm_loss, make_batch
from remat.planner import Planner, plan
from remat.planner.timing import DeviceRates

CONFIG = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=3, d_ff=256)
H100 = DeviceRates.named("h100")


def _gpt(seed: int = 0) -> tuple[GPT, tuple[torch.Tensor], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    idx, targets = make_batch(CONFIG, 4, torch.Generator().manual_seed(seed))
    return model, (idx,), lambda logits: lm_loss(logits, targets)


def _fake_gpt() -> tuple[Any, GPT, tuple[torch.Tensor], Callable[[Any], torch.Tensor]]:
    fake = fake_tensor_mode()
    with fake:
        model, inputs, loss_fn = _gpt()
    return fake, model, inputs, loss_fn


def test_an_estimated_eager_profile_counts_the_measured_bytes_and_its_plan_fits_when_run() -> None:
    fake, fake_model, fake_inputs, fake_loss = _fake_gpt()
    with fake:
        estimated = Planner(fake_model, loss_fn=fake_loss, estimate=H100)
        estimated_profile = estimated.profile(fake_inputs)
    model, inputs, loss_fn = _gpt()
    measured_profile = Planner(model, loss_fn=loss_fn, repeats=1).profile(inputs)
    assert estimated_profile.estimated_with == H100.describe()
    assert measured_profile.estimated_with is None
    assert estimated_profile.unchecked_peak_bytes == measured_profile.unchecked_peak_bytes
    for mine, theirs in zip(estimated_profile.regions, measured_profile.regions, strict=True):
        for name, cost in mine.costs.items():
            assert cost.retained_bytes == theirs.costs[name].retained_bytes, (mine.name, name)
            assert cost.time_s > 0
    for fraction in (0.9, 0.75):
        with fake:
            chosen = estimated.plan(fake_inputs, fraction=fraction)
        assert chosen.estimated_with is not None and "estimated, not measured" in chosen.report()
        assert chosen.verify(model, inputs, loss_fn=loss_fn) <= chosen.budget_bytes, fraction


def test_recomputation_costs_time_in_the_model_as_it_does_when_run() -> None:
    # Large enough that the matmuls, not the ops' fixed costs, set the time;
    # on fake tensors it costs nothing to run.
    config = GPTConfig(vocab_size=1024, seq_len=512, d_model=1024, n_heads=8, n_layers=3, d_ff=4096)
    fake = fake_tensor_mode()
    with fake:
        model = GPT(config)
        idx, targets = make_batch(config, 8, torch.Generator().manual_seed(0))
        profile = Planner(
            model, loss_fn=lambda logits: lm_loss(logits, targets), estimate=DeviceRates.named("a100")
        ).profile((idx,))
    costs = profile.regions[1].costs
    assert costs["keep"].time_s < costs["checkpoint:save_matmuls"].time_s < costs["checkpoint"].time_s
    assert profile.unchecked_step_s > sum(region.costs["keep"].time_s for region in profile.regions)


def test_estimated_plans_refuse_what_needs_a_run() -> None:
    fake, model, inputs, loss_fn = _fake_gpt()
    with fake, pytest.raises(CheckpointUsageError, match="verify=True runs the plan"):
        plan(model, inputs, "60%", loss_fn=loss_fn, estimate=H100, verify=True)
    with fake, pytest.raises(UnsupportedCheckpointError, match="compress needs measured steps"):
        plan(model, inputs, "60%", loss_fn=loss_fn, estimate=H100, compress="fp8", max_gradient_error=0.1)
    with pytest.raises(CheckpointUsageError, match=r"estimate must be a remat\.planner\.timing\.DeviceRates"):
        Planner(model, estimate="h100")  # type: ignore[arg-type]


def test_a_saved_estimated_plan_says_so(tmp_path: Any) -> None:
    fake, model, inputs, loss_fn = _fake_gpt()
    with fake:
        chosen = plan(model, inputs, "80%", loss_fn=loss_fn, estimate=H100)
    text = chosen.save(tmp_path / "plan.toml").read_text()
    assert f'estimated_with = "{H100.describe()}"' in text


@pytest.mark.skipif(
    not (sharding_api_available() and collectives_run_on_fake_tensors()),
    reason="simulated ranks need FSDP2 and collectives on fake tensors (torch 2.11+)",
)
def test_an_estimated_sharded_plan_is_made_on_one_simulated_rank_for_all() -> None:
    def build() -> tuple[GPT, tuple[torch.Tensor], Callable[[Any], torch.Tensor]]:
        return _gpt()

    with simulated_rank(build, sharding=Sharding(world_size=8, fsdp=True)) as (model, inputs, loss_fn):
        chosen = plan(model, inputs, "80%", loss_fn=loss_fn, estimate=H100)
        assert not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 8
    assert chosen.world_size == 8
    assert chosen.predicted_peak_bytes <= chosen.budget_bytes
    assert [d.region for d in chosen.decisions] == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.skipif(not static_compile_supported(), reason="static compiled estimates need torch 2.11+")
def test_an_estimated_compiled_plan_fits_when_compiled_and_run() -> None:
    fake, fake_model, fake_inputs, fake_loss = _fake_gpt()
    with fake:
        estimated = Planner(fake_model, loss_fn=fake_loss, compile=True, estimate=H100)
        profile = estimated.profile(fake_inputs)
    model, inputs, loss_fn = _gpt()
    keep = Planner(copy.deepcopy(model), loss_fn=loss_fn, repeats=1, compile=True, options=[]).profile(inputs)
    # What a compiled block keeps is the partitioner's: exact. Its backward's
    # transients are a model of inductor's buffers that errs high on blocks
    # this small (+9.8% on the unchecked peak here, measured): a plan made on it
    # may keep less than it could, never more (docs/design/planner.md,
    # "Estimated plans").
    for mine, theirs in zip(profile.regions, keep.regions, strict=True):
        assert mine.costs["keep"].retained_bytes == theirs.costs["keep"].retained_bytes
    assert keep.unchecked_peak_bytes <= profile.unchecked_peak_bytes <= 1.15 * keep.unchecked_peak_bytes
    for fraction in (0.85, 0.65):
        with fake:
            chosen = estimated.plan(fake_inputs, fraction=fraction)
        assert chosen.compile is not None
        assert chosen.verify(model, inputs, loss_fn=loss_fn) <= chosen.budget_bytes, (fraction, chosen.report())
