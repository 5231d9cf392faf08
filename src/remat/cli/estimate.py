"""``remat estimate``: the memory of a training step at any size, without allocating it.

Layer: ``remat.cli`` (the application), above :mod:`remat.cli.strategies`.

On one process the model is built on the ``meta`` device (shapes and
storage sizes, no data) and :func:`remat.memory.track_training_step` counts
a steady-state step; with ``--world-size N --fsdp [--tp K]`` one rank's step
runs with the real FSDP2 and tensor-parallel code on fake tensors, the other
ranks simulated (:func:`remat.memory.estimate_sharded_step`), and
``--measure`` also runs it for real on local processes.

The embedded GPT's presets are named by their parameter count
(:data:`remat.models.PRESETS`); :func:`estimate_training_step` estimates one in Python.

Example:
    >>> from remat.cli.estimate import estimate_training_step
    >>> from remat.models import GPTConfig
    >>> est = estimate_training_step(GPTConfig(n_layers=2, seq_len=64), batch=2)
    >>> est.report.peak_bytes > est.parameter_count * 4 * 3   # params, grads, Adam x2
    True
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from remat._compat.fake import fake_tensor_mode
from remat.cli.arguments import (
    add_model_arguments,
    add_sharding_arguments,
    model_request,
    sharding_from,
)
from remat.cli.console import add_quiet_argument, check_writable, progress_wanted
from remat.cli.console import progress as progress_bar
from remat.cli.loader import HF_DEFAULT_SEQ, LoadedModel, ModelRequest, load_model
from remat.cli.pipelined import PipelineCase, add_pipeline_arguments, pipeline_from, render_ranks
from remat.cli.strategies import ESTIMATE_STRATEGIES, apply_strategy, budget_setting
from remat.errors import CheckpointUsageError, ModelLoadError, RematError
from remat.launch import run_on_ranks
from remat.memory import (
    MemoryReport,
    Pipeline,
    Sharding,
    estimate_sharded_step,
    format_bytes,
    measure_training_step,
    render_memory_report,
    shard_model,
    statically_compiled,
    track_training_step,
)
from remat.memory._estimate import Optimizer
from remat.memory._render import format_table
from remat.models import (
    GPT_TP_PLAN,
    PRESETS,
    Attention,
    CheckpointFn,
    GPTConfig,
    lm_loss,
    meta_model,
)
from remat.placement import CompileSpec
from remat.planner.step import default_loss

__all__ = [
    "MeasuredStep",
    "ShardedCase",
    "StepEstimate",
    "add_arguments",
    "estimate_training_step",
    "measure_compiled_sharded_steps",
    "measure_sharded_steps",
    "render_measured",
    "run",
]

HELP = "estimate a training step's memory at any size, on meta tensors"
DESCRIPTION = (
    "Track one training step (forward, backward, optimizer) of a model on meta tensors: nothing "
    "is allocated, so a 7B-parameter step fits on a laptop. The model: the embedded GPT family "
    "(--preset and the shape flags), --model or --hf-config."
)

@dataclass(frozen=True)
class StepEstimate:
    """The estimated memory of one training step of the embedded GPT.

    Attributes:
        config: the model shape (``seq_len`` is the sequence length used).
        batch: sequences per batch.
        dtype: parameter and activation dtype, e.g. ``"torch.bfloat16"``.
        optimizer: ``"adamw"``, ``"sgd"`` (no momentum: no state) or ``"none"``.
        parameter_count: number of parameters.
        report: the tracked step (forward, backward, optimizer step).
        elapsed_s: wall time the estimate took.
    """

    config: GPTConfig
    batch: int
    dtype: str
    optimizer: Optimizer
    parameter_count: int
    report: MemoryReport
    elapsed_s: float


def estimate_training_step(
    config: GPTConfig,
    *,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    optimizer: Optimizer = "adamw",
    checkpoint_fn: CheckpointFn | None = None,
    attention: Attention = "fused",
) -> StepEstimate:
    """Track one training step of a meta-device GPT of this shape.

    ``checkpoint_fn`` runs each block as in :class:`remat.models.GPT`
    (e.g. ``functools.partial(remat.checkpoint, policy=...)``).

    Example:
        >>> import functools, remat
        >>> from remat.cli.estimate import estimate_training_step
        >>> from remat.models import GPTConfig
        >>> config = GPTConfig(n_layers=4, seq_len=128)
        >>> plain = estimate_training_step(config, batch=4)
        >>> ckpt = estimate_training_step(config, batch=4, checkpoint_fn=remat.checkpoint)
        >>> ckpt.report.forward_end_bytes < plain.report.forward_end_bytes
        True
    """
    if not isinstance(batch, int) or batch < 1:
        raise CheckpointUsageError(f"estimate_training_step: batch must be an int >= 1, got {batch!r}.")
    if optimizer not in ("adamw", "sgd", "none"):
        raise CheckpointUsageError(
            f"estimate_training_step: optimizer must be 'adamw', 'sgd' or 'none', got {optimizer!r}."
        )
    if attention not in ("fused", "math"):
        raise CheckpointUsageError(
            f"estimate_training_step: attention must be 'fused' or 'math', got {attention!r}."
        )
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointUsageError(
            f"estimate_training_step: dtype must be a floating torch.dtype, got {dtype!r}."
        )
    start = time.perf_counter()
    model = meta_model(config, dtype=dtype, attention=attention)
    idx = torch.zeros(batch, config.seq_len, dtype=torch.long, device="meta")
    report = track_training_step(
        model, lambda: lm_loss(model(idx, checkpoint_fn=checkpoint_fn), idx), optimizer=optimizer
    )
    return StepEstimate(
        config=config,
        batch=batch,
        dtype=str(dtype),
        optimizer=optimizer,
        parameter_count=sum(p.numel() for p in model.parameters()),
        report=report,
        elapsed_s=time.perf_counter() - start,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``remat estimate``."""
    add_model_arguments(parser)
    presets = ", ".join(f"{name} ({_count(c.parameter_count())})" for name, c in PRESETS.items())
    parser.add_argument("--preset", choices=list(PRESETS), default=None,
                        help=f"embedded GPT shape to start from, by parameter count: {presets} "
                        "(default: tiny)")
    for flag, text in (("layers", "blocks"), ("d-model", "width"), ("heads", "attention heads"),
                       ("d-ff", "MLP width"), ("vocab", "vocabulary size")):
        parser.add_argument(f"--{flag}", type=int, default=None,
                            help=f"embedded GPT: {text} (overrides the preset)")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per sequence (default: the preset's; with --hf-config "
                        f"the config's positions, at most {HF_DEFAULT_SEQ})")
    parser.add_argument("--batch", type=int, default=1, help="sequences per batch (default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    parser.add_argument("--strategy", type=_estimate_strategy, default="none", metavar="STRATEGY",
                        help=f"checkpointing of each block: {', '.join(ESTIMATE_STRATEGIES)}, or with "
                        "--compile budget:<fraction> (the compiler plans each block under that "
                        "fraction of its activation memory; torch 2.13+) (default: %(default)s)")
    parser.add_argument("--attention", choices=("fused", "math"), default="fused",
                        help="attention kernel to account for (default: %(default)s)")
    parser.add_argument("--compile", action="store_true",
                        help="each block compiled on its own (fullgraph=True, inductor), as torchtitan "
                        "compiles them: estimated on fake tensors from what the compiler decides at "
                        "trace time (its partitioner's saved tensors, its buffer plan), "
                        "with no kernel run, at any size and --world-size; --measure also runs it")
    parser.add_argument("--top", type=int, default=10, help="modules to list (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write JSON")
    sharded = add_sharding_arguments(
        parser,
        "one rank's memory when the step is split over ranks; the ranks are simulated in this "
        "process on fake tensors, so any --world-size costs the same",
    )
    sharded.add_argument("--measure", action="store_true",
                         help="also run the step for real, on N local CPU processes (gloo) with "
                         "--world-size, in this process without (measured against estimated; "
                         "small models only)")
    add_pipeline_arguments(
        parser,
        "every pipeline rank's memory under a schedule of torch.distributed.pipelining: the "
        "model cut into stages, each rank's steps simulated in this process on fake tensors "
        "(the microbatches in flight are the schedule's own)",
    )
    add_quiet_argument(parser)


def _estimate_strategy(text: str) -> str:
    """``--strategy``: one that needs no host memory (fake tensors have none), or a budget."""
    if text in ESTIMATE_STRATEGIES:
        return text
    if text.startswith("budget:"):
        try:
            budget_setting(text, "remat estimate", CompileSpec())  # the fraction, checked here
        except RematError as error:
            raise argparse.ArgumentTypeError(f"{error} (budget:<fraction>, with --compile)") from error
        return text
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose one of {', '.join(ESTIMATE_STRATEGIES)}, or "
        "budget:<fraction> with --compile)"
    )


_GPT_SHAPE_FLAGS = {
    "n_layers": "layers",
    "d_model": "d_model",
    "n_heads": "heads",
    "d_ff": "d_ff",
    "vocab_size": "vocab",
}



def run(args: argparse.Namespace) -> int:
    """Run ``remat estimate``; returns the exit status."""
    if args.json is not None:  # before the work, not after
        check_writable(args.json, "--json", "remat estimate")
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
    request = model_request(
        args, "remat estimate", gpt=config, device="meta", dtype=getattr(torch, args.dtype),
        attention=args.attention,
    )
    pipeline = pipeline_from(args, "remat estimate")
    if pipeline is not None:
        return _estimate_pipelined(args, request, pipeline)
    sharding = sharding_from(args, "remat estimate")
    if sharding is not None:
        return _estimate_sharded(args, request, sharding)
    if args.compile:
        return _estimate_compiled(args, request)
    if args.measure:
        raise CheckpointUsageError(
            "remat estimate: --measure runs the step for real: with --world-size N (and --fsdp "
            "and/or --tp K) on local processes, or with --compile in this process."
        )
    steps = 1 if args.optimizer == "none" else 2
    start = time.perf_counter()
    with progress_bar(1 + steps, "remat estimate", enabled=progress_wanted(args.quiet)) as tick:
        loaded = load_model(request)
        apply_strategy(loaded, args.strategy, "remat estimate")
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
    parameter_count = _print_title(loaded, args, f"{args.attention} attention")
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
        _write_json(args.json, payload)
    return 0


def _print_title(loaded: LoadedModel, args: argparse.Namespace, how: str) -> int:
    """Print the loader's notes and the model's line; returns its parameter count."""
    parameter_count = sum(p.numel() for p in loaded.model.parameters())
    for note in loaded.notes:
        print(note)
    print(
        f"{loaded.title}; {_count(parameter_count)} parameters, {args.dtype}, optimizer "
        f"{args.optimizer}, strategy {args.strategy}, {how}"
    )
    return parameter_count


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def _estimate_compiled(args: argparse.Namespace, request: ModelRequest) -> int:
    """``remat estimate --compile [--measure]``: one step with every block compiled,
    estimated on fake tensors (and with ``--measure`` also run and measured here)."""
    start = time.perf_counter()
    steps = 2 if args.measure else 1
    with progress_bar(steps, "remat estimate", enabled=progress_wanted(args.quiet)) as tick:
        fake = fake_tensor_mode()
        with fake:
            loaded = load_model(dataclasses.replace(request, device="fake"))
        apply_strategy(loaded, args.strategy, "remat estimate", compile=CompileSpec())
        model, loss_fn = loaded.model, loaded.loss_fn or default_loss
        with statically_compiled(model):
            report = track_training_step(
                model, lambda: loss_fn(model(*loaded.args, **loaded.kwargs)), optimizer=args.optimizer
            )
        elapsed_s = time.perf_counter() - start
        tick("estimated")
        measured = None
        if args.measure:
            real = load_model(dataclasses.replace(request, device="cpu"))
            apply_strategy(real, args.strategy, "remat estimate", compile=CompileSpec())
            real_loss = real.loss_fn or default_loss
            measured = measure_training_step(
                real.model, lambda: real_loss(real.model(*real.args, **real.kwargs)), optimizer=args.optimizer
            )
            tick("measured")
    parameter_count = _print_title(loaded, args, "each block compiled (fullgraph, inductor)")
    print(f"estimated on fake tensors in {elapsed_s:.1f} s: what the compiler saves, from its "
          "partitioner; its buffers, from inductor's own plan (nothing allocated, no kernel compiled)")
    print()
    print(render_memory_report(report, top_modules=args.top))
    if measured is not None:
        print()
        print(render_measured(report, [MeasuredStep(0, measured.peak_bytes, measured.forward_end_bytes)],
                              where="measured for real in this process (the allocator's count):"))
    if args.json is not None:
        payload = {
            "model": loaded.title,
            "config": _config_dict(loaded, request.gpt or GPTConfig()),
            "compiled": True,
            "batch": args.batch,
            "dtype": args.dtype,
            "optimizer": args.optimizer,
            "strategy": args.strategy,
            "parameter_count": parameter_count,
            "peak_bytes": report.peak_bytes,
            "forward_end_bytes": report.forward_end_bytes,
            "by_category": [dataclasses.asdict(u) for u in report.by_category],
            "measured": None if measured is None else {
                "resident_bytes": measured.resident_bytes,
                "peak_bytes": measured.peak_bytes,
                "forward_end_bytes": measured.forward_end_bytes,
            },
            "elapsed_s": elapsed_s,
        }
        _write_json(args.json, payload)
    return 0


def _print_simulated_title(args: argparse.Namespace, request: ModelRequest, what: str, elapsed_s: float) -> str:
    """Print the model's line and how the ranks were estimated; returns the model's title."""
    title = load_model(request).title  # on meta: nothing allocated
    how = "each block compiled (fullgraph, inductor)" if args.compile else f"{args.attention} attention"
    print(f"{title}; {args.dtype}, optimizer {args.optimizer}, strategy {args.strategy}, {how}")
    print(f"{what} in {elapsed_s:.1f} s on fake tensors and simulated ranks (nothing allocated)")
    return title


def _estimate_pipelined(args: argparse.Namespace, request: ModelRequest, pipeline: Pipeline) -> int:
    """``remat estimate --pipeline S``: every rank's steps, simulated here (measured with --measure)."""
    case = PipelineCase(request, args.strategy, pipeline, args.optimizer, compile=args.compile)
    start = time.perf_counter()
    with progress_bar(pipeline.ranks, "remat estimate", enabled=progress_wanted(args.quiet)) as tick:
        estimated = case.estimate()
        tick("ranks")
    elapsed_s = time.perf_counter() - start
    title = _print_simulated_title(args, request, f"{pipeline.describe()}; every rank estimated", elapsed_s)
    measured = case.measure() if args.measure else ()
    print()
    print(render_ranks(estimated, measured))
    if args.json is not None:
        _write_json(args.json, {
            "model": title,
            "pipeline": dataclasses.asdict(pipeline),
            "batch": args.batch,
            "dtype": args.dtype,
            "optimizer": args.optimizer,
            "strategy": args.strategy,
            "ranks": [
                {"rank": rank, "peak_bytes": report.peak_bytes,
                 "by_category": [dataclasses.asdict(u) for u in report.by_category],
                 **({"measured_peak_bytes": measured[rank].peak_bytes} if measured else {})}
                for rank, report in enumerate(estimated)
            ],
            "elapsed_s": elapsed_s,
        })
    return 0


def _estimate_sharded(args: argparse.Namespace, request: ModelRequest, sharding: Sharding) -> int:
    """``remat estimate --world-size N --fsdp [--tp K]``: one rank's step, simulated here."""
    strategy = args.strategy
    case = ShardedCase(request, strategy, sharding, args.optimizer, compile=args.compile)
    start = time.perf_counter()
    with progress_bar(1, "remat estimate", enabled=progress_wanted(args.quiet)) as tick:
        report = case.estimate()
        tick("tracked step")
    elapsed_s = time.perf_counter() - start
    title = _print_simulated_title(args, request, f"{sharding.describe()}; estimated for one rank", elapsed_s)
    print()
    print(render_memory_report(report, top_modules=args.top))
    measured: list[MemoryReport] | list[MeasuredStep] = []
    if args.measure:
        measure = "measure_compiled_sharded_steps" if args.compile else "measure_sharded_steps"
        measured = [
            reports[0] for reports in run_on_ranks(sharding.world_size, f"remat.cli.estimate:{measure}", [case])
        ]
        print()
        print(render_measured(report, measured))
    if args.json is not None:
        payload_json = {
            "model": title,
            "sharding": dataclasses.asdict(sharding),
            "batch": args.batch,
            "dtype": args.dtype,
            "optimizer": args.optimizer,
            "strategy": strategy,
            "peak_bytes": report.peak_bytes,
            "forward_end_bytes": report.forward_end_bytes,
            "by_category": [dataclasses.asdict(u) for u in report.by_category],
            "measured": [
                {"rank": m.rank, "peak_bytes": m.peak_bytes, "forward_end_bytes": m.forward_end_bytes}
                for m in measured
            ],
            "elapsed_s": elapsed_s,
        }
        _write_json(args.json, payload_json)
    return 0


@dataclass(frozen=True)
class ShardedCase:
    """One sharded training step to estimate or measure: the model, its
    checkpointing strategy, the sharding and the optimizer."""

    request: ModelRequest
    strategy: str
    sharding: Sharding
    optimizer: str = "adamw"
    compile: bool = False

    def build(self, device: Literal["cpu", "fake"]) -> tuple[nn.Module, Any]:
        """The checkpointed model on ``device`` ("cpu" or "fake") and its ``loss()``;
        with ``compile``, every block compiled (torchtitan's order: checkpoint, compile,
        then shard)."""
        loaded = load_model(dataclasses.replace(self.request, device=device))
        apply_strategy(loaded, self.strategy, self.request.command, compile=CompileSpec() if self.compile else None)
        model, loss_fn = loaded.model, loaded.loss_fn or default_loss
        return model, lambda: loss_fn(model(*loaded.args, **loaded.kwargs))

    def estimate(self) -> MemoryReport:
        """Rank 0's step, simulated in this process (no process group may exist here)."""
        return estimate_sharded_step(
            lambda: self.build("fake"),
            sharding=self.sharding,
            optimizer=self.optimizer,  # type: ignore[arg-type]
            tp_plan=self.tp_plan,
            compiled=self.compile,
        )

    @property
    def tp_plan(self) -> dict[str, str] | None:
        """The tensor-parallel plan: the embedded GPT's; None lets a transformers model bring its own."""
        return GPT_TP_PLAN if self.request.builtin_gpt else None


@dataclass(frozen=True)
class MeasuredStep:
    """One rank's measured step where only the allocator could count it (compiled blocks)."""

    rank: int | None
    peak_bytes: int
    forward_end_bytes: int


def render_measured(
    estimate: MemoryReport,
    measured: Sequence[MemoryReport | MeasuredStep],
    where: str = "measured on local CPU processes (gloo):",
) -> str:
    """Estimated against measured peak and end of forward, one row per rank."""
    rows = []
    for report in measured:
        error = (estimate.peak_bytes - report.peak_bytes) / report.peak_bytes if report.peak_bytes else 0.0
        rows.append((
            str(report.rank),
            format_bytes(report.peak_bytes),
            format_bytes(estimate.peak_bytes),
            f"{100 * error:+.2f}%",
            format_bytes(report.forward_end_bytes),
            format_bytes(estimate.forward_end_bytes),
        ))
    header = ("rank", "measured peak", "estimated", "error", "measured end of fwd", "estimated")
    return where + "\n" + format_table(header, rows)


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


def measure_sharded_steps(cases: Sequence[ShardedCase]) -> list[MemoryReport]:
    """This rank's real step for each case, tracked (run on every rank by the launcher)."""
    reports = []
    for case in cases:
        model, loss = case.build("cpu")
        shard_model(model, case.sharding, tp_plan=case.tp_plan)
        reports.append(track_training_step(model, loss, optimizer=case.optimizer))  # type: ignore[arg-type]
        del model, loss
    return reports


def measure_compiled_sharded_steps(cases: Sequence[ShardedCase]) -> list[MeasuredStep]:
    """This rank's real step for each case with compiled blocks, by the allocator's count
    (compiled code allocates where no tracker sees it); run on every rank by the launcher."""
    steps = []
    for case in cases:
        model, loss = case.build("cpu")
        shard_model(model, case.sharding, tp_plan=case.tp_plan)
        measured = measure_training_step(model, loss, optimizer=case.optimizer)  # type: ignore[arg-type]
        steps.append(MeasuredStep(torch.distributed.get_rank(), measured.peak_bytes, measured.forward_end_bytes))
        del model, loss
        torch.compiler.reset()
    return steps
