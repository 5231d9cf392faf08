"""Pipeline-parallel training: each rank's memory, from the schedule's own order of work.

Layer: ``remat.memory`` (the tracker's package); imports ``remat._compat``,
``remat.errors``, the tracker and the training step's optimizer, and
``torch.distributed.pipelining`` lazily.

* :class:`Pipeline` says how a model runs in stages: over how many ranks,
  under which schedule of ``torch.distributed.pipelining``, in how many
  microbatches, and which stages each rank runs (one; two for the looped
  and V-shaped schedules).
* :class:`StagedModel` is what a build function returns: every stage's
  module in order, the whole batch, its target and the loss.
* :func:`estimate_pipeline_step` tracks one training step of every rank in
  this process, one rank after another, each in a simulated process group
  (sends and receives move nothing) on fake tensors. The real
  ``PipelineStage`` and schedule code runs, so a rank holds exactly the
  microbatches the schedule's order of actions keeps in flight there (no
  formula per schedule; ``docs/design/memory.md``, "Pipelined training").
* :func:`measure_pipeline_step` runs the same step on real gloo processes,
  one per rank, with the same tracker: the estimate's oracle. With compiled
  stages it counts what the allocator hands out instead (inductor's buffers
  are invisible to a tracker of tensors): :class:`RankAllocations`.

Example:
    >>> from remat.memory import Pipeline
    >>> Pipeline(ranks=2, schedule="ZBVZeroBubble", microbatches=4).stage_indices(0)
    (0, 3)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

import torch
from torch import Tensor, nn

from remat._compat.autograd import autograd_runs_in_this_process
from remat._compat.distributed import (
    collectives_run_on_fake_tensors,
    distributed_rank,
    sends_held_by_their_works,
    sharding_api_available,
    simulated_process_group,
    waits_return_their_input,
)
from remat._compat.fake import fake_tensor_mode, outside_fake_mode
from remat._compat.pipelining import (
    is_multi_stage,
    release_fake_outputs_as_plain,
    schedule_class,
    static_shapes_voted,
)
from remat._compat.profiler import labels_unseen
from remat._fork import ForkedPool, run_forked
from remat._scope import OpObserver
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError
from remat.memory._allocations import track_allocations
from remat.memory._estimate import AllocatedStep, Optimizer, _make_optimizer, resident_bytes
from remat.memory._report import MemoryReport
from remat.memory._sharded import (
    MIXED_PRECISIONS,
    MixedPrecision,
    Sharding,
    shard_model,
    tensor_parallel_plan,
)
from remat.memory._tracker import track

__all__ = [
    "PIPELINE_SCHEDULES",
    "Pipeline",
    "StagedModel",
    "estimate_pipeline_step",
    "measure_pipeline_step",
    "measure_this_rank",
]

PIPELINE_SCHEDULES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
"""The schedules of ``torch.distributed.pipelining``, by the names of their classes
without ``Schedule`` (``"1F1B"`` is ``Schedule1F1B``)."""

_V_SHAPED = frozenset({"ZBVZeroBubble", "DualPipeV"})
"""Schedules whose rank ``r`` runs stages ``r`` and ``2R - 1 - r`` (a V), not a loop."""

_SPLIT_BACKWARD = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})
"""Schedules that split a stage's backward into an input pass and a later weight pass."""


@dataclass(frozen=True)
class Pipeline:
    """How a model is trained in pipeline stages (``torch.distributed.pipelining``).

    Attributes:
        ranks: pipeline ranks (the schedule's world size).
        schedule: one of :data:`PIPELINE_SCHEDULES`.
        microbatches: microbatches per step (the batch is split along its
            first dimension).
        stages_per_rank: stages each rank runs; 0 (the default) means one for
            the single-stage schedules (GPipe, 1F1B) and two for the others
            (looped: rank ``r`` runs ``r, r + R, ...``; V-shaped ZBV and
            DualPipeV: ``r`` and ``2R - 1 - r``).
        data_parallel: FSDP2 ranks each stage is sharded over (``fully_shard``
            on each of its blocks, then on the stage).
        tensor_parallel: tensor-parallel ranks of each stage (its blocks'
            linear layers split by the model's plan, ``StagedModel.tp_plan``
            or its config's): ``ranks * data_parallel * tensor_parallel``
            ranks in all, on a ``("pp", "dp", "tp")`` device mesh.
        mixed_precision: with ``data_parallel > 1``, the stages compute in
            ``"bf16"`` or ``"fp16"`` (FSDP2's ``MixedPrecisionPolicy``, as
            :class:`~remat.memory.Sharding` sets it): the activations and the
            tensors sent between stages are in that dtype.
        reshard_after_forward: with ``data_parallel > 1``, False keeps each
            block's gathered parameters from its forward to its backward.

    Example:
        >>> Pipeline(ranks=4, schedule="Interleaved1F1B", microbatches=8).stage_indices(1)
        (1, 5)
    """

    ranks: int
    schedule: str = "1F1B"
    microbatches: int = 4
    stages_per_rank: int = 0
    data_parallel: int = 1
    tensor_parallel: int = 1
    mixed_precision: MixedPrecision | None = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        api = "remat.memory.Pipeline"
        for field, least in (("ranks", 1), ("microbatches", 1), ("stages_per_rank", 0), ("data_parallel", 1),
                             ("tensor_parallel", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CheckpointUsageError(f"{api}: {field} must be an int >= {least}, got {value!r}.")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise CheckpointUsageError(
                f"{api}: schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {self.schedule!r}."
            )
        if not isinstance(self.reshard_after_forward, bool):
            raise CheckpointTypeError(f"{api}: reshard_after_forward must be a bool, got {self.reshard_after_forward!r}.")
        if self.data_parallel == 1 and (self.mixed_precision is not None or not self.reshard_after_forward):
            raise CheckpointUsageError(
                f"{api}: mixed_precision and reshard_after_forward are FSDP2's settings of the sharded "
                "stages; give data_parallel > 1 (each stage sharded over that many ranks)."
            )
        self.stage_sharding  # noqa: B018  (Sharding checks the FSDP2 settings' values)
        per_rank = self.per_rank
        if self.schedule in _V_SHAPED and per_rank != 2:
            raise CheckpointUsageError(
                f"{api}: {self.schedule} runs two stages on each rank (a V), got stages_per_rank={per_rank}."
            )

    @property
    def schedule_class(self) -> type:
        """torch's schedule class; ``UnsupportedCheckpointError`` where this torch lacks it."""
        found = schedule_class(f"Schedule{self.schedule}")
        if found is None:
            raise UnsupportedCheckpointError(
                f"remat.memory.Pipeline: torch {torch.__version__} has no "
                f"torch.distributed.pipelining.Schedule{self.schedule}; use a newer torch or "
                "another schedule."
            )
        return found

    @property
    def per_rank(self) -> int:
        """Stages per rank, with the default resolved."""
        if self.stages_per_rank:
            return self.stages_per_rank
        return 1 if self.schedule in ("GPipe", "1F1B") else 2

    @property
    def n_stages(self) -> int:
        """Stages in all: ``ranks * per_rank``."""
        return self.ranks * self.per_rank

    def stage_indices(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, in order."""
        if not 0 <= rank < self.ranks:
            raise CheckpointUsageError(f"remat.memory.Pipeline: rank must be in [0, {self.ranks}), got {rank!r}.")
        if self.schedule in _V_SHAPED:
            return (rank, self.n_stages - 1 - rank)
        return tuple(rank + loop * self.ranks for loop in range(self.per_rank))

    @property
    def ranks_per_stage(self) -> int:
        """The ranks that run each stage together: ``data_parallel * tensor_parallel``."""
        return self.data_parallel * self.tensor_parallel

    @property
    def stage_sharding(self) -> Sharding | None:
        """How each stage is split over its ranks (FSDP2 and/or tensor parallel); None when not."""
        if self.ranks_per_stage == 1:
            return None
        return Sharding(world_size=self.ranks_per_stage, fsdp=self.data_parallel > 1, tp=self.tensor_parallel,
                        mixed_precision=self.mixed_precision, reshard_after_forward=self.reshard_after_forward)

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs a stage's backward as an input pass and a later weight
        pass (the zero-bubble schedules), where a checkpoint's ``weight_pass`` matters.

        Example:
            >>> Pipeline(ranks=2, schedule="ZBVZeroBubble").splits_backward
            True
        """
        return self.schedule in _SPLIT_BACKWARD

    @property
    def world_size(self) -> int:
        """Ranks in all: ``ranks * data_parallel * tensor_parallel``."""
        return self.ranks * self.ranks_per_stage

    def describe(self) -> str:
        """One line: ``"ZBVZeroBubble, 2 ranks x 2 stages, 4 microbatches"``."""
        sharding = self.stage_sharding
        sharded = f", each stage on {sharding.describe()}" if sharding is not None else ""
        return (f"{self.schedule}, {self.ranks} ranks x {self.per_rank} stages, {self.microbatches} "
                f"microbatches{sharded}")


@dataclass
class StagedModel:
    """A model cut into pipeline stages, with one step's data (what a build function returns).

    Attributes:
        stages: every stage's module, in order (``Pipeline.n_stages`` of them);
            ``remat.models.gpt_stages`` and ``llama_stages`` cut the models
            remat ships. Checkpoint their blocks before returning them.
        inputs: the first stage's positional arguments for the whole batch.
        target: the whole batch's target, passed to ``loss_fn`` with the last
            stage's output.
        loss_fn: ``(output, target) -> scalar loss`` of one microbatch.
        model: the whole model the stages were cut from, if any: a plan
            names its blocks by their paths there
            (:func:`remat.planner.plan_pipeline`), and tensor-parallel
            stages find their modules' styles there.
        tp_plan: with ``Pipeline(tensor_parallel=...)``, module-name globs of
            the whole model to ``"colwise"``/``"rowwise"``; default: the
            model's config's (:func:`remat.memory.tensor_parallel_plan`).
    """

    stages: Sequence[nn.Module]
    inputs: tuple[Tensor, ...]
    target: Tensor
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    model: nn.Module | None = None
    tp_plan: Mapping[str, str] | None = None


@dataclass(frozen=True)
class RankAllocations(AllocatedStep):
    """One pipeline rank's step measured by the allocator (:func:`measure_pipeline_step`
    with ``compiled=True``): compiled stages' buffers included, which a tracker of tensors
    does not see (``docs/design/memory.md``, "Compiled code").

    Attributes:
        resident_bytes: its stages' parameters, buffers and optimizer state when the
            step starts (every distinct storage once).
        step_peak_bytes: the step's own allocations at their peak.
        rank: the pipeline rank.

    Example:
        >>> RankAllocations(rank=0, resident_bytes=1024, step_peak_bytes=512).peak_bytes
        1536
    """

    rank: int


_WARMUP_STEPS = 2
"""Untracked steps before a compiled rank is measured: the first compiles the stages' blocks
and makes the optimizer's state, the second recompiles what that state asks for."""

BuildStages = Callable[[], StagedModel]
"""Makes the staged model and its data; a module-level function (or a
``functools.partial`` of one) where the step is measured on processes."""


def estimate_pipeline_step(
    build: BuildStages,
    *,
    pipeline: Pipeline,
    optimizer: Optimizer = "adamw",
    compiled: bool = False,
    processes: int | None = None,
) -> tuple[MemoryReport, ...]:
    """Every rank's memory in a training step of a pipelined model, estimated in this process.

    ``build`` runs inside a fake-tensor mode once per rank: the model and data
    have shapes, dtypes and storage sizes but no data, and allocate nothing.
    Each rank builds ``PipelineStage`` objects for its stages (shapes from
    one microbatch run through the stages), the schedule, and an optimizer
    over its stages' parameters (its state made first), and one step runs
    (schedule step, optimizer step) in a simulated process group of
    ``pipeline.ranks`` ranks. The report is the tracker's: parameters, gradients,
    optimizer state, activations of the microbatches in flight, the
    schedule's send and receive buffers, at the most this rank holds at once.
    The ranks are simulated independently, on Linux in forked copies of this
    process, one per usable CPU (``processes``): the same reports, sooner.

    Args:
        build: makes a :class:`StagedModel`; build as for a CPU run.
        pipeline: ranks, schedule and microbatches.
        optimizer: ``"adamw"``, ``"sgd"`` or ``"none"``.
        compiled: the stages' compiled blocks run under
            :func:`remat.memory.statically_compiled` (compile them in ``build``).
        processes: how many processes simulate ranks at once (this one and
            forked copies); default ``REMAT_PROCESSES`` where set, else every
            CPU this process may use; 1: all in this process.

    Raises:
        UnsupportedCheckpointError: torch lacks the schedule, or its
            collectives do not run on fake tensors (2.11 and newer do).
        CheckpointUsageError: a process group already exists in this process.

    Example:
        >>> import torch
        >>> from remat.memory import Pipeline, StagedModel, estimate_pipeline_step
        >>> def build():
        ...     stages = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(2)]
        ...     x, y = torch.zeros(8, 64), torch.zeros(8, 64)
        ...     return StagedModel(stages, (x,), y, torch.nn.functional.mse_loss)
        >>> reports = estimate_pipeline_step(build, pipeline=Pipeline(ranks=2, schedule="1F1B"))
        >>> [report.rank for report in reports]
        [0, 1]
    """
    api = "remat.memory.estimate_pipeline_step"
    check_request(pipeline, optimizer, api)
    return tuple(simulate_ranks(build, pipeline, optimizer=optimizer, compiled=compiled, processes=processes, api=api))


StepObserver = Callable[[int], OpObserver]
"""``step_observer(rank)``: told of every op of a rank's tracked step, by the tracker
(:class:`remat._scope.OpObserver`)."""


def simulate_ranks(
    build: BuildStages,
    pipeline: Pipeline,
    *,
    optimizer: Optimizer = "adamw",
    compiled: bool = False,
    ranks: Sequence[int] | None = None,
    step_observer: StepObserver | None = None,
    shapes: ExampleShapes | None = None,
    processes: int | None = None,
    api: str = "remat.memory.estimate_pipeline_step",
) -> list[MemoryReport]:
    """:func:`estimate_pipeline_step`'s work for ``ranks`` (default: all), with
    ``step_observer(rank)`` told of every op of each rank's tracked step (the planner's
    clock, with ``processes=1``: an observer in a forked copy changes only that copy). ``shapes`` carries the
    stages' example shapes from one call to the next (checkpointing does not change
    them). The caller has checked the pipeline and the torch release.

    Ranks are independent (each in its own simulated process group), so they are spread
    over ``processes`` forked copies of this process (:func:`run_simulations`). What a
    copy learns (example shapes it found) stays in it; its reports come back.
    """
    from remat.memory._compiled import statically_compiled

    shapes = shapes if shapes is not None else ExampleShapes()

    def simulated(rank: int) -> MemoryReport:
        # The first of each pipeline rank's ranks stands for all of them (FSDP2 pads every
        # shard to the same size; tensor parallelism splits heads and widths evenly).
        with simulated_process_group(pipeline.world_size, rank * pipeline.ranks_per_stage):
            mesh = _mesh(pipeline)  # outside the fake mode: a mesh reads its rank table
            fake = fake_tensor_mode()
            with fake:
                staged = _built(build, api)
            with fake, sends_held_by_their_works():
                observer = step_observer(rank) if step_observer is not None else None
                report: MemoryReport = _rank_step(
                    staged, pipeline, rank, optimizer, simulated=True, mesh=mesh,
                    wrap=statically_compiled if compiled else None, observer=observer, shapes=shapes,
                )
        return report

    chosen = list(range(pipeline.ranks)) if ranks is None else list(ranks)
    return run_simulations([functools.partial(simulated, rank) for rank in chosen], processes)


T = TypeVar("T")
J = TypeVar("J")


def run_simulations(tasks: Sequence[Callable[[], T]], processes: int | None = None) -> list[T]:
    """Independent simulations (each a training step on fake tensors) spread over
    ``processes`` forked copies of this process (default: ``REMAT_PROCESSES``, else every
    usable CPU; :func:`remat._fork.run_forked`). A copy that cannot run autograd (a CUDA
    build of torch forked after its first backward) takes no simulation; the others run them."""
    return run_forked(tasks, processes, copy_can_run=autograd_runs_in_this_process)


def simulation_pool(work: Callable[[J], T], processes: int | None = None) -> ForkedPool[J, T]:
    """A pool of forked copies of this process that run ``work`` (a simulation) on jobs as
    they are handed out (:class:`remat._fork.ForkedPool`), for a search whose next
    simulations depend on the last ones; copies that cannot run autograd take none, as in
    :func:`run_simulations`."""
    return ForkedPool(work, processes, copy_can_run=autograd_runs_in_this_process)


@overload
def measure_pipeline_step(
    build: BuildStages, *, pipeline: Pipeline, optimizer: Optimizer = ..., timeout_s: float = ...,
    compiled: Literal[False] = ...,
) -> tuple[MemoryReport, ...]: ...
@overload
def measure_pipeline_step(
    build: BuildStages, *, pipeline: Pipeline, optimizer: Optimizer = ..., timeout_s: float = ...,
    compiled: Literal[True],
) -> tuple[RankAllocations, ...]: ...
@overload
def measure_pipeline_step(
    build: BuildStages, *, pipeline: Pipeline, optimizer: Optimizer = ..., timeout_s: float = ...,
    compiled: bool,
) -> tuple[MemoryReport, ...] | tuple[RankAllocations, ...]: ...
def measure_pipeline_step(
    build: BuildStages,
    *,
    pipeline: Pipeline,
    optimizer: Optimizer = "adamw",
    timeout_s: float = 900.0,
    compiled: bool = False,
) -> tuple[MemoryReport, ...] | tuple[RankAllocations, ...]:
    """The same step as :func:`estimate_pipeline_step`, run for real: one gloo process per
    rank, real tensors on the CPU, tracked by the same tracker. ``build`` must be importable
    in a fresh interpreter (a module-level function, or a ``functools.partial`` of one).

    With ``compiled=True`` (the build compiles the stages' blocks) each rank first runs
    two untracked steps (they compile), then one step counted by the allocator
    (:func:`remat.memory.track_allocations`): a :class:`RankAllocations` per rank, the
    oracle of ``estimate_pipeline_step(..., compiled=True)``.

    Example:
        >>> reports = measure_pipeline_step(build, pipeline=Pipeline(ranks=2))  # doctest: +SKIP
        >>> [report.peak_bytes for report in reports]  # doctest: +SKIP
        [1234944, 1151488]
    """
    _check(pipeline, optimizer, "remat.memory.measure_pipeline_step")
    from remat.launch import run_on_ranks

    results = run_on_ranks(pipeline.world_size, "remat.memory._pipeline:measured_rank",
                           (build, pipeline, optimizer, compiled), timeout_s=timeout_s)
    return tuple(results[:: pipeline.ranks_per_stage])  # the first of each pipeline rank's ranks


def measured_rank(payload: tuple[BuildStages, Pipeline, Optimizer, bool]) -> MemoryReport | RankAllocations:
    """One rank of :func:`measure_pipeline_step` (run by ``remat.launch`` on each process)."""
    build, pipeline, optimizer, compiled = payload
    return measure_this_rank(build, pipeline, optimizer, compiled=compiled)


@overload
def measure_this_rank(
    build: BuildStages, pipeline: Pipeline, optimizer: Optimizer = ..., *, compiled: Literal[False] = ...
) -> MemoryReport: ...
@overload
def measure_this_rank(
    build: BuildStages, pipeline: Pipeline, optimizer: Optimizer = ..., *, compiled: Literal[True]
) -> RankAllocations: ...
@overload
def measure_this_rank(
    build: BuildStages, pipeline: Pipeline, optimizer: Optimizer = ..., *, compiled: bool
) -> MemoryReport | RankAllocations: ...
def measure_this_rank(
    build: BuildStages, pipeline: Pipeline, optimizer: Optimizer = "adamw", *, compiled: bool = False
) -> MemoryReport | RankAllocations:
    """This process's rank of :func:`measure_pipeline_step`, in the process group that
    exists (``torch.distributed`` initialized with ``pipeline.world_size`` ranks): several
    pipelines can be measured in one launch, one after another.

    Example:
        >>> report = measure_this_rank(build, Pipeline(ranks=2))  # doctest: +SKIP
    """
    rank = distributed_rank()
    if rank is None or rank[1] != pipeline.world_size:
        raise CheckpointUsageError(
            f"remat.memory.measure_this_rank: needs a process group of {pipeline.world_size} ranks "
            f"(pipeline ranks x data-parallel ranks), found {'none' if rank is None else f'{rank[1]} ranks'}."
        )
    mesh = _mesh(pipeline)
    staged = _built(build, "remat.memory.measure_this_rank")
    measured: MemoryReport | RankAllocations = _rank_step(
        staged, pipeline, rank[0] // pipeline.ranks_per_stage, optimizer, simulated=False, wrap=None, mesh=mesh,
        allocations=compiled,
    )
    return measured


def check_request(pipeline: Pipeline, optimizer: str, api: str) -> None:
    """Refuse a request that cannot be simulated here, before anything is built."""
    _check(pipeline, optimizer, api)
    if not collectives_run_on_fake_tensors():
        raise UnsupportedCheckpointError(
            f"{api}: simulating ranks needs a torch whose collectives run on fake tensors (2.11 "
            f"and newer have them); this is torch {torch.__version__}. Use a newer torch, or "
            "measure_pipeline_step on real processes."
        )
    if distributed_rank() is not None:
        raise CheckpointUsageError(
            f"{api}: a process group is already initialized in this process; the ranks are "
            "simulated in a process group of their own. Call it before "
            "torch.distributed.init_process_group, or in a separate process."
        )


def _check(pipeline: Pipeline, optimizer: str, api: str) -> None:
    if not isinstance(pipeline, Pipeline):
        raise CheckpointTypeError(f"{api}: pipeline must be a remat.memory.Pipeline, got {type(pipeline).__name__}.")
    if optimizer not in ("adamw", "sgd", "none"):
        raise CheckpointUsageError(f"{api}: optimizer must be 'adamw', 'sgd' or 'none', got {optimizer!r}.")
    pipeline.schedule_class  # noqa: B018  (refuses a schedule this torch lacks, before building)


def _built(build: BuildStages, api: str) -> StagedModel:
    staged = build()
    if not isinstance(staged, StagedModel):
        raise CheckpointTypeError(f"{api}: build() must return a remat.memory.StagedModel, got {type(staged).__name__}.")
    # Contiguous batches: torch 2.11's stages check a microbatch's strides against their
    # example's, and a sliced batch (tokens[:, :-1]) splits into differently strided pieces.
    return dataclasses.replace(
        staged, inputs=tuple(value.contiguous() for value in staged.inputs), target=staged.target.contiguous()
    )


def _rank_step(
    staged: StagedModel,
    pipeline: Pipeline,
    rank: int,
    optimizer: Optimizer,
    *,
    simulated: bool,
    wrap: Callable[[nn.Module], contextlib.AbstractContextManager[Any]] | None,
    observer: OpObserver | None = None,
    mesh: Any = None,
    shapes: ExampleShapes | None = None,
    allocations: bool = False,
) -> Any:
    """Build ``rank``'s stages and schedule, run one tracked step, return the tracker's report
    (with ``allocations``, warm up and return the allocator's count: a :class:`RankAllocations`)."""
    if len(staged.stages) != pipeline.n_stages:
        raise CheckpointUsageError(
            f"remat.memory: {pipeline.describe()} needs {pipeline.n_stages} stage modules, the "
            f"build gave {len(staged.stages)}."
        )
    indices = pipeline.stage_indices(rank)
    # Every stage's compiled blocks run as the compiler decides, the examples' forward too.
    compiling = wrap(nn.ModuleList(staged.stages)) if wrap is not None else contextlib.nullcontext()
    with compiling:
        return _tracked_step(staged, pipeline, rank, indices, optimizer, simulated, observer, mesh, shapes,
                             allocations)


def _tracked_step(
    staged: StagedModel,
    pipeline: Pipeline,
    rank: int,
    indices: tuple[int, ...],
    optimizer: Optimizer,
    simulated: bool,
    observer: OpObserver | None,
    mesh: Any,
    shapes: ExampleShapes | None,
    allocations: bool,
) -> MemoryReport | RankAllocations:
    from torch.distributed.pipelining import PipelineStage

    device = _device_of(staged.stages[indices[0]])
    compute = MIXED_PRECISIONS[pipeline.mixed_precision] if pipeline.mixed_precision is not None else None
    examples = (shapes or ExampleShapes()).examples(staged, pipeline.microbatches, device, compute)
    group = None
    stage_sharding = pipeline.stage_sharding
    if mesh is not None and stage_sharding is not None:
        group = mesh["pp"].get_group()
        for i in indices:  # tensor parallel first, then each of the stage's blocks, then the stage
            stage = staged.stages[i]
            plan = _stage_tp_plan(stage, staged, "remat.memory") if stage_sharding.tp > 1 else None
            # Outside the fake mode, as a sharded estimate shards: FSDP2 over a tensor-parallel
            # mesh joins the two meshes' rank tables, which must be real tensors (the
            # parameters are fake already, so sharding allocates nothing).
            with outside_fake_mode() if simulated else contextlib.nullcontext():
                shard_model(stage, stage_sharding, blocks=list(getattr(stage, "blocks", ())), tp_plan=plan,
                            mesh=_stage_mesh(mesh, stage_sharding))
    cls = pipeline.schedule_class
    last = pipeline.n_stages - 1

    def new_schedule() -> Any:
        """The rank's stages and their schedule, with no buffers yet (a stage makes its send
        and receive buffers in its first step)."""
        stages = [
            PipelineStage(staged.stages[i], i, pipeline.n_stages, device, group=group,
                          input_args=examples[i][0], output_args=examples[i][1])
            for i in indices
        ]
        if simulated:  # a fake output is sent and released as the real rank's plain one is
            for stage in stages:
                release_fake_outputs_as_plain(stage)
        return cls(stages if is_multi_stage(cls) else stages[0], n_microbatches=pipeline.microbatches,
                   loss_fn=staged.loss_fn)

    schedule = new_schedule()
    held = nn.ModuleList([staged.stages[i] for i in indices])
    optim = _make_optimizer(held, optimizer)

    def step() -> None:
        arguments = staged.inputs if 0 in indices else ()
        keywords: dict[str, Any] = {"target": staged.target, "losses": []} if last in indices else {}
        schedule.step(*arguments, **keywords)
        if optim is not None:
            optim.step()
        held.zero_grad(set_to_none=True)

    if allocations:
        for _ in range(_WARMUP_STEPS):
            step()
        # A fresh schedule for the measured step: its buffers are made inside the step, as
        # in the tracked one (the allocator's count does not see what the warm-up made).
        schedule = new_schedule()
        resident = resident_bytes(held, optim)
        with track_allocations(device.type, quiet=True) as meter:
            step()
        return RankAllocations(resident_bytes=resident, step_peak_bytes=meter.peak_bytes, rank=rank)
    if optim is not None:
        # The optimizer's state, made without a step of the pipeline: the one tracked step
        # is then a steady-state one (with the schedule's buffers set up inside it).
        for parameter in held.parameters():
            if parameter.requires_grad:
                parameter.grad = torch.zeros_like(parameter)
        optim.step()
        held.zero_grad(set_to_none=True)
    tracker = track(held, optimizer=optim)
    if simulated:  # a collective's wait, the schedule's static-shapes vote and profiler labels, on fake tensors
        tracker.answer_ops({**waits_return_their_input(), **static_shapes_voted(), **labels_unseen()})
    if observer is not None:
        tracker.observe_ops(observer)
    with tracker:
        step()
    return tracker.report()


Examples = list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]]
_Meta = tuple[torch.Size, torch.dtype, bool]


class ExampleShapes:
    """The stages' example shapes, found once (a forward of one microbatch through every
    stage) and made again, as empty tensors, for each later simulated rank."""

    def __init__(self) -> None:
        self.metas: list[tuple[tuple[_Meta, ...], tuple[_Meta, ...]]] | None = None

    def examples(
        self, staged: StagedModel, microbatches: int, device: torch.device, compute: torch.dtype | None = None
    ) -> Examples:
        """Every stage's example inputs and outputs; with ``compute`` (mixed precision), the
        floating tensors that stages send to each other are in that dtype, as FSDP2's
        mixed precision makes them (the examples are found in full precision)."""
        if self.metas is None:
            found = _stage_examples(staged, microbatches)
            self.metas = [(_metas(inputs), _metas(outputs)) for inputs, outputs in found]
            if compute is None:
                return found
        first = tuple(value.chunk(microbatches)[0] for value in staged.inputs)
        return [
            (first if index == 0 else _empty(inputs, device, compute), _empty(outputs, device, compute))
            for index, (inputs, outputs) in enumerate(self.metas)
        ]


def _metas(values: tuple[Tensor, ...]) -> tuple[_Meta, ...]:
    return tuple((value.shape, value.dtype, value.requires_grad) for value in values)


def _empty(metas: tuple[_Meta, ...], device: torch.device, compute: torch.dtype | None = None) -> tuple[Tensor, ...]:
    return tuple(
        torch.empty(shape, dtype=compute if compute is not None and dtype.is_floating_point else dtype,
                    device=device).requires_grad_(grad)
        for shape, dtype, grad in metas
    )


def _stage_examples(staged: StagedModel, microbatches: int) -> Examples:
    """Each stage's inputs and outputs for one microbatch (the static shapes its
    ``PipelineStage`` is built with), from the first microbatch run through the stages."""
    arguments = tuple(value.chunk(microbatches)[0] for value in staged.inputs)
    examples = []
    with torch.no_grad():
        for module in staged.stages:
            out = module(*arguments)
            outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            # A later stage sends its gradients back: outputs that carry one need grad.
            outputs = tuple(
                value.detach().requires_grad_(value.is_floating_point()) for value in outputs
            )
            examples.append((arguments, outputs))
            arguments = outputs
    return examples


def _mesh(pipeline: Pipeline) -> Any:
    """The ``("pp", "dp", "tp")`` device mesh of a pipeline whose stages are split; None otherwise."""
    if pipeline.ranks_per_stage == 1:
        return None
    if not sharding_api_available():
        raise UnsupportedCheckpointError(
            f"remat.memory: stages split over several ranks need FSDP2's public fully_shard and "
            f"DTensor (torch 2.6 and newer); this is torch {torch.__version__}."
        )
    from torch.distributed.device_mesh import init_device_mesh

    shape = (pipeline.ranks, pipeline.data_parallel, pipeline.tensor_parallel)
    return init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))


def _stage_mesh(mesh: Any, sharding: Sharding) -> Any:
    """The part of the pipeline's mesh one stage is split over, named as ``shard_model`` wants it."""
    if sharding.fsdp and sharding.tp > 1:
        return mesh["dp", "tp"]
    return mesh["tp"] if sharding.tp > 1 else mesh["dp"]


def _stage_tp_plan(stage: nn.Module, staged: StagedModel, api: str) -> dict[str, str]:
    """The model's tensor-parallel plan (module-name globs in the whole model: ``tp_plan``,
    or its config's) as the names of ``stage``'s own modules it covers."""
    if staged.model is None:
        raise CheckpointUsageError(
            f"{api}: tensor-parallel stages need StagedModel(model=...) (the whole model): its "
            "tensor-parallel plan names modules by their paths there."
        )
    plan = dict(staged.tp_plan) if staged.tp_plan is not None else tensor_parallel_plan(staged.model)
    paths = {id(module): path for path, module in staged.model.named_modules()}
    found = {}
    for name, module in stage.named_modules():
        path = paths.get(id(module))
        style = next((style for glob, style in plan.items() if path and fnmatch.fnmatchcase(path, glob)), None)
        if style is not None:
            found[name] = style
    return found


def _device_of(module: nn.Module) -> torch.device:
    for parameter in module.parameters():
        return parameter.device
    return torch.device("cpu")
