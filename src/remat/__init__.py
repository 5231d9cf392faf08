"""remat: activation checkpointing for PyTorch, drop-in compatible with
``torch.utils.checkpoint``.

Example:
    >>> import torch, remat
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> y = remat.checkpoint(lambda t: t.sin().cos(), x)
    >>> y.sum().backward()
"""

from remat import policies
from remat._engine.group import GraphExecGroup
from remat._engine.reentrant import check_backward_validity, detach_variable
from remat._engine.replay import DefaultDeviceType, get_device_states, set_device_states
from remat._engine.selective import SAC_IGNORED_OPS, create_selective_checkpoint_contexts
from remat._settings import set_checkpoint_debug_enabled, set_checkpoint_early_stop
from remat.checkpoint import checkpoint, checkpoint_sequential, checkpointed, noop_context_fn
from remat.errors import CheckpointError, RecomputeMismatchError, RematError
from remat.names import name
from remat.offload import no_offload, offload
from remat.policies import CheckpointPolicy, SelectiveCheckpointContext

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointPolicy",
    "DefaultDeviceType",
    "GraphExecGroup",
    "RecomputeMismatchError",
    "RematError",
    "SAC_IGNORED_OPS",
    "SelectiveCheckpointContext",
    "check_backward_validity",
    "checkpoint",
    "checkpoint_sequential",
    "checkpointed",
    "create_selective_checkpoint_contexts",
    "detach_variable",
    "get_device_states",
    "name",
    "no_offload",
    "noop_context_fn",
    "offload",
    "policies",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
    "set_device_states",
]
