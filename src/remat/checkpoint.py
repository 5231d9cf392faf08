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

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

import torch

from remat._compat.tracers import outside_dynamo
from remat._engine.forward_state import needs_function_path
from remat._engine.region import Region
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.options import CheckpointOptions, noop_context_fn

if TYPE_CHECKING:
    from remat._engine.split import WeightPass
    from remat.compression import Compression

__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "checkpointed",
    "noop_context_fn",
    "run_checkpoint",
]

P = ParamSpec("P")
R = TypeVar("R")


def _check_reentrant_arguments(kwargs: dict[str, Any], api: str) -> None:
    # Checked before the compile branch too: torch compiles a reentrant
    # checkpoint as a non-reentrant one, and code must not work only compiled.
    if kwargs:
        raise CheckpointUsageError(
            f"{api}(use_reentrant=True) passes no keyword arguments to the function; got "
            f"{sorted(kwargs)}. Use use_reentrant=False, or bind them with functools.partial."
        )


def _check_function(function: Any, api: str) -> None:
    if not callable(function):
        raise CheckpointTypeError(
            f"{api}: the function to checkpoint must be callable, got "
            f"{type(function).__name__}. Pass the function first, then its arguments: "
            f"{api}(fn, *args)."
        )


_DEFAULTS = CheckpointOptions(api="remat.checkpoint")


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
    compress_inputs: Compression | str | None = None,
    weight_pass: WeightPass = "keep",
    **kwargs: Any,
) -> R:
    """Run ``function(*args, **kwargs)`` without keeping its activations for backward.

    Only the inputs are kept; backward recomputes the function (once per
    backward call, stopping as soon as every needed tensor is back) and frees
    each recomputed tensor as soon as it is used. Gradients equal those of the
    plain call.

    Args:
        function: what to run. Called again in backward with the same inputs.
        *args: its positional inputs (tensors may be nested in lists/dicts).
        **kwargs: its keyword inputs (as are keywords that are not options).
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
        compress_inputs: keep the inputs the region saves (its activation
            inputs) compressed in this format (``"bf16"``, ``"fp8"``,
            ``"int8"``, ...) instead of as they are. The forward is unchanged;
            the recomputation, and so the gradients, start from approximate
            values (``docs/design/compression.md``).
        weight_pass: in a pipeline stage whose backward is split into an
            input pass and a weight pass (the zero-bubble schedules),
            ``"keep"`` keeps the input pass's recomputation for the weight
            pass (one recomputation per microbatch), ``"recompute"``
            recomputes once more for the weight pass (less memory between
            the passes; ``docs/design/pipelining.md``).

    Example:
        >>> import torch, remat
        >>> layer = torch.nn.Linear(8, 8)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = remat.checkpoint(lambda t: layer(t).relu(), x)
        >>> y.sum().backward()
    """
    if (
        use_reentrant is None
        and context_fn is noop_context_fn
        and policy is None
        and determinism_check == "default"
        and debug is False
        and early_stop is True
        and preserve_rng_state is True
        and compress_inputs is None
        and weight_pass == "keep"
    ):
        options = _DEFAULTS  # the common call: nothing to validate or build
    else:
        chosen = (
            use_reentrant,
            policy,
            context_fn,
            determinism_check,
            debug,
            early_stop,
            preserve_rng_state,
            compress_inputs,
            weight_pass,
        )
        # Dynamo cannot replay a write to the module's cache: build under compile.
        options = _build_options(*chosen) if torch.compiler.is_compiling() else _options_of(chosen)
    return run_checkpoint(options, function, *args, **kwargs)


def _build_options(
    use_reentrant: bool | None,
    policy: Callable[..., Any] | None,
    context_fn: Callable[[], tuple[Any, Any]] | None,
    determinism_check: str,
    debug: bool | None,
    early_stop: bool,
    preserve_rng_state: bool,
    compress_inputs: Compression | str | None = None,
    weight_pass: WeightPass = "keep",
) -> CheckpointOptions:
    return CheckpointOptions(
        use_reentrant=use_reentrant,
        policy=policy,
        context_fn=context_fn,
        determinism_check=determinism_check,  # type: ignore[arg-type]  # checked there
        debug=debug,
        early_stop=early_stop,
        preserve_rng_state=preserve_rng_state,
        compress_inputs=compress_inputs,
        weight_pass=weight_pass,
        api="remat.checkpoint",
    )


# A call with options (a policy, early_stop=False...) is usually made again and
# again with the same ones: the validated value is reused instead of being
# built per call (docs/design/performance.md). Keyed by the ids of the option
# values; an entry holds those values, so its ids stay theirs (and True is not
# 1). A list of ops is not cached: the list could change between calls.
_OPTIONS: dict[tuple[int, ...], tuple[tuple[Any, ...], CheckpointOptions]] = {}
_OPTIONS_KEPT = 32


def _options_of(chosen: tuple[Any, ...]) -> CheckpointOptions:
    key = tuple(map(id, chosen))
    entry = _OPTIONS.get(key)
    if entry is not None:
        return entry[1]
    options = _build_options(*chosen)
    if not isinstance(chosen[1], list):
        if len(_OPTIONS) >= _OPTIONS_KEPT:
            _OPTIONS.clear()
        _OPTIONS[key] = (chosen, options)
    return options


def run_checkpoint(
    options: CheckpointOptions, function: Callable[..., R], /, *args: Any, **kwargs: Any
) -> R:
    """Checkpoint ``function(*args, **kwargs)`` with options fixed beforehand.

    What every front-end calls once it has built its :class:`CheckpointOptions`:
    every argument after ``function`` is the function's, even one named like
    an option. ``functools.partial(run_checkpoint, options)`` is a checkpoint
    function with fixed options (the wrappers' ``checkpoint_fn``).

    Example:
        >>> import torch, remat
        >>> from remat.checkpoint import run_checkpoint
        >>> options = remat.CheckpointOptions(early_stop=False)
        >>> run_checkpoint(options, torch.sin, torch.randn(3, requires_grad=True)).sum().backward()
    """
    api = options.api
    if not callable(function):
        _check_function(function, api)
    if options.use_reentrant:
        _check_reentrant_arguments(kwargs, api)
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the eager engine's hooks: use torch's compiler door
        # (docs/design/compile.md). Imported here: eager training never needs it
        # (Dynamo traces this import on every supported torch).
        from remat.compile import checkpoint_under_compile

        return checkpoint_under_compile(function, args, kwargs, options)  # type: ignore[no-any-return]
    return _run_eagerly(options, function, args, kwargs)


@outside_dynamo
def _run_eagerly(
    options: CheckpointOptions,
    function: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> R:
    # The eager engine is never compiled frame by frame (a graph break hands a frame back to Python).
    if options.use_reentrant:
        # Imported here: the reentrant variant is three modules that programs
        # using the default variant never need.
        from remat._engine.reentrant import run_reentrant

        rerun = run_reentrant(
            function, args, preserve_rng_state=options.preserve_rng_state, api=options.api
        )
        return rerun  # type: ignore[no-any-return]
    if torch.is_grad_enabled() and needs_function_path():
        from remat._engine.transformed import run_transformed  # loaded under a transform only

        # torch.func.grad and its kin turn saved-tensor hooks off: the region
        # runs as one recomputing autograd.Function (docs/design/tracing.md).
        return run_transformed(function, args, kwargs, options.region_options(), options.contexts())  # type: ignore[no-any-return]
    region = Region(function, options=options.region_options(), context_fn=options.contexts())
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
        **kwargs: only ``preserve_rng_state``, as in :func:`checkpoint`.

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


@overload
def checkpointed(function: Callable[P, R], /, **given: Any) -> Callable[P, R]: ...
@overload
def checkpointed(
    function: None = None, /, **given: Any
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
def checkpointed(function: Callable[P, R] | None = None, /, **given: Any) -> Any:
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
    options = CheckpointOptions.from_kwargs("remat.checkpointed", given)

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        _check_function(fn, options.api)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            # Options were fixed above: every call argument, whatever its name, is fn's.
            return run_checkpoint(options, fn, *args, **kwargs)

        return wrapper

    return decorate if function is None else decorate(function)
