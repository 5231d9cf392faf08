"""The ``remat`` command.

``remat demo`` (also what a bare ``remat`` runs) trains the embedded GPT
(:mod:`remat.models`) for a few CPU steps under three strategies and prints
one table:

* ``none``: no checkpointing;
* ``torch``: every block through ``torch.utils.checkpoint.checkpoint``;
* ``remat``: every block through ``remat.checkpoint``;
* ``remat:save_matmuls`` / ``remat:save_matmuls_no_batch`` (benchmark only):
  the same with a selective policy from :mod:`remat.policies`.

Strategies take turns step by step in one process (the order rotates each
round), so drift in machine load hits them alike; time ratios are medians of
per-round ratios. Memory comes from one extra step per strategy under
:func:`remat.memory.track`, apart from the timed steps. Gradients of every
step are compared with those of ``none`` (same weights, batch and seed).

The data and its rendering are separate: :func:`compare_strategies` returns
:class:`StrategyResult` values, :func:`render_table` formats them.

Example:
    >>> from remat.cli import DemoOptions, compare_strategies, render_table
    >>> options = DemoOptions(steps=1, layers=2, batch=2, seq=32)
    >>> results = compare_strategies(options)
    >>> [r.strategy for r in results]
    ['none', 'torch', 'remat']
    >>> all(r.grads_match is not False for r in results)
    True
    >>> text = render_table(results, options)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal, get_args

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from remat import policies
from remat.checkpoint import checkpoint as remat_checkpoint
from remat.errors import CheckpointUsageError
from remat.memory import track
from remat.models import GPT, CheckpointFn, GPTConfig, lm_loss, make_batch

__all__ = [
    "ALL_STRATEGIES",
    "STRATEGIES",
    "DemoOptions",
    "Strategy",
    "StrategyResult",
    "add_demo_arguments",
    "compare_strategies",
    "format_bytes",
    "main",
    "options_from_args",
    "render_table",
]

Strategy = Literal["none", "torch", "remat", "remat:save_matmuls", "remat:save_matmuls_no_batch"]
ALL_STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
"""Every strategy, baseline first; ``benchmarks/run.py`` runs them all."""

STRATEGIES: tuple[Strategy, ...] = ("none", "torch", "remat")
"""What ``remat demo`` compares."""

FORWARD_END = "forward_end"
"""The :class:`~remat.memory.MemoryTracker` mark taken after the loss is computed."""


@dataclass(frozen=True)
class DemoOptions:
    """What ``remat demo`` runs: model depth, batch shape, step counts.

    Example:
        >>> DemoOptions(layers=2).model_config().n_layers
        2
    """

    steps: int = 5
    warmup: int = 1
    layers: int = 6
    batch: int = 4
    seq: int = 256
    seed: int = 0
    lr: float = 1e-2

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("warmup", 0), ("layers", 1), ("batch", 1), ("seq", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise CheckpointUsageError(
                    f"remat demo: {name} must be an int >= {low}, got {value!r}."
                )

    def model_config(self) -> GPTConfig:
        """The embedded GPT's configuration for these options (dropout 0)."""
        return GPTConfig(n_layers=self.layers, seq_len=self.seq)


@dataclass(frozen=True)
class StrategyResult:
    """How one strategy did in :func:`compare_strategies`.

    Attributes:
        strategy: one of :data:`ALL_STRATEGIES`.
        median_step_s: median wall time of a training step (forward, backward,
            SGD update), over the measured steps.
        step_time_ratio: median over rounds of this strategy's step time
            divided by ``none``'s step time in the same round.
        forward_end_bytes: live tensor bytes right after the loss (what is
            kept for backward, plus logits and loss).
        peak_bytes: peak live tensor bytes over forward and backward.
        grads_match: whether every step's gradients equal ``none``'s bitwise;
            ``None`` for ``none`` itself.
        max_grad_abs_diff: largest absolute gradient difference from ``none``.
        step_s: every measured step time, in round order.
    """

    strategy: Strategy
    median_step_s: float
    step_time_ratio: float
    forward_end_bytes: int
    peak_bytes: int
    grads_match: bool | None
    max_grad_abs_diff: float
    step_s: tuple[float, ...]


def compare_strategies(
    options: DemoOptions | None = None,
    *,
    strategies: Sequence[Strategy] = STRATEGIES,
) -> list[StrategyResult]:
    """Train the embedded GPT under each strategy, interleaved, and measure it.

    ``strategies`` must include ``"none"``, the baseline for time ratios and
    gradients. Results come back in the order of ``strategies``.

    Example:
        >>> results = compare_strategies(
        ...     DemoOptions(steps=1, warmup=0, layers=1, batch=1, seq=16),
        ...     strategies=["none", "torch"],
        ... )
        >>> results[1].forward_end_bytes < results[0].forward_end_bytes
        True
    """
    options = options or DemoOptions()
    strategies = _check_strategies(strategies)
    config = options.model_config()
    torch.manual_seed(options.seed)
    base = GPT(config)
    models = {s: copy.deepcopy(base) for s in strategies}
    fns = {s: _checkpoint_fn(s) for s in strategies}
    batches = torch.Generator().manual_seed(options.seed)

    step_s: dict[Strategy, list[float]] = {s: [] for s in strategies}
    ratios: dict[Strategy, list[float]] = {s: [] for s in strategies}
    grad_diff = dict.fromkeys(strategies, 0.0)
    for round_ in range(options.warmup + options.steps):
        idx, targets = make_batch(config, options.batch, batches)
        shift = round_ % len(strategies)
        times: dict[Strategy, float] = {}
        for s in [*strategies[shift:], *strategies[:shift]]:
            # Same dropout masks for every strategy (matters only with dropout > 0).
            torch.manual_seed(options.seed + round_)
            times[s] = _train_step(models[s], fns[s], idx, targets, options.lr)
        for s in strategies:
            grad_diff[s] = max(grad_diff[s], _max_grad_diff(models[s], models["none"]))
            if round_ >= options.warmup:
                step_s[s].append(times[s])
                ratios[s].append(times[s] / times["none"])

    memory = {s: _measure_memory(models[s], fns[s], idx, targets) for s in strategies}
    return [
        StrategyResult(
            strategy=s,
            median_step_s=statistics.median(step_s[s]),
            step_time_ratio=statistics.median(ratios[s]),
            forward_end_bytes=memory[s][0],
            peak_bytes=memory[s][1],
            grads_match=None if s == "none" else grad_diff[s] == 0.0,
            max_grad_abs_diff=grad_diff[s],
            step_s=tuple(step_s[s]),
        )
        for s in strategies
    ]


def render_table(results: Sequence[StrategyResult], options: DemoOptions | None = None) -> str:
    """Format results as a plain-text table, with a title line when ``options`` is given.

    Example:
        >>> row = StrategyResult("none", 0.25, 1.0, 3 * 2**20, 4 * 2**20, None, 0.0, (0.25,))
        >>> print(render_table([row]))
        strategy  step (ms)  vs none  forward-end live  peak live  grads match
        none          250.0    1.00x           3.0 MiB    4.0 MiB  (baseline)
    """
    header = ("strategy", "step (ms)", "vs none", "forward-end live", "peak live", "grads match")
    rows = [
        (
            r.strategy,
            f"{r.median_step_s * 1e3:.1f}",
            f"{r.step_time_ratio:.2f}x",
            format_bytes(r.forward_end_bytes),
            format_bytes(r.peak_bytes),
            _grads_cell(r),
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first, *middle, last = cells
        padded = [first.ljust(widths[0])]
        padded += [c.rjust(w) for c, w in zip(middle, widths[1:-1], strict=True)]
        return "  ".join([*padded, last]).rstrip()

    lines = [line(header), *(line(row) for row in rows)]
    if options is not None:
        lines.insert(0, _title(options))
    return "\n".join(lines)


def format_bytes(nbytes: int) -> str:
    """Bytes in binary units, e.g. ``"3.0 MiB"``.

    Example:
        >>> format_bytes(512), format_bytes(262144), format_bytes(3 * 2**30)
        ('512 B', '256.0 KiB', '3.0 GiB')
    """
    if abs(nbytes) < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


_DEMO_ARGUMENTS = {
    "steps": "measured training steps per strategy",
    "warmup": "unmeasured steps first",
    "layers": "transformer blocks",
    "batch": "sequences per batch",
    "seq": "tokens per sequence",
    "seed": "seed of weights and batches",
}


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``remat demo`` (also used by ``benchmarks/run.py``).

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_demo_arguments(parser)
        >>> parser.parse_args(["--steps", "2"]).steps
        2
    """
    defaults = DemoOptions()
    for name, text in _DEMO_ARGUMENTS.items():
        parser.add_argument(
            f"--{name}",
            type=int,
            default=getattr(defaults, name),
            help=f"{text} (default: %(default)s)",
        )


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """The :class:`DemoOptions` of arguments parsed with :func:`add_demo_arguments`.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_demo_arguments(parser)
        >>> options_from_args(parser.parse_args(["--layers", "2"])).layers
        2
    """
    return DemoOptions(**{name: getattr(args, name) for name in _DEMO_ARGUMENTS})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``remat`` command; returns the exit status.

    With no subcommand, runs ``remat demo`` with its defaults.

    Example:
        >>> main(["demo", "--steps", "3", "--layers", "4"])  # doctest: +SKIP
        0
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        options = options_from_args(args)
    except SystemExit as stop:  # --help, or a bad argument (already reported)
        return stop.code if isinstance(stop.code, int) else 1
    except CheckpointUsageError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    print(render_table(compare_strategies(options), options))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat",
        description="Activation checkpointing for PyTorch. "
        "Without a subcommand, runs `remat demo`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo}")
    demo = sub.add_parser(
        "demo",
        help="compare none / torch / remat checkpointing on the embedded GPT",
        description="Train the embedded GPT for a few CPU steps with no checkpointing, "
        "torch.utils.checkpoint and remat.checkpoint (interleaved), and print step time, "
        "memory at the end of forward, peak memory and whether gradients match.",
    )
    add_demo_arguments(demo)
    # A bare `remat` runs the demo with its defaults.
    parser.set_defaults(**{name: getattr(DemoOptions(), name) for name in _DEMO_ARGUMENTS})
    return parser


def _title(options: DemoOptions) -> str:
    config = options.model_config()
    return (
        f"GPT {config.n_layers} layers x d_model {config.d_model}, seq {config.seq_len}, "
        f"batch {options.batch}; {options.steps} step{'s' * (options.steps != 1)} "
        f"(+{options.warmup} warmup); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


def _check_strategies(strategies: Sequence[Strategy]) -> list[Strategy]:
    unknown = [s for s in strategies if s not in ALL_STRATEGIES]
    if unknown or "none" not in strategies or len(set(strategies)) != len(strategies):
        raise CheckpointUsageError(
            f"compare_strategies: strategies must be distinct names from {list(ALL_STRATEGIES)} "
            f"including 'none' (the baseline), got {list(strategies)!r}."
        )
    return list(strategies)


_POLICIES = {
    "remat:save_matmuls": policies.save_matmuls,
    "remat:save_matmuls_no_batch": policies.save_matmuls_without_batch_dims,
}


def _checkpoint_fn(strategy: Strategy) -> CheckpointFn | None:
    if strategy == "torch":
        return partial(torch_checkpoint, use_reentrant=False)
    if strategy == "remat":
        return partial(remat_checkpoint, use_reentrant=False)
    if strategy in _POLICIES:
        return partial(remat_checkpoint, policy=_POLICIES[strategy])
    return None


def _train_step(
    model: GPT, checkpoint_fn: CheckpointFn | None, idx: Tensor, targets: Tensor, lr: float
) -> float:
    """One SGD step; returns its wall time in seconds. Gradients stay on the model."""
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    torch.autograd.backward(lm_loss(model(idx, checkpoint_fn=checkpoint_fn), targets))
    # Plain SGD: torch.optim would import torch._dynamo, seconds of start-up for a demo.
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.add_(param.grad, alpha=-lr)
    return time.perf_counter() - start


def _measure_memory(
    model: GPT, checkpoint_fn: CheckpointFn | None, idx: Tensor, targets: Tensor
) -> tuple[int, int]:
    """(forward-end bytes, peak bytes) of one forward and backward, no optimizer step."""
    model.zero_grad(set_to_none=True)
    with track() as tracker:
        loss = lm_loss(model(idx, checkpoint_fn=checkpoint_fn), targets)
        tracker.mark(FORWARD_END)
        torch.autograd.backward(loss)
    model.zero_grad(set_to_none=True)
    return tracker.marks[FORWARD_END], tracker.peak_bytes


def _max_grad_diff(model: GPT, reference: GPT) -> float:
    diff = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                return float("inf")
            continue
        diff = max(diff, (p.grad - q.grad).abs().max().item())
    return diff


def _grads_cell(result: StrategyResult) -> str:
    if result.grads_match is None:
        return "(baseline)"
    if result.grads_match:
        return "yes (bitwise)"
    return f"no (max |diff| {result.max_grad_abs_diff:.1e})"


if __name__ == "__main__":
    raise SystemExit(main())
