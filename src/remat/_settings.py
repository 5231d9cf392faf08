"""Context-local knobs, read once when a region starts.

Each knob lives in a :class:`contextvars.ContextVar`, so a setting made in one
thread or asyncio task never leaks into another. The engine reads the knobs a
single time, in :func:`remat._engine.region.Region` construction, and freezes
them into the region's options; hooks that run later (backward may run on
another thread) never consult ambient state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from remat.errors import CheckpointTypeError

__all__ = [
    "overrides",
    "resolve_debug",
    "resolve_early_stop",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
]

_EARLY_STOP: ContextVar[bool | None] = ContextVar("remat_early_stop", default=None)
_DEBUG: ContextVar[bool | None] = ContextVar("remat_debug", default=None)


@contextlib.contextmanager
def set_checkpoint_early_stop(enable: bool) -> Iterator[None]:
    """Override ``early_stop`` for every checkpoint whose forward runs inside.

    Early stop ends the recomputation as soon as every tensor the backward
    needs is back. Only the forward needs to run under this context; the
    setting is frozen into each region when it starts.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(3, requires_grad=True)
        >>> with remat.set_checkpoint_early_stop(False):
        ...     y = remat.checkpoint(torch.sin, x)
        >>> y.sum().backward()
    """
    if not isinstance(enable, bool):
        raise CheckpointTypeError(
            f"set_checkpoint_early_stop(enable) takes a bool, got {type(enable).__name__}"
        )
    token = _EARLY_STOP.set(enable)
    try:
        yield
    finally:
        _EARLY_STOP.reset(token)


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None) -> Iterator[None]:
    """Turn the checkpoint debug log on or off for regions started inside.

    ``True``/``False`` override every checkpoint's ``debug=`` argument;
    ``None`` defers to the argument. With debug on, a recompute mismatch
    error lists the operators of the forward and of the recompute with the
    user's source lines, and names the first operator that differs.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(3, requires_grad=True)
        >>> with remat.set_checkpoint_debug_enabled(True):
        ...     y = remat.checkpoint(torch.sin, x)
        >>> y.sum().backward()
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise CheckpointTypeError(
            "set_checkpoint_debug_enabled(enabled) takes True, False or None, "
            f"got {type(enabled).__name__}"
        )
    token = _DEBUG.set(enabled)
    try:
        yield
    finally:
        _DEBUG.reset(token)


def resolve_early_stop(argument: bool) -> bool:
    """The early-stop setting in force: the context override, else the argument."""
    override = _EARLY_STOP.get()
    return argument if override is None else override


def resolve_debug(argument: bool | None) -> bool:
    """The debug setting in force: the context override, else the argument."""
    override = _DEBUG.get()
    if override is not None:
        return override
    return bool(argument)


def overrides() -> tuple[bool | None, bool | None]:
    """The context overrides of (early stop, debug), None where not set.

    Read by every region: both in one call; a front-end caches what it derives
    from them.
    """
    return _EARLY_STOP.get(), _DEBUG.get()
