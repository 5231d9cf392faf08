"""Planner solvers on hand-built tables with known optima, and against enumeration."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import random_chain, uniform_chain
from remat.errors import CheckpointTypeError, CheckpointUsageError, InfeasibleBudgetError
from remat.planner.budget import Budget
from remat.planner.cost import peak_bytes, step_time_s, term_bytes
from remat.planner.data import (
    CHECKPOINT,
    KEEP,
    SAVE_MATMULS,
    ChainProblem,
    SharedInput,
)
from remat.planner.solvers import (
    min_reachable_peak,
    pareto_front,
    solve,
    solve_dp,
    solve_enumerate,
    solve_greedy,
    solve_milp,
)

# The code under test imports no torch (test_cost checks it): its answers cannot change
# with the torch release, so the release matrix skips these (scripts/test-matrix.sh).
pytestmark = pytest.mark.torch_free


def test_peak_formula_by_hand() -> None:
    problem = uniform_chain(3)
    # keep, keep, keep: the last block's backward sits on 200 retained bytes: 200 + 150.
    assert peak_bytes(problem, (0, 0, 0)) == 350
    # checkpoint first: 10 + 100 retained under the last block: 110 + 150.
    assert peak_bytes(problem, (1, 0, 0)) == 260
    assert peak_bytes(problem, (1, 1, 1)) == 130
    assert step_time_s(problem, (1, 1, 0)) == 4.0


def test_residues_and_forward_terms_count() -> None:
    problem = uniform_chain(
        2, floor_bytes=5, residue_bytes=((7, 7), (40, 3)), forward_bytes=((0, 0), (0, 500))
    )
    # block 0's backward: 150 + residue of block 1 (40); the floor adds both residues.
    assert peak_bytes(problem, (0, 0)) == max(100 + 150, 150 + 40, 5 + 47)
    assert peak_bytes(problem, (0, 1)) == 600  # block 1's forward peak under checkpoint
    assert solve_dp(problem, 260).choice == (0, 0)
    assert solve_dp(problem, 200).choice == (1, 0)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(350, (0, 0, 0)), (260, (1, 0, 0)), (250, (1, 1, 0)), (170, (1, 1, 0)), (130, (1, 1, 1))],
)
def test_known_optima(budget: int, expected: tuple[int, ...]) -> None:
    problem = uniform_chain(3)
    for solver in ("dp", "milp", "enumerate"):
        solution = solve(problem, budget, solver)  # type: ignore[arg-type]
        # Ties (same time, both fitting) may go either way; the time may not.
        assert solution.step_s == step_time_s(problem, expected), solver
        assert solution.peak_bytes <= budget
        assert solution.optimal and solution.gap < 1e-6
    assert solve_dp(problem, budget).choice == expected


def linked_pair(**extra: Any) -> ChainProblem:
    """Two keep/checkpoint regions whose boundary tensor is 60 bytes when region 0
    checkpoints and region 1 keeps (it lives through region 1's backward)."""
    no_link = ((0, 0), (0, 0))
    return uniform_chain(2, link_bytes=(no_link, ((0, 0), (60, 0))), **extra)


def test_links_between_neighbours() -> None:
    # Region 1's residue grows by 60 when region 0 checkpoints and region 1 keeps
    # (the shared tensor lives through region 1's backward).
    problem = linked_pair()
    # (1, 0): region 1's own peak +60, and region 0's backward sees its residue 60.
    assert peak_bytes(problem, (1, 0)) == max(10 + 150 + 60, 110 + 60)
    assert peak_bytes(problem, (0, 1)) == 210
    assert solve_dp(problem, 210).choice == (0, 1)
    assert solve_milp(problem, 210).choice == (0, 1)
    with pytest.raises(CheckpointUsageError, match="link_bytes"):
        ChainProblem((KEEP,), ((1,),), ((1,),), ((1.0,),), 0, 0, link_bytes=(((0, 0),),))


def test_link_peak_is_the_measured_rise_not_the_whole_tensor() -> None:
    # Same chain, but region 1's measured backward peak came before the shared
    # tensor's free: its peak rises by 20 (what ran after the free), not 60.
    problem = linked_pair(link_peak_bytes=(((0, 0), (0, 0)), ((0, 0), (20, 0))))
    assert problem.link_peak_bytes[1][1][0] == 20
    assert peak_bytes(problem, (1, 0)) == max(10 + 150 + 20, 110 + 60)
    budget = peak_bytes(problem, (1, 0))
    oracle = solve_enumerate(problem, budget)
    assert solve_dp(problem, budget).choice == solve_milp(problem, budget).choice == oracle.choice
    with pytest.raises(CheckpointUsageError, match="link_peak_bytes"):
        ChainProblem((KEEP,), ((1,),), ((1,),), ((1.0,),), 0, 0, link_peak_bytes=(((0, 0),),))


def test_shared_inputs_count_from_the_first_region_that_keeps_them() -> None:
    # A 30-byte mask: checkpointed regions keep it (their saved inputs) until
    # their backward, kept ones do not. It lives through the backward of every
    # region from the first that keeps it on, and through the loss when any does.
    problem = uniform_chain(
        3, shared=(SharedInput(30, takers=(0, 1, 2), kept_under=("checkpoint",)),), tail_after_bytes=50
    )
    assert peak_bytes(problem, (0, 0, 0)) == 350  # as without a mask
    # Region 0 keeps it: +30 under every backward, and under the loss (30 + 50).
    assert peak_bytes(problem, (1, 0, 0)) == 10 + 100 + 150 + 30
    assert term_bytes(problem, (1, 0, 0))["after_model"] == 210 + 50 + 30
    # Region 2 keeps it: only its own backward sees it.
    assert peak_bytes(problem, (0, 0, 1)) == max(100 + 150, 200 + 110 + 30, 210 + 50 + 30)
    for budget in (260, 290, 340, 400):
        oracle = solve_enumerate(problem, budget)
        for solver in (solve_dp, solve_milp):
            assert solver(problem, budget).step_s == oracle.step_s
    with pytest.raises(CheckpointUsageError, match="outside the chain"):
        ChainProblem((KEEP,), ((1,),), ((1,),), ((1.0,),), 0, 0, shared=(SharedInput(1, (0, 1), ("keep",)),))


def test_shared_inputs_taken_by_some_regions_only() -> None:
    # Gemma-2's shape: a global mask for regions 0 and 2, a sliding one for 1 and 3,
    # each kept only by a checkpointed region that takes it. Checkpointing region 2
    # keeps the global mask alone: 20 bytes under regions 2 and 3's backward, not 50.
    problem = uniform_chain(
        4,
        shared=(
            SharedInput(20, takers=(0, 2), kept_under=("checkpoint",)),
            SharedInput(30, takers=(1, 3), kept_under=("checkpoint",)),
        ),
    )
    assert peak_bytes(problem, (0, 0, 1, 0)) == 210 + 150 + 20
    assert peak_bytes(problem, (0, 1, 1, 0)) == 110 + 10 + 150 + 50
    for budget in (330, 360, 380, 400):
        oracle = solve_enumerate(problem, budget)
        for solver in (solve_dp, solve_milp):
            assert solver(problem, budget).step_s == oracle.step_s


def test_checkpoints_the_earliest_blocks_first() -> None:
    # Retained bytes of early blocks sit under every later peak: freeing them helps most.
    solution = solve_dp(uniform_chain(8), 8 * 10 + 100 * 3 + 150)
    assert solution.choice == (1, 1, 1, 1, 0, 0, 0, 0)


def test_unreachable_budget_names_the_smallest_peak() -> None:
    problem = uniform_chain(3)
    assert min_reachable_peak(problem) == 130
    for solver in ("auto", "dp", "milp", "greedy", "enumerate"):
        with pytest.raises(CheckpointUsageError, match=r"smallest reachable peak is .*\(130 bytes\)") as info:
            solve(problem, 129, solver)  # type: ignore[arg-type]
        assert isinstance(info.value, InfeasibleBudgetError)
        assert info.value.min_peak_bytes == 130
    assert solve(problem, 130).choice == (1, 1, 1)


def test_unknown_solver_is_a_usage_error() -> None:
    with pytest.raises(CheckpointUsageError, match="solver must be one of"):
        solve(uniform_chain(2), 1000, "simplex")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
# No subnormal fractions: meaningless as budgets, and hypothesis refuses them once a
# kernel built with -ffast-math (inductor's C++ on torch 2.4) has set flush-to-zero.
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 6),
    fraction=st.floats(0.0, 1.0, allow_subnormal=False),
)
def test_dp_and_milp_match_enumeration(seed: int, n: int, fraction: float) -> None:
    problem = random_chain(random.Random(seed), n)
    low = min_reachable_peak(problem)
    high = peak_bytes(problem, (0,) * n)
    budget = int(low + fraction * max(0, high - low))
    oracle = solve_enumerate(problem, budget)
    assert min(peak_bytes(problem, c) for c in [oracle.choice]) <= budget
    for solution in (solve_dp(problem, budget), solve_milp(problem, budget)):
        assert solution.peak_bytes <= budget
        assert solution.step_s == pytest.approx(oracle.step_s, rel=1e-9)
    greedy = solve_greedy(problem, budget)
    assert greedy.peak_bytes <= budget
    assert greedy.step_s >= oracle.step_s - 1e-9
    assert 0.0 <= greedy.gap < 1.0
    with pytest.raises(InfeasibleBudgetError):
        solve_dp(problem, low - 1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6))
def test_min_reachable_peak_matches_enumeration(seed: int, n: int) -> None:
    import itertools

    problem = random_chain(random.Random(seed), n)
    brute = min(peak_bytes(problem, c) for c in itertools.product(range(3), repeat=n))
    assert min_reachable_peak(problem) == brute


def test_pareto_front_trades_memory_for_time() -> None:
    front = pareto_front(random_chain(random.Random(3), 8), points=10)
    assert len(front) >= 2
    for lower, higher in itertools.pairwise(front):
        assert lower.peak_bytes < higher.peak_bytes
        assert lower.step_s > higher.step_s
        assert lower.peak_bytes <= lower.budget_bytes


def test_96_blocks_solve_exactly() -> None:
    # benchmarks/planner.py reports the solve time (under 5 s); on a shared CI
    # machine the bound here only catches a blow-up of the DP's state set.
    problem = random_chain(random.Random(0), 96)
    budget = (min_reachable_peak(problem) + peak_bytes(problem, (0,) * 96)) // 2
    started = time.perf_counter()
    solution = solve(problem, budget, "dp")
    assert time.perf_counter() - started < 60.0
    assert solution.solver == "dp" and solution.optimal and solution.peak_bytes <= budget
    assert solution.step_s == pytest.approx(solve_milp(problem, budget).step_s, rel=1e-9)
    # "auto" hands chains this long to the MILP (faster there than the DP), and solves them exactly.
    chosen = solve(problem, budget)
    assert chosen.solver == "milp" and chosen.optimal
    assert chosen.step_s == pytest.approx(solution.step_s, rel=1e-9)
    short = random_chain(random.Random(0), 12)
    assert solve(short, peak_bytes(short, (0,) * 12)).solver in ("dp", "keep")


@pytest.mark.parametrize(
    ("budget", "reference", "expected"),
    [
        (4096, None, 4096),
        ("300MiB", None, 300 * 2**20),
        ("6GiB", None, 6 * 2**30),
        ("1.5 GB", None, 1_500_000_000),
        ("512", None, 512),
        ("50%", 1000, 500),
        ("100 %", 1000, 1000),
        ("12.5%", 1000, 125),
    ],
)
def test_budget_parse(budget: object, reference: int | None, expected: int) -> None:
    assert Budget.parse(budget).resolve(reference) == expected


def test_a_fraction_is_asked_for_explicitly() -> None:
    # A bare float is refused: budget=1 (one byte) and budget=1.0 (the whole unchecked
    # peak) would mean different things; a fraction is asked for by name or as "50%".
    assert Budget.parse(None, fraction=0.5).resolve(1000) == 500
    assert Budget.parse(None, fraction=1).resolve(1000) == 1000
    with pytest.raises(CheckpointTypeError, match=r"ambiguous.*'50%' or fraction=0.5"):
        Budget.parse(0.5).resolve(1000)
    with pytest.raises(CheckpointTypeError, match="ambiguous"):
        Budget.parse(1.0).resolve(1000)
    with pytest.raises(CheckpointUsageError, match=r"not a whole number of bytes.*'50%'"):
        Budget.parse("0.5").resolve(1000)
    with pytest.raises(CheckpointUsageError, match="not both"):
        Budget.parse("50%", fraction=0.5).resolve(1000)
    with pytest.raises(CheckpointUsageError, match="missing"):
        Budget.parse(None).resolve(1000)


@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [
        (0, CheckpointUsageError, "positive"),
        (-5, CheckpointUsageError, "positive"),
        ("150%", CheckpointUsageError, r"\(0, 1\]"),
        ("0%", CheckpointUsageError, r"\(0, 1\]"),
        (1.5, CheckpointTypeError, "ambiguous"),
        ("lots", CheckpointUsageError, "cannot read"),
        ("3 parsecs", CheckpointUsageError, "cannot read"),
        (True, CheckpointTypeError, "bool"),
        ([1], CheckpointTypeError, "list"),
    ],
)
def test_budget_parse_rejects(budget: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Budget.parse(budget).resolve(1000)


def test_tables_must_agree() -> None:
    with pytest.raises(CheckpointUsageError, match="one entry per option"):
        ChainProblem((KEEP, CHECKPOINT), ((1,),), ((1, 2),), ((1.0, 2.0),), 0, 0)
    with pytest.raises(CheckpointUsageError, match="one row per region"):
        ChainProblem((KEEP,), ((1,), (2,)), ((1,),), ((1.0,),), 0, 0)


def test_a_budget_is_a_value_validated_once() -> None:
    assert Budget.of_bytes(4096) == Budget(nbytes=4096) == Budget.parse(4096)
    assert Budget.fraction(0.5) == Budget(ratio=0.5) == Budget.parse("50%")
    assert Budget.fraction(1).ratio == 1.0 and Budget.fraction(0.5).resolve(1001) == 500
    budget = Budget.of_bytes(10)
    assert Budget.parse(budget) is budget
    with pytest.raises(CheckpointUsageError, match="not both"):
        Budget.parse(budget, fraction=0.5)
    with pytest.raises(CheckpointUsageError, match="exactly one"):
        Budget()
    with pytest.raises(CheckpointUsageError, match="exactly one"):
        Budget(nbytes=10, ratio=0.5)
    with pytest.raises(CheckpointUsageError, match="positive"):
        Budget.of_bytes(0)
    with pytest.raises(CheckpointTypeError, match="must be an int"):
        Budget.of_bytes(1.5)  # type: ignore[arg-type]
    with pytest.raises(CheckpointUsageError, match=r"fraction=1.5 must be a fraction in \(0, 1\]"):
        Budget.fraction(1.5)
    with pytest.raises(CheckpointTypeError, match="fraction must be a number"):
        Budget.fraction("0.5")  # type: ignore[arg-type]
    with pytest.raises(CheckpointUsageError, match="needs the unchecked peak"):
        Budget.fraction(0.5).resolve(None)


def test_the_milp_prints_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    # HiGHS writes "HighsMipSolverData::transformNewIntegerFeasibleSolution
    # tmpSolver.run();" to file descriptor 1 on this chain (scipy 1.17),
    # whatever disp=False says; the solver sends the descriptor to the null
    # device while HiGHS runs (src/remat/planner/solvers/milp.py).
    pytest.importorskip("scipy")
    rng = random.Random(1)
    size, scale = 192, 2_000_000
    retained = tuple(tuple(rng.randint(1, scale) for _ in range(3)) for _ in range(size))
    problem = ChainProblem(
        (KEEP, CHECKPOINT, SAVE_MATMULS), retained,
        tuple(tuple(r + rng.randint(0, scale) for r in row) for row in retained),
        tuple(tuple(1.0 + rng.random() for _ in range(3)) for _ in range(size)),
        rng.randint(0, scale // 2), rng.randint(0, scale // 2),
        residue_bytes=tuple(tuple(rng.randint(0, scale // 7) for _ in range(3)) for _ in range(size)),
    )
    budget = (min_reachable_peak(problem) + peak_bytes(problem, (0,) * size)) // 2
    print("before", flush=True)
    solution = solve_milp(problem, budget)
    print("after")
    assert solution.peak_bytes <= budget
    out, _ = capfd.readouterr()
    assert out == "before\nafter\n"  # the user's own output still arrives, in order


def with_compression(problem: Any, rng: random.Random) -> Any:
    """``problem`` with two compressing options added: cheaper in bytes than keep, faster than
    checkpoint, each with a gradient error of its own per region."""
    import dataclasses

    from remat.planner.data import KEEP

    width = len(problem.options)
    options = (*problem.options, KEEP.compressed("fp8"), problem.options[1].compressed("int8"))

    def widen(table: Any, extra: Any) -> Any:
        return tuple((*row, *extra(k, row)) for k, row in enumerate(table))

    def cheaper(k: int, row: Any) -> tuple[int, int]:
        return (max(1, row[0] // 3), max(1, row[1] // 2))

    retained = widen(problem.retained_bytes, cheaper)
    local = widen(problem.local_bytes, lambda k, row: (row[0] - (problem.retained_bytes[k][0] - retained[k][width]), row[1]))
    times = widen(problem.time_s, lambda k, row: (row[0] + 0.2 * rng.random(), row[1] + 0.1 * rng.random()))
    residue = widen(problem.residue_bytes, lambda k, row: (row[0], row[1]))
    forward = widen(problem.forward_bytes, lambda k, row: (row[0], row[1]))
    square = tuple(tuple(0 for _ in range(width + 2)) for _ in range(width + 2))
    errors = tuple((0.0,) * width + (rng.uniform(0.005, 0.03), rng.uniform(0.002, 0.02)) for _ in retained)
    return dataclasses.replace(
        problem,
        options=options,
        retained_bytes=retained,
        local_bytes=local,
        time_s=times,
        residue_bytes=residue,
        forward_bytes=forward,
        link_bytes=tuple(square for _ in retained),
        link_peak_bytes=tuple(square for _ in retained),
        shared=(),
        gradient_error=errors,
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 5),
    fraction=st.floats(0.0, 1.0, allow_subnormal=False),
    bound=st.sampled_from([0.0, 0.01, 0.02, 0.04, 1.0]),
)
def test_the_solvers_keep_the_gradient_error_bound_and_match_enumeration(
    seed: int, n: int, fraction: float, bound: float
) -> None:
    from remat.planner.cost import gradient_error
    from remat.planner.solvers import solve

    rng = random.Random(seed)
    problem = with_compression(random_chain(rng, n), rng)
    exact_options = [[o for o in range(len(problem.options)) if not problem.gradient_error[k][o]] for k in range(n)]
    low = min_reachable_peak(problem, exact_options)  # always reachable within any bound
    high = peak_bytes(problem, (0,) * n)
    budget = int(low + fraction * max(0, high - low))
    oracle = solve_enumerate(problem, budget, max_error=bound)
    assert gradient_error(problem, oracle.choice) <= bound
    for solution in (solve(problem, budget, "auto", max_error=bound), solve_milp(problem, budget, max_error=bound)):
        assert solution.peak_bytes <= budget
        assert solution.gradient_error == pytest.approx(gradient_error(problem, solution.choice))
        assert solution.gradient_error <= bound * (1 + 1e-9)
        assert solution.step_s == pytest.approx(oracle.step_s, rel=1e-9)
    greedy = solve_greedy(problem, budget, max_error=bound)
    assert greedy.peak_bytes <= budget and greedy.gradient_error <= bound * (1 + 1e-9)
    # Allowing compression never makes the fastest plan slower than the exact one.
    exact = solve(problem, budget, "auto", max_error=0.0)
    assert exact.gradient_error == 0.0
    assert oracle.step_s <= exact.step_s + 1e-9


def test_an_error_bound_no_plan_meets_names_the_bound() -> None:
    from remat.planner.solvers import solve

    rng = random.Random(0)
    problem = with_compression(uniform_chain(4), rng)
    exact = [[o for o in range(len(problem.options)) if not problem.gradient_error[k][o]] for k in range(4)]
    lowest_exact = min_reachable_peak(problem, exact)
    with pytest.raises(InfeasibleBudgetError, match="smallest reachable") as caught:
        solve(problem, lowest_exact - 1, max_error=0.0)
    assert caught.value.min_peak_bytes == lowest_exact
