"""Plans with compression allowed against plans without, on the embedded GPT and a HF Llama.

One profile per model (``compress=("bf16", "fp8", "int8")``, every option's
bytes, time and per-region gradient error measured), then at four budgets
between checkpointing every block and keeping everything:

* ``exact``: the fastest plan of exact options (``max_gradient_error=0``,
  the plan without compression, from the same profile);
* ``compress``: the fastest plan within ``--max-error`` (default 0.02).

Columns: the decisions, predicted and measured peak, predicted step time and
measured step time (medians of interleaved steps, both plans applied in
turn), predicted and measured gradient error.

    .venv/bin/python benchmarks/compression_planner.py [--max-error 0.02] [--rounds 7] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from compression import llama_and_tokens  # this folder: the same Llama config
from remat.models import GPT, GPTConfig, lm_loss, make_batch
from remat.planner import Planner
from remat.planner.cost import chain_problem, peak_bytes
from remat.planner.step import run_step


def gpt_case(quick: bool) -> tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]:
    config = GPTConfig(n_layers=4 if quick else 6, seq_len=128 if quick else 256, d_model=128, n_heads=4, d_ff=512)
    torch.manual_seed(0)
    model = GPT(config)
    idx, targets = make_batch(config, 4, torch.Generator().manual_seed(0))
    return model, (idx,), lambda logits: lm_loss(logits, targets)


def llama_case(quick: bool) -> tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]:
    model, tokens = llama_and_tokens(4 if quick else 6, quick)
    return model, (tokens[:, :-1],), lambda output: nn.functional.cross_entropy(
        output.logits.flatten(0, 1), tokens[:, 1:].flatten()
    )


def short(decisions: Any) -> str:
    counts = collections.Counter(d.option.name for d in decisions)
    return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-error", type=float, default=0.02)
    parser.add_argument("--rounds", type=int, default=7, help="timed steps per plan, interleaved")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    # A CPU computes denormal floats on a slow path; flushing them keeps a run that
    # makes some (small weights, long training) from timing that path. On these
    # models it changes little (a GPT step with fp8 compression: 1.05x).
    torch.set_flush_denormal(True)
    cases = {"gpt": gpt_case, "llama": llama_case}
    rows = []
    for name in args.models.split(","):
        model, inputs, loss_fn = cases[name](args.quick)
        started = time.perf_counter()
        planner = Planner(model, loss_fn=loss_fn, repeats=2, compress=("bf16", "fp8", "int8"),
                          max_gradient_error=args.max_error)
        profile = planner.profile(inputs)
        problem = chain_problem(profile)
        full = peak_bytes(problem, (problem.options.index(next(o for o in problem.options if o.name == "checkpoint")),) * problem.size)
        high = profile.unchecked_peak_bytes
        print(f"{name}: profiled in {time.perf_counter() - started:.0f} s; checkpoint-all peak "
              f"{full / 2**20:.2f} MiB, unchecked {high / 2**20:.2f} MiB", flush=True)
        for fraction in (0.2, 0.4, 0.6, 0.8):
            budget = int(full + fraction * (high - full))
            plans = {"exact": planner.plan(inputs, budget=budget, max_gradient_error=0.0),
                     "compress": planner.plan(inputs, budget=budget)}
            measured: dict[str, list[float]] = {kind: [] for kind in plans}
            for round_ in range(args.rounds + 1):
                for kind, chosen in plans.items():
                    with chosen.apply(model):
                        model.zero_grad(set_to_none=True)
                        begin = time.perf_counter()
                        run_step(model, inputs, loss_fn)
                        if round_:
                            measured[kind].append(time.perf_counter() - begin)
            model.zero_grad(set_to_none=True)
            for kind, chosen in plans.items():
                row = {
                    "model": name, "budget_mib": budget / 2**20, "plan": kind, "decisions": short(chosen.decisions),
                    "predicted_peak_mib": chosen.predicted_peak_bytes / 2**20,
                    "measured_peak_mib": chosen.verify(model, inputs, loss_fn=loss_fn) / 2**20,
                    "predicted_step_ms": chosen.predicted_step_s * 1e3,
                    "measured_step_ms": statistics.median(measured[kind]) * 1e3,
                    "predicted_error": chosen.predicted_gradient_error,
                    "measured_error": chosen.measure_gradient_error(model, inputs, loss_fn=loss_fn),
                }
                rows.append(row)
                print(f"  budget {row['budget_mib']:7.2f} MiB  {kind:<8}  peak {row['predicted_peak_mib']:6.2f} / "
                      f"{row['measured_peak_mib']:6.2f} MiB  step {row['predicted_step_ms']:7.1f} / "
                      f"{row['measured_step_ms']:7.1f} ms  error {row['predicted_error']:.2e} / "
                      f"{row['measured_error']:.2e}  {row['decisions']}", flush=True)
            exact, compress = measured["exact"], measured["compress"]
            ratio = statistics.median(c / e for c, e in zip(compress, exact, strict=True))  # per interleaved round
            print(f"  -> compress / exact step time (median of per-round ratios): {ratio:.3f}x", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
