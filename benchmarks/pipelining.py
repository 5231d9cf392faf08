"""Full checkpointing inside pipeline stages under the zero-bubble schedules: remat beside torch.

Each rank (gloo, CPU processes) builds three copies of the embedded GPT cut
into stages (``remat.models.gpt_stages``), one per form: no checkpointing,
torch's full checkpoint (``torch.utils.checkpoint.checkpoint``, non-reentrant:
the one torch form that runs under these schedules) and remat's
(``remat.checkpoint``). Steps of ZBVZeroBubble and DualPipeV run interleaved
(form after form, round after round) in one process per rank. Per rank:
the median step time of each form and its ratio to no checkpointing (median
of the per-round ratios), the step's peak of live tensor bytes
(``remat.memory.track``, one tracked step: the counts are deterministic),
and each block's recomputations per microbatch.

    .venv/bin/python benchmarks/pipelining.py            # 2 ranks, 15 rounds
    .venv/bin/python benchmarks/pipelining.py --quick    # 3 rounds, a smaller model
"""

from __future__ import annotations

import argparse
import collections
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
from remat.memory import track  # noqa: E402
from remat.models import GPT, GPTConfig, gpt_stages, lm_loss  # noqa: E402

SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
FORMS = ("none", "torch", "remat")
MICROBATCHES = 4


def _runner(form: str) -> Any:
    if form == "none":
        return None

    def run(block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if form == "torch":
            return torch.utils.checkpoint.checkpoint(block, hidden, use_reentrant=False)  # type: ignore[no-any-return]
        return remat.checkpoint(block, hidden)

    return run


class _Pipeline:
    """One form's stages on this rank, its schedule, and a counter of recomputations."""

    def __init__(self, schedule: str, form: str, config: GPTConfig, rows: int) -> None:
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, schedules

        rank, world = dist.get_rank(), dist.get_world_size()
        n_stages = 2 * world
        mine = [rank, n_stages - 1 - rank]  # V-shaped: the first and the mirrored last stage
        torch.manual_seed(0)
        model = GPT(config).train()
        runner = _runner(form)
        stages = gpt_stages(model, n_stages, **({"run_block": runner} if runner else {}))
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(config.vocab_size, (rows * MICROBATCHES, config.seq_len + 1), generator=generator)
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        examples, hidden = {}, self.inputs[:rows]
        with torch.no_grad():
            for index, stage in enumerate(stages):
                examples[index] = hidden
                hidden = stage(hidden)
        self.group = dist.new_group(backend="gloo")
        self.pipeline = [
            PipelineStage(stages[i], i, n_stages, torch.device("cpu"), group=self.group, input_args=(examples[i],))
            for i in mine
        ]
        self.first, self.last = 0 in mine, n_stages - 1 in mine
        self.recomputes: collections.Counter[str] = collections.Counter()
        for i in mine:
            for offset, block in enumerate(stages[i].blocks):
                block.register_forward_pre_hook(self._counter(f"stage{i}.block{offset}"))
        self.schedule = getattr(schedules, schedule)(self.pipeline, n_microbatches=MICROBATCHES, loss_fn=lm_loss)
        self.parameters = [p for stage in self.pipeline for p in stage.submod.parameters()]

    def _counter(self, name: str) -> Any:
        def count(module: torch.nn.Module, args: Any) -> None:
            if torch._C._current_graph_task_id() != -1:  # a forward inside backward: a recomputation
                self.recomputes[name] += 1

        return count

    def step(self) -> float:
        import torch.distributed as dist

        for parameter in self.parameters:
            parameter.grad = None
        dist.barrier(self.group)
        start = time.perf_counter()
        args = (self.inputs,) if self.first else ()
        kwargs = {"target": self.targets} if self.last else {}
        self.schedule.step(*args, **kwargs)
        return time.perf_counter() - start


def rank_main(payload: tuple[int, bool]) -> dict[str, Any]:
    rounds, quick = payload
    from torch.distributed.pipelining import schedules

    config = (
        GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=8, d_ff=256)
        if quick
        else GPTConfig(vocab_size=512, seq_len=256, d_model=256, n_heads=4, n_layers=8, d_ff=1024)
    )
    rows = 2 if quick else 4
    results: dict[str, Any] = {}
    for schedule in SCHEDULES:
        if not hasattr(schedules, schedule):
            results[schedule] = f"torch {torch.__version__} has no {schedule}"
            continue
        pipelines = {form: _Pipeline(schedule, form, config, rows) for form in FORMS}
        peaks, recomputes = {}, {}
        for form, pipeline in pipelines.items():
            pipeline.step()  # warm-up (and torch's shape inference)
            pipeline.recomputes.clear()
            with track() as tracker:
                pipeline.step()
            peaks[form] = tracker.peak_bytes
            recomputes[form] = {k: v / MICROBATCHES for k, v in pipeline.recomputes.items()}
        times: dict[str, list[float]] = {form: [] for form in FORMS}
        for _ in range(rounds):
            for form, pipeline in pipelines.items():
                times[form].append(pipeline.step())
        results[schedule] = {"peaks": peaks, "times": times, "recomputes": recomputes}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 15)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    per_rank = run_on_ranks(args.world_size, "pipelining:rank_main", (rounds, args.quick), timeout_s=3000)
    print(f"embedded GPT, {2 * args.world_size} stages on {args.world_size} CPU ranks (gloo), "
          f"{MICROBATCHES} microbatches, torch {torch.__version__}; medians of {rounds} interleaved rounds")
    print("| schedule | rank | form | step ms | vs none | peak MiB | vs none | recomputes per block per microbatch |")
    print("|---|---|---|---|---|---|---|---|")
    for schedule in SCHEDULES:
        for rank, results in enumerate(per_rank):
            result = results[schedule]
            if isinstance(result, str):
                print(f"| {schedule.removeprefix('Schedule')} | {rank} | {result} | | | | | |")
                continue
            times, peaks = result["times"], result["peaks"]
            for form in FORMS:
                ratio = statistics.median(a / b for a, b in zip(times[form], times["none"], strict=True))
                counts = result["recomputes"][form]
                shown = f"{min(counts.values()):g}-{max(counts.values()):g}" if counts else "0"
                print(
                    f"| {schedule.removeprefix('Schedule')} | {rank} | {form} | "
                    f"{1e3 * statistics.median(times[form]):.1f} | {ratio:.3f} | {peaks[form] / 2**20:.2f} | "
                    f"{peaks[form] / peaks['none']:.3f} | {shown} |"
                )


if __name__ == "__main__":
    main()
