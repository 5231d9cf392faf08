"""A checkpointed region as an explicit object: ``enter(args, kwargs)``, run, ``exit(exc)``.

Every front-end (the :func:`remat.checkpoint` function, module wrappers, the
hook-based ``checkpoint_module``) drives this one object::

    region = Region(fn, options=..., context_fn=...)
    region.enter(args, kwargs)          # save inputs, capture RNG/autocast, push hooks
    try:
        out = fn(*args, **kwargs)
    except BaseException as exc:
        region.exit(exc)                # pops everything, then the caller re-raises
        raise
    region.exit(None)

By default the backward reruns ``recompute_fn(*args, **kwargs)`` under the
region's recomputation scope. With ``caller_scopes_recompute=True`` it calls
``recompute_fn(scope, *args, **kwargs)`` and the caller opens and closes the
:class:`~remat._engine.hooks.RecomputeScope` itself, around exactly the part
that the forward's region covered (``checkpoint_module``'s hooks).

Under ``torch.no_grad()`` a region is inert: nothing is saved, nothing will be
recomputed, and the function simply runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from remat._engine.forward_state import ReplayState, region_transform
from remat._engine.frame import Frame, RegionOptions, flatten_inputs
from remat._engine.hooks import ForwardHooks
from remat._engine.split import microbatch_of_running_stage
from remat._engine.verify import OpLog
from remat._scope import Nested
from remat.errors import CheckpointError, CheckpointStateError

__all__ = ["ContextFn", "Region"]

ContextFn = Callable[[], tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]]


# Under no_grad a region only marks that it was entered (nullcontext is reusable).
_NOTHING_TO_UNDO = contextlib.nullcontext()


class Region:
    """One checkpointed call. See the module docstring for the protocol."""

    __slots__ = ("_context_fn", "_frame", "_stack", "caller_scopes_recompute", "options", "recompute_fn")

    def __init__(
        self,
        recompute_fn: Callable[..., Any],
        *,
        options: RegionOptions,
        context_fn: ContextFn | None = None,
        caller_scopes_recompute: bool = False,
    ) -> None:
        self.recompute_fn = recompute_fn
        self.caller_scopes_recompute = caller_scopes_recompute
        self.options = options
        self._context_fn = context_fn
        self._frame: Frame | None = None
        self._stack: contextlib.AbstractContextManager[Any] | None = None

    @property
    def active(self) -> bool:
        """Whether the forward is being checkpointed (False under no_grad)."""
        return self._frame is not None

    def enter(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Start the region's forward: save inputs and push the saved-tensor hooks."""
        if self._stack is not None:
            raise CheckpointStateError(f"{self.options.api}: a Region cannot be entered twice")
        if not torch.is_grad_enabled():
            self._stack = _NOTHING_TO_UNDO
            return
        options = self.options
        transform = region_transform(options.api, reentrant=False)
        forward_context, recompute_context = (
            self._context_fn() if self._context_fn is not None else (None, None)
        )
        forward_log = OpLog() if options.debug else None
        leaves, spec, tensors = flatten_inputs(args, kwargs)
        frame = Frame(
            self.recompute_fn,
            options,
            ReplayState.capture(tensors, preserve_rng=options.preserve_rng),
            recompute_context,
            forward_log,
            caller_scopes_recompute=self.caller_scopes_recompute,
        )
        frame.transform = transform
        frame.split = microbatch_of_running_stage()
        frame.save_inputs(leaves, spec, tensors)
        hooks = ForwardHooks(frame)
        if forward_context is None and forward_log is None:
            # The usual region: its hooks are the only context (no ExitStack).
            hooks.__enter__()
            self._frame, self._stack = frame, hooks
            return
        contexts: tuple[contextlib.AbstractContextManager[Any], ...] = (hooks,)
        if forward_context is not None:
            contexts += (forward_context,)
        if forward_log is not None:
            contexts += (forward_log,)
        stack = Nested(contexts)
        stack.__enter__()
        self._frame, self._stack = frame, stack

    def exit(self, exc: BaseException | None) -> None:
        """End the forward. Pass the exception the forward raised, if any.

        Raises :class:`~remat.errors.CheckpointError` if a ``context_fn``
        context swallowed that exception (a failed forward has no value to return).
        """
        stack, frame = self._stack, self._frame
        if stack is None:
            raise CheckpointStateError(f"{self.options.api}: Region.exit() without enter()")
        self._stack = None
        if exc is None:
            stack.__exit__(None, None, None)
        elif stack.__exit__(type(exc), exc, exc.__traceback__):
            raise CheckpointError(
                f"{self.options.api}: the forward context returned by context_fn suppressed "
                f"an exception of the checkpointed function ({type(exc).__name__}: {exc}). "
                "A failed forward has no output to return; let the exception propagate."
            ) from exc
        if frame is None:
            return
        frame.forward_done = True
        replay = frame.replay
        if exc is None and replay.preserve_rng and not replay.device_was_initialized:
            replay.check_device_unchanged(self.options.api)

