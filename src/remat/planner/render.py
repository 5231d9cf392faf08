"""Plans as text, and the memory-time Pareto plot (matplotlib, optional).

Data in, text or a file out; nothing here decides anything.

Example:
    >>> from remat.planner.render import render_measurement
    >>> print(render_measurement(1_000_000, 980_000, 0.10, 0.11))
    peak: predicted 976.6 KiB, measured 957.0 KiB (-2.0%)
    step: predicted 100.0 ms, measured 110.0 ms (+10.0%)
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from remat._units import format_bytes
from remat.errors import UnsupportedCheckpointError
from remat.planner.data import ParetoPoint

if TYPE_CHECKING:
    from remat.planner.result import Plan

__all__ = ["render_measurement", "render_pareto_plot", "render_plan"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def render_plan(plan: Plan) -> str:
    """The plan as a table: one line per region, then totals and how it was found.

    Example:
        >>> text = render_plan(p)   # doctest: +SKIP
    """
    solution = plan.solution
    width = max([6, *(len(d.region) for d in plan.decisions)])
    named = max([24, *(len(d.option.name) for d in plan.decisions)])
    approximate = plan.problem.approximate
    lines = [
        f"{'region':<{width}}  {'decision':<{named}}  {'kept for backward':>17}  {'fwd+bwd':>9}"
        + ("  grad. error" if approximate else ""),
    ]
    for decision in plan.decisions:
        lines.append(
            f"{decision.region:<{width}}  {decision.option.name:<{named}}  "
            f"{format_bytes(decision.retained_bytes):>17}  {_ms(decision.time_s):>9}"
            + (f"  {decision.gradient_error:>11.2e}" if approximate else "")
        )
    counts = Counter(d.option.name for d in plan.decisions)
    status = "optimal" if solution.optimal else f"gap <= {solution.gap:.1%}"
    lines += [
        "",
        "summary: " + ", ".join(f"{name} x{count}" for name, count in sorted(counts.items())),
        f"budget {format_bytes(plan.budget_bytes)}: predicted peak "
        f"{format_bytes(plan.predicted_peak_bytes)} "
        f"({plan.predicted_peak_bytes / max(1, plan.unchecked_peak_bytes):.0%} of unchecked "
        f"{format_bytes(plan.unchecked_peak_bytes)})",
        f"predicted step {_ms(plan.predicted_step_s)} "
        f"({plan.predicted_step_s / max(1e-12, plan.unchecked_step_s):.2f}x unchecked "
        f"{_ms(plan.unchecked_step_s)})",
        f"solver {solution.solver} ({status}) in {solution.solve_s * 1e3:.1f} ms",
    ]
    if plan.estimated_with is not None:
        lines.insert(-1, f"estimated, not measured: bytes on fake tensors, times modelled at {plan.estimated_with}")
    if approximate:
        bound = "" if plan.max_gradient_error is None else f" (bound {plan.max_gradient_error:.2e})"
        measured = (
            "" if plan.measured_gradient_error is None else f", measured {plan.measured_gradient_error:.2e}"
        )
        lines.insert(-1, f"predicted gradient error {solution.gradient_error:.2e}{bound}{measured}")
    if plan.head is not None:
        how = (
            f"loss in {plan.head_chunks} slices (train with plan.loss)"
            if plan.head_chunks > 1 else "not chunked"
        )
        lines.insert(-3, f"head {plan.head.module}: {how}")
    return "\n".join(lines)


def render_measurement(
    predicted_peak_bytes: int, measured_peak_bytes: int, predicted_step_s: float, measured_step_s: float
) -> str:
    """Predicted versus measured peak and step time, with relative errors."""

    def rel(measured: float, predicted: float) -> str:
        return f"{(measured - predicted) / predicted:+.1%}" if predicted else "n/a"

    return (
        f"peak: predicted {format_bytes(predicted_peak_bytes)}, measured "
        f"{format_bytes(measured_peak_bytes)} ({rel(measured_peak_bytes, predicted_peak_bytes)})\n"
        f"step: predicted {_ms(predicted_step_s)}, measured {_ms(measured_step_s)} "
        f"({rel(measured_step_s, predicted_step_s)})"
    )


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UnsupportedCheckpointError(
            "remat.planner: drawing the Pareto plot needs matplotlib; install it with: "
            "pip install remat[plot]"
        ) from exc
    return plt


def render_pareto_plot(
    points: Sequence[ParetoPoint],
    path: str | os.PathLike[str],
    *,
    chosen: Plan | None = None,
    title: str = "remat plan: step time vs peak memory",
) -> None:
    """Draw predicted step time against peak memory for the Pareto plans, to ``path``.

    Example:
        >>> render_pareto_plot(p.pareto(), "pareto.png", chosen=p)   # doctest: +SKIP
    """
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    mib = [p.peak_bytes / 2**20 for p in points]
    ms = [p.step_s * 1e3 for p in points]
    axes.step(mib, ms, where="post", color="#4477aa", alpha=0.5)
    axes.plot(mib, ms, "o", color="#4477aa", label="fastest plan per budget")
    if chosen is not None:
        axes.plot(
            [chosen.predicted_peak_bytes / 2**20],
            [chosen.predicted_step_s * 1e3],
            "*",
            markersize=14,
            color="#ee6677",
            label="this plan",
        )
        axes.axvline(chosen.budget_bytes / 2**20, color="#ee6677", linestyle=":", label="budget")
    axes.set_xlabel("predicted peak (MiB)")
    axes.set_ylabel("predicted step time (ms)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
