"""``CheckpointOptions``: the one value every front-end builds and the engine reads.

Layer: above the engine (``remat._engine``), below the front-ends
(``remat.compile``, ``remat.checkpoint``, ``remat.nn``, ``remat.composable``,
``remat.integrations``). Each front-end turns its keyword arguments into one
:class:`CheckpointOptions`, validated once, where defaults live; the eager
engine and the compile path read its fields. ``policy`` is a field of its own,
not a ``context_fn`` in disguise, so the compile path reads it directly.
Design: ``docs/design/architecture.md`` ("One options value").

Example:
    >>> import torch, remat
    >>> from remat.policies import save_matmuls
    >>> options = remat.CheckpointOptions(policy=save_matmuls, early_stop=False)
    >>> options.replace(debug=True).debug
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch.utils.checkpoint as torch_checkpoint

from remat._engine.frame import RegionOptions
from remat._engine.region import ContextFn
from remat._engine.selective import SelectiveContexts, create_selective_checkpoint_contexts
from remat._engine.verify import DETERMINISM_CHECKS
from remat._settings import overrides, resolve_debug, resolve_early_stop
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.policies import policy_of_ops
from remat.storage.choice import DEVICE, Storage

if TYPE_CHECKING:
    from remat._engine.split import WeightPass
    from remat.compression import Compression

__all__ = ["CheckpointOptions", "noop_context_fn"]


def noop_context_fn() -> tuple[contextlib.nullcontext[None], contextlib.nullcontext[None]]:
    """The default ``context_fn``: no extra context for forward or recompute.

    Example:
        >>> import remat
        >>> forward_ctx, recompute_ctx = remat.noop_context_fn()
    """
    return contextlib.nullcontext(), contextlib.nullcontext()


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

# Reentrant checkpointing has no saved-tensor hooks: none of these apply.
_NON_REENTRANT_ONLY = ("policy", "context_fn", "debug")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """How a region is checkpointed: frozen, validated when built.

    Every front-end (:func:`remat.checkpoint`, :func:`remat.checkpointed`,
    the :mod:`remat.nn` wrappers, :func:`remat.checkpoint_module`, the
    Hugging Face integration, the torch.compile path) builds one of these
    from its keyword arguments; the fields are :func:`remat.checkpoint`'s
    options, with the same defaults. A bad value is a
    :class:`~remat.errors.CheckpointTypeError` or
    :class:`~remat.errors.CheckpointUsageError` naming ``api``.

    Attributes:
        use_reentrant: the classic autograd-Function variant (``None`` is
            ``False``, the recommended default).
        policy: selective checkpointing: a :mod:`remat.policies` policy, a
            ``(ctx, op, *args, **kwargs)`` function, or ``OpOverload``\\ s to save
            (a list or set: checked once, here, and kept as the policy it
            means, :func:`remat.policies.save_ops`).
        context_fn: two context managers for forward and recompute
            (``None`` or :func:`noop_context_fn`: none). Not with ``policy``.
        determinism_check: ``"default"`` or ``"none"``.
        debug: list both runs' operators on a mismatch (``None``: the
            :func:`remat.set_checkpoint_debug_enabled` setting decides).
        early_stop: stop a recomputation once every needed tensor is back.
        preserve_rng_state: replay the forward's RNG state in the recompute.
        compress_inputs: keep the region's activation inputs compressed in this
            format (``"fp8"``, ``"int8"``, ...; :func:`remat.compression.compression`)
            instead of as they are: the recomputation, and so the gradients,
            start from approximate values (``docs/design/compression.md``).
        weight_pass: under a backward split into an input pass and a weight
            pass (the zero-bubble pipeline schedules): ``"keep"`` keeps the
            input pass's recomputation for the weight pass (one
            recomputation per microbatch; the region's activations live in
            between), ``"recompute"`` recomputes once more for all the weight
            pass's calls (only the inputs live in between;
            ``docs/design/pipelining.md``).
        api: the front-end, named in error messages.

    Example:
        >>> from remat import CheckpointOptions
        >>> CheckpointOptions(early_stop=False).early_stop
        False
        >>> CheckpointOptions(determinism_check="never")
        Traceback (most recent call last):
        ...
        remat.errors.CheckpointUsageError: remat.CheckpointOptions: determinism_check must be one of ['default', 'none'], got 'never'.
    """

    use_reentrant: bool | None = False
    policy: Callable[..., Any] | list[Any] | None = None
    context_fn: Callable[[], tuple[Any, Any]] | None = None
    determinism_check: Literal["default", "none"] = "default"
    debug: bool | None = False
    early_stop: bool = True
    preserve_rng_state: bool = True
    compress_inputs: Compression | str | None = None
    weight_pass: WeightPass = "keep"
    api: str = dataclasses.field(default="remat.CheckpointOptions", compare=False)
    # RegionOptions per context override of (early_stop, debug): every region of
    # a wrapper or a default call reuses one instead of building it.
    _regions: dict[tuple[bool | None, bool | None], RegionOptions] = dataclasses.field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    _selective: list[SelectiveContexts] = dataclasses.field(
        default_factory=list, init=False, compare=False, repr=False
    )
    # The ops of a list policy, for the torch.compile path: Dynamo before torch
    # 2.9 cannot carry the policy object into a region, the list it can.
    _listed_ops: tuple[Any, ...] | None = dataclasses.field(
        default=None, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        _check(self)
        if self.compress_inputs is not None:
            from remat.compression import compression  # loaded with the first compressing region

            object.__setattr__(self, "compress_inputs", compression(self.compress_inputs, api=f"{self.api}: compress_inputs"))
        # Normal forms, so that equal options compare equal.
        if self.use_reentrant is None:
            object.__setattr__(self, "use_reentrant", False)
        if self.context_fn is noop_context_fn or self.context_fn is torch_checkpoint.noop_context_fn:
            object.__setattr__(self, "context_fn", None)
        if self.policy is not None and not callable(self.policy):
            # The one normalisation of a list policy: the engine takes a policy.
            ops = tuple(self.policy)
            object.__setattr__(self, "policy", policy_of_ops(ops, self.api))
            object.__setattr__(self, "_listed_ops", ops)

    @classmethod
    def from_kwargs(
        cls, api: str, options: Mapping[str, Any], *, accepted: Iterable[str] | None = None
    ) -> CheckpointOptions:
        """Build from a front-end's keyword options; an unknown name is an error.

        ``accepted`` narrows the names a front-end takes (default: every field
        but ``api``); the message lists them.

        Example:
            >>> CheckpointOptions.from_kwargs("my_api", {"early_stop": False}).early_stop
            False
        """
        names = OPTION_NAMES if accepted is None else frozenset(accepted)
        unknown = set(options) - names
        if unknown:
            raise CheckpointUsageError(
                f"{api}: unknown checkpoint options {sorted(unknown)}; valid options are "
                f"{sorted(names)}."
            )
        if options.get("policy") is not None and options.get("context_fn") is not None:
            # Named together, even as the no-op context: one of them is a mistake.
            raise CheckpointUsageError(
                f"{api}: pass either policy= or context_fn=, not both; a policy builds the "
                "selective-checkpoint contexts itself."
            )
        return cls(**options, api=api)

    def replace(self, **changes: Any) -> CheckpointOptions:
        """A copy with some fields changed, validated again.

        Example:
            >>> CheckpointOptions().replace(early_stop=False).early_stop
            False
        """
        if self._listed_ops is not None and "policy" not in changes:
            changes["policy"] = self._listed_ops  # the list again: the compile path reads it
        return dataclasses.replace(self, **changes)

    def contexts(self) -> ContextFn | None:
        """What the eager engine enters around forward and recompute (None: nothing)."""
        if self.policy is not None:
            # Made once: the policy's operator table is shared by every region.
            found = self._selective
            if not found:
                assert callable(self.policy), "remat bug: a list policy was not normalised"
                found.append(SelectiveContexts(self.policy))
            return found[0]
        if self.context_fn is not None:
            return _checked_context_fn(self.context_fn, self.api)
        return None

    def region_options(self) -> RegionOptions:
        """The settings of one region, with the context-local overrides resolved now."""
        overridden = overrides()
        found = self._regions.get(overridden)
        if found is None:
            key = (resolve_early_stop(self.early_stop), resolve_debug(self.debug))
            found = self._regions[overridden] = RegionOptions(
                early_stop=key[0],
                check_determinism=self.determinism_check == "default",
                debug=key[1],
                preserve_rng=self.preserve_rng_state,
                api=self.api,
                debug_blocked=self.debug is True and not key[1],
                inputs=_inputs_storage(self.compress_inputs),  # type: ignore[arg-type]  # parsed in __post_init__
                weight_pass=self.weight_pass,
            )
        return found


def _inputs_storage(compress_inputs: Compression | None) -> Storage:
    """Where a region keeps its inputs: compressed in this format, or as they are."""
    return DEVICE if compress_inputs is None else Storage.compressed(compress_inputs)


def _check(options: CheckpointOptions) -> None:
    api = options.api
    if options.use_reentrant is not None and not isinstance(options.use_reentrant, bool):
        raise CheckpointTypeError(
            f"{api}: use_reentrant must be True or False, got {options.use_reentrant!r}."
        )
    for name in ("early_stop", "preserve_rng_state"):
        if not isinstance(getattr(options, name), bool):
            raise CheckpointTypeError(
                f"{api}: {name} must be True or False, got {getattr(options, name)!r}."
            )
    if options.debug is not None and not isinstance(options.debug, bool):
        raise CheckpointTypeError(
            f"{api}: debug must be True, False or None (None: the "
            f"set_checkpoint_debug_enabled setting decides), got {options.debug!r}."
        )
    if options.weight_pass not in ("keep", "recompute"):
        raise CheckpointUsageError(
            f"{api}: weight_pass must be 'keep' or 'recompute', got {options.weight_pass!r}."
        )
    if options.determinism_check not in DETERMINISM_CHECKS:
        raise CheckpointUsageError(
            f"{api}: determinism_check must be one of {list(DETERMINISM_CHECKS)}, got "
            f"{options.determinism_check!r}."
        )
    context_fn = options.context_fn
    _check_context_fn(context_fn, api)
    has_context = context_fn is not None and context_fn is not noop_context_fn and (
        context_fn is not torch_checkpoint.noop_context_fn
    )
    if options.policy is not None:
        _check_policy(options.policy, api)
        if has_context:
            raise CheckpointUsageError(
                f"{api}: pass either policy= or context_fn=, not both; a policy builds the "
                "selective-checkpoint contexts itself."
            )
    if options.use_reentrant:
        used = [
            name
            for name, value in (
                ("policy", options.policy),
                ("context_fn", context_fn if has_context else None),
                ("debug", options.debug or None),
                ("compress_inputs", options.compress_inputs),
            )
            if value is not None
        ]
        if used:
            raise CheckpointUsageError(
                f"{api}: {', '.join(used)} work only with use_reentrant=False (the "
                "reentrant variant has no saved-tensor hooks to run them)."
            )


def _check_context_fn(context_fn: Any, api: str) -> None:
    if context_fn is None or context_fn is noop_context_fn:
        return
    if not callable(context_fn):
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


def _check_policy(policy: Any, api: str) -> None:
    if callable(policy) or isinstance(policy, (list, tuple, set, frozenset)):
        return  # a list's ops are checked when it becomes a policy (__post_init__)
    raise CheckpointTypeError(
        f"{api}: policy must be a policy from remat.policies, a (ctx, op, *args, **kwargs) "
        f"function or a list of OpOverloads to save, got {type(policy).__name__}."
    )


def _checked_context_fn(context_fn: Callable[[], Any], api: str) -> ContextFn:
    """``context_fn`` with a clear error if it returns something other than two contexts."""

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


OPTION_NAMES = frozenset(
    field.name for field in dataclasses.fields(CheckpointOptions) if field.init and field.name != "api"
)
"""The option names every front-end accepts (some front-ends narrow them)."""
