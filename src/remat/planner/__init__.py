"""Automatic planning: the fastest checkpoint plan that fits a memory budget.

``plan(model, example_inputs, budget=...)`` profiles the model's repeated
blocks under each option (keep, checkpoint, checkpoint with a selective
policy, offload), solves for the fastest choice whose predicted peak fits,
and returns a :class:`Plan`; ``plan.apply(model)`` puts it in place and
``plan.report()`` describes it. Design: ``docs/design/planner.md``.

Layers, top to bottom (an import-linter contract in ``pyproject.toml``):
``_planner`` (profile once, solve, build the plan) and ``pipeline``
(:func:`plan_pipeline`: one choice per pipeline rank, from simulated ranks), ``result``
(:class:`Plan` with ``apply``/``report``/``pareto``), ``profile`` (measure
the options), ``step`` (one training step as the planner models it),
``apply``, ``render``, ``head``, ``phases``, ``ranks`` and ``timing``
(consume a plan, the planned output layer and loss, one step's windows and
their bytes, agreeing across ranks, the time model of estimated plans), ``solvers`` (torch-free, on plain data)
and ``rank_search`` (one pipeline rank's search, torch-free), ``cost``
(the peak terms, defined once), ``data`` (options, profiles, problems and
solutions) and ``budget`` (memory budgets). ``remat plan`` is
:mod:`remat.cli.plan`.

This package exports what a user calls; the solvers' tables and measured
profiles stay importable from their modules (``remat.planner.data``,
``remat.planner.cost``, ``remat.planner.solvers``).

Example:
    >>> import torch
    >>> from remat.planner import plan
    >>> model = torch.nn.Sequential(*[
    ...     torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))
    ...     for _ in range(6)])
    >>> p = plan(model, torch.randn(512, 32), budget="70%", repeats=1)
    >>> handle = p.apply(model)
    >>> model(torch.randn(512, 32)).sum().backward()
    >>> handle.remove()
"""

from remat.errors import InfeasibleBudgetError
from remat.planner._planner import Planner, plan
from remat.planner.budget import Budget
from remat.planner.data import (
    CHECKPOINT,
    CHECKPOINT_OFFLOAD,
    DEFAULT_OPTIONS,
    KEEP,
    OFFLOAD,
    SAVE_MATMULS,
    Decision,
    Option,
    ParetoPoint,
)
from remat.planner.head import Head
from remat.planner.pipeline import PipelinePlan, PipelinePlanner, RankPlan, plan_pipeline
from remat.planner.render import render_pareto_plot, render_plan
from remat.planner.result import Plan
from remat.planner.timing import DeviceRates

__all__ = [
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
