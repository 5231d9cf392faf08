"""Compare no checkpointing, torch.utils.checkpoint and remat on the embedded GPT.

Besides ``remat demo``'s three strategies, the table has remat's selective
policies (the savings ladder: what each policy keeps and costs).

One command, one table (the same as ``remat demo``); ``--json PATH`` also
writes the options, the environment and every result. Strategies run
interleaved step by step; time ratios are medians of per-round ratios.

    .venv/bin/python benchmarks/run.py [--steps N] [--layers N] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from remat.cli import (
    ALL_STRATEGIES,
    StrategyResult,
    add_demo_arguments,
    compare_strategies,
    options_from_args,
    render_table,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_demo_arguments(parser)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON")
    args = parser.parse_args(argv)
    options = options_from_args(args)
    results = compare_strategies(options, strategies=ALL_STRATEGIES)
    print(render_table(results, options))
    if args.json is not None:
        report = {
            "options": dataclasses.asdict(options),
            "model": dataclasses.asdict(options.model_config()),
            "environment": {
                "torch": torch.__version__,
                "python": platform.python_version(),
                "threads": torch.get_num_threads(),
                "machine": platform.machine(),
            },
            "results": [_result_fields(r) for r in results],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _result_fields(result: StrategyResult) -> dict[str, object]:
    """The result's numbers, plus its memory breakdown (the timeline is left out)."""
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name != "memory"}
    if result.memory is not None:
        fields["memory_by_category"] = [dataclasses.asdict(u) for u in result.memory.by_category]
        fields["memory_start_bytes"] = result.memory.start_bytes
    return fields


if __name__ == "__main__":
    raise SystemExit(main())
