"""Where a saved tensor lives: one value, and the one function that decides it.

Layer: storage (imports ``policies``, ``compression``, ``_scope``, ``_compat``
and ``errors``). Every path that keeps a tensor for backward anywhere but as it
is asks :func:`decide`, once per tensor:

=================== ============================================ ===============
origin              who asks                                     asked for
=================== ============================================ ===============
``"policy"``        a selective policy's decision for an op's     the decision's
                    output (``_engine/selective.py``, ``OpCache``) :func:`storage_for`
``"context"``       a tensor autograd saves under ``remat.offload``, the context's
                    ``remat.compress``, ``remat.exact``           storage
                    (``storage/contexts.py``)
``"region_input"``  a region's own input (``_engine/frame.py``,    the region's
                    ``Frame.save_inputs``)                        ``inputs`` option
``"graph"``         an intermediate a compiled graph saves, while  the context's
                    AOTAutograd traces the context's hook          storage
=================== ============================================ ===============

A plan's placement (``remat/placement.py``) does not decide: it turns a
``BlockSetting`` into one :class:`Storage` for what the block keeps, and hands
it to these paths. Inside code that torch.compile traces, the compiler owns
what a graph saves: :func:`under_compiler` says what becomes of each storage
there, and refuses what a compiler cannot do, in one error.

The walk of one tensor through these steps: ``docs/design/saved-tensor.md``.

Example:
    >>> import torch
    >>> from remat.compression import compression
    >>> fp8 = Storage.compressed(compression("fp8"))
    >>> x = torch.randn(64, 64, requires_grad=True)
    >>> decide(x, fp8, "context"), decide(x * 2, fp8, "context")
    (Storage('device'), Storage('compressed', fp8))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from remat._compat.autograd import base_of
from remat._scope import SAVING_REGION_INPUTS, SavedTensorEvent
from remat.errors import UnsupportedCheckpointError
from remat.policies import CheckpointPolicy, Compress, Decision

if TYPE_CHECKING:
    from remat.compression import Compression

__all__ = [
    "DEVICE",
    "HOST",
    "RECOMPUTE",
    "Origin",
    "Storage",
    "Where",
    "compressible",
    "decide",
    "event_of",
    "storage_for",
    "under_compiler",
]

Where = Literal["device", "recompute", "host", "compressed"]
Origin = Literal["policy", "context", "region_input", "graph"]


@dataclass(frozen=True)
class Storage:
    """Where a saved tensor lives until backward reads it.

    ``where`` is one of ``"device"`` (kept as it is), ``"recompute"``
    (nothing kept: backward recomputes it), ``"host"`` (a copy in host
    memory), ``"compressed"`` (a smaller copy on its device, in ``format``).
    ``must=False`` lets a compiler keep the tensor on its device instead
    (``PREFER_OFFLOAD``, ``Compress(..., must=False)``). Use :data:`DEVICE`,
    :data:`RECOMPUTE`, :data:`HOST` and :meth:`Storage.compressed`.

    Example:
        >>> HOST.saves, RECOMPUTE.saves
        (True, False)
    """

    where: Where
    format: Compression | None = None
    must: bool = True

    def __post_init__(self) -> None:
        if (self.where == "compressed") != (self.format is not None):
            raise AssertionError(f"remat bug: a {self.where!r} storage with format {self.format!r}")

    @classmethod
    def compressed(cls, format: Compression, *, must: bool = True) -> Storage:
        """Kept compressed on its device in ``format``."""
        return cls("compressed", format, must)

    @property
    def saves(self) -> bool:
        """Whether something is kept (anywhere) rather than recomputed."""
        return self.where != "recompute"

    @property
    def stored(self) -> bool:
        """Whether a stash keeps it (a host copy or a compressed copy)."""
        return self.where == "host" or self.where == "compressed"

    def __repr__(self) -> str:
        fields = [repr(self.where)]
        if self.format is not None:
            fields.append(str(self.format))
        if not self.must:
            fields.append("must=False")
        return f"Storage({', '.join(fields)})"


DEVICE = Storage("device")
"""Kept on its device, as it is."""
RECOMPUTE = Storage("recompute")
"""Not kept: backward recomputes it."""
HOST = Storage("host")
"""A copy in host memory, brought back for backward."""
_PREFER_HOST = Storage("host", must=False)
_PREFER_DEVICE = Storage("device", must=False)

_OF_POLICY = {
    CheckpointPolicy.MUST_SAVE: DEVICE,
    CheckpointPolicy.PREFER_SAVE: _PREFER_DEVICE,
    CheckpointPolicy.MUST_RECOMPUTE: RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE: Storage("recompute", must=False),
    CheckpointPolicy.MUST_OFFLOAD: HOST,
    CheckpointPolicy.PREFER_OFFLOAD: _PREFER_HOST,
}


def storage_for(decision: Decision) -> Storage:
    """The :class:`Storage` a policy's decision asks for (``MUST_SAVE``: the device, ...).

    Example:
        >>> storage_for(CheckpointPolicy.PREFER_OFFLOAD)
        Storage('host', must=False)
    """
    if isinstance(decision, Compress):
        return Storage.compressed(decision.compression, must=decision.must)
    return _OF_POLICY[decision]


def _parameter_storage(tensor: torch.Tensor) -> bool:
    """Parameters (and views of them, e.g. a transposed weight) live anyway."""
    if isinstance(tensor, torch.nn.Parameter):
        return True
    base = base_of(tensor)
    return base is not tensor and (isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad))


def decide(tensor: torch.Tensor, asked: Storage, origin: Origin, min_bytes: int = 0) -> Storage:
    """Where ``tensor`` lives, given what was ``asked`` for it and where it comes from.

    The rules, in one place (``docs/design/saved-tensor.md``):

    * the device and recomputation are what they are;
    * a policy's op output goes where the policy said, except that a format
      never compresses a dtype it does not shrink (integer, bool, or already
      as small): those outputs stay on the device;
    * any other tensor below ``min_bytes``, and any parameter or view of
      one, stays on the device (it lives anyway);
    * a host copy takes everything else;
    * compression takes only *activations*: tensors with autograd history,
      of a float dtype the format shrinks. Parameters, buffers, a model's
      inputs and a norm's statistics stay exact; so do a region's inputs
      saved under a ``remat.compress`` context (a recomputation from
      approximate inputs happens only where the region asks, with
      ``compress_inputs``). A compiled graph's intermediates (``"graph"``)
      carry no history while AOTAutograd traces them; their dtype decides.
    """
    where = asked.where
    if where == "device" or where == "recompute":
        return asked
    if origin == "policy":
        if where == "compressed" and not asked.format.applies_to(tensor.dtype):  # type: ignore[union-attr]
            return DEVICE
        return asked
    if where == "compressed":
        if not asked.format.applies_to(tensor.dtype):  # type: ignore[union-attr]
            return DEVICE
        if origin == "graph":
            return asked
        if tensor.grad_fn is None or (origin == "context" and SAVING_REGION_INPUTS.get()):
            return DEVICE
    if tensor.numel() * tensor.element_size() < min_bytes or _parameter_storage(tensor):
        return DEVICE
    return asked


def compressible(tensor: torch.Tensor, format: Compression, min_bytes: int = 1024) -> bool:
    """Whether a ``remat.compress`` block compresses ``tensor`` when autograd saves it.

    :func:`decide` for the context (tools that measure compression ask it
    too): an activation (autograd history: not a parameter or a view of one,
    a buffer, an input or a norm's statistics), of a float dtype ``format``
    makes smaller, of at least ``min_bytes``, and not a region's input.

    Example:
        >>> import torch
        >>> from remat.compression import compression
        >>> x = torch.randn(64, 64, requires_grad=True)
        >>> compressible(x, compression("fp8")), compressible(x * 2, compression("fp8"))
        (False, True)
    """
    return decide(tensor, Storage.compressed(format), "context", min_bytes).where == "compressed"


def under_compiler(storage: Storage, api: str, what: str) -> Storage:
    """What becomes of ``storage`` in code that torch.compile traces (``what``: who asked, for the error).

    The compiler's partitioner only keeps or recomputes (torch does not
    honour its CPU-offload tags): a host copy is kept on the device there
    (``must`` carried over, so ``MUST_OFFLOAD`` is ``MUST_SAVE``), as is a
    compression a compiler may override (``Compress(..., must=False)``). A
    compression that must happen is refused, the same way for every way of
    asking (a policy, ``compress_inputs``, a ``remat.compress`` block entered
    inside compiled code): a compiled graph compresses only through a
    ``remat.compress`` block *around* the compiled call (torch 2.11 and
    newer), whose hooks the compiler takes into its graphs.

    Example:
        >>> under_compiler(HOST, "remat.checkpoint", "a policy")
        Storage('device')
    """
    if storage.where == "host":
        return DEVICE if storage.must else _PREFER_DEVICE
    if storage.where != "compressed":
        return storage
    if not storage.must:
        return _PREFER_DEVICE
    raise UnsupportedCheckpointError(
        # (the format's name, not str() of the format: Dynamo 2.4 cannot trace that call)
        f"{api} under torch.compile: {what} keeps saved tensors compressed ({storage.format.format}), and a "  # type: ignore[union-attr]
        "compiled graph's saved tensors are the compiler's, which only keeps or recomputes them. "
        "Put remat.compress around the compiled call instead (torch 2.11 and newer compresses the "
        "graph's saved intermediates there), let the compiler keep the tensor with "
        "remat.policies.Compress(..., must=False), or run this part eagerly "
        "(docs/design/compression.md, 'Under torch.compile')."
    )


_EVENTS: dict[tuple[bool, str], SavedTensorEvent] = {
    (True, "device"): "policy_saved",
    (True, "host"): "policy_offloaded",
    (True, "compressed"): "policy_compressed",
    (False, "host"): "offloaded",
    (False, "compressed"): "compressed",
}


def event_of(storage: Storage, origin: Origin) -> SavedTensorEvent | None:
    """What a saved-tensor observer hears of a tensor decided to live in ``storage``
    (``remat._scope``'s events); None where nothing is reported (kept as it is outside
    a policy, or recomputed).

    Example:
        >>> from remat.storage.choice import DEVICE, HOST
        >>> event_of(HOST, "policy"), event_of(HOST, "region_input"), event_of(DEVICE, "context")
        ('policy_offloaded', 'offloaded', None)
    """
    return _EVENTS.get((origin == "policy", storage.where))
