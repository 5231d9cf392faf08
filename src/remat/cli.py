"""The ``remat`` command.

``remat demo`` (also what a bare ``remat`` runs) trains the embedded GPT
(:mod:`remat._demo`) for a few CPU steps under each strategy and prints one
table; with matplotlib installed it also draws the memory timeline of a step
per strategy and the bytes each module keeps for backward (``remat-out/``):

* ``none``: no checkpointing;
* ``torch``: every block through ``torch.utils.checkpoint.checkpoint``;
* ``remat``: every block through ``remat.checkpoint`` (full recomputation);
* ``remat:save_matmuls``: the same with :data:`remat.policies.save_matmuls`;
* ``remat:names``: keep only the tensors the blocks name ``attn_out``
  (:func:`remat.policies.save_only_names`);
* ``remat:offload``: checkpoint every block inside ``remat.offload()``, so
  the blocks' inputs wait in host memory (saves device memory on CUDA; on CPU
  the host copy is CPU memory too, so the counts do not drop);
* ``remat:save_matmuls_no_batch`` (benchmark only).

Strategies take turns step by step in one process (the order rotates each
round), so drift in machine load hits them alike; time ratios are medians of
per-round ratios. Memory comes from one extra forward and backward per
strategy under :func:`remat.memory.track` (the model's parameters included),
apart from the timed steps. Gradients of every step are compared with those
of ``none`` (same weights, batch and seed).

Other subcommands: ``remat report`` prints the saved-tensor report of a
model's forward, ``remat estimate`` the memory of a training step at any size
(on meta tensors: the embedded GPT family by ``--preset``, or any model),
``remat plan`` hands over to the planner. All three read their model the
same way (:mod:`remat._models`): ``--model gpt|mlp|convnet``, ``--model
package.module:factory`` or ``--hf-config path/to/config.json``. Every
command exits 0 when done, 2 on a usage error and 1 when the model cannot be
built, with one line on stderr (:mod:`remat._console`); progress bars go to
stderr only on a terminal, never with ``--quiet``.

The data and its rendering are separate: :func:`compare_strategies` returns
:class:`StrategyResult` values, :func:`render_table` formats them.

Example:
    >>> from remat.cli import DemoOptions, compare_strategies, render_table
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
import importlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from remat import policies
from remat._console import (
    CommandParser,
    add_quiet_argument,
    progress_wanted,
    run_command,
)
from remat._console import progress as progress_bar
from remat._demo import GPT, CheckpointFn, GPTConfig, lm_loss, make_batch
from remat._models import (
    BUILTIN_MODELS,
    FACTORY_CONTRACT,
    HF_DEFAULT_SEQ,
    LoadedModel,
    ModelLoadError,
    ModelRequest,
    load_model,
    repeated_blocks,
)
from remat.checkpoint import checkpoint as remat_checkpoint
from remat.errors import CheckpointUsageError, RematError
from remat.memory import (
    FORWARD_END,
    PRESETS,
    MemoryReport,
    SavedTensorReport,
    format_bytes,
    plot_saved_by_module,
    plot_timeline,
    render_memory_report,
    render_saved_tensors,
    saved_tensors,
    track,
)
from remat.memory._estimate import track_training_step
from remat.nn import apply_activation_checkpointing, checkpoint_wrapper
from remat.offload import offload
from remat.planner.profile import default_loss

__all__ = [
    "ALL_STRATEGIES",
    "DEFAULT_OUT",
    "STRATEGIES",
    "DemoOptions",
    "Strategy",
    "StrategyResult",
    "add_demo_arguments",
    "compare_strategies",
    "format_bytes",
    "load_factory",
    "main",
    "options_from_args",
    "render_table",
    "tiny_gpt",
    "trade_off_note",
    "write_plots",
]

Strategy = Literal[
    "none",
    "torch",
    "remat",
    "remat:save_matmuls",
    "remat:save_matmuls_no_batch",
    "remat:names",
    "remat:offload",
]
ALL_STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
"""Every strategy, baseline first; ``benchmarks/run.py`` runs them all."""

STRATEGIES: tuple[Strategy, ...] = (
    "none",
    "torch",
    "remat",
    "remat:save_matmuls",
    "remat:names",
    "remat:offload",
)
"""What ``remat demo`` compares."""

DEFAULT_OUT = Path("remat-out")
"""Where ``remat demo`` writes its plots (git-ignored)."""

ATTENTION_NAME = "attn_out"
"""The name the embedded GPT's blocks give their attention outputs."""


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
    models = {s: copy.deepcopy(base) for s in strategies}
    fns = {s: _checkpoint_fn(s) for s in strategies}
    batches = torch.Generator().manual_seed(options.seed)

    step_s: dict[Strategy, list[float]] = {s: [] for s in strategies}
    ratios: dict[Strategy, list[float]] = {s: [] for s in strategies}
    grad_diff = dict.fromkeys(strategies, 0.0)
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
    timeline = out_dir / "timeline.png"
    plot_timeline(timelines, timeline, title=f"Live tensor memory over one step: {_model_title(options)}")
    saved: dict[str, SavedTensorReport] = {r.strategy: _saved_report(r.strategy, options) for r in results}
    by_module = out_dir / "saved_by_module.png"
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


def load_factory(spec: str) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """Import ``package.module:factory``, call it, return (model, args, kwargs).

    The factory follows the contract of every ``remat`` command
    (:data:`remat._models.FACTORY_CONTRACT`): it takes no arguments and
    returns ``(model, args)``, ``(model, args, kwargs)``, ``(model, args,
    loss_fn)`` or ``(model, args, kwargs, loss_fn)``; the loss function is
    not returned here. Only Python code is imported; no file is unpickled.
    A malformed spec is a ``CheckpointUsageError``; a factory that does not
    import, raises or returns the wrong shape a ``ModelLoadError``.

    Example:
        >>> model, args, kwargs = load_factory("remat.cli:tiny_gpt")
        >>> type(model).__name__, tuple(args[0].shape)
        ('GPT', (2, 32))
    """
    loaded = load_model(ModelRequest(command="remat", model=spec))
    return loaded.model, loaded.args, loaded.kwargs


def tiny_gpt() -> tuple[nn.Module, tuple[Tensor]]:
    """A factory for ``--model remat.cli:tiny_gpt``: a 2-block GPT and a batch of token ids.

    Example:
        >>> model, (idx,) = tiny_gpt()
    """
    config = GPTConfig(n_layers=2, seq_len=32)
    torch.manual_seed(0)
    idx, _ = make_batch(config, 2, torch.Generator().manual_seed(0))
    return GPT(config), (idx,)


_COMMANDS = ("demo", "report", "estimate", "plan")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``remat`` command; returns the exit status.

    With no subcommand, runs ``remat demo`` with its defaults. Exit status:
    0 done, 2 usage error (bad flag or value, malformed ``--model``), 1 the
    model could not be built or the command failed on it; each failure is one
    line on stderr, ``remat <command>: error: ...``.

    Example:
        >>> main(["demo", "--steps", "3", "--layers", "4"])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        return _plan(argv[1:])
    parser = _parser()
    named = next((a for a in argv if a in _COMMANDS), None)
    prog = f"remat {named}" if named else "remat"

    def body() -> int:
        args = parser.parse_args(argv)
        command = args.command or "demo"
        if command == "demo":
            return _demo(args)
        if command == "report":
            return _report(args)
        return _estimate(args)

    return run_command(prog, body)


# -- subcommands ---------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    strategies = _check_strategies(args.strategies or STRATEGIES)
    results = compare_strategies(
        options, strategies=strategies, progress=progress_wanted(args.quiet)
    )
    print(render_table(results, options))
    note = trade_off_note(results)
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


def _report(args: argparse.Namespace) -> int:
    loaded = load_model(
        ModelRequest(
            command="remat report",
            model=args.model,
            hf_config=args.hf_config,
            batch=args.batch,
            seq=args.seq,
            gpt=GPTConfig(n_layers=args.layers, seq_len=args.seq),
        )
    )
    _apply_strategy(loaded, args.strategy, "remat report")
    for note in loaded.notes:
        print(note)
    print(f"{args.strategy}: {loaded.title}")
    report = saved_tensors(loaded.model, *loaded.args, **loaded.kwargs)
    print(render_saved_tensors(report, limit=args.limit))
    return 0


_GPT_SHAPE_FLAGS = {
    "n_layers": "layers",
    "d_model": "d_model",
    "n_heads": "heads",
    "d_ff": "d_ff",
    "vocab_size": "vocab",
}


def _estimate(args: argparse.Namespace) -> int:
    shape = {field_: getattr(args, flag) for field_, flag in _GPT_SHAPE_FLAGS.items()}
    given = [f"--{_GPT_SHAPE_FLAGS[f].replace('_', '-')}" for f, v in shape.items() if v is not None]
    if args.preset is not None:
        given.insert(0, "--preset")
    if (args.model not in (None, "gpt") or args.hf_config is not None) and given:
        raise CheckpointUsageError(
            f"remat estimate: {', '.join(given)} shape the built-in GPT; they do not apply "
            "to --model package.module:factory, mlp, convnet or --hf-config."
        )
    base = PRESETS[args.preset or "tiny"]
    overrides = {**shape, "seq_len": args.seq}
    config = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    request = ModelRequest(
        command="remat estimate",
        model=args.model,
        hf_config=args.hf_config,
        batch=args.batch,
        seq=args.seq,
        gpt=config,
        device="meta",
        dtype=getattr(torch, args.dtype),
        attention=args.attention,
    )
    steps = 1 if args.optimizer == "none" else 2
    start = time.perf_counter()
    with progress_bar(1 + steps, "remat estimate", enabled=progress_wanted(args.quiet)) as tick:
        loaded = load_model(request)
        _apply_strategy(loaded, args.strategy, "remat estimate")
        tick("first step" if steps == 2 else "tracked step")
        model, loss_fn = loaded.model, loaded.loss_fn or default_loss
        try:
            report = track_training_step(
                model,
                lambda: loss_fn(model(*loaded.args, **loaded.kwargs)),
                optimizer=args.optimizer,
                on_step=lambda: tick("tracked step"),
            )
        except (RuntimeError, NotImplementedError, ValueError) as error:
            if loaded.builtin_gpt or isinstance(error, RematError):
                raise
            raise ModelLoadError(
                f"a training step of {loaded.title} failed on meta tensors "
                f"({type(error).__name__}: {error}); a model that reads tensor values "
                "(.item(), data-dependent shapes) cannot be estimated without data."
            ) from error
    elapsed_s = time.perf_counter() - start
    parameter_count = sum(p.numel() for p in model.parameters())
    for note in loaded.notes:
        print(note)
    print(
        f"{loaded.title}; {_count(parameter_count)} parameters, {args.dtype}, optimizer "
        f"{args.optimizer}, strategy {args.strategy}, {args.attention} attention"
    )
    print(f"estimated on meta tensors in {elapsed_s:.1f} s (nothing allocated)")
    print()
    print(render_memory_report(report, top_modules=args.top))
    if args.json is not None:
        payload = {
            "model": loaded.title,
            "config": _config_dict(loaded, config),
            "batch": args.batch,
            "dtype": args.dtype,
            "optimizer": args.optimizer,
            "strategy": args.strategy,
            "parameter_count": parameter_count,
            "peak_bytes": report.peak_bytes,
            "forward_end_bytes": report.forward_end_bytes,
            "by_category": [dataclasses.asdict(u) for u in report.by_category],
            "elapsed_s": elapsed_s,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def _config_dict(loaded: LoadedModel, config: GPTConfig) -> dict[str, Any] | None:
    """The model's configuration for the JSON output: the GPT's, a transformers config's, or none."""
    if loaded.builtin_gpt:
        return dataclasses.asdict(config)
    hf_config = getattr(loaded.model, "config", None)
    to_json = getattr(hf_config, "to_json_string", None)
    if callable(to_json):
        parsed: dict[str, Any] = json.loads(to_json())
        return parsed
    return None


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _plan(argv: list[str]) -> int:
    try:
        command = importlib.import_module("remat.planner._command")
    except ImportError as error:
        print(
            f"remat plan: error: `remat plan` is not available in this installation ({error}).",
            file=sys.stderr,
        )
        return 2
    status: int = command.main(argv)
    return status


_MODEL_HELP = (
    f"{' | '.join(BUILTIN_MODELS)} (built-in; default gpt) or package.module:FACTORY, where "
    f"{FACTORY_CONTRACT}"
)
_HF_CONFIG_HELP = (
    "a HuggingFace config.json (or a directory holding one): the causal LM it describes, with "
    "random weights and use_cache=False; nothing is downloaded (pip install remat[hf])"
)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="NAME|MODULE:FACTORY", default=None, help=_MODEL_HELP)
    source.add_argument("--hf-config", metavar="PATH", default=None, help=_HF_CONFIG_HELP)


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="remat",
        description="Activation checkpointing for PyTorch. "
        "Without a subcommand, runs `remat demo`.",
        epilog="Exit status: 0 done, 2 usage error, 1 the model could not be built or the "
        "command failed on it (one line on stderr).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,report,estimate,plan}")
    demo = sub.add_parser(
        "demo",
        help="compare checkpointing strategies on the embedded GPT",
        description="Train the embedded GPT for a few CPU steps with no checkpointing, "
        "torch.utils.checkpoint, remat.checkpoint and remat's policies and offload "
        "(interleaved), print step time, memory at the end of forward, peak memory and "
        "whether gradients match, and draw the plots.",
    )
    add_demo_arguments(demo)
    demo.add_argument(
        "--strategies",
        nargs="+",
        choices=ALL_STRATEGIES,
        metavar="NAME",
        help=f"strategies to compare, 'none' included (default: {' '.join(STRATEGIES)})",
    )
    demo.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where plots go (default: %(default)s)")
    demo.add_argument("--no-plots", action="store_true", help="print the table only")
    add_quiet_argument(demo)

    report = sub.add_parser(
        "report",
        help="list the tensors a forward keeps for backward",
        description="Run one forward and list every tensor it saves for backward: shape, dtype, "
        "bytes, producing op, module, source line and fate (kept, dropped by a checkpoint, "
        "saved or offloaded by a policy, offloaded).",
    )
    _add_model_arguments(report)
    report.add_argument("--strategy", choices=ALL_STRATEGIES, default="none",
                        help="checkpointing of the model's blocks (the embedded GPT's, or the "
                        "children of the model's largest nn.ModuleList) (default: %(default)s)")
    report.add_argument("--layers", type=int, default=2, help="embedded GPT blocks (default: %(default)s)")
    report.add_argument("--batch", type=int, default=2, help="sequences (default: %(default)s)")
    report.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    report.add_argument("--limit", type=int, default=None, help="list at most this many tensors")

    estimate = sub.add_parser(
        "estimate",
        help="estimate a training step's memory at any size, on meta tensors",
        description="Track one training step (forward, backward, optimizer) of a model on meta "
        "tensors: nothing is allocated, so a 7B-parameter step fits on a laptop. The model: the "
        "embedded GPT family (--preset and the shape flags), --model or --hf-config.",
    )
    _add_model_arguments(estimate)
    presets = ", ".join(f"{name} ({_count(c.parameter_count())})" for name, c in PRESETS.items())
    estimate.add_argument("--preset", choices=list(PRESETS), default=None,
                          help=f"embedded GPT shape to start from, by parameter count: {presets} "
                          "(default: tiny)")
    for flag, text in (("layers", "blocks"), ("d-model", "width"), ("heads", "attention heads"),
                       ("d-ff", "MLP width"), ("vocab", "vocabulary size")):
        estimate.add_argument(f"--{flag}", type=int, default=None,
                              help=f"embedded GPT: {text} (overrides the preset)")
    estimate.add_argument("--seq", type=int, default=None,
                          help="tokens per sequence (default: the preset's; with --hf-config "
                          f"the config's positions, at most {HF_DEFAULT_SEQ})")
    estimate.add_argument("--batch", type=int, default=1, help="sequences per batch (default: %(default)s)")
    estimate.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    estimate.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    estimate.add_argument("--strategy", choices=_ESTIMATE_STRATEGIES, default="none",
                          help="checkpointing of each block (default: %(default)s)")
    estimate.add_argument("--attention", choices=("fused", "math"), default="fused",
                          help="attention kernel to account for (default: %(default)s)")
    estimate.add_argument("--top", type=int, default=10, help="modules to list (default: %(default)s)")
    estimate.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write JSON")
    add_quiet_argument(estimate)

    sub.add_parser(
        "plan",
        help="plan checkpointing under a memory budget (see `remat plan --help`)",
        add_help=False,
    )
    # A bare `remat` runs the demo with its defaults.
    parser.set_defaults(
        **{name: getattr(DemoOptions(), name) for name in _DEMO_ARGUMENTS},
        strategies=None,
        out=DEFAULT_OUT,
        no_plots=False,
        quiet=False,
    )
    return parser


# -- strategies ----------------------------------------------------------------


# Strategies that need no host memory: these also run on meta tensors.
_ESTIMATE_STRATEGIES = ("none", "torch", "remat", "remat:save_matmuls", "remat:save_matmuls_no_batch", "remat:names")


def _checkpoint_fn(strategy: str) -> CheckpointFn | None:
    if strategy == "torch":
        return partial(torch_checkpoint, use_reentrant=False)
    if strategy == "remat":
        return partial(remat_checkpoint, use_reentrant=False)
    if strategy == "remat:save_matmuls":
        return partial(remat_checkpoint, policy=policies.save_matmuls)
    if strategy == "remat:save_matmuls_no_batch":
        return partial(remat_checkpoint, policy=policies.save_matmuls_without_batch_dims)
    if strategy == "remat:names":
        return partial(remat_checkpoint, policy=policies.save_only_names(ATTENTION_NAME))
    if strategy == "remat:offload":
        return _offloaded_checkpoint
    return None


def _offloaded_checkpoint(block: Any, *args: Any, **kwargs: Any) -> Any:
    """Checkpoint a block and keep its inputs in host memory until backward."""
    with offload(min_bytes=0):
        return remat_checkpoint(block, *args, use_reentrant=False, **kwargs)


def _apply_strategy(loaded: LoadedModel, strategy: str, command: str) -> None:
    """Checkpoint the model's blocks as ``strategy`` says (in place).

    The embedded GPT takes the checkpoint function in its forward; any other
    model gets the children of its largest ``nn.ModuleList`` wrapped.
    """
    fn = _checkpoint_fn(strategy)
    if fn is None:
        return
    if loaded.builtin_gpt:
        loaded.kwargs["checkpoint_fn"] = fn
        return
    blocks = {id(block) for block in repeated_blocks(loaded.model)}
    if not blocks:
        raise CheckpointUsageError(
            f"{command}: --strategy {strategy} checkpoints the model's repeated blocks (the "
            f"children of its largest nn.ModuleList), and {loaded.title} has no nn.ModuleList; "
            "use --strategy none."
        )
    apply_activation_checkpointing(
        loaded.model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_fn=fn),
        check_fn=lambda module: id(module) in blocks,
    )


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


def _saved_report(strategy: str, options: DemoOptions) -> SavedTensorReport:
    config = options.model_config()
    torch.manual_seed(options.seed)
    model = GPT(config)
    idx, _ = make_batch(config, options.batch, torch.Generator().manual_seed(options.seed))
    return saved_tensors(model, idx, checkpoint_fn=_checkpoint_fn(strategy))


def _max_grad_diff(model: GPT, reference: GPT) -> float:
    diff = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                return float("inf")
            continue
        diff = max(diff, (p.grad - q.grad).abs().max().item())
    return diff


# -- formatting ----------------------------------------------------------------


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


def _grads_cell(result: StrategyResult) -> str:
    if result.grads_match is None:
        return "(baseline)"
    if result.grads_match:
        return "yes (bitwise)"
    return f"no (max |diff| {result.max_grad_abs_diff:.1e})"


if __name__ == "__main__":
    raise SystemExit(main())
