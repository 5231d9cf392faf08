"""remat: activation checkpointing for PyTorch, drop-in compatible with
``torch.utils.checkpoint``.

The top level holds two kinds of names (``docs/api.md`` lists both):
torch's, which behave as in ``torch.utils.checkpoint``, torch's checkpoint
wrappers and its composable checkpoint (switch the import, keep the code),
and remat's own: options, policies and names, offload and compression, one placement
mechanism (:func:`place`, :func:`apply_config`), the planner and chunked
losses. Subpackages: :mod:`remat.nn`, :mod:`remat.composable`,
:mod:`remat.memory`, :mod:`remat.planner`, :mod:`remat.integrations`; the
``remat`` command is :mod:`remat.cli`, which the library never imports.

Example:
    >>> import torch, remat
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> y = remat.checkpoint(lambda t: t.sin().cos(), x)
    >>> y.sum().backward()
"""

import importlib
from typing import TYPE_CHECKING, Any

from remat import policies
from remat._engine.forward_state import DefaultDeviceType, get_device_states, set_device_states
from remat._engine.selective import SAC_IGNORED_OPS, create_selective_checkpoint_contexts
from remat._settings import set_checkpoint_debug_enabled, set_checkpoint_early_stop
from remat.checkpoint import checkpoint, checkpoint_sequential, checkpointed, noop_context_fn
from remat.errors import CheckpointError, RecomputeMismatchError, RematError
from remat.names import name

# Through the old package path: importing the submodule ``remat.offload`` sets the
# attribute ``remat.offload``, which must then be rebound to the context class.
from remat.offload import compress, exact, no_offload, offload
from remat.options import CheckpointOptions
from remat.policies import CheckpointPolicy, SelectiveCheckpointContext

if TYPE_CHECKING:
    from remat import composable as composable
    from remat import nn as nn
    from remat._engine.group import GraphExecGroup
    from remat._engine.reentrant import check_backward_validity, detach_variable
    from remat.composable import checkpoint_module, remove_checkpoint_module
    from remat.compression import Compression
    from remat.config import CheckpointConfig, apply_config, config_from_toml
    from remat.losses import chunked_head_loss, chunked_loss
    from remat.nn import (
        ActivationWrapper,
        CheckpointImpl,
        CheckpointWrapper,
        OffloadWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
        every_nth,
        offload_wrapper,
    )
    from remat.placement import BlockSetting, Placement, place
    from remat.planner import Plan, plan

# Loaded on first use (docs/design/architecture.md, "What import remat loads"):
# a script that calls remat.checkpoint needs none of these. The planner brings
# its solvers and the memory tracker.
_NN = (
    "ActivationWrapper",
    "CheckpointImpl",
    "CheckpointWrapper",
    "OffloadWrapper",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "every_nth",
    "offload_wrapper",
)
_LAZY = {
    **dict.fromkeys(_NN, "remat.nn"),
    "checkpoint_module": "remat.composable",
    "remove_checkpoint_module": "remat.composable",
    "GraphExecGroup": "remat._engine.group",
    "check_backward_validity": "remat._engine.reentrant",
    "detach_variable": "remat._engine.reentrant",
    "CheckpointConfig": "remat.config",
    "apply_config": "remat.config",
    "config_from_toml": "remat.config",
    "Plan": "remat.planner",
    "BlockSetting": "remat.placement",
    "Placement": "remat.placement",
    "place": "remat.placement",
    "chunked_head_loss": "remat.losses",
    "chunked_loss": "remat.losses",
    "Compression": "remat.compression",
    "plan": "remat.planner",
}
# Subpackages reached as attributes (remat.nn.checkpoint_wrapper) without an import.
_LAZY_MODULES = (
    "nn", "composable", "memory", "planner", "integrations", "config", "losses", "placement", "compression"
)


def __getattr__(attribute: str) -> Any:
    module = _LAZY.get(attribute)
    if module is not None:
        value = getattr(importlib.import_module(module), attribute)
    elif attribute in _LAZY_MODULES:
        value = importlib.import_module(f"remat.{attribute}")
    else:
        raise AttributeError(f"module 'remat' has no attribute {attribute!r}")
    globals()[attribute] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (tool.hatch.version)

__all__ = [
    "ActivationWrapper",
    "BlockSetting",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointImpl",
    "CheckpointOptions",
    "CheckpointPolicy",
    "CheckpointWrapper",
    "Compression",
    "DefaultDeviceType",
    "GraphExecGroup",
    "OffloadWrapper",
    "Placement",
    "Plan",
    "RecomputeMismatchError",
    "RematError",
    "SAC_IGNORED_OPS",
    "SelectiveCheckpointContext",
    "apply_activation_checkpointing",
    "apply_config",
    "check_backward_validity",
    "checkpoint",
    "checkpoint_module",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "checkpointed",
    "chunked_head_loss",
    "chunked_loss",
    "compress",
    "config_from_toml",
    "create_selective_checkpoint_contexts",
    "detach_variable",
    "every_nth",
    "exact",
    "get_device_states",
    "name",
    "no_offload",
    "noop_context_fn",
    "offload",
    "offload_wrapper",
    "place",
    "plan",
    "policies",
    "remove_checkpoint_module",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
    "set_device_states",
]
