"""Estimate a training step's memory at any size, without allocating it.

The embedded GPT (:mod:`remat._demo`) is built on the ``meta`` device:
tensors there have shapes, dtypes and storages with byte sizes, but no data,
so the tracker counts exactly what a real step would allocate while nothing is
allocated. A 7B-parameter step takes seconds on a laptop.

Two things differ from a real run and are handled here:

* On ``meta``, ``scaled_dot_product_attention`` falls back to its math form,
  which keeps the ``[batch, heads, seq, seq]`` attention matrix. Real runs use
  a fused kernel (flash attention on CUDA, its CPU twin on CPU) that keeps only
  the output and a log-sum-exp. With ``attention="fused"`` (default) each
  attention module calls the fused op directly, so the estimate matches the
  real step (same op, same saved tensors); ``"math"`` keeps the fallback.
* A first optimizer step creates the optimizer state. The estimate runs one
  untracked step first and tracks the second: the steady state of training.

See ``docs/design/memory.md`` ("Estimating on meta tensors").

Example:
    >>> from remat.memory import estimate_training_step
    >>> from remat._demo import GPTConfig
    >>> est = estimate_training_step(GPTConfig(n_layers=2, seq_len=64), batch=2)
    >>> est.report.peak_bytes > est.parameter_count * 4 * 3   # params, grads, Adam x2
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor, nn

from remat._demo import GPT, Block, CheckpointFn, GPTConfig, lm_loss
from remat.errors import CheckpointUsageError
from remat.memory._report import MemoryReport
from remat.memory._tracker import FORWARD_END, track
from remat.names import name

__all__ = ["PRESETS", "StepEstimate", "estimate_training_step", "track_training_step"]

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "1b": GPTConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_heads=16, n_layers=22, d_ff=5632),
    "7b": GPTConfig(vocab_size=32000, seq_len=2048, d_model=4096, n_heads=32, n_layers=32, d_ff=16384),
    "13b": GPTConfig(vocab_size=32000, seq_len=2048, d_model=5120, n_heads=40, n_layers=40, d_ff=20480),
}
"""Model shapes by parameter count (:meth:`GPTConfig.parameter_count`):
``tiny`` 1.3M, ``1b`` 1.01B (TinyLlama's layers, width and FFN width),
``7b`` 6.71B and ``13b`` 12.9B (Llama-7B's and 13B's layers, width, heads
and vocabulary). The embedded GPT's MLP has two matrices where Llama's
SwiGLU has three, so ``7b`` and ``13b`` use a ``4 * d_model`` FFN width to
reach Llama's parameter counts (6.74B and 13.0B)."""

Optimizer = Literal["adamw", "sgd", "none"]
Attention = Literal["fused", "math"]


@dataclass(frozen=True)
class StepEstimate:
    """The estimated memory of one training step of the embedded GPT.

    Attributes:
        config: the model shape (``seq_len`` is the sequence length used).
        batch: sequences per batch.
        dtype: parameter and activation dtype, e.g. ``"torch.bfloat16"``.
        optimizer: ``"adamw"``, ``"sgd"`` (no momentum: no state) or ``"none"``.
        parameter_count: number of parameters.
        report: the tracked step (forward, backward, optimizer step).
        elapsed_s: wall time the estimate took.
    """

    config: GPTConfig
    batch: int
    dtype: str
    optimizer: Optimizer
    parameter_count: int
    report: MemoryReport
    elapsed_s: float


def estimate_training_step(
    config: GPTConfig,
    *,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    optimizer: Optimizer = "adamw",
    checkpoint_fn: CheckpointFn | None = None,
    attention: Attention = "fused",
) -> StepEstimate:
    """Track one training step of a meta-device GPT of this shape.

    ``checkpoint_fn`` runs each block as in :class:`remat._demo.GPT`
    (e.g. ``functools.partial(remat.checkpoint, policy=...)``).

    Example:
        >>> import functools, remat
        >>> from remat.memory import PRESETS, estimate_training_step
        >>> from remat._demo import GPTConfig
        >>> config = GPTConfig(n_layers=4, seq_len=128)
        >>> plain = estimate_training_step(config, batch=4)
        >>> ckpt = estimate_training_step(config, batch=4, checkpoint_fn=remat.checkpoint)
        >>> ckpt.report.forward_end_bytes < plain.report.forward_end_bytes
        True
    """
    if not isinstance(batch, int) or batch < 1:
        raise CheckpointUsageError(f"estimate_training_step: batch must be an int >= 1, got {batch!r}.")
    if optimizer not in ("adamw", "sgd", "none"):
        raise CheckpointUsageError(
            f"estimate_training_step: optimizer must be 'adamw', 'sgd' or 'none', got {optimizer!r}."
        )
    if attention not in ("fused", "math"):
        raise CheckpointUsageError(
            f"estimate_training_step: attention must be 'fused' or 'math', got {attention!r}."
        )
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointUsageError(
            f"estimate_training_step: dtype must be a floating torch.dtype, got {dtype!r}."
        )
    start = time.perf_counter()
    model = meta_model(config, dtype=dtype, attention=attention)
    idx = torch.zeros(batch, config.seq_len, dtype=torch.long, device="meta")
    report = track_training_step(
        model, lambda: lm_loss(model(idx, checkpoint_fn=checkpoint_fn), idx), optimizer=optimizer
    )
    return StepEstimate(
        config=config,
        batch=batch,
        dtype=str(dtype),
        optimizer=optimizer,
        parameter_count=sum(p.numel() for p in model.parameters()),
        report=report,
        elapsed_s=time.perf_counter() - start,
    )


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
    after each step (progress). Meant for models on the meta device (see
    :func:`meta_model`), but works on any device.

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


def meta_model(config: GPTConfig, *, dtype: torch.dtype = torch.float32, attention: Attention = "fused") -> GPT:
    """The embedded GPT on the meta device (no memory), attention as in real runs.

    Example:
        >>> from remat._demo import GPTConfig
        >>> meta_model(GPTConfig(n_layers=1)).head.weight.device.type
        'meta'
    """
    with torch.device("meta"):
        model = GPT(replace(config, dropout=0.0))
    if any(param.dtype != dtype for param in model.parameters()):
        model.to(dtype)  # not otherwise: under a fake-tensor mode, Module.to cannot swap
    if attention == "fused":
        for block in model.blocks:
            assert isinstance(block, Block)
            fused = _FusedCausalAttention(block.attn.qkv, block.attn.proj, config.n_heads)
            block.register_module("attn", fused)
    return model


class _FusedCausalAttention(nn.Module):
    """The embedded model's attention through the fused (flash) attention op.

    Same parameters and module paths as ``remat._demo.CausalSelfAttention``
    (``qkv``, ``proj``) and the same ``"attn_out"`` name on its output; the
    fused op keeps what flash attention keeps: the output and a
    ``[batch, heads, seq]`` log-sum-exp.
    """

    def __init__(self, qkv: nn.Module, proj: nn.Module, n_heads: int) -> None:
        super().__init__()
        self.qkv = qkv
        self.proj = proj
        self.n_heads = n_heads

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        heads = (batch, seq, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(heads).transpose(1, 2) for t in self.qkv(x).split(width, dim=2))
        y = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
        y = name(y, "attn_out")  # as the model names it, for name-based policies
        out: Tensor = self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return out


def _make_optimizer(model: nn.Module, optimizer: Optimizer) -> torch.optim.Optimizer | None:
    if optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), foreach=False)
    if optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    return None
