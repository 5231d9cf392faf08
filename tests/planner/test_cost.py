"""The cost model's peak terms: one definition that every solver agrees with.

``remat.planner.cost`` defines a choice's peak as labelled terms. The MILP
turns each term into a row of the same name, and the DP has its own
incremental recurrence: both are checked here against the terms, on
hand-built tables and on random problems and choices.
"""

from __future__ import annotations

import ast
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import REPO, random_chain, uniform_chain
from remat.errors import CheckpointUsageError, FrontierTooLargeError, UnsupportedCheckpointError
from remat.planner.cost import PeakTerm, Span, peak_bytes, peak_terms, step_time_s, term_bytes
from remat.planner.data import ChainProblem, SharedInput
from remat.planner.solvers import (
    min_reachable_peak,
    solve_dp,
    solve_enumerate,
    solve_milp,
)
from remat.planner.solvers.dp import dp_peak
from remat.planner.solvers.milp import Program

# The code under test imports no torch (test_cost checks it): its answers cannot change
# with the torch release, so the release matrix skips these (scripts/test-matrix.sh).
pytestmark = pytest.mark.torch_free

PLANNER = REPO / "src" / "remat" / "planner"


def masked(n: int = 3) -> ChainProblem:
    """``uniform_chain(n)`` with a 30-byte mask that checkpointed regions keep, and a split tail."""
    return uniform_chain(
        n,
        floor_bytes=5,
        shared=(SharedInput(30, takers=tuple(range(n)), kept_under=("checkpoint",)),),
        tail_after_bytes=50,
    )


def test_each_term_is_defined_once_with_a_label() -> None:
    terms = peak_terms(masked(2))
    assert [t.label for t in terms] == [
        "backward[0]", "forward[0]", "backward[1]", "forward[1]", "tail", "after_model", "floor",
    ]
    assert terms[2] == PeakTerm("backward", 1, 0, (
        Span("retained", 0, 1),
        Span("local", 1, 2),
        Span("link_peak", 1, 2),
        Span("residue", 2, 2),
        Span("link", 2, 2),
        Span("held", 0, 2),
    ))
    assert terms[-1] == PeakTerm("floor", None, 5, (Span("residue", 0, 2), Span("link", 0, 2)))
    # Without a split tail there is no "after_model" term.
    assert "after_model" not in [t.label for t in peak_terms(uniform_chain(2))]


def test_term_values_by_hand() -> None:
    problem = masked(3)
    # Region 0 checkpoints and keeps the mask until its backward: every backward
    # from there on, and the loss after the model's forward, sit on it.
    values = term_bytes(problem, (1, 0, 0))
    assert values == {
        "backward[0]": 110 + 30,
        "forward[0]": 0,
        "backward[1]": 10 + 150 + 30,
        "forward[1]": 10,
        "backward[2]": 110 + 150 + 30,
        "forward[2]": 110,
        "tail": 210,
        "after_model": 210 + 50 + 30,
        "floor": 5,
    }
    assert peak_bytes(problem, (1, 0, 0)) == max(values.values()) == 290
    assert step_time_s(problem, (1, 0, 0)) == 3.5
    with pytest.raises(CheckpointUsageError, match="one option index"):
        peak_bytes(problem, (1, 0))
    with pytest.raises(CheckpointUsageError, match="one option index"):
        peak_bytes(problem, (1, 0, 2))


def test_milp_rows_are_the_terms_by_name() -> None:
    problem = masked(2)
    program = Program(problem, 1000)
    labels = [row.label for row in program.rows]
    assert labels == [
        "one_option[0]", "one_option[1]",
        "pair_from[1,0]", "pair_from[1,1]", "pair_to[1,0]", "pair_to[1,1]",
        "kept[0,0]", "kept[0,1]", "kept_since[0,1]",
        *(term.label for term in peak_terms(problem)),
    ]
    rows = {row.label: row for row in program.rows}
    # backward[1] <= budget: retained by region 0, region 1's own peak, the mask if
    # region 0 or 1 keeps it (h[0, 1]); bytes scaled by the budget.
    assert rows["backward[1]"].coefficients == {
        program.z(0, 0): 0.1, program.z(0, 1): 0.01,
        program.z(1, 0): 0.15, program.z(1, 1): 0.11,
        program.h(0, 1): 0.03,
    }
    assert rows["floor"].high == pytest.approx(1.0 - 5 / 1000)
    assert rows["kept[0,1]"].coefficients == {program.z(1, 1): 1.0, program.h(0, 1): -1.0}


def check_against_the_terms(problem: ChainProblem, choice: tuple[int, ...]) -> None:
    """The DP's recurrence and the MILP's rows give ``choice`` the terms' values."""
    values = term_bytes(problem, choice)
    assert dp_peak(problem, choice) == peak_bytes(problem, choice) == max(values.values())
    program = Program(problem, 1)  # budget 1: the rows hold bytes unscaled
    point = program.point(choice)
    for row in program.rows:
        if row.label in values:  # a peak term: its spans' bytes, below 1 - constant
            assert row.value(point) + (1 - row.high) == pytest.approx(values[row.label]), row.label
        else:  # structural rows hold at every choice
            assert row.low - 1e-9 <= row.value(point) <= row.high + 1e-9, row.label


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5))
def test_dp_and_milp_agree_with_the_terms_on_every_choice(seed: int, n: int) -> None:
    problem = random_chain(random.Random(seed), n)
    for choice in itertools.product(range(len(problem.options)), repeat=n):
        check_against_the_terms(problem, choice)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 7),
    fraction=st.floats(0.0, 1.0, allow_subnormal=False),
)
def test_solvers_answers_are_the_terms_optimum(seed: int, n: int, fraction: float) -> None:
    rng = random.Random(seed)
    problem = random_chain(rng, n)
    low = min_reachable_peak(problem)
    budget = int(low + fraction * max(0, peak_bytes(problem, (0,) * n) - low))
    oracle = solve_enumerate(problem, budget)
    for solution in (solve_dp(problem, budget), solve_milp(problem, budget), oracle):
        assert solution.peak_bytes == peak_bytes(problem, solution.choice) <= budget
        assert solution.step_s == pytest.approx(oracle.step_s, rel=1e-9)
        check_against_the_terms(problem, solution.choice)
    # And on a few random choices of a longer chain, too long to enumerate.
    longer = random_chain(rng, 24)
    for _ in range(5):
        check_against_the_terms(longer, tuple(rng.randrange(3) for _ in range(24)))


def test_the_dp_names_its_state_cap() -> None:
    problem = random_chain(random.Random(0), 12)
    with pytest.raises(FrontierTooLargeError, match="solver='milp'") as info:
        solve_dp(problem, peak_bytes(problem, (0,) * 12), max_states=2)
    assert isinstance(info.value, UnsupportedCheckpointError)
    assert info.value.max_states == 2 and info.value.states > 2


@pytest.mark.parametrize(
    "module", ["data.py", "budget.py", "cost.py", *(f"solvers/{p.name}" for p in (PLANNER / "solvers").glob("*.py"))]
)
def test_the_data_cost_model_and_solvers_import_no_torch(module: str) -> None:
    tree = ast.parse((PLANNER / module).read_text())
    imported = {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] == "torch"}, module
