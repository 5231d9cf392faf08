"""The embedded demo model: a small GPT-style decoder-only transformer.

The model of the command line (``remat demo``, ``plan``, ``report``,
``estimate``), of the benchmarks, the tests and the docs. Layer: see
:mod:`remat.models`. :func:`meta_model` builds it on the meta device with
the attention real runs use (``remat estimate``).

Token and position embeddings, ``n_layers`` pre-LayerNorm blocks (causal
self-attention, then a GELU MLP, each around a residual), a final LayerNorm
and a linear LM head. Activations dominate its memory at the default size,
which is what checkpointing is about.

The blocks live in ``model.blocks`` and ``forward`` takes a
``checkpoint_fn``: each block is run as ``checkpoint_fn(block, h)``, so the
same model runs with no checkpointing, ``torch.utils.checkpoint`` or remat.

Example:
    >>> import torch
    >>> from remat.models import GPT, GPTConfig, lm_loss, make_batch
    >>> config = GPTConfig(n_layers=2, seq_len=32)
    >>> model = GPT(config)
    >>> idx, targets = make_batch(config, 2, torch.Generator().manual_seed(0))
    >>> logits = model(idx)
    >>> tuple(logits.shape)
    (2, 32, 256)
    >>> lm_loss(logits, targets).backward()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remat.errors import CheckpointUsageError
from remat.names import name as name_tensor

__all__ = [
    "GPT",
    "GPT_TP_PLAN",
    "PRESETS",
    "Attention",
    "Block",
    "CheckpointFn",
    "GPTConfig",
    "lm_loss",
    "make_batch",
    "meta_model",
    "tiny_gpt",
]

CheckpointFn = Callable[[nn.Module, Tensor], Tensor]
"""Runs ``block(h)``, e.g. ``functools.partial(remat.checkpoint, use_reentrant=False)``."""


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the embedded GPT. Defaults: about 1.2M parameters.

    Example:
        >>> GPTConfig(n_layers=2).d_model
        128
    """

    vocab_size: int = 256
    seq_len: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 6
    d_ff: int = 512
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CheckpointUsageError(
                    f"GPTConfig: {name} must be a positive int, got {value!r}."
                )
        if self.d_model % self.n_heads:
            raise CheckpointUsageError(
                f"GPTConfig: d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); pick n_heads among its divisors."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise CheckpointUsageError(
                f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}."
            )

    def parameter_count(self) -> int:
        """The number of parameters of a :class:`GPT` of this shape (computed, nothing built).

        Example:
            >>> config = GPTConfig(n_layers=2)
            >>> config.parameter_count() == sum(p.numel() for p in GPT(config).parameters())
            True
        """
        d, ff = self.d_model, self.d_ff
        norms = 2 * 2 * d  # two LayerNorms, weight and bias
        attention = (3 * d * d + 3 * d) + (d * d + d)  # qkv and proj, with biases
        mlp = (d * ff + ff) + (ff * d + d)
        embeddings = (self.vocab_size + self.seq_len) * d
        head = d * self.vocab_size + 2 * d  # final LayerNorm, bias-free head
        return embeddings + self.n_layers * (norms + attention + mlp) + head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``.

    The attention output (before the projection) is named ``"attn_out"`` for
    name-based policies, e.g. ``remat.policies.save_only_names("attn_out")``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        heads = (batch, seq, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(heads).transpose(1, 2) for t in self.qkv(x).split(width, dim=2))
        y = name_tensor(
            F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            ),
            "attn_out",
        )
        out: Tensor = self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return out


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.

    The MLP output is named ``"mlp_out"``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff),
            nn.GELU(),
            nn.Linear(config.d_ff, config.d_model),
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        out: Tensor = x + self.drop(name_tensor(self.mlp(self.ln_2(x)), "mlp_out"))
        return out


class GPT(nn.Module):
    """Decoder-only transformer returning next-token logits ``[batch, seq, vocab]``.

    Example:
        >>> import functools, torch
        >>> from torch.utils.checkpoint import checkpoint
        >>> model = GPT(GPTConfig(n_layers=2, seq_len=16))
        >>> idx = torch.zeros(1, 16, dtype=torch.long)
        >>> ckpt = functools.partial(checkpoint, use_reentrant=False)
        >>> torch.equal(model(idx), model(idx, checkpoint_fn=ckpt))
        True
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: Tensor, *, checkpoint_fn: CheckpointFn | None = None) -> Tensor:
        """Logits for token ids ``idx`` of shape ``[batch, seq]``, ``seq <= seq_len``.

        With ``checkpoint_fn``, each block runs as ``checkpoint_fn(block, h)``.
        """
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise CheckpointUsageError(
                f"GPT.forward: idx has {seq} positions but the model was built for "
                f"seq_len={self.config.seq_len}; build it with a larger GPTConfig.seq_len."
            )
        positions = torch.arange(seq, device=idx.device)
        h = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            h = block(h) if checkpoint_fn is None else checkpoint_fn(block, h)
        logits: Tensor = self.head(self.ln_f(h))
        return logits


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of ``logits [b, s, v]`` against ``targets [b, s]``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_batch(
    config: GPTConfig, batch_size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Random token ids ``idx`` and their next tokens ``targets``, both ``[batch, seq_len]``.

    Example:
        >>> import torch
        >>> config = GPTConfig(seq_len=8)
        >>> idx, targets = make_batch(config, 4, torch.Generator().manual_seed(0))
        >>> torch.equal(idx[:, 1:], targets[:, :-1])
        True
    """
    tokens = torch.randint(config.vocab_size, (batch_size, config.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _init_weights(module: nn.Module) -> None:
    """GPT-2 style: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


Attention = Literal["fused", "math"]


def meta_model(config: GPTConfig, *, dtype: torch.dtype = torch.float32, attention: Attention = "fused") -> GPT:
    """The embedded GPT on the meta device (no memory), attention as in real runs.

    Example:
        >>> from remat.models import GPTConfig
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

    Same parameters and module paths as ``remat.models.CausalSelfAttention``
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
        y = name_tensor(y, "attn_out")  # as the model names it, for name-based policies
        out: Tensor = self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return out


GPT_TP_PLAN: dict[str, str] = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}

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
"""The embedded GPT's tensor-parallel plan (``remat.memory.shard_model``'s ``tp_plan``): its
attention projects q, k and v with one fused linear, which cannot be split by
columns without splitting the heads apart, so only the MLP is split
(Megatron's MLP layout)."""


def tiny_gpt() -> tuple[nn.Module, tuple[Tensor]]:
    """A model factory for ``--model remat.models:tiny_gpt``: a 2-block GPT and a batch of token ids.

    Any command's ``--model package.module:factory`` takes a function like
    this one (no arguments; returns the model and its positional inputs).

    Example:
        >>> model, (idx,) = tiny_gpt()
        >>> tuple(idx.shape)
        (2, 32)
    """
    config = GPTConfig(n_layers=2, seq_len=32)
    torch.manual_seed(0)
    idx, _ = make_batch(config, 2, torch.Generator().manual_seed(0))
    return GPT(config), (idx,)
