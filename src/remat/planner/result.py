"""The plan a user gets back: planner data plus the three things one does with it.

Layer: the top of the planner's data side. It imports the layers that consume
a plan (:mod:`~remat.planner.apply`, :mod:`~remat.planner.render`) and the
solvers (for its Pareto front); those see :class:`Plan` only as a type, so no
import circle runs through the planner (``docs/design/architecture.md``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from remat.config import CheckpointConfig
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.memory import AllocationMeter, MemoryTracker, track, track_allocations
from remat.placement import CompileSpec
from remat.planner.apply import apply_decisions
from remat.planner.data import ChainProblem, Decision, ParetoPoint, Solution
from remat.planner.head import Head
from remat.planner.render import render_plan
from remat.planner.solvers import pareto_front
from remat.planner.step import LossFn, counted_device, default_loss, run_step

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """Which regions to keep, checkpoint (with which policy) or offload.

    Returned by :func:`remat.planner.plan`. ``apply(model)`` puts it in
    place; ``report()`` describes it.

    Attributes:
        decisions: one per region, in execution order.
        budget_bytes: the memory budget the plan was solved for.
        predicted_peak_bytes: peak live bytes the cost model predicts.
        predicted_step_s: step time it predicts.
        unchecked_peak_bytes: measured peak with nothing checkpointed.
        unchecked_step_s: measured step time with nothing checkpointed.
        solution: how it was found (solver, optimality, gap, solve time).
        problem: the chain problem it solved (for Pareto curves and checks).
        measured_peak_bytes: the peak of one step with the plan applied, when
            it was verified (``plan(..., verify=True)`` or :meth:`verify`).
        head: the head the planner was given (``None`` without one).
        head_chunks: slices the plan computes the head and loss in (1: as
            usual); train with :meth:`loss` when it is more than 1.
        head_problems: with a head, the chain problem of every head option
            as ``(chunks, problem)``, for the Pareto front over all of them.
        world_size: ranks that planned together (sharded training: the
            budget and the peaks are per rank); 1 in one process.
        compile: how the regions were compiled while they were measured
            (``plan(..., compile=True)``), or None for an eager plan. The
            predictions hold for regions compiled this way, so :meth:`apply`
            compiles them so, and :meth:`save` records it.
        max_gradient_error: the bound on the gradient error the plan was
            solved for, when compression was allowed (``plan(...,
            compress=..., max_gradient_error=...)``); its predicted error is
            ``solution.gradient_error``.
        measured_gradient_error: the gradient error of one step with the
            plan applied against the unchecked step, when it was verified.
        estimated_with: None for a plan from measured steps; else it was
            planned from estimated ones (``plan(..., estimate=...)``: bytes
            counted on fake tensors, times modelled) and this names the device
            rates its times assume. Its unchecked figures are estimates too.

    Example:
        >>> import torch
        >>> from remat.planner import plan
        >>> model = build_model()                                 # doctest: +SKIP
        >>> p = plan(model, (torch.randn(32, 64),), budget="50%")  # doctest: +SKIP
        >>> handle = p.apply(model)                               # doctest: +SKIP
    """

    decisions: tuple[Decision, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_step_s: float
    unchecked_peak_bytes: int
    unchecked_step_s: float
    solution: Solution
    problem: ChainProblem
    measured_peak_bytes: int | None = None
    head: Head | None = None
    head_chunks: int = 1
    head_problems: tuple[tuple[int, ChainProblem], ...] = ()
    world_size: int = 1
    compile: CompileSpec | None = None
    max_gradient_error: float | None = None
    measured_gradient_error: float | None = None
    estimated_with: str | None = None

    @property
    def predicted_gradient_error(self) -> float:
        """The relative gradient error the plan is predicted to have (0 for an exact plan)."""
        return self.solution.gradient_error

    def apply(self, model: Any) -> Any:
        """Checkpoint/offload the planned submodules of ``model`` in place.

        A plan made compiled also compiles every planned region (kept ones
        too), as they were measured. Returns the
        :class:`~remat.placement.Placement`, whose ``remove()`` undoes it
        all. See :func:`remat.planner.apply.apply_decisions`.
        """
        return apply_decisions(self.decisions, model, self.compile)

    def to_config(self) -> CheckpointConfig:
        """The plan as a :class:`remat.CheckpointConfig`: one option per region.

        ``remat.apply_config(model, plan.to_config())`` puts the same
        checkpoints in place as :meth:`apply` (both go through
        :func:`remat.placement.place`).
        """
        return CheckpointConfig(
            regions={d.region: d.option.name for d in self.decisions}, compile=self.compile
        )

    def save(self, path: str | Path) -> Path:
        """Write the plan as TOML that :func:`remat.apply_config` applies, on any rank or machine.

        The ``[activation_checkpoint.regions]`` table holds one option per
        region (read it with :func:`remat.config_from_toml`); a ``[plan]``
        table records what the planner predicted and for how many ranks,
        which ``apply_config`` does not read. Planning profiles the model for
        seconds to minutes; a saved plan is applied in milliseconds.

        Example:
            >>> p.save("plan.toml")                                              # doctest: +SKIP
            >>> remat.apply_config(model, remat.config_from_toml("plan.toml"))   # doctest: +SKIP
        """
        if not isinstance(path, (str, Path)):
            raise CheckpointTypeError(f"remat.planner: Plan.save takes a path, got {type(path).__name__}.")
        facts: dict[str, Any] = {
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_s": round(self.predicted_step_s, 6),
            "unchecked_peak_bytes": self.unchecked_peak_bytes,
            "unchecked_step_s": round(self.unchecked_step_s, 6),
            "head_chunks": self.head_chunks,
            "solver": self.solution.solver,
            "world_size": self.world_size,
        }
        if self.estimated_with is not None:
            facts["estimated_with"] = self.estimated_with
        if self.measured_peak_bytes is not None:
            facts["measured_peak_bytes"] = self.measured_peak_bytes
        if self.problem.approximate:
            facts["predicted_gradient_error"] = round(self.predicted_gradient_error, 9)
        if self.max_gradient_error is not None:
            facts["max_gradient_error"] = self.max_gradient_error
        if self.measured_gradient_error is not None:
            facts["measured_gradient_error"] = round(self.measured_gradient_error, 9)
        compiled = []
        if self.compile is not None:
            arguments = ", ".join(
                f"{key} = {_toml_value(value)}" for key, value in self.compile.arguments().items()
            )
            compiled = ["[activation_checkpoint]", f"compile = {{ {arguments} }}", ""]
        lines = [
            "# A checkpoint plan made by remat.planner. Apply it with",
            "#   remat.apply_config(model, remat.config_from_toml(path))",
            "# (the [plan] table records the prediction; apply_config does not read it).",
            "",
            *compiled,
            "[activation_checkpoint.regions]",
            *(f"{_toml_string(d.region)} = {_toml_string(d.option.name)}" for d in self.decisions),
            "",
            "[plan]",
            *(f"{key} = {_toml_value(value)}" for key, value in facts.items()),
        ]
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines) + "\n")
        return target

    def report(self) -> str:
        """The plan as text: decisions, predicted peak and time, solver. See
        :func:`remat.planner.render.render_plan`."""
        return render_plan(self)

    def verify(
        self, model: Any, example_inputs: Any, *, loss_fn: LossFn = default_loss
    ) -> int:
        """Apply the plan, run one tracked step, undo it; return the measured peak bytes.

        The peak counts what the planner's prediction counts (the step's own
        allocations, as :func:`remat.memory.track`; for a plan made compiled,
        as the allocator counts them, :func:`remat.memory.track_allocations`,
        after a step that compiles the regions). Gradients and buffers are
        left as they were.
        """
        inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        handle = self.apply(model)
        try:
            grads = [(p, p.grad) for p in model.parameters()]
            for p, _ in grads:
                p.grad = None
            try:
                device = counted_device(model)
                meter: AllocationMeter | MemoryTracker
                if self.compile is None:
                    meter = track(device=device)
                else:
                    for _ in range(2):  # compiles (and the recompile a first step may ask for)
                        run_step(model, inputs, loss_fn, head=self.head, chunks=self.head_chunks)
                        for p, _ in grads:
                            p.grad = None
                    meter = track_allocations(device, quiet=True)
                with meter:
                    run_step(model, inputs, loss_fn, head=self.head, chunks=self.head_chunks)
            finally:
                for p, grad in grads:
                    p.grad = grad
        finally:
            handle.remove()
        return meter.peak_bytes

    def measure_gradient_error(
        self, model: Any, example_inputs: Any, *, loss_fn: LossFn = default_loss
    ) -> float:
        """Run one step with the plan applied and one unchecked, from the same RNG state;
        return ``||g' - g|| / ||g||`` over every parameter gradient (0 for an exact plan).

        Gradients and the caller's RNG state are left as they were.
        """
        inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        parameters = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad for p in parameters]
        with torch.random.fork_rng(devices=[]):
            state = torch.get_rng_state()

            def gradients() -> Tensor:
                torch.set_rng_state(state)
                for p in parameters:
                    p.grad = None
                run_step(model, inputs, loss_fn, head=self.head, chunks=self.head_chunks)
                return torch.cat([
                    (p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                    for p in parameters
                ])

            try:
                reference = gradients()
                with self.apply(model):
                    planned = gradients()
            finally:
                for p, grad in zip(parameters, grads, strict=True):
                    p.grad = grad
        return float((planned - reference).norm() / reference.norm().clamp_min(1e-30))

    def loss(self, model: Any, inputs: Any, targets: Tensor) -> Tensor:
        """The training loss of one batch the way the plan computes it (head in slices).

        For a plan made with a :class:`~remat.planner.Head`: runs
        ``model(*inputs)`` with the head skipped and returns the head's loss
        over ``targets`` in :attr:`head_chunks` slices
        (:func:`remat.losses.chunked_head_loss`). Apply the plan first.

        Example:
            >>> with p.apply(model):                                  # doctest: +SKIP
            ...     p.loss(model, (idx,), targets).backward()
        """
        if self.head is None:
            raise CheckpointUsageError(
                "remat.planner: Plan.loss needs a plan made with head=Head(...); this plan "
                "plans the blocks only: compute your loss from model(...) as usual."
            )
        batch = inputs if isinstance(inputs, tuple) else (inputs,)
        return self.head.step_loss(model, batch, self.head_chunks, targets)

    def pareto(self, points: int = 12) -> tuple[ParetoPoint, ...]:
        """Fastest plans over budgets from the smallest reachable peak to the unchecked one.

        With a planned head, the front over every head option: each
        option's front, merged, keeping only points faster than every point
        that needs less memory.
        """
        if not self.head_problems:
            return pareto_front(self.problem, points=points)
        merged = sorted(
            (
                dataclasses.replace(point, head_chunks=chunks)
                for chunks, problem in self.head_problems
                for point in pareto_front(problem, points=points)
            ),
            key=lambda point: (point.peak_bytes, point.step_s),
        )
        front: list[ParetoPoint] = []
        for point in merged:
            if not front or point.step_s < front[-1].step_s:
                front.append(point)
        return tuple(front)


def _toml_string(text: str) -> str:
    # A JSON string is a valid TOML basic string (same escapes).
    return json.dumps(text)


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
