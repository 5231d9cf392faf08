"""The chain problem as a mixed-integer program, solved by HiGHS through scipy.

One binary ``z[k, o]`` per region and option, ``sum_o z[k, o] = 1``, and
a pair variable per neighbouring regions' options for the links; minimise
``sum time[k][o] z[k, o]`` subject to one row per term of
:meth:`ChainProblem.peak_bytes` (two per region, the tail, the floor), e.g.::

    sum_{j<k,o} retained[j][o] z[j,o] + sum_o local[k][o] z[k,o]
        + sum_{j>k} (sum_o residue[j][o] z[j,o] + sum_{a,b} link[j][a][b] w[j,a,b]) <= budget

Bytes are divided by the budget so that the rows are of order one for
HiGHS's tolerances; the answer is then checked with exact integers. scipy
is optional (``pip install remat[planner]``) and imported only here.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from remat.errors import UnsupportedCheckpointError
from remat.planner.model import ChainProblem, Solution
from remat.planner.solvers.dp import infeasible

__all__ = ["lp_lower_bound", "scipy_available", "solve_milp"]

_INSTALL_HINT = "install scipy with: pip install remat[planner]"


def scipy_available() -> bool:
    """Whether ``scipy.optimize.milp`` can be imported."""
    return importlib.util.find_spec("scipy") is not None


def _optimize() -> Any:
    try:
        import scipy.optimize
    except ImportError as exc:
        raise UnsupportedCheckpointError(
            f"remat.planner: the MILP solver needs scipy; {_INSTALL_HINT}, or use solver='dp'."
        ) from exc
    return scipy.optimize


def _matrices(problem: ChainProblem, budget_bytes: int) -> tuple[Any, Any, Any, Any]:
    """Objective, equality rows, peak rows and their upper bounds (bytes / budget).

    Variables: ``z[k, o]`` (one per region and option), then ``w[k, a, b]``
    for ``k >= 1`` (region ``k - 1`` runs ``a`` and region ``k`` runs ``b``),
    tied to ``z`` by ``sum_b w[k, a, b] = z[k-1, a]`` and
    ``sum_a w[k, a, b] = z[k, b]``: exact for binary ``z``, and it makes
    the links between neighbours linear. Per shared group ``g``, continuous
    ``h[g, k] >= sum_{o keeps g at k} z[k, o]`` and ``h[g, k] >= h[g, k - 1]``
    say whether a region up to ``k`` keeps it: only lower bounds are needed,
    since a larger ``h`` only tightens the peak rows.
    """
    import numpy as np

    n, width = problem.size, len(problem.options)
    pairs = max(0, n - 1) * width * width
    # Per shared group g, h[g, k] >= 1 when a region 0..k keeps it (S(k) in bytes).
    groups = len(problem.shared)
    size = n * width + pairs + groups * n
    scale = 1.0 / budget_bytes

    def z(k: int, o: int) -> int:
        return k * width + o

    def w(k: int, a: int, b: int) -> int:
        return n * width + ((k - 1) * width + a) * width + b

    def h(g: int, k: int) -> int:
        return n * width + pairs + g * n + k

    cost = np.zeros(size)
    cost[: n * width] = np.asarray(problem.time_s, dtype=float).reshape(-1)
    equal = []
    for k in range(n):
        row = np.zeros(size)
        row[[z(k, o) for o in range(width)]] = 1.0
        equal.append((row, 1.0))
    for k in range(1, n):
        for a in range(width):
            row = np.zeros(size)
            row[[w(k, a, b) for b in range(width)]] = 1.0
            row[z(k - 1, a)] = -1.0
            equal.append((row, 0.0))
        for b in range(width):
            row = np.zeros(size)
            row[[w(k, a, b) for a in range(width)]] = 1.0
            row[z(k, b)] = -1.0
            equal.append((row, 0.0))

    def residue_of(k: int, row: Any) -> None:
        for o in range(width):
            row[z(k, o)] += problem.residue_bytes[k][o] * scale
        for a in range(width):
            for b in range(width):
                if k:
                    row[w(k, a, b)] += problem.link_bytes[k][a][b] * scale

    def retained_before(k: int, row: Any) -> None:
        for j in range(k):
            for o in range(width):
                row[z(j, o)] += problem.retained_bytes[j][o] * scale

    rows, upper = [], []
    for k in range(n):
        backward = np.zeros(size)
        retained_before(k, backward)
        for o in range(width):
            backward[z(k, o)] += problem.local_bytes[k][o] * scale
        for a in range(width):
            for b in range(width):
                if k:
                    backward[w(k, a, b)] += problem.link_peak_bytes[k][a][b] * scale
        for j in range(k + 1, n):
            residue_of(j, backward)
        for g, group in enumerate(problem.shared):
            backward[h(g, k)] += group.nbytes * scale
            at_least = np.zeros(size)  # h[g, k] >= "region k keeps g", and >= h[g, k - 1]
            for o in range(width):
                if problem.keeps(k, o) >> g & 1:
                    at_least[z(k, o)] += 1.0
            at_least[h(g, k)] -= 1.0
            rows.append(at_least)
            upper.append(0.0)
            if k:
                grows = np.zeros(size)
                grows[h(g, k - 1)] += 1.0
                grows[h(g, k)] -= 1.0
                rows.append(grows)
                upper.append(0.0)
        forward = np.zeros(size)
        retained_before(k, forward)
        for o in range(width):
            forward[z(k, o)] += problem.forward_bytes[k][o] * scale
        rows += [backward, forward]
        upper += [1.0, 1.0]
    tail = np.zeros(size)
    retained_before(n, tail)
    rows.append(tail)
    upper.append(1.0 - problem.tail_bytes * scale)
    if problem.tail_after_bytes is not None and n:
        after = np.zeros(size)
        retained_before(n, after)
        for g, group in enumerate(problem.shared):
            after[h(g, n - 1)] += group.nbytes * scale
        rows.append(after)
        upper.append(1.0 - problem.tail_after_bytes * scale)
    floor = np.zeros(size)
    for j in range(n):
        residue_of(j, floor)
    rows.append(floor)
    upper.append(1.0 - problem.floor_bytes * scale)
    equal_matrix = np.vstack([row for row, _ in equal])
    equal_rhs = np.asarray([rhs for _, rhs in equal])
    return cost, (equal_matrix, equal_rhs), np.vstack(rows), np.asarray(upper)


def solve_milp(problem: ChainProblem, budget_bytes: int, *, time_limit_s: float = 30.0) -> Solution:
    """The fastest choice within ``budget_bytes`` by MILP (HiGHS); optimal unless it timed out.

    Example:
        >>> from remat.planner.model import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> solve_milp(p, 200).choice
        (1, 0)
    """
    started = time.perf_counter()
    optimize = _optimize()
    import numpy as np

    if problem.floor_bytes > budget_bytes:
        raise infeasible(problem, budget_bytes)
    width = len(problem.options)
    # HiGHS accepts rows that overshoot by its feasibility tolerance; shrink
    # the budget by the overshoot and solve again until exact integers agree.
    target = budget_bytes
    for _ in range(3):
        cost, (equal, rhs), peak, upper = _matrices(problem, target)
        integrality = np.zeros_like(cost)
        integrality[: problem.size * width] = 1.0  # the pair variables follow
        result = optimize.milp(
            cost,
            constraints=[
                optimize.LinearConstraint(equal, rhs, rhs),
                optimize.LinearConstraint(peak, -np.inf, upper),
            ],
            integrality=integrality,
            bounds=optimize.Bounds(0.0, 1.0),
            options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9},
        )
        if result.x is None:
            raise infeasible(problem, budget_bytes)
        choice = tuple(
            int(np.argmax(result.x[k * width : (k + 1) * width])) for k in range(problem.size)
        )
        overshoot = problem.peak_bytes(choice) - budget_bytes
        if overshoot <= 0:
            gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
            return Solution(
                choice=choice,
                peak_bytes=problem.peak_bytes(choice),
                step_s=problem.step_time_s(choice),
                solver="milp",
                optimal=result.status == 0,
                gap=max(0.0, gap),
                solve_s=time.perf_counter() - started,
            )
        target -= overshoot
    raise infeasible(problem, budget_bytes)


def lp_lower_bound(problem: ChainProblem, budget_bytes: int) -> float | None:
    """The LP relaxation's optimum (a lower bound on any plan's time), or None."""
    if not scipy_available():
        return None
    optimize = _optimize()

    cost, (equal, rhs), peak, upper = _matrices(problem, budget_bytes)
    result = optimize.linprog(
        cost,
        A_ub=peak,
        b_ub=upper,
        A_eq=equal,
        b_eq=rhs,
        bounds=(0.0, 1.0),
        method="highs",
    )
    return float(result.fun) + problem.base_time_s if result.status == 0 else None
