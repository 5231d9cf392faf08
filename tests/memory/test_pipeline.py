"""Every rank's memory of pipelined training: the estimate (simulated ranks, fake tensors)
against the same steps measured on gloo processes (``remat.memory.estimate_pipeline_step``,
``measure_pipeline_step``).

The cells: the embedded GPT without checkpointing and with remat's full checkpoint, and a
Hugging Face Llama under a selective policy, under GPipe, 1F1B, Interleaved1F1B and
ZBVZeroBubble, at 2 and 4 ranks, and with each stage sharded by FSDP2 over 2 ranks (2 x 2;
also in bf16 without resharding) or split by tensor parallelism (2 x 2);
and the GPT's blocks compiled (inductor), estimated with ``compiled=True`` and measured by the
allocator (``docs/design/memory.md``, "Pipelined training").
One launch per world size measures every cell on its ranks (the cells run one after another
in one process group); the estimates run here.
Every rank's estimated peak is within 3% of its measured one (all were equal to the byte on
torch 2.11, 2.13 and 2.15 when written: the same schedule code runs on both sides).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import pytest
import torch
from torch import nn

import remat
from helpers import launch_once, tiny_llama_config
from remat import policies
from remat._compat.distributed import collectives_run_on_fake_tensors
from remat._compat.pipelining import schedule_class
from remat._compat.versions import static_compile_supported
from remat.errors import CheckpointUsageError, UnsupportedCheckpointError
from remat.memory import (
    Pipeline,
    StagedModel,
    estimate_pipeline_step,
    measure_this_rank,
)
from remat.memory._pipeline import _V_SHAPED
from remat.memory._report import CATEGORIES
from remat.models import GPT, GPTConfig, gpt_stages, llama_stages, lm_loss

pytestmark = pytest.mark.xdist_group("pipeline-memory")

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
MODELS = ("gpt", "gpt-full", "llama-policy")
TOLERANCE = 0.03
VOCAB, SEQ, ROWS, MICROBATCHES = 64, 16, 2, 4


def _release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _full(block: nn.Module, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    out = remat.checkpoint(block, hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _save_matmuls(block: nn.Module, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    out = remat.checkpoint(block, hidden, policy=policies.save_matmuls, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def build(model: str, n_stages: int, compiled: bool = False) -> StagedModel:
    """The staged model of a cell (a top-level function: the ranks pickle a partial of it);
    ``compiled``: every block compiled (inductor), checkpointed as ``model`` says."""
    torch.manual_seed(0)
    tokens = torch.randint(VOCAB, (ROWS * MICROBATCHES, SEQ + 1))
    inputs, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if model == "llama-policy":
        import transformers

        config = tiny_llama_config(vocab_size=VOCAB, num_hidden_layers=n_stages, max_position_embeddings=SEQ,
                                   use_cache=False, attn_implementation="sdpa")
        llama = transformers.LlamaForCausalLM(config).train()
        return StagedModel(llama_stages(llama, n_stages, run_block=_save_matmuls), (inputs,), target, lm_loss,
                           model=llama)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=2, n_layers=n_stages, d_ff=64))
    if compiled:
        mode = "full" if model == "gpt-full" else "none"
        remat.apply_config(gpt, {"mode": mode, "compile": True})
        return StagedModel(gpt_stages(gpt, n_stages), (inputs,), target, lm_loss)
    runner = {"run_block": _full} if model == "gpt-full" else {}
    return StagedModel(gpt_stages(gpt, n_stages, **runner), (inputs,), target, lm_loss)


@dataclasses.dataclass(frozen=True)
class Cell:
    model: str
    schedule: str
    ranks: int
    data_parallel: int = 1  # FSDP2 ranks per stage
    compiled: bool = False  # every block compiled; measured by the allocator
    mixed_precision: str | None = None  # FSDP2's, with data_parallel > 1
    tensor_parallel: int = 1  # the Llama's own plan splits each stage's blocks
    reshard_after_forward: bool = True

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline(ranks=self.ranks, schedule=self.schedule, microbatches=MICROBATCHES,
                        data_parallel=self.data_parallel, tensor_parallel=self.tensor_parallel,
                        mixed_precision=self.mixed_precision,  # type: ignore[arg-type]
                        reshard_after_forward=self.reshard_after_forward)

    @property
    def world_size(self) -> int:
        return self.pipeline.world_size

    @property
    def build(self) -> Any:
        return functools.partial(build, self.model, self.pipeline.n_stages, self.compiled)

    def skip_reason(self) -> str | None:
        if schedule_class(f"Schedule{self.schedule}") is None:
            return f"torch {torch.__version__} has no Schedule{self.schedule}"
        if not collectives_run_on_fake_tensors():
            return f"torch {torch.__version__}'s collectives do not run on fake tensors (2.11 and newer)"
        if self.schedule in _V_SHAPED and _release() < (2, 13):
            return f"torch {torch.__version__}'s V schedules send between stages of one rank, which gloo refuses"
        if self.model.startswith("llama"):
            pytest.importorskip("transformers")
        if self.compiled and not static_compile_supported():
            return f"static compiled estimates need torch 2.11 and newer; this is {torch.__version__}"
        return None

    @property
    def name(self) -> str:
        sharded = f"x{self.data_parallel}fsdp" if self.data_parallel > 1 else ""
        sharded += f"-{self.mixed_precision}" if self.mixed_precision else ""
        sharded += "" if self.reshard_after_forward else "-no-reshard"
        sharded += f"x{self.tensor_parallel}tp" if self.tensor_parallel > 1 else ""
        return f"{self.model}/{self.schedule}/{self.ranks}ranks{sharded}{'/compiled' if self.compiled else ''}"


_PER_RELEASE = os.environ.get("REMAT_PIPELINE_CELLS", "all") == "per-release"
CELLS = [Cell(model, schedule, 2) for schedule in SCHEDULES for model in MODELS]
if not _PER_RELEASE:  # the other releases: 2 ranks (one launch)
    # 4 ranks, checkpointed; stages sharded with FSDP2 (2 pipeline ranks x 2 data-parallel ones)
    CELLS += [Cell(model, schedule, 4) for schedule in SCHEDULES for model in ("gpt-full", "llama-policy")]
    CELLS += [Cell("gpt-full", "1F1B", 2, 2), Cell("llama-policy", "ZBVZeroBubble", 2, 2),
              Cell("llama-policy", "1F1B", 2, 2, mixed_precision="bf16", reshard_after_forward=False),
              # each stage split 2 ways by tensor parallelism (2 pipeline x 2 tensor-parallel ranks)
              Cell("llama-policy", "ZBVZeroBubble", 2, tensor_parallel=2)]
    # Compiled blocks (inductor on each rank), checkpointed under 1F1B and a split backward,
    # and kept under 1F1B (kept compiled blocks under a split backward fail in torch itself:
    # their donated buffers refuse the input pass's retained graph).
    CELLS += [Cell("gpt-full", "1F1B", 2, compiled=True), Cell("gpt-full", "ZBVZeroBubble", 2, compiled=True),
              Cell("gpt", "1F1B", 2, compiled=True)]

_LAUNCHED: dict[int, Any] = {}

def measure_cells(cells: list[Cell]) -> dict[Cell, list[int]]:
    """On each rank: every cell's measured peak (one process group for all)."""
    peaks = {}
    for cell in cells:
        if cell.compiled:
            # Each compiled cell compiles afresh, as its own job would: a backward compiled
            # for 1F1B (one backward, donated buffers) is not reused under a split backward.
            torch.compiler.reset()
        peaks[cell] = measure_this_rank(cell.build, cell.pipeline, compiled=cell.compiled).peak_bytes
    return peaks


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.name)
def test_estimate_is_within_three_percent_of_every_ranks_measured_peak(cell: Cell) -> None:
    reason = cell.skip_reason()
    if reason:
        pytest.skip(reason)
    runnable = [c for c in CELLS if c.world_size == cell.world_size and c.skip_reason() is None]
    per_rank = launch_once(_LAUNCHED, cell.world_size, measure_cells, runnable, timeout_s=900)
    measured = [rank_cells[cell] for rank_cells in per_rank[:: cell.pipeline.ranks_per_stage]]
    reports = estimate_pipeline_step(cell.build, pipeline=cell.pipeline, compiled=cell.compiled)
    estimated = [report.peak_bytes for report in reports]
    for rank, (got, want) in enumerate(zip(estimated, measured, strict=True)):
        assert abs(got - want) <= TOLERANCE * want, (rank, got, want)


def test_later_stages_hold_fewer_microbatches_under_1f1b() -> None:
    """Under 1F1B stage i of S keeps up to S - i microbatches: with checkpointing off, rank 0's
    activations at its peak outweigh the last rank's, whose stage also has the head."""
    if Cell("gpt", "1F1B", 4).skip_reason():
        pytest.skip(Cell("gpt", "1F1B", 4).skip_reason())
    pipeline = Pipeline(ranks=4, schedule="1F1B", microbatches=8)
    reports = estimate_pipeline_step(functools.partial(build, "gpt", 4), pipeline=pipeline)
    held = [report.category("activation").at_peak_bytes + report.category("temporary").at_peak_bytes for report in reports]
    assert held[0] > held[1] > held[2]


def test_bad_pipelines_are_refused_with_what_to_do() -> None:
    with pytest.raises(CheckpointUsageError, match="schedule must be one of"):
        Pipeline(ranks=2, schedule="Schedule1F1B")
    with pytest.raises(CheckpointUsageError, match="two stages on each rank"):
        Pipeline(ranks=2, schedule="ZBVZeroBubble", stages_per_rank=3)
    with pytest.raises(CheckpointUsageError, match="ranks must be an int >= 1"):
        Pipeline(ranks=0)
    with pytest.raises(CheckpointUsageError, match="tensor_parallel must be an int >= 1"):
        Pipeline(ranks=2, tensor_parallel=0)
    with pytest.raises(CheckpointUsageError, match="give data_parallel > 1"):
        Pipeline(ranks=2, tensor_parallel=2, mixed_precision="bf16")
    with pytest.raises(CheckpointUsageError, match="mixed_precision must be one of"):
        Pipeline(ranks=2, data_parallel=2, mixed_precision="fp8")  # type: ignore[arg-type]
    assert Pipeline(ranks=2, data_parallel=2, tensor_parallel=2).world_size == 8
    if collectives_run_on_fake_tensors():
        with pytest.raises(CheckpointUsageError, match="needs 4 stage modules, the build gave 2"):
            estimate_pipeline_step(functools.partial(build, "gpt", 2), pipeline=Pipeline(ranks=2, schedule="LoopedBFS"))
    else:
        with pytest.raises(UnsupportedCheckpointError, match="collectives run on fake tensors"):
            estimate_pipeline_step(functools.partial(build, "gpt", 2), pipeline=Pipeline(ranks=2))


@pytest.mark.parametrize("cell", [
    Cell("gpt-full", "1F1B", 4),
    Cell("llama-policy", "1F1B", 2, 2, mixed_precision="bf16", reshard_after_forward=False),
    Cell("llama-policy", "ZBVZeroBubble", 2, tensor_parallel=2),
], ids=lambda cell: cell.name)
def test_ranks_simulated_in_forked_processes_report_what_one_process_does(cell: Cell) -> None:
    """The ranks are simulated in forked copies of this process (one per usable CPU):
    the same reports, to the byte and by category, as one after another here."""
    reason = cell.skip_reason()
    if reason:
        pytest.skip(reason)
    alone = estimate_pipeline_step(cell.build, pipeline=cell.pipeline, processes=1)
    forked = estimate_pipeline_step(cell.build, pipeline=cell.pipeline, processes=2)
    for here, there in zip(alone, forked, strict=True):
        assert here.rank == there.rank
        assert here.peak_bytes == there.peak_bytes
        for category in CATEGORIES:
            assert here.category(category).at_peak_bytes == there.category(category).at_peak_bytes, category
