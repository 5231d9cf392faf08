"""Per-stage plans for pipelined training against the best uniform hand strategy, at three budgets.

For each budget (a fraction of the largest rank's unchecked peak), two ways to
checkpoint the embedded GPT cut into pipeline stages:

* remat's plan (``remat.planner.PipelinePlanner``): each rank its own count
  of fully and selectively (save_matmuls) checkpointed blocks, chosen from
  ranks simulated on fake tensors with times modelled at rates measured
  on this machine;
* the best uniform hand strategy: the same count on every stage (as
  Megatron's ``recompute_num_layers`` sets it), the least checkpointing
  whose simulated peak fits every rank (where the backward splits, with
  either weight pass, the same on every stage).

Under a split-backward schedule (``--schedule ZBVZeroBubble``) the plan also
chooses each rank's weight pass (``+W`` in the table: it recomputes for the
weight pass).

Both run on gloo CPU processes, one per rank, steps interleaved (plan after
plan, round after round) in one process per rank: per budget, every rank's
measured peak (``remat.memory.measure_this_rank``'s tracker) and the step
time (the slowest rank's, median over rounds) with its ratio to the uniform
strategy (median of per-round ratios).

    .venv/bin/python benchmarks/pipeline_plans.py            # 4 ranks, 1F1B, 9 rounds
    .venv/bin/python benchmarks/pipeline_plans.py --quick    # 2 ranks, 3 rounds, a smaller model
    .venv/bin/python benchmarks/pipeline_plans.py --ranks 2 --schedule ZBVZeroBubble
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import remat  # noqa: E402
from remat.launch import run_on_ranks  # noqa: E402
from remat.memory import (  # noqa: E402
    Pipeline,
    StagedModel,
    estimate_pipeline_step,
    format_bytes,
    measure_this_rank,
)
from remat.models import GPT, GPTConfig, gpt_stages, lm_loss  # noqa: E402
from remat.planner import PipelinePlanner  # noqa: E402
from remat.planner.timing import DeviceRates  # noqa: E402

BUDGET_POINTS = (0.75, 0.45, 0.15)
"""The budgets: these fractions of the way from the lowest reachable peak (every block fully
checkpointed) to the unchecked one, on the largest rank."""
SELECTIVE = "checkpoint:save_matmuls"


def _config(quick: bool) -> GPTConfig:
    if quick:
        return GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=4, d_ff=256)
    return GPTConfig(vocab_size=512, seq_len=256, d_model=128, n_heads=4, n_layers=8, d_ff=512)


def build(quick: bool, n_stages: int, rows: int, regions: tuple[tuple[str, str], ...] = ()) -> StagedModel:
    """The GPT cut into stages, ``regions`` applied as a saved plan would be."""
    torch.manual_seed(0)
    config = _config(quick)
    gpt = GPT(config).train()
    if regions:
        remat.apply_config(gpt, {"regions": dict(regions)})
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(config.vocab_size, (rows, config.seq_len + 1), generator=generator)
    return StagedModel(gpt_stages(gpt, n_stages), (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous(),
                       lm_loss, model=gpt)


def _uniform(blocks: list[list[str]], full: int, selective: int, weight_pass: str) -> tuple[tuple[str, str], ...]:
    suffix = "" if weight_pass == "keep" else f"+weight_pass:{weight_pass}"
    regions = []
    for paths in blocks:
        for index, path in enumerate(paths):
            option = "checkpoint" + suffix if index < full else SELECTIVE + suffix if index < full + selective else "keep"
            regions.append((path, option))
    return tuple(regions)


def rank_main(payload: tuple[bool, Pipeline, int, list[tuple[tuple[str, str], ...]], int]) -> dict[str, Any]:
    """On each rank: every strategy's measured peak, then interleaved timed steps."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    quick, pipeline, rows, strategies, rounds = payload
    rank = dist.get_rank()
    peaks = [measure_this_rank(functools.partial(build, quick, pipeline.n_stages, rows, s), pipeline).peak_bytes
             for s in strategies]
    runs = []
    for regions in strategies:
        staged = build(quick, pipeline.n_stages, rows, regions)
        mine = pipeline.stage_indices(rank)
        examples, hidden = {}, staged.inputs[0].chunk(pipeline.microbatches)[0]
        with torch.no_grad():
            for index, stage in enumerate(staged.stages):
                examples[index] = hidden
                hidden = stage(hidden)
        stages = [PipelineStage(staged.stages[i], i, pipeline.n_stages, torch.device("cpu"),
                                input_args=(examples[i],)) for i in mine]
        cls = pipeline.schedule_class
        multi = len(mine) > 1
        schedule = cls(stages if multi else stages[0], n_microbatches=pipeline.microbatches, loss_fn=lm_loss)
        params = [p for i in mine for p in staged.stages[i].parameters()]
        runs.append((schedule, staged, mine, params))

    def step(run: Any) -> float:
        schedule, staged, mine, params = run
        for parameter in params:
            parameter.grad = None
        dist.barrier()
        start = time.perf_counter()
        args = staged.inputs if 0 in mine else ()
        kwargs = {"target": staged.target} if pipeline.n_stages - 1 in mine else {}
        schedule.step(*args, **kwargs)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the pipeline's step: its slowest rank
        return float(elapsed)

    for run in runs:
        step(run)  # warm-up, shapes
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(rounds):
        # Every other round in reverse: run in one fixed order, the plan (always first of its
        # pair) read 3% slower than the same strategy run as the uniform one (ZBV, 91%).
        order = list(enumerate(runs))
        for index, run in order if round_ % 2 == 0 else reversed(order):
            times[index].append(step(run))
    return {"peaks": peaks, "times": times}


def _counts(rank: Any) -> str:
    """``full/selective`` blocks of a rank's plan, ``+W`` where its weight pass recomputes."""
    return f"{rank.full_blocks}/{rank.selective_blocks}{'+W' if rank.weight_pass == 'recompute' else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    ranks = args.ranks or (2 if args.quick else 4)
    rounds = args.rounds or (3 if args.quick else 9)
    pipeline = Pipeline(ranks=ranks, schedule=args.schedule, microbatches=2 * ranks)
    rows = 2 * pipeline.microbatches
    make = functools.partial(build, args.quick, pipeline.n_stages, rows)

    start = time.perf_counter()
    planner = PipelinePlanner(make, pipeline=pipeline, rates=DeviceRates.measure("cpu"))
    uniform = planner.uniform()
    # The lowest reachable peak: every block fully checkpointed, each rank with its better weight pass.
    lowest = max(min(uniform["checkpoint", weight_pass][rank][0] for weight_pass in planner.weight_passes)
                 for rank in range(ranks))
    highest = max(peak for peak, _ in uniform["keep", "keep"])
    budgets = [int(lowest + point * (highest - lowest)) for point in BUDGET_POINTS]
    plans = {f"{100 * budget / highest:.0f}%": planner.plan(budget) for budget in budgets}
    planned_s = time.perf_counter() - start
    blocks = planner.blocks()
    per_stage = len(blocks[0])
    uniform_peaks = {}  # the hand strategies, each weight pass where the schedule splits backward
    for weight_pass in planner.weight_passes:
        for full in range(per_stage + 1):
            for selective in range(per_stage + 1 - full):
                if weight_pass != "keep" and full + selective == 0:
                    continue
                regions = _uniform(blocks, full, selective, weight_pass)
                reports = estimate_pipeline_step(
                    functools.partial(build, args.quick, pipeline.n_stages, rows, regions), pipeline=pipeline)
                uniform_peaks[(full, selective, weight_pass)] = max(report.peak_bytes for report in reports)
    strategies: list[tuple[tuple[str, str], ...]] = []
    rows_out = []
    for budget, plan in plans.items():
        # The least recomputation that fits: fewest blocks (a full one counts twice), then
        # the weight pass that does not recompute again.
        fitting = [(2 * f + s, w != "keep", peak, (f, s, w)) for (f, s, w), peak in uniform_peaks.items()
                   if peak <= plan.budget_bytes]
        if not fitting:
            print(f"budget {budget}: no uniform strategy fits; the plan's peaks "
                  f"{[format_bytes(r.peak_bytes) for r in plan.ranks]} are not measured against one")
            continue
        chosen = min(fitting)[3]
        strategies += [tuple(plan.regions.items()), _uniform(blocks, *chosen)]
        rows_out.append((budget, plan, chosen))

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    per_rank = run_on_ranks(ranks, "pipeline_plans:rank_main", (args.quick, pipeline, rows, strategies, rounds),
                            timeout_s=3000)
    config = _config(args.quick)
    print(f"embedded GPT ({config.n_layers} blocks, d_model {config.d_model}, seq {config.seq_len}), "
          f"{pipeline.describe()}, {rows} sequences a step, CPU ranks (gloo), torch {torch.__version__}; "
          f"three plans in {planned_s:.1f} s; medians of {rounds} interleaved rounds")
    print("| budget | strategy | full / selective blocks by rank | measured peak by rank | fits | step ms | vs uniform |")
    print("|---|---|---|---|---|---|---|")
    times = per_rank[0]["times"]  # every rank has the slowest rank's time
    for index, (budget, plan, (full, selective, weight_pass)) in enumerate(rows_out):
        for offset, name in enumerate(("remat plan", "uniform")):
            column = 2 * index + offset
            peaks = [result["peaks"][column] for result in per_rank]
            counts = (" ".join(_counts(r) for r in plan.ranks) if offset == 0
                      else " ".join(f"{full}/{selective}{'+W' if weight_pass != 'keep' else ''}" for _ in range(ranks)))
            ratio = statistics.median(a / b for a, b in zip(times[column], times[2 * index + 1], strict=True))
            print(f"| {budget} ({format_bytes(plan.budget_bytes)}) | {name} | {counts} | "
                  f"{' '.join(format_bytes(p) for p in peaks)} | "
                  f"{'yes' if max(peaks) <= plan.budget_bytes else 'NO'} | "
                  f"{1e3 * statistics.median(times[column]):.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
