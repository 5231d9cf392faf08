"""Models the command line, the benchmarks, the tests and the docs share.

Built from code, never downloaded. Not the checkpointing API: a model to try
it on. Layer: above :mod:`remat.names` (the GPT names its attention output
for name-based policies), below everything that runs a region; nothing in
the library imports it except the command line.

* :class:`GPT` (:class:`GPTConfig`, :class:`Block`, :func:`lm_loss`,
  :func:`make_batch`, :func:`meta_model`, :data:`GPT_TP_PLAN`, :data:`PRESETS`
  of 1B to 13B parameters): the embedded
  demo model, a small decoder-only transformer (``remat.models.gpt``);
* :func:`tiny_gpt`: a model factory for ``--model remat.models:tiny_gpt``
  (also ``gpt``);
* :class:`MLPChain` and :class:`ConvNet`: a deep chain of MLP blocks of
  varying width and a residual conv net, for the planner's benchmarks
  (``remat.models.chains``);
* :func:`gpt_stages`, :func:`llama_stages` (:class:`DecoderStage`,
  :func:`split_evenly`): a decoder cut into pipeline stages for
  ``torch.distributed.pipelining`` (``remat.models.stages``).

This package re-exports them.

Example:
    >>> import torch
    >>> from remat.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layers=2, seq_len=16))
    >>> len(model.blocks)
    2
"""

from remat.models.chains import ConvNet, MLPChain
from remat.models.gpt import (
    GPT,
    GPT_TP_PLAN,
    PRESETS,
    Attention,
    Block,
    CheckpointFn,
    GPTConfig,
    lm_loss,
    make_batch,
    meta_model,
    tiny_gpt,
)
from remat.models.stages import DecoderStage, gpt_stages, llama_stages, split_evenly

__all__ = [
    "GPT",
    "GPT_TP_PLAN",
    "PRESETS",
    "Attention",
    "Block",
    "CheckpointFn",
    "ConvNet",
    "DecoderStage",
    "GPTConfig",
    "MLPChain",
    "gpt_stages",
    "llama_stages",
    "lm_loss",
    "make_batch",
    "meta_model",
    "split_evenly",
    "tiny_gpt",
]
