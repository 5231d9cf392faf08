"""Function-level checkpointing: ``checkpoint``, ``checkpoint_sequential``, ``checkpointed``.

Drop-in for ``torch.utils.checkpoint``: same arguments, same results, same
error types. Differences, all deliberate:

* ``use_reentrant`` defaults to ``False`` (the recommended variant) with no
  warning when omitted;
* settings (``set_checkpoint_early_stop``, ``set_checkpoint_debug_enabled``)
  are context-local and frozen when each region starts;
* ``debug=True`` combines with a custom ``context_fn``;
* tensors nested in containers (lists, dicts, dataclasses registered as
  pytrees) are saved like top-level tensors, so in-place changes to them are
  caught and enclosing checkpoints account for them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar, overload

import torch

from remat._engine.frame import RegionOptions
from remat._engine.reentrant import ReentrantCheckpoint
from remat._engine.region import ContextFn, Region
from remat._engine.selective import create_selective_checkpoint_contexts
from remat._engine.verify import DETERMINISM_CHECKS
from remat._settings import resolve_debug, resolve_early_stop
from remat.compile import checkpoint_under_compile
from remat.errors import CheckpointTypeError, CheckpointUsageError

__all__ = ["checkpoint", "checkpoint_sequential", "checkpointed", "noop_context_fn"]

P = ParamSpec("P")
R = TypeVar("R")


def noop_context_fn() -> tuple[contextlib.nullcontext[None], contextlib.nullcontext[None]]:
    """The default ``context_fn``: no extra context for forward or recompute.

    Example:
        >>> import remat
        >>> forward_ctx, recompute_ctx = remat.noop_context_fn()
    """
    return contextlib.nullcontext(), contextlib.nullcontext()


def _checked_context_fn(context_fn: Any, api: str) -> ContextFn:
    def make() -> Any:
        pair = context_fn()
        if (
            not isinstance(pair, tuple)
            or len(pair) != 2
            or not all(hasattr(ctx, "__enter__") and hasattr(ctx, "__exit__") for ctx in pair)
        ):
            raise CheckpointTypeError(
                f"{api}: context_fn must return a tuple of two context managers "
                "(forward context, recompute context); it returned "
                f"{type(pair).__name__}. See remat.noop_context_fn for the shape."
            )
        return pair

    return make


def _validate(
    function: Any,
    use_reentrant: Any,
    context_fn: Any,
    determinism_check: Any,
    api: str,
) -> None:
    if not callable(function):
        raise CheckpointTypeError(
            f"{api}: the function to checkpoint must be callable, got "
            f"{type(function).__name__}. Pass the function first, then its arguments: "
            f"{api}(fn, *args)."
        )
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise CheckpointTypeError(
            f"{api}: use_reentrant must be True or False, got {use_reentrant!r}."
        )
    if not callable(context_fn):
        raise CheckpointTypeError(
            f"{api}: context_fn must be a callable returning two context managers, got "
            f"{type(context_fn).__name__}."
        )
    if determinism_check not in DETERMINISM_CHECKS:
        raise CheckpointUsageError(
            f"{api}: determinism_check must be one of {list(DETERMINISM_CHECKS)}, got "
            f"{determinism_check!r}."
        )


def with_policy(context_fn: Any, policy: Any, api: str) -> Any:
    """The ``context_fn`` that ``policy=`` stands for (``context_fn`` if no policy)."""
    if policy is None:
        return context_fn
    if context_fn is not noop_context_fn:
        raise CheckpointUsageError(
            f"{api}: pass either policy= or context_fn=, not both; a policy builds the "
            "selective-checkpoint contexts itself."
        )
    return functools.partial(create_selective_checkpoint_contexts, policy)


def region_options(
    api: str, *, early_stop: bool, determinism_check: str, debug: bool | None, preserve_rng_state: bool
) -> RegionOptions:
    """Freeze a region's settings, resolving the context-local overrides now."""
    return RegionOptions(
        early_stop=resolve_early_stop(early_stop),
        check_determinism=determinism_check == "default",
        debug=resolve_debug(debug),
        preserve_rng=preserve_rng_state,
        api=api,
    )


def _check_reentrant_arguments(kwargs: dict[str, Any], context_fn: Any, debug: Any, api: str) -> None:
    # Checked before the compile branch too: torch compiles a reentrant
    # checkpoint as a non-reentrant one, and code must not work only compiled.
    if kwargs:
        raise CheckpointUsageError(
            f"{api}(use_reentrant=True) passes no keyword arguments to the function; got "
            f"{sorted(kwargs)}. Use use_reentrant=False, or bind them with functools.partial."
        )
    if context_fn is not noop_context_fn or debug is not False:
        raise CheckpointUsageError(f"{api}: context_fn and debug work only with use_reentrant=False.")


def checkpoint(
    function: Callable[..., R],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    policy: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> R:
    """Run ``function(*args, **kwargs)`` without keeping its activations for backward.

    Only the inputs are kept; backward recomputes the function (once per
    backward call, stopping as soon as every needed tensor is back) and frees
    each recomputed tensor as soon as it is used. Gradients equal those of the
    plain call.

    Args:
        function: what to run. Called again in backward with the same inputs.
        *args, **kwargs: its inputs (tensors may be nested in lists/dicts).
        use_reentrant: ``False`` (default, recommended) uses saved-tensor hooks
            and supports ``autograd.grad``, kwargs, nesting and double
            backward. ``True`` is the classic autograd-Function variant.
        context_fn: returns two context managers, entered around the forward and
            around the recomputation (used for selective checkpointing).
        determinism_check: ``"default"`` checks that the recomputation saves
            tensors of the same shape, dtype and device; ``"none"`` skips it.
        debug: on a mismatch, list the operators of both runs with source lines.
        early_stop: stop the recomputation once every needed tensor is back.
        preserve_rng_state: replay the forward's CPU and device RNG state.
        policy: selective checkpointing without ``context_fn`` ceremony: a
            policy from :mod:`remat.policies` or any ``(ctx, op, *args,
            **kwargs) -> CheckpointPolicy | bool`` function, or a list of
            ``OpOverload``s to save. Cannot be combined with ``context_fn``.

    Example:
        >>> import torch, remat
        >>> layer = torch.nn.Linear(8, 8)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = remat.checkpoint(lambda t: layer(t).relu(), x)
        >>> y.sum().backward()
    """
    api = "remat.checkpoint"
    _validate(function, use_reentrant, context_fn, determinism_check, api)
    context_fn = with_policy(context_fn, policy, api)
    if use_reentrant:
        _check_reentrant_arguments(kwargs, context_fn, debug, api)
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the eager engine's hooks: use torch's compiler door
        # (docs/design/compile.md).
        return checkpoint_under_compile(  # type: ignore[no-any-return]
            function,
            args,
            kwargs,
            use_reentrant=use_reentrant,
            context_fn=None if context_fn is noop_context_fn else context_fn,
            debug=debug,
            determinism_check=determinism_check,
            preserve_rng_state=preserve_rng_state,
            api=api,
            policy=policy,
        )
    if use_reentrant:
        return ReentrantCheckpoint.apply(function, preserve_rng_state, api, *args)  # type: ignore[no-untyped-call,no-any-return]
    region = Region(
        function,
        options=region_options(
            api,
            early_stop=early_stop,
            determinism_check=determinism_check,
            debug=debug,
            preserve_rng_state=preserve_rng_state,
        ),
        context_fn=None if context_fn is noop_context_fn else _checked_context_fn(context_fn, api),
    )
    region.enter(args, kwargs)
    try:
        output = function(*args, **kwargs)
    except BaseException as exc:
        region.exit(exc)
        raise
    region.exit(None)
    return output


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[[Any], Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run callables in sequence, checkpointing all but the last of ``segments`` chunks.

    Args:
        functions: an ``nn.Sequential`` or a list of callables taking one value.
        segments: how many chunks to split them into (1 <= segments <= len).
        input: the value passed to the first callable.
        use_reentrant: as in :func:`checkpoint` (default ``False``).
        preserve_rng_state: as in :func:`checkpoint` (the only other keyword).

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> y = remat.checkpoint_sequential(model, 2, torch.randn(2, 8, requires_grad=True))
        >>> y.sum().backward()
    """
    api = "remat.checkpoint_sequential"
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise CheckpointUsageError(
            f"{api}: unexpected keyword arguments {sorted(kwargs)}; only use_reentrant and "
            "preserve_rng_state are accepted."
        )
    chain = list(functions.children()) if isinstance(functions, torch.nn.Sequential) else list(functions)
    if not all(callable(step) for step in chain):
        raise CheckpointTypeError(f"{api}: every element of functions must be callable.")
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise CheckpointTypeError(f"{api}: segments must be an int, got {type(segments).__name__}.")
    if not 1 <= segments <= len(chain):
        raise CheckpointUsageError(
            f"{api}: segments must be between 1 and the number of functions ({len(chain)}), "
            f"got {segments}."
        )

    def run(start: int, stop: int) -> Callable[[Any], Any]:
        def forward(value: Any) -> Any:
            for step in chain[start:stop]:
                value = step(value)
            return value

        return forward

    size = len(chain) // segments
    start = 0
    for _ in range(segments - 1):
        input = checkpoint(
            run(start, start + size),
            input,
            use_reentrant=use_reentrant,
            preserve_rng_state=preserve,
        )
        start += size
    return run(start, len(chain))(input)


# The checkpoint options are checkpoint()'s keyword-only parameters.
_OPTION_NAMES = frozenset(
    name
    for name, parameter in inspect.signature(checkpoint).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
)


@overload
def checkpointed(function: Callable[P, R], /, **options: Any) -> Callable[P, R]: ...
@overload
def checkpointed(
    function: None = None, /, **options: Any
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
def checkpointed(function: Callable[P, R] | None = None, /, **options: Any) -> Any:
    """Decorator: every call of the function runs under :func:`checkpoint`.

    Options are those of :func:`checkpoint` (``use_reentrant``, ``context_fn``,
    ``determinism_check``, ``debug``, ``early_stop``, ``preserve_rng_state``,
    ``policy``).

    Example:
        >>> import torch, remat
        >>> @remat.checkpointed(early_stop=True)
        ... def block(x):
        ...     return x.sin().cos()
        >>> block(torch.randn(3, requires_grad=True)).sum().backward()
    """
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise CheckpointUsageError(
            f"remat.checkpointed: unknown options {sorted(unknown)}; valid options are "
            f"{sorted(_OPTION_NAMES)}."
        )

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        _validate(
            fn,
            options.get("use_reentrant"),
            options.get("context_fn", noop_context_fn),
            options.get("determinism_check", "default"),
            "remat.checkpointed",
        )

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            call_options: dict[str, Any] = {**options, **kwargs}
            return checkpoint(fn, *args, **call_options)

        return wrapper

    return decorate if function is None else decorate(function)
