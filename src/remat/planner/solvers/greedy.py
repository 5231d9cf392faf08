"""Greedy fallback: cheapest memory first, with its gap to a lower bound.

Start from the fastest option everywhere; while the plan does not fit,
switch the region whose move frees the most retained bytes per second of
added time. Not optimal in general; the gap it reports is measured against
the LP relaxation when scipy is available, else against the fastest choice.
"""

from __future__ import annotations

import time

from remat.planner.cost import peak_bytes, step_time_s
from remat.planner.data import ChainProblem, Solution
from remat.planner.solvers.dp import infeasible, min_peak_choice
from remat.planner.solvers.milp import lp_lower_bound

__all__ = ["solve_greedy"]


def solve_greedy(problem: ChainProblem, budget_bytes: int) -> Solution:
    """A choice within ``budget_bytes`` found greedily, and how far from optimal it may be.

    Example:
        >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> solve_greedy(p, 200).peak_bytes <= 200
        True
    """
    started = time.perf_counter()
    times = problem.time_s
    choice = [min(range(len(row)), key=row.__getitem__) for row in times]
    while peak_bytes(problem, choice) > budget_bytes:
        best: tuple[float, int, int] | None = None
        for k, (retained, cost) in enumerate(zip(problem.retained_bytes, times, strict=True)):
            current = choice[k]
            for option in range(len(retained)):
                freed = retained[current] - retained[option]
                if freed <= 0:
                    continue
                ratio = freed / max(cost[option] - cost[current], 1e-12)
                if best is None or ratio > best[0]:
                    best = (ratio, k, option)
        if best is None:
            break
        choice[best[1]] = best[2]
    if peak_bytes(problem, choice) > budget_bytes:
        # Moves by retained bytes alone missed a local peak: take the lowest plan.
        choice = list(min_peak_choice(problem))
        if peak_bytes(problem, choice) > budget_bytes:
            raise infeasible(problem, budget_bytes)
    step_s = step_time_s(problem, choice)
    bound = lp_lower_bound(problem, budget_bytes)
    if bound is None:
        bound = step_time_s(problem, [min(range(len(row)), key=row.__getitem__) for row in times])
    return Solution(
        choice=tuple(choice),
        peak_bytes=peak_bytes(problem, choice),
        step_s=step_s,
        solver="greedy",
        optimal=False,
        gap=max(0.0, (step_s - bound) / step_s) if step_s > 0 else 0.0,
        solve_s=time.perf_counter() - started,
    )
