"""What ``remat.planner`` exports: what users call, not solver tables or records."""

from __future__ import annotations

import pytest
import torch

import remat.planner
import remat.planner.solvers
from remat.errors import CheckpointTypeError, CheckpointUsageError, InfeasibleBudgetError
from remat.planner import Budget, Planner


def test_the_planner_exports_what_users_call() -> None:
    assert remat.planner.__all__ == [
        "Budget",
        "CHECKPOINT",
        "CHECKPOINT_OFFLOAD",
        "DEFAULT_OPTIONS",
        "Decision",
        "DeviceRates",
        "Head",
        "InfeasibleBudgetError",
        "KEEP",
        "OFFLOAD",
        "Option",
        "ParetoPoint",
        "PipelinePlan",
        "PipelinePlanner",
        "Plan",
        "Planner",
        "RankPlan",
        "SAVE_MATMULS",
        "plan",
        "plan_pipeline",
        "render_pareto_plot",
        "render_plan",
    ]
    for name in remat.planner.__all__:
        assert getattr(remat.planner, name) is not None, name
    assert remat.planner.InfeasibleBudgetError is InfeasibleBudgetError
    assert issubclass(InfeasibleBudgetError, CheckpointUsageError)


def test_the_solvers_export_the_solvers() -> None:
    assert remat.planner.solvers.__all__ == [
        "SolverName",
        "min_peak_choice",
        "min_reachable_peak",
        "pareto_front",
        "solve",
        "solve_dp",
        "solve_enumerate",
        "solve_greedy",
        "solve_milp",
    ]


class _Broken(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the budget is checked before the model runs")


def test_a_bad_budget_is_refused_before_profiling() -> None:
    planner = Planner(_Broken(), repeats=1)
    with pytest.raises(CheckpointTypeError, match="a float is ambiguous"):
        planner.plan(torch.randn(2, 4), budget=0.5)
    with pytest.raises(CheckpointUsageError, match="not both"):
        planner.plan(torch.randn(2, 4), budget=Budget.of_bytes(10), fraction=0.5)


def test_a_budget_value_plans_like_its_text() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))
        for _ in range(4)
    ])
    planner = Planner(model, repeats=1)
    x = torch.randn(256, 32)
    by_text = planner.plan(x, budget="70%")
    assert planner.plan(x, budget=Budget.fraction(0.7)).decisions == by_text.decisions
    assert planner.plan(x, budget=Budget.of_bytes(by_text.budget_bytes)).budget_bytes == (
        by_text.budget_bytes
    )
