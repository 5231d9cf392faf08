"""The model's head as a planned part: its output layer and loss, chunked or not.

Layer: beside :mod:`~remat.planner.apply` (it puts a head option in place,
through :func:`remat.losses.chunked_head_loss`); the profiler and the plan use it.

Below full checkpointing, what is left of a language model's peak is mostly
its head: the logits, the log-softmax the loss keeps and their gradients,
each ``batch x seq x vocab``. Checkpointing the blocks cannot touch them;
computing head and loss in slices can (``docs/design/planner.md``, "The head").

Example:
    >>> import torch
    >>> from remat.planner.head import Head
    >>> targets = torch.randint(64, (2, 16))   # a language model's next tokens
    >>> head = Head("head", targets)
    >>> head.chunk_options(16)
    (1, 2, 4, 8, 16)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.losses import TokenLoss, chunked_head_loss

__all__ = ["DEFAULT_CHUNKS", "Head"]

DEFAULT_CHUNKS: tuple[int, ...] = (2, 4, 8, 16)
"""Slice counts the planner measures besides the unchunked head."""


@dataclass(frozen=True, eq=False)  # holds a tensor: equal only to itself
class Head:
    """The model's output layer and a per-position loss, which the planner may chunk.

    With a ``Head``, the planner's step is
    ``chunked_head_loss(model, inputs, head=module, targets=targets, chunks=c).backward()``
    (:func:`remat.losses.chunked_head_loss`) instead of
    ``loss_fn(model(*inputs)).backward()``, and it chooses ``c`` along with
    the blocks' options: ``c=1`` is the ordinary unchunked loss, larger
    ``c`` keeps one slice of logits alive at a time for one more head forward.
    A plan with a chunked head gives the loss to use in training through
    :meth:`remat.planner.Plan.loss`.

    Attributes:
        module: name of the output layer in the model (``"lm_head"``).
        targets: one target per position (``[batch, seq]`` token ids) of the
            example inputs.
        loss: per-slice summed loss; default token cross-entropy averaged over
            the targets that are not ``ignore_index``.
        ignore_index: target value the default loss skips.
        dim: the position dimension to slice (1: the sequence).
        chunks: slice counts to consider besides 1 (kept up to the number of
            positions along ``dim``).

    Example:
        >>> import torch
        >>> Head("lm_head", torch.zeros(2, 8, dtype=torch.long)).chunk_options(8)
        (1, 2, 4, 8)
    """

    module: str
    targets: Tensor = field(repr=False)
    loss: TokenLoss | None = field(default=None, repr=False)
    ignore_index: int = -100
    dim: int = 1
    chunks: tuple[int, ...] = DEFAULT_CHUNKS

    def __post_init__(self) -> None:
        api = "remat.planner.Head"
        if not isinstance(self.module, str) or not self.module:
            raise CheckpointTypeError(
                f"{api}: module must be the head's submodule name (e.g. 'lm_head'), got "
                f"{self.module!r}."
            )
        if not isinstance(self.targets, Tensor):
            raise CheckpointTypeError(
                f"{api}: targets must be a tensor of per-position targets, got "
                f"{type(self.targets).__name__}."
            )
        if self.loss is not None and not callable(self.loss):
            raise CheckpointTypeError(f"{api}: loss must be callable, got {type(self.loss).__name__}.")
        chunks = tuple(self.chunks)
        if not chunks or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in chunks):
            raise CheckpointUsageError(f"{api}: chunks must be ints >= 1, got {self.chunks!r}.")
        object.__setattr__(self, "chunks", chunks)

    def chunk_options(self, positions: int) -> tuple[int, ...]:
        """1 (unchunked) and every configured count up to ``positions``, ascending."""
        return tuple(sorted({1, *(c for c in self.chunks if c <= positions)}))

    def positions(self) -> int:
        """How many positions ``dim`` of the targets holds (the most slices possible)."""
        if not -self.targets.dim() <= self.dim < self.targets.dim():
            raise CheckpointUsageError(
                f"remat.planner.Head: dim={self.dim} is not a dimension of targets "
                f"{tuple(self.targets.shape)}."
            )
        return int(self.targets.shape[self.dim])

    def step_loss(
        self, model: nn.Module, inputs: Sequence[Any], chunks: int, targets: Tensor | None = None
    ) -> Tensor:
        """The step's loss with the head in ``chunks`` slices (over ``targets``, default
        the example's)."""
        return chunked_head_loss(
            model, inputs, head=self.module, targets=self.targets if targets is None else targets,
            chunks=chunks, loss=self.loss, ignore_index=self.ignore_index, dim=self.dim,
        )
