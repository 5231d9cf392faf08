"""``remat report``: what a forward keeps for backward, tensor by tensor.

Layer: ``remat.cli`` (the application), above :mod:`remat.cli.strategies`.

Example:
    >>> from remat.cli import main
    >>> main(["report", "--model", "mlp", "--strategy", "remat", "--limit", "2"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse

from remat.cli.arguments import add_model_arguments, model_request
from remat.cli.loader import load_model
from remat.cli.strategies import ALL_STRATEGIES, apply_strategy
from remat.memory import render_saved_tensors, saved_tensors
from remat.models import GPTConfig

__all__ = ["add_arguments", "run"]

HELP = "list the tensors a forward keeps for backward"
DESCRIPTION = (
    "Run one forward and list every tensor it saves for backward: shape, dtype, bytes, "
    "producing op, module, source line and fate (kept, dropped by a checkpoint, saved or "
    "offloaded by a policy, offloaded)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``remat report``."""
    add_model_arguments(parser)
    parser.add_argument("--strategy", choices=ALL_STRATEGIES, default="none",
                        help="checkpointing of the model's blocks (the stack of repeated blocks "
                        "every command and the planner find) (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="embedded GPT blocks (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=2, help="sequences (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="list at most this many tensors")


def run(args: argparse.Namespace) -> int:
    """Run ``remat report``; returns the exit status."""
    gpt = GPTConfig(n_layers=args.layers, seq_len=args.seq)
    loaded = load_model(model_request(args, "remat report", gpt=gpt))
    apply_strategy(loaded, args.strategy, "remat report")
    for note in loaded.notes:
        print(note)
    print(f"{args.strategy}: {loaded.title}")
    report = saved_tensors(loaded.model, *loaded.args, **loaded.kwargs)
    print(render_saved_tensors(report, limit=args.limit))
    return 0
