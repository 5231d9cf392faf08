"""Sharded planner benchmark: plans for FSDP2 ranks against the fastest hand strategy that fits.

On N local CPU processes (gloo, default 2), each model is sharded with FSDP2
and planned by all ranks together (one plan, per-rank budget, verified). The
hand strategies of ``benchmarks/planner.py`` (none, checkpoint all, every
other block, save_matmuls all, save_matmuls alternating with checkpoint) are
measured on the same ranks: their peak is the largest over the ranks, and a
strategy fits when that peak is within the budget. Step times are medians of
interleaved, rotated rounds (every rank runs the same rounds in step; rank
0's times are reported). The plan's peak is also the largest over the ranks.

    python benchmarks/sharded_planner.py                 # 2 ranks, a few minutes on 2 CPU cores
    python benchmarks/sharded_planner.py --quick         # smaller models, fewer rounds
    python benchmarks/sharded_planner.py --world-size 4
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from planner import Case, Strategy, hand_strategies, run, step_times  # noqa: E402
from remat.launch import run_on_ranks  # noqa: E402
from remat.memory import Sharding, shard_model  # noqa: E402
from remat.models import GPT, GPTConfig, lm_loss, make_batch  # noqa: E402
from remat.planner import Planner  # noqa: E402
from remat.planner.ranks import largest_over_ranks  # noqa: E402


def sharded_cases(quick: bool) -> Iterator[Case]:
    """A small Llama (built from a local config, nothing downloaded) and the embedded GPT, seeded."""
    import transformers

    seq, batch = (64 if quick else 128), 4
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=6 if quick else 8,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
        use_cache=False,
    )
    torch.manual_seed(0)
    llama = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    next_ids = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)  # the last position has none
    yield Case("llama", llama, (ids,), lambda output: lm_loss(output.logits, next_ids))
    gpt = GPTConfig(n_layers=8 if quick else 12, d_model=64, n_heads=4, d_ff=256, seq_len=seq, vocab_size=128)
    torch.manual_seed(0)
    model = GPT(gpt)
    idx, targets = make_batch(gpt, batch, torch.Generator().manual_seed(0))
    yield Case("gpt", model, (idx,), lambda logits: lm_loss(logits, targets))


def rank_main(payload: tuple[bool, int, tuple[float, ...]]) -> list[dict[str, Any]]:
    """Every rank: shard, plan together, measure hands and plans in step with the others."""
    import torch.distributed as dist

    quick, rounds, fractions = payload
    rows = []
    for case in sharded_cases(quick):
        name = case.name
        shard_model(case.model, Sharding(world_size=dist.get_world_size(), fsdp=True))
        planner = Planner(case.model, loss_fn=case.loss_fn, repeats=3)
        profile = planner.profile(case.inputs)
        hands = hand_strategies(len(profile.regions), False, False)
        peaks = {label: largest_over_ranks(int(run(case, s, tracked=True)), together=True) for label, s in hands.items()}
        strategies: dict[str, Strategy] = dict(hands)
        plans = {}
        for fraction in fractions:
            budget = int(fraction * profile.unchecked_peak_bytes)
            chosen = planner.plan(case.inputs, budget=budget, verify=True)
            label = f"plan {fraction:.0%}"
            plans[label] = (budget, chosen)
            strategies[label] = Strategy(tuple(d.option for d in chosen.decisions))
            peaks[label] = largest_over_ranks(int(run(case, strategies[label], tracked=True)), together=True)
        timed = step_times(case, strategies, rounds)
        for label, (budget, chosen) in plans.items():
            fitting = [h for h in hands if peaks[h] <= budget]
            best = min(fitting, key=timed.__getitem__) if fitting else None
            counts: dict[str, int] = {}
            for decision in chosen.decisions:
                counts[decision.option.name] = counts.get(decision.option.name, 0) + 1
            rows.append({
                "model": name, "budget": label.split()[1], "budget_bytes": budget,
                "predicted": chosen.predicted_peak_bytes, "peak": peaks[label],
                "plan_s": timed[label], "best": best, "hand_s": timed[best] if best else None,
                "counts": counts, "regions": len(chosen.decisions),
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 15)
    # The ranks import this file's rank_main (and benchmarks/planner.py) from here.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    rows = run_on_ranks(
        args.world_size, "sharded_planner:rank_main", (args.quick, rounds, (0.5, 0.7, 0.9)), timeout_s=3000
    )[0]
    print(f"FSDP2 on {args.world_size} CPU ranks (gloo); peaks are the largest over the ranks, "
          f"times rank 0's medians of {rounds} rounds")
    print("| model | budget | predicted / measured peak (MiB) | within budget | plan ms "
          "| fastest hand that fits | hand ms | plan / hand | plan |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for row in rows:
        fits = row["peak"] <= row["budget_bytes"]
        ratio = row["plan_s"] / row["hand_s"] if row["hand_s"] else None
        if ratio is not None:
            ratios.append(ratio)
        counts = ", ".join(f"{k}: {v}" for k, v in row["counts"].items())
        hand_ms = "-" if row["hand_s"] is None else f"{1e3 * row['hand_s']:.1f}"
        shown = "-" if ratio is None else f"{ratio:.3f}"
        print(
            f"| {row['model']}-{row['regions']} | {row['budget']} | {row['predicted'] / 2**20:.2f} / "
            f"{row['peak'] / 2**20:.2f} | {'yes' if fits else 'NO'} | {1e3 * row['plan_s']:.1f} "
            f"| {row['best'] or '(none fits)'} | {hand_ms} | {shown} | {counts} |"
        )
    within = sum(1 for row in rows if row["peak"] <= row["budget_bytes"])
    print(f"\nmeasured peak within budget on every rank: {within}/{len(rows)}")
    if ratios:
        ratios.sort()
        print(f"plan / fastest fitting hand: median {ratios[len(ratios) // 2]:.3f}, worst {ratios[-1]:.3f}; "
              f"<= 1.02 in {sum(1 for r in ratios if r <= 1.02)}/{len(ratios)}")


if __name__ == "__main__":
    main()
