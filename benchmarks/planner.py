"""Planner benchmark: budgets of 30/50/70% on GPT, an MLP chain and a conv net.

For each model and budget: the plan's predicted and measured peak (tracker),
measured step time, and the best hand strategy that fits the same budget
(checkpoint every block, every other block, save_matmuls everywhere);
plus exhaustive-optimum checks on small chains and the 96-block solve time.

    python benchmarks/planner.py            # prints a table
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from remat._demo import GPT, ConvNet, GPTConfig, MLPChain, lm_loss, make_batch
from remat.memory import track
from remat.planner import Planner
from remat.planner.apply import install
from remat.planner.model import CHECKPOINT, KEEP, SAVE_MATMULS, ChainProblem
from remat.planner.profile import default_loss, find_candidates, run_step
from remat.planner.solvers import min_reachable_peak, solve, solve_enumerate


def install_all(model, options):  # type: ignore[no-untyped-def]
    blocks = [m for _, m in find_candidates(model)]
    return [install(b, o) for b, o in zip(blocks, options, strict=True)]


def peak_of(model, inputs, loss_fn, options) -> int:  # type: ignore[no-untyped-def]
    removers = install_all(model, options)
    try:
        model.zero_grad(set_to_none=True)
        with track() as tracker:
            run_step(model, inputs, loss_fn)
    finally:
        for remove in removers:
            remove()
    return tracker.peak_bytes


def step_times(model, inputs, loss_fn, strategies, rounds):  # type: ignore[no-untyped-def]
    """Median step time per strategy; strategies take turns (rotating) so load drift hits all."""
    names = list(strategies)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            removers = install_all(model, strategies[name])
            try:
                model.zero_grad(set_to_none=True)
                started = time.perf_counter()
                run_step(model, inputs, loss_fn)
                times[name].append(time.perf_counter() - started)
            finally:
                for remove in removers:
                    remove()
    return {name: statistics.median(values) for name, values in times.items()}


def models():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    config = GPTConfig(n_layers=12, d_model=64, n_heads=4, d_ff=256, seq_len=128, vocab_size=128)
    idx, targets = make_batch(config, 4, torch.Generator().manual_seed(0))
    yield "gpt-12", GPT(config), (idx,), lambda logits: lm_loss(logits, targets)
    widths = (64, *(128, 64) * 8)
    yield "mlp-16", MLPChain(widths=widths), (torch.randn(2048, 64),), default_loss
    yield "conv-24", ConvNet(channels=(8, 16, 32), blocks_per_stage=8), (torch.randn(8, 3, 48, 48),), default_loss


def main(rounds: int = 11) -> None:
    print(f"{'model':8} {'budget':>6} {'pred MiB':>9} {'meas MiB':>9} {'err':>6} {'fits':>5} "
          f"{'pred ms':>8} {'plan ms':>8} {'best hand that fits':>24} {'hand ms':>8} {'solve ms':>8}  plan")
    for name, model, inputs, loss_fn in models():
        planner = Planner(model, loss_fn=loss_fn, repeats=5)
        started = time.perf_counter()
        profile = planner.profile(inputs)
        profile_s = time.perf_counter() - started
        n = len(profile.regions)
        low = min_reachable_peak(profile.problem())
        strategies = {
            "checkpoint all": [CHECKPOINT] * n,
            "checkpoint every other": [CHECKPOINT if i % 2 == 0 else KEEP for i in range(n)],
            "save_matmuls all": [SAVE_MATMULS] * n,
        }
        peaks = {h: peak_of(model, inputs, loss_fn, o) for h, o in strategies.items()}
        plans = {}
        for fraction in (0.3, 0.5, 0.7):
            try:
                plans[fraction] = planner.plan(inputs, fraction=fraction)
            except ValueError as exc:
                plans[fraction] = exc  # type: ignore[assignment]
        for fraction, chosen in plans.items():
            if not isinstance(chosen, Exception):
                options = [d.option for d in chosen.decisions]
                strategies[f"plan {fraction:.0%}"] = options
                peaks[f"plan {fraction:.0%}"] = peak_of(model, inputs, loss_fn, options)
        timed = step_times(model, inputs, loss_fn, strategies, rounds)
        print(f"# {name}: {n} blocks, unchecked peak {profile.unchecked_peak_bytes / 2**20:.2f} MiB "
              f"(step {profile.unchecked_step_s * 1e3:.0f} ms), min reachable "
              f"{low / profile.unchecked_peak_bytes:.0%}, profile {profile_s:.1f} s")
        for fraction, chosen in plans.items():
            if isinstance(chosen, Exception):
                print(f"{name:8} {fraction:>6.0%} unreachable: {str(chosen)[:100]}")
                continue
            key = f"plan {fraction:.0%}"
            peak = peaks[key]
            fitting = [h for h in ("checkpoint all", "checkpoint every other", "save_matmuls all")
                       if peaks[h] <= chosen.budget_bytes]
            best = min(fitting, key=timed.__getitem__) if fitting else "none fits"
            hand_ms = f"{timed[best] * 1e3:8.1f}" if fitting else f"{'-':>8}"
            err = (peak - chosen.predicted_peak_bytes) / peak
            counts = {}
            for d in chosen.decisions:
                counts[d.option.name] = counts.get(d.option.name, 0) + 1
            if 3**n <= 600_000:
                oracle = solve_enumerate(profile.problem(), chosen.solution.peak_bytes)
                exact = abs(oracle.step_s - chosen.predicted_step_s) < 1e-9
                counts["equals exhaustive optimum"] = exact  # type: ignore[assignment]
            print(f"{name:8} {fraction:>6.0%} {chosen.predicted_peak_bytes / 2**20:9.2f} "
                  f"{peak / 2**20:9.2f} {err:+6.1%} {peak <= chosen.budget_bytes!s:>5} "
                  f"{chosen.predicted_step_s * 1e3:8.1f} {timed[key] * 1e3:8.1f} {best:>24} {hand_ms} "
                  f"{chosen.solution.solve_s * 1e3:8.1f}  {counts}")
    rng = random.Random(0)
    agree = 0
    for trial in range(50):
        width, size = 3, rng.randint(2, 8)
        retained = tuple(tuple(rng.randint(1, 200) for _ in range(width)) for _ in range(size))
        problem = ChainProblem(
            (KEEP, CHECKPOINT, SAVE_MATMULS), retained,
            tuple(tuple(r + rng.randint(0, 150) for r in row) for row in retained),
            tuple(tuple(1.0 + rng.random() for _ in range(width)) for _ in range(size)),
            rng.randint(0, 100), rng.randint(0, 100),
            residue_bytes=tuple(tuple(rng.randint(0, 30) for _ in range(width)) for _ in range(size)),
        )
        budget = (min_reachable_peak(problem) + problem.peak_bytes((0,) * size)) // 2
        agree += abs(solve(problem, budget).step_s - solve_enumerate(problem, budget).step_s) < 1e-9
        del trial
    print(f"DP equals the exhaustive optimum on {agree}/50 random chains (2-8 blocks, 3 options)")
    size = 96
    retained = tuple(tuple(rng.randint(10_000, 2_000_000) for _ in range(3)) for _ in range(size))
    problem = ChainProblem(
        (KEEP, CHECKPOINT, SAVE_MATMULS), retained,
        tuple(tuple(r + rng.randint(0, 3_000_000) for r in row) for row in retained),
        tuple(tuple(1.0 + rng.random() for _ in range(3)) for _ in range(size)), 10**6, 10**6,
        residue_bytes=tuple(tuple(rng.randint(0, 200_000) for _ in range(3)) for _ in range(size)),
    )
    budget = (min_reachable_peak(problem) + problem.peak_bytes((0,) * size)) // 2
    for solver in ("dp", "milp"):
        started = time.perf_counter()
        solution = solve(problem, budget, solver)  # type: ignore[arg-type]
        print(f"96 blocks, 3 options: {solver} {time.perf_counter() - started:.2f} s (optimal={solution.optimal})")


if __name__ == "__main__":
    main()
