"""``checkpoint_module``: checkpoint a module in place with forward hooks.

The composable form (torch's is ``torch.distributed._composable.checkpoint``):
no wrapper, so the model's structure and every FQN stay as they are. Three
pieces, all methods of one :class:`_ModuleCheckpoint` object kept on the module,
drive the same :class:`~remat._engine.region.Region` as :func:`remat.checkpoint`:

* a forward pre-hook builds a region and ``enter(args, kwargs)`` it;
* a forward hook (first of the forward hooks) ``exit(None)`` it;
* an instance-level ``forward`` runs the class's forward and, if it raises,
  ``exit(exc)`` the region before the exception leaves, so a failed forward
  leaves no saved-tensor hooks behind.

The backward recomputes by calling the module again, its other hooks
included, as torch does (FSDP2's pre-forward hook unshards the parameters
there when needed). The recomputation covers what the forward's region
covered and nothing more: our pre-hook opens the recomputation's scope (RNG
and autocast of the forward, the selective-checkpointing replay, the hooks
that catch saved tensors) and hands the forward the inputs the region saved,
whatever hooks that ran before it made of them this time; our forward hook
closes the scope. Hooks that ran outside the region in the forward run
outside it again. While
torch.compile traces, the hooks are inert and the instance ``forward`` calls
:func:`remat.checkpoint.checkpoint` on the class's forward instead, the path
the compiler understands. Why it is built this way: ``docs/design/modules.md``.

Example:
    >>> import torch
    >>> from remat.composable import checkpoint_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    >>> _ = checkpoint_module(model[0])
    >>> model(torch.randn(2, 8, requires_grad=True)).sum().backward()
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import torch
from torch import nn

from remat._engine.forward_state import needs_function_path
from remat._engine.hooks import RecomputeScope
from remat._engine.region import ContextFn, Region
from remat.checkpoint import run_checkpoint
from remat.errors import CheckpointUsageError, UnsupportedCheckpointError
from remat.options import CheckpointOptions

__all__ = ["checkpoint_module", "remove_checkpoint_module"]

_API = "remat.checkpoint_module"
# Where the per-module object lives (an ordinary attribute: deepcopy and
# pickle carry it along with the hooks that are its bound methods).
_STATE = "_remat_checkpoint_module"

M = TypeVar("M", bound=nn.Module)


class _Call:
    """One call of a checkpointed module, from its pre-hook to its forward hook.

    A forward call holds its region; the call a recomputation makes holds the
    recomputation's scope instead (``region`` is None).
    """

    __slots__ = ("owner", "region", "returned", "scope", "started")

    def __init__(
        self, owner: _ModuleCheckpoint, region: Region | None, scope: RecomputeScope | None = None
    ) -> None:
        self.owner = owner
        self.region = region
        self.scope = scope
        self.started = False  # the forward began
        self.returned = False  # the forward returned normally


class _Rerun:
    """A recomputation's call of the module: its scope and the region's saved inputs."""

    __slots__ = ("args", "kwargs", "owner", "scope")

    def __init__(
        self,
        owner: _ModuleCheckpoint,
        scope: RecomputeScope,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.owner = owner
        self.scope = scope
        self.args = args
        self.kwargs = kwargs


# Calls whose region is open, innermost last, per thread/context: the calls of
# one thread nest, so the innermost one is always the call a hook belongs to.
_OPEN: ContextVar[tuple[_Call, ...]] = ContextVar("remat_open_module_calls", default=())
# The module call that a recomputation makes: its hooks open the scope instead
# of a region.
_RECOMPUTING: ContextVar[_Rerun | None] = ContextVar("remat_recomputing_module", default=None)


class _ModuleCheckpoint:
    """Options and hook methods of one checkpointed module."""

    def __init__(self, module: nn.Module, options: CheckpointOptions) -> None:
        self.module = module
        self.options = options
        self.context_fn: ContextFn | None = options.contexts()
        # The forward found on the instance before ours (usually none: the class's).
        self.previous_forward: Callable[..., Any] | None = module.__dict__.get("forward")
        self.handles: list[Any] = []

    def _inert(self) -> bool:
        # Compiling, or under torch.func.grad and its kin (saved-tensor hooks
        # off): the hooks stand aside and forward() checkpoints the call as a
        # function (docs/design/tracing.md).
        return torch.compiler.is_compiling() or (torch.is_grad_enabled() and needs_function_path())

    def pre_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._inert():
            return None
        rerun = _RECOMPUTING.get()
        if rerun is not None and rerun.owner is self:
            _RECOMPUTING.set(None)  # only that one call; a recursive call checkpoints again
            rerun.scope.open()
            _OPEN.set((*_OPEN.get(), _Call(self, None, rerun.scope)))
            # What the forward's region received: hooks that ran before this one
            # were outside the region, and must not transform the inputs twice.
            return rerun.args, rerun.kwargs
        region = Region(
            functools.partial(self._recompute, module),
            options=self.options.region_options(),
            context_fn=self.context_fn,
            caller_scopes_recompute=True,
        )
        region.enter(args, kwargs)
        _OPEN.set((*_OPEN.get(), _Call(self, region)))
        return None

    def forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        # Registered with always_call=True: also runs when a later pre-hook or
        # the forward raised an Exception. Only a call whose forward returned,
        # or never started, is ours to close; a failed forward closed its own.
        if self._inert():
            return
        calls = _OPEN.get()
        if (
            not calls
            or calls[-1].owner is not self
            or (calls[-1].started and not calls[-1].returned)
        ):
            return
        call = calls[-1]
        _OPEN.set(calls[:-1])
        if call.region is None:  # the recomputation's call: its region ends here too
            assert call.scope is not None, "remat bug: a module call without region or scope"
            call.scope.close(sys.exc_info()[1])
            return
        call.region.exit(None if call.started else sys.exc_info()[1])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Installed as the module's ``forward``; runs the original one."""
        original = self._original_forward()
        if self._inert():
            # Compiling: hooks are off; the checkpoint takes the compiler's path.
            # Options are fixed: every keyword is the forward's. (A closure, not
            # the forward itself, which may be a partial: Dynamo on torch 2.4
            # cannot answer callable() for a partial.)
            def forward(*positional: Any, **keywords: Any) -> Any:
                return original(*positional, **keywords)

            return run_checkpoint(self.options, forward, *args, **kwargs)
        calls = _OPEN.get()
        call = calls[-1] if calls and calls[-1].owner is self and not calls[-1].started else None
        if call is None or call.region is None:  # a recomputation, or forward() called directly
            return original(*args, **kwargs)
        call.started = True
        try:
            output = original(*args, **kwargs)
        except BaseException as exc:
            # Normally the innermost record; by identity in case an inner call
            # was interrupted before its forward hook could close its own.
            _OPEN.set(tuple(open_call for open_call in _OPEN.get() if open_call is not call))
            call.region.exit(exc)
            raise
        call.returned = True
        return output

    def _original_forward(self) -> Callable[..., Any]:
        if self.previous_forward is not None:
            return self.previous_forward
        # A partial rather than ``function.__get__``: dynamo before torch 2.13
        # cannot trace the descriptor call (checked 2.4.1, 2.11.0).
        return functools.partial(type(self.module).forward, self.module)

    def _recompute(
        self, module: nn.Module, scope: RecomputeScope, *args: Any, **kwargs: Any
    ) -> Any:
        open_calls = _OPEN.get()
        token = _RECOMPUTING.set(_Rerun(self, scope, args, kwargs))
        try:
            return module(*args, **kwargs)
        finally:
            _RECOMPUTING.reset(token)
            # A call cut short by early stop (not an Exception, so no forward
            # hook ran) leaves its record; the engine closes its scope.
            _OPEN.set(open_calls)


class _Forward:
    """The module's instance-level ``forward``: calls the checkpoint object's.

    A callable object rather than a bound method so that it can report the
    original forward's signature (tools such as Hugging Face's Trainer inspect
    ``model.forward`` to choose inputs); ``deepcopy`` copies it with its object.
    No ``__slots__``: Dynamo before torch 2.5 cannot read a slot of a user object
    (checked 2.4.1), and this object is called inside every compiled forward.
    """

    def __init__(self, checkpoint: _ModuleCheckpoint) -> None:
        self.checkpoint = checkpoint

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.checkpoint.forward(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.checkpoint._original_forward())





def checkpoint_module(module: M, **kwargs: Any) -> M:
    """Checkpoint every call of ``module`` in place, without a wrapper.

    Parameters, buffers, FQNs and the module tree stay unchanged. Each call
    of the module runs as a non-reentrant checkpointed region, recomputed
    once per backward.

    Args:
        module: the module to checkpoint (it is returned).
        **kwargs: options of :func:`remat.checkpoint` for the non-reentrant
            variant: ``policy``, ``context_fn`` (``None`` = no context, as in
            torch's composable API), ``preserve_rng_state``,
            ``determinism_check``, ``debug``, ``early_stop``;
            ``use_reentrant=False`` is accepted and ``True`` raises
            ``UnsupportedCheckpointError`` (a ``NotImplementedError``). Any
            other name is a ``CheckpointUsageError`` (a ``ValueError``).

    Applying it twice to one module is a ``CheckpointUsageError``; undo it
    with :func:`remove_checkpoint_module` first to change options.

    Example:
        >>> import torch
        >>> from remat.policies import save_matmuls
        >>> layer = checkpoint_module(torch.nn.Linear(8, 8), policy=save_matmuls)
        >>> layer(torch.randn(2, 8, requires_grad=True)).sum().backward()
    """
    if not isinstance(module, nn.Module):
        from remat.errors import CheckpointTypeError

        raise CheckpointTypeError(
            f"{_API}: expected an nn.Module, got {type(module).__name__}. To checkpoint a "
            "function use remat.checkpoint."
        )
    if kwargs.get("use_reentrant"):
        raise UnsupportedCheckpointError(
            f"{_API}: use_reentrant=True is not supported by the hook-based form (hooks "
            "cannot wrap the forward in an autograd.Function). Use "
            "remat.nn.checkpoint_wrapper(module, CheckpointImpl.REENTRANT) instead."
        )
    options = CheckpointOptions.from_kwargs(_API, kwargs)
    if _STATE in module.__dict__:
        raise CheckpointUsageError(
            f"{_API}: this {type(module).__name__} is already checkpointed. To change its "
            "options call remat.composable.remove_checkpoint_module(module) first."
        )
    state = _ModuleCheckpoint(module, options)
    state.handles = [
        module.register_forward_pre_hook(state.pre_hook, with_kwargs=True),
        # First of the forward hooks, so the region ends where the forward does.
        module.register_forward_hook(
            state.forward_hook, prepend=True, with_kwargs=True, always_call=True
        ),
    ]
    module.__dict__[_STATE] = state
    module.forward = _Forward(state)
    return module


def remove_checkpoint_module(module: nn.Module) -> nn.Module:
    """Undo :func:`checkpoint_module`: remove its hooks and restore ``forward``.

    Example:
        >>> import torch
        >>> layer = checkpoint_module(torch.nn.Linear(4, 4))
        >>> layer = remove_checkpoint_module(layer)
        >>> "forward" in vars(layer)
        False
    """
    state = module.__dict__.pop(_STATE, None) if isinstance(module, nn.Module) else None
    if state is None:
        raise CheckpointUsageError(
            f"remat.composable.remove_checkpoint_module: {type(module).__name__} is not checkpointed by "
            "remat.checkpoint_module."
        )
    for handle in state.handles:
        handle.remove()
    if state.previous_forward is None:
        del module.forward
    else:
        module.forward = state.previous_forward
    return module
