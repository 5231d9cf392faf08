"""Estimated compiled plans against measured ones: `remat plan --compile --estimate here --measure`.

    python benchmarks/static_plans.py                 # 5 models x 3 budgets, blocks compiled
    python benchmarks/static_plans.py --quick         # the embedded GPT, 2 budgets
    python benchmarks/static_plans.py --models gpt llama --budgets 90% 70%

Each row is one run of the command, as users run it: the estimated planner
(each option's compiled step estimated on fake tensors, times from the time
model at this machine's measured rates) plans under the budget (a percentage
of the estimated unchecked compiled peak); the measured planner (every
option compiled, run and timed here) plans under the same bytes; both plans
are applied to copies of the real model, compiled and run side by side
(interleaved steps): does the estimated plan fit when run, and its step time
over the measured plan's (median of the per-round ratios).

Models: the embedded GPT and the four HF causal LMs of
``benchmarks/static_compiled.py`` (local configs, nothing downloaded; needs
``pip install remat[hf]``). CPU, float32, torch 2.13+ (the compiler's
per-region budgets are among the options).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from command import run_remat  # this folder
from static_compiled import model_arguments  # this folder


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    fraction: float
    budget_bytes: int
    estimated: str
    measured: str
    estimated_peak: int
    measured_peak: int
    time_ratio: float
    estimated_ms: float
    measured_ms: float

    @property
    def fits(self) -> bool:
        return self.estimated_peak <= self.budget_bytes


def _summary(decisions: list[str]) -> str:
    counts = Counter(name.replace("checkpoint:", "") for name in decisions)
    return " ".join(f"{name}x{n}" for name, n in sorted(counts.items()))


def row_for(name: str, model: list[str], budget: str, steps: int) -> Row:
    _, result = run_remat(
        "plan", *model, "--batch", "4", "--seq", "128", "--compile", "--estimate", "here", "--measure",
        "--budget", budget, "--steps", str(steps), "--repeats", "1",
    )
    estimated, measured, run = result["estimated"], result["measured"], result["run"]
    return Row(
        name, float(budget.rstrip("%")) / 100, estimated["budget_bytes"], _summary(estimated["decisions"]),
        _summary(measured["decisions"]), run["estimated"]["peak_bytes"], run["measured"]["peak_bytes"],
        result["step_time_ratio"], 1e3 * run["estimated"]["step_s"], 1e3 * run["measured"]["step_s"],
    )


def render(rows: list[Row]) -> str:
    lines = [
        f"{'model':9} {'budget':>6} {'estimated plan':34} {'measured plan':34} {'est. peak/budget':>16} "
        f"{'fits':>4} {'time ratio':>10} {'est. ms':>8} {'meas. ms':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r.model:9} {r.fraction:>6.2f} {r.estimated:34} {r.measured:34} "
            f"{r.estimated_peak / r.budget_bytes:>16.3f} {'yes' if r.fits else 'NO':>4} {r.time_ratio:>10.3f} "
            f"{r.estimated_ms:>8.1f} {r.measured_ms:>8.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="the embedded GPT, two budgets")
    parser.add_argument("--models", nargs="*", default=None, help="gpt llama gpt2 gpt_neox gemma")
    parser.add_argument("--budgets", nargs="*", default=None, help="default 90%% 75%% 60%%")
    parser.add_argument("--steps", type=int, default=30, help="interleaved timed steps per plan")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    names = args.models or (["gpt"] if args.quick else ["gpt", "llama", "gpt2", "gpt_neox", "gemma"])
    budgets = args.budgets or (["90%", "70%"] if args.quick else ["90%", "75%", "60%"])
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as folder:
        for name, model in model_arguments(names, Path(folder)).items():
            if name == "gpt":  # remat plan shapes its GPT by width and depth (4 heads, d_ff = 4 x width)
                model = ["--layers", "3", "--d-model", "128"]
            for budget in budgets:
                rows.append(row_for(name, model, budget, args.steps))
                print(render(rows[-1:]).splitlines()[1], flush=True)
    print()
    print(render(rows))
    if rows:
        ratios = [r.time_ratio for r in rows]
        print(f"\nfit when run: {sum(r.fits for r in rows)}/{len(rows)}; step time estimated/measured plan: "
              f"median {statistics.median(ratios):.3f}, worst {max(ratios):.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
