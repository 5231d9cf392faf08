"""Let tools see what checkpointed regions do with saved tensors.

Saved-tensor hooks nest: the innermost set wins, so a tool's own outer hooks
never see tensors saved inside a remat region or under ``remat.offload``. A
tool that wants to (the saved-tensor report in :mod:`remat.memory`) installs a
callback with :func:`observe_saved_tensors`; regions and offload contexts
*entered* while it is active read it once, at entry, and call it during the
forward with one of these events:

``"region_saved"``
    autograd saved this tensor inside a checkpointed region; it is not
    stored: backward recomputes it (or replays a policy's cached output).
``"policy_saved"``
    a selective policy kept this op output on its device (usually reported
    as ``region_saved`` too, right after; match the two by storage).
``"policy_offloaded"``
    a selective policy kept a host copy of this op output.
``"offloaded"``
    ``remat.offload`` moved this saved tensor to host memory.

Nothing is reported when no callback is installed; the hot path then pays one
``None`` check per saved tensor.

Example:
    >>> import torch, remat
    >>> from remat._engine.observe import observe_saved_tensors
    >>> events = []
    >>> x = torch.randn(3, requires_grad=True)
    >>> with observe_saved_tensors(lambda event, t: events.append(event)):
    ...     y = remat.checkpoint(torch.sin, x)
    >>> events
    ['region_saved']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Literal

import torch

__all__ = ["SavedTensorEvent", "SavedTensorObserver", "current_observer", "observe_saved_tensors"]

SavedTensorEvent = Literal["region_saved", "policy_saved", "policy_offloaded", "offloaded"]
SavedTensorObserver = Callable[[SavedTensorEvent, torch.Tensor], None]

_observer: ContextVar[SavedTensorObserver | None] = ContextVar("remat_saved_tensor_observer", default=None)


def current_observer() -> SavedTensorObserver | None:
    """The callback regions entered now should report to, if any."""
    return _observer.get()


@contextlib.contextmanager
def observe_saved_tensors(callback: SavedTensorObserver) -> Iterator[None]:
    """Report saved-tensor events of regions entered inside the block to ``callback``."""
    if not callable(callback):
        raise TypeError(
            f"observe_saved_tensors: callback must be callable as callback(event, tensor), "
            f"got {type(callback).__name__}"
        )
    token = _observer.set(callback)
    try:
        yield
    finally:
        _observer.reset(token)
