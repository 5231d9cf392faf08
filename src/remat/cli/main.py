"""The ``remat`` command: its parser and the dispatch to each subcommand.

Layer: the top of ``remat.cli`` (the application); nothing in the library
imports it.

``remat demo`` (also what a bare ``remat`` runs) compares checkpointing
strategies on the embedded GPT (:mod:`remat.cli.demo`); ``remat report``
lists what a forward keeps for backward (:mod:`remat.cli.report`); ``remat
estimate`` estimates a training step's memory at any size, one process or
one rank of many (:mod:`remat.cli.estimate`); ``remat plan`` plans under a
memory budget (:mod:`remat.cli.plan`). Every command reads its model the
same way (:mod:`remat.cli.arguments`) and exits 0 when done, 2 on a usage
error and 1 when the model cannot be built, with one line on stderr
(:mod:`remat.cli.console`).

Example:
    >>> main(["report", "--model", "mlp", "--limit", "1"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import ModuleType

from remat.cli import demo, estimate, plan, report
from remat.cli.console import CommandParser, run_command

__all__ = ["build_parser", "main"]

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
"""torch's documented switch: with it at "1", ``torch.cuda.is_available()`` asks NVML instead
of the CUDA runtime, so the process can still fork copies that use CUDA or autograd. The
``remat`` command sets it (unless the caller did) for its own process: torch's fake-tensor
mode asks ``is_available()`` at every simulation, and on a machine with a GPU the runtime's
answer left every forked simulation of ``remat plan --pipeline`` unable to run a backward, so
the plan ran in one process (Llama-3.1-8B 4x2 on a 16-core H200 machine: 97.6 s, and 56.8 s
with the switch). Where NVML is missing torch falls back to the runtime's answer."""

COMMANDS: dict[str, ModuleType] = {"demo": demo, "report": report, "estimate": estimate, "plan": plan}
"""Each subcommand's module: ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)``, ``run(args)``."""


def build_parser() -> CommandParser:
    """The ``remat`` parser: one subparser per command (errors are one line, exit status 2)."""
    parser = CommandParser(
        prog="remat",
        description="Activation checkpointing for PyTorch. Without a subcommand, runs `remat demo`.",
        epilog="Exit status: 0 done, 2 usage error, 1 the model could not be built or the "
        "command failed on it (one line on stderr).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION))
    parser.set_defaults(**demo.defaults())  # a bare `remat` runs the demo with its defaults
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``remat`` command; returns the exit status.

    With no subcommand, runs ``remat demo`` with its defaults. Run as the command (``argv``
    None) it sets :data:`NVML_CHECK` unless it is set. Exit status:
    0 done, 2 usage error (bad flag or value, malformed ``--model``, a budget
    no plan meets), 1 the model could not be built or the command failed on
    it; each failure is one line on stderr, ``remat <command>: error: ...``.

    Example:
        >>> main(["demo", "--steps", "3", "--layers", "4"])  # doctest: +SKIP
        0
    """
    if argv is None:  # the command's own process (not a caller's that passes argv)
        os.environ.setdefault(NVML_CHECK, "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    named = next((a for a in argv if a in COMMANDS), None)
    prog = f"remat {named}" if named else "remat"

    def body() -> int:
        args = build_parser().parse_args(argv)
        status: int = COMMANDS[args.command or "demo"].run(args)
        return status

    return run_command(prog, body)
