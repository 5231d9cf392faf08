"""Selective-checkpointing policies as values.

A *policy* answers, for each operator a checkpointed region runs in its
forward, whether to keep its output for backward or to recompute it. It is
called as ``policy(ctx, op, *args, **kwargs)`` (torch's protocol, so any
policy written for ``torch.utils.checkpoint`` works) and returns a
:class:`CheckpointPolicy` or a bool (``True`` = save).

remat's built-in policies are frozen dataclasses with a readable ``reason``;
they also answer :meth:`Policy.decide`, which may return ``None`` ("no
opinion") so that combinators can chain them::

    >>> import remat.policies as P
    >>> policy = P.first_of(P.save_ops(torch.ops.aten.mm.default), P.save_nothing)
    >>> P.save_matmuls.reason
    'matmuls are the expensive ops: save their outputs, recompute the cheap rest'

Only the final answer given to the engine must be a decision; a plain function
that returns ``None`` or a string is an error naming the policy and the op.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from remat._compat.dispatch import HigherOrderOperator, OpOverload, OpOverloadPacket
from remat.errors import CheckpointTypeError, CheckpointUsageError, PolicyError
from remat.names import tensor_name

if TYPE_CHECKING:
    from remat.compression import Compression, Scale

__all__ = [
    "MATMUL_OPS",
    "UNBATCHED_MATMUL_OPS",
    "CheckpointPolicy",
    "Compress",
    "Decision",
    "Policy",
    "SelectiveCheckpointContext",
    "compress_names",
    "compressed",
    "first_of",
    "offload_names",
    "save_all_but_names",
    "save_any_of",
    "save_matmuls",
    "save_matmuls_without_batch_dims",
    "save_nothing",
    "save_only_names",
    "save_ops",
]


class CheckpointPolicy(enum.Enum):
    """What to do with one operator's output; same members as torch's enum.

    ``MUST_*`` decisions are not to be overridden by other systems (e.g. a
    compiler); ``PREFER_*`` may be. ``*_CPU_OFFLOAD`` keeps the output on the
    host instead of the device (aliases ``MUST_OFFLOAD``/``PREFER_OFFLOAD``).

    Example:
        >>> CheckpointPolicy.MUST_SAVE.saves
        True
    """

    # Values equal torch.utils.checkpoint.CheckpointPolicy's, so either converts by name.
    MUST_SAVE = 0  # keep on device; a compiler must not override
    PREFER_SAVE = 1  # keep on device unless a compiler knows better
    MUST_RECOMPUTE = 2  # never keep
    PREFER_RECOMPUTE = 3  # plain checkpointing; the default
    MUST_OFFLOAD = 4  # keep a host copy
    PREFER_OFFLOAD = 5
    MUST_CPU_OFFLOAD = 4  # torch's spelling of the two above
    PREFER_CPU_OFFLOAD = 5

    @property
    def saves(self) -> bool:
        """Whether the output is kept (on device or offloaded) rather than recomputed."""
        return self is not CheckpointPolicy.MUST_RECOMPUTE and (
            self is not CheckpointPolicy.PREFER_RECOMPUTE
        )

    @property
    def offloads(self) -> bool:
        """Whether the output is kept on the host."""
        return self in (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)

    @property
    def compression(self) -> None:
        """The format an output is kept in when compressed: never, for these decisions (see :class:`Compress`)."""
        return None


@dataclass(frozen=True)
class Compress:
    """A policy's answer that keeps the op's output compressed on its device.

    remat's fourth storage choice beside keep, recompute and offload, as a
    decision value that carries its format (the way JAX's policies answer
    ``Offloadable(src, dst)``): ``Compress("fp8")``, ``Compress("int8",
    must=False)``. ``format`` is a name (``"bf16"``, ``"fp16"``, ``"fp8"``,
    ``"fp8_e5m2"``, ``"int8"``) or a :class:`~remat.compression.Compression`;
    ``scale`` picks per-row (default) or per-tensor scales. The output's
    float tensors are compressed; its integer and bool tensors are kept as
    they are, and an op with no float output is an error. The forward is
    unchanged: only what backward reads is approximate
    (``docs/design/compression.md``). ``must=False`` lets a compiler keep
    the value instead, as ``PREFER_SAVE`` does.

    Example:
        >>> decision = Compress("fp8")
        >>> decision.saves, decision.offloads, str(decision.compression)
        (True, False, 'fp8')
    """

    format: Compression | str
    must: bool = True
    scale: Scale | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from remat.compression import compression

        object.__setattr__(self, "format", compression(self.format, scale=self.scale, api="remat.policies.Compress"))
        object.__setattr__(self, "scale", None)
        if not isinstance(self.must, bool):
            raise CheckpointTypeError(f"remat.policies.Compress: must must be True or False, got {self.must!r}.")

    @property
    def compression(self) -> Compression:
        """The format the output is kept in."""
        return self.format  # type: ignore[return-value]  # a Compression after __post_init__

    @property
    def saves(self) -> bool:
        return True

    @property
    def offloads(self) -> bool:
        return False

    @property
    def name(self) -> str:
        return "MUST_COMPRESS" if self.must else "PREFER_COMPRESS"

    @property
    def value(self) -> int:
        """Sorts beside the enum's saves: a must-decision before a preference."""
        return 0 if self.must else 1


Decision = CheckpointPolicy | Compress
"""What a policy decides for one op: a :class:`CheckpointPolicy` or a :class:`Compress`."""


class SelectiveCheckpointContext:
    """What a policy learns besides the op: ``is_recompute`` (always False: policies
    run in the forward only) and ``op_output``.

    Example:
        >>> SelectiveCheckpointContext(is_recompute=False).is_recompute
        False
    """

    __slots__ = ("is_recompute", "op_output")

    def __init__(self, *, is_recompute: bool, op_output: Any = None) -> None:
        self.is_recompute = is_recompute
        self.op_output = op_output


def _policy_name(policy: object) -> str:
    if isinstance(policy, Policy):  # its repr lists every field (op sets): too long
        return f"{type(policy).__name__}({policy.reason!r})"
    return getattr(policy, "__qualname__", None) or repr(policy)


_SIGNATURE_HINT = (
    "A policy is called as policy(ctx, op, *args, **kwargs) and returns a CheckpointPolicy "
    "(e.g. CheckpointPolicy.MUST_SAVE), a remat.policies.Compress, or a bool (True = save); return "
    "CheckpointPolicy.PREFER_RECOMPUTE for 'no opinion'."
)


def ask_policy(
    policy: Callable[..., Any],
    ctx: SelectiveCheckpointContext,
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Decision:
    """Call ``policy`` for ``op`` and check its answer; every caller of a policy goes here.

    A ``TypeError`` from the call (a wrong signature, a bug in the policy)
    becomes a :class:`~remat.errors.PolicyError`: under an operator like
    ``a @ b`` Python would otherwise swallow it (see that class).
    """
    try:
        value = policy(ctx, op, *args, **kwargs)
    except TypeError as exc:
        raise PolicyError(
            f"selective checkpoint policy {_policy_name(policy)} raised TypeError for op {op}: "
            f"{exc}. {_SIGNATURE_HINT}",
            policy=policy,
            op=op,
            value=None,
        ) from exc
    return normalize_decision(value, policy, op)


def normalize_decision(value: object, policy: object, op: object) -> Decision:
    """Turn a policy's answer into a :data:`Decision`, or raise :class:`PolicyError`.

    Accepts remat's and torch's ``CheckpointPolicy``, :class:`Compress` and
    bools (True = save).
    """
    if isinstance(value, (CheckpointPolicy, Compress)):
        return value
    if isinstance(value, bool):
        return CheckpointPolicy.MUST_SAVE if value else CheckpointPolicy.PREFER_RECOMPUTE
    if isinstance(value, enum.Enum) and value.name in CheckpointPolicy.__members__:
        return CheckpointPolicy[value.name]  # torch.utils.checkpoint.CheckpointPolicy
    raise PolicyError(
        f"selective checkpoint policy {_policy_name(policy)} returned {value!r} for op {op}. "
        f"{_SIGNATURE_HINT}",
        policy=policy,
        op=op,
        value=value,
    )


@dataclass(frozen=True)
class Policy:
    """Base of remat's built-in policies: ``decide`` may return None (no opinion)."""

    reason: str = field(default="", compare=False)

    def decide(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Decision | None:
        """The decision for ``op``, or None to let the next policy (or the default) decide."""
        raise NotImplementedError

    def decides_by_op_only(self) -> bool:
        """True if the decision depends on the op alone (never on its arguments).

        Selective checkpointing then asks once per op and region, not per call.
        """
        return False

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any
    ) -> Decision:
        decision = self.decide(op, args, kwargs)
        return CheckpointPolicy.PREFER_RECOMPUTE if decision is None else decision

    # A policy is an immutable value: a (deep) copy of a model that holds one
    # (a wrapper, a Hugging Face layer) shares it. The ops some policies hold
    # cannot be copied at all.
    def __copy__(self) -> Policy:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Policy:
        return self


def _as_decider(policy: Callable[..., Any]) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], Decision | None]:
    if isinstance(policy, Policy):
        return policy.decide

    def decide(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Decision:
        return ask_policy(policy, SelectiveCheckpointContext(is_recompute=False), op, args, kwargs)

    return decide


@dataclass(frozen=True)
class _Constant(Policy):
    decision: CheckpointPolicy = CheckpointPolicy.PREFER_RECOMPUTE

    def decide(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CheckpointPolicy:
        return self.decision

    def decides_by_op_only(self) -> bool:
        return True


@dataclass(frozen=True)
class _SaveOps(Policy):
    ops: frozenset[Any] = frozenset()

    def decide(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CheckpointPolicy | None:
        return CheckpointPolicy.MUST_SAVE if op in self.ops else None

    def decides_by_op_only(self) -> bool:
        return True

    def __reduce__(self) -> tuple[Any, ...]:
        # Operators do not pickle; their names ("aten.mm.default") do.
        return (_saving_named_ops, (sorted(str(op) for op in self.ops), self.reason))


def _saving_named_ops(names: list[str], reason: str) -> _SaveOps:
    ops = []
    for name in names:
        found: Any = torch.ops
        for part in name.split("."):
            found = getattr(found, part)
        ops.append(found)
    return _SaveOps(reason=reason, ops=frozenset(ops))


@dataclass(frozen=True)
class _FirstOf(Policy):
    policies: tuple[Callable[..., Any], ...] = ()

    def decide(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Decision | None:
        for policy in self.policies:
            decision = _as_decider(policy)(op, args, kwargs)
            if decision is not None:
                return decision
        return None

    def decides_by_op_only(self) -> bool:
        return all(isinstance(p, Policy) and p.decides_by_op_only() for p in self.policies)


@dataclass(frozen=True)
class _SaveAnyOf(Policy):
    policies: tuple[Callable[..., Any], ...] = ()

    def decide(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Decision | None:
        decisions = [_as_decider(policy)(op, args, kwargs) for policy in self.policies]
        saving = [d for d in decisions if d is not None and d.saves]
        if saving:
            return min(saving, key=lambda d: d.value)  # MUST_* before PREFER_*
        return next((d for d in decisions if d is not None), None)

    def decides_by_op_only(self) -> bool:
        return all(isinstance(p, Policy) and p.decides_by_op_only() for p in self.policies)


def _overloads(names: Iterable[str]) -> frozenset[Any]:
    found = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            found.add(getattr(packet, overload))
    return frozenset(found)


MATMUL_OPS: frozenset[Any] = _overloads(
    [
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "linear",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ]
)
"""Every overload of the matmul and scaled-dot-product-attention ops."""

UNBATCHED_MATMUL_OPS: frozenset[Any] = _overloads(["mm", "addmm", "linear"])
"""Matmuls without a batch dimension (weights times activations)."""


def checked_ops(ops: Iterable[Any], api: str) -> frozenset[Any]:
    """The ops as a set, after checking each is an ``OpOverload`` (ValueError if not)."""
    for op in ops:
        if isinstance(op, OpOverloadPacket):
            raise CheckpointUsageError(
                f"{api}: {op} is an OpOverloadPacket; name one overload instead, e.g. "
                "torch.ops.aten.mm.default for torch.ops.aten.mm."
            )
        if not isinstance(op, (OpOverload, HigherOrderOperator)):
            raise CheckpointUsageError(
                f"{api}: expected OpOverloads such as torch.ops.aten.mm.default, got "
                f"{op!r} of type {type(op).__name__}."
            )
    return frozenset(ops)


def save_ops(*ops: Any) -> Policy:
    """Save the outputs of exactly these ``OpOverload``s; no opinion on others.

    Example:
        >>> policy = save_ops(torch.ops.aten.mm.default)
    """
    return policy_of_ops(ops, "remat.policies.save_ops")


def policy_of_ops(ops: Iterable[Any], api: str) -> Policy:
    """A list of ``OpOverload``\\ s to save as the policy it means, :func:`save_ops`.

    The one place a list policy (``policy=[torch.ops.aten.mm.default]``)
    is checked and turned into a policy: errors name ``api``.

    Example:
        >>> policy_of_ops([torch.ops.aten.mm.default], "my_api") == save_ops(torch.ops.aten.mm.default)
        True
    """
    chosen = checked_ops(ops, api)
    return _SaveOps(reason=f"save the outputs of {len(chosen)} listed ops", ops=chosen)


def _checked_policies(policies: tuple[Any, ...], api: str) -> tuple[Callable[..., Any], ...]:
    """Check a combinator's policies now: inside the forward a TypeError would be swallowed."""
    for index, policy in enumerate(policies):
        if not callable(policy):
            raise CheckpointTypeError(
                f"remat.policies.{api}: every policy must be callable (a remat policy or a "
                f"function (ctx, op, *args, **kwargs)); policy {index} is {type(policy).__name__}."
            )
    return policies


def first_of(*policies: Callable[..., Any]) -> Policy:
    """The first decision that is not "no opinion", in order.

    Example:
        >>> policy = first_of(save_ops(torch.ops.aten.mm.default), save_nothing)
    """
    return _FirstOf(
        reason="first policy with an opinion decides", policies=_checked_policies(policies, "first_of")
    )


def save_any_of(*policies: Callable[..., Any]) -> Policy:
    """Save an op's output if any of the policies would save it (union of saves).

    Example:
        >>> policy = save_any_of(save_ops(torch.ops.aten.mm.default), save_matmuls)
    """
    return _SaveAnyOf(
        reason="union of what the policies save", policies=_checked_policies(policies, "save_any_of")
    )


save_nothing: Policy = _Constant(
    reason="recompute everything: least memory, one extra forward",
    decision=CheckpointPolicy.PREFER_RECOMPUTE,
)
"""Full recomputation (plain checkpointing)."""

save_matmuls: Policy = _SaveOps(
    reason="matmuls are the expensive ops: save their outputs, recompute the cheap rest",
    ops=MATMUL_OPS,
)
"""Save matmul and attention outputs; recompute elementwise ops and norms."""

save_matmuls_without_batch_dims: Policy = _SaveOps(
    reason="save weight matmuls (no batch dim); recompute batched attention matmuls",
    ops=UNBATCHED_MATMUL_OPS,
)
"""Save mm/addmm/linear outputs only (JAX's dots_with_no_batch_dims_saveable)."""


@dataclass(frozen=True)
class _ByName(Policy):
    """Decides for tensors tagged with :func:`remat.name`; no opinion on other ops."""

    names: frozenset[str] = frozenset()
    listed: Decision = CheckpointPolicy.MUST_SAVE
    others: Decision | None = None

    def decide(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Decision | None:
        label = tensor_name(op, args)
        if label is None:
            return None
        return self.listed if label in self.names else self.others


def _by_name(
    api: str,
    names: tuple[str, ...],
    reason: str,
    listed: Decision,
    others: Decision | None = None,
) -> Policy:
    """Check the names, then build the policy; ``{names}`` in ``reason`` lists them."""
    if not names:
        raise CheckpointUsageError(f"remat.policies.{api}: give at least one name, e.g. {api}('attn_out').")
    for label in names:
        if not isinstance(label, str) or not label:
            raise CheckpointTypeError(
                f"remat.policies.{api}: names must be non-empty strings, got {label!r}. Pass "
                f"them as separate arguments: {api}('attn_out', 'mlp_out')."
            )
    chosen = frozenset(names)
    listing = ", ".join(sorted(chosen))
    return _ByName(reason=reason.format(names=listing), names=chosen, listed=listed, others=others)


def save_only_names(*names: str) -> Policy:
    """Keep the tensors tagged with these names (see :func:`remat.name`); recompute the rest.

    The op that produced a named tensor is replayed from the cache in
    backward instead of being rerun.

    Example:
        >>> policy = save_only_names("attn_out")
        >>> policy.reason
        'keep tensors named attn_out, recompute the rest'
    """
    return _by_name(
        "save_only_names", names, "keep tensors named {names}, recompute the rest", CheckpointPolicy.MUST_SAVE
    )


def save_all_but_names(*names: str) -> Policy:
    """Keep every named tensor except these (and recompute them); no opinion on unnamed ops.

    Example:
        >>> policy = save_all_but_names("mlp_hidden")
    """
    return _by_name(
        "save_all_but_names",
        names,
        "keep every named tensor except {names}",
        CheckpointPolicy.MUST_RECOMPUTE,
        others=CheckpointPolicy.MUST_SAVE,
    )


def offload_names(*names: str) -> Policy:
    """Keep host copies of the tensors tagged with these names; recompute the rest.

    Combine with other policies: ``first_of(offload_names("attn_out"), save_matmuls)``.

    Example:
        >>> policy = offload_names("attn_out")
    """
    return _by_name(
        "offload_names", names, "offload tensors named {names} to host memory", CheckpointPolicy.MUST_OFFLOAD
    )


def compress_names(*names: str, format: Compression | str = "fp8", scale: Scale | None = None) -> Policy:
    """Keep the tensors tagged with these names compressed; recompute the rest.

    The named tensor's producer is replayed from the cache in backward, its
    output decompressed (see :func:`remat.name` and :class:`Compress`). A
    name on a tensor with no float values is an error when the region runs.

    Example:
        >>> policy = compress_names("attn_out", format="int8")
        >>> policy.reason
        'keep tensors named attn_out compressed (int8), recompute the rest'
    """
    decision = Compress(format, scale=scale)
    return _by_name(
        "compress_names",
        names,
        f"keep tensors named {{names}} compressed ({decision.compression}), recompute the rest",
        decision,
    )


@dataclass(frozen=True)
class _Compressed(Policy):
    """Every save of ``policy`` becomes a :class:`Compress` of ``decision``'s format."""

    policy: Callable[..., Any] = save_nothing
    decision: Compress | None = None

    def decide(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Decision | None:
        decision = _as_decider(self.policy)(op, args, kwargs)
        if decision is None or not decision.saves or decision.offloads or decision.compression is not None:
            return decision
        assert self.decision is not None, "remat bug: a compressed policy without its format"
        must = decision is CheckpointPolicy.MUST_SAVE
        return self.decision if must == self.decision.must else Compress(self.decision.format, must=must)

    def decides_by_op_only(self) -> bool:
        return isinstance(self.policy, Policy) and self.policy.decides_by_op_only()


def compressed(policy: Callable[..., Any], format: Compression | str = "fp8", *, scale: Scale | None = None) -> Policy:
    """What ``policy`` saves, kept compressed in ``format``; its other answers unchanged.

    ``compressed(save_matmuls, "fp8")`` keeps every matmul output as fp8 with
    per-row scales and recomputes the rest. Offloads and decisions that
    compress already stay as they are.

    Example:
        >>> policy = compressed(save_matmuls, "int8")
        >>> policy.reason
        'matmuls are the expensive ops: save their outputs, recompute the cheap rest (compressed: int8)'
    """
    (checked,) = _checked_policies((policy,), "compressed")
    decision = Compress(format, scale=scale)
    reason = getattr(checked, "reason", None) or _policy_name(checked)
    return _Compressed(reason=f"{reason} (compressed: {decision.compression})", policy=checked, decision=decision)
