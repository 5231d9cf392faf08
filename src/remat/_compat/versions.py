"""Version gates: facts about the installed torch, read once when this module loads.

Each gate is a function returning a constant, so a caller reads the fact
without comparing versions itself. The comparisons run here, at import:
gates are also asked inside code Dynamo traces (``remat.compile``), where
Dynamo cannot build a ``TorchVersion`` (a ``str`` subclass) on any release.
Each gate names the releases it was checked on and what differs below it;
its caller raises the error, or takes the other way, below the gate.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

__all__ = [
    "backward_from_edges_supported",
    "dynamo_traces_policy_objects",
    "flash_cpu_takes_grouped_heads",
    "static_compile_supported",
    "torch_has_selective_checkpointing",
]


def _at_least(release: str) -> bool:
    return bool(torch.torch_version.TorchVersion(torch.__version__) >= release)


_TORCH_HAS_SELECTIVE_CHECKPOINTING = hasattr(
    torch.utils.checkpoint, "create_selective_checkpoint_contexts"
)
_DYNAMO_TRACES_POLICY_OBJECTS = _at_least("2.9")
_FLASH_CPU_GQA_BACKWARD = _at_least("2.11")
_BACKWARD_FROM_EDGES = _at_least("2.7")
_DYNAMO_REFAKES_FAKE_INPUTS = _at_least("2.11")


def torch_has_selective_checkpointing() -> bool:
    """Whether ``torch.utils.checkpoint`` has its public selective-checkpoint API.

    ``CheckpointPolicy`` and ``create_selective_checkpoint_contexts`` appeared
    in torch 2.5 (absent on 2.4.1, present on 2.5.1-2.15.0, checked). remat's
    eager selective checkpointing is its own and works on every release; only
    the torch.compile path needs torch's, because the compiler's partitioner
    reads nothing but the decisions of torch's own dispatch modes.
    """
    return _TORCH_HAS_SELECTIVE_CHECKPOINTING


def dynamo_traces_policy_objects() -> bool:
    """Whether torch.compile can carry a :mod:`remat.policies` object into a region.

    remat's ready-made policies are frozen dataclasses holding frozensets of
    ops. Dynamo before torch 2.9 cannot treat them as constants ("is not a
    constant"; checked 2.5.1 and 2.7.1 fail, 2.9.1-2.15.0 pass), so the
    compiled path needs 2.9 for them; plain policy functions and op lists work
    from 2.5.
    """
    return _DYNAMO_TRACES_POLICY_OBJECTS


def backward_from_edges_supported() -> bool:
    """Whether ``torch.autograd.backward`` starts from a ``GradientEdge`` (a node
    and an output number, with no tensor): torch >= 2.7 (pytorch#144744; checked
    2.4.1: absent, 2.7.1, 2.11.0, 2.13.0, 2.15.0: present). Below it a reentrant
    region cannot give the gradient of a tensor it has only the edge of, and
    says so.
    """
    return _BACKWARD_FROM_EDGES


def static_compile_supported() -> bool:
    """Whether torch.compile can compile a module whose tensors are fake ones of another mode.

    Dynamo re-wraps fake inputs in its own fake-tensor mode from 2.11
    (checked 2.11.0, 2.13.0, 2.15.0); 2.4.1 and 2.7.1 pass the caller's fake
    tensors through, and inductor's front end refuses the two modes
    ("fake mode from tracing context doesn't match").
    """
    return _DYNAMO_REFAKES_FAKE_INPUTS


def flash_cpu_takes_grouped_heads() -> bool:
    """Whether the CPU flash-attention op differentiates grouped key/value heads.

    Its forward accepts fewer key/value heads than query heads, but on torch
    2.7.1 its backward returns a gradient of the query's head count for them
    (an error); 2.11.0, 2.13.0 and 2.15.0 are right. Releases in between were
    not checked, so they repeat the heads as transformers does without
    ``enable_gqa``.
    """
    return _FLASH_CPU_GQA_BACKWARD
