"""Planner benchmark: plans against the fastest hand strategy that fits, on four models.

For each model and budget: the plan's predicted and measured peak (tracker),
its measured step time against the fastest hand strategy whose measured
peak fits the same budget (none, checkpoint all, every other block,
save_matmuls all, save_matmuls on every other block and full checkpoints
between; on the language model each of those with the head unchunked and
in 8 slices), and the solve time. Step times are medians of interleaved,
rotated rounds in one process. Then: the solvers against exhaustive
enumeration on small random chains, and the solve time of a 192-block
non-uniform chain.

    python benchmarks/planner.py                  # prints the tables (a few minutes on 2 CPU cores)
    python benchmarks/planner.py --quick          # smaller models, fewer rounds
    python benchmarks/planner.py --models gpt-lm  # one model (gpt-12, mlp-16, conv-24, gpt-lm)
    python benchmarks/planner.py --device cuda    # on a GPU: offload joins the options and
                                                  # the hand strategies; peaks count GPU memory
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from remat.memory import track
from remat.models import GPT, ConvNet, GPTConfig, MLPChain, lm_loss, make_batch
from remat.planner import Head, InfeasibleBudgetError, Planner
from remat.planner.apply import install
from remat.planner.cost import peak_bytes
from remat.planner.data import CHECKPOINT, KEEP, OFFLOAD, SAVE_MATMULS, ChainProblem, Option
from remat.planner.profile import find_candidates
from remat.planner.solvers import min_reachable_peak, solve, solve_enumerate
from remat.planner.step import LossFn, counted_device, default_loss, run_step


@dataclass
class Case:
    name: str
    model: torch.nn.Module
    inputs: tuple[Any, ...]
    loss_fn: LossFn
    head: Head | None = None
    blocks: list[torch.nn.Module] = field(default_factory=list)  # found once, on first use


@dataclass(frozen=True)
class Strategy:
    options: tuple[Option, ...]
    chunks: int = 1


def run(case: Case, strategy: Strategy, tracked: bool = False) -> float:
    """One step under ``strategy``: its peak bytes when tracked, else its wall time."""
    if not case.blocks:  # finding them runs a forward: once per case, not per step
        case.blocks = [m for _, m in find_candidates(case.model, None, case.inputs)]
    removers = [install(b, o) for b, o in zip(case.blocks, strategy.options, strict=True)]
    try:
        case.model.zero_grad(set_to_none=True)
        if tracked:
            with track(device=counted_device(case.model)) as tracker:
                run_step(case.model, case.inputs, case.loss_fn, head=case.head, chunks=strategy.chunks)
            return float(tracker.peak_bytes)
        sync()
        started = time.perf_counter()
        run_step(case.model, case.inputs, case.loss_fn, head=case.head, chunks=strategy.chunks)
        sync()
        return time.perf_counter() - started
    finally:
        for remove in removers:
            remove()


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def step_times(case: Case, strategies: dict[str, Strategy], rounds: int) -> dict[str, float]:
    """Median step time per strategy; strategies take turns (rotating) so load drift hits all."""
    names = list(strategies)
    for name in names:
        run(case, strategies[name])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(run(case, strategies[name]))
    return {name: statistics.median(values) for name, values in times.items()}


def hand_strategies(n: int, with_head: bool, offload: bool) -> dict[str, Strategy]:
    layouts = {
        "none": [KEEP] * n,
        "checkpoint all": [CHECKPOINT] * n,
        "every other": [CHECKPOINT if i % 2 == 0 else KEEP for i in range(n)],
        "save_matmuls all": [SAVE_MATMULS] * n,
        "save_matmuls/checkpoint": [SAVE_MATMULS if i % 2 else CHECKPOINT for i in range(n)],
    }
    if offload:
        layouts["offload all"] = [OFFLOAD] * n
        layouts["offload/checkpoint"] = [OFFLOAD if i % 2 else CHECKPOINT for i in range(n)]
    strategies = {name: Strategy(tuple(options)) for name, options in layouts.items()}
    if with_head:
        strategies.update(
            {f"{name} +head/8": Strategy(tuple(options), 8) for name, options in layouts.items()}
        )
    return strategies


def on(device: str, case: Case) -> Case:
    """``case`` with its model, inputs and head targets on ``device``."""
    if device == "cpu":
        return case
    case.model.to(device)
    case.inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in case.inputs)
    if case.head is not None:
        case.head = Head(case.head.module, case.head.targets.to(device))
    return case


def cases(quick: bool) -> Iterator[Case]:
    torch.manual_seed(0)
    seq = 64 if quick else 128
    config = GPTConfig(n_layers=12, d_model=64, n_heads=4, d_ff=256, seq_len=seq, vocab_size=128)
    idx, targets = make_batch(config, 4, torch.Generator().manual_seed(0))
    yield Case("gpt-12", GPT(config), (idx,), lambda logits, t=targets: lm_loss(logits, t.to(logits.device)))
    widths = (64, *(128, 64) * 8)
    yield Case("mlp-16", MLPChain(widths=widths), (torch.randn(1024 if quick else 2048, 64),), default_loss)
    side = 32 if quick else 48
    yield Case("conv-24", ConvNet(channels=(8, 16, 32), blocks_per_stage=8),
               (torch.randn(8, 3, side, side),), default_loss)
    lm = GPTConfig(n_layers=8, d_model=64, n_heads=4, d_ff=256, seq_len=seq * 2,
                   vocab_size=4096 if quick else 8192)
    idx, targets = make_batch(lm, 4, torch.Generator().manual_seed(1))
    yield Case("gpt-lm", GPT(lm), (idx,), default_loss, head=Head("head", targets))


def plan_cases(quick: bool, rounds: int, device: str = "cpu", models: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    rows = []
    for case in (on(device, c) for c in cases(quick) if not models or c.name in models):
        planner = Planner(case.model, loss_fn=case.loss_fn if case.head is None else default_loss,
                          head=case.head, repeats=3)
        started = time.perf_counter()
        profile = planner.profile(case.inputs)
        profile_s = time.perf_counter() - started
        n = len(profile.regions)
        hands = hand_strategies(n, case.head is not None, OFFLOAD in profile.options)
        peaks = {name: run(case, s, tracked=True) for name, s in hands.items()}
        budgets = {f"{f:.0%}": int(f * profile.unchecked_peak_bytes) for f in (0.3, 0.5, 0.7, 0.9)}
        if case.head is not None:
            full = peaks["checkpoint all"]
            budgets.update({f"{f:.0%} of full": int(f * full) for f in (0.8, 0.6, 0.4)})
        plans: dict[str, Any] = {}
        for label, budget in budgets.items():
            try:
                plans[label] = planner.plan(case.inputs, budget=budget)
            except InfeasibleBudgetError as exc:
                plans[label] = exc
        strategies = dict(hands)
        # The same strategy timed twice: how far apart identical steps read here.
        strategies["none (control)"] = hands["none"]
        for label, chosen in plans.items():
            if not isinstance(chosen, Exception):
                strategies[f"plan {label}"] = Strategy(
                    tuple(d.option for d in chosen.decisions), chosen.head_chunks
                )
                peaks[f"plan {label}"] = run(case, strategies[f"plan {label}"], tracked=True)
        timed = step_times(case, strategies, rounds)
        print(f"# {case.name}: {n} blocks, unchecked peak {profile.unchecked_peak_bytes / 2**20:.2f} MiB, "
              f"checkpoint-all peak {peaks['checkpoint all'] / 2**20:.2f} MiB, "
              f"profile {profile_s:.1f} s" + (f", head options {[h.chunks for h in profile.heads]}"
                                              if profile.heads else "")
              + f"; noise control: 'none' timed twice reads {timed['none (control)'] / timed['none']:.3f}x")
        for label, chosen in plans.items():
            budget = budgets[label]
            fitting = [h for h in hands if peaks[h] <= budget]
            best = min(fitting, key=timed.__getitem__) if fitting else None
            row: dict[str, Any] = {"model": case.name, "budget": label, "budget_bytes": budget,
                                   "best": best, "hand_s": timed[best] if best else None}
            if isinstance(chosen, Exception):
                row.update(plan=None, error=getattr(chosen, "min_peak_bytes", 0))
            else:
                key = f"plan {label}"
                counts: dict[str, int] = {}
                for d in chosen.decisions:
                    counts[d.option.name] = counts.get(d.option.name, 0) + 1
                row.update(plan=chosen, peak=peaks[key], plan_s=timed[key], counts=counts)
            rows.append(row)
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print()
    print("| model | budget | predicted / measured peak (MiB) | fits | plan ms | fastest hand that fits | "
          "hand ms | plan / hand | solve ms | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    fits = 0
    planned = 0
    for row in rows:
        chosen = row["plan"]
        if chosen is None:
            print(f"| {row['model']} | {row['budget']} | unreachable (smallest {row['error'] / 2**20:.2f}) "
                  f"| - | - | {row['best'] or 'none fits'} | - | - | - | - |")
            continue
        planned += 1
        fits += row["peak"] <= row["budget_bytes"]
        ratio = row["plan_s"] / row["hand_s"] if row["hand_s"] else None
        if ratio is not None:
            ratios.append(ratio)
        head = f", head/{chosen.head_chunks}" if chosen.head_chunks > 1 else ""
        print(f"| {row['model']} | {row['budget']} | {chosen.predicted_peak_bytes / 2**20:.2f} / "
              f"{row['peak'] / 2**20:.2f} | {'yes' if row['peak'] <= row['budget_bytes'] else 'NO'} | "
              f"{row['plan_s'] * 1e3:.1f} | {row['best'] or 'none fits'} | "
              f"{row['hand_s'] * 1e3 if row['hand_s'] else float('nan'):.1f} | "
              f"{f'{ratio:.3f}' if ratio else 'n/a (no hand fits)'} | "
              f"{chosen.solution.solve_s * 1e3:.1f} | {row['counts']}{head} |")
    print()
    print(f"measured peak within budget: {fits}/{planned}")
    if ratios:
        within = sum(r <= 1.02 for r in ratios)
        print(f"plan / fastest fitting hand strategy: median {statistics.median(ratios):.3f}, "
              f"worst {max(ratios):.3f}; <= 1.02 in {within}/{len(ratios)} "
              f"({within / len(ratios):.0%}), <= 1.05 in {sum(r <= 1.05 for r in ratios)}/{len(ratios)}")


def random_chain(rng: random.Random, size: int, scale: int = 200) -> ChainProblem:
    width = 3
    retained = tuple(tuple(rng.randint(1, scale) for _ in range(width)) for _ in range(size))
    return ChainProblem(
        (KEEP, CHECKPOINT, SAVE_MATMULS), retained,
        tuple(tuple(r + rng.randint(0, scale) for r in row) for row in retained),
        tuple(tuple(1.0 + rng.random() for _ in range(width)) for _ in range(size)),
        rng.randint(0, scale // 2), rng.randint(0, scale // 2),
        residue_bytes=tuple(tuple(rng.randint(0, scale // 7) for _ in range(width)) for _ in range(size)),
    )


def solver_checks() -> None:
    rng = random.Random(0)
    worst = {"dp": 0.0, "milp": 0.0}
    trials = 50
    for _ in range(trials):
        problem = random_chain(rng, rng.randint(2, 8))
        budget = (min_reachable_peak(problem) + peak_bytes(problem, (0,) * problem.size)) // 2
        best = solve_enumerate(problem, budget).step_s
        for name in worst:
            got = solve(problem, budget, name).step_s  # type: ignore[arg-type]
            worst[name] = max(worst[name], got / best - 1)
    print()
    print(f"exhaustive check, {trials} random chains of 2-8 blocks, 3 options: worst gap to the "
          f"optimum dp {worst['dp']:.2%}, milp {worst['milp']:.2%}")
    problem = random_chain(rng, 192, scale=2_000_000)
    budget = (min_reachable_peak(problem) + peak_bytes(problem, (0,) * problem.size)) // 2
    for name in ("auto", "milp", "dp"):
        started = time.perf_counter()
        solution = solve(problem, budget, name)  # type: ignore[arg-type]
        print(f"192 non-uniform blocks, 3 options: {name} -> {solution.solver} "
              f"{time.perf_counter() - started:.2f} s (optimal={solution.optimal})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per strategy")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the models run (cuda: offload joins the options)")
    parser.add_argument("--models", nargs="+", default=(), metavar="NAME",
                        help="only these models (gpt-12, mlp-16, conv-24, gpt-lm; default: all four)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    rounds = args.rounds or (3 if args.quick else 11)
    print(f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}")
    print_rows(plan_cases(args.quick, rounds, args.device, tuple(args.models)))
    solver_checks()


if __name__ == "__main__":
    main()
