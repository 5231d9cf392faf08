"""The checkpointing strategies every ``remat`` command can put on a model's blocks.

Layer: ``remat.cli`` (the application); above the model loader
(:mod:`remat.cli.loader`) and :mod:`remat.models`.

A strategy is a name: ``none``, ``torch`` (``torch.utils.checkpoint``, the
baseline remat replaces), ``remat`` (full recomputation), ``remat:save_matmuls``,
``remat:save_matmuls_no_batch``, ``remat:names`` (keep the blocks' attention
outputs, named ``attn_out``), ``remat:offload`` (checkpoint, inputs in host
memory), and the two compressed ones: ``remat:save_matmuls+fp8``
(``remat:save_matmuls`` with what it keeps, its inputs and matmul outputs,
kept as fp8) and ``remat:keep+int8`` (no recomputation; every activation a
block saves kept as int8). Their gradients are approximate
(``docs/design/compression.md``). :func:`apply_strategy` puts one on the blocks of a loaded model with
:func:`remat.placement.place` (remat's strategies; FQNs unchanged, undone by
the handle it returns) or with wrappers (``torch``, whose checkpoint is not
remat's).

Example:
    >>> from remat.cli.loader import ModelRequest, load_model
    >>> loaded = load_model(ModelRequest(command="remat report", model="mlp"))
    >>> apply_strategy(loaded, "remat:save_matmuls", "remat report").blocks
    ('blocks.0', 'blocks.1', 'blocks.2', 'blocks.3')
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Literal, get_args

from torch.utils.checkpoint import checkpoint as torch_checkpoint

from remat import policies
from remat._blocks import require_blocks
from remat.cli.loader import LoadedModel
from remat.config import region_setting
from remat.errors import CheckpointUsageError
from remat.models import CheckpointFn
from remat.nn import apply_activation_checkpointing, checkpoint_wrapper
from remat.placement import BlockSetting, CompileSpec, Placement, place

__all__ = [
    "ALL_STRATEGIES",
    "ATTENTION_NAME",
    "COMPRESSED_STRATEGIES",
    "ESTIMATE_STRATEGIES",
    "Strategy",
    "apply_strategy",
    "budget_setting",
    "checkpoint_fn",
    "setting_of",
]

Strategy = Literal[
    "none",
    "torch",
    "remat",
    "remat:save_matmuls",
    "remat:save_matmuls_no_batch",
    "remat:names",
    "remat:offload",
    "remat:save_matmuls+fp8",
    "remat:keep+int8",
]

ALL_STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
"""Every strategy, baseline first; ``remat demo --strategies all`` runs them all (``benchmarks/strategies.py``)."""

ATTENTION_NAME = "attn_out"
"""The name the embedded GPT's blocks give their attention outputs."""


ESTIMATE_STRATEGIES: tuple[Strategy, ...] = (
    "none", "torch", "remat", "remat:save_matmuls", "remat:save_matmuls_no_batch", "remat:names"
)
"""Strategies that need no host memory: these also run on meta and fake tensors."""

_SETTINGS: dict[str, BlockSetting] = {
    "remat": BlockSetting(),
    "remat:save_matmuls": BlockSetting(policy=policies.save_matmuls),
    "remat:save_matmuls_no_batch": BlockSetting(policy=policies.save_matmuls_without_batch_dims),
    "remat:names": BlockSetting(policy=policies.save_only_names(ATTENTION_NAME)),
    "remat:offload": BlockSetting(offload=True),
    "remat:save_matmuls+fp8": BlockSetting(policy=policies.save_matmuls, compress="fp8"),
    "remat:keep+int8": BlockSetting(checkpoint=False, compress="int8"),
}

COMPRESSED_STRATEGIES: tuple[Strategy, ...] = ("remat:save_matmuls+fp8", "remat:keep+int8")
"""Strategies whose gradients are approximate: what they keep is compressed."""


def budget_setting(strategy: str, command: str, compile: CompileSpec | None) -> BlockSetting:
    """The setting of a ``budget:<fraction>`` strategy: the planner's option of that name
    (:func:`remat.config.region_setting`), which needs the blocks compiled."""
    if compile is None:
        raise CheckpointUsageError(
            f"{command}: --strategy {strategy} is a compile-time budget (torch.compile's partitioner "
            "plans what each block keeps); add --compile."
        )
    return region_setting(strategy)


def checkpoint_fn(strategy: str) -> CheckpointFn | None:
    """The function that runs one block under ``torch`` (torch's checkpoint); None otherwise.

    The demo passes it to the embedded GPT's forward (``checkpoint_fn=``);
    remat's strategies are placed on the blocks instead (:func:`setting_of`).
    """
    if strategy == "torch":
        return partial(torch_checkpoint, use_reentrant=False)
    return None


def setting_of(strategy: str) -> BlockSetting | None:
    """The :class:`~remat.placement.BlockSetting` of one of remat's strategies (None for
    ``none`` and ``torch``).

    Example:
        >>> setting_of("remat:keep+int8").kept
        Storage('compressed', int8)
    """
    return _SETTINGS.get(strategy)


def apply_strategy(
    loaded: LoadedModel, strategy: str, command: str, compile: CompileSpec | None = None
) -> Placement | None:
    """Checkpoint the model's blocks as ``strategy`` says (in place).

    The blocks are the model's stack of repeated blocks, found as the
    planner finds them (:func:`remat._blocks.find_blocks` with the model's
    inputs: the chain the forward runs, not a larger list of heads beside
    it), so ``remat report`` and ``remat plan`` choose the same blocks. remat's strategies go through :func:`remat.placement.place`
    (hooks, FQNs unchanged; a sharding engine applied afterwards, torchtitan's
    order, gathers each block's parameters outside its checkpoint) and return
    its handle; ``torch`` wraps each block with ``torch.utils.checkpoint``
    (returns None); ``none`` does nothing. With ``compile``, every block is
    then compiled on its own (the wrapper, for ``torch``).
    """
    if strategy == "none" and compile is None:
        return None
    found = require_blocks(
        loaded.model,
        inputs=loaded.args,
        kwargs=loaded.kwargs,
        api=f"{command}: --strategy {strategy}",
        remedy="use --strategy none",
    )
    if strategy == "torch":
        chosen = {id(block) for _, block in found}
        apply_activation_checkpointing(
            loaded.model,
            checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_fn=checkpoint_fn("torch")),
            check_fn=lambda module: id(module) in chosen,
        )
        if compile is None:
            return None
        setting = BlockSetting(checkpoint=False)  # the wrappers are the blocks now
    elif strategy == "none":
        setting = BlockSetting(checkpoint=False)
    else:
        known = _SETTINGS.get(strategy)
        if known is None and strategy.startswith("budget:"):
            known = budget_setting(strategy, command, compile)
        if known is None:
            raise CheckpointUsageError(
                f"{command}: unknown strategy {strategy!r}; choose one of {list(ALL_STRATEGIES)} "
                "or budget:<fraction> (compiled blocks)."
            )
        setting = known
    return place(loaded.model, {name: dataclasses.replace(setting, compile=compile) for name, _ in found})
