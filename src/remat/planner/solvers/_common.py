"""What every solver shares: the error naming the smallest reachable peak."""

from __future__ import annotations

from remat.errors import CheckpointUsageError
from remat.planner.model import format_bytes

__all__ = ["InfeasibleBudget"]


class InfeasibleBudget(CheckpointUsageError):
    """No plan fits the budget; ``min_peak_bytes`` is the smallest reachable peak."""

    def __init__(self, message: str, *, budget_bytes: int = 0, min_peak_bytes: int = 0) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes

    @classmethod
    def for_peak(cls, budget_bytes: int, min_peak_bytes: int) -> InfeasibleBudget:
        """The error for ``budget_bytes`` when no plan goes below ``min_peak_bytes``.

        Solvers raise it through :func:`remat.planner.solvers.dp.infeasible`,
        which computes the smallest reachable peak.
        """
        return cls(
            f"remat.planner: no plan keeps the peak within the budget of "
            f"{format_bytes(budget_bytes)} ({budget_bytes} bytes); the smallest reachable "
            f"peak is {format_bytes(min_peak_bytes)} ({min_peak_bytes} bytes). Raise the budget "
            "to at least that, shrink the batch or sequence, or offer more options (offload on "
            "an accelerator).",
            budget_bytes=budget_bytes,
            min_peak_bytes=min_peak_bytes,
        )
