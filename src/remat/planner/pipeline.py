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
3. each rank searches alone (:class:`~remat.planner.rank_search.RankSearch`):
   its fastest choice predicted to fit is simulated; where that does not
   fit, or a choice faster by more than a tie (0.5% of its unchecked step)
   may fit, it moves on to its next choice, a few tries at most, and then
   takes, of its choices simulated to fit and tied with the fastest, the
   smallest peak: the plan's peaks and times are simulated, not predicted.
   Every rank's simulations run on one pool of forked processes, each
   rank's next one as soon as its last result is in.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from remat._compat.fake import fake_tensor_mode
from remat.config import apply_config
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.memory import Pipeline, StagedModel, format_bytes
from remat.memory._estimate import Optimizer
from remat.memory._pipeline import (
    BuildStages,
    ExampleShapes,
    check_request,
    run_simulations,
    simulate_ranks,
    simulation_pool,
)
from remat.memory._render import format_table
from remat.planner.budget import Budget, unreachable_budget
from remat.planner.rank_search import Choice, MenuEntry, RankSearch, interpolated
from remat.planner.timing import DeviceRates, ModelledClock

if TYPE_CHECKING:
    from remat._engine.split import WeightPass
    from remat._fork import ForkedPool

__all__ = ["PipelinePlan", "PipelinePlanner", "RankPlan", "plan_pipeline"]

KEEP, FULL = "keep", "checkpoint"
WEIGHT_PASSES: tuple[WeightPass, ...] = ("keep", "recompute")
_SAMPLED_BLOCKS = 2
"""Blocks per stage in the simulations that price the checkpoint options where every stage
has at least twice as many alike blocks (``PipelinePlanner.corners``)."""


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
    processes: int | None = None,
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
        processes: as :func:`remat.memory.estimate_pipeline_step` (how many
            processes simulate ranks at once; default every usable CPU).

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
    planner = PipelinePlanner(
        build, pipeline=pipeline, optimizer=optimizer, selective=selective, rates=rates, processes=processes
    )
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
        processes: int | None = None,
    ) -> None:
        self.api = "remat.planner.plan_pipeline"
        self.processes = processes
        check_request(pipeline, optimizer, self.api)
        self.build, self.pipeline, self.optimizer, self.selective = build, pipeline, optimizer, selective
        self.rates = rates if rates is not None else DeviceRates.named("h100")
        self._uniform: dict[tuple[str, WeightPass], list[tuple[int, float]]] | None = None
        self._corners: dict[tuple[str, WeightPass], list[tuple[int, float]]] | None = None
        self._unchecked: list[tuple[int, float]] | None = None
        # Each rank's corners by (option, weight_pass), as they come in (corners() has them all).
        self._rows: list[dict[tuple[str, WeightPass], tuple[int, float]] | None] = [None] * pipeline.ranks
        self._blocks: list[list[str]] | None = None
        self._sampled = False  # whether the stages are long and alike enough to price on a sample
        self._shapes = ExampleShapes()  # the stages' shapes, found by the first simulation
        # Where the backward is one pass, what the weight pass reads is no choice.
        self.weight_passes: tuple[WeightPass, ...] = WEIGHT_PASSES if pipeline.splits_backward else ("keep",)

    def uniform(self) -> dict[tuple[str, WeightPass], list[tuple[int, float]]]:
        """Every rank's simulated (peak bytes, modelled step seconds) with all its blocks
        kept, selective, and fully checkpointed, the checkpoints with each ``weight_pass``
        this schedule distinguishes (simulated once), by ``(option, weight_pass)``."""
        if self._uniform is None:
            blocks = self.blocks()
            uniform: Corners = {(KEEP, "keep"): self._keep_all()}
            for option, weight_pass in self._checkpoints():
                named = _with_weight_pass(option, weight_pass)
                uniform[option, weight_pass] = self._simulate({path: named for rank in blocks for path in rank})
            self._uniform = uniform
        return self._uniform

    def corners(self) -> dict[tuple[str, WeightPass], list[tuple[int, float]]]:
        """What the plan's menus interpolate between: :meth:`uniform`'s corners, or where
        every stage has at least ``2 * _SAMPLED_BLOCKS`` blocks alike (Llama-3.1-8B in 4
        stages has 8), the same corners priced on stages cut short.

        Every block kept is simulated in full (the unchecked peaks are exact). Each other
        corner is simulated with the stages cut to 1 block and to ``_SAMPLED_BLOCKS``
        blocks, and extended: each further block adds what the second one added (so what
        happens once per stage, such as one block's recomputation at a time, is not
        scaled). A prediction, a few times cheaper than simulating long stages, which the
        plan's searches check by simulating their choices in full
        (``docs/design/planner.md``, "Pipelined plans").
        """
        if self._corners is None:
            with self._pool() as pool:
                pending = _Pending(pool)
                self._gather_corners(pending, lambda rank: None)
                pending.run()
        assert self._corners is not None  # every rank's corners came in
        return self._corners

    def _gather_corners(self, pending: _Pending, ready: Callable[[int], None]) -> None:
        """Hand out the simulations of :meth:`corners` not run yet, and call ``ready(rank)``
        as soon as a rank's corners are in (at once, for every rank, where all are)."""
        ranks = range(self.pipeline.ranks)
        blocks = self.blocks()
        if self._corners is None and not self._sampled and self._uniform is not None:
            self._corners = self._uniform  # the corners are uniform()'s, simulated already
        if self._corners is not None:
            for rank in ranks:
                self._rows[rank] = {key: row[rank] for key, row in self._corners.items()}
                ready(rank)
            return
        unchecked: list[tuple[int, float] | None] = (
            [*self._unchecked] if self._unchecked is not None else [None] * len(ranks))
        # A checkpoint's corner: on stages cut to 1 and to _SAMPLED_BLOCKS blocks, or in full.
        cuts: tuple[int | None, ...] = (_SAMPLED_BLOCKS, 1) if self._sampled else (None,)
        wanted = [(option, weight_pass, cut) for cut in cuts for option, weight_pass in self._checkpoints()]
        results: list[dict[tuple[str, WeightPass, int | None], tuple[int, float]]] = [{} for _ in ranks]
        rows = self._rows

        def landed(rank: int) -> None:
            kept_result = unchecked[rank]
            if kept_result is None or len(results[rank]) < len(wanted):
                return
            row = {(KEEP, "keep"): kept_result, **self._extended(rank, results[rank])}
            rows[rank] = row
            if all(found is not None for found in rows):
                self._corners = {key: [found[key] for found in rows if found is not None] for key in row}
                if not self._sampled:
                    self._uniform = self._corners
            ready(rank)

        def kept_landed(rank: int, result: tuple[int, float]) -> None:
            unchecked[rank] = result
            if all(found is not None for found in unchecked):
                self._unchecked = [found for found in unchecked if found is not None]
            landed(rank)

        def checkpoint_landed(rank: int, key: tuple[str, WeightPass, int | None], result: tuple[int, float]) -> None:
            results[rank][key] = result
            landed(rank)

        kept = {path: KEEP for paths in blocks for path in paths}
        # The longest first (every block kept, then the longer cuts), so that no process is
        # left with a long one at the end.
        for rank in ranks:
            if unchecked[rank] is None:
                pending.submit((rank, kept, None), functools.partial(kept_landed, rank))
        for option, weight_pass, cut in wanted:
            named = _with_weight_pass(option, weight_pass)
            for rank in ranks:
                job = (rank, {path: named for paths in blocks for path in paths}, cut)
                pending.submit(job, functools.partial(checkpoint_landed, rank, (option, weight_pass, cut)))

    def _extended(
        self, rank: int, results: Mapping[tuple[str, WeightPass, int | None], tuple[int, float]]
    ) -> dict[tuple[str, WeightPass], tuple[int, float]]:
        """A rank's checkpoint corners from its simulations (:meth:`corners`): as simulated
        in full, or extended from the stages cut short: each block beyond the sample adds
        what the second sampled block added."""
        if not self._sampled:
            return {(option, weight_pass): results[option, weight_pass, None]
                    for option, weight_pass in self._checkpoints()}
        per_stage = len(self.pipeline.stage_indices(rank))
        more = (len(self.blocks()[rank]) - _SAMPLED_BLOCKS * per_stage) / ((_SAMPLED_BLOCKS - 1) * per_stage)
        row = {}
        for option, weight_pass in self._checkpoints():
            one, two = results[option, weight_pass, 1], results[option, weight_pass, _SAMPLED_BLOCKS]
            row[option, weight_pass] = (round(two[0] + more * (two[0] - one[0])), two[1] + more * (two[1] - one[1]))
        return row

    def _checkpoints(self) -> list[tuple[str, WeightPass]]:
        return list(itertools.product((self.selective, FULL), self.weight_passes))

    def _keep_all(self) -> list[tuple[int, float]]:
        """Every rank simulated with every block kept (once)."""
        if self._unchecked is None:
            self._unchecked = self._simulate({path: KEEP for rank in self.blocks() for path in rank})
        return self._unchecked

    def blocks(self) -> list[list[str]]:
        """Each rank's blocks, by their paths in the whole model."""
        if self._blocks is None:
            self._blocks, self._sampled = _rank_blocks(self.build, self.pipeline, self.api)
        return self._blocks

    def plan(self, budget: int | str | Budget) -> PipelinePlan:
        """The fastest plan whose every rank fits ``budget`` (see :func:`plan_pipeline`).

        Each rank searches alone (:class:`~remat.planner.rank_search.RankSearch`): its
        first try as soon as its own corners are in, each next one as soon as its last
        result is, all on one pool of forked processes (``docs/design/planner.md``, "Ranks
        in parallel")."""
        wanted = Budget.parse(budget)
        blocks, pipeline = self.blocks(), self.pipeline
        budget_bytes: int | None = None
        if self._corners is not None:
            budget_bytes = wanted.resolve(max(peak for peak, _ in self._corners[KEEP, "keep"]))
            # Each rank's most frugal choice: every block fully checkpointed, the better weight pass.
            if self._lowest(self._corners) > budget_bytes and self._lowest(self.uniform()) > budget_bytes:
                raise unreachable_budget(budget_bytes, self._lowest(self.uniform()))
        searches: dict[int, RankSearch] = {}
        waiting: list[int] = []  # ranks whose corners are in, before a share of the unchecked peak is known
        with self._pool() as pool:
            pending = _Pending(pool)

            def advance(rank: int) -> None:
                search = searches[rank]
                choice = search.next_try()
                tries = [choice] if choice is not None else search.frugal_tries()
                for tried in tries:
                    def landed(result: tuple[int, float], tried: Choice = tried) -> None:
                        search.simulated(tried, result)
                        if choice is not None:
                            advance(rank)

                    # In turn, behind the corners handed out: a try put first kept the last
                    # rank's corners, and so its whole search, waiting behind the others'.
                    pending.submit(self._try_job(rank, tried), landed)

            def start(rank: int) -> None:
                assert budget_bytes is not None and self._unchecked is not None
                row = self._row(rank)
                n_blocks = len(blocks[rank])
                searches[rank] = RankSearch(
                    self._menu(row, n_blocks), self._simulated_corners(row, n_blocks),
                    budget_bytes=budget_bytes, n_blocks=n_blocks, weight_passes=self.weight_passes,
                )
                advance(rank)

            def ready(rank: int) -> None:
                nonlocal budget_bytes
                if budget_bytes is None:
                    if self._unchecked is None:  # a share of the unchecked peak, not known yet
                        waiting.append(rank)
                        return
                    budget_bytes = wanted.resolve(max(peak for peak, _ in self._unchecked))
                    for earlier in waiting:
                        start(earlier)
                start(rank)

            if wanted.nbytes is not None:
                budget_bytes = wanted.nbytes
            self._gather_corners(pending, ready)
            pending.run()
        assert budget_bytes is not None and self._corners is not None
        answers = [searches[rank].answer() for rank in range(pipeline.ranks)]
        chosen = [choice for choice in answers if choice is not None]
        if len(chosen) < len(answers):
            unfit = [searches[rank] for rank, choice in enumerate(answers) if choice is None]
            raise unreachable_budget(budget_bytes, _smallest_reachable(unfit))
        unchecked = tuple(peak for peak, _ in self._corners[KEEP, "keep"])
        ranks = tuple(
            RankPlan(
                rank=rank, stages=pipeline.stage_indices(rank), blocks=tuple(blocks[rank]),
                full_blocks=chosen[rank][0], selective_blocks=chosen[rank][1],
                peak_bytes=searches[rank].known[chosen[rank]][0], step_s=searches[rank].known[chosen[rank]][1],
                weight_pass=_kept_choice(chosen[rank]),
            )
            for rank in range(pipeline.ranks)
        )
        return PipelinePlan(pipeline, budget_bytes, self.selective, ranks, unchecked, self.rates.describe())

    def _lowest(self, corners: Mapping[tuple[str, WeightPass], Sequence[tuple[int, float]]]) -> int:
        """The largest rank's peak with every block fully checkpointed, each rank with its
        better weight pass."""
        return max(
            min(corners[FULL, weight_pass][rank][0] for weight_pass in self.weight_passes)
            for rank in range(self.pipeline.ranks)
        )

    def _row(self, rank: int) -> dict[tuple[str, WeightPass], tuple[int, float]]:
        """A rank's corners, once they are in (:meth:`_gather_corners` calls ``ready``)."""
        found = self._rows[rank]
        assert found is not None
        return found

    def _simulated_corners(
        self, row: Mapping[tuple[str, WeightPass], tuple[int, float]], n_blocks: int
    ) -> dict[Choice, tuple[int, float]]:
        """A rank's choices simulated in full before its search: every block kept, and
        where :meth:`corners` are :meth:`uniform`'s, every block selective and full."""
        seen: dict[Choice, tuple[int, float]] = {}
        for weight_pass in self.weight_passes:
            seen[0, 0, weight_pass] = row[KEEP, "keep"]
            if not self._sampled:  # the corners are uniform()'s, simulated in full
                seen[0, n_blocks, weight_pass] = row[self.selective, weight_pass]
                seen[n_blocks, 0, weight_pass] = row[FULL, weight_pass]
        return seen

    def _try_job(self, rank: int, choice: Choice) -> SimulationJob:
        """The simulation of ``choice`` on ``rank``: a rank's result does not depend on the
        others' blocks, so theirs are left kept."""
        kept: Choice = (0, 0, "keep")
        choices = [choice if other == rank else kept for other in range(self.pipeline.ranks)]
        return rank, _regions(self.blocks(), choices, self.selective), None

    def _menu(self, row: Mapping[tuple[str, WeightPass], tuple[int, float]], n_blocks: int) -> list[MenuEntry]:
        """A rank's choices with their interpolated peaks and step times, fastest first
        (fewer bytes first among equally fast ones; see
        :func:`~remat.planner.rank_search.interpolated`)."""
        ranked = []
        for weight_pass in self.weight_passes:
            points = [row[option] for option in ((KEEP, "keep"), (self.selective, weight_pass), (FULL, weight_pass))]
            ranked += [(step_s, peak, (full, selective, weight_pass))
                       for full, selective, peak, step_s in interpolated(n_blocks, points)]
        ranked.sort(key=lambda entry: entry[:2])
        return [(choice, peak, step_s) for step_s, peak, choice in ranked]

    def _simulate(
        self, regions: Mapping[str, str], ranks: Sequence[int] | None = None, *, cut: int | None = None
    ) -> list[tuple[int, float]]:
        """The simulated peak and modelled steady-state step time of every rank (or of
        ``ranks``, in that order) with ``regions`` applied; with ``cut``, on stages cut
        to their first ``cut`` blocks."""
        chosen = range(self.pipeline.ranks) if ranks is None else ranks
        return self._simulate_jobs([(rank, regions, cut) for rank in chosen])

    def _simulate_jobs(self, jobs: Sequence[SimulationJob]) -> list[tuple[int, float]]:
        """Each ``(rank, regions, cut)`` job's simulated peak and modelled step time (as
        :meth:`_simulate`), the jobs spread over ``processes`` forked copies of this
        process (:func:`remat.memory._pipeline.run_simulations`): ranks are independent."""
        return run_simulations([functools.partial(self._simulate_one, *job) for job in jobs], self.processes)

    def _pool(self) -> ForkedPool[SimulationJob, tuple[int, float]]:
        """Forked copies of this process that simulate jobs as they are handed out
        (:func:`remat.memory._pipeline.simulation_pool`)."""
        return simulation_pool(self._simulate_job, self.processes)

    def _simulate_job(self, job: SimulationJob) -> tuple[int, float]:
        return self._simulate_one(*job)

    def _simulate_one(self, rank: int, regions: Mapping[str, str], cut: int | None) -> tuple[int, float]:
        clock = ModelledClock(self.rates)
        (report,) = simulate_ranks(
            functools.partial(_checkpointed, self.build, dict(regions), cut),
            self.pipeline,
            optimizer=self.optimizer, ranks=[rank], step_observer=lambda _: clock, shapes=self._shapes,
            processes=1, api=self.api,
        )
        return report.peak_bytes, clock.seconds()


SimulationJob = tuple[int, Mapping[str, str], "int | None"]
"""A simulation for :meth:`PipelinePlanner._simulate_one`: the rank, every block's region
option, and the blocks per stage where the stages are cut short (None: in full)."""


class _Pending:
    """Simulations handed to a pool, each with what to do with its result (which may hand
    out more): one rank's search moves on as soon as its own result is in."""

    def __init__(self, pool: ForkedPool[SimulationJob, tuple[int, float]]) -> None:
        self.pool = pool
        self._then: dict[int, Callable[[tuple[int, float]], None]] = {}

    def submit(self, job: SimulationJob, then: Callable[[tuple[int, float]], None]) -> None:
        self._then[self.pool.submit(job)] = then

    def run(self) -> None:
        """Collect results, and do what each one was submitted with, until none is pending."""
        while self._then:
            ticket, result = self.pool.next_result()
            self._then.pop(ticket)(result)


Corners = dict[tuple[str, "WeightPass"], list[tuple[int, float]]]
"""Every rank's (peak bytes, modelled step seconds) by ``(option, weight_pass)`` with all its
blocks under that option."""


def _smallest_reachable(unfit: Sequence[RankSearch]) -> int:
    """The smallest peak any plan reaches, from the searches of the ranks where nothing fits:
    the largest of their most frugal peaks, which each simulated last
    (:meth:`RankSearch.frugal_tries`); every other rank fits below it. (Before, it came from
    :meth:`PipelinePlanner.uniform`, which on sampled corners simulated every rank's uniform
    choices in full again: Llama-3.1-8B in 4 stages took 106 s for an unreachable budget.)"""
    peaks = [search.frugal_peak() for search in unfit]
    assert all(peak is not None for peak in peaks)  # a search ends with its frugal tries
    return max(peak for peak in peaks if peak is not None)


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


def _checkpointed(build: BuildStages, regions: dict[str, str], cut: int | None) -> StagedModel:
    staged = build()
    assert staged.model is not None  # _rank_blocks, which runs first, refuses a build without it
    apply_config(staged.model, {"regions": regions})
    if cut is not None:  # _rank_blocks found every stage's blocks in a ModuleList, longer than this
        for stage in staged.stages:
            del _stage_blocks(stage)[cut:]
    return staged


def _rank_blocks(build: BuildStages, pipeline: Pipeline, api: str) -> tuple[list[list[str]], bool]:
    """Each rank's blocks, by their paths in the whole model (from one build on fake tensors),
    and whether a few blocks stand for a stage's: every stage has at least
    ``2 * _SAMPLED_BLOCKS`` blocks, all of one class with the same parameter shapes."""
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
    sampled = all(
        len(run) >= 2 * _SAMPLED_BLOCKS and len({_likeness(block) for block in run}) == 1
        for run in map(_stage_blocks, staged.stages)
    )
    return ranks, sampled


def _stage_blocks(stage: nn.Module) -> nn.ModuleList:
    found = getattr(stage, "blocks", None)
    assert isinstance(found, nn.ModuleList)  # _rank_blocks refuses a stage without them
    return found


def _likeness(block: nn.Module) -> tuple[object, ...]:
    """What two blocks share when one can stand for the other: class and parameter shapes."""
    return (type(block), *((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters()))
