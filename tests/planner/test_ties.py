"""Ties within the profile's noise go to the plan with fewer bytes (docs/design/planner.md, "Ties").

Every solver follows one rule (:func:`remat.planner.cost.preferred`): of the
plans whose step time is within ``ChainProblem.time_tolerance_s`` of the
fastest that fits, the one with the smallest predicted peak, then the least
time. So a larger budget never yields a higher peak unless the fastest
plan there is faster than the tolerance.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import random_chain, uniform_chain
from remat.errors import CheckpointUsageError
from remat.planner.cost import peak_bytes, preferred, step_time_s, tied_time_s
from remat.planner.data import ChainProblem
from remat.planner.solvers import min_reachable_peak, solve

SOLVERS = ("dp", "milp", "greedy", "enumerate")
EXACT = ("dp", "milp", "enumerate")  # the greedy is not optimal: no monotonicity to promise


def lowest_tied_peak(problem: ChainProblem, budget: int) -> tuple[int, float]:
    """By enumeration: the rule's answer's (peak, step time), computed the long way."""
    fitting = [
        (step_time_s(problem, c), peak_bytes(problem, c))
        for c in itertools.product(range(len(problem.options)), repeat=problem.size)
        if peak_bytes(problem, c) <= budget
    ]
    bound = tied_time_s(problem, min(step for step, _ in fitting))
    peak, step = min((peak, step) for step, peak in fitting if step <= bound)
    return peak, step


@pytest.mark.parametrize("solver", SOLVERS)
def test_an_exact_tie_goes_to_the_fewest_bytes(solver: Any) -> None:
    # Checkpointing costs nothing here: every choice takes 3 s, and the budget
    # fits keeping everything (350 bytes); checkpointing all three peaks at 130.
    problem = uniform_chain(3, time_s=((1.0, 1.0),) * 3)
    solution = solve(problem, 350, solver)
    assert (solution.peak_bytes, solution.choice) == (130, (1, 1, 1))
    assert solution.step_s == 3.0


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_tie_within_the_noise_goes_to_the_fewest_bytes(solver: Any) -> None:
    # Checkpoint is 1 ms slower per block, keep-all fits: without a tolerance
    # the fastest (keep everything, 350 bytes) wins; within 5 ms of noise the
    # three checkpoints (3 ms slower) tie with it and peak at 130.
    times = ((1.0, 1.001),) * 3
    assert solve(uniform_chain(3, time_s=times), 350, solver).choice == (0, 0, 0)
    noisy = uniform_chain(3, time_s=times, time_tolerance_s=0.005)
    solution = solve(noisy, 350, solver)
    assert (solution.peak_bytes, solution.choice) == (130, (1, 1, 1))
    assert solution.step_s == pytest.approx(3.003)


@pytest.mark.parametrize("solver", SOLVERS)
def test_the_tolerance_is_counted_from_the_fastest_not_chained(solver: Any) -> None:
    # Each checkpoint adds 4 ms; the tolerance is 5 ms. One checkpoint ties
    # with keeping everything, two would tie with one but not with the fastest.
    problem = uniform_chain(3, time_s=((1.0, 1.004),) * 3, time_tolerance_s=0.005)
    solution = solve(problem, 350, solver)
    assert solution.choice.count(1) == 1
    assert solution.peak_bytes == min(peak_bytes(problem, c) for c in ((1, 0, 0), (0, 1, 0), (0, 0, 1)))


@pytest.mark.parametrize("solver", EXACT)
def test_a_tie_dropped_by_forward_peaks_is_still_found(solver: Any) -> None:
    # Every choice takes 2 s. Region 0's checkpoint retains less but has a
    # forward peak of 300 (a workspace, say). The DP's Pareto sets compare
    # retained bytes, backward peaks and time, not forward peaks, so its
    # search drops (0, 1) (peak 210) for (1, 1) (peak 300), which retains
    # less: it must search again below the best peak it found.
    problem = uniform_chain(2, time_s=((1.0, 1.0),) * 2, forward_bytes=((0, 300), (0, 0)))
    solution = solve(problem, 400, solver)
    assert (solution.peak_bytes, solution.choice) == (210, (0, 1))
    assert lowest_tied_peak(problem, 400) == (210, 2.0)


def test_the_rule_itself() -> None:
    problem = uniform_chain(1, time_tolerance_s=0.1)
    assert tied_time_s(problem, 2.0) == pytest.approx(2.1)
    # Without a stated tolerance, only float rounding ties.
    exact = uniform_chain(1)
    assert tied_time_s(exact, 0.1 + 0.2) >= 0.3 + 0.0 and tied_time_s(exact, 1.0) < 1.0 + 1e-6
    assert preferred(problem, [(1.0, 300), (1.09, 200), (1.11, 100)]) == 1
    assert preferred(problem, [(1.0, 300), (1.05, 200), (1.02, 200)]) == 2  # same bytes: less time
    assert preferred(exact, [(1.0, 300), (1.0, 300)]) == 0  # then the first
    with pytest.raises(CheckpointUsageError, match="time_tolerance_s"):
        uniform_chain(1, time_tolerance_s=-1.0)
    with pytest.raises(CheckpointUsageError, match="time_tolerance_s"):
        uniform_chain(1, time_tolerance_s=float("nan"))


def test_head_options_tie_like_solutions() -> None:
    from remat.planner._planner import _fastest

    # The same blocks under two head options: the second (a chunked head)
    # peaks lower after the blocks at the same time; the tie goes to it.
    unchunked = uniform_chain(3, tail_bytes=400)
    chunked = uniform_chain(3, tail_bytes=100)
    head, solution = _fastest([unchunked, chunked], 1000, "auto")
    assert head == 1
    assert solution.peak_bytes == peak_bytes(chunked, solution.choice)
    # A chunked head slower by more than the tolerance does not win.
    slower = dataclasses.replace(chunked, base_time_s=0.5)
    assert _fastest([unchunked, slower], 1000, "auto")[0] == 0


def quantised(problem: ChainProblem, step: float) -> ChainProblem:
    """The same chain with times rounded to multiples of ``step``: exact ties are common."""
    times = tuple(tuple(round(t / step) * step for t in row) for row in problem.time_s)
    return dataclasses.replace(problem, time_s=times)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 5),
    tolerance=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    fractions=st.tuples(st.floats(0.0, 1.0, allow_subnormal=False), st.floats(0.0, 1.0, allow_subnormal=False)),
)
def test_a_larger_budget_never_raises_the_peak_without_a_gain_beyond_the_noise(
    seed: int, n: int, tolerance: float, fractions: tuple[float, float]
) -> None:
    problem = dataclasses.replace(
        quantised(random_chain(random.Random(seed), n), 0.25), time_tolerance_s=tolerance
    )
    low = min_reachable_peak(problem)
    high = max(peak_bytes(problem, c) for c in itertools.product(range(3), repeat=n))
    small, large = (int(low + f * (high - low)) for f in sorted(fractions))
    expected = {budget: lowest_tied_peak(problem, budget) for budget in (small, large)}
    fastest_large = min(
        step_time_s(problem, c) for c in itertools.product(range(3), repeat=n) if peak_bytes(problem, c) <= large
    )
    for solver in EXACT:
        at_small, at_large = solve(problem, small, solver), solve(problem, large, solver)
        for budget, solution in ((small, at_small), (large, at_large)):
            assert (solution.peak_bytes, solution.step_s) == (
                expected[budget][0], pytest.approx(expected[budget][1], abs=1e-9)
            ), solver
        if at_large.peak_bytes > at_small.peak_bytes:
            # The smaller budget's plan fits the larger one too; it lost only
            # because the fastest plan there is faster by more than the tolerance.
            assert at_small.step_s > tied_time_s(problem, fastest_large), solver


def test_the_profile_noise_is_the_standard_error_of_a_plans_time() -> None:
    import math

    from torch import nn

    from remat.planner.data import CHECKPOINT, KEEP
    from remat.planner.profile import _step_noise

    def rounds(*per_round: tuple[float, ...]) -> list[Any]:
        """Recorders of timed rounds: each region's forward took the given seconds."""
        return [
            SimpleNamespace(
                forward=[SimpleNamespace(seconds=s) for s in times],
                backward=[SimpleNamespace(seconds=0.0) for _ in times],
            )
            for times in per_round
        ]

    # Blocks a and b are identical (one median for both), c differs.
    regions = [("a", nn.Linear(2, 2)), ("b", nn.Linear(2, 2)), ("c", nn.Linear(3, 3))]
    sizes = [(8, 8), (8, 8), (12, 12)]
    runs = rounds((1.0, 1.2, 2.0), (1.1, 9.0, 2.0), (1.1, 1.1, 2.0))
    timings = {KEEP.name: runs, CHECKPOINT.name: runs}
    # a and b: 1.0, 1.2, 1.1, 9.0, 1.1, 1.1: median 1.1, deviations 0.1, 0.1, 0, 7.9, 0, 0:
    # MAD 0.05 (the stalled 9.0 barely counts). Their errors add: twice one median's.
    twins = 2 * 1.2533 * 1.4826 * 0.05 / math.sqrt(6)
    # c read 2.0 every round: no spread, no error.
    assert _step_noise(regions, (KEEP, CHECKPOINT), sizes, timings) == pytest.approx(twins)  # type: ignore[arg-type]
    # One round of distinct blocks: nothing sampled twice, no noise to count.
    first = {name: runs[:1] for name in timings}
    assert _step_noise(regions[1:], (KEEP, CHECKPOINT), sizes[1:], first) == 0.0  # type: ignore[arg-type]
