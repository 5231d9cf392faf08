"""Where a module region's time goes, piece by piece (CPU, one process).

A chain of checkpointed blocks ``x + 0.5 * tanh(x @ W)`` (one parameter each,
batch 64, width 64, the first row of ``benchmarks/overhead.py``) runs forward
and backward under cProfile; the table lists remat's own functions by the
time spent in them (``tottime``), per region, with their share of remat's
total. The profiler adds its own cost per call, so absolute figures are
higher than ``benchmarks/overhead.py`` measures: read the shares.

    .venv/bin/python benchmarks/region_profile.py [--regions N] [--policy save_matmuls]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

import remat
from overhead import TanhBlock  # the block of the benchmark's first row (this folder)
from remat.policies import save_matmuls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", choices=["none", "save_matmuls"], default="none")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    blocks = [TanhBlock(64) for _ in range(args.regions)]
    x = torch.randn(64, 64, requires_grad=True)
    policy = save_matmuls if args.policy == "save_matmuls" else None

    def step() -> None:
        h = x
        for block in blocks:
            h = remat.checkpoint(block, h, policy=policy) if policy else remat.checkpoint(block, h)
        h.sum().backward()

    for _ in range(3):
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step()
    profile.disable()
    stats = pstats.Stats(profile)
    regions = args.regions * args.steps
    rows = []
    for (path, line, name), (_, calls, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "/remat/" in path:
            short = path.split("/remat/", 1)[1]
            rows.append((tottime, calls, f"{short}:{line} {name}"))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"remat's own time per region: {total / regions * 1e6:.1f} us (under cProfile), "
          f"{args.regions} regions x {args.steps} steps, policy {args.policy}")
    print(f"{'us/region':>9}  {'share':>5}  {'calls/region':>12}  function")
    for tottime, calls, where in rows[:15]:
        print(f"{tottime / regions * 1e6:9.2f}  {tottime / total:5.0%}  {calls / regions:12.1f}  {where}")


if __name__ == "__main__":
    main()
