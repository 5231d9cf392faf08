"""Every choice of Llama-3.1-8B's pipeline ranks simulated in full, for the rounds test.

``tests/planner/test_pipeline_rounds.py`` replays the pipeline planner's rounds against
this table.

The plan (``remat plan --pipeline``) simulates only the few choices its rounds try
(``docs/design/planner.md``, "Predicting the next try"). This script simulates all of
them: for each of the 4 ranks (1F1B, 4 microbatches, each stage FSDP2 x 2 in bf16, seq
8192, batch 4) every count of fully and selectively checkpointed blocks among its 8
(45 choices), on fake tensors, with the planner's modelled clock (h100 rates), and
writes each rank's menu (the choices fastest first with their interpolated peaks, as the
planner ranks them) and every simulated (peak bytes, step seconds). 180 simulations:
about 16 minutes on a 2-core machine (both cores).

    .venv/bin/python tests/planner/data/make_pipeline_rounds_table.py               # the test's table
    .venv/bin/python tests/planner/data/make_pipeline_rounds_table.py --out t.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "src"))

from remat.cli.loader import ModelRequest  # noqa: E402
from remat.cli.pipelined import PipelineCase  # noqa: E402
from remat.memory import Pipeline  # noqa: E402
from remat.planner import PipelinePlanner  # noqa: E402
from remat.planner.pipeline import _regions  # noqa: E402

TABLE = HERE / "llama-3.1-8b-pipeline-rounds.json"
ABOUT = (
    "Llama-3.1-8B (benchmarks/configs/llama-3.1-8b.json), 1F1B, 4 ranks x 1 stage, 4 microbatches, "
    "each stage FSDP2 x 2, bf16, seq 8192, batch 4: every rank's menu (choices fastest first, as "
    "(full, selective, interpolated peak bytes, interpolated step seconds)) and every choice simulated in full (peak bytes, "
    "modelled step seconds); written by tests/planner/data/make_pipeline_rounds_table.py."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TABLE, help="where to write the table (default: the test's)")
    args = parser.parse_args()
    request = ModelRequest(command="benchmark", hf_config=str(REPO / "benchmarks" / "configs" / "llama-3.1-8b.json"),
                           batch=4, seq=8192)
    pipeline = Pipeline(ranks=4, schedule="1F1B", microbatches=4, data_parallel=2, mixed_precision="bf16")
    case = PipelineCase(request, "none", pipeline)
    planner = PipelinePlanner(case.build, pipeline=pipeline)
    started = time.perf_counter()
    blocks = planner.blocks()
    planner.corners()
    menus = [planner._menu(planner._row(rank), len(paths)) for rank, paths in enumerate(blocks)]
    kept = (0, 0, "keep")
    tries = [(rank, (full, selective, "keep")) for rank, paths in enumerate(blocks)
             for full in range(len(paths) + 1) for selective in range(len(paths) + 1 - full)]
    jobs = [(rank, _regions(blocks, [choice if other == rank else kept for other in range(pipeline.ranks)],
                            planner.selective), None) for rank, choice in tries]
    results = dict(zip(tries, planner._simulate_jobs(jobs), strict=True))
    table = {"about": ABOUT, "ranks": [
        {"menu": [[full, selective, peak, step_s] for (full, selective, _), peak, step_s in menus[rank]],
         "simulated": [[full, selective, *results[rank, (full, selective, "keep")]]
                       for (other, (full, selective, _)) in tries if other == rank]}
        for rank in range(pipeline.ranks)
    ]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, separators=(",", ":")) + "\n")
    print(f"{len(tries)} simulations in {time.perf_counter() - started:.0f} s: {args.out}")
    for rank in range(pipeline.ranks):
        fits = {budget: min((step_s, choice) for (other, choice), (peak, step_s) in results.items()
                            if other == rank and peak <= budget * 2**30) for budget in (40, 45)}
        print(f"rank {rank}: fastest fitting at 40 GiB {fits[40][1][:2]}, at 45 GiB {fits[45][1][:2]}")


if __name__ == "__main__":
    main()
