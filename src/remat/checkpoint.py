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
import torch.utils.checkpoint as torch_checkpoint

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


# The selective-checkpoint factories, which take a policy: passed as
# context_fn unbound, they would fail on the first call with a bare TypeError.
_UNBOUND_FACTORIES = tuple(
    factory
    for factory in (
        create_selective_checkpoint_contexts,
        getattr(torch_checkpoint, "create_selective_checkpoint_contexts", None),
    )
    if factory is not None
)


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
    if context_fn is not None and not callable(context_fn):
        hint = (
            " It looks like the contexts themselves: pass the function that makes them, e.g. "
            "functools.partial(remat.create_selective_checkpoint_contexts, policy)."
            if isinstance(context_fn, tuple)
            else ""
        )
        raise CheckpointTypeError(
            f"{api}: context_fn must be a callable returning two context managers, got "
            f"{type(context_fn).__name__}.{hint}"
        )
    if any(context_fn is factory for factory in _UNBOUND_FACTORIES):
        raise CheckpointTypeError(
            f"{api}: context_fn is create_selective_checkpoint_contexts itself, without its "
            "policy; context_fn is called with no arguments. Bind the policy first: "
            "context_fn=functools.partial(create_selective_checkpoint_contexts, policy) "
            "(policy: a policy function or a list such as [torch.ops.aten.mm.default]), or "
            "pass policy=policy instead of context_fn."
        )
    if determinism_check not in DETERMINISM_CHECKS:
        raise CheckpointUsageError(
            f"{api}: determinism_check must be one of {list(DETERMINISM_CHECKS)}, got "
            f"{determinism_check!r}."
        )


def with_policy(context_fn: Any, policy: Any, api: str) -> Any:
    """The ``context_fn`` that ``policy=`` stands for (``context_fn`` if no policy).

    ``context_fn=None`` means no context (the default of torch's composable
    ``checkpoint``): it becomes :func:`noop_context_fn`.
    """
    if context_fn is None:
        context_fn = noop_context_fn
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
    context_fn: Callable[[], tuple[Any, Any]] | None = noop_context_fn,
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
            around the recomputation (used for selective checkpointing); ``None``
            is the same as the default :func:`noop_context_fn`.
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
    return _run(
        function,
        args,
        kwargs,
        use_reentrant=use_reentrant,
        context_fn=context_fn,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        preserve_rng_state=preserve_rng_state,
        policy=policy,
        api="remat.checkpoint",
    )


def _run(
    function: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    use_reentrant: bool | None,
    context_fn: Callable[[], tuple[Any, Any]] | None,
    determinism_check: str,
    debug: bool,
    early_stop: bool,
    preserve_rng_state: bool,
    policy: Callable[..., Any] | None,
    api: str,
) -> R:
    """:func:`checkpoint` with the function's arguments and the options kept apart.

    Front-ends whose options are fixed beforehand (:func:`checkpointed`) call
    this, so no argument of the function can be mistaken for an option.
    """
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
    chain = _steps(functions, api)
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


def _steps(functions: Any, api: str) -> list[Callable[[Any], Any]]:
    """The callables of ``checkpoint_sequential``'s ``functions``, checked."""
    accepted = (
        "functions must be an nn.Sequential, or a list, tuple or nn.ModuleList of callables "
        "each taking the previous one's output"
    )
    chain: list[Callable[[Any], Any]]
    if isinstance(functions, torch.nn.Sequential):
        chain = list(functions.children())
    elif isinstance(functions, (str, bytes)) or not hasattr(functions, "__iter__"):
        single = (
            f" To checkpoint one {type(functions).__name__}, call remat.checkpoint(it, input)."
            if callable(functions)
            else ""
        )
        raise CheckpointTypeError(f"{api}: {accepted}; got {type(functions).__name__}.{single}")
    else:
        chain = list(functions)
    for index, step in enumerate(chain):
        if not callable(step):
            raise CheckpointTypeError(
                f"{api}: {accepted}; element {index} is {type(step).__name__}, not callable."
            )
    return chain


# The checkpoint options are checkpoint()'s keyword-only parameters.
_OPTION_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(checkpoint).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
}
_OPTION_NAMES = frozenset(_OPTION_DEFAULTS)


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
    ``policy``), fixed here: every argument of a call goes to the function,
    also one named like an option (``block(x, debug=True)`` passes ``debug``
    to ``block``).

    Example:
        >>> import torch, remat
        >>> @remat.checkpointed(early_stop=True)
        ... def block(x):
        ...     return x.sin().cos()
        >>> block(torch.randn(3, requires_grad=True)).sum().backward()
    """
    api = "remat.checkpointed"
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise CheckpointUsageError(
            f"{api}: unknown options {sorted(unknown)}; valid options are "
            f"{sorted(_OPTION_NAMES)}."
        )

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        chosen = {**_OPTION_DEFAULTS, **options}
        _validate(fn, chosen["use_reentrant"], chosen["context_fn"], chosen["determinism_check"], api)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            # Options were fixed above: every call argument, whatever its name, is fn's.
            return _run(fn, args, kwargs, api=api, **chosen)

        return wrapper

    return decorate if function is None else decorate(function)
