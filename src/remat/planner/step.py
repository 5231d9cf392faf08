"""One training step as the planner models it, and what a profile depends on.

Shared by the profiler (:mod:`~remat.planner.profile`), the plan's own
measurement (:meth:`~remat.planner.Plan.verify`) and the command line:
the step is ``loss_fn(model(*inputs)).backward()`` (or the planned head's
loss), and its peak counts the memory of the device the model is on.

Example:
    >>> import torch
    >>> from remat.planner.step import run_step
    >>> layer = torch.nn.Linear(4, 4)
    >>> run_step(layer, (torch.randn(2, 4),))
    >>> layer.weight.grad is not None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from remat._compat.pytree import tree_flatten
from remat.errors import CheckpointUsageError
from remat.planner.head import Head

__all__ = ["LossFn", "counted_device", "default_loss", "input_key", "run_step"]

LossFn = Callable[[Any], Tensor]
"""Turns the model's output into the scalar loss of a training step."""


def default_loss(output: Any) -> Tensor:
    """Sum of every floating-point tensor in the output (the default ``loss_fn``).

    Example:
        >>> import torch
        >>> default_loss((torch.ones(2), torch.ones(3))).item()
        5.0
    """
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    if not leaves:
        raise CheckpointUsageError(
            "remat.planner: the model's output holds no floating-point tensor to build a loss "
            "from; pass loss_fn=... (e.g. lambda logits: F.cross_entropy(logits, targets))."
        )
    total = leaves[0].sum()
    for leaf in leaves[1:]:
        total = total + leaf.sum()
    return total


def run_step(
    model: nn.Module,
    inputs: Sequence[Any],
    loss_fn: LossFn = default_loss,
    *,
    head: Head | None = None,
    chunks: int = 1,
    on_forward_end: Callable[[], None] | None = None,
    on_model_end: Callable[[], None] | None = None,
) -> None:
    """One training step as the planner models it: ``loss_fn(model(*inputs)).backward()``.

    With a ``head``, the loss is ``head.step_loss(model, inputs, chunks)``
    (the head's output layer and loss in ``chunks`` slices) and ``loss_fn``
    is not used. The output is not kept past the loss, as in a training
    loop; what the plan's peak refers to is this step's own allocations
    (activations, gradients, temporaries), counted like :func:`remat.memory.track`.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(4, 4)
        >>> run_step(layer, (torch.randn(2, 4),))
        >>> layer.weight.grad is not None
        True
    """
    if head is None:
        output = model(*inputs)
        if on_model_end is not None:
            on_model_end()
        loss = loss_fn(output)
        del output  # the loss's graph keeps what it needs
    else:
        loss = head.step_loss(model, inputs, chunks)
    if on_forward_end is not None:
        on_forward_end()
    loss.backward()  # type: ignore[no-untyped-call]


def input_key(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """What a profile depends on: shapes, dtypes and devices of the input tensors.

    Example:
        >>> import torch
        >>> input_key((torch.zeros(2, 3),))
        (((2, 3), 'torch.float32', 'cpu'),)
    """
    return tuple(
        (tuple(leaf.shape), str(leaf.dtype), str(leaf.device))
        if isinstance(leaf, Tensor)
        else type(leaf).__name__
        for leaf in tree_flatten(list(inputs))[0]
    )


def counted_device(model: nn.Module) -> str | None:
    """The device type whose memory a budget is about: the accelerator the model is on.

    ``None`` (every device) on the CPU. On an accelerator only its memory
    counts, so an offloaded region's host copies do not count against the
    budget they were moved out of.

    Example:
        >>> import torch
        >>> counted_device(torch.nn.Linear(2, 2)) is None
        True
    """
    for parameter in model.parameters():
        if parameter.device.type not in ("cpu", "meta"):
            return parameter.device.type
    return None
