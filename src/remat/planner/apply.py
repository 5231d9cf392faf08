"""Put a plan (or one option) in place on a model's modules, reversibly.

A thin layer over :mod:`remat.placement`, the one mechanism every entry
point uses: a planner :class:`~remat.planner.data.Option` becomes a
:class:`~remat.placement.BlockSetting` (its policy looked up by name in
:mod:`remat.policies`), and a plan's decisions are placed in one call. A
planned region keeps its name and its place in the module tree; removing
the handle restores it exactly. The profiler installs options the same way,
so what was measured is what runs.

Example:
    >>> import torch
    >>> from remat.planner.apply import install
    >>> from remat.planner.data import CHECKPOINT
    >>> layer = torch.nn.Linear(4, 4)
    >>> remove = install(layer, CHECKPOINT)
    >>> layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
    >>> remove()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from remat.config import region_setting
from remat.errors import CheckpointUsageError
from remat.placement import BlockSetting, CompileSpec, Placement, place
from remat.placement import install as install_setting
from remat.planner.data import Decision, Option

__all__ = ["apply_decisions", "install", "setting_of"]


def setting_of(option: Option, compile: CompileSpec | None = None) -> BlockSetting:
    """The placement of one planner option (its name read as a saved plan's is).

    Example:
        >>> from remat import policies
        >>> from remat.planner.data import SAVE_MATMULS
        >>> setting = setting_of(SAVE_MATMULS)
        >>> setting.checkpoint, setting.policy is policies.save_matmuls
        (True, True)
    """
    return region_setting(option.name, compile=compile)


def install(module: nn.Module, option: Option, compile: CompileSpec | None = None) -> Callable[[], None]:
    """Run ``module`` under ``option`` from now on; returns a function that undoes it.

    ``keep`` installs nothing (unless ``compile``: then the module is
    compiled); see :func:`remat.placement.install` for the rest.
    A module already routed (by an applied plan) is an error: remove that
    plan first.

    Example:
        >>> import torch
        >>> from remat.planner.data import SAVE_MATMULS
        >>> layer = torch.nn.Linear(4, 4)
        >>> remove = install(layer, SAVE_MATMULS)
        >>> remove()
    """
    return install_setting(module, setting_of(option, compile))


def apply_decisions(
    decisions: Sequence[Decision], model: nn.Module, compile: CompileSpec | None = None
) -> Placement:
    """Checkpoint/offload the regions a plan chose, in place; FQNs do not change.

    Returns the :class:`~remat.placement.Placement`: ``blocks`` names the
    regions not kept, ``remove()`` (or leaving a ``with`` block) undoes it.
    :meth:`remat.planner.Plan.apply` calls it with the plan's decisions
    (and, for a plan made compiled, how its regions are compiled).

    Example:
        >>> import torch
        >>> from remat.planner.data import CHECKPOINT, KEEP, Decision
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> handle = apply_decisions([Decision("0", CHECKPOINT, 0, 0.0), Decision("1", KEEP, 0, 0.0)], model)
        >>> handle.blocks
        ('0',)
        >>> handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise CheckpointUsageError(
            f"remat.planner: apply() takes the nn.Module the plan was made for, got "
            f"{type(model).__name__}."
        )
    return place(model, [(d.region, setting_of(d.option, compile)) for d in decisions])
