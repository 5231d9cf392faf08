"""Exact dynamic programming over a chain (docs/design/planner.md, "Solvers").

After region ``k`` a partial plan is summed up by its last option (the link
to the next region depends on it), the shared inputs its regions keep (a
bitmask of groups), and three numbers: ``P``, the bytes its regions retain
(what later regions' peaks sit on), ``C``, the highest backward peak among
its regions counting the residues of the regions so far (later residues
only add to it), and its cost (time, or the highest forward peak when
minimising the peak). Of two partial plans with the same last option and
shared groups, one that is no worse on all three is at least as good for
every completion, so only those Pareto sets are kept: exact, and small for
real models.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from remat.planner.model import ChainProblem, Solution
from remat.planner.solvers._common import InfeasibleBudget

__all__ = [
    "DEFAULT_MAX_STATES",
    "FrontierTooLarge",
    "infeasible",
    "min_peak_choice",
    "min_reachable_peak",
    "solve_dp",
]

DEFAULT_MAX_STATES = 100_000
"""Pareto-set size past which :func:`solve_dp` gives up (the MILP takes over)."""

_Step = Callable[[float, int, int, int], float]  # (cost, region, option, retained before) -> cost


class FrontierTooLarge(Exception):
    """Internal: the DP's Pareto set outgrew its cap; ``solve`` falls back to the MILP."""


def _pareto(candidates: list[tuple[int, int, float, int, int]]) -> list[tuple[int, int, float, int, int]]:
    """Candidates ``(P, C, cost, parent, option)`` that no other beats on all of P, C, cost."""
    candidates.sort(key=lambda c: (c[0], c[1], c[2]))
    kept = []
    stair_c: list[int] = []  # C of kept states, ascending; their costs descend
    stair_cost: list[float] = []
    for candidate in candidates:
        _, c, cost, _, _ = candidate
        at = bisect.bisect_right(stair_c, c) - 1
        if at >= 0 and stair_cost[at] <= cost:
            continue  # a kept state retains no more, peaks no higher, costs no more
        kept.append(candidate)
        end = at + 1
        while end < len(stair_c) and stair_cost[end] >= cost:
            end += 1
        stair_c[at + 1 : end] = [c]
        stair_cost[at + 1 : end] = [cost]
    return kept


def _search(
    problem: ChainProblem, budget_bytes: float, step: _Step, max_states: int
) -> tuple[list[tuple[int, int, float]], list[int], list[list[tuple[int, int]]]]:
    """Final states ``(P, C, cost)`` within the budget, the shared groups each
    holds (a bitmask), and the links to rebuild choices.

    States are kept per last option, since the link to the next region
    depends on it, and per shared groups kept so far (``S`` of the cost model).
    """
    n, width = problem.size, len(problem.options)
    lowest = [
        min(problem.residue_bytes[k]) + min(min(row) for row in problem.link_bytes[k])
        for k in range(n)
    ]
    lowest_retained = [min(row) for row in problem.retained_bytes]
    later_residue = [sum(lowest[k + 1 :]) for k in range(n)]
    later_retained = [sum(lowest_retained[k + 1 :]) for k in range(n)]
    states: list[tuple[int, int, float]] = [(0, problem.floor_bytes, 0.0)]
    last: list[int | None] = [None]
    held: list[int] = [0]
    links: list[list[tuple[int, int]]] = []
    for k in range(n):
        retained, local = problem.retained_bytes[k], problem.local_bytes[k]
        residue, forward = problem.residue_bytes[k], problem.forward_bytes[k]
        groups: dict[tuple[int, int], list[tuple[int, int, float, int, int]]] = {}
        for index, (p, c, cost) in enumerate(states):
            for o in range(width):
                link = problem.link(k, last[index], o)
                rise = problem.link_peak(k, last[index], o)
                now_held = held[index] | problem.keeps(k, o)
                held_bytes = problem.held_bytes(now_held)
                new_c = max(c + residue[o] + link, p + local[o] + rise + held_bytes)
                new_p = p + retained[o]
                if (
                    p + forward[o] > budget_bytes
                    or new_c + later_residue[k] > budget_bytes
                    or problem.tail_peak(new_p + later_retained[k], held_bytes) > budget_bytes
                ):
                    continue
                groups.setdefault((o, now_held), []).append(
                    (new_p, new_c, step(cost, k, o, p), index, o)
                )
        kept = [  # in option order: ties between equal plans go as before shared bytes existed
            (state, key[1]) for key in sorted(groups) for state in _pareto(groups[key])
        ]
        if len(kept) > max_states:
            raise FrontierTooLarge(f"DP Pareto set has {len(kept)} states (cap {max_states})")
        states = [(p, c, cost) for (p, c, cost, _, _), _ in kept]
        last = [o for (_, _, _, _, o), _ in kept]
        held = [now_held for _, now_held in kept]
        links.append([(index, o) for (_, _, _, index, o), _ in kept])
    return states, held, links


def _rebuild(links: list[list[tuple[int, int]]], index: int) -> tuple[int, ...]:
    choice = []
    for level in reversed(links):
        index, option = level[index]
        choice.append(option)
    return tuple(reversed(choice))


def solve_dp(
    problem: ChainProblem, budget_bytes: int, *, max_states: int = DEFAULT_MAX_STATES
) -> Solution:
    """The fastest choice within ``budget_bytes``, exactly.

    Example:
        >>> from remat.planner.model import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> solve_dp(p, 200).choice
        (1, 0)
    """
    started = time.perf_counter()

    def add_time(cost: float, k: int, o: int, _: int) -> float:
        return cost + problem.time_s[k][o]

    states, held, links = _search(problem, budget_bytes, add_time, max_states)
    finals = [
        i for i, (p, c, _) in enumerate(states)
        if max(c, problem.tail_peak(p, problem.held_bytes(held[i]))) <= budget_bytes
    ]
    if not finals:
        raise infeasible(problem, budget_bytes)
    choice = _rebuild(links, min(finals, key=lambda i: states[i][2]))
    return Solution(
        choice=choice,
        peak_bytes=problem.peak_bytes(choice),
        step_s=problem.step_time_s(choice),
        solver="dp",
        optimal=True,
        gap=0.0,
        solve_s=time.perf_counter() - started,
    )


def min_peak_choice(problem: ChainProblem, *, max_states: int = DEFAULT_MAX_STATES) -> tuple[int, ...]:
    """A choice with the smallest predicted peak (the same DP; cost = highest forward peak).

    Example:
        >>> from remat.planner.model import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> min_peak_choice(p)
        (1, 1)
    """

    def forward_peak(cost: float, k: int, o: int, retained_before: int) -> float:
        return max(cost, retained_before + problem.forward_bytes[k][o])

    states, held, links = _search(problem, float("inf"), forward_peak, max_states)
    best = min(
        range(len(states)),
        key=lambda i: max(
            states[i][1], problem.tail_peak(states[i][0], problem.held_bytes(held[i])), states[i][2]
        ),
    )
    return _rebuild(links, best)


def min_reachable_peak(problem: ChainProblem) -> int:
    """The smallest predicted peak of any choice.

    Example:
        >>> from remat.planner.model import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> min_reachable_peak(p)
        120
    """
    return problem.peak_bytes(min_peak_choice(problem))


def infeasible(problem: ChainProblem, budget_bytes: int) -> InfeasibleBudget:
    """The error every solver raises when no choice fits ``budget_bytes``."""
    return InfeasibleBudget.for_peak(budget_bytes, min_reachable_peak(problem))
