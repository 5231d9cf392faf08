"""How much ``remat.memory.track`` slows a real CPU training step.

Runs the embedded GPT's training step (forward, backward, SGD update) with
and without the tracker, interleaved step by step so machine load hits both
alike, and prints the median of per-step time ratios (tracked / untracked),
for ``track()`` and for ``track(model)`` (module hooks and attribution on).

    .venv/bin/python benchmarks/tracker_overhead.py [--steps N] [--layers N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from remat.memory import track
from remat.models import GPT, GPTConfig, lm_loss, make_batch

Mode = Callable[[torch.nn.Module], contextlib.AbstractContextManager[Any]]
MODES: dict[str, Mode] = {
    "untracked": lambda model: contextlib.nullcontext(),
    "track()": lambda model: track(),
    "track(model)": lambda model: track(model),
}


def _step(model: GPT, idx: torch.Tensor, targets: torch.Tensor, mode: Mode) -> float:
    start = time.perf_counter()
    with mode(model):
        model.zero_grad(set_to_none=True)
        lm_loss(model(idx), targets).backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.add_(param.grad, alpha=-1e-3)
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per mode (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON")
    args = parser.parse_args(argv)

    config = GPTConfig(n_layers=args.layers, seq_len=args.seq)
    torch.manual_seed(0)
    model = GPT(config)
    idx, targets = make_batch(config, args.batch, torch.Generator().manual_seed(0))
    names = list(MODES)
    times: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.warmup + args.steps):
        shift = round_ % len(names)
        step_s = {name: _step(model, idx, targets, MODES[name]) for name in names[shift:] + names[:shift]}
        if round_ >= args.warmup:
            for name in names:
                times[name].append(step_s[name])
                ratios[name].append(step_s[name] / step_s["untracked"])

    print(
        f"GPT {args.layers} layers x d_model {config.d_model}, seq {args.seq}, batch {args.batch}; "
        f"{args.steps} steps (+{args.warmup} warmup); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'mode':<14}{'step (ms)':>10}{'vs untracked':>14}")
    for name in names:
        print(f"{name:<14}{statistics.median(times[name]) * 1e3:>10.1f}{statistics.median(ratios[name]):>13.2f}x")
    if args.json is not None:
        report = {
            "options": vars(args) | {"json": str(args.json)},
            "median_step_s": {name: statistics.median(times[name]) for name in names},
            "median_ratio": {name: statistics.median(ratios[name]) for name in names},
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
