"""Decoder models cut into pipeline stages, for ``torch.distributed.pipelining``.

A :class:`DecoderStage` is one stage's module: the embedding (first stage), a
run of the model's blocks, the final norm and head (last stage). It holds the
model's own modules, so the stages of one model share its weights; build
``torch.distributed.pipelining.PipelineStage`` objects from the stages a rank
runs. :func:`gpt_stages` cuts the embedded GPT, :func:`llama_stages` a
Hugging Face Llama (``LlamaForCausalLM``; its rotary positions are computed
in each stage, as the model computes them once for all its layers).

How blocks run is the caller's: ``run_block(block, hidden, **kwargs)`` (the
default calls the block), so a stage runs its blocks plainly, under a
checkpoint function, or as placed (:func:`remat.placement.place` on
``stage.blocks``).

Example:
    >>> import torch
    >>> from remat.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layers=4, seq_len=16))
    >>> stages = gpt_stages(model, 2)
    >>> [len(stage.blocks) for stage in stages]
    [2, 2]
    >>> idx = torch.randint(256, (2, 16))
    >>> torch.equal(stages[1](stages[0](idx)), model(idx))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.models.gpt import GPT

__all__ = ["BlockRunner", "DecoderStage", "gpt_stages", "llama_stages", "split_evenly"]

BlockRunner = Callable[..., Tensor]
"""``run_block(block, hidden, **kwargs)``: how a stage runs one of its blocks."""


def _call(block: nn.Module, hidden: Tensor, **kwargs: Any) -> Tensor:
    out = block(hidden, **kwargs)
    first: Tensor = out[0] if isinstance(out, tuple) else out  # transformers' layers may return tuples
    return first


def split_evenly(n_blocks: int, n_stages: int) -> list[range]:
    """The blocks of each stage: ``n_blocks`` in ``n_stages`` runs, the first ones one longer.

    Example:
        >>> split_evenly(5, 2)
        [range(0, 3), range(3, 5)]
    """
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise CheckpointUsageError(f"remat.models.stages: stages must be an int >= 1, got {n_stages!r}.")
    if n_stages > n_blocks:
        raise CheckpointUsageError(
            f"remat.models.stages: {n_stages} stages for a model of {n_blocks} blocks; every "
            "stage needs one block at least: use fewer stages or more layers."
        )
    size, extra = divmod(n_blocks, n_stages)
    runs, start = [], 0
    for index in range(n_stages):
        stop = start + size + (index < extra)
        runs.append(range(start, stop))
        start = stop
    return runs


class DecoderStage(nn.Module):
    """One pipeline stage of a decoder (see the module docstring).

    Attributes:
        embed: the first stage's input module (token ids to hidden states), or None.
        blocks: this stage's blocks, the model's own modules.
        head: the last stage's output module (hidden states to logits), or None.
        positions: ``hidden -> kwargs`` each block is called with (Llama's
            rotary embeddings), or None.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        *,
        embed: nn.Module | None = None,
        head: nn.Module | None = None,
        positions: Callable[[Tensor], dict[str, Any]] | None = None,
        run_block: BlockRunner = _call,
    ) -> None:
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.positions = positions
        self.run_block = run_block

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.embed(x) if self.embed is not None else x
        kwargs = self.positions(hidden) if self.positions is not None else {}
        for block in self.blocks:
            hidden = self.run_block(block, hidden, **kwargs)
        return self.head(hidden) if self.head is not None else hidden


class _GPTEmbedding(nn.Module):
    """The GPT's token and position embeddings (and dropout), as its forward applies them."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        out: Tensor = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        return out


def gpt_stages(model: GPT, n_stages: int, *, run_block: BlockRunner = _call) -> list[DecoderStage]:
    """The embedded GPT cut into ``n_stages`` stages of consecutive blocks (:func:`split_evenly`).

    The first stage takes token ids, the last returns logits; chained, they are
    the model's forward.
    """
    if not isinstance(model, GPT):
        raise CheckpointTypeError(f"remat.models.gpt_stages: model must be a remat.models.GPT, got {type(model).__name__}.")
    runs = split_evenly(len(model.blocks), n_stages)
    embed = _GPTEmbedding(model)
    head = nn.Sequential(model.ln_f, model.head)
    return [
        DecoderStage(
            [model.blocks[i] for i in run],
            embed=embed if index == 0 else None,
            head=head if index == n_stages - 1 else None,
            run_block=run_block,
        )
        for index, run in enumerate(runs)
    ]


class _Rotary:
    """A Llama's rotary embeddings for the hidden states at hand (positions 0..seq-1)."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary = rotary

    def __call__(self, hidden: Tensor) -> dict[str, Any]:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return {"position_embeddings": self.rotary(hidden, positions)}


def llama_stages(model: nn.Module, n_stages: int, *, run_block: BlockRunner = _call) -> list[DecoderStage]:
    """A Hugging Face ``LlamaForCausalLM`` (or a model laid out as one: ``model.model.embed_tokens``,
    ``.layers``, ``.norm``, ``.rotary_emb``, and ``model.lm_head``) cut into ``n_stages`` stages.

    Each stage computes the rotary position embeddings of its layers; attention is
    causal (no mask is passed, so the attention implementation's causal path runs).
    """
    body = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if body is None or not all(hasattr(body, name) for name in needed) or not hasattr(model, "lm_head"):
        raise CheckpointTypeError(
            "remat.models.llama_stages: model must be laid out as transformers' LlamaForCausalLM "
            f"(model.model.{', '.join(needed)} and model.lm_head); got {type(model).__name__}."
        )
    runs = split_evenly(len(body.layers), n_stages)
    lm_head: nn.Module = model.lm_head  # type: ignore[assignment]
    head = nn.Sequential(body.norm, lm_head)
    positions = _Rotary(body.rotary_emb)
    return [
        DecoderStage(
            [body.layers[i] for i in run],
            embed=body.embed_tokens if index == 0 else None,
            head=head if index == n_stages - 1 else None,
            positions=positions,
            run_block=run_block,
        )
        for index, run in enumerate(runs)
    ]
