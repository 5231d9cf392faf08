"""Losses over a model's output layer in chunks, so its full output never exists at once.

Layer: a front-end beside :mod:`remat.nn` and :mod:`remat.composable` (it runs
each chunk through :func:`remat.checkpoint.run_checkpoint`).

A language model's head turns hidden states ``[batch, seq, d]`` into logits
``[batch, seq, vocab]``; with a large vocabulary those logits, the
log-softmax the loss saves and their gradients are the largest tensors of a
training step, larger than every block's activations together once the
blocks are checkpointed. :func:`chunked_loss` computes the head and the loss
one slice of positions at a time, each slice under a checkpoint: the forward
keeps only the hidden states, and the backward recomputes one slice's logits
at a time. The price is one more forward of the head. The planner offers it
as the head's option (``remat.planner.Head``); ``docs/design/planner.md``
("The head") says how it is measured.

:func:`chunked_head_loss` runs a whole model that way without editing its
``forward``: the head module is skipped (it returns a zero-stride
placeholder of the right shape), its input is captured, and the chunked loss
is computed from it.

Example:
    >>> import torch
    >>> from remat.losses import chunked_loss
    >>> head = torch.nn.Linear(16, 100, bias=False)
    >>> hidden = torch.randn(2, 8, 16, requires_grad=True)
    >>> targets = torch.randint(0, 100, (2, 8))
    >>> loss = chunked_loss(head, hidden, targets, chunks=4)
    >>> full = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), targets.flatten())
    >>> bool(torch.allclose(loss, full))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remat._compat.autograd import base_of
from remat.checkpoint import run_checkpoint
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.options import CheckpointOptions

__all__ = ["TokenLoss", "chunked_head_loss", "chunked_loss"]

TokenLoss = Callable[[Tensor, Tensor], Tensor]
"""``(outputs of one chunk, its targets) -> that chunk's summed loss``; chunks add up."""

_OPTIONS = CheckpointOptions(api="remat.chunked_loss")


def _summed_cross_entropy(ignore_index: int) -> TokenLoss:
    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(
            logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="sum"
        )

    return loss


def _check(hidden: Any, targets: Any, chunks: Any, dim: int, api: str) -> int:
    """Validate; return the normalized ``dim``."""
    if not isinstance(hidden, Tensor) or not isinstance(targets, Tensor):
        raise CheckpointTypeError(
            f"{api}: hidden and targets must be tensors, got {type(hidden).__name__} and "
            f"{type(targets).__name__}."
        )
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise CheckpointUsageError(f"{api}: chunks must be an int >= 1, got {chunks!r}.")
    if not -hidden.dim() <= dim < hidden.dim() or dim % hidden.dim() == hidden.dim() - 1:
        raise CheckpointUsageError(
            f"{api}: dim={dim} must name a position dimension of hidden {tuple(hidden.shape)}, "
            "not its last (feature) dimension."
        )
    dim %= hidden.dim()
    if targets.dim() <= dim or targets.shape[dim] != hidden.shape[dim]:
        raise CheckpointUsageError(
            f"{api}: targets {tuple(targets.shape)} and hidden {tuple(hidden.shape)} must have "
            f"the same size along dim {dim} (the dimension that is chunked)."
        )
    if chunks > hidden.shape[dim]:
        raise CheckpointUsageError(
            f"{api}: chunks={chunks} is more than the {hidden.shape[dim]} positions along dim "
            f"{dim}; use at most {hidden.shape[dim]}."
        )
    return dim


def _sizes(total: int, chunks: int) -> list[int]:
    base, extra = divmod(total, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def chunked_loss(
    head: Callable[[Tensor], Tensor],
    hidden: Tensor,
    targets: Tensor,
    *,
    chunks: int,
    loss: TokenLoss | None = None,
    ignore_index: int = -100,
    dim: int = 1,
) -> Tensor:
    """``loss(head(hidden), targets)`` computed ``chunks`` slices at a time along ``dim``.

    Each slice runs ``head`` and the loss under a checkpoint, so only one
    slice's head output (logits) is alive at a time, in forward and in
    backward; the head's forward runs once more per slice in backward.
    ``chunks=1`` is the plain unchunked computation (no checkpoint).

    Args:
        head: the output layer (an ``nn.Linear`` ``lm_head``, or any callable
            acting on each position independently).
        hidden: the head's input, e.g. ``[batch, seq, d_model]``.
        targets: one target per position: the shape of ``hidden`` without its
            last dimension (e.g. ``[batch, seq]`` token ids).
        chunks: number of slices along ``dim`` (at most its size).
        loss: ``(outputs, targets) -> summed loss`` of one slice. Default:
            token cross-entropy, averaged over the targets that are not
            ``ignore_index`` (what ``F.cross_entropy`` with ``reduction="mean"``
            gives on the whole batch). A custom loss must *sum* over its slice;
            the result is the sum over slices (divide it yourself).
        ignore_index: target value the default loss skips.
        dim: the position dimension to slice (default 1, the sequence).

    Returns:
        The scalar loss; gradients reach ``hidden`` and the head's parameters.

    Example:
        >>> import torch
        >>> head = torch.nn.Linear(8, 50)
        >>> hidden = torch.randn(4, 6, 8, requires_grad=True)
        >>> chunked_loss(head, hidden, torch.randint(0, 50, (4, 6)), chunks=3).backward()
        >>> hidden.grad.shape
        torch.Size([4, 6, 8])
    """
    api = "remat.chunked_loss"
    if not callable(head):
        raise CheckpointTypeError(f"{api}: head must be callable, got {type(head).__name__}.")
    dim = _check(hidden, targets, chunks, dim, api)
    piece_loss = loss if loss is not None else _summed_cross_entropy(ignore_index)

    def piece(h: Tensor, t: Tensor) -> Tensor:
        return piece_loss(head(h), t)

    if chunks == 1:
        total = piece(hidden, targets)
    else:
        sizes = _sizes(hidden.shape[dim], chunks)
        # One split node for all slices: in backward it joins their gradients
        # once, instead of one full-size gradient per slice.
        parts = zip(torch.split(hidden, sizes, dim), torch.split(targets, sizes, dim), strict=True)
        values = [run_checkpoint(_OPTIONS, piece, h, t) for h, t in parts]
        total = values[0]
        for value in values[1:]:
            total = total + value
    if loss is not None:
        return total
    return total / (targets != ignore_index).sum()


class _Placeholder:
    """What the skipped head returns: zeros of the real output's shape, with no storage."""

    def __init__(self) -> None:
        self.hidden: Tensor | None = None
        self.calls = 0
        self.zeros: Tensor | None = None  # what every view of the placeholder is a view of

    def forward(self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.calls += 1
        if not args or not isinstance(args[0], Tensor):
            raise CheckpointUsageError(
                "remat.chunked_head_loss: the head must be called with the hidden states as "
                "its first positional argument."
            )
        hidden = args[0]
        self.hidden = hidden
        # The head's output shape, from one position (a sliver of its work).
        one = hidden[(slice(0, 1),) * (hidden.dim() - 1)]
        with torch.no_grad():
            sample = original(one, *args[1:], **kwargs)
        if not isinstance(sample, Tensor):
            raise CheckpointUsageError(
                "remat.chunked_head_loss: the head must return one tensor, got "
                f"{type(sample).__name__}."
            )
        shape = (*hidden.shape[:-1], *sample.shape[hidden.dim() - 1:])
        self.zeros = sample.new_zeros(())
        return self.zeros.expand(shape)

    def returned_by(self, output: Any) -> bool:
        """Whether ``output`` holds the placeholder or a view of it, unchanged."""
        return any(base_of(t) is self.zeros for t in _tensors_in(output))


def _tensors_in(value: Any) -> Iterator[Tensor]:
    """Tensors in a model output: nested tuples, lists, dicts and output objects."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, Mapping):  # dicts and Hugging Face ModelOutput
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


@contextmanager
def _skipped(head: nn.Module) -> Iterator[_Placeholder]:
    if "forward" in vars(head):
        raise CheckpointUsageError(
            f"remat.chunked_head_loss: the head {type(head).__name__} already has its forward "
            "replaced on the instance (a plan or wrapper is applied to it); leave the head "
            "out of other plans."
        )
    placeholder = _Placeholder()
    original = head.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return placeholder.forward(original, args, kwargs)

    head.forward = forward
    try:
        yield placeholder
    finally:
        del head.forward


def chunked_head_loss(
    model: nn.Module,
    inputs: Sequence[Any],
    *,
    head: str | nn.Module,
    targets: Tensor,
    chunks: int,
    loss: TokenLoss | None = None,
    ignore_index: int = -100,
    dim: int = 1,
) -> Tensor:
    """Run ``model(*inputs)`` with its output layer replaced by :func:`chunked_loss`.

    The model's ``forward`` is not edited: while it runs, ``head`` returns a
    zero-stride placeholder of its real output's shape (so a model that
    only returns the logits, or wraps them in an output object, runs
    unchanged), and its input is captured. The model's return value is
    dropped; the loss of the captured hidden states is returned. The model
    must call ``head`` once, with the hidden states as the first argument,
    and return that output unchanged (or a view of it, alone or in an output
    object); a model that computes on it (soft-capping, scaling or upcasting
    the logits) is refused, since the head's loss alone would be another loss.

    Args:
        model: the whole model.
        inputs: its positional inputs.
        head: the output layer, a submodule or its name (``"lm_head"``).
        targets, chunks, loss, ignore_index, dim: as for :func:`chunked_loss`.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
        >>> idx, targets = torch.randint(64, (2, 16)), torch.randint(64, (2, 16))
        >>> chunked_head_loss(model, (idx,), head="1", targets=targets, chunks=4).backward()
    """
    api = "remat.chunked_head_loss"
    if isinstance(head, str):
        try:
            module = model.get_submodule(head)
        except AttributeError as exc:
            raise CheckpointUsageError(f"{api}: the model has no submodule {head!r}.") from exc
    elif isinstance(head, nn.Module):
        module = head
    else:
        raise CheckpointTypeError(
            f"{api}: head must be a submodule or its name, got {type(head).__name__}."
        )
    with _skipped(module) as placeholder:
        output = model(*inputs)
    if placeholder.calls != 1 or placeholder.hidden is None:
        raise CheckpointUsageError(
            f"{api}: the head ran {placeholder.calls} times in the model's forward; it must run "
            "exactly once (name the model's output layer, e.g. 'lm_head')."
        )
    if not placeholder.returned_by(output):
        # The model computed on the head's output (logit soft-capping, a
        # scale, an upcast): the loss of the head alone would be another loss.
        raise CheckpointUsageError(
            f"{api}: the model does not return the output of {type(module).__name__} as it is "
            "(it computes on it, e.g. soft-caps, scales or upcasts the logits), so a loss of the "
            "head alone would differ from the model's. Use remat.chunked_loss(head, hidden, "
            "targets, chunks=...) with a head function that includes that step."
        )
    return chunked_loss(
        module, placeholder.hidden, targets, chunks=chunks, loss=loss, ignore_index=ignore_index,
        dim=dim,
    )
