"""Every remat form inside pipeline stages, under every schedule torch ships (gloo, 2 and 4 ranks).

A model is cut into stages (``remat.models.gpt_stages`` / ``llama_stages``,
one block a stage), each rank builds ``PipelineStage`` objects for the
stages the schedule gives it (one, two looped, or two in a V), and one
training step of several microbatches runs under each schedule of
``torch.distributed.pipelining``: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
and the zero-bubble ones that split backward into an input pass and a
weight pass (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV). A schedule
this torch lacks is skipped by name.

The oracle of a cell is the same schedule without checkpointing: every
gradient of every stage, bitwise, on every rank. A compressing form is
compared with the same compression without pipelining (the microbatches run
one after another in one process). Each cell also counts, per block and
microbatch, the block's forwards inside backward: a checkpointed block is
recomputed once per microbatch, however backward is split
(``docs/design/pipelining.md``). torch's own checkpoint forms run beside
remat's, for the table in ``docs/guide/pipelining.md`` (``python
tests/integration/pipelining_table.py`` prints it); they are recorded, not
asserted.

One launch per world size computes every cell (``pipeline_records`` on each
rank); the tests only compare.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import remat
from helpers import launch_once, tiny_llama_config
from remat import policies
from remat.composable import checkpoint_module
from remat.models import GPT, GPTConfig, gpt_stages, llama_stages, lm_loss
from remat.nn import CheckpointImpl, checkpoint_wrapper
from remat.placement import BlockSetting, place

pytestmark = pytest.mark.xdist_group("pipelining")  # one launch per world size, one worker

SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
SPLIT = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
"""The schedules whose backward is an input pass and a later weight pass."""
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
LAUNCH_TIMEOUT_S = 600
VOCAB, SEQ, ROWS = 64, 8, 2  # ROWS: sequences per microbatch
MM_OPS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default]

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import schedules

    return getattr(schedules, name, None)


# ------------------------------------------------------------------- the forms


def _function(**options: Any) -> Callable[..., torch.Tensor]:
    def run(block: nn.Module, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = remat.checkpoint(block, hidden, **options, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    return run


def _torch_function(**options: Any) -> Callable[..., torch.Tensor]:
    def run(block: nn.Module, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = torch.utils.checkpoint.checkpoint(block, hidden, **options, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    return run


def _torch_selective() -> Callable[..., torch.Tensor]:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return _torch_function(
        use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, MM_OPS)
    )


RUNNERS: dict[str, Callable[[], Callable[..., torch.Tensor]]] = {
    "full": lambda: _function(),
    "policy": lambda: _function(policy=policies.save_matmuls),
    "op list": lambda: _function(policy=list(MM_OPS)),
    "names": lambda: _function(policy=policies.save_only_names("attn_out")),
    "weight pass recompute": lambda: _function(weight_pass="recompute"),
    "torch": lambda: _torch_function(use_reentrant=False),
    "torch selective": _torch_selective,
    "torch reentrant": lambda: _torch_function(use_reentrant=True),
}
"""Forms that run each block through a checkpoint function (the stage's ``run_block``)."""


def _reentrant(blocks: nn.ModuleList) -> None:
    # remat.checkpoint's reentrant variant takes no keyword arguments (Llama's
    # layers need position_embeddings): the reentrant wrapper passes them on.
    for index, block in enumerate(blocks):
        blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT)


def _wrapper(blocks: nn.ModuleList) -> None:
    for index, block in enumerate(blocks):
        blocks[index] = checkpoint_wrapper(block)


def _composable(blocks: nn.ModuleList) -> None:
    for block in blocks:
        checkpoint_module(block)


def _placed(setting: BlockSetting) -> Callable[[nn.ModuleList], None]:
    def apply(blocks: nn.ModuleList) -> None:
        place(blocks, {str(index): setting for index in range(len(blocks))})

    return apply


def _torch_composable(blocks: nn.ModuleList) -> None:
    from torch.distributed._composable import checkpoint as torch_composable

    for block in blocks:
        torch_composable(block)


MODULE_FORMS: dict[str, Callable[[nn.ModuleList], None]] = {
    "reentrant": _reentrant,
    "wrapper": _wrapper,
    "module": _composable,
    "offload": _placed(BlockSetting(offload=True)),
    "compress": _placed(BlockSetting(compress="int8")),
    "torch composable": _torch_composable,
}
"""Forms put on the blocks themselves."""

REMAT_FORMS = ("full", "policy", "op list", "names", "reentrant", "wrapper", "module", "offload", "weight pass recompute")
TORCH_FORMS = ("torch", "torch selective", "torch composable", "torch reentrant")
COMPRESSED = {"compress": 3e-2}  # int8 (tests/storage/test_compress.py states the tolerance)
KIND_FORMS = ("full", "policy", "reentrant", "module")
"""One form of each kind (function, selective, reentrant, module hooks): the second model
and the other torch releases of the matrix run these."""


# ------------------------------------------------------------------- the cells


@dataclasses.dataclass(frozen=True)
class Cell:
    model: str  # "gpt" (token ids in: stage 0's input needs no grad), "gpt-hidden" (hidden states that need grad), "llama"
    schedule: str
    form: str  # "none" (the oracle), or a key of RUNNERS / MODULE_FORMS
    world_size: int
    static: bool = True  # stages built with example inputs; else shapes inferred at run time

    @property
    def name(self) -> str:
        shapes = "" if self.static else "/runtime-shapes"
        return f"{self.model}/{self.schedule.removeprefix('Schedule')}/{self.form}/{self.world_size}ranks{shapes}"

    @property
    def oracle(self) -> Cell:
        return dataclasses.replace(self, form="none")

    @property
    def microbatches(self) -> int:
        return 8 if self.schedule == "ScheduleDualPipeV" and self.world_size == 4 else 4

    def skip_reason(self) -> str | None:
        if _schedule_class(self.schedule) is None:
            return f"torch {torch.__version__} has no torch.distributed.pipelining.{self.schedule}"
        if self.model == "llama" and not HAS_TRANSFORMERS:
            return "transformers is not installed"
        if self.schedule != "ScheduleGPipe" and _torch_release() < (2, 8):
            # measured without checkpointing too: every such cell timed out in a receive
            return (
                f"torch {torch.__version__}'s {self.schedule} hangs on gloo: its fused sends and receives "
                "wait on one of gloo's several works (pytorch/pytorch#132644, fixed in 2.8)"
            )
        if self.schedule in V_SHAPED and _torch_release() < (2, 13):
            # measured on 2.11 without checkpointing: the V's middle stages share a rank
            return (
                f"torch {torch.__version__}'s {self.schedule} sends between two stages of one rank "
                "over gloo, which gloo refuses ('Pair is not connected'); runs from 2.13"
            )
        if self.form in ("reentrant", "torch reentrant") and self.schedule in SPLIT and _torch_release() < (2, 13):
            # the reentrant region is a Python autograd.Function node, and the weight pass
            # hands torch.autograd.grad a GradientEdge to it
            return (
                f"torch {torch.__version__}'s weight pass reads _input_metadata of a GradientEdge's node, "
                "which a Python autograd.Function node refuses; runs from 2.13"
            )
        if not self.static and not _infers_shapes():
            return f"torch {torch.__version__}'s PipelineStage needs example inputs (no run-time shape inference)"
        if self.form.startswith("torch selective") and not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
            return f"torch {torch.__version__} has no selective checkpointing"
        return None


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _infers_shapes() -> bool:
    import inspect

    from torch.distributed.pipelining import PipelineStage

    return inspect.signature(PipelineStage).parameters["input_args"].default is None


def _cells(table: bool = False) -> list[Cell]:
    """The tests' cells; with ``table``, those of the docs' table: every form of remat's, and
    torch's (its full checkpoint only at 4 ranks), on the GPT at 2 and 4 ranks (torch's are
    shown there, not asserted)."""
    per_release = os.environ.get("REMAT_PIPELINE_CELLS", "all") == "per-release" and not table
    cells = []
    # The other releases: one form per kind at 2 ranks, static and run-time shapes (what a
    # release changes is the schedules' code; the models and 4 ranks run on the main one).
    for world in (2,) if per_release else (2, 4):
        for schedule in SCHEDULES:
            forms: tuple[str, ...] = ("none", *REMAT_FORMS, "compress")
            if table:
                # At 4 ranks only torch's full checkpoint of its forms: a cell that fails on one
                # rank can leave another waiting in a receive that gloo never times out there.
                forms = ("none", *REMAT_FORMS, *(TORCH_FORMS if world == 2 else ("torch",)))
            elif world == 4 or per_release:
                forms = ("none", *KIND_FORMS)
            cells += [Cell("gpt", schedule, form, world) for form in forms]
            if per_release:
                cells += [Cell("gpt", schedule, form, world, static=False) for form in ("none", "full")]
            elif world == 2 and not table:
                # stage 0 taking hidden states that need grad, shapes inferred at run
                # time, and the Llama
                cells += [Cell("gpt-hidden", schedule, form, world) for form in ("none", *KIND_FORMS)]
                cells += [Cell("gpt", schedule, form, world, static=False) for form in ("none", "full", "reentrant")]
                cells += [Cell("llama", schedule, form, world) for form in ("none", *KIND_FORMS, "names")]
    return cells


CELLS = _cells()
CHECKED = [cell for cell in CELLS if cell.form != "none" and not cell.form.startswith("torch") and cell.form not in COMPRESSED]


# ----------------------------------------------------------- one cell on a rank


def _layout(schedule: str, world: int, rank: int) -> tuple[list[int], int]:
    """The stages this rank runs, and the number of stages."""
    cls = _schedule_class(schedule)
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    if not issubclass(cls, PipelineScheduleMulti):
        return [rank], world
    stages = 2 * world
    if schedule in V_SHAPED:
        return [rank, stages - 1 - rank], stages
    return [rank, rank + world], stages


def _model(cell: Cell, n_stages: int) -> nn.Module:
    torch.manual_seed(0)
    if cell.model == "llama":
        import transformers

        config = tiny_llama_config(
            vocab_size=VOCAB, num_hidden_layers=n_stages, max_position_embeddings=2 * SEQ, use_cache=False,
            attn_implementation="sdpa",
        )
        return transformers.LlamaForCausalLM(config).train()
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=2, n_layers=n_stages, d_ff=64)).train()


def _tag_llama_attention(block: nn.Module) -> None:
    """Name a Llama layer's attention output "attn_out", as the GPT names its own."""

    def tag(module: nn.Module, args: Any, output: Any) -> Any:
        return (remat.name(output[0], "attn_out"), *output[1:])

    block.self_attn.register_forward_hook(tag)


def _stages(cell: Cell, model: nn.Module, n_stages: int) -> list[nn.Module]:
    runner = RUNNERS[cell.form]() if cell.form in RUNNERS else None
    cut = llama_stages if cell.model == "llama" else gpt_stages
    stages = cut(model, n_stages, **({"run_block": runner} if runner is not None else {}))  # type: ignore[operator]
    if cell.model == "gpt-hidden":  # stage 0 takes hidden states that need grad
        stages[0].embed = None
    if cell.model == "llama" and cell.form == "names":
        for stage in stages:
            for block in stage.blocks:
                _tag_llama_attention(block)
    if cell.form in MODULE_FORMS:
        for stage in stages:
            MODULE_FORMS[cell.form](stage.blocks)
    return stages


def _data(cell: Cell) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    rows = ROWS * cell.microbatches
    tokens = torch.randint(VOCAB, (rows, SEQ + 1), generator=generator)
    if cell.model == "gpt-hidden":
        hidden = torch.randn(rows, SEQ, 32, generator=generator)
        return hidden, tokens[:, 1:].contiguous()
    # contiguous: torch 2.7-2.11 check each microbatch's strides against the example's
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits, targets)


def _inferring_metadata() -> bool:
    """Whether the stage is inferring its backward's metadata (torch 2.13 and newer run one
    backward on an example before the first microbatch: no microbatch's work)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_backward_metadata_inference":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _Recomputes:
    """Counts each block's forwards inside a microbatch's backward (a recomputation), by block."""

    def __init__(self, stages: list[nn.Module], first: list[int]) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.handles = []
        for stage, index in zip(stages, first, strict=True):
            for offset, block in enumerate(stage.blocks):
                # The block's first child: a placement reruns the block's forward function, not
                # its __call__, and a wrapper reruns the module it wraps.
                first_child = next(block.children())
                self.handles.append(first_child.register_forward_pre_hook(self._hook(f"block{index + offset}")))

    def _hook(self, name: str) -> Callable[..., None]:
        def count(module: nn.Module, args: Any) -> None:
            if torch._C._current_graph_task_id() != -1 and not _inferring_metadata():  # in a backward call
                self.counts[name] += 1

        return count


def _parameters(stages: list[nn.Module], mine: list[int]) -> dict[str, nn.Parameter]:
    """This rank's parameters by stage and name (a wrapper's prefix left out: the same
    names with every form)."""
    return {
        f"stage{index}.{name.replace('_checkpoint_wrapped_module.', '')}": parameter
        for index in mine
        for name, parameter in stages[index].named_parameters()
    }


def _step(cell: Cell, group: Any) -> dict[str, Any]:
    """This rank's gradients, by stage and parameter, and the recomputations per block and
    microbatch; the stages talk over ``group``."""
    from torch.distributed.pipelining import PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    mine, n_stages = _layout(cell.schedule, world, rank)
    model = _model(cell, n_stages)
    stages = _stages(cell, model, n_stages)
    inputs, targets = _data(cell)
    if cell.model == "gpt-hidden":
        inputs.requires_grad_(True)
    examples: dict[int, dict[str, Any]] = {}
    if cell.static:
        with torch.no_grad():  # each stage's example input and output, on one microbatch
            hidden = inputs[:ROWS]
            for index, stage in enumerate(stages):
                output = stage(hidden)
                examples[index] = {"input_args": (hidden,)}
                if not _infers_shapes():  # torch 2.4 would run the stage on uninitialized inputs
                    examples[index]["output_args"] = (output,)
                hidden = output
    pipeline = [
        PipelineStage(stages[index], index, n_stages, torch.device("cpu"), group=group, **examples.get(index, {}))
        for index in mine
    ]
    counter = _Recomputes([stages[index] for index in mine], mine)
    cls = _schedule_class(cell.schedule)
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    multi = issubclass(cls, PipelineScheduleMulti)
    schedule = cls(pipeline if multi else pipeline[0], n_microbatches=cell.microbatches, loss_fn=_loss)
    args = (inputs,) if 0 in mine else ()
    kwargs = {"target": targets} if n_stages - 1 in mine else {}
    schedule.step(*args, **kwargs)
    grads = {
        name: (None if p.grad is None else p.grad.detach().clone()) for name, p in _parameters(stages, mine).items()
    }
    record = {"grads": grads, "recomputes": {k: v / cell.microbatches for k, v in counter.counts.items()}}
    if cell.schedule in SPLIT and cell.form in REMAT_FORMS:
        record["leftovers"] = _leftovers(pipeline)
    return record


def _leftovers(pipeline: list[Any]) -> dict[str, int]:
    """Regions still alive after the step, and microbatches remat still tracks for its stages."""
    import gc

    from remat._engine import split
    from remat._engine.frame import Frame

    gc.collect()
    tracked = [split._STAGES.get(stage) for stage in pipeline]
    return {
        "frames": sum(type(obj) is Frame for obj in gc.get_objects()),
        "microbatches": sum(len(t.microbatches) for t in tracked if t is not None),
    }


def _sequential_grads(cell: Cell) -> dict[str, Any]:
    """The same model, form and microbatches without pipelining: one process, the
    microbatches one after another, each stage taking its input as a pipeline stage does
    (a leaf that needs grad: what remat.compress keeps exact is the same), gradients
    scaled as the schedules scale them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, n_stages = _layout(cell.schedule, world, rank)
    model = _model(cell, n_stages)
    stages = _stages(cell, model, n_stages)
    inputs, targets = _data(cell)
    for start in range(0, inputs.shape[0], ROWS):
        leaves, outputs = [], []
        hidden = inputs[start:start + ROWS]
        for index, stage in enumerate(stages):
            leaf = hidden if index == 0 else hidden.detach().requires_grad_()
            leaves.append(leaf)
            hidden = stage(leaf)
            outputs.append(hidden)
        _loss(hidden, targets[start:start + ROWS]).backward()
        for index in range(n_stages - 2, -1, -1):
            outputs[index].backward(leaves[index + 1].grad)
    return {name: p.grad.detach().clone() / cell.microbatches for name, p in _parameters(stages, mine).items()}


CELL_TIMEOUT = datetime.timedelta(seconds=20)
"""How long a stage waits for its peer: a cell that fails on one rank leaves the other
waiting in a receive, and each cell has a group of its own, so the next one starts clean."""


def pipeline_records(table: bool) -> dict[str, Any]:
    """Every cell of this world size on this rank (the launcher runs this on each rank)."""
    world = dist.get_world_size()
    records: dict[str, Any] = {}
    for cell in _cells(table) if table else CELLS:
        if cell.world_size != world or cell.skip_reason() is not None:
            continue
        group = dist.new_group(timeout=CELL_TIMEOUT, backend="gloo")
        try:
            records[cell.name] = _step(cell, group)
            if cell.form in COMPRESSED:
                records[cell.name]["sequential"] = _sequential_grads(cell)
        except Exception as exc:
            records[cell.name] = f"{type(exc).__name__}: {exc}"
            records[cell.name + "#traceback"] = traceback.format_exc()
        dist.barrier()
        dist.destroy_process_group(group)
    return records


# ------------------------------------------------------------------------ launch

_LAUNCHED: dict[int, list[dict[str, Any]] | str] = {}
_TABLE_LAUNCHED: dict[int, list[dict[str, Any]] | str] = {}  # the docs' table: other cells


def ranks(world_size: int, table: bool = False) -> list[dict[str, Any]]:
    """Every rank's records for ``world_size`` (one launch per world size per session)."""
    launched = _TABLE_LAUNCHED if table else _LAUNCHED
    return launch_once(launched, world_size, pipeline_records, table, timeout_s=LAUNCH_TIMEOUT_S)


def records(cell: Cell) -> list[dict[str, Any]]:
    """The cell's record on every rank (skips what this torch cannot run; fails on an error)."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    reason = cell.skip_reason()
    if reason is not None:
        pytest.skip(f"{cell.name}: {reason}")
    per_rank = [results[cell.name] for results in ranks(cell.world_size)]
    for rank, record in enumerate(per_rank):
        assert isinstance(record, dict), (
            f"{cell.name} failed on rank {rank}: {record}\n{ranks(cell.world_size)[rank][cell.name + '#traceback']}"
        )
    return per_rank


def _difference(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    """None if every gradient is bitwise the oracle's, else the first difference."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        other = got[key]
        if (value is None) != (other is None):
            return f"{key}: {'no gradient' if other is None else 'a gradient where the oracle has none'}"
        if value is not None and not torch.equal(other, value):
            return f"{key}: max diff {(other - value).abs().max().item():.3g}"
    return None


# ------------------------------------------------------------------------- tests


@pytest.mark.parametrize("cell", CHECKED, ids=lambda c: c.name)
def test_gradients_equal_the_unchecked_pipeline(cell: Cell) -> None:
    for got, want in zip(records(cell), records(cell.oracle), strict=True):
        difference = _difference(got["grads"], want["grads"])
        assert difference is None, difference


@pytest.mark.parametrize("cell", [c for c in CHECKED if c.static], ids=lambda c: c.name)
def test_a_block_is_recomputed_once_per_microbatch(cell: Cell) -> None:
    """However backward is split: the input pass and the weight pass's calls share one
    recomputation (two with weight_pass="recompute" under a split schedule, and two for the
    reentrant variant there: its recomputation is one autograd node's backward, run by each
    pass; docs/design/pipelining.md)."""
    twice = cell.form in ("weight pass recompute", "reentrant")
    expected = 2.0 if twice and cell.schedule in SPLIT else 1.0
    selective = cell.form in ("policy", "op list", "names")
    for rank, record in enumerate(records(cell)):
        counts = record["recomputes"]
        for block, per_microbatch in counts.items():
            # DualPipeV splits only some microbatches' backward: at most the expectation.
            assert per_microbatch <= expected, (rank, block, counts)
        if not selective:  # (a selective policy may keep what a block needs: no rerun at all)
            assert counts and all(value >= 1.0 for value in counts.values()), (rank, counts)


SUMMATION = 8 * torch.finfo(torch.float32).eps
"""Relative to each gradient's largest value: a schedule may run a stage's microbatches'
backwards in another order than one after another (LoopedBFS: stage 0's, last to first),
and float sums depend on order (measured: 2.3e-10 at a scale of 2e-3, 1.1e-7 relative, a
float32 rounding or two). int8 compression moves the gradients by about 1e-3 of their scale."""


def _close(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    for key, value in want.items():
        scale = float(value.abs().max()) or 1.0
        gap = float((got[key] - value).abs().max())
        if gap > SUMMATION * scale:
            return f"{key}: max diff {gap:.3g} at scale {scale:.3g}"
    return None


@pytest.mark.parametrize("cell", [c for c in CELLS if c.form in COMPRESSED], ids=lambda c: c.name)
def test_compressed_stages_equal_the_same_compression_without_pipelining(cell: Cell) -> None:
    compressed_somewhere = False
    for record, oracle in zip(records(cell), records(cell.oracle), strict=True):
        difference = _close(record["grads"], record["sequential"])
        assert difference is None, difference
        # A stage whose block takes the stage's input (a leaf, kept exact) compresses nothing.
        compressed_somewhere |= _difference(record["grads"], oracle["grads"]) is not None
    assert compressed_somewhere, "the compression changed no gradient on any rank"


@pytest.mark.parametrize("cell", [c for c in CHECKED if c.schedule in SPLIT and c.form in REMAT_FORMS], ids=lambda c: c.name)
def test_a_split_backward_leaves_nothing_behind(cell: Cell) -> None:
    """After a zero-bubble step, no region is alive and remat tracks no microbatch: the
    recomputations the passes shared went with their microbatch."""
    for record in records(cell):
        assert record["leftovers"] == {"frames": 0, "microbatches": 0}, record["leftovers"]


# -------------------------------------------------------------- the table (docs)


def _outcome(cell: Cell) -> str:
    per_rank = [results.get(cell.name) for results in ranks(cell.world_size, table=True)]
    if any(isinstance(record, str) for record in per_rank):
        return "error"
    oracle = [results.get(cell.oracle.name) for results in ranks(cell.world_size, table=True)]
    wrong = any(_difference(got["grads"], want["grads"]) for got, want in zip(per_rank, oracle, strict=True))
    worst = max((v for record in per_rank for v in record["recomputes"].values()), default=0.0)
    return ("wrong" if wrong else "ok") + (f" ({worst:g}/mb)" if worst else "")


def print_table(worlds: tuple[int, ...] = (2, 4)) -> None:
    """Schedule x form, remat beside torch, at 2 and 4 ranks (``tests/integration/pipelining_table.py``)."""
    table = _cells(table=True)
    for world in worlds:
        ranks(world, table=True)
        forms = [f for f in dict.fromkeys(c.form for c in table if c.world_size == world) if f != "none"]
        print(f"\n{world} ranks, embedded GPT (token ids in), {torch.__version__}")
        print("| schedule | " + " | ".join(forms) + " |")
        print("|---" * (len(forms) + 1) + "|")
        for schedule in SCHEDULES:
            row = [Cell("gpt", schedule, form, world) for form in forms]
            shown = [("skipped" if c.skip_reason() else _outcome(c)) for c in row]
            print(f"| {schedule.removeprefix('Schedule')} | " + " | ".join(shown) + " |")
