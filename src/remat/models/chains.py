"""Chains of blocks with different costs, for the planner's benchmarks and tests.

:class:`MLPChain` (MLP blocks of varying width) and :class:`ConvNet` (a
residual conv net whose blocks shrink the image and widen the channels):
models whose blocks keep different amounts for backward, unlike the GPT's
identical blocks. Each keeps its blocks in ``model.blocks``. Layer: see
:mod:`remat.models`.

Example:
    >>> import torch
    >>> from remat.models import MLPChain
    >>> tuple(MLPChain(widths=(32, 64, 32))(torch.randn(4, 32)).shape)
    (4, 10)
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from remat.errors import CheckpointUsageError

__all__ = ["ConvBlock", "ConvNet", "MLPChain"]


class MLPChain(nn.Module):
    """A deep chain of MLP blocks of varying width, for planning benchmarks.

    Block ``i`` maps ``widths[i]`` to ``widths[i + 1]`` features
    (``Linear -> GELU -> Linear``, hidden size ``4 * widths[i + 1]``), so
    blocks differ in what they keep for backward; a linear head gives
    ``classes`` logits. The blocks are ``model.blocks``.

    Example:
        >>> import torch
        >>> model = MLPChain(widths=(32, 64, 32))
        >>> tuple(model(torch.randn(4, 32)).shape)
        (4, 10)
    """

    def __init__(self, widths: tuple[int, ...] = (256, 512, 256, 512, 256), classes: int = 10) -> None:
        super().__init__()
        if len(widths) < 2 or not all(isinstance(w, int) and w > 0 for w in widths):
            raise CheckpointUsageError(
                f"MLPChain: widths must be at least two positive ints, got {widths!r}."
            )
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(a, 4 * b), nn.GELU(), nn.Linear(4 * b, b))
            for a, b in zip(widths[:-1], widths[1:], strict=True)  # noqa: RUF007 (py3.10 floor)
        )
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[batch, classes]`` for features ``x [batch, widths[0]]``."""
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.head(x)
        return out


class ConvBlock(nn.Module):
    """``conv3x3 -> GroupNorm -> ReLU`` twice, with a strided first conv when downsampling.

    GroupNorm rather than BatchNorm: a recomputed BatchNorm would update its
    running statistics twice per step.
    """

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1),
            nn.GroupNorm(4, channels_out),
            nn.ReLU(),
            nn.Conv2d(channels_out, channels_out, 3, padding=1),
            nn.GroupNorm(4, channels_out),
        )
        self.skip = (
            nn.Identity()
            if stride == 1 and channels_in == channels_out
            else nn.Conv2d(channels_in, channels_out, 1, stride=stride)
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = F.relu(self.body(x) + self.skip(x))
        return out


class ConvNet(nn.Module):
    """A small residual conv net whose blocks shrink the image and widen the channels.

    Stages of ``blocks_per_stage`` :class:`ConvBlock` s at ``channels``
    (each stage after the first halves the resolution), then global average
    pooling and a linear head. Early blocks hold most of the activation
    memory, late ones little: heterogeneous costs for the planner. The
    blocks are ``model.blocks``.

    Example:
        >>> import torch
        >>> model = ConvNet(channels=(8, 16), blocks_per_stage=1)
        >>> tuple(model(torch.randn(2, 3, 16, 16)).shape)
        (2, 10)
    """

    def __init__(
        self,
        channels: tuple[int, ...] = (16, 32, 64),
        blocks_per_stage: int = 2,
        classes: int = 10,
    ) -> None:
        super().__init__()
        if not channels or any(c % 4 for c in channels) or blocks_per_stage < 1:
            raise CheckpointUsageError(
                f"ConvNet: channels must be multiples of 4 (GroupNorm(4)) and blocks_per_stage "
                f">= 1, got channels={channels!r}, blocks_per_stage={blocks_per_stage!r}."
            )
        self.stem = nn.Conv2d(3, channels[0], 3, padding=1)
        blocks = []
        previous = channels[0]
        for stage, width in enumerate(channels):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(ConvBlock(previous, width, stride))
                previous = width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(previous, classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[batch, classes]`` for images ``x [batch, 3, height, width]``."""
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        out: Tensor = self.head(h.mean(dim=(2, 3)))
        return out
