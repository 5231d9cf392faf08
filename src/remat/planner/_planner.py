"""``plan()`` and :class:`Planner`: profile once per input shape, solve, build the Plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from remat.errors import CheckpointUsageError, InfeasibleBudgetError
from remat.placement import CompileSpec
from remat.planner.budget import Budget, unreachable_budget
from remat.planner.cost import chain_problem, preferred, step_time_s, tied_time_s
from remat.planner.data import KEEP, ChainProblem, Decision, Option, Profile, Solution
from remat.planner.head import Head
from remat.planner.profile import profile_model
from remat.planner.ranks import (
    agree_profile,
    largest_over_ranks,
    plans_together,
    share_plan,
    world_size,
)
from remat.planner.result import Plan
from remat.planner.solvers import SolverName, solve
from remat.planner.step import LossFn, default_loss, input_key
from remat.planner.timing import DeviceRates

__all__ = ["Planner", "plan"]


def _as_inputs(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    return (example_inputs,)


class Planner:
    """Plans for one model; profiles are cached by input shapes and dtypes.

    Planning again with inputs of the same shapes reuses the profile (the
    solve takes milliseconds); new shapes are profiled again.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(*[
        ...     torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))
        ...     for _ in range(6)])
        >>> planner = Planner(model, repeats=1)
        >>> p = planner.plan((torch.randn(512, 32),), budget="70%")
        >>> p.predicted_peak_bytes <= p.budget_bytes
        True
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn = default_loss,
        candidates: Sequence[str | nn.Module] | None = None,
        options: Sequence[Option] | None = None,
        repeats: int = 3,
        head: Head | None = None,
        compile: bool | CompileSpec | Mapping[str, Any] | None = None,
        compress: str | Sequence[str] | None = None,
        max_gradient_error: float | None = None,
        estimate: DeviceRates | None = None,
    ) -> None:
        if estimate is not None and not isinstance(estimate, DeviceRates):
            raise CheckpointUsageError(
                "remat.planner: estimate must be a remat.planner.timing.DeviceRates (DeviceRates.named"
                f"('h100'), DeviceRates.measure()), got {type(estimate).__name__}."
            )
        self.estimate = estimate
        self.compress, self.max_gradient_error = _compression_request(compress, max_gradient_error)
        self.model = model
        self.loss_fn = loss_fn
        self.candidates = candidates
        self.options = options
        self.repeats = repeats
        self.head = head
        self.compile = CompileSpec.of(compile, "remat.planner")
        self._profiles: dict[tuple[Any, ...], Profile] = {}

    def _together(self) -> bool:
        """Whether every rank plans this model together (a sharded model: planner.ranks).
        Never for an estimate: it runs in one process, one simulated rank standing for all."""
        return self.estimate is None and plans_together(self.model)

    def profile(self, example_inputs: Any) -> Profile:
        """The profile for these inputs' shapes (measured on first use)."""
        inputs = _as_inputs(example_inputs)
        key = input_key(inputs)
        if key not in self._profiles:
            # A sharded model: every rank profiles (in step: FSDP2's gathers
            # are collectives) and all plan with the agreed profile.
            self._profiles[key] = agree_profile(profile_model(
                self.model,
                inputs,
                loss_fn=self.loss_fn,
                candidates=self.candidates,
                options=self.options,
                repeats=self.repeats,
                head=self.head,
                compile=self.compile,
                compress=self.compress,
                estimate=self.estimate,
            ), together=self._together())
        return self._profiles[key]

    def plan(
        self,
        example_inputs: Any,
        *,
        budget: int | str | Budget | None = None,
        fraction: float | None = None,
        solver: SolverName = "auto",
        headroom: float = 0.0,
        verify: bool = False,
        max_gradient_error: float | None = None,
    ) -> Plan:
        """The fastest plan whose predicted peak fits the budget (see :func:`plan`).

        ``max_gradient_error`` overrides the planner's bound for this plan
        (``0.0``: exact options only, the plan without compression, from the
        same profile).
        """
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not (
            0.0 <= headroom < 1.0
        ):
            raise CheckpointUsageError(f"remat.planner: headroom must be in [0, 1), got {headroom!r}.")
        wanted = Budget.parse(budget, fraction=fraction)  # refused before the profile's steps
        if verify and self.estimate is not None:
            raise CheckpointUsageError(
                "remat.planner: verify=True runs the plan, and an estimated plan is made for a model "
                "that may not run here; apply the plan where it runs and check it there "
                "(Plan.verify), or plan without estimate=."
            )
        profile = self.profile(example_inputs)
        budget_bytes = wanted.resolve(profile.unchecked_peak_bytes)
        problems = [chain_problem(profile, h) for h in range(max(1, len(profile.heads)))]
        target = int(budget_bytes * (1.0 - headroom))
        unchecked = profile.unchecked_peak_bytes
        bound = self.max_gradient_error
        if max_gradient_error is not None:
            if isinstance(max_gradient_error, bool) or not isinstance(max_gradient_error, (int, float)) or max_gradient_error < 0:
                raise CheckpointUsageError(
                    f"remat.planner: max_gradient_error must be a number >= 0, got {max_gradient_error!r}."
                )
            bound = float(max_gradient_error)
        chosen = self._build(
            profile, problems, _solve(problems, target, budget_bytes, solver, unchecked, bound), budget_bytes, bound
        )
        if not verify:
            return chosen
        # Measure the plan in place; only when the measured peak is over the
        # budget, aim lower by the overshoot and solve again (a few times).
        # Likewise a gradient error over its bound: the bound shrinks by the
        # ratio (the regions' errors added in quadrature is a model).
        inputs = _as_inputs(example_inputs)
        aim = bound
        for _ in range(_VERIFY_TRIES):
            measured = largest_over_ranks(
                chosen.verify(self.model, inputs, loss_fn=self.loss_fn), together=self._together()
            )
            chosen = dataclasses.replace(chosen, measured_peak_bytes=measured)
            error = None
            if chosen.problem.approximate and chosen.predicted_gradient_error > 0:
                error = chosen.measure_gradient_error(self.model, inputs, loss_fn=self.loss_fn)
                chosen = dataclasses.replace(chosen, measured_gradient_error=error)
            over_error = error is not None and bound is not None and aim is not None and error > bound
            if measured <= budget_bytes and not over_error:
                return chosen
            if measured > budget_bytes:
                target -= measured - budget_bytes
            if over_error:
                assert error is not None and aim is not None and bound is not None
                aim *= bound / error
            if target <= 0:
                break
            try:
                solution = _solve(problems, target, target, solver, unchecked, aim)
            except InfeasibleBudgetError:
                break
            chosen = self._build(profile, problems, solution, budget_bytes, bound)
        return chosen

    def _build(
        self,
        profile: Profile,
        problems: Sequence[ChainProblem],
        answer: tuple[int, Solution],
        budget_bytes: int,
        bound: float | None = None,
    ) -> Plan:
        head, solution = answer
        return share_plan(
            self._plan_of(profile, problems, head, solution, budget_bytes, bound), together=self._together()
        )

    def _plan_of(
        self,
        profile: Profile,
        problems: Sequence[ChainProblem],
        head: int,
        solution: Solution,
        budget_bytes: int,
        bound: float | None = None,
    ) -> Plan:
        problem = problems[head]
        decisions = tuple(
            Decision(
                region=region.name,
                option=problem.options[o],
                retained_bytes=problem.retained_bytes[k][o],
                time_s=problem.time_s[k][o],
                gradient_error=problem.gradient_error[k][o],
            )
            for k, (region, o) in enumerate(zip(profile.regions, solution.choice, strict=True))
        )
        return Plan(
            decisions=decisions,
            budget_bytes=budget_bytes,
            predicted_peak_bytes=solution.peak_bytes,
            predicted_step_s=solution.step_s,
            unchecked_peak_bytes=profile.unchecked_peak_bytes,
            unchecked_step_s=profile.unchecked_step_s,
            solution=solution,
            problem=problem,
            head=self.head if profile.heads else None,
            head_chunks=profile.heads[head].chunks if profile.heads else 1,
            head_problems=tuple(
                (cost.chunks, each) for cost, each in zip(profile.heads, problems, strict=True)
            ) if profile.heads else (),
            world_size=world_size() if self._together() or self.estimate is not None else 1,
            compile=self.compile,
            max_gradient_error=bound,
            estimated_with=profile.estimated_with,
        )


_VERIFY_TRIES = 3


def _compression_request(
    compress: str | Sequence[str] | None, max_gradient_error: float | None
) -> tuple[tuple[str, ...], float | None]:
    """The formats to offer and the error bound, checked: compression only with a bound."""
    api = "remat.planner"
    formats = (compress,) if isinstance(compress, str) else tuple(compress or ())
    if max_gradient_error is not None and (
        isinstance(max_gradient_error, bool)
        or not isinstance(max_gradient_error, (int, float))
        or not max_gradient_error > 0
    ):
        raise CheckpointUsageError(
            f"{api}: max_gradient_error must be a positive number (the largest relative gradient "
            f"error a plan may have, e.g. 0.02), got {max_gradient_error!r}."
        )
    if formats and max_gradient_error is None:
        raise CheckpointUsageError(
            f"{api}: compress={list(formats)} makes the gradients approximate; pass "
            "max_gradient_error=... (e.g. 0.02: 2% relative error of the parameter gradients) "
            "so the plan stays within it."
        )
    if max_gradient_error is not None and not formats:
        raise CheckpointUsageError(
            f"{api}: max_gradient_error bounds the error of compressing options; pass "
            "compress=['fp8', ...] to offer them (without compression a plan is exact)."
        )
    return formats, None if max_gradient_error is None else float(max_gradient_error)


def _solve(
    problems: Sequence[ChainProblem],
    target: int,
    budget_bytes: int,
    solver: SolverName,
    unchecked_peak_bytes: int,
    max_error: float | None = None,
) -> tuple[int, Solution]:
    """Solve at ``target``; at ``budget_bytes`` if nothing fits the target.

    One problem per head option (the unchunked head first): the fastest
    answer over them, by the solvers' rule for ties (:func:`_fastest`). When keeping everything
    with the unchunked head fits, that is the plan, whatever the solver's
    timings say: a checkpoint never makes a step faster than no checkpoint.
    Its peak is the unchecked step's, measured, not predicted.
    """
    first = problems[0]
    keep_all = (first.options.index(KEEP),) * first.size
    if unchecked_peak_bytes <= target:
        return 0, Solution(
            choice=keep_all,
            peak_bytes=unchecked_peak_bytes,
            step_s=step_time_s(first, keep_all),
            solver="keep",
            optimal=True,
            gap=0.0,
            solve_s=0.0,
        )
    try:
        return _fastest(problems, target, solver, max_error)
    except InfeasibleBudgetError:
        if target >= budget_bytes:
            raise
        return _fastest(problems, budget_bytes, solver, max_error)


def _fastest(
    problems: Sequence[ChainProblem], budget: int, solver: SolverName, max_error: float | None = None
) -> tuple[int, Solution]:
    """The fastest solution over the head options, by the solvers' rule for ties (of those
    tied with the fastest in time, the fewest bytes, then the least time, then the fewer
    slices: ``docs/design/planner.md``, "Ties"); the smallest reachable peak if none fits.

    The tie is against the fastest plan over *every* head option, as within one
    problem: each option's own answer may already be up to the noise slower than
    its fastest, so comparing those answers with each other would chain two
    tolerances. So each option is solved twice: exactly, for its fastest time,
    then with its tolerance widened to the one bound shared by all options.
    """
    exact: list[tuple[int, Solution]] = []
    lowest: int | None = None
    for index, problem in enumerate(problems):
        try:
            exact_problem = dataclasses.replace(problem, time_tolerance_s=0.0)
            exact.append((index, solve(exact_problem, budget, solver, max_error=max_error)))
        except InfeasibleBudgetError as exc:
            lowest = exc.min_peak_bytes if lowest is None else min(lowest, exc.min_peak_bytes)
    if not exact:
        assert lowest is not None  # every problem raised
        raise unreachable_budget(budget, lowest, max_error)
    # One profile, one noise: every head option's problem has the same tolerance.
    bound = tied_time_s(problems[exact[0][0]], min(s.step_s for _, s in exact))
    found: list[tuple[int, Solution]] = []
    for index, fastest in exact:
        if fastest.step_s > bound:
            continue  # slower than the shared bound even at its fastest: not tied
        slack = bound - fastest.step_s
        widened = dataclasses.replace(problems[index], time_tolerance_s=slack)
        found.append((index, solve(widened, budget, solver, max_error=max_error)))
    # Every answer is within the bound, so ``preferred`` (fewest bytes, then least time) ties them all.
    at = preferred(problems[found[0][0]], [(s.step_s, s.peak_bytes) for _, s in found])
    return found[at]


def plan(
    model: nn.Module,
    example_inputs: Any,
    budget: int | str | Budget | None = None,
    *,
    fraction: float | None = None,
    loss_fn: LossFn = default_loss,
    candidates: Sequence[str | nn.Module] | None = None,
    options: Sequence[Option] | None = None,
    solver: SolverName = "auto",
    repeats: int = 3,
    headroom: float = 0.0,
    verify: bool = False,
    head: Head | None = None,
    compile: bool | CompileSpec | Mapping[str, Any] | None = None,
    compress: str | Sequence[str] | None = None,
    max_gradient_error: float | None = None,
    estimate: DeviceRates | None = None,
) -> Plan:
    """Find the fastest checkpoint/selective/offload plan whose peak fits ``budget``.

    Profiles one training step (``loss_fn(model(*example_inputs)).backward()``)
    with every candidate region under every option, then solves exactly (DP
    on the chain; MILP when that grows too large). The peak is the step's
    own live tensor bytes (activations, gradients, temporaries) as counted
    by :func:`remat.memory.track`; parameters and optimizer state are not in it.

    Args:
        model: the model to plan for.
        example_inputs: a tensor or a tuple of positional inputs.
        budget: bytes (``int``, ``"300MiB"``, ``"6GiB"``), a percentage of
            the unchecked step's peak (``"50%"``), or a
            :class:`~remat.planner.Budget`. A float is refused: ``1`` is one
            byte; write a fraction as ``"100%"`` or ``fraction=1.0``.
        fraction: the budget as a fraction in ``(0, 1]`` of the unchecked
            step's peak, instead of ``budget``. At the unchecked peak or
            above nothing is checkpointed.
        loss_fn: model output -> scalar loss (default: sum of outputs).
        candidates: submodules (names or modules) to plan; default: the
            children of the model's largest ``ModuleList``/``Sequential``.
        options: what a region may do; default keep, checkpoint,
            checkpoint with ``save_matmuls`` (and offload on accelerators).
        solver: ``"auto"``, ``"dp"``, ``"milp"``, ``"greedy"`` or ``"enumerate"``.
        repeats: timed steps per option while profiling.
        headroom: aim this fraction below the budget when a plan fits there
            (default 0: the budget itself).
        verify: apply the plan, measure one step's peak and, only if it is
            over the budget, aim lower by the overshoot and solve again (up to
            three times); the plan then carries ``measured_peak_bytes``.
        head: the model's output layer and per-position loss
            (:class:`~remat.planner.Head`): the planner may also compute them in
            slices, which reaches budgets below checkpointing every block on
            language models; train with :meth:`Plan.loss` then. Replaces
            ``loss_fn``.
        compile: plan for regions compiled one by one, as torchtitan compiles
            a transformer's blocks: ``True`` (``fullgraph=True``, inductor) or
            a :class:`~remat.placement.CompileSpec`. Every option is measured
            compiled, with the allocator's count of bytes (inductor's buffers
            included), and where torch has per-region compile budgets (2.13
            and newer) the compiler's own choices under a budget join the
            options. The plan compiles its regions when applied. Profiling
            compiles each option once and resets torch.compile's in-memory
            caches when it is done (``docs/guide/compiled.md``).
        compress: formats (``"fp8"``, ``"int8"``, ``"bf16"``, ...) the plan
            may keep saved tensors in: every keep and checkpoint option is
            also offered keeping what it keeps compressed, its gradient error
            measured region by region. Needs ``max_gradient_error``; not with
            ``compile``.
        max_gradient_error: the largest predicted relative gradient error
            (``||g' - g|| / ||g||`` over every parameter gradient) the plan
            may have; the regions' errors add in quadrature
            (``docs/design/planner.md``, "Gradient error").
        estimate: plan without running the model, for one too large for this
            machine: build it (and ``example_inputs``) on fake tensors and
            give a device's rates (:class:`~remat.planner.timing.DeviceRates`:
            ``DeviceRates.named("h100")`` or ``DeviceRates.measure()``). Each
            option's step is tracked once (compiled regions as the compiler
            decides, :func:`remat.memory.statically_compiled`) and timed by a
            time model (:class:`~remat.planner.timing.ModelledClock`); the
            plan's ``estimated_with`` says so. Inside a simulated process
            group (sharded on fake tensors, as
            :func:`remat.memory.estimate_sharded_step` does) the plan is every
            rank's. Not with ``verify`` or ``compress``
            (``docs/design/planner.md``, "Estimated plans").

    Raises:
        InfeasibleBudgetError: the budget is unreachable (a
            ``CheckpointUsageError``); the message and the ``min_peak_bytes``
            field give the smallest reachable peak.

    Example:
        >>> import torch
        >>> from remat.planner import plan
        >>> model = torch.nn.Sequential(*[
        ...     torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))
        ...     for _ in range(6)])
        >>> p = plan(model, torch.randn(512, 32), budget="70%", repeats=1)
        >>> with p.apply(model):
        ...     model(torch.randn(512, 32)).sum().backward()
    """
    planner = Planner(
        model, loss_fn=loss_fn, candidates=candidates, options=options, repeats=repeats, head=head,
        compile=compile, compress=compress, max_gradient_error=max_gradient_error, estimate=estimate,
    )
    return planner.plan(
        example_inputs, budget=budget, fraction=fraction, solver=solver, headroom=headroom,
        verify=verify,
    )
