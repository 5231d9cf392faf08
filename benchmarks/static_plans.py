"""Estimated compiled plans against measured ones: `remat plan --compile --estimate` on the same models.

    python benchmarks/static_plans.py                 # 5 models x 3 budgets, blocks compiled
    python benchmarks/static_plans.py --quick         # the embedded GPT, 2 budgets
    python benchmarks/static_plans.py --models gpt llama --fractions 0.9 0.7

For each model, in one process: the estimated planner (``remat.plan(...,
compile=True, estimate=DeviceRates.measure())``: each option's compiled step
estimated on fake tensors, times from the time model at this machine's
measured rates) and the measured planner (every option compiled, run and
timed here) each profile once; then for each budget (a fraction of the
measured unchecked compiled peak, in bytes, the same for both) each plans,
both plans are applied to copies of the real model, compiled, and run side
by side (interleaved steps): does the estimated plan fit when run, and its
step time over the measured plan's (median of the per-round ratios).

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
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from remat._compat import fake_tensor_mode
from remat.cli.loader import ModelRequest, load_model
from remat.cli.plan import run_side_by_side, user_model
from remat.errors import InfeasibleBudgetError
from remat.models import GPTConfig
from remat.planner import DeviceRates, Plan, Planner
from static_compiled import HF_CONFIGS  # this folder

GPT = GPTConfig(n_layers=3, d_model=128, n_heads=4, d_ff=512, vocab_size=512, seq_len=128)


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


def _summary(plan: Plan) -> str:
    counts = Counter(d.option.name.replace("checkpoint:", "") for d in plan.decisions)
    return " ".join(f"{name}x{n}" for name, n in sorted(counts.items()))


def _request(name: str, folder: Path) -> ModelRequest:
    if name == "gpt":
        return ModelRequest(command="benchmark", batch=4, seq=128, gpt=GPT)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(HF_CONFIGS[name]))
    return ModelRequest(command="benchmark", hf_config=path, batch=4, seq=128)


def rows_for(name: str, request: ModelRequest, fractions: list[float], rates: DeviceRates, steps: int) -> list[Row]:
    fake = fake_tensor_mode()
    with fake:
        fake_model, fake_inputs, fake_loss = user_model(load_model(dataclasses.replace(request, device="fake")))
        estimated = Planner(fake_model, loss_fn=fake_loss, compile=True, estimate=rates)
        started = time.perf_counter()
        estimated.profile(fake_inputs)
        estimate_s = time.perf_counter() - started
    model, inputs, loss_fn = user_model(load_model(request))
    measured = Planner(model, loss_fn=loss_fn, compile=True, repeats=1)
    started = time.perf_counter()
    unchecked = measured.profile(inputs).unchecked_peak_bytes
    measure_s = time.perf_counter() - started
    print(f"# {name}: estimated profile {estimate_s:.0f} s, measured profile {measure_s:.0f} s", flush=True)
    rows = []
    for fraction in fractions:
        budget = int(fraction * unchecked)
        try:
            with fake:
                mine = estimated.plan(fake_inputs, budget=budget)
            theirs = measured.plan(inputs, budget=budget)
        except InfeasibleBudgetError as error:
            print(f"# {name} {fraction:.2f}: {error}")
            continue
        peaks, times = run_side_by_side({"estimated": mine, "measured": theirs}, model, inputs, loss_fn, steps)
        ratio = statistics.median(e / m for e, m in zip(times["estimated"], times["measured"], strict=True))
        rows.append(Row(
            name, fraction, budget, _summary(mine), _summary(theirs), peaks["estimated"], peaks["measured"],
            ratio, 1e3 * statistics.median(times["estimated"]), 1e3 * statistics.median(times["measured"]),
        ))
        print(render(rows[-1:]).splitlines()[1], flush=True)
    return rows


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
    parser.add_argument("--fractions", nargs="*", type=float, default=None, help="default 0.9 0.75 0.6")
    parser.add_argument("--steps", type=int, default=20, help="interleaved timed steps per plan")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    names = args.models or (["gpt"] if args.quick else ["gpt", "llama", "gpt2", "gpt_neox", "gemma"])
    fractions = args.fractions or ([0.9, 0.7] if args.quick else [0.9, 0.75, 0.6])
    rates = DeviceRates.measure()
    print(f"# rates: {rates.describe()}")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            rows += rows_for(name, _request(name, Path(folder)), fractions, rates, args.steps)
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
