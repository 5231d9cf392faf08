"""Solvers for :class:`~remat.planner.data.ChainProblem`: torch-free, tested on tables.

Each reads a choice's peak from :mod:`remat.planner.cost`, the one place its
terms are defined (the DP in its incremental form, the MILP as named rows),
and follows its rule for ties (:func:`remat.planner.cost.preferred`: within
the profile's noise of the fastest, the fewest bytes).

* :func:`solve_dp` (``dp``): exact dynamic programming over the chain (the default);
* :func:`solve_milp` (``milp``): exact mixed-integer program through
  ``scipy.optimize.milp`` (HiGHS), for when the DP's state set grows too large;
* :func:`solve_greedy` (``greedy``): a fallback without scipy, with its gap to
  a lower bound;
* :func:`solve_enumerate` (``exhaustive``): every choice, for checking the
  others on small chains.

:func:`solve` picks among them; :func:`min_reachable_peak` answers "how low
can the peak go", which an unreachable budget's error reports.

Example:
    >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
    >>> problem = ChainProblem(
    ...     options=(KEEP, CHECKPOINT),
    ...     retained_bytes=((100, 10),) * 3, local_bytes=((150, 110),) * 3,
    ...     time_s=((1.0, 1.5),) * 3, tail_bytes=0, floor_bytes=0)
    >>> solve(problem, 250).choice
    (1, 1, 0)
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from remat.errors import CheckpointUsageError, FrontierTooLargeError
from remat.planner.cost import gradient_error, peak_bytes
from remat.planner.data import ChainProblem, ParetoPoint, Solution
from remat.planner.solvers.dp import min_peak_choice, min_reachable_peak, solve_dp, within
from remat.planner.solvers.exhaustive import solve_enumerate
from remat.planner.solvers.greedy import solve_greedy
from remat.planner.solvers.milp import scipy_available, solve_milp

__all__ = [
    "SolverName",
    "min_peak_choice",
    "min_reachable_peak",
    "pareto_front",
    "solve",
    "solve_dp",
    "solve_enumerate",
    "solve_greedy",
    "solve_milp",
]

SolverName = Literal["auto", "dp", "milp", "greedy", "enumerate"]

_DP_REGIONS = 48
"""Longest chain ``"auto"`` gives the DP (benchmarks/planner.py times both)."""


def solve(
    problem: ChainProblem, budget_bytes: int, solver: SolverName = "auto", *, max_error: float | None = None
) -> Solution:
    """The fastest choice whose predicted peak is at most ``budget_bytes``; of the
    choices tied with it within ``problem.time_tolerance_s``, the one with the
    fewest peak bytes (:func:`remat.planner.cost.preferred`, ``docs/design/planner.md``, "Ties").

    ``"auto"`` runs the DP on chains of up to 48 regions and the MILP on
    longer ones (the DP's frontier grows with the chain: 2 s on 192
    non-uniform blocks against 0.7 s for the MILP, and more on real profiles);
    the DP, then the greedy fallback, when scipy is missing. Raises
    :class:`~remat.errors.InfeasibleBudgetError` (a ``CheckpointUsageError``) when
    no choice fits.

    ``max_error`` bounds the predicted gradient error of a plan whose options
    compress (:func:`remat.planner.cost.gradient_error`). The DP solves
    without the joint bound, over the options each within it alone; when its
    answer also keeps the joint bound it is optimal, else the MILP (which
    has the bound as a row) answers, or the greedy fallback without scipy.

    Example:
        >>> from remat.planner.data import KEEP, ChainProblem
        >>> p = ChainProblem((KEEP,), ((1,),), ((2,),), ((1.0,),), 0, 0)
        >>> solve(p, 2).step_s
        1.0
    """
    if max_error is not None and problem.approximate:
        return _solve_within(problem, budget_bytes, solver, max_error)
    solution = _solve_any(problem, budget_bytes, solver)
    return dataclasses.replace(solution, gradient_error=gradient_error(problem, solution.choice))


def _solve_within(problem: ChainProblem, budget_bytes: int, solver: SolverName, max_error: float) -> Solution:
    if solver == "milp":
        return solve_milp(problem, budget_bytes, max_error=max_error)
    if solver == "greedy":
        return solve_greedy(problem, budget_bytes, max_error=max_error)
    if solver == "enumerate":
        return solve_enumerate(problem, budget_bytes, max_error=max_error)
    if solver not in ("auto", "dp"):
        return _solve_any(problem, budget_bytes, solver)  # the same error for an unknown name
    allowed = within(problem, max_error)
    try:
        solution = solve_dp(problem, budget_bytes, allowed=allowed)
    except FrontierTooLargeError:
        solution = None
    if solution is not None:
        error = gradient_error(problem, solution.choice)
        if error <= max_error:
            return dataclasses.replace(solution, gradient_error=error)
    if scipy_available():
        return solve_milp(problem, budget_bytes, max_error=max_error)
    return solve_greedy(problem, budget_bytes, max_error=max_error)


def _solve_any(problem: ChainProblem, budget_bytes: int, solver: SolverName) -> Solution:
    if solver == "dp":
        return solve_dp(problem, budget_bytes)
    if solver == "milp":
        return solve_milp(problem, budget_bytes)
    if solver == "greedy":
        return solve_greedy(problem, budget_bytes)
    if solver == "enumerate":
        return solve_enumerate(problem, budget_bytes)
    if solver != "auto":
        raise CheckpointUsageError(
            f"remat.planner: solver must be one of 'auto', 'dp', 'milp', 'greedy', "
            f"'enumerate'; got {solver!r}."
        )
    if problem.size > _DP_REGIONS and scipy_available():
        return solve_milp(problem, budget_bytes)
    try:
        return solve_dp(problem, budget_bytes)
    except FrontierTooLargeError:
        if scipy_available():
            return solve_milp(problem, budget_bytes)
        return solve_greedy(problem, budget_bytes)


def pareto_front(problem: ChainProblem, points: int = 12) -> tuple[ParetoPoint, ...]:
    """Fastest plans at ``points`` budgets spread from the smallest reachable peak
    to the peak of the fastest plan; repeated plans appear once.

    Example:
        >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> [point.choice for point in pareto_front(p, points=3)]
        [(1, 1), (1, 0), (0, 0)]
    """
    low = min_reachable_peak(problem)
    fastest = tuple(min(range(len(row)), key=row.__getitem__) for row in problem.time_s)
    high = max(low, peak_bytes(problem, fastest))
    budgets = sorted({low + (high - low) * i // max(1, points - 1) for i in range(points)})
    front: list[ParetoPoint] = []
    for budget in budgets:
        solution = solve(problem, budget)
        if front and front[-1].choice == solution.choice:
            continue
        if front and solution.step_s >= front[-1].step_s:
            continue  # no faster than a plan that needs less memory
        front.append(ParetoPoint(budget, solution.peak_bytes, solution.step_s, solution.choice))
    return tuple(front)
