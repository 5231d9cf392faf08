"""Track one steady-state training step of any model: forward, backward, optimizer.

:func:`track_training_step` runs one untracked step (which creates the
optimizer's state) and tracks the second: the steady state of training.
Meant for models whose tensors have no data (on the ``meta`` device, or
fake tensors, as :func:`remat.memory.estimate_sharded_step` makes them), so
that a 7B-parameter step is counted while nothing is allocated; it works on
any device. See ``docs/design/memory.md`` ("Estimating on meta tensors").

:func:`measure_training_step` measures the same steady-state step for real,
with the allocator's count (:func:`remat.memory.track_allocations`): the
answer for compiled models, whose buffers no dispatch mode sees and whose
kernels run on real tensors only (``docs/design/memory.md``, "Compiled code").

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
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from remat._compat.dispatch import wrapped_tensors
from remat.errors import CheckpointUsageError
from remat.memory._allocations import track_allocations
from remat.memory._report import MemoryReport
from remat.memory._tracker import FORWARD_END, track

__all__ = ["Optimizer", "StepBytes", "measure_training_step", "track_training_step"]

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
    step = _TrainingStep(model, loss, optimizer, on_step, "track_training_step")
    if step.optimizer is not None:
        step()  # creates the optimizer state: track the steady state, not the first step
    with track(model, optimizer=step.optimizer) as tracker:
        step(tracker)
    return tracker.report()


@dataclass(frozen=True)
class AllocatedStep:
    """What the allocator counts of a step: the bytes resident when it starts and its own peak.

    Attributes:
        resident_bytes: parameters, buffers and optimizer state when the
            step starts (every distinct storage, counted once).
        step_peak_bytes: the step's own allocations at their peak (the
            allocator's count above the start).
    """

    resident_bytes: int
    step_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Resident bytes plus the step's peak: the most the step holds at once."""
        return self.resident_bytes + self.step_peak_bytes


@dataclass(frozen=True)
class StepBytes(AllocatedStep):
    """A training step measured by the allocator (:func:`measure_training_step`).

    Attributes:
        resident_bytes: as :class:`AllocatedStep`.
        step_peak_bytes: as :class:`AllocatedStep`.
        forward_end_bytes: resident plus the step's own bytes at the end of
            the forward.
    """

    forward_end_bytes: int


def measure_training_step(
    model: nn.Module,
    loss: Callable[[], Tensor],
    *,
    optimizer: Optimizer = "adamw",
    device: str | None = None,
    warmup: int = 2,
) -> StepBytes:
    """Measure one steady-state training step for real, with the allocator's count.

    ``warmup`` untracked steps run first: they create the optimizer's state
    and, for a compiled model, compile it (and recompile what its first
    step's state asks for). Then one step under
    :func:`remat.memory.track_allocations` (``device``: only that device
    type's allocations). Use it where :func:`track_training_step` cannot
    see: compiled models (inductor's buffers), on a model small enough to run.

    Example:
        >>> import torch
        >>> from remat.memory import measure_training_step
        >>> layer = torch.nn.Linear(256, 256)
        >>> x = torch.randn(64, 256)
        >>> measured = measure_training_step(layer, lambda: layer(x).square().sum(), optimizer="sgd")
        >>> measured.resident_bytes                    # weight and bias
        263168
        >>> measured.forward_end_bytes - measured.resident_bytes   # the output (square saves it), the loss
        65540
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise CheckpointUsageError(f"measure_training_step: warmup must be an int >= 1, got {warmup!r}.")
    step = _TrainingStep(model, loss, optimizer, None, "measure_training_step")
    for _ in range(warmup):
        step()
    resident = resident_bytes(model, step.optimizer)
    with track_allocations(device, quiet=True) as meter:
        step(meter)
    return StepBytes(resident, meter.peak_bytes, resident + meter.marks[FORWARD_END])


class _TrainingStep:
    """``loss()``, backward, the optimizer's step, gradients dropped: one training step."""

    def __init__(
        self,
        model: nn.Module,
        loss: Callable[[], Tensor],
        optimizer: Optimizer,
        on_step: Callable[[], None] | None,
        api: str,
    ) -> None:
        if optimizer not in ("adamw", "sgd", "none"):
            raise CheckpointUsageError(
                f"{api}: optimizer must be 'adamw', 'sgd' or 'none', got {optimizer!r}."
            )
        self.model, self.loss, self.on_step = model, loss, on_step
        self.optimizer = _make_optimizer(model, optimizer)

    def __call__(self, meter: Any = None) -> None:
        value = self.loss()
        if meter is not None:
            meter.mark(FORWARD_END)
        torch.autograd.backward(value)
        del value
        if self.optimizer is not None:
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        if self.on_step is not None:
            self.on_step()


def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of ``model``'s parameters and buffers and ``optimizer``'s state, every
    distinct storage once: what a step starts with, which an allocator's count of the
    step does not see."""
    state = [] if optimizer is None else [value for each in optimizer.state.values() for value in each.values()]
    return _distinct_bytes([*model.parameters(), *model.buffers(), *(v for v in state if isinstance(v, Tensor))])


def _distinct_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors``: a wrapper subclass (a sharded
    parameter's ``DTensor``) by what it wraps, as the allocator sees it."""
    storages: dict[int, int] = {}
    pending = list(tensors)
    while pending:
        tensor = pending.pop()
        inner = wrapped_tensors(tensor)
        if inner is not None:
            pending.extend(inner)
            continue
        storage = tensor.untyped_storage()
        storages[id(storage)] = storage.nbytes()
    return sum(storages.values())


def _make_optimizer(model: nn.Module, optimizer: Optimizer) -> torch.optim.Optimizer | None:
    if optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), foreach=False)
    if optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    return None
