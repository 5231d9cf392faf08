"""Every choice, one by one: the oracle for the other solvers on small chains."""

from __future__ import annotations

import itertools
import math
import time

from remat.errors import CheckpointUsageError
from remat.planner.cost import gradient_error, peak_bytes, preferred, step_time_s, tied_time_s
from remat.planner.data import ChainProblem, Solution
from remat.planner.solvers.dp import infeasible, within

__all__ = ["MAX_CHOICES", "solve_enumerate"]

MAX_CHOICES = 2_000_000
"""Largest number of choices :func:`solve_enumerate` agrees to try."""


def solve_enumerate(problem: ChainProblem, budget_bytes: int, *, max_error: float | None = None) -> Solution:
    """The fastest choice within the budget, by trying them all (small chains only).

    Of the choices tied with the fastest in time
    (:func:`remat.planner.cost.tied_time_s`), the one with the fewest peak
    bytes, then the least time, then the first in order.

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
    # Every feasible choice tied with the fastest so far; the others can never tie again.
    tied: list[tuple[float, int, tuple[int, ...]]] = []
    fastest = bound = math.inf
    for choice in itertools.product(range(width), repeat=problem.size):
        step_s = step_time_s(problem, choice)
        if step_s > bound:
            continue
        peak = peak_bytes(problem, choice)
        if peak > budget_bytes or (max_error is not None and gradient_error(problem, choice) > max_error):
            continue
        if step_s < fastest:
            fastest, bound = step_s, tied_time_s(problem, step_s)
            tied = [entry for entry in tied if entry[0] <= bound]
        tied.append((step_s, peak, choice))
    if not tied:
        raise infeasible(problem, budget_bytes, within(problem, max_error))
    step_s, peak, choice = tied[preferred(problem, [(entry[0], entry[1]) for entry in tied])]
    return Solution(
        choice, peak, step_s, "enumerate", True, 0.0, time.perf_counter() - started,
        gradient_error(problem, choice),
    )
