"""Every pipeline rank's estimated peak beside the same step measured on gloo processes.

For each schedule of ``torch.distributed.pipelining`` this torch has, at 2 and 4 pipeline
ranks and with each stage sharded by FSDP2 over 2 ranks (2 x 2): the embedded GPT fully
checkpointed by remat and a Hugging Face Llama under remat's save_matmuls policy (both
cut with ``remat.models``), estimated in this process (``remat.memory.estimate_pipeline_step``,
fake tensors, simulated ranks) and measured (``measure_this_rank`` on every rank of one
launch per world size, the same tracker on real tensors). Prints one row per cell and rank,
the estimate's time, and the largest error.

    .venv/bin/python benchmarks/pipeline_estimate.py           # every schedule
    .venv/bin/python benchmarks/pipeline_estimate.py --quick   # GPipe, 1F1B, Interleaved1F1B, ZBV; GPT only
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import remat  # noqa: E402
from remat import policies  # noqa: E402
from remat._compat.pipelining import schedule_class  # noqa: E402
from remat.launch import run_on_ranks  # noqa: E402
from remat.memory import (  # noqa: E402
    PIPELINE_SCHEDULES,
    Pipeline,
    StagedModel,
    estimate_pipeline_step,
    format_bytes,
    measure_this_rank,
)
from remat.models import GPT, GPTConfig, gpt_stages, llama_stages, lm_loss  # noqa: E402

VOCAB, SEQ, ROWS = 128, 64, 2


def _run(policy: Any, block: torch.nn.Module, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    out = remat.checkpoint(block, hidden, policy=policy, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def build(model: str, n_stages: int, microbatches: int) -> StagedModel:
    torch.manual_seed(0)
    tokens = torch.randint(VOCAB, (ROWS * microbatches, SEQ + 1))
    inputs, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if model == "llama":
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=n_stages,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
            attn_implementation="sdpa",
        )
        llama = transformers.LlamaForCausalLM(config).train()
        stages = llama_stages(llama, n_stages, run_block=functools.partial(_run, policies.save_matmuls))
        return StagedModel(stages, (inputs,), target, lm_loss, model=llama)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=64, n_heads=2, n_layers=n_stages, d_ff=256))
    return StagedModel(gpt_stages(gpt, n_stages, run_block=functools.partial(_run, None)), (inputs,), target,
                       lm_loss, model=gpt)


def _cells(quick: bool) -> list[tuple[str, Pipeline]]:
    schedules = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble") if quick else PIPELINE_SCHEDULES
    models = ("gpt",) if quick else ("gpt", "llama")
    cells = []
    for ranks, data_parallel in ((2, 1), (4, 1), (2, 2)):
        for schedule in schedules:
            if schedule_class(f"Schedule{schedule}") is None:
                continue
            microbatches = 8 if ranks == 4 else 4
            cells += [(model, Pipeline(ranks=ranks, schedule=schedule, microbatches=microbatches,
                                       data_parallel=data_parallel)) for model in models]
    return cells


def measure_all(cells: list[tuple[str, Pipeline]]) -> list[int]:
    """On each rank: its measured peak in every cell."""
    return [measure_this_rank(functools.partial(build, model, p.n_stages, p.microbatches), p).peak_bytes
            for model, p in cells]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cells = _cells(args.quick)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    measured: dict[int, list[list[int]]] = {}
    for world in sorted({p.world_size for _, p in cells}):
        mine = [cell for cell in cells if cell[1].world_size == world]
        measured[world] = run_on_ranks(world, "pipeline_estimate:measure_all", mine, timeout_s=3000)
    print(f"torch {torch.__version__}; estimated in this process, measured on gloo CPU processes")
    print("| model | pipeline | rank | estimated | measured | error | estimate s |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for model, pipeline in cells:
        start = time.perf_counter()
        reports = estimate_pipeline_step(functools.partial(build, model, pipeline.n_stages, pipeline.microbatches),
                                         pipeline=pipeline)
        elapsed = time.perf_counter() - start
        mine = [cell for cell in cells if cell[1].world_size == pipeline.world_size]
        column = mine.index((model, pipeline))
        for rank, report in enumerate(reports):
            real = measured[pipeline.world_size][rank * pipeline.data_parallel][column]
            error = (report.peak_bytes - real) / real
            worst = max(worst, abs(error))
            print(f"| {model} | {pipeline.describe()} | {rank} | {format_bytes(report.peak_bytes)} | "
                  f"{format_bytes(real)} | {100 * error:+.2f}% | {elapsed:.1f} |")
    print(f"largest error: {100 * worst:.2f}% over {len(cells)} cells")


if __name__ == "__main__":
    main()
