"""The savings ladder of selective checkpointing on the embedded GPT model.

One command: ``.venv/bin/python benchmarks/policies.py``. Strategies run
interleaved step by step in one process; the time column is the median of
per-round ratios to no checkpointing. Memory comes from one tracked step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import remat
import remat.policies as P
from remat.cli import format_bytes
from remat.memory import track
from remat.models import GPT, GPTConfig, lm_loss, make_batch

Strategy = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None

STRATEGIES: dict[str, Strategy] = {
    "none": None,
    "full (plain checkpoint)": remat.checkpoint,
    "save_matmuls": partial(remat.checkpoint, policy=P.save_matmuls),
    "save_matmuls_without_batch_dims": partial(remat.checkpoint, policy=P.save_matmuls_without_batch_dims),
}


def step(model: GPT, strategy: Any, idx: torch.Tensor, targets: torch.Tensor) -> float:
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    lm_loss(model(idx, checkpoint_fn=strategy), targets).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPTConfig(n_layers=args.layers)
    model = GPT(config)
    idx, targets = make_batch(config, args.batch, torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    for strategy in STRATEGIES.values():  # warm-up
        step(model, strategy, idx, targets)
    for _ in range(args.steps):
        for name, strategy in STRATEGIES.items():
            times[name].append(step(model, strategy, idx, targets))
    print(f"GPT {args.layers} layers, batch {args.batch}, seq {config.seq_len}; {args.steps} rounds")
    print(f"{'strategy':34} {'step ms':>8} {'vs none':>8} {'fwd-end live':>13} {'peak':>10}")
    for name, strategy in STRATEGIES.items():
        model.zero_grad(set_to_none=True)
        with track() as tracker:
            loss = lm_loss(model(idx, checkpoint_fn=strategy), targets)
            tracker.mark("forward_end")
            loss.backward()
        ratio = statistics.median(t / n for t, n in zip(times[name], times["none"], strict=True))
        print(
            f"{name:34} {1e3 * statistics.median(times[name]):8.1f} {ratio:7.2f}x "
            f"{format_bytes(tracker.marks['forward_end']):>13} {format_bytes(tracker.peak_bytes):>10}"
        )


if __name__ == "__main__":
    main()
