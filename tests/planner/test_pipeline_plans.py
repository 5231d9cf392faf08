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
from remat._compat.distributed import collectives_run_on_fake_tensors, sharding_api_available
from remat.errors import CheckpointUsageError, InfeasibleBudgetError
from remat.memory import Pipeline, StagedModel, estimate_pipeline_step, measure_this_rank
from remat.models import GPT, GPTConfig, gpt_stages, lm_loss
from remat.planner import PipelinePlanner, plan_pipeline

pytestmark = [
    pytest.mark.xdist_group("pipeline-memory"),
    pytest.mark.skipif(not collectives_run_on_fake_tensors(),
                       reason="simulated ranks run collectives on fake tensors: torch 2.11 and newer"),
]

PIPELINE = Pipeline(ranks=2, schedule="1F1B", microbatches=4)
BUDGETS = ("92%", "80%")  # checkpointing every block reaches 77% (parameters and Adam dominate)
# A zero-bubble schedule, where each rank also chooses its checkpoints' weight pass: at 80%
# rank 1 fits only if its weight pass recomputes (keeping the input pass's recomputation
# holds as much as no checkpointing there).
ZERO_BUBBLE = Pipeline(ranks=2, schedule="ZBVZeroBubble", microbatches=4)
ZERO_BUBBLE_BUDGET = "80%"


def _zero_bubble_runs() -> bool:
    # gloo runs the V schedules from torch 2.13 (docs/design/pipelining.md, "What is not covered").
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 13)


def build(
    regions: dict[str, str] | None = None, *, whole: bool = True, stages: int = 2, layers: int = 4
) -> StagedModel:
    """The GPT of ``layers`` blocks in ``stages`` stages; ``regions`` applied as a saved plan would be."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=2, n_layers=layers, d_ff=256))
    if regions is not None:
        remat.apply_config(gpt, {"regions": regions})
    tokens = torch.randint(128, (8, 33))
    return StagedModel(gpt_stages(gpt, stages), (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous(), lm_loss,
                       model=gpt if whole else None)


@functools.cache
def _planner(pipeline: Pipeline = PIPELINE) -> PipelinePlanner:
    return PipelinePlanner(functools.partial(build, stages=pipeline.n_stages), pipeline=pipeline)


@functools.cache
def _plans() -> dict[str, Any]:
    return {budget: _planner().plan(budget) for budget in BUDGETS}


def _all_plans() -> list[Any]:
    """The 1F1B plans, then the zero-bubble one where this torch runs it on gloo."""
    zero_bubble = [_planner(ZERO_BUBBLE).plan(ZERO_BUBBLE_BUDGET)] if _zero_bubble_runs() else []
    return [*_plans().values(), *zero_bubble]


def measure_plans(cases: list[tuple[Pipeline, dict[str, str]]]) -> list[int]:
    """On each rank: this rank's measured peak under each plan (on its pipeline)."""
    return [measure_this_rank(functools.partial(build, regions, stages=pipeline.n_stages), pipeline).peak_bytes
            for pipeline, regions in cases]


_LAUNCHED: dict[int, Any] = {}


def test_every_rank_fits_each_budget_measured_on_real_ranks(tmp_path: Path) -> None:
    plans = _all_plans()
    cases = []
    for index, plan in enumerate(plans):
        path = plan.save(tmp_path / f"{index}.toml")
        regions = dict(remat.config_from_toml(path).regions or {})
        assert regions == plan.regions
        assert all(rank.peak_bytes <= plan.budget_bytes for rank in plan.ranks), plan.report()
        cases.append((plan.pipeline, regions))
    measured = launch_once(_LAUNCHED, 2, measure_plans, cases, timeout_s=600)
    for index, plan in enumerate(plans):
        for rank in plan.ranks:
            assert measured[rank.rank][index] <= plan.budget_bytes
            assert abs(measured[rank.rank][index] - rank.peak_bytes) <= 0.03 * rank.peak_bytes


SHARDED = Pipeline(ranks=2, schedule="1F1B", microbatches=4, data_parallel=2)  # each stage on 2 FSDP2 ranks


def test_a_plan_for_fsdp_sharded_stages_fits_every_rank_measured() -> None:
    """Stages sharded by FSDP2 (a ("pp", "dp") mesh of 2 x 2 ranks): one plan per pipeline
    rank, the same on its data-parallel ranks, fits each of the four (measured)."""
    if not sharding_api_available():
        pytest.skip(f"FSDP2's public fully_shard is in torch 2.6 and newer; this is {torch.__version__}")
    plan = _planner(SHARDED).plan("90%")
    assert any(rank.full_blocks + rank.selective_blocks for rank in plan.ranks), plan.report()
    measured = launch_once(_LAUNCHED, 4, measure_plans, [(SHARDED, plan.regions)], timeout_s=600)
    for process, peaks in enumerate(measured):
        rank = plan.ranks[process // SHARDED.data_parallel]
        assert peaks[0] <= plan.budget_bytes
        assert abs(peaks[0] - rank.peak_bytes) <= 0.03 * rank.peak_bytes


def test_zero_bubble_plans_choose_each_ranks_weight_pass() -> None:
    if not _zero_bubble_runs():
        pytest.skip(f"gloo runs the V schedules from torch 2.13; this is {torch.__version__}")
    planner = _planner(ZERO_BUBBLE)
    plan = planner.plan(ZERO_BUBBLE_BUDGET)
    uniform = planner.uniform()
    # Some rank cannot fit with the input pass's recomputation kept for the weight pass,
    # even with every block fully checkpointed; the plan recomputes for the weight pass there.
    squeezed = [rank for rank in plan.ranks if uniform["checkpoint", "keep"][rank.rank][0] > plan.budget_bytes]
    assert squeezed, plan.report()
    assert all(rank.weight_pass == "recompute" for rank in squeezed)
    assert any(option.endswith("+weight_pass:recompute") for option in plan.regions.values())
    assert "weight pass" in plan.report()
    # Under 1F1B the backward is one pass: no rank has a weight-pass choice.
    assert _planner().weight_passes == ("keep",)
    assert all(rank.weight_pass == "keep" for each in _plans().values() for rank in each.ranks)


def test_the_first_stage_checkpoints_the_most_and_smaller_budgets_checkpoint_more() -> None:
    plans = list(_plans().values())
    for plan in plans:
        work = [2 * rank.full_blocks + rank.selective_blocks for rank in plan.ranks]
        assert work == sorted(work, reverse=True), plan.report()  # 1F1B: rank 0 holds the most
    totals = [sum(2 * r.full_blocks + r.selective_blocks for r in plan.ranks) for plan in plans]
    assert totals == sorted(totals) and totals[-1] > totals[0]
    assert all(plan.peak_bytes <= plan.budget_bytes for plan in plans)


def test_ranks_searched_on_forked_processes_plan_what_one_process_does() -> None:
    """The plan runs on a pool of forked processes (each rank's next try as soon as its own
    last result is in, docs/design/planner.md, "Ranks in parallel"): the same plan, figure
    for figure, as every simulation in this process (the suite's default)."""
    forked = PipelinePlanner(functools.partial(build, stages=2), pipeline=PIPELINE, processes=2)
    assert forked.plan("80%") == _plans()["80%"]
    assert forked.corners() == _planner().corners()


def test_a_plan_after_the_uniform_corners_simulates_only_its_tries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the corners are uniform()'s (short stages), a plan made after uniform() simulates
    only its searches' tries: the same plan as a fresh planner's, three simulations fewer
    per rank (every block kept, selective, full)."""
    counted: list[int] = []
    simulate_one = PipelinePlanner._simulate_one

    def counting(self: PipelinePlanner, *job: Any) -> tuple[int, float]:
        counted.append(job[0])
        return simulate_one(self, *job)

    monkeypatch.setattr(PipelinePlanner, "_simulate_one", counting)
    fresh = PipelinePlanner(functools.partial(build, stages=2), pipeline=PIPELINE)
    plan = fresh.plan("80%")
    fresh_count = len(counted)
    warm = PipelinePlanner(functools.partial(build, stages=2), pipeline=PIPELINE)
    assert warm.uniform() == fresh.uniform()
    counted.clear()
    assert warm.plan("80%") == plan
    assert len(counted) == fresh_count - 3 * PIPELINE.ranks


def test_an_unreachable_budget_names_the_smallest_peak() -> None:
    with pytest.raises(InfeasibleBudgetError) as caught:
        _planner().plan(1 << 20)
    plans = _plans()
    assert caught.value.min_peak_bytes > 1 << 20
    assert caught.value.min_peak_bytes <= min(plan.peak_bytes for plan in plans.values())


def test_a_build_without_the_whole_model_is_refused() -> None:
    with pytest.raises(CheckpointUsageError, match="needs model="):
        plan_pipeline(functools.partial(build, whole=False), pipeline=PIPELINE, budget="80%")


def test_long_stages_are_priced_on_a_sample_and_the_plan_simulated_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stages of 4 alike blocks: the options' corners come from stages cut to 1 and 2
    blocks (extended to 4), close to the corners simulated in full; every figure of the
    plan is a simulation of the whole stages (docs/design/planner.md, "Pipelined plans").
    An unreachable budget first: the smallest reachable peak comes from the frugal choices
    each unfit rank's search simulated, not from simulating every rank's uniform choices in
    full again (Llama-3.1-8B in 4 stages took 106 s so), and it is the peak they reach."""
    make = functools.partial(build, layers=8)
    planner = PipelinePlanner(make, pipeline=PIPELINE)

    def no_uniform(self: PipelinePlanner) -> Any:
        pytest.fail("the unreachable budget simulated the uniform corners in full")

    with monkeypatch.context() as patched:
        patched.setattr(PipelinePlanner, "uniform", no_uniform)
        with pytest.raises(InfeasibleBudgetError) as unreachable:
            planner.plan(1 << 20)
    plan = planner.plan("80%")
    corners, uniform = planner.corners(), planner.uniform()
    assert unreachable.value.min_peak_bytes == max(peak for peak, _ in uniform["checkpoint", "keep"])
    assert corners is not uniform and corners["keep", "keep"] == uniform["keep", "keep"]
    for rank in range(PIPELINE.ranks):
        span = uniform["keep", "keep"][rank][0] - uniform["checkpoint", "keep"][rank][0]
        for option in ("checkpoint", "checkpoint:save_matmuls"):
            assert abs(corners[option, "keep"][rank][0] - uniform[option, "keep"][rank][0]) <= 0.05 * span
    reports = estimate_pipeline_step(functools.partial(make, plan.regions), pipeline=PIPELINE)
    assert [report.peak_bytes for report in reports] == [rank.peak_bytes for rank in plan.ranks]
    assert plan.peak_bytes <= plan.budget_bytes
    assert any(rank.full_blocks + rank.selective_blocks for rank in plan.ranks), plan.report()
    with pytest.raises(InfeasibleBudgetError):
        planner.plan(1 << 20)
