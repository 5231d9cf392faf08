"""Track one steady-state training step of any model: forward, backward, optimizer.

:func:`track_training_step` runs one untracked step (which creates the
optimizer's state) and tracks the second: the steady state of training.
Meant for models whose tensors have no data (on the ``meta`` device, or
fake tensors, as :func:`remat.memory.estimate_sharded_step` makes them), so
that a 7B-parameter step is counted while nothing is allocated; it works on
any device. See ``docs/design/memory.md`` ("Estimating on meta tensors").

Example:
    >>> import torch
    >>> from remat.memory import track_training_step
    >>> with torch.device("meta"):
    ...     layer = torch.nn.Linear(1024, 1024)
    >>> x = torch.zeros(8, 1024, device="meta")
    >>> report = track_training_step(layer, lambda: layer(x).sum(), optimizer="adamw")
    >>> report.category("optimizer_state").at_end_bytes >= 2 * 1024 * 1024 * 4   # two moments
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from remat.errors import CheckpointUsageError
from remat.memory._report import MemoryReport
from remat.memory._tracker import FORWARD_END, track

__all__ = ["Optimizer", "track_training_step"]

Optimizer = Literal["adamw", "sgd", "none"]


def track_training_step(
    model: nn.Module,
    loss: Callable[[], Tensor],
    *,
    optimizer: Optimizer = "adamw",
    on_step: Callable[[], None] | None = None,
) -> MemoryReport:
    """Track one steady-state training step of any model: ``loss()``, backward, optimizer.

    ``loss`` runs the forward and returns the scalar loss. With an optimizer,
    one untracked step runs first to create its state; ``on_step`` is called
    after each step (progress). Meant for models on the meta device or with
    fake tensors, but works on any device.

    Example:
        >>> with torch.device("meta"):
        ...     layer = nn.Linear(1024, 1024)
        >>> x = torch.zeros(8, 1024, device="meta")
        >>> report = track_training_step(layer, lambda: layer(x).sum(), optimizer="sgd")
        >>> report.peak_bytes >= 2 * 1024 * 1024 * 4   # weight and its gradient
        True
    """
    if optimizer not in ("adamw", "sgd", "none"):
        raise CheckpointUsageError(
            f"track_training_step: optimizer must be 'adamw', 'sgd' or 'none', got {optimizer!r}."
        )
    step_optimizer = _make_optimizer(model, optimizer)

    def step(tracker: Any = None) -> None:
        value = loss()
        if tracker is not None:
            tracker.mark(FORWARD_END)
        torch.autograd.backward(value)
        del value
        if step_optimizer is not None:
            step_optimizer.step()
        model.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step()

    if step_optimizer is not None:
        step()  # creates the optimizer state: track the steady state, not the first step
    with track(model, optimizer=step_optimizer) as tracker:
        step(tracker)
    return tracker.report()


def _make_optimizer(model: nn.Module, optimizer: Optimizer) -> torch.optim.Optimizer | None:
    if optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), foreach=False)
    if optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    return None
