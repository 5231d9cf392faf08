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
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from typing import Any

import torch

from remat._compat import pop_saved_tensor_hooks, push_saved_tensor_hooks

__all__ = ["INSIDE_REGION", "Nested", "RegionHooks", "in_region"]

INSIDE_REGION: ContextVar[bool] = ContextVar("remat_inside_region", default=False)
"""True while a region's hooks are active (:class:`RegionHooks` and the engine's
recomputation set it)."""


def in_region() -> bool:
    """True inside a remat region's forward or recomputation."""
    return INSIDE_REGION.get()


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
        self._token = INSIDE_REGION.set(True)

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            INSIDE_REGION.reset(self._token)
            self._token = None
        pop_saved_tensor_hooks()


class Nested:
    """Context managers entered in order and exited in reverse, as one.

    What ``contextlib.ExitStack`` does for a fixed tuple, at a fraction of its
    cost: a selective region enters its dispatch mode around its hooks in
    every forward and recomputation (docs/design/performance.md). An exception
    a context suppresses is gone for the contexts outside it; one raised by an
    ``__exit__`` replaces the one in flight (chained to it), as in nested
    ``with`` statements. ``__exit__`` returns True when an exception was
    suppressed.

    Example:
        >>> import contextlib
        >>> with Nested((contextlib.nullcontext(), contextlib.suppress(KeyError))):
        ...     raise KeyError("gone")
    """

    __slots__ = ("_contexts", "_entered")

    def __init__(self, contexts: tuple[AbstractContextManager[Any], ...]) -> None:
        self._contexts = contexts
        self._entered = 0

    def __enter__(self) -> None:
        try:
            for context in self._contexts:
                context.__enter__()
                self._entered += 1
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)
            raise

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> bool:
        entered, self._entered = self._entered, 0
        original = exc
        for context in reversed(self._contexts[:entered]):
            try:
                if context.__exit__(kind, exc, traceback):
                    kind = exc = traceback = None
            except BaseException as error:
                if error is not exc and error.__context__ is None:
                    error.__context__ = exc
                kind, exc, traceback = type(error), error, error.__traceback__
        if exc is not None and exc is not original:
            raise exc
        return original is not None and exc is None
