"""Every choice, one by one: the oracle for the other solvers on small chains."""

from __future__ import annotations

import itertools
import time

from remat.errors import CheckpointUsageError
from remat.planner.cost import gradient_error, peak_bytes, step_time_s
from remat.planner.data import ChainProblem, Solution
from remat.planner.solvers.dp import infeasible, within

__all__ = ["MAX_CHOICES", "solve_enumerate"]

MAX_CHOICES = 2_000_000
"""Largest number of choices :func:`solve_enumerate` agrees to try."""


def solve_enumerate(problem: ChainProblem, budget_bytes: int, *, max_error: float | None = None) -> Solution:
    """The fastest choice within the budget, by trying them all (small chains only).

    Ties in time go to the smaller peak, then to the first choice in order.

    Example:
        >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> solve_enumerate(p, 200).choice
        (1, 0)
    """
    started = time.perf_counter()
    width = len(problem.options)
    if width ** problem.size > MAX_CHOICES:
        raise CheckpointUsageError(
            f"remat.planner: enumerating {width}^{problem.size} choices is too many "
            f"(limit {MAX_CHOICES}); use solver='dp' or 'milp'."
        )
    best: tuple[float, int, tuple[int, ...]] | None = None
    for choice in itertools.product(range(width), repeat=problem.size):
        peak = peak_bytes(problem, choice)
        if peak > budget_bytes or (max_error is not None and gradient_error(problem, choice) > max_error):
            continue
        key = (step_time_s(problem, choice), peak, choice)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        raise infeasible(problem, budget_bytes, within(problem, max_error))
    step_s, peak, choice = best
    return Solution(
        choice, peak, step_s, "enumerate", True, 0.0, time.perf_counter() - started,
        gradient_error(problem, choice),
    )
