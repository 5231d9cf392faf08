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
from remat.compression import FORMATS
from remat.memory import (
    compression_report,
    render_compression_report,
    render_saved_tensors,
    saved_tensors,
)
from remat.models import GPTConfig
from remat.planner.step import default_loss

__all__ = ["add_arguments", "run"]

HELP = "list the tensors a forward keeps for backward, or what compressing them costs"
DESCRIPTION = (
    "Run one forward and list every tensor it saves for backward: shape, dtype, bytes, "
    "producing op, module, source line and fate (kept, dropped by a checkpoint, saved, "
    "compressed or offloaded by a policy, compressed, offloaded). With --compress FORMAT, "
    "run the training step with and without compression instead and report, per module (or "
    "per saved tensor), the bytes before and after and the gradient error, measured and "
    "predicted, safest to compress first."
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
    parser.add_argument("--compress", choices=FORMATS, default=None, metavar="FORMAT",
                        help=f"report the gradient error of compressing saved tensors in FORMAT "
                        f"({', '.join(FORMATS)}) instead of listing them")
    parser.add_argument("--by", choices=("module", "tensor"), default="module",
                        help="with --compress: one row per module or per saved tensor (default: %(default)s)")
    parser.add_argument("--depth", type=int, default=2,
                        help="with --compress --by module: module path components kept (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Run ``remat report``; returns the exit status."""
    gpt = GPTConfig(n_layers=args.layers, seq_len=args.seq)
    loaded = load_model(model_request(args, "remat report", gpt=gpt))
    apply_strategy(loaded, args.strategy, "remat report")
    for note in loaded.notes:
        print(note)
    print(f"{args.strategy}: {loaded.title}")
    if args.compress is not None:
        model, loss_fn = loaded.model, loaded.loss_fn or default_loss
        compressed = compression_report(
            model,
            lambda: loss_fn(model(*loaded.args, **loaded.kwargs)),
            args.compress,
            by=args.by,
            depth=args.depth if args.by == "module" else None,
        )
        print(render_compression_report(compressed))
        return 0
    report = saved_tensors(loaded.model, *loaded.args, **loaded.kwargs)
    print(render_saved_tensors(report, limit=args.limit))
    return 0
