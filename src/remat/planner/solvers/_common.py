"""What every solver shares: the smallest reachable peak and the error naming it."""

from __future__ import annotations

from remat.errors import CheckpointUsageError
from remat.planner.model import ChainProblem, format_bytes

__all__ = ["InfeasibleBudget", "min_reachable_peak"]


class InfeasibleBudget(CheckpointUsageError):
    """No plan fits the budget; ``min_peak_bytes`` is the smallest reachable peak."""

    def __init__(self, message: str, *, budget_bytes: int = 0, min_peak_bytes: int = 0) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes

    @classmethod
    def for_problem(cls, problem: ChainProblem, budget_bytes: int) -> InfeasibleBudget:
        """The error for ``budget_bytes``, naming the smallest peak any plan reaches."""
        low = min_reachable_peak(problem)
        return cls(
            f"remat.planner: no plan keeps the peak within the budget of "
            f"{format_bytes(budget_bytes)} ({budget_bytes} bytes); the smallest reachable "
            f"peak is {format_bytes(low)} ({low} bytes). Raise the budget to at least that, "
            "shrink the batch or sequence, or offer more options (offload on an accelerator).",
            budget_bytes=budget_bytes,
            min_peak_bytes=low,
        )


def min_reachable_peak(problem: ChainProblem) -> int:
    """The smallest predicted peak of any choice.

    Example:
        >>> from remat.planner.model import KEEP, CHECKPOINT, ChainProblem
        >>> p = ChainProblem((KEEP, CHECKPOINT), ((100, 10),) * 2, ((150, 110),) * 2,
        ...                  ((1.0, 1.5),) * 2, 0, 0)
        >>> min_reachable_peak(p)
        120
    """
    from remat.planner.solvers.dp import min_peak_choice

    return problem.peak_bytes(min_peak_choice(problem))
