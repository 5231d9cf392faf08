"""Plans for pipelined training: each rank's blocks checkpointed as its own memory needs.

Layer: the top of ``remat.planner`` (beside ``_planner``); imports the
memory package's pipeline simulation (:mod:`remat.memory._pipeline`),
:func:`remat.apply_config` and the time model (:mod:`remat.planner.timing`).

Under a pipeline schedule the ranks hold different numbers of microbatches
at their peaks (under 1F1B stage ``i`` of ``S`` keeps up to ``S - i``), so
one strategy for every stage either wastes time on the later ranks or does
not fit on the first. :func:`plan_pipeline` chooses, rank by rank, how many
of its blocks to checkpoint fully and how many with a selective policy
(the first ones fully, the next selectively, the rest kept, as Megatron
counts recomputed layers per stage), and under the schedules that split
backward (:attr:`~remat.memory.Pipeline.splits_backward`) whether its
checkpoints keep the input pass's recomputation for the weight pass or
recompute again (``weight_pass``): the fastest choice whose peak fits one
per-rank budget (``docs/design/planner.md``, "Pipelined plans"):

1. every rank's steps are simulated with every block kept, every block
   selective and every block fully checkpointed, each checkpoint with each
   ``weight_pass`` where the backward splits (the schedule's own code on
   fake tensors, :func:`remat.memory.estimate_pipeline_step`), which gives
   each rank's peak and, under a modelled clock, its step time for each;
2. a rank's peak and time for ``f`` full and ``s`` selective blocks (with
   one ``weight_pass``) are interpolated between those (each block adds its
   share), and each rank takes the fastest choice predicted to fit;
3. each rank's fastest choice predicted to fit is simulated (in a round,
   only the ranks whose choice is not simulated yet); a rank whose
   simulation does not fit moves on to its next choice, a few rounds at
   most, and then takes its fastest choice simulated to fit: the plan's
   peaks and times are simulated, not predicted.

A rank's memory depends on its own blocks only, so choosing rank by rank is
the joint choice. The plan names blocks by their paths in the whole model;
:meth:`PipelinePlan.save` writes the TOML that :func:`remat.apply_config`
applies on every rank before the model is cut into stages.

Example:
    >>> from remat.memory import Pipeline
    >>> plan = plan_pipeline(build, pipeline=Pipeline(ranks=4), budget="2GiB")  # doctest: +SKIP
    >>> [rank.full_blocks for rank in plan.ranks]  # doctest: +SKIP
    [3, 2, 1, 0]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from remat._compat.fake import fake_tensor_mode
from remat.config import apply_config
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.memory import Pipeline, StagedModel, format_bytes
from remat.memory._estimate import Optimizer
from remat.memory._pipeline import BuildStages, ExampleShapes, check_request, simulate_ranks
from remat.memory._render import format_table
from remat.planner.budget import Budget, unreachable_budget
from remat.planner.timing import DeviceRates, ModelledClock

if TYPE_CHECKING:
    from remat._engine.split import WeightPass

__all__ = ["PipelinePlan", "PipelinePlanner", "RankPlan", "plan_pipeline"]

KEEP, FULL = "keep", "checkpoint"
WEIGHT_PASSES: tuple[WeightPass, ...] = ("keep", "recompute")
_ROUNDS = 6  # simulated rounds at most; then each rank takes its fastest choice simulated to fit


@dataclass(frozen=True)
class RankPlan:
    """One pipeline rank's part of a :class:`PipelinePlan`.

    Attributes:
        rank: the pipeline rank.
        stages: the stages it runs.
        blocks: its blocks' paths in the whole model, in the order they run.
        full_blocks: how many of them (the first ones) are fully checkpointed.
        selective_blocks: how many after those are checkpointed with the
            plan's selective option; the rest are kept.
        peak_bytes: the rank's simulated peak under the plan.
        step_s: its modelled step time under the plan.
        weight_pass: its checkpoints' ``weight_pass`` (``"keep"`` unless the
            schedule splits backward and recomputing for the weight pass
            is what fits fastest).
    """

    rank: int
    stages: tuple[int, ...]
    blocks: tuple[str, ...]
    full_blocks: int
    selective_blocks: int
    peak_bytes: int
    step_s: float
    weight_pass: WeightPass = "keep"


@dataclass(frozen=True)
class PipelinePlan:
    """A checkpoint plan for pipelined training, one choice per rank (:func:`plan_pipeline`).

    Attributes:
        pipeline: the pipeline it was made for.
        budget_bytes: the per-rank budget.
        selective: the option of the selectively checkpointed blocks.
        ranks: one :class:`RankPlan` per rank.
        unchecked_peak_bytes: each rank's simulated peak with every block kept.
        estimated_with: the rates of the modelled clock.
    """

    pipeline: Pipeline
    budget_bytes: int
    selective: str
    ranks: tuple[RankPlan, ...]
    unchecked_peak_bytes: tuple[int, ...]
    estimated_with: str

    @property
    def regions(self) -> dict[str, str]:
        """Every block's option, by its path in the whole model (``apply_config``'s regions)."""
        regions: dict[str, str] = {}
        for rank in self.ranks:
            choice = (rank.full_blocks, rank.selective_blocks, rank.weight_pass)
            for index, path in enumerate(rank.blocks):
                regions[path] = _option(index, choice, self.selective)
        return regions

    @property
    def peak_bytes(self) -> int:
        """The largest simulated peak over the ranks."""
        return max(rank.peak_bytes for rank in self.ranks)

    def apply(self, model: nn.Module) -> Any:
        """Checkpoint ``model``'s blocks as planned (before cutting it into stages); returns
        the :class:`~remat.placement.Placement`, whose ``remove()`` undoes it."""
        return apply_config(model, {"regions": self.regions})

    def save(self, path: str | Path) -> Path:
        """Write the plan as TOML that :func:`remat.apply_config` applies on every rank.

        Example:
            >>> plan.save("pipeline-plan.toml")                                            # doctest: +SKIP
            >>> remat.apply_config(model, remat.config_from_toml("pipeline-plan.toml"))  # doctest: +SKIP
        """
        if not isinstance(path, (str, Path)):
            raise CheckpointTypeError(f"remat.planner: PipelinePlan.save takes a path, got {type(path).__name__}.")
        lines = [
            "# A pipeline checkpoint plan made by remat.planner.plan_pipeline. Apply it on every rank,",
            "# before cutting the model into stages, with",
            "#   remat.apply_config(model, remat.config_from_toml(path))",
            "",
            "[activation_checkpoint.regions]",
            *(f'"{region}" = "{option}"' for region, option in self.regions.items()),
            "",
            "[plan]",
            f'pipeline = "{self.pipeline.describe()}"',
            f"budget_bytes = {self.budget_bytes}",
            f"peak_bytes_by_rank = {[rank.peak_bytes for rank in self.ranks]}",
            f"unchecked_peak_bytes_by_rank = {list(self.unchecked_peak_bytes)}",
            f'estimated_with = "{self.estimated_with}"',
        ]
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines) + "\n")
        return target

    def report(self) -> str:
        """One row per rank: its stages, what it checkpoints, its simulated peak and time
        (and its checkpoints' ``weight_pass`` where the schedule splits backward)."""
        split = self.pipeline.splits_backward
        header = ("rank", "stages", "blocks", "full", self.selective, "kept", *(("weight pass",) if split else ()),
                  "peak", "unchecked peak", "step (modelled)")
        rows = [
            (
                str(rank.rank), ",".join(map(str, rank.stages)), str(len(rank.blocks)), str(rank.full_blocks),
                str(rank.selective_blocks), str(len(rank.blocks) - rank.full_blocks - rank.selective_blocks),
                *((rank.weight_pass,) if split else ()),
                format_bytes(rank.peak_bytes), format_bytes(self.unchecked_peak_bytes[rank.rank]),
                f"{1e3 * rank.step_s:.2f} ms",
            )
            for rank in self.ranks
        ]
        title = f"{self.pipeline.describe()}; budget {format_bytes(self.budget_bytes)} per rank"
        return title + "\n" + format_table(header, rows)


def plan_pipeline(
    build: BuildStages,
    *,
    pipeline: Pipeline,
    budget: int | str | Budget,
    optimizer: Optimizer = "adamw",
    selective: str = "checkpoint:save_matmuls",
    rates: DeviceRates | None = None,
) -> PipelinePlan:
    """The fastest per-rank checkpointing of a pipelined model whose every rank fits ``budget``.

    ``build`` makes the model unchecked, cut into stages, with
    :attr:`StagedModel.model` set (the plan names blocks by their paths
    there) and each stage's blocks in a ``blocks`` attribute (as
    :func:`remat.models.gpt_stages` and ``llama_stages`` make them); it runs
    on fake tensors, so any size plans without allocating it. See the module
    docstring for the method; :class:`PipelinePlanner` plans several budgets
    from one set of simulations.

    Args:
        build: makes the unchecked :class:`~remat.memory.StagedModel`.
        pipeline: ranks, schedule, microbatches.
        budget: bytes per rank (``int``, ``"300MiB"``) or a percentage of
            the largest rank's unchecked peak (``"60%"``).
        optimizer: as :func:`remat.memory.estimate_pipeline_step`.
        selective: the option of the blocks checkpointed selectively
            (a saved plan's option name, ``"checkpoint:<policy>"``).
        rates: the modelled clock's device (default: ``DeviceRates.named("h100")``).

    Raises:
        InfeasibleBudgetError: a rank does not fit even with every block fully
            checkpointed; the message gives the smallest reachable peak.

    Example:
        >>> import torch
        >>> from remat.memory import Pipeline, StagedModel
        >>> from remat.models import GPT, GPTConfig, gpt_stages, lm_loss
        >>> def build():
        ...     gpt = GPT(GPTConfig(n_layers=4, seq_len=16, d_model=32, n_heads=2, d_ff=64))
        ...     tokens = torch.randint(256, (4, 17))
        ...     return StagedModel(gpt_stages(gpt, 2), (tokens[:, :-1],), tokens[:, 1:], lm_loss, model=gpt)
        >>> plan = plan_pipeline(build, pipeline=Pipeline(ranks=2, microbatches=2), budget="90%")
        >>> plan.peak_bytes <= plan.budget_bytes
        True
    """
    planner = PipelinePlanner(build, pipeline=pipeline, optimizer=optimizer, selective=selective, rates=rates)
    return planner.plan(budget)


class PipelinePlanner:
    """Plans one pipelined model at any number of budgets (:func:`plan_pipeline`): the
    simulations of the uniform choices run once, on the first plan.

    Example:
        >>> planner = PipelinePlanner(build, pipeline=Pipeline(ranks=4))  # doctest: +SKIP
        >>> plans = [planner.plan(budget) for budget in ("90%", "70%", "50%")]  # doctest: +SKIP
    """

    def __init__(
        self,
        build: BuildStages,
        *,
        pipeline: Pipeline,
        optimizer: Optimizer = "adamw",
        selective: str = "checkpoint:save_matmuls",
        rates: DeviceRates | None = None,
    ) -> None:
        self.api = "remat.planner.plan_pipeline"
        check_request(pipeline, optimizer, self.api)
        self.build, self.pipeline, self.optimizer, self.selective = build, pipeline, optimizer, selective
        self.rates = rates if rates is not None else DeviceRates.named("h100")
        self._uniform: dict[tuple[str, WeightPass], list[tuple[int, float]]] | None = None
        self._blocks: list[list[str]] | None = None
        self._shapes = ExampleShapes()  # the stages' shapes, found by the first simulation
        # Where the backward is one pass, what the weight pass reads is no choice.
        self.weight_passes: tuple[WeightPass, ...] = WEIGHT_PASSES if pipeline.splits_backward else ("keep",)

    def uniform(self) -> dict[tuple[str, WeightPass], list[tuple[int, float]]]:
        """Every rank's simulated (peak bytes, modelled step seconds) with all its blocks
        kept, selective, and fully checkpointed, the checkpoints with each ``weight_pass``
        this schedule distinguishes (simulated once), by ``(option, weight_pass)``."""
        if self._uniform is None:
            blocks = self.blocks()
            keep: tuple[str, WeightPass] = (KEEP, "keep")
            uniform = {keep: self._simulate({path: KEEP for rank in blocks for path in rank})}
            for option, weight_pass in itertools.product((self.selective, FULL), self.weight_passes):
                named = _with_weight_pass(option, weight_pass)
                uniform[option, weight_pass] = self._simulate({path: named for rank in blocks for path in rank})
            self._uniform = uniform
        return self._uniform

    def blocks(self) -> list[list[str]]:
        """Each rank's blocks, by their paths in the whole model."""
        if self._blocks is None:
            self._blocks = _rank_blocks(self.build, self.pipeline, self.api)
        return self._blocks

    def plan(self, budget: int | str | Budget) -> PipelinePlan:
        """The fastest plan whose every rank fits ``budget`` (see :func:`plan_pipeline`)."""
        wanted = Budget.parse(budget)
        uniform, blocks, pipeline = self.uniform(), self.blocks(), self.pipeline
        unchecked = tuple(peak for peak, _ in uniform[KEEP, "keep"])
        budget_bytes = wanted.resolve(max(unchecked))
        # Each rank's most frugal choice: every block fully checkpointed, the better weight pass.
        lowest = max(
            min(uniform[FULL, weight_pass][rank][0] for weight_pass in self.weight_passes)
            for rank in range(pipeline.ranks)
        )
        if lowest > budget_bytes:
            raise unreachable_budget(budget_bytes, lowest)
        menus = [self._menu(rank, len(paths)) for rank, paths in enumerate(blocks)]
        # What each rank's choices were simulated to (peak, time): a rank's memory and time
        # depend on its own blocks only, so a rank's result holds whatever the others chose,
        # and a round simulates only the ranks whose choice is new.
        known: list[dict[Choice, tuple[int, float]]] = []
        for rank, paths in enumerate(blocks):
            n = len(paths)
            seen: dict[Choice, tuple[int, float]] = {}
            for weight_pass in self.weight_passes:
                seen[0, 0, weight_pass] = uniform[KEEP, "keep"][rank]
                seen[0, n, weight_pass] = uniform[self.selective, weight_pass][rank]
                seen[n, 0, weight_pass] = uniform[FULL, weight_pass][rank]
            known.append(seen)
        for _ in range(_ROUNDS):
            trial = [_next_choice(menu, seen, budget_bytes, self._slack(rank))
                     for rank, (menu, seen) in enumerate(zip(menus, known, strict=True))]
            new = [rank for rank, choice in enumerate(trial) if choice not in known[rank]]
            if not new:
                break
            for rank, result in zip(new, self._simulate(_regions(blocks, trial, self.selective), new), strict=True):
                known[rank][trial[rank]] = result
        chosen = [_fitting(menu, seen, budget_bytes) for menu, seen in zip(menus, known, strict=True)]
        ranks = tuple(
            RankPlan(
                rank=rank, stages=pipeline.stage_indices(rank), blocks=tuple(blocks[rank]),
                full_blocks=chosen[rank][0], selective_blocks=chosen[rank][1],
                peak_bytes=known[rank][chosen[rank]][0], step_s=known[rank][chosen[rank]][1],
                weight_pass=_kept_choice(chosen[rank]),
            )
            for rank in range(pipeline.ranks)
        )
        return PipelinePlan(pipeline, budget_bytes, self.selective, ranks, unchecked, self.rates.describe())

    def _menu(self, rank: int, n_blocks: int) -> list[tuple[Choice, float]]:
        """A rank's choices with their interpolated peaks, fastest first (fewer bytes first
        among equally fast ones; see :func:`_interpolated`)."""
        uniform = self.uniform()
        ranked = []
        for weight_pass in self.weight_passes:
            corners = [uniform[option][rank] for option in
                       ((KEEP, "keep"), (self.selective, weight_pass), (FULL, weight_pass))]
            ranked += [(step_s, peak, (full, selective, weight_pass))
                       for full, selective, peak, step_s in _interpolated(n_blocks, corners)]
        ranked.sort(key=lambda entry: entry[:2])
        return [(choice, peak) for _, peak, choice in ranked]

    def _slack(self, rank: int) -> float:
        """How far over the budget an interpolated peak may be and still be worth simulating:
        a tenth of the span from every block kept to every block fully checkpointed."""
        uniform = self.uniform()
        return 0.1 * (uniform[KEEP, "keep"][rank][0] - uniform[FULL, "keep"][rank][0])

    def _simulate(self, regions: Mapping[str, str], ranks: Sequence[int] | None = None) -> list[tuple[int, float]]:
        """The simulated peak and modelled steady-state step time of every rank (or of
        ``ranks``, in that order) with ``regions`` applied."""
        clocks: dict[int, ModelledClock] = {}

        def clock(rank: int) -> ModelledClock:
            clocks[rank] = ModelledClock(self.rates)
            return clocks[rank]

        chosen = list(range(self.pipeline.ranks)) if ranks is None else list(ranks)
        reports = simulate_ranks(
            functools.partial(_checkpointed, self.build, dict(regions)), self.pipeline,
            optimizer=self.optimizer, ranks=chosen, step_context=clock, shapes=self._shapes, api=self.api,
        )
        return [(report.peak_bytes, clocks[rank].seconds()) for rank, report in zip(chosen, reports, strict=True)]


Choice = tuple[int, int, "WeightPass"]
"""A rank's choice: how many blocks are fully checkpointed, how many selectively, and its
checkpoints' ``weight_pass``."""


Simulated = Mapping[Choice, tuple[int, float]]
"""A rank's simulated choices: each one's (peak bytes, modelled step seconds)."""


def _next_choice(menu: Sequence[tuple[Choice, float]], known: Simulated, budget_bytes: int, slack: float) -> Choice:
    """The fastest choice that fits as simulated, or that is not simulated yet and is
    predicted to fit (within ``slack``): the one to simulate next."""
    for choice, predicted in menu:
        result = known.get(choice)
        if (result is not None and result[0] <= budget_bytes) or (result is None and predicted <= budget_bytes + slack):
            return choice
    return _fitting(menu, known, budget_bytes)


def _fitting(menu: Sequence[tuple[Choice, float]], known: Simulated, budget_bytes: int) -> Choice:
    """The fastest choice simulated to fit (every block fully checkpointed fits: checked first)."""
    for choice, _ in menu:
        result = known.get(choice)
        if result is not None and result[0] <= budget_bytes:
            return choice
    raise AssertionError("remat bug: a pipeline rank has no choice that fits, though its most frugal one did")


def _kept_choice(choice: Choice) -> WeightPass:
    """The weight pass a choice really sets: with nothing checkpointed there is none to set."""
    full, selective, weight_pass = choice
    return weight_pass if full + selective else "keep"


def _with_weight_pass(option: str, weight_pass: WeightPass) -> str:
    """A checkpoint's option name with its ``weight_pass`` (a region option of :func:`remat.apply_config`)."""
    return option if weight_pass == "keep" else f"{option}+weight_pass:{weight_pass}"


def _option(index: int, choice: Choice, selective_option: str) -> str:
    full, selective, weight_pass = choice
    if index < full:
        return _with_weight_pass(FULL, weight_pass)
    return _with_weight_pass(selective_option, weight_pass) if index < full + selective else KEEP


def _regions(blocks: Sequence[Sequence[str]], choice: Sequence[Choice], selective: str) -> dict[str, str]:
    return {path: _option(index, choice[rank], selective)
            for rank, paths in enumerate(blocks) for index, path in enumerate(paths)}


def _interpolated(n_blocks: int, uniform: Sequence[tuple[int, float]]) -> list[tuple[int, int, float, float]]:
    """Every ``(full, selective, predicted peak, predicted step seconds)`` of a rank.

    ``uniform`` is the rank's (peak, time) with every block kept, selective, full; a
    choice's peak and time are interpolated: each block moves its share of the way.
    """
    (keep_peak, keep_s), (selective_peak, selective_s), (full_peak, full_s) = uniform
    found = []
    for full, selective in itertools.product(range(n_blocks + 1), repeat=2):
        if full + selective > n_blocks:
            continue
        peak = keep_peak + (full * (full_peak - keep_peak) + selective * (selective_peak - keep_peak)) / n_blocks
        step_s = keep_s + (full * (full_s - keep_s) + selective * (selective_s - keep_s)) / n_blocks
        found.append((full, selective, peak, step_s))
    return found


def _checkpointed(build: BuildStages, regions: dict[str, str]) -> StagedModel:
    staged = build()
    assert staged.model is not None  # _rank_blocks, which runs first, refuses a build without it
    apply_config(staged.model, {"regions": regions})
    return staged


def _rank_blocks(build: BuildStages, pipeline: Pipeline, api: str) -> list[list[str]]:
    """Each rank's blocks, by their paths in the whole model (from one build on fake tensors)."""
    with fake_tensor_mode():
        staged = build()
    model = staged.model
    if not isinstance(model, nn.Module):
        raise CheckpointUsageError(
            f"{api}: the build's StagedModel needs model= (the whole model): the plan names "
            "blocks by their paths there."
        )
    paths = {id(module): path for path, module in model.named_modules()}
    ranks = []
    for rank in range(pipeline.ranks):
        found: list[str] = []
        for index in pipeline.stage_indices(rank):
            stage_blocks = getattr(staged.stages[index], "blocks", None)
            if not isinstance(stage_blocks, nn.ModuleList) or any(id(b) not in paths for b in stage_blocks):
                raise CheckpointUsageError(
                    f"{api}: stage {index} needs its blocks in a `blocks` ModuleList of the model's "
                    "own modules (as remat.models.gpt_stages and llama_stages cut them)."
                )
            found += [paths[id(block)] for block in stage_blocks]
        ranks.append(found)
    return ranks
