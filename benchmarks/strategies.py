"""Every checkpointing strategy on the embedded GPT: step time, memory and gradients against none.

``remat demo --strategies all`` run as users run it (``python -m remat demo
... --json``): no checkpointing, ``torch.utils.checkpoint``, ``remat.checkpoint``
and remat's policies and offload (the savings ladder: what each keeps and
costs), trained a few steps each on the CPU. Strategies take turns step by
step in one process and time ratios are medians of per-round ratios; memory
comes from a separate tracked step so tracking does not skew the timings.
Prints the command's table; ``--json PATH`` also writes the options, the
environment and every result. Every other argument goes to ``remat demo``
(``--steps``, ``--warmup``, ``--layers``, ``--batch``, ``--seq``, ``--seed``).

    .venv/bin/python benchmarks/strategies.py [--steps N] [--layers N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from command import run_remat  # this folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON")
    args, demo_arguments = parser.parse_known_args(argv)
    printed, results = run_remat("demo", "--strategies", "all", "--no-plots", *demo_arguments)
    print(printed, end="")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
