"""The reentrant variant (``use_reentrant=True``): one autograd node per region.

The forward runs under ``no_grad`` inside a custom ``autograd.Function``; its
backward reruns the function with grad enabled on detached inputs and calls
``torch.autograd.backward`` on the result (a nested, "reentrant" backward).
Its documented limits follow from that design: it only works with
``.backward()`` without ``inputs`` (the nested backward cannot honour
``torch.autograd.grad``), needs an output that requires grad, and takes no
keyword arguments. Where torch silently gives wrong gradients, remat raises or
warns, naming ``use_reentrant=False``: double backward (the nested backward
records no second-order terms), autograd called inside the function (its
forward runs under ``no_grad``), and tensors returned inside containers
(``autograd.Function`` connects only top-level tensors to the graph).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from remat._compat import is_checkpoint_valid
from remat._engine.replay import ReplayState, tensor_leaves
from remat.errors import CheckpointError

__all__ = ["ReentrantCheckpoint", "check_backward_validity", "detach_variable"]


def check_backward_validity(inputs: Iterable[Any]) -> None:
    """Warn when no tensor input requires grad (the gradients would all be None).

    Example:
        >>> import torch, remat
        >>> remat.check_backward_validity([torch.ones(1, requires_grad=True)])
    """
    if not any(isinstance(value, torch.Tensor) and value.requires_grad for value in inputs):
        warnings.warn(
            "None of the inputs have requires_grad=True. Gradients will be None",
            stacklevel=2,
        )


def detach_variable(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Detach each tensor of a tuple, keeping its ``requires_grad`` flag.

    Example:
        >>> import torch, remat
        >>> (y,) = remat.detach_variable((torch.ones(1, requires_grad=True),))
        >>> y.requires_grad, y.grad_fn is None
        (True, True)
    """
    if not isinstance(inputs, tuple):
        raise TypeError(
            "detach_variable takes a tuple of tensors (other values pass through); "
            f"got {type(inputs).__name__}"
        )
    detached = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            copy = value.detach()
            copy.requires_grad = value.requires_grad
            detached.append(copy)
        else:
            detached.append(value)
    return tuple(detached)


# DistributedDataParallel's reducer raises this when a parameter reports its
# gradient twice in one step. A reentrant region backpropagates in a nested
# backward of its own, so it does when the region's parameters are used more
# than once per step, or under find_unused_parameters=True (the forward ran
# under no_grad, so DDP already marked them unused). DDP raises a plain
# RuntimeError, hence the match on its text; docs/design/distributed.md.
_DDP_READY_TWICE = "Expected to mark a variable ready only once"


def _ddp_advice(api: str) -> str:
    return (
        f"{api}(use_reentrant=True) under DistributedDataParallel: DDP saw a parameter of "
        "this checkpointed region report its gradient twice in one step. The reentrant "
        "variant backpropagates each region in a nested backward of its own, which DDP "
        "cannot follow when the region's parameters are used more than once per step "
        "(a block checkpointed twice, shared weights) or with find_unused_parameters=True "
        "(the region's forward ran under no_grad, so DDP had marked its parameters "
        "unused). Pass use_reentrant=False (recommended; it handles both), or, for reused "
        "parameters without find_unused_parameters, construct DDP with static_graph=True."
    )


# What autograd says when backward meets a tensor without history; inside the
# reentrant forward (run under no_grad) that is every tensor, so a function that
# calls torch.autograd.grad or .backward() itself fails with it.
_NO_GRAPH = "does not require grad and does not have a grad_fn"


def _backward_inside_advice(api: str) -> str:
    return (
        f"{api}(use_reentrant=True): the checkpointed function runs autograd itself "
        "(torch.autograd.grad or .backward() inside the region), but the reentrant "
        "variant runs the forward under torch.no_grad(), so no tensor in it has a "
        "graph. Pass use_reentrant=False (recommended), which supports backward "
        "inside the checkpointed function."
    )


def _warn_on_nested_tensors(outputs: Any, api: str) -> None:
    """Warn when tensors come back inside containers: autograd.Function tracks
    only tensors returned directly (or in a top-level tuple)."""
    items = outputs if isinstance(outputs, tuple) else (outputs,)
    for item in items:
        if isinstance(item, torch.Tensor) or item is None:
            continue
        if any(isinstance(leaf, torch.Tensor) for leaf in tensor_leaves((item,))):
            from remat._source import user_stacklevel  # a warning only: keep import remat lean

            warnings.warn(
                f"{api}(use_reentrant=True) returned tensors inside a "
                f"{type(item).__name__}: the reentrant variant only connects tensors "
                "returned directly or in a tuple to the graph, so these come back without "
                "grad_fn and their gradients are lost. Pass use_reentrant=False "
                "(recommended), which supports nested outputs, or return a tuple of tensors.",
                stacklevel=user_stacklevel(),
            )
            return


class ReentrantCheckpoint(torch.autograd.Function):
    """``apply(function, preserve_rng_state, api, *args)``; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        function: Callable[..., Any],
        preserve_rng_state: bool,
        api: str,
        *args: Any,
    ) -> Any:
        check_backward_validity(args)
        ctx.function = function
        ctx.api = api
        ctx.replay = ReplayState.capture(tensor_leaves(args), preserve_rng=preserve_rng_state)
        ctx.tensor_positions = [i for i, value in enumerate(args) if isinstance(value, torch.Tensor)]
        ctx.others = [None if isinstance(value, torch.Tensor) else value for value in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        # Outputs no backward reaches get None, not zeros: a nested backward from
        # zeros would leave zero gradients where an unchecked run leaves None.
        ctx.set_materialize_grads(False)
        try:
            with torch.no_grad():
                outputs = function(*args)
        except RuntimeError as exc:
            if _NO_GRAPH in str(exc):
                raise CheckpointError(_backward_inside_advice(api)) from exc
            raise
        ctx.replay.check_device_unchanged(api)
        _warn_on_nested_tensors(outputs, api)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple[Any, ...]:
        if torch.is_grad_enabled():  # the engine enables grad only under create_graph=True
            raise CheckpointError(
                f"{ctx.api}(use_reentrant=True) does not support double backward "
                "(backward or autograd.grad with create_graph=True): its nested backward "
                "cannot record the region's second-order terms, so the gradient of the "
                "gradient would be silently wrong. Pass use_reentrant=False (recommended), "
                "which supports it."
            )
        if not is_checkpoint_valid():
            raise RuntimeError(
                f"{ctx.api}(use_reentrant=True) does not work with torch.autograd.grad() or "
                "with backward(inputs=...). Call .backward() without inputs, or pass "
                "use_reentrant=False (recommended)."
            )
        args = list(ctx.others)
        for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors, strict=True):
            args[position] = tensor
        inputs = detach_variable(tuple(args))
        with ctx.replay.restore(), torch.enable_grad():
            outputs = ctx.function(*inputs)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [
            (output, grad)
            for output, grad in zip(outputs, grad_outputs, strict=False)
            if isinstance(output, torch.Tensor) and output.requires_grad
        ]
        if not pairs:
            raise RuntimeError(
                f"{ctx.api}(use_reentrant=True): none of the outputs requires grad, so "
                "there is nothing to backpropagate through this checkpoint. Make an input "
                "require grad, or do not checkpoint this function."
            )
        pairs = [(output, grad) for output, grad in pairs if grad is not None]
        if not pairs:  # no used output requires grad: nothing flows, as without checkpoint
            return (None, None, None, *(None for _ in inputs))
        try:
            torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])
        except RuntimeError as exc:
            if _DDP_READY_TWICE in str(exc):
                raise CheckpointError(_ddp_advice(ctx.api)) from exc
            raise
        grads = tuple(value.grad if isinstance(value, torch.Tensor) else None for value in inputs)
        return (None, None, None, *grads)
