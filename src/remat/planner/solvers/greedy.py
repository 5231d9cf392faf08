"""Greedy fallback: cheapest memory first, with its gap to a lower bound.

Start from the fastest option everywhere (the fastest exact one where
options compress); while the plan does not fit, switch the region whose move
frees the most retained bytes per second of added time, among the moves that
keep the predicted gradient error within its bound. Not optimal in general; the gap it reports is measured against
the LP relaxation when scipy is available, else against the fastest choice.
"""

from __future__ import annotations

import time

from remat.planner.cost import gradient_error, peak_bytes, step_time_s, tied_time_s
from remat.planner.data import ChainProblem, Solution
from remat.planner.solvers.dp import infeasible, min_peak_choice, within
from remat.planner.solvers.milp import lp_lower_bound

__all__ = ["solve_greedy"]


def solve_greedy(problem: ChainProblem, budget_bytes: int, *, max_error: float | None = None) -> Solution:
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
    allowed = within(problem, max_error) or [list(range(len(row))) for row in times]
    exact = [[o for o in options if not problem.gradient_error[k][o]] for k, options in enumerate(allowed)]
    # Start exact (error 0) where an exact option exists; moves keep the joint error in bound.
    choice = [min(exact[k] or allowed[k], key=row.__getitem__) for k, row in enumerate(times)]
    while peak_bytes(problem, choice) > budget_bytes:
        best: tuple[float, int, int] | None = None
        for k, (retained, cost) in enumerate(zip(problem.retained_bytes, times, strict=True)):
            current = choice[k]
            for option in allowed[k]:
                freed = retained[current] - retained[option]
                if freed <= 0:
                    continue
                if max_error is not None and problem.gradient_error[k][option]:
                    moved = [*choice[:k], option, *choice[k + 1 :]]
                    if gradient_error(problem, moved) > max_error:
                        continue
                ratio = freed / max(cost[option] - cost[current], 1e-12)
                if best is None or ratio > best[0]:
                    best = (ratio, k, option)
        if best is None:
            break
        choice[best[1]] = best[2]
    if peak_bytes(problem, choice) > budget_bytes:
        # Moves by retained bytes alone missed a local peak: take the lowest exact plan.
        choice = list(min_peak_choice(problem, allowed=exact if all(exact) else None))
        if peak_bytes(problem, choice) > budget_bytes or (
            max_error is not None and gradient_error(problem, choice) > max_error
        ):
            raise infeasible(problem, budget_bytes, within(problem, max_error))
    choice = _fewer_bytes(problem, choice, allowed, max_error)
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
        gradient_error=gradient_error(problem, choice),
    )


def _fewer_bytes(
    problem: ChainProblem, choice: list[int], allowed: list[list[int]], max_error: float | None
) -> list[int]:
    """``choice`` moved, one region at a time, to lower peaks while its time stays tied with
    where it started (``docs/design/planner.md``, "Ties"): the greedy steps by retained bytes
    per second and stops at the first fit, which may leave a tie with fewer bytes untaken."""
    bound = tied_time_s(problem, step_time_s(problem, choice))
    peak = peak_bytes(problem, choice)
    for _ in range(problem.size * len(problem.options)):  # each move lowers the peak; bounded anyway
        best: tuple[int, float, int, int] | None = None
        for k, options in enumerate(allowed):
            for option in options:
                if option == choice[k]:
                    continue
                moved = [*choice[:k], option, *choice[k + 1 :]]
                step_s = step_time_s(problem, moved)
                if step_s > bound or (max_error is not None and gradient_error(problem, moved) > max_error):
                    continue
                moved_peak = peak_bytes(problem, moved)
                if moved_peak < peak and (best is None or (moved_peak, step_s) < best[:2]):
                    best = (moved_peak, step_s, k, option)
        if best is None:
            break
        peak, _, k, option = best
        choice = [*choice[:k], option, *choice[k + 1 :]]
    return choice
