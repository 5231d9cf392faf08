"""torch.compile support: checkpointed regions handed to the compiler's rematerialization.

Dynamo cannot trace remat's eager engine (it refuses ``saved_tensors_hooks``
and HigherOrderOperators it does not know). It knows one door:
``torch.utils.checkpoint.checkpoint``, which it turns into the
``tag_activation_checkpoint`` operator. AOTAutograd then tags every op of the
region with a ``recompute`` decision, and the min-cut partitioner recomputes
the tagged ops in the backward graph. So while compiling,
:func:`remat.checkpoint` calls :func:`checkpoint_under_compile`, which walks
through that door with remat's options translated:

* a remat policy (``policy=`` or a ``context_fn`` from
  :func:`remat.create_selective_checkpoint_contexts`) becomes a policy for
  torch's own selective-checkpoint modes, the only ones whose decisions reach
  the partitioner;
* offload decisions become saves (torch 2.13's partitioner does not honour
  its CPU-offload tags), so nothing a policy keeps is ever recomputed;
* any other ``context_fn`` must give two ``TorchDispatchMode``\\ s, else a
  :class:`~remat.errors.CheckpointTypeError`.

The reasoning, and what torch does with ``preserve_rng_state``, ``debug``,
``early_stop`` and ``use_reentrant`` under compile, is in
``docs/design/compile.md``.

Example:
    >>> import torch, remat
    >>> from remat import policies
    >>> def block(x, w):
    ...     return remat.checkpoint(lambda a: (a @ w).sigmoid(), x, policy=policies.save_matmuls)
    >>> x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    >>> torch.compile(block, backend="aot_eager", fullgraph=True)(x, w).sum().backward()
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from remat._compat.dispatch import TorchDispatchMode, checked_on_exit, is_compiler_tracing
from remat._compat.versions import dynamo_traces_policy_objects, torch_has_selective_checkpointing
from remat._engine.forward_state import ReplayState
from remat._engine.selective import RecordOps, ReplayOps, create_selective_checkpoint_contexts
from remat.errors import CheckpointTypeError, UnsupportedCheckpointError
from remat.options import CheckpointOptions
from remat.policies import Policy, ask_policy, save_nothing
from remat.storage.choice import Storage, storage_for, under_compiler

__all__ = ["CompilerPolicy", "checkpoint_under_compile", "compiler_contexts"]

# What each storage becomes for the partitioner, once under_compiler has said what
# a compiler does with it (a host copy is kept on the device: the nearest
# decision that never recomputes what a policy keeps).
_TAG_FOR = {
    ("device", True): "MUST_SAVE",
    ("device", False): "PREFER_SAVE",
    ("recompute", True): "MUST_RECOMPUTE",
    ("recompute", False): "PREFER_RECOMPUTE",
}


class CompilerPolicy:
    """A remat policy answering in torch's ``CheckpointPolicy``, for the compiler.

    Calls the wrapped policy with torch's protocol ``(ctx, op, *args, **kwargs)``,
    checks its answer like the eager engine does, and maps offload decisions
    to the matching save (see the module docstring).

    Example:
        >>> import torch
        >>> from remat import policies
        >>> decide = CompilerPolicy(policies.save_matmuls)
        >>> decide(None, torch.ops.aten.mm.default).name
        'MUST_SAVE'
    """

    __slots__ = ("policy", "refusal")

    def __init__(self, policy: Callable[..., Any]) -> None:
        self.policy = policy
        # The first error the policy gave (a refusal, or the policy's own
        # failure), raised once the forward mode has left the stack: raised
        # in the mode it would strand torch's checkpoint (see checked_on_exit).
        self.refusal: Exception | None = None

    def __call__(
        self, ctx: Any, op: Any, *args: Any, **kwargs: Any
    ) -> torch_checkpoint.CheckpointPolicy:
        try:
            decision = ask_policy(self.policy, ctx, op, args, kwargs)
            storage = under_compiler(
                storage_for(decision),
                "remat.checkpoint",
                f"the policy {self.policy!r}, for the output of {op},",
            )
        except Exception as error:  # raised, unchanged, by raise_refusal
            if self.refusal is None:
                self.refusal = error
            return (
                torch_checkpoint.CheckpointPolicy.MUST_SAVE
            )  # the trace goes on to the mode's exit
        return torch_checkpoint.CheckpointPolicy[_TAG_FOR[storage.where, storage.must]]

    def raise_refusal(self) -> None:
        """Raise the policy's first error, if it gave one (called as the forward mode exits)."""
        refusal, self.refusal = self.refusal, None
        if refusal is not None:
            raise refusal

    def __repr__(self) -> str:
        return f"CompilerPolicy({self.policy!r})"


def compiler_contexts(
    context_fn: Callable[[], Any] | None, preserve_rng_state: bool = True
) -> tuple[Any, Any]:
    """Call a remat ``context_fn`` and return contexts the compiler accepts.

    ``None`` (plain checkpointing) gives torch's selective modes with a policy
    that recomputes everything, which is what torch itself uses for a plain
    region under compile. remat's selective-checkpoint pair
    (:class:`~remat._engine.selective.RecordOps`,
    :class:`~remat._engine.selective.ReplayOps`) is rebuilt as torch's pair with
    the same policy and mutation setting; another pair of ``TorchDispatchMode``\\ s
    passes through unchanged; anything else is a :class:`CheckpointTypeError`.

    Runs when torch's checkpoint calls it: at AOTAutograd trace time, or per
    call when the region runs eagerly (``backend="eager"``, or after a graph
    break). Eagerly, with ``preserve_rng_state``, the contexts also replay the
    forward's RNG state in the recomputation: torch's compiled-checkpoint
    operator turns its own RNG preservation off and counts on the compiler,
    which an eager run does not have. Under a tracing backend torch wraps an
    error in its ``BackendCompilerFailed`` (``.inner_exception`` is remat's).

    Example:
        >>> import functools, torch, remat
        >>> ops = [torch.ops.aten.mm.default]
        >>> fwd, rec = compiler_contexts(
        ...     functools.partial(remat.create_selective_checkpoint_contexts, ops), False
        ... )
        >>> type(fwd).__name__
        '_CachingTorchDispatchMode'
    """
    forward, recompute = _dispatch_modes(context_fn)
    if not preserve_rng_state or is_compiler_tracing():
        return forward, recompute
    replay = _RngReplay()
    return replay.forward(forward), replay.recompute(recompute)


def _dispatch_modes(context_fn: Callable[[], Any] | None) -> tuple[Any, Any]:
    if context_fn is None:
        return _torch_modes(CompilerPolicy(save_nothing), allow_mutation=False)
    pair = context_fn()
    if isinstance(pair, tuple) and len(pair) == 2:
        forward, recompute = pair
        if isinstance(forward, RecordOps) and isinstance(recompute, ReplayOps):
            return _torch_modes(CompilerPolicy(forward.policy), forward.cache.allow_mutation)
        if isinstance(forward, TorchDispatchMode) and isinstance(recompute, TorchDispatchMode):
            return forward, recompute
    kinds = (
        ", ".join(type(ctx).__name__ for ctx in pair)
        if isinstance(pair, tuple)
        else type(pair).__name__
    )
    raise CheckpointTypeError(
        "remat.checkpoint under torch.compile: context_fn must return two TorchDispatchModes "
        f"(forward, recompute); {getattr(context_fn, '__name__', context_fn)!r} returned "
        f"({kinds}). The compiler can only honour selective-checkpoint decisions: pass "
        "policy=... or context_fn=functools.partial(remat.create_selective_checkpoint_contexts, "
        "policy), or run this region without torch.compile."
    )


def _torch_modes(policy: CompilerPolicy, allow_mutation: bool) -> tuple[Any, Any]:
    # torch's own modes: the only ones whose decisions reach the partitioner.
    forward, recompute = torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
        policy, allow_cache_entry_mutation=allow_mutation
    )
    return checked_on_exit(forward, policy.raise_refusal), recompute


class _RngReplay:
    """The forward's RNG state, captured on entering the forward, replayed in recompute."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: ReplayState | None = None

    @contextlib.contextmanager
    def forward(self, mode: Any) -> Iterator[None]:
        self.state = ReplayState.capture((), preserve_rng=True)
        with mode:
            yield

    @contextlib.contextmanager
    def recompute(self, mode: Any) -> Iterator[None]:
        assert self.state is not None, "remat bug: recompute before the forward captured RNG"
        with self.state.restore(), mode:
            yield


# A policy built inside the compiled function (``policy=save_only_names("x")``
# in a forward) is an object Dynamo made up: it cannot hand it to the
# compiler, which needs a constant ``context_fn``. remat's policies are frozen
# dataclasses of constants, so they travel as a recipe of constants
# (class, field values) and are rebuilt when the compiler calls context_fn.
_POLICY, _TUPLE, _VALUE = "policy", "tuple", "value"


def _recipe(value: Any) -> tuple[Any, ...]:
    if isinstance(value, Policy):
        fields = tuple(
            (field.name, _recipe(getattr(value, field.name)))
            for field in dataclasses.fields(value)
            if field.init
        )
        return (_POLICY, type(value), fields)
    if isinstance(value, tuple):
        return (_TUPLE, tuple(_recipe(item) for item in value))
    return (_VALUE, value)


def _rebuild(recipe: tuple[Any, ...]) -> Any:
    kind = recipe[0]
    if kind == _POLICY:
        return recipe[1](**{name: _rebuild(item) for name, item in recipe[2]})
    if kind == _TUPLE:
        return tuple(_rebuild(item) for item in recipe[1])
    return recipe[1]


def _rebuilt_contexts(recipe: tuple[Any, ...], *args: Any, **kwargs: Any) -> Any:
    return create_selective_checkpoint_contexts(_rebuild(recipe), *args, **kwargs)


def _policy_context_fn(policy: Any) -> Callable[[], Any]:
    # policy= itself: no context_fn to look inside.
    if isinstance(policy, Policy):
        return functools.partial(_rebuilt_contexts, _recipe(policy))
    return functools.partial(create_selective_checkpoint_contexts, policy)


def _constant_context_fn(context_fn: Callable[[], Any]) -> Callable[[], Any]:
    # A user's context_fn=functools.partial(remat.create_selective_checkpoint_contexts,
    # policy, ...): the torch-style spelling of policy=, carried the same way.
    if (
        isinstance(context_fn, functools.partial)
        and context_fn.func is create_selective_checkpoint_contexts
        and context_fn.args
        and isinstance(context_fn.args[0], Policy)
    ):
        return functools.partial(
            _rebuilt_contexts,
            _recipe(context_fn.args[0]),
            *context_fn.args[1:],
            **context_fn.keywords,
        )
    return context_fn


def checkpoint_under_compile(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: CheckpointOptions,
) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` inside a graph torch.compile traces.

    Called by the front-ends when ``torch.compiler.is_compiling()``. The region
    becomes torch's ``tag_activation_checkpoint`` operator, so the compiled
    backward recomputes it (or what ``options.policy`` does not save).
    ``debug`` and ``early_stop`` have no meaning there (the compiled
    recomputation is the forward's own graph); RNG is replayed by the
    compiler's RNG functionalization (``docs/design/compile.md``).

    Example:
        >>> import torch, remat
        >>> f = torch.compile(lambda x: remat.checkpoint(torch.sin, x), backend="aot_eager")
        >>> f(torch.randn(3, requires_grad=True)).sum().backward()
    """
    # The options were validated when built, reentrant rules included.
    if options.compress_inputs is not None:
        # (the format's name, not str() of the format: Dynamo 2.4 cannot trace that call)
        inputs = Storage.compressed(options.compress_inputs)  # type: ignore[arg-type]  # parsed in __post_init__
        under_compiler(inputs, options.api, f"compress_inputs={options.compress_inputs.format!r}")
    context_fn: Callable[[], Any] | None
    if options.policy is not None:
        # A list policy goes to the compiler as the list (a policy object needs torch >= 2.9).
        listed = options._listed_ops
        policy = options.policy if listed is None else list(listed)
        _require_selective_support(policy, options.api)
        context_fn = _policy_context_fn(policy)
    elif options.context_fn is not None:
        _require_selective_support(None, options.api)
        context_fn = _constant_context_fn(options.context_fn)
    elif not torch_has_selective_checkpointing():
        # torch 2.4 compiles a checkpoint only with its default context_fn.
        return torch_checkpoint.checkpoint(
            function,
            *args,
            use_reentrant=False,
            determinism_check=options.determinism_check,
            preserve_rng_state=options.preserve_rng_state,
            **kwargs,
        )
    else:
        context_fn = None
    return torch_checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=functools.partial(compiler_contexts, context_fn, options.preserve_rng_state),
        determinism_check=options.determinism_check,
        preserve_rng_state=options.preserve_rng_state,
        **kwargs,
    )


def _require_selective_support(policy: Any, api: str) -> None:
    # Raised while Dynamo traces: with fullgraph=True it reports only the
    # source line, hence the comments on the raise lines; otherwise the frame
    # falls back to eager Python, which raises the error itself.
    if not torch_has_selective_checkpointing():
        raise UnsupportedCheckpointError(  # a policy under torch.compile needs torch >= 2.5
            f"{api} under torch.compile: a policy or context_fn needs torch >= 2.5, where "
            f"torch.utils.checkpoint gained selective checkpointing; this is torch "
            f"{torch.__version__}. Upgrade torch, run this region eagerly (outside "
            "torch.compile), or drop policy=/context_fn= to checkpoint the whole region."
        )
    if isinstance(policy, Policy) and not dynamo_traces_policy_objects():
        raise UnsupportedCheckpointError(  # remat.policies objects under compile: torch >= 2.9
            f"{api} under torch.compile: the policy is a remat.policies object, which "
            f"torch.compile can carry into a region from torch 2.9 on; this is torch "
            f"{torch.__version__}. Upgrade torch, or pass a plain policy function "
            "(ctx, op, *args, **kwargs) -> CheckpointPolicy, or a list of ops to save "
            "(e.g. policy=[torch.ops.aten.mm.default])."
        )
