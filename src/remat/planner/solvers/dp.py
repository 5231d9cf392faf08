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

This recurrence is the incremental form of the peak terms of
:mod:`remat.planner.cost` (each line below names the terms it computes);
:func:`dp_peak` runs it along one choice, and the tests check it against
:func:`remat.planner.cost.peak_bytes` on random problems and choices.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence

from remat.errors import FrontierTooLargeError, InfeasibleBudgetError
from remat.planner.budget import unreachable_budget
from remat.planner.cost import peak_bytes, step_time_s, tied_time_s
from remat.planner.data import ChainProblem, Solution

__all__ = [
    "DEFAULT_MAX_STATES",
    "dp_peak",
    "infeasible",
    "min_peak_choice",
    "min_reachable_peak",
    "solve_dp",
    "within",
]

DEFAULT_MAX_STATES = 100_000
"""Pareto-set size past which :func:`solve_dp` gives up (the MILP takes over)."""

_Step = Callable[[float, int, int, int], float]  # (cost, region, option, retained before) -> cost


def _tail_peak(problem: ChainProblem, retained: int, held: int) -> int:
    """Terms ``tail`` and ``after_model``, on ``retained`` bytes with ``held`` shared bytes kept."""
    tail = retained + problem.tail_bytes
    if problem.tail_after_bytes is not None:
        tail = max(tail, retained + problem.tail_after_bytes + held)
    return tail


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
    problem: ChainProblem,
    budget_bytes: float,
    step: _Step,
    max_states: int,
    options_at: Sequence[Sequence[int]] | None = None,
) -> tuple[list[tuple[int, int, float]], list[int], list[list[tuple[int, int]]]]:
    """Final states ``(P, C, cost)`` within the budget, the shared groups each
    holds (a bitmask), and the links to rebuild choices.

    States are kept per last option, since the link to the next region
    depends on it, and per shared groups kept so far (``S`` of the cost model).
    ``options_at[k]`` limits the options region ``k`` may take (all of them
    by default).
    """
    n, width = problem.size, len(problem.options)
    lowest = [
        min(problem.residue_bytes[k]) + min(min(row) for row in problem.link_bytes[k])
        for k in range(n)
    ]
    lowest_retained = [min(row) for row in problem.retained_bytes]
    later_residue = [sum(lowest[k + 1 :]) for k in range(n)]
    later_retained = [sum(lowest_retained[k + 1 :]) for k in range(n)]
    # "floor": its constant; every region adds its residue and link below.
    states: list[tuple[int, int, float]] = [(0, problem.floor_bytes, 0.0)]
    last: list[int | None] = [None]
    held: list[int] = [0]
    links: list[list[tuple[int, int]]] = []
    for k in range(n):
        retained, local = problem.retained_bytes[k], problem.local_bytes[k]
        residue, forward = problem.residue_bytes[k], problem.forward_bytes[k]
        options = range(width) if options_at is None else options_at[k]
        groups: dict[tuple[int, int], list[tuple[int, int, float, int, int]]] = {}
        for index, (p, c, cost) in enumerate(states):
            for o in options:
                link = problem.link(k, last[index], o)
                rise = problem.link_peak(k, last[index], o)
                now_held = held[index] | problem.keeps(k, o)
                held_bytes = problem.held_bytes(now_held)
                # "backward[k]" without the later residues (added as they come),
                # and region k's residue and link for the earlier ones and "floor".
                new_c = max(c + residue[o] + link, p + local[o] + rise + held_bytes)
                new_p = p + retained[o]
                if (
                    p + forward[o] > budget_bytes  # "forward[k]"
                    or new_c + later_residue[k] > budget_bytes
                    or _tail_peak(problem, new_p + later_retained[k], held_bytes) > budget_bytes
                ):
                    continue
                groups.setdefault((o, now_held), []).append(
                    (new_p, new_c, step(cost, k, o, p), index, o)
                )
        kept = [  # in option order: ties between equal plans go as before shared bytes existed
            (state, key[1]) for key in sorted(groups) for state in _pareto(groups[key])
        ]
        if len(kept) > max_states:
            raise FrontierTooLargeError(
                f"remat.planner: the DP kept {len(kept)} partial plans at region {k} (cap "
                f"{max_states}); use solver='milp' (or 'auto', which does), or raise max_states.",
                states=len(kept),
                max_states=max_states,
            )
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
    problem: ChainProblem,
    budget_bytes: int,
    *,
    max_states: int = DEFAULT_MAX_STATES,
    allowed: Sequence[Sequence[int]] | None = None,
) -> Solution:
    """The fastest choice within ``budget_bytes``, exactly; of the choices
    tied with it in time, the one with the fewest peak bytes
    (:func:`remat.planner.cost.tied_time_s`, ``docs/design/planner.md``, "Ties").

    Example:
        >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> solve_dp(p, 200).choice
        (1, 0)

    ``allowed[k]`` limits the options region ``k`` may take (all by default).
    """
    started = time.perf_counter()

    def add_time(cost: float, k: int, o: int, _: int) -> float:
        return cost + problem.time_s[k][o]

    def tied_within(budget: float, bound: float | None) -> tuple[list[tuple[int, ...]], float]:
        """Choices of the final states within ``budget`` whose time (regions only) is at
        most ``bound``; None: tied with the fastest of them. The bound comes back."""
        states, held, links = _search(problem, budget, add_time, max_states, allowed)
        finals = [
            i for i, (p, c, _) in enumerate(states)
            if max(c, _tail_peak(problem, p, problem.held_bytes(held[i]))) <= budget
        ]
        if bound is None and finals:
            # The search's costs leave out base_time_s; the tie is on the whole step.
            fastest = min(states[i][2] for i in finals)
            bound = tied_time_s(problem, problem.base_time_s + fastest) - problem.base_time_s
        tied = [_rebuild(links, i) for i in finals if bound is not None and states[i][2] <= bound]
        return tied, float("inf") if bound is None else bound

    tied, bound = tied_within(budget_bytes, None)
    if not tied:
        raise infeasible(problem, budget_bytes, allowed)
    fastest_s = min(step_time_s(problem, c) for c in tied)
    choice = _fewest_bytes(problem, tied)
    # The Pareto sets compare retained bytes, backward peaks and time, not
    # forward peaks, so a tied choice with fewer bytes may have been dropped:
    # search again below the best peak found until no tied choice fits.
    while (below := tied_within(peak_bytes(problem, choice) - 1, bound)[0]):
        choice = _fewest_bytes(problem, below)
    if step_time_s(problem, choice) > fastest_s:
        # At the fewest bytes, the fastest tied choice (no search drops the fastest state).
        at_least, _ = tied_within(peak_bytes(problem, choice), bound)
        choice = min(at_least, key=lambda c: (step_time_s(problem, c), c))
    return Solution(
        choice=choice,
        peak_bytes=peak_bytes(problem, choice),
        step_s=step_time_s(problem, choice),
        solver="dp",
        optimal=True,
        gap=0.0,
        solve_s=time.perf_counter() - started,
    )


def _fewest_bytes(problem: ChainProblem, choices: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Of tied choices, the one with the fewest peak bytes, then the least time."""
    return min(choices, key=lambda c: (peak_bytes(problem, c), step_time_s(problem, c)))


def _lowest_peaks(
    problem: ChainProblem, max_states: int, options_at: Sequence[Sequence[int]] | None = None
) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """The peak of every final state of the DP without a budget (cost: highest forward term)."""

    def forward_peak(cost: float, k: int, o: int, retained_before: int) -> float:
        return max(cost, retained_before + problem.forward_bytes[k][o])

    states, held, links = _search(problem, float("inf"), forward_peak, max_states, options_at)
    peaks = [
        int(max(c, _tail_peak(problem, p, problem.held_bytes(mask)), forward))
        for (p, c, forward), mask in zip(states, held, strict=True)
    ]
    return peaks, links


def min_peak_choice(
    problem: ChainProblem,
    *,
    max_states: int = DEFAULT_MAX_STATES,
    allowed: Sequence[Sequence[int]] | None = None,
) -> tuple[int, ...]:
    """A choice with the smallest predicted peak (the same DP; cost = highest forward peak).

    Example:
        >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> min_peak_choice(p)
        (1, 1)
    """
    peaks, links = _lowest_peaks(problem, max_states, allowed)
    return _rebuild(links, min(range(len(peaks)), key=peaks.__getitem__))


def dp_peak(problem: ChainProblem, choice: Sequence[int]) -> int:
    """The peak the DP's recurrence gives ``choice``: its search, pinned to that choice.

    Equal to :func:`remat.planner.cost.peak_bytes` for every choice; the
    tests check it, so that the DP's incremental form and the cost model's
    terms cannot drift apart.

    Example:
        >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> dp_peak(p, (0, 1)), peak_bytes(p, (0, 1))
        (210, 210)
    """
    peaks, _ = _lowest_peaks(problem, 1, [(o,) for o in choice])
    (peak,) = peaks
    return peak


def min_reachable_peak(problem: ChainProblem, allowed: Sequence[Sequence[int]] | None = None) -> int:
    """The smallest predicted peak of any choice (of the ``allowed`` options per region).

    Example:
        >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> min_reachable_peak(p)
        120
    """
    return peak_bytes(problem, min_peak_choice(problem, allowed=allowed))


def infeasible(
    problem: ChainProblem, budget_bytes: int, allowed: Sequence[Sequence[int]] | None = None
) -> InfeasibleBudgetError:
    """The error every solver raises when no choice (of the ``allowed`` options) fits ``budget_bytes``."""
    return unreachable_budget(budget_bytes, min_reachable_peak(problem, allowed))


def within(problem: ChainProblem, max_error: float | None) -> list[list[int]] | None:
    """Per region, the options whose own error stays within ``max_error`` (None: all of them)."""
    if max_error is None or not problem.approximate:
        return None
    return [[o for o, error in enumerate(row) if error <= max_error] for row in problem.gradient_error]
