"""``remat plan``: plan the embedded GPT (or a model of yours) under a budget, apply, measure.

``remat plan --budget 0.5`` profiles the embedded GPT, prints the plan,
applies it and prints predicted versus measured peak and step time.
``--model package.module:factory`` plans a model of yours instead: the
factory is imported (never unpickled) and called with no arguments; it
returns ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``.

Example:
    >>> from remat.planner._command import main
    >>> main(["--budget", "0.6", "--layers", "2", "--seq", "32", "--batch", "2",
    ...       "--repeats", "1", "--steps", "1"])   # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat._demo import GPT, GPTConfig, lm_loss, make_batch
from remat.errors import CheckpointTypeError, CheckpointUsageError, RematError
from remat.memory import track
from remat.planner._planner import Planner
from remat.planner.profile import LossFn, default_loss, run_step
from remat.planner.render import render_measurement, render_pareto_plot

__all__ = ["build_parser", "load_factory", "main", "measure_step"]


def build_parser() -> argparse.ArgumentParser:
    """The ``remat plan`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="remat plan",
        description="Find the fastest checkpoint plan that fits a memory budget, apply it "
        "and compare predicted with measured peak memory and step time.",
    )
    parser.add_argument("--budget", default="0.5",
                        help="bytes ('300MiB', '6GiB', 1000000) or a fraction of the unchecked "
                        "peak in (0, 1] (default 0.5)")
    parser.add_argument("--model", default=None, metavar="PACKAGE.MODULE:FACTORY",
                        help="plan this model instead of the embedded GPT; FACTORY() returns "
                        "(model, inputs) or (model, inputs, loss_fn)")
    parser.add_argument("--solver", default="auto", choices=["auto", "dp", "milp", "greedy", "enumerate"])
    parser.add_argument("--layers", type=int, default=12, help="embedded GPT: blocks (default 12)")
    parser.add_argument("--d-model", type=int, default=64, help="embedded GPT: width (default 64)")
    parser.add_argument("--seq", type=int, default=128, help="embedded GPT: sequence length")
    parser.add_argument("--batch", type=int, default=4, help="embedded GPT: batch size")
    parser.add_argument("--repeats", type=int, default=3, help="timed profiling steps per option")
    parser.add_argument("--steps", type=int, default=3, help="measured steps with the plan applied")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="write the memory-time Pareto plot (needs matplotlib)")
    return parser


def load_factory(spec: str) -> Callable[[], Any]:
    """Import ``package.module:factory`` and return the factory (no unpickling, ever).

    Example:
        >>> load_factory("remat._demo:GPTConfig")().n_layers
        6
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise CheckpointUsageError(
            f"remat plan: --model must look like package.module:factory, got {spec!r}."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CheckpointUsageError(
            f"remat plan: cannot import {module_name!r} for --model ({exc}); check the module "
            "path and that its directory is on PYTHONPATH."
        ) from exc
    factory: Any = module
    for part in attribute.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise CheckpointUsageError(f"remat plan: {module_name!r} has no attribute {attribute!r}.")
    if not callable(factory):
        raise CheckpointTypeError(f"remat plan: {spec} is not callable.")
    return factory  # type: ignore[no-any-return]


def _user_model(spec: str) -> tuple[nn.Module, tuple[Any, ...], LossFn]:
    built = load_factory(spec)()
    if not isinstance(built, tuple) or len(built) not in (2, 3) or not isinstance(built[0], nn.Module):
        raise CheckpointTypeError(
            f"remat plan: {spec}() must return (model, inputs) or (model, inputs, loss_fn) with "
            f"an nn.Module first; it returned {type(built).__name__}."
        )
    inputs = built[1] if isinstance(built[1], tuple) else (built[1],)
    return built[0], inputs, built[2] if len(built) == 3 else default_loss


def _embedded(args: argparse.Namespace) -> tuple[nn.Module, tuple[Any, ...], LossFn]:
    config = GPTConfig(
        n_layers=args.layers, d_model=args.d_model, seq_len=args.seq,
        n_heads=4 if args.d_model % 4 == 0 else 1, d_ff=4 * args.d_model,
    )
    torch.manual_seed(0)
    model = GPT(config)
    idx, targets = make_batch(config, args.batch, torch.Generator().manual_seed(0))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)

    return model, (idx,), loss_fn


def measure_step(
    model: nn.Module, inputs: Sequence[Any], loss_fn: LossFn, steps: int
) -> tuple[int, float]:
    """Peak live bytes of one tracked step, and the median time of ``steps`` untracked ones."""
    model.zero_grad(set_to_none=True)
    with track() as tracker:
        run_step(model, inputs, loss_fn)
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        run_step(model, inputs, loss_fn)
        times.append(time.perf_counter() - started)
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes, statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Run ``remat plan``; returns the exit status (2 for bad input, with a message)."""
    args = build_parser().parse_args(argv)
    try:
        if args.steps < 1 or args.repeats < 1:
            raise CheckpointUsageError("remat plan: --steps and --repeats must be >= 1.")
        budget: int | float | str = args.budget
        try:
            budget = float(args.budget) if "." in args.budget else int(args.budget)
        except ValueError:
            pass  # a string with a unit, parsed by the planner
        model, inputs, loss_fn = _user_model(args.model) if args.model else _embedded(args)
        planner = Planner(model, loss_fn=loss_fn, repeats=args.repeats)
        chosen = planner.plan(inputs, budget=budget, solver=args.solver)
        print(chosen.report())
        with chosen.apply(model):
            peak, step_s = measure_step(model, inputs, loss_fn, args.steps)
        print()
        print(render_measurement(chosen.predicted_peak_bytes, peak, chosen.predicted_step_s, step_s))
        print("within budget" if peak <= chosen.budget_bytes else "OVER BUDGET")
        if args.plot:
            render_pareto_plot(chosen.pareto(), args.plot, chosen=chosen)
            print(f"Pareto plot written to {args.plot}")
    except RematError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
