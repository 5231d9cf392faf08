"""Plans for pipelined training (``remat.planner.plan_pipeline``): one choice per rank under
one per-rank budget, from the ranks simulated on fake tensors; the saved plan, applied on
real gloo ranks, fits every rank (measured). Design: ``docs/design/planner.md``
("Pipelined plans")."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import remat
from helpers import launch_once
from remat._compat.distributed import collectives_run_on_fake_tensors
from remat.errors import CheckpointUsageError, InfeasibleBudgetError
from remat.memory import Pipeline, StagedModel, measure_this_rank
from remat.models import GPT, GPTConfig, gpt_stages, lm_loss
from remat.planner import PipelinePlanner, plan_pipeline

pytestmark = [
    pytest.mark.xdist_group("pipeline-memory"),
    pytest.mark.skipif(not collectives_run_on_fake_tensors(),
                       reason="simulated ranks run collectives on fake tensors: torch 2.11 and newer"),
]

PIPELINE = Pipeline(ranks=2, schedule="1F1B", microbatches=4)
BUDGETS = ("92%", "80%")  # checkpointing every block reaches 77% (parameters and Adam dominate)


def build(regions: dict[str, str] | None = None, *, whole: bool = True) -> StagedModel:
    """The GPT of 4 blocks in 2 stages; ``regions`` applied as a saved plan would be."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=2, n_layers=4, d_ff=256))
    if regions is not None:
        remat.apply_config(gpt, {"regions": regions})
    tokens = torch.randint(128, (8, 33))
    return StagedModel(gpt_stages(gpt, 2), (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous(), lm_loss,
                       model=gpt if whole else None)


@functools.cache
def _planner() -> PipelinePlanner:
    return PipelinePlanner(build, pipeline=PIPELINE)


@functools.cache
def _plans() -> dict[str, Any]:
    return {budget: _planner().plan(budget) for budget in BUDGETS}


def measure_plans(regions: list[dict[str, str]]) -> list[int]:
    """On each rank: this rank's measured peak under each plan."""
    return [measure_this_rank(functools.partial(build, each), PIPELINE).peak_bytes for each in regions]


_LAUNCHED: dict[int, Any] = {}


def test_every_rank_fits_each_budget_measured_on_real_ranks(tmp_path: Path) -> None:
    plans = _plans()
    saved = []
    for budget, plan in plans.items():
        path = plan.save(tmp_path / f"{budget.rstrip('%')}.toml")
        saved.append(dict(remat.config_from_toml(path).regions or {}))
        assert saved[-1] == plan.regions
        assert all(rank.peak_bytes <= plan.budget_bytes for rank in plan.ranks), budget
    measured = launch_once(_LAUNCHED, 2, measure_plans, saved, timeout_s=600)
    for index, plan in enumerate(plans.values()):
        for rank in plan.ranks:
            assert measured[rank.rank][index] <= plan.budget_bytes
            assert abs(measured[rank.rank][index] - rank.peak_bytes) <= 0.03 * rank.peak_bytes


def test_the_first_stage_checkpoints_the_most_and_smaller_budgets_checkpoint_more() -> None:
    plans = list(_plans().values())
    for plan in plans:
        work = [2 * rank.full_blocks + rank.selective_blocks for rank in plan.ranks]
        assert work == sorted(work, reverse=True), plan.report()  # 1F1B: rank 0 holds the most
    totals = [sum(2 * r.full_blocks + r.selective_blocks for r in plan.ranks) for plan in plans]
    assert totals == sorted(totals) and totals[-1] > totals[0]
    assert all(plan.peak_bytes <= plan.budget_bytes for plan in plans)


def test_an_unreachable_budget_names_the_smallest_peak() -> None:
    with pytest.raises(InfeasibleBudgetError) as caught:
        _planner().plan(1 << 20)
    plans = _plans()
    assert caught.value.min_peak_bytes > 1 << 20
    assert caught.value.min_peak_bytes <= min(plan.peak_bytes for plan in plans.values())


def test_a_build_without_the_whole_model_is_refused() -> None:
    with pytest.raises(CheckpointUsageError, match="needs model="):
        plan_pipeline(functools.partial(build, whole=False), pipeline=PIPELINE, budget="80%")
