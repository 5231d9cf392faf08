"""Compiled planner benchmark: remat's compiled plans against torch's activation_memory_budget.

Every block compiled on its own (``fullgraph=True``, inductor), as torchtitan
compiles a transformer. Budgets lie 30, 50, 70 and 90% of the way from the
compiled peak with every block checkpointed to the compiled unchecked peak.
At each budget:

* remat's plan (``remat.plan(..., compile=True)``): predicted and measured
  peak, whether it fits, step time;
* torch's ``activation_memory_budget`` at the largest fraction whose measured
  peak fits the same bytes (a scan of fractions, then bisection between the
  scan's points; the fraction is reported), applied to every block through
  ``torch.autograd.graph.region_activation_memory_budget`` (the same
  knapsack per block graph as the process-wide setting; checked once per
  model and printed);
* compiled hand strategies: none, every block checkpointed, every other
  block, save_matmuls on every block.

Peaks are the allocator's count of one step's own allocations
(``remat.memory.track_allocations``; inductor's buffers included; on CUDA
``torch.cuda.max_memory_allocated`` is printed beside it). Step times are
medians of per-round ratios from interleaved, rotated rounds in one process.
Whether each side's peak is monotonic in its budget is reported.

    python benchmarks/compiled_planner.py              # GPT and a HF Llama config (20-30 min, 2 CPU cores)
    python benchmarks/compiled_planner.py --quick      # small models, two budgets, few rounds
    python benchmarks/compiled_planner.py --device cuda

Needs torch 2.13 or newer (per-region compile budgets) and, for the Llama
rows, transformers (``pip install remat[hf]``).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from remat._compat.dynamo import compile_cache_room
from remat._compat.partitioner import region_memory_budgets_available
from remat.memory import track_allocations
from remat.models import GPT, GPTConfig, lm_loss, make_batch
from remat.placement import BlockSetting, CompileSpec, Placement, place
from remat.planner import Planner
from remat.planner.cost import (
    chain_problem,
    peak_bytes,
)
from remat.planner.data import CHECKPOINT
from remat.policies import save_matmuls

SPEC = CompileSpec()


@dataclass
class Case:
    name: str
    build: Callable[[], torch.nn.Module]  # a fresh model with the case's weights
    blocks: str  # the blocks' container, e.g. "blocks"
    inputs: tuple[Any, ...]
    loss_fn: Callable[[Any], torch.Tensor]


@dataclass
class Variant:
    """One compiled model under one strategy."""

    label: str
    model: torch.nn.Module
    handle: Placement
    peak: int = 0
    cuda_peak: int | None = None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step(case: Case, model: torch.nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    case.loss_fn(model(*case.inputs)).backward()


def block_names(case: Case, model: torch.nn.Module) -> list[str]:
    return [f"{case.blocks}.{i}" for i in range(len(model.get_submodule(case.blocks)))]


def variant(case: Case, label: str, settings: list[BlockSetting], device: str) -> Variant:
    """A fresh model with ``settings`` on its blocks, compiled, warmed up and its peak measured."""
    model = case.build()
    handle = place(model, list(zip(block_names(case, model), settings, strict=True)))
    for _ in range(2):  # compile, and the recompile a first step's state may ask for
        step(case, model)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with track_allocations(None if device == "cpu" else device) as meter:
        step(case, model)
    found = Variant(label, model, handle, meter.peak_bytes)
    if device == "cuda":
        found.cuda_peak = torch.cuda.max_memory_allocated() - base
    return found


def hand(kind: str, n: int) -> list[BlockSetting]:
    keep = BlockSetting(checkpoint=False, compile=SPEC)
    full = BlockSetting(compile=SPEC)
    matmuls = BlockSetting(policy=save_matmuls, compile=SPEC)
    layout = {
        "none": [keep] * n,
        "checkpoint all": [full] * n,
        "every other": [full if i % 2 == 0 else keep for i in range(n)],
        "save_matmuls all": [matmuls] * n,
    }
    return layout[kind]


def torch_budget(fraction: float, n: int) -> list[BlockSetting]:
    return [BlockSetting(checkpoint=False, memory_budget=fraction, compile=SPEC)] * n


class TorchFractions:
    """Peaks of torch's budget at each fraction tried (each a compiled variant, kept for timing)."""

    def __init__(self, case: Case, n: int, device: str) -> None:
        self.case, self.n, self.device = case, n, device
        self.seen: dict[float, Variant] = {}

    def at(self, fraction: float) -> Variant:
        fraction = round(fraction, 4)
        if fraction not in self.seen:
            self.seen[fraction] = variant(
                self.case, f"torch {fraction:g}", torch_budget(fraction, self.n), self.device
            )
        return self.seen[fraction]

    def largest_fitting(self, budget: int, grid: list[float], steps: int) -> float | None:
        """The largest fraction of the scan that fits, refined by bisection towards the next one."""
        fitting = [f for f in grid if self.at(f).peak <= budget]
        if not fitting:
            return None
        low = max(fitting)
        above = [f for f in grid if f > low]
        if not above:
            return low
        high = min(above)
        for _ in range(steps):
            middle = (low + high) / 2
            if self.at(middle).peak <= budget:
                low = middle
            else:
                high = middle
        return low


def time_rounds(case: Case, variants: list[Variant], rounds: int, device: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {v.label: [] for v in variants}
    for round_ in range(rounds):
        shift = round_ % len(variants)
        for v in variants[shift:] + variants[:shift]:
            sync(device)
            started = time.perf_counter()
            step(case, v.model)
            sync(device)
            times[v.label].append(time.perf_counter() - started)
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def monotonic(peaks: list[int]) -> bool:
    return all(a <= b for a, b in itertools.pairwise(peaks))


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def gpt_case(quick: bool, device: str) -> Case:
    config = GPTConfig(n_layers=4 if quick else 6, seq_len=64 if quick else 128, d_model=128,
                       n_heads=4, d_ff=512)
    torch.manual_seed(0)
    base = GPT(config).to(device)
    idx, targets = (t.to(device) for t in make_batch(config, 4, torch.Generator().manual_seed(0)))
    return Case(f"gpt-{config.n_layers}", lambda: copy.deepcopy(base), "blocks", (idx,),
                lambda logits: lm_loss(logits, targets))


def llama_case(quick: bool, device: str) -> Case | None:
    try:
        import transformers
    except ImportError:
        print("# llama: skipped (transformers is not installed: pip install remat[hf])")
        return None
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4 if quick else 6,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to(device)
    seq = 64 if quick else 128
    tokens = torch.randint(config.vocab_size, (4, seq + 1), generator=torch.Generator().manual_seed(0))
    idx, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def loss_fn(output: Any) -> torch.Tensor:
        return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())

    return Case(f"llama-{config.num_hidden_layers}", lambda: copy.deepcopy(base), "model.layers",
                (idx,), loss_fn)


def run_case(case: Case, shares: list[float], rounds: int, quick: bool, device: str) -> dict[str, Any]:
    planner_model = case.build()
    planner = Planner(planner_model, loss_fn=case.loss_fn, compile=SPEC, repeats=3)
    started = time.perf_counter()
    profile = planner.profile(case.inputs)
    profile_s = time.perf_counter() - started
    n = len(profile.regions)
    problem = chain_problem(profile, 0)
    full_predicted = peak_bytes(problem, (problem.options.index(CHECKPOINT),) * n)

    hands = {kind: variant(case, kind, hand(kind, n), device)
             for kind in ("none", "checkpoint all", "every other", "save_matmuls all")}
    low, high = hands["checkpoint all"].peak, hands["none"].peak
    budgets = {share: int(low + share * (high - low)) for share in shares}

    plans: dict[float, Any] = {}
    plan_variants: dict[float, Variant] = {}
    for share, budget in budgets.items():
        chosen = planner.plan(case.inputs, budget=budget)
        plans[share] = chosen
        model = case.build()
        handle = chosen.apply(model)
        for _ in range(2):
            step(case, model)
        with track_allocations(None if device == "cpu" else device) as meter:
            step(case, model)
        plan_variants[share] = Variant(f"remat {share:.0%}", model, handle, meter.peak_bytes)

    torch_side = TorchFractions(case, n, device)
    grid = [i / 10 for i in range(11)] if not quick else [0.0, 0.25, 0.5, 0.75, 1.0]
    fractions = {share: torch_side.largest_fitting(budget, grid, 3 if quick else 5)
                 for share, budget in budgets.items()}
    # The per-region budget is torch's process-wide one, graph by graph: check it on one fraction.
    check = 0.5
    global_peak = global_budget_peak(case, n, check, device)
    per_region_peak = torch_side.at(check).peak

    timed = [*hands.values(), *plan_variants.values()]
    torch_rows = {share: torch_side.at(f) for share, f in fractions.items() if f is not None}
    timed += list({id(v): v for v in torch_rows.values()}.values())
    control = Variant("none (control)", hands["none"].model, hands["none"].handle)
    times = time_rounds(case, [*timed, control], rounds, device)
    return {
        "case": case, "n": n, "profile_s": profile_s, "full_predicted": full_predicted,
        "unchecked_predicted": profile.unchecked_peak_bytes, "hands": hands, "budgets": budgets,
        "plans": plans, "plan_variants": plan_variants, "fractions": fractions,
        "torch_rows": torch_rows, "times": times, "grid": {f: torch_side.at(f).peak for f in grid},
        "check": (check, global_peak, per_region_peak),
    }


def global_budget_peak(case: Case, n: int, fraction: float, device: str) -> int:
    """The peak with torch's process-wide activation_memory_budget (a fresh compile)."""
    import torch._functorch.config as functorch_config

    torch.compiler.reset()  # the process-wide setting is not part of the compiled code's guards
    # Blocks compiled by torch itself: remat compiles its blocks under torch's
    # default partitioner settings, whatever the process's (docs/design/compile.md,
    # "Isolation").
    model = case.build()
    for name in block_names(case, model):
        model.get_submodule(name).compile(**SPEC.arguments())
    with functorch_config.patch(activation_memory_budget=fraction):
        for _ in range(2):  # compile, and the recompile a first step's state may ask for
            step(case, model)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with track_allocations(None if device == "cpu" else device) as meter:
            step(case, model)
    torch.compiler.reset()
    return meter.peak_bytes


def report(result: dict[str, Any]) -> list[float]:
    case, times = result["case"], result["times"]
    hands = result["hands"]
    check, global_peak, region_peak = result["check"]
    print(f"\n# {case.name}: {result['n']} blocks compiled (fullgraph, inductor); "
          f"unchecked peak {mib(hands['none'].peak)} MiB (predicted {mib(result['unchecked_predicted'])}), "
          f"checkpoint all {mib(hands['checkpoint all'].peak)} MiB (predicted "
          f"{mib(result['full_predicted'])}); profile {result['profile_s']:.0f} s; "
          f"torch's budget {check}: process-wide {mib(global_peak)} MiB, per region {mib(region_peak)} MiB; "
          f"noise control: 'none' timed twice reads {ratio(times, 'none (control)', 'none'):.3f}x")
    print("\n| budget | bytes (MiB) | remat predicted / measured | fits | remat ms | torch fraction | "
          "torch peak | torch ms | remat / torch | fastest hand that fits | hand ms | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for share, budget in result["budgets"].items():
        chosen, measured = result["plans"][share], result["plan_variants"][share]
        remat_ms = statistics.median(times[measured.label]) * 1e3
        torch_row = result["torch_rows"].get(share)
        fitting = [h for h in hands.values() if h.peak <= budget]
        best = min(fitting, key=lambda h: statistics.median(times[h.label])) if fitting else None
        counts: dict[str, int] = {}
        for d in chosen.decisions:
            counts[d.option.name] = counts.get(d.option.name, 0) + 1
        if torch_row is not None:
            r = ratio(times, measured.label, torch_row.label)
            ratios.append(r)
            torch_cells = (f"{result['fractions'][share]:.3f} | {mib(torch_row.peak)} | "
                           f"{statistics.median(times[torch_row.label]) * 1e3:.1f} | {r:.3f}")
        else:
            torch_cells = "none fits | - | - | -"
        hand_cells = (f"{best.label} | {statistics.median(times[best.label]) * 1e3:.1f}"
                      if best else "none fits | -")
        print(f"| {share:.0%} | {mib(budget)} | {mib(chosen.predicted_peak_bytes)} / {mib(measured.peak)} "
              f"({(chosen.predicted_peak_bytes - measured.peak) / measured.peak:+.2%}) | "
              f"{'yes' if measured.peak <= budget else 'NO'} | {remat_ms:.1f} | {torch_cells} | "
              f"{hand_cells} | {counts} |")
    print("\n| hand strategy | peak (MiB) | ms |")
    print("|---|---|---|")
    for h in hands.values():
        print(f"| {h.label} | {mib(h.peak)} | {statistics.median(times[h.label]) * 1e3:.1f} |")
    plan_peaks = [result["plan_variants"][s].peak for s in result["budgets"]]
    grid = result["grid"]
    print(f"\nremat peaks monotonic in the budget: {monotonic(plan_peaks)}; torch's peaks over its "
          f"fractions {', '.join(f'{f:g}: {mib(p)}' for f, p in grid.items())} MiB: monotonic "
          f"{monotonic(list(grid.values()))}")
    if ratios:
        print(f"remat / torch at the same bytes: median {statistics.median(ratios):.3f}, "
              f"worst {max(ratios):.3f}")
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, budgets 30 and 70%%, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 11, quick 3)")
    parser.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if not region_memory_budgets_available():
        parser.error(f"needs per-region compile budgets (torch 2.13 or newer); this is torch {torch.__version__}")
    if args.device == "cpu":
        torch.set_num_threads(1)
    rounds = args.rounds or (3 if args.quick else 11)
    shares = [0.3, 0.7] if args.quick else [0.3, 0.5, 0.7, 0.9]
    print(f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu, 1 thread'}, "
          f"torch {torch.__version__}")
    every_ratio: list[float] = []
    builders = {"gpt": gpt_case, "llama": llama_case}
    with compile_cache_room(256):  # every strategy's compiled block coexists for the timed rounds
        for name in args.models.split(","):
            case = builders[name.strip()](args.quick, args.device)
            if case is not None:
                every_ratio += report(run_case(case, shares, rounds, args.quick, args.device))
                torch.compiler.reset()
    if every_ratio:
        print(f"\nall models: remat / torch median {statistics.median(every_ratio):.3f}, "
              f"worst {max(every_ratio):.3f}")


if __name__ == "__main__":
    main()
