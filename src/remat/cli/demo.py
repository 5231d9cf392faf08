"""``remat demo``: the embedded GPT trained under each strategy, interleaved, and measured.

Layer: ``remat.cli`` (the application), above :mod:`remat.cli.strategies`.

The strategies (:mod:`remat.cli.strategies`) take turns step by step in one
process (the order rotates each round), so drift in machine load hits them
alike; time ratios are medians of per-round ratios. remat's strategies are
placed on the GPT's blocks (:func:`remat.placement.place`), torch's wraps
each block call. Memory comes from one extra forward and backward per
strategy under :func:`remat.memory.track` (the model's parameters included),
apart from the timed steps. Gradients of every step are compared with those
of ``none`` (same weights, batch and seed); a compressed strategy's are
approximate, and its gradient error is measured on the first step, where
every model still has the same weights. :func:`compare_strategies` returns :class:`StrategyResult` values,
:func:`render_table` formats them, :func:`write_plots` draws them.

Example:
    >>> from remat.cli.demo import DemoOptions, compare_strategies, render_table
    >>> options = DemoOptions(steps=1, layers=2, batch=2, seq=32)
    >>> results = compare_strategies(options, strategies=["none", "torch", "remat"])
    >>> [r.strategy for r in results]
    ['none', 'torch', 'remat']
    >>> all(r.grads_match is not False for r in results)
    True
    >>> text = render_table(results, options)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from remat.cli.console import add_quiet_argument, check_writable, progress_wanted
from remat.cli.console import progress as progress_bar
from remat.cli.strategies import (
    ALL_STRATEGIES,
    COMPRESSED_STRATEGIES,
    Strategy,
    checkpoint_fn,
    setting_of,
)
from remat.errors import CheckpointUsageError, RematError
from remat.memory import (
    FORWARD_END,
    MemoryReport,
    SavedTensorReport,
    format_bytes,
    plot_saved_by_module,
    plot_timeline,
    saved_tensors,
    track,
)
from remat.models import GPT, CheckpointFn, GPTConfig, lm_loss, make_batch
from remat.placement import place

__all__ = [
    "DEFAULT_OUT",
    "STRATEGIES",
    "DemoOptions",
    "StrategyResult",
    "add_arguments",
    "add_demo_arguments",
    "compare_strategies",
    "compression_note",
    "options_from_args",
    "render_table",
    "results_json",
    "run",
    "trade_off_note",
    "write_plots",
]

HELP = "compare checkpointing strategies on the embedded GPT"
DESCRIPTION = (
    "Train the embedded GPT for a few CPU steps with no checkpointing, torch.utils.checkpoint, "
    "remat.checkpoint, remat's policies, offload and compression (interleaved), print step time, "
    "memory at the end of forward, peak memory and whether gradients match (or, compressed, "
    "their error), and draw the plots."
)

STRATEGIES: tuple[Strategy, ...] = (
    "none",
    "torch",
    "remat",
    "remat:save_matmuls",
    "remat:names",
    "remat:offload",
    "remat:save_matmuls+fp8",
    "remat:keep+int8",
)
"""What ``remat demo`` compares: every strategy."""


DEFAULT_OUT = Path("remat-out")
"""Where ``remat demo`` writes its plots (git-ignored)."""


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
        forward_end_bytes: live tensor bytes right after the loss: the
            parameters, what is kept for backward, logits and loss.
        peak_bytes: peak live tensor bytes over forward and backward,
            parameters and gradients included.
        grads_match: whether every step's gradients equal ``none``'s bitwise;
            ``None`` for ``none`` itself.
        max_grad_abs_diff: largest absolute gradient difference from ``none``.
        grad_error: ``||g - g_none|| / ||g_none||`` over every parameter on the
            first step, where both models have the same weights (0 for an exact
            strategy; a compressed one's error).
        step_s: every measured step time, in round order.
        memory: the tracked step behind the two byte counts (not compared,
            not printed).
    """

    strategy: Strategy
    median_step_s: float
    step_time_ratio: float
    forward_end_bytes: int
    peak_bytes: int
    grads_match: bool | None
    max_grad_abs_diff: float
    step_s: tuple[float, ...]
    grad_error: float = 0.0
    memory: MemoryReport | None = field(default=None, compare=False, repr=False)


def compare_strategies(
    options: DemoOptions | None = None,
    *,
    strategies: Sequence[Strategy] = STRATEGIES,
    progress: bool = False,
) -> list[StrategyResult]:
    """Train the embedded GPT under each strategy, interleaved, and measure it.

    ``strategies`` must include ``"none"``, the baseline for time ratios and
    gradients. Results come back in the order of ``strategies``. With
    ``progress``, a progress bar goes to stderr (tqdm when installed).

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
    models = {s: _placed(copy.deepcopy(base), s) for s in strategies}
    fns = {s: checkpoint_fn(s) for s in strategies}
    batches = torch.Generator().manual_seed(options.seed)

    step_s: dict[Strategy, list[float]] = {s: [] for s in strategies}
    ratios: dict[Strategy, list[float]] = {s: [] for s in strategies}
    grad_diff = dict.fromkeys(strategies, 0.0)
    grad_error = dict.fromkeys(strategies, 0.0)
    rounds = options.warmup + options.steps
    total = rounds * len(strategies) + len(strategies)
    with progress_bar(total, "remat demo", enabled=progress) as tick:
        for round_ in range(rounds):
            idx, targets = make_batch(config, options.batch, batches)
            shift = round_ % len(strategies)
            times: dict[Strategy, float] = {}
            for s in [*strategies[shift:], *strategies[:shift]]:
                # Same dropout masks for every strategy (matters only with dropout > 0).
                torch.manual_seed(options.seed + round_)
                times[s] = _train_step(models[s], fns[s], idx, targets, options.lr)
                tick()
            for s in strategies:
                grad_diff[s] = max(grad_diff[s], _max_grad_diff(models[s], models["none"]))
                if round_ == 0:  # the same weights for every model: the gradients' own error
                    grad_error[s] = _relative_grad_error(models[s], models["none"])
                if round_ >= options.warmup:
                    step_s[s].append(times[s])
                    ratios[s].append(times[s] / times["none"])
        memory = {}
        for s in strategies:
            memory[s] = _measure_memory(models[s], fns[s], idx, targets)
            tick()
    return [
        StrategyResult(
            strategy=s,
            median_step_s=statistics.median(step_s[s]),
            step_time_ratio=statistics.median(ratios[s]),
            forward_end_bytes=memory[s].forward_end_bytes,
            peak_bytes=memory[s].peak_bytes,
            grads_match=None if s == "none" else grad_diff[s] == 0.0,
            max_grad_abs_diff=grad_diff[s],
            step_s=tuple(step_s[s]),
            grad_error=grad_error[s],
            memory=memory[s],
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


def trade_off_note(results: Sequence[StrategyResult]) -> str | None:
    """One line on what ``save_matmuls`` bought against full checkpointing, or None without both.

    Honest either way: what it keeps, and whether that bought time here. On a
    CPU with a small model it may not: the matmuls it skips are cheap next to
    intercepting every op in the forward and again in the recomputation
    (``docs/design/performance.md``).

    Example:
        >>> full = StrategyResult("remat", 0.3, 1.3, 10 * 2**20, 20 * 2**20, True, 0.0, (0.3,))
        >>> sac = StrategyResult("remat:save_matmuls", 0.28, 1.2, 40 * 2**20, 44 * 2**20, True, 0.0, (0.28,))
        >>> print(trade_off_note([full, sac]))
        remat:save_matmuls keeps the matmul outputs (30.0 MiB more than remat at the end of the forward) so that the recomputation skips them: 1.20x none against remat's 1.30x, the faster of the two here.
    """
    by_name = {r.strategy: r for r in results}
    full, sac = by_name.get("remat"), by_name.get("remat:save_matmuls")
    if full is None or sac is None:
        return None
    if sac.step_time_ratio < full.step_time_ratio:
        verdict = "the faster of the two here"
    else:
        verdict = (
            "yet slower here: on a CPU, with a model this small, the matmuls it skips cost less "
            "than intercepting every op in the forward and again in the recomputation; on a GPU "
            "the matmuls are most of the recomputation's time"
        )
    kept = format_bytes(max(0, sac.forward_end_bytes - full.forward_end_bytes))
    return (
        f"remat:save_matmuls keeps the matmul outputs ({kept} more than remat at the end of the "
        f"forward) so that the recomputation skips them: {sac.step_time_ratio:.2f}x none against "
        f"remat's {full.step_time_ratio:.2f}x, {verdict}."
    )

def compression_note(results: Sequence[StrategyResult]) -> str | None:
    """One line on what compression bought: bytes kept against the exact strategy it
    shrinks, and the gradient error it costs; None without such a pair.

    Example:
        >>> sac = StrategyResult("remat:save_matmuls", 0.28, 1.2, 40 * 2**20, 44 * 2**20, True, 0.0, (0.28,))
        >>> fp8 = StrategyResult("remat:save_matmuls+fp8", 0.3, 1.3, 22 * 2**20, 30 * 2**20, False, 0.1, (0.3,), 0.02)
        >>> print(compression_note([sac, fp8]))
        remat:save_matmuls+fp8 keeps what remat:save_matmuls keeps in 18.0 MiB less at the end of the forward (1.30x none against 1.20x), for a gradient error of 2.0e-02 on the first step.
    """
    by_name = {r.strategy: r for r in results}
    lines = []
    for compressed, exact in (("remat:save_matmuls+fp8", "remat:save_matmuls"), ("remat:keep+int8", "none")):
        small, large = by_name.get(compressed), by_name.get(exact)  # type: ignore[call-overload]
        if small is None or large is None:
            continue
        less = format_bytes(max(0, large.forward_end_bytes - small.forward_end_bytes))
        lines.append(
            f"{compressed} keeps what {exact} keeps in {less} less at the end of the forward "
            f"({small.step_time_ratio:.2f}x none against {large.step_time_ratio:.2f}x), for a "
            f"gradient error of {small.grad_error:.1e} on the first step."
        )
    return "\n".join(lines) or None


_TIMELINE_FILE = "timeline.png"
_BY_MODULE_FILE = "saved_by_module.png"


def write_plots(
    results: Sequence[StrategyResult], options: DemoOptions, out_dir: Path
) -> list[Path]:
    """Draw the demo's plots into ``out_dir``; returns the files written.

    ``timeline.png``: live memory over one step, one line per strategy.
    ``saved_by_module.png``: bytes each block keeps for backward, per strategy.
    Needs matplotlib (``pip install remat[plot]``).

    Example:
        >>> write_plots(results, options, Path("remat-out"))  # doctest: +SKIP
        [PosixPath('remat-out/timeline.png'), PosixPath('remat-out/saved_by_module.png')]
    """
    timelines: dict[str, MemoryReport] = {r.strategy: r.memory for r in results if r.memory is not None}
    timeline = out_dir / _TIMELINE_FILE
    plot_timeline(timelines, timeline, title=f"Live tensor memory over one step: {_model_title(options)}")
    saved: dict[str, SavedTensorReport] = {r.strategy: _saved_report(r.strategy, options) for r in results}
    by_module = out_dir / _BY_MODULE_FILE
    plot_saved_by_module(saved, by_module, title=f"Kept for backward, by module: {_model_title(options)}")
    return [timeline, by_module]


_DEMO_ARGUMENTS = {
    "steps": "measured training steps per strategy",
    "warmup": "unmeasured steps first",
    "layers": "transformer blocks",
    "batch": "sequences per batch",
    "seq": "tokens per sequence",
    "seed": "seed of weights and batches",
}


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``remat demo`` that set :class:`DemoOptions`.

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``remat demo`` (a bare ``remat`` runs it with their defaults)."""
    add_demo_arguments(parser)
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=(*ALL_STRATEGIES, "all"),
        metavar="NAME",
        help=f"strategies to compare, 'none' included, or 'all' (default: {' '.join(STRATEGIES)})",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where plots go (default: %(default)s)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the options, the environment and every result as JSON")
    add_quiet_argument(parser)


def defaults() -> dict[str, object]:
    """What a bare ``remat`` (no subcommand) runs the demo with."""
    return {
        **{name: getattr(DemoOptions(), name) for name in _DEMO_ARGUMENTS},
        "strategies": None,
        "out": DEFAULT_OUT,
        "no_plots": False,
        "json": None,
        "quiet": False,
    }


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    chosen = args.strategies or STRATEGIES
    strategies = _check_strategies(ALL_STRATEGIES if "all" in chosen else chosen)
    # Output paths are checked before the strategies run, not after.
    if args.json is not None:
        check_writable(args.json, "--json", "remat demo")
    if not args.no_plots:
        check_writable(args.out / _TIMELINE_FILE, "--out", "remat demo")
    results = compare_strategies(
        options, strategies=strategies, progress=progress_wanted(args.quiet)
    )
    print(render_table(results, options))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results_json(results, options), indent=2) + "\n")
    for note in (trade_off_note(results), compression_note(results)):
        if note is not None:
            print(note)
    if "remat:offload" in strategies:
        print("remat:offload keeps block inputs in host memory: on CPU that is the same "
              "memory, so its bytes only drop on an accelerator.")
    if args.no_plots:
        return 0
    try:
        written = write_plots(results, options, args.out)
    except RematError as error:  # matplotlib missing: the table is the result
        print(f"plots skipped: {error}", file=sys.stderr)
        return 0
    print("plots: " + ", ".join(str(path) for path in written))
    return 0


def results_json(results: Sequence[StrategyResult], options: DemoOptions) -> dict[str, object]:
    """What ``remat demo --json`` writes: the options, the model, the environment, every result.

    Each result's numbers come with its memory by category (the timeline is left out).

    Example:
        >>> row = StrategyResult("none", 0.25, 1.0, 3 * 2**20, 4 * 2**20, None, 0.0, (0.25,))
        >>> sorted(results_json([row], DemoOptions()))
        ['environment', 'model', 'options', 'results']
    """
    rows = []
    for result in results:
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name != "memory"}
        if result.memory is not None:
            fields["memory_by_category"] = [dataclasses.asdict(u) for u in result.memory.by_category]
            fields["memory_start_bytes"] = result.memory.start_bytes
        rows.append(fields)
    return {
        "options": dataclasses.asdict(options),
        "model": dataclasses.asdict(options.model_config()),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
        },
        "results": rows,
    }


def _check_strategies(strategies: Sequence[Strategy]) -> list[Strategy]:
    unknown = [s for s in strategies if s not in ALL_STRATEGIES]
    if unknown or "none" not in strategies or len(set(strategies)) != len(strategies):
        raise CheckpointUsageError(
            f"compare_strategies: strategies must be distinct names from {list(ALL_STRATEGIES)} "
            f"including 'none' (the baseline), got {list(strategies)!r}."
        )
    return list(strategies)


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
) -> MemoryReport:
    """The tracked forward and backward (no optimizer step), parameters included."""
    model.zero_grad(set_to_none=True)
    with track(model) as tracker:
        loss = lm_loss(model(idx, checkpoint_fn=checkpoint_fn), targets)
        tracker.mark(FORWARD_END)
        torch.autograd.backward(loss)
        del loss
    model.zero_grad(set_to_none=True)
    return tracker.report()


def _placed(model: GPT, strategy: Strategy) -> GPT:
    """``model`` with remat's ``strategy`` placed on its blocks (none and torch: as it is)."""
    setting = setting_of(strategy)
    if setting is not None:
        place(model, {f"blocks.{index}": setting for index in range(len(model.blocks))})
    return model


def _saved_report(strategy: Strategy, options: DemoOptions) -> SavedTensorReport:
    config = options.model_config()
    torch.manual_seed(options.seed)
    model = _placed(GPT(config), strategy)
    idx, _ = make_batch(config, options.batch, torch.Generator().manual_seed(options.seed))
    return saved_tensors(model, idx, checkpoint_fn=checkpoint_fn(strategy))


def _max_grad_diff(model: GPT, reference: GPT) -> float:
    diff = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                return float("inf")
            continue
        diff = max(diff, (p.grad - q.grad).abs().max().item())
    return diff


def _model_title_of(config: GPTConfig, batch: int) -> str:
    return (
        f"GPT {config.n_layers} layers x d_model {config.d_model}, seq {config.seq_len}, "
        f"batch {batch}"
    )


def _model_title(options: DemoOptions) -> str:
    return _model_title_of(options.model_config(), options.batch)


def _title(options: DemoOptions) -> str:
    return (
        f"{_model_title(options)}; {options.steps} step{'s' * (options.steps != 1)} "
        f"(+{options.warmup} warmup); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        "memory includes parameters"
    )


def _relative_grad_error(model: GPT, reference: GPT) -> float:
    """``||g - g_ref|| / ||g_ref||`` over every parameter's gradient."""
    got = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    want = [p.grad.flatten() for p in reference.parameters() if p.grad is not None]
    if len(got) != len(want):
        return float("inf")
    difference, norm = torch.cat(got) - torch.cat(want), torch.cat(want).norm()
    return float(difference.norm() / norm) if norm else 0.0


def _grads_cell(result: StrategyResult) -> str:
    if result.grads_match is None:
        return "(baseline)"
    if result.grads_match:
        return "yes (bitwise)"
    if result.strategy in COMPRESSED_STRATEGIES:
        return f"approx. (error {result.grad_error:.1e})"
    return f"no (max |diff| {result.max_grad_abs_diff:.1e})"
