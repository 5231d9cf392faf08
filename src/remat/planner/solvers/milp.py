"""The chain problem as a mixed-integer program, solved by HiGHS through scipy.

Variables: a binary ``z[k, o]`` per region and option (region ``k`` runs
option ``o``); for ``k >= 1`` a pair variable ``w[k, a, b]`` (region ``k - 1``
runs ``a`` and region ``k`` runs ``b``), which makes the links between
neighbours linear; per shared group ``g`` a continuous ``h[g, k]`` (a region
up to ``k`` keeps ``g``). Minimise ``sum time[k][o] z[k, o]`` subject to
these rows, each named::

    one_option[k]      sum_o z[k, o] = 1
    pair_from[k,a]     sum_b w[k, a, b] = z[k-1, a]        exact for binary z
    pair_to[k,b]       sum_a w[k, a, b] = z[k, b]
    kept[g,k]          sum_{o keeps g at k} z[k, o] <= h[g, k]
    kept_since[g,k]    h[g, k-1] <= h[g, k]
    backward[k], forward[k], tail, after_model, floor
                       one row per peak term of remat.planner.cost: its
                       spans over z, w and h <= budget - its constant
    gradient_error     sum e[k][o]^2 z[k, o] <= max_error^2, when options
                       compress (remat.planner.cost.gradient_error)

Ties (``docs/design/planner.md``, "Ties"): the program is solved again one
byte below the fastest plan's peak; when the answer there is slower than
the tie allows, no tied plan has fewer bytes (most often). Else a second
program takes the fastest time found, adds a variable ``m`` for the peak,
turns each peak row into ``term - m <= -constant`` and adds the row::

    step_time          sum time[k][o] z[k, o] <= tied time - base time

and minimises ``m``: the fewest bytes among the plans tied with the
fastest; the first program at that peak then gives the fastest of them.
Solves, not a bytes penalty on the first objective: the tie is a bound on
time, which a weighted sum cannot state, and a penalty small enough never
to buy bytes with time would sit below HiGHS's own tolerances.

Only lower bounds on ``h`` are needed: a larger ``h`` only tightens the peak
rows. Bytes are divided by the budget so that the rows are of order one for
HiGHS's tolerances; the answer is then checked with exact integers. scipy
is optional (``pip install remat[planner]``) and imported only here. HiGHS
runs with the process's standard output sent to the null device
(:func:`remat._silence.silenced`): its C++ writes some lines straight to
descriptor 1 whatever scipy's ``disp=False`` says (on some chains of 192
blocks, ``HighsMipSolverData::transformNewIntegerFeasibleSolution
tmpSolver.run();``), and it flushes them, so none is left to appear after
the descriptor is back (``tests/planner/test_solvers.py`` captures
descriptor 1 on such a chain).
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from remat._silence import silenced
from remat.errors import UnsupportedCheckpointError
from remat.planner.cost import (
    OPTION_TABLES,
    PAIR_TABLES,
    PeakTerm,
    gradient_error,
    option_table,
    pair_table,
    peak_bytes,
    peak_terms,
    step_time_s,
    tied_time_s,
)
from remat.planner.data import ChainProblem, Solution
from remat.planner.solvers.dp import infeasible, within

__all__ = ["Program", "Row", "lp_lower_bound", "scipy_available", "solve_milp"]

_INSTALL_HINT = "install scipy with: pip install remat[planner]"


def scipy_available() -> bool:
    """Whether ``scipy.optimize.milp`` can be imported."""
    return importlib.util.find_spec("scipy") is not None


def _scipy() -> Any:
    try:
        import scipy.optimize
        import scipy.sparse
    except ImportError as exc:
        raise UnsupportedCheckpointError(
            f"remat.planner: the MILP solver needs scipy; {_INSTALL_HINT}, or use solver='dp'."
        ) from exc
    return scipy


@dataclass(frozen=True)
class Row:
    """One named constraint: ``low <= sum(coefficients[v] * x[v]) <= high``."""

    label: str
    coefficients: dict[int, float] = field(hash=False)
    low: float
    high: float

    def value(self, x: Sequence[float]) -> float:
        """The row's sum at the point ``x``."""
        return math.fsum(c * x[v] for v, c in self.coefficients.items())


class Program:
    """The MILP of one chain problem and budget: variables, objective, named rows.

    Example:
        >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> [row.label for row in Program(p, 200).rows]     # doctest: +NORMALIZE_WHITESPACE
        ['one_option[0]', 'one_option[1]', 'pair_from[1,0]', 'pair_from[1,1]', 'pair_to[1,0]',
         'pair_to[1,1]', 'backward[0]', 'forward[0]', 'backward[1]', 'forward[1]', 'tail', 'floor']
    """

    def __init__(
        self,
        problem: ChainProblem,
        budget_bytes: int,
        max_error: float | None = None,
        *,
        time_cap_s: float | None = None,
    ) -> None:
        self.problem = problem
        n, width = problem.size, len(problem.options)
        self._pairs_at = n * width
        self._held_at = self._pairs_at + max(0, n - 1) * width * width
        self.variables = self._held_at + len(problem.shared) * n
        self.integral = n * width  # the z; w and h follow and are continuous
        self.scale = 1.0 / budget_bytes
        # With time_cap_s, the tie's program: minimise the peak m (the last variable).
        self.peak = self.variables if time_cap_s is not None else None
        if self.peak is not None:
            self.variables += 1
        self.objective = [0.0] * self.variables
        for k, row in enumerate(problem.time_s):
            for o, seconds in enumerate(row):
                self.objective[self.z(k, o)] = seconds if self.peak is None else 0.0
        if self.peak is not None:
            self.objective[self.peak] = 1.0
        self.rows: list[Row] = [*self._choice_rows(), *self._held_rows()]
        self.rows += [self._term_row(term) for term in peak_terms(problem)]
        if max_error is not None and problem.approximate:
            self.rows.append(self._error_row(max_error))
        if time_cap_s is not None:
            self.rows.append(self._time_row(time_cap_s))

    def z(self, k: int, o: int) -> int:
        return k * len(self.problem.options) + o

    def w(self, k: int, a: int, b: int) -> int:
        width = len(self.problem.options)
        return self._pairs_at + ((k - 1) * width + a) * width + b

    def h(self, g: int, k: int) -> int:
        return self._held_at + g * self.problem.size + k

    def _choice_rows(self) -> list[Row]:
        n, width = self.problem.size, len(self.problem.options)
        rows = [
            Row(f"one_option[{k}]", {self.z(k, o): 1.0 for o in range(width)}, 1.0, 1.0)
            for k in range(n)
        ]
        for k in range(1, n):
            for a in range(width):
                ties = {self.w(k, a, b): 1.0 for b in range(width)}
                rows.append(Row(f"pair_from[{k},{a}]", {**ties, self.z(k - 1, a): -1.0}, 0.0, 0.0))
            for b in range(width):
                ties = {self.w(k, a, b): 1.0 for a in range(width)}
                rows.append(Row(f"pair_to[{k},{b}]", {**ties, self.z(k, b): -1.0}, 0.0, 0.0))
        return rows

    def _held_rows(self) -> list[Row]:
        problem = self.problem
        rows = []
        for g in range(len(problem.shared)):
            for k in range(problem.size):
                keeps = {
                    self.z(k, o): 1.0
                    for o in range(len(problem.options))
                    if problem.keeps(k, o) >> g & 1
                }
                rows.append(Row(f"kept[{g},{k}]", {**keeps, self.h(g, k): -1.0}, -math.inf, 0.0))
                if k:
                    since = {self.h(g, k - 1): 1.0, self.h(g, k): -1.0}
                    rows.append(Row(f"kept_since[{g},{k}]", since, -math.inf, 0.0))
        return rows

    def _term_row(self, term: PeakTerm) -> Row:
        """The peak term as a row: its spans over z, w and h, scaled by the budget."""
        problem, scale = self.problem, self.scale
        width = len(problem.options)
        coefficients: dict[int, float] = {}

        def add(variable: int, nbytes: int) -> None:
            if nbytes:
                coefficients[variable] = coefficients.get(variable, 0.0) + nbytes * scale

        for span in term.spans:
            if span.table in OPTION_TABLES:
                entries = option_table(problem, span.table)
                for k in range(span.start, span.stop):
                    for o in range(width):
                        add(self.z(k, o), entries[k][o])
            elif span.table in PAIR_TABLES:
                pairs = pair_table(problem, span.table)
                for k in range(max(1, span.start), span.stop):
                    for a in range(width):
                        for b in range(width):
                            add(self.w(k, a, b), pairs[k][a][b])
            else:  # "held": h[g, k] says whether a region 0..k keeps group g
                assert span.start == 0, f"remat bug: a held span from region {span.start}"
                for g, group in enumerate(problem.shared):
                    if span.stop:
                        add(self.h(g, span.stop - 1), group.nbytes)
        if self.peak is not None:  # term <= m, m <= 1 (its bound): the budget still holds
            coefficients[self.peak] = -1.0
            return Row(term.label, coefficients, -math.inf, -term.constant * scale)
        return Row(term.label, coefficients, -math.inf, 1.0 - term.constant * scale)

    def _time_row(self, time_cap_s: float) -> Row:
        """``step_time``: the regions' time at most the tied time less the time outside them,
        divided by the tied time (order one)."""
        problem = self.problem
        scale = 1.0 / time_cap_s if time_cap_s > 0 else 1.0
        coefficients = {
            self.z(k, o): seconds * scale
            for k, row in enumerate(problem.time_s)
            for o, seconds in enumerate(row)
            if seconds
        }
        return Row("step_time", coefficients, -math.inf, (time_cap_s - problem.base_time_s) * scale)

    def _error_row(self, max_error: float) -> Row:
        """``gradient_error``: the squared errors of the chosen options, at most ``max_error`` squared
        (:func:`remat.planner.cost.gradient_error`), scaled to order one."""
        largest = max(error for row in self.problem.gradient_error for error in row)
        # Of order one: divided by the bound, or (bound 0: exact options only) by the largest error.
        scale = max_error * max_error if max_error > 0 else largest * largest
        coefficients = {
            self.z(k, o): error * error / scale
            for k, row in enumerate(self.problem.gradient_error)
            for o, error in enumerate(row)
            if error
        }
        return Row("gradient_error", coefficients, -math.inf, 1.0 if max_error > 0 else 0.0)

    def point(self, choice: Sequence[int]) -> list[float]:
        """The variables' values that stand for ``choice``."""
        problem = self.problem
        x = [0.0] * self.variables
        for k, o in enumerate(choice):
            x[self.z(k, o)] = 1.0
            if k:
                x[self.w(k, choice[k - 1], o)] = 1.0
        for g in range(len(problem.shared)):
            held = 0.0
            for k, o in enumerate(choice):
                held = max(held, float(problem.keeps(k, o) >> g & 1))
                x[self.h(g, k)] = held
        if self.peak is not None:
            x[self.peak] = peak_bytes(problem, choice) * self.scale
        return x

    def matrices(self) -> tuple[Any, Any, Any, Any, Any, Any]:
        """Objective, equality rows and right-hand side, inequality rows and bounds (sparse)."""
        sparse = _scipy().sparse
        import numpy as np

        def stack(rows: list[Row]) -> Any:
            data, columns, starts = [], [], [0]
            for row in rows:
                columns += list(row.coefficients)
                data += list(row.coefficients.values())
                starts.append(len(columns))
            return sparse.csr_array(
                (np.asarray(data, dtype=float), np.asarray(columns, dtype=np.int64), starts),
                shape=(len(rows), self.variables),
            )

        equal = [row for row in self.rows if row.low == row.high]
        upper = [row for row in self.rows if row.low != row.high]
        return (
            np.asarray(self.objective),
            stack(equal),
            np.asarray([row.high for row in equal]),
            stack(upper),
            np.asarray([row.low for row in upper]),
            np.asarray([row.high for row in upper]),
        )


def solve_milp(
    problem: ChainProblem, budget_bytes: int, *, time_limit_s: float = 30.0, max_error: float | None = None
) -> Solution:
    """The fastest choice within ``budget_bytes`` by MILP (HiGHS); optimal unless it timed out.
    Of the choices tied with it in time, the one with the fewest peak bytes, by further
    solves (the module docstring; ``docs/design/planner.md``, "Ties").

    ``max_error`` bounds the choice's predicted gradient error (a row of its own).

    Example:
        >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> solve_milp(p, 200).choice
        (1, 0)
    """
    started = time.perf_counter()
    if problem.floor_bytes > budget_bytes:
        raise infeasible(problem, budget_bytes)
    found = _solve_program(problem, budget_bytes, time_limit_s, max_error, None)
    if found is None:
        raise infeasible(problem, budget_bytes, within(problem, max_error))
    choice, optimal, gap = found
    bound = tied_time_s(problem, step_time_s(problem, choice))
    # Most often nothing ties: the fastest plan just below this peak is slower
    # than the tie allows, which the first program (quicker than the second)
    # tells. Else the second program, then the fastest at its peak.
    below = _solve_program(problem, peak_bytes(problem, choice) - 1, time_limit_s, max_error, None)
    if below is not None and _fewer_bytes(problem, below[0], choice, bound):
        choice = below[0]
        answers = [below]
        tied = _solve_program(problem, peak_bytes(problem, choice), time_limit_s, max_error, bound)
        if tied is not None:
            answers.append(tied)
            if _fewer_bytes(problem, tied[0], choice, bound):
                choice = tied[0]
        fastest = _solve_program(problem, peak_bytes(problem, choice), time_limit_s, max_error, None)
        if fastest is not None:
            answers.append(fastest)
            if _fewer_bytes(problem, fastest[0], choice, bound, or_equal=True):
                choice = fastest[0]
        optimal = optimal and all(answer[1] for answer in answers)
        gap = max(gap, *(answer[2] for answer in answers))
    return Solution(
        choice=choice,
        peak_bytes=peak_bytes(problem, choice),
        step_s=step_time_s(problem, choice),
        solver="milp",
        optimal=optimal,
        gap=gap,
        solve_s=time.perf_counter() - started,
        gradient_error=gradient_error(problem, choice),
    )


def _fewer_bytes(
    problem: ChainProblem, other: tuple[int, ...], choice: tuple[int, ...], bound: float, *, or_equal: bool = False
) -> bool:
    """Whether ``other`` ties (step time at most ``bound``, checked in exact arithmetic, not
    within HiGHS's tolerance) and beats ``choice``: fewer bytes, or (``or_equal``) as few
    and less time."""
    step_s = step_time_s(problem, other)
    if step_s > bound:
        return False
    mine = (peak_bytes(problem, other), step_s)
    theirs = (peak_bytes(problem, choice), step_time_s(problem, choice))
    return mine < theirs if or_equal else mine[0] < theirs[0]


def _solve_program(
    problem: ChainProblem,
    budget_bytes: int,
    time_limit_s: float,
    max_error: float | None,
    time_cap_s: float | None,
) -> tuple[tuple[int, ...], bool, float] | None:
    """One program's answer ``(choice, optimal, gap)`` within ``budget_bytes`` (checked in exact
    integers), or None: the fastest choice, or with ``time_cap_s`` the fewest bytes of those at
    most that slow."""
    optimize = _scipy().optimize
    import numpy as np

    width = len(problem.options)
    # HiGHS accepts rows that overshoot by its feasibility tolerance; shrink
    # the budget by the overshoot and solve again until exact integers agree.
    if budget_bytes <= 0 or problem.floor_bytes > budget_bytes:
        return None
    target = budget_bytes
    for _ in range(3):
        program = Program(problem, target, max_error, time_cap_s=time_cap_s)
        cost, equal, rhs, rows, low, high = program.matrices()
        integrality = np.zeros_like(cost)
        integrality[: program.integral] = 1.0
        with silenced(1):  # HiGHS prints to fd 1 whatever disp says (see the module docstring)
            result = optimize.milp(
                cost,
                constraints=[
                    optimize.LinearConstraint(equal, rhs, rhs),
                    optimize.LinearConstraint(rows, low, high),
                ],
                integrality=integrality,
                bounds=optimize.Bounds(0.0, 1.0),
                options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9, "disp": False},
            )
        if result.x is None:
            return None
        choice = tuple(
            int(np.argmax(result.x[k * width : (k + 1) * width])) for k in range(problem.size)
        )
        overshoot = peak_bytes(problem, choice) - budget_bytes
        if max_error is not None and gradient_error(problem, choice) > max_error:
            return None  # within HiGHS's tolerance, not ours
        if overshoot <= 0:
            gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
            return choice, result.status == 0, max(0.0, gap)
        target -= overshoot
        if target <= 0:
            return None
    return None


def lp_lower_bound(problem: ChainProblem, budget_bytes: int) -> float | None:
    """The LP relaxation's optimum (a lower bound on any plan's time), or None."""
    if not scipy_available():
        return None
    optimize = _scipy().optimize

    cost, equal, rhs, rows, _, high = Program(problem, budget_bytes).matrices()
    result = optimize.linprog(
        cost,
        A_ub=rows,
        b_ub=high,
        A_eq=equal,
        b_eq=rhs,
        bounds=(0.0, 1.0),
        method="highs",
    )
    return float(result.fun) + problem.base_time_s if result.status == 0 else None
