"""``remat estimate --pipeline S``: every pipeline rank's memory, from the schedule's own order.

Layer: ``remat.cli`` (the application), beside :mod:`remat.cli.estimate`,
which calls it. The model is loaded as for any estimate, its blocks
checkpointed as ``--strategy`` says, then cut into stages
(:func:`remat.models.gpt_stages` for the embedded GPT,
:func:`remat.models.llama_stages` for a Hugging Face causal LM laid out as
Llama's), and :func:`remat.memory.estimate_pipeline_step` runs every rank's
step on fake tensors; ``--measure`` runs it on local gloo processes.

Example:
    >>> from remat.cli.loader import ModelRequest
    >>> from remat.memory import Pipeline
    >>> from remat.models import GPTConfig
    >>> case = PipelineCase(ModelRequest(command="remat estimate", gpt=GPTConfig(n_layers=2, seq_len=16), batch=4),
    ...                     "remat", Pipeline(ranks=2, schedule="1F1B", microbatches=2))
    >>> [report.rank for report in case.estimate()]
    [0, 1]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from remat.cli.loader import ModelRequest, load_model
from remat.cli.strategies import apply_strategy
from remat.config import apply_config
from remat.errors import CheckpointUsageError
from remat.memory import (
    PIPELINE_SCHEDULES,
    MemoryReport,
    Pipeline,
    RankAllocations,
    StagedModel,
    estimate_pipeline_step,
    format_bytes,
    measure_pipeline_step,
)
from remat.memory._estimate import Optimizer
from remat.memory._render import format_table
from remat.models import gpt_stages, llama_stages, lm_loss
from remat.placement import CompileSpec

__all__ = ["PipelineCase", "add_pipeline_arguments", "pipeline_from", "render_ranks"]


def add_pipeline_arguments(parser: argparse.ArgumentParser, description: str) -> None:
    """``--pipeline S``, ``--schedule``, ``--microbatches``, in their own group."""
    staged = parser.add_argument_group("pipeline parallelism", description)
    staged.add_argument("--pipeline", type=int, default=None, metavar="S",
                        help="pipeline ranks (the embedded GPT or a Llama-like --hf-config)")
    staged.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default=None,
                        help="torch's schedule, by its class name without 'Schedule' (default: 1F1B)")
    staged.add_argument("--microbatches", type=int, default=None, metavar="M",
                        help="microbatches per step; --batch splits into them (default: 2 x S)")


def pipeline_from(args: argparse.Namespace, command: str) -> Pipeline | None:
    """The :class:`remat.memory.Pipeline` of ``--pipeline``, ``--schedule`` and
    ``--microbatches``; None without ``--pipeline``."""
    if args.pipeline is None:
        for flag in ("schedule", "microbatches"):
            if getattr(args, flag) is not None:
                raise CheckpointUsageError(f"{command}: --{flag} describes a pipeline; give --pipeline S too.")
        return None
    data_parallel, tp = 1, args.tp
    if args.world_size != 1 or args.fsdp or tp != 1:
        per_stage = args.world_size // args.pipeline
        if args.world_size % args.pipeline or per_stage % tp:
            raise CheckpointUsageError(
                f"{command}: with --pipeline {args.pipeline}, each stage runs on --world-size N / "
                f"{args.pipeline} ranks, split --tp {tp} ways: give a --world-size that is a multiple of "
                f"{args.pipeline * tp}."
            )
        data_parallel = per_stage // tp
        if (data_parallel > 1) != bool(args.fsdp):
            raise CheckpointUsageError(
                f"{command}: --pipeline {args.pipeline} --tp {tp} on --world-size {args.world_size} leaves "
                f"{data_parallel} data-parallel rank(s) per stage; FSDP2 shards a stage over 2 or more: "
                + ("give --fsdp." if data_parallel > 1 else "drop --fsdp, or give a larger --world-size.")
            )
    mixed_precision = getattr(args, "mixed_precision", None)
    reshard = not getattr(args, "no_reshard", False)
    if data_parallel == 1 and (mixed_precision is not None or not reshard):
        raise CheckpointUsageError(
            f"{command}: --mixed-precision and --no-reshard set how FSDP2 shards each stage; give "
            f"--world-size N --fsdp with N a multiple of --pipeline {args.pipeline} above it."
        )
    microbatches = args.microbatches if args.microbatches is not None else 2 * args.pipeline
    pipeline = Pipeline(ranks=args.pipeline, schedule=args.schedule or "1F1B", microbatches=microbatches,
                        data_parallel=data_parallel, tensor_parallel=tp, mixed_precision=mixed_precision,
                        reshard_after_forward=reshard)
    if args.batch % microbatches:
        raise CheckpointUsageError(
            f"{command}: --batch {args.batch} does not split into {microbatches} microbatches; give "
            f"a --batch that is a multiple of --microbatches."
        )
    return pipeline


@dataclass(frozen=True)
class PipelineCase:
    """One pipelined training step to estimate or measure: the model, its checkpointing
    strategy, the pipeline and the optimizer."""

    request: ModelRequest
    strategy: str
    pipeline: Pipeline
    optimizer: Optimizer = "adamw"
    compile: bool = False
    regions: tuple[tuple[str, str], ...] = ()

    def build(self, device: Literal["cpu", "fake"] = "fake") -> StagedModel:
        """The checkpointed model on ``device`` (``strategy``, or a plan's ``regions``), cut into
        the pipeline's stages, with its batch."""
        loaded = load_model(dataclasses.replace(self.request, device=device))
        if self.regions:
            apply_config(loaded.model, {"regions": dict(self.regions)})
        else:
            apply_strategy(loaded, self.strategy, self.request.command,
                           compile=CompileSpec() if self.compile else None)
        if loaded.head is None or loaded.kwargs:
            raise CheckpointUsageError(
                f"{self.request.command}: --pipeline cuts a decoder into stages: the embedded GPT "
                f"or a Hugging Face causal LM laid out as Llama's; {loaded.title} is not one."
            )
        n_stages = self.pipeline.n_stages
        if loaded.builtin_gpt:
            stages: Sequence[nn.Module] = gpt_stages(loaded.model, n_stages)  # type: ignore[arg-type]
        else:
            stages = llama_stages(loaded.model, n_stages)
        _, target = loaded.head
        return StagedModel(stages, tuple(loaded.args), target, lm_loss, model=loaded.model)

    def estimate(self) -> tuple[MemoryReport, ...]:
        """Every rank's steps, simulated in this process (no process group may exist here)."""
        return estimate_pipeline_step(
            self.build, pipeline=self.pipeline, optimizer=self.optimizer, compiled=self.compile
        )

    def measure(self) -> tuple[MemoryReport | RankAllocations, ...]:
        """Every rank's steps, run on local gloo processes (small models only); compiled, as
        the allocator counts them."""
        return measure_pipeline_step(
            self.cpu_build, pipeline=self.pipeline, optimizer=self.optimizer, compiled=self.compile
        )

    def cpu_build(self) -> StagedModel:
        """:meth:`build` on the CPU (a bound method the ranks unpickle)."""
        return self.build("cpu")


def render_ranks(estimated: Sequence[MemoryReport], measured: Sequence[MemoryReport | RankAllocations] = ()) -> str:
    """One row per rank: its stages' peak and what fills it; with ``measured``, beside it."""
    header = ["rank", "peak", "parameters", "gradients", "optimizer", "activations", "communication"]
    if measured:
        header += ["measured peak", "error"]
    rows = []
    for index, report in enumerate(estimated):
        at_peak = {usage.name: usage.at_peak_bytes for usage in report.by_category}
        row = [
            str(index),
            format_bytes(report.peak_bytes),
            format_bytes(at_peak.get("parameter", 0)),
            format_bytes(at_peak.get("gradient", 0)),
            format_bytes(at_peak.get("optimizer_state", 0)),
            format_bytes(at_peak.get("activation", 0) + at_peak.get("temporary", 0)),
            format_bytes(at_peak.get("communication", 0)),
        ]
        if measured:
            real = measured[index].peak_bytes
            row += [format_bytes(real), f"{100 * (report.peak_bytes - real) / real:+.2f}%" if real else "-"]
        rows.append(tuple(row))
    return format_table(tuple(header), rows)
