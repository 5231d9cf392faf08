"""Whether code runs inside a checkpointed region's forward or recomputation.

Saved-tensor contexts that would steal a region's tensors (``remat.offload``
and its opt-out) consult this when they are entered: inside a region every
saved tensor already belongs to the region, and a context entered there must
stand aside, or the recomputation would save fewer tensors than the forward.

"Inside a region" is exactly "a region's saved-tensor hooks are active", so
the hooks themselves mark it (:class:`RegionHooks`); nothing else is pushed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any

import torch

from remat._compat import pop_saved_tensor_hooks, push_saved_tensor_hooks

__all__ = ["RegionHooks", "in_region"]

_inside: ContextVar[bool] = ContextVar("remat_inside_region", default=False)


def in_region() -> bool:
    """True inside a remat region's forward or recomputation."""
    return _inside.get()


class RegionHooks:
    """Saved-tensor hooks of a region; while active, :func:`in_region` is True.

    The same as ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``, with
    the hooks pushed directly (:func:`remat._compat.push_saved_tensor_hooks`):
    every region enters two of these, one for its forward and one per
    recomputation (docs/design/performance.md).
    """

    __slots__ = ("_token", "pack_hook", "unpack_hook")

    def __init__(self, pack_hook: Callable[[torch.Tensor], Any], unpack_hook: Callable[[Any], torch.Tensor]) -> None:
        self.pack_hook = pack_hook
        self.unpack_hook = unpack_hook
        self._token: Token[bool] | None = None

    def __enter__(self) -> None:
        push_saved_tensor_hooks(self.pack_hook, self.unpack_hook)
        self._token = _inside.set(True)

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _inside.reset(self._token)
            self._token = None
        pop_saved_tensor_hooks()
