"""Names for tensors, so that policies can target them: ``remat.name(t, "attn_out")``.

``remat.name`` is an operator, ``torch.ops.remat.named.default(tensor, name)``,
registered with ``torch.library`` so that every dispatch-level tool sees it:
remat's selective-checkpoint recorder, a user's own policy function, and
(through its tracing) ``torch.compile``. In eager mode it returns its input
itself: no copy, no autograd node, nothing for autograd to save. Under
``torch.compile`` it traces as a clone (functionalization cannot handle a
custom op whose output aliases its input, and the partitioner never saves
views); inductor removes that clone again. See ``docs/design/compile.md``.

How a name reaches a policy: when a selective policy (e.g.
:func:`remat.policies.save_only_names`) decides to save the ``named`` op, the
decision is applied to the op that *produced* the named tensor, looking
through views; the producer is then replayed from the cache in backward
instead of being recomputed. If the tensor was modified in place between its
producer and the ``named`` call, the named value itself is kept instead
(the producer then reruns; the result is still exact).

The idiom, in a transformer block::

    def forward(self, x):
        h = x + remat.name(self.attn(self.ln1(x)), "attn_out")
        return h + remat.name(self.mlp(self.ln2(h)), "mlp_out")

    # keep attention outputs, recompute everything else:
    remat.checkpoint(block, x, policy=remat.policies.save_only_names("attn_out"))

Example:
    >>> import torch, remat
    >>> x = torch.randn(4, requires_grad=True)
    >>> y = remat.name(x.sin(), "features")
    >>> remat.names.tensor_name(torch.ops.remat.named.default, (y, "features"))
    'features'
"""

from __future__ import annotations

from typing import Any

import torch

from remat._compat.dispatch import below_autograd, dispatch_modes_active
from remat._compat.tracers import functorch_transform, functorch_transforms
from remat.errors import CheckpointTypeError, CheckpointUsageError

__all__ = ["name", "tensor_name"]

_LIBRARY = torch.library.Library("remat", "DEF")  # type: ignore[no-untyped-call]  # owns the op; must stay alive
_LIBRARY.define("named(Tensor(a) self, str name) -> Tensor(a)")  # type: ignore[no-untyped-call]


def _named_kernel(tensor: torch.Tensor, label: str) -> torch.Tensor:
    return tensor


def _named_functional(tensor: torch.Tensor, label: str) -> torch.Tensor:
    # Only torch.compile's functionalization calls this (as the op's
    # decomposition): it cannot functionalize a custom op whose output aliases
    # its input. A clone, not a view, so a policy's save decision survives the
    # partitioner (it never saves views); inductor removes the clone again.
    copied: torch.Tensor = torch.ops.aten.clone.default(tensor)
    return copied


class _IdentityGrad(torch.autograd.Function):
    """Gives a tensor that a layer below autograd returned the input's gradient path."""

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, box: tuple[torch.Tensor]) -> torch.Tensor:
        # The result travels in a tuple: an input returned as-is would become a
        # view op that a selective-checkpoint cache did not see in the forward.
        return box[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _named_autograd_kernel(tensor: torch.Tensor, label: str) -> torch.Tensor:
    # Eagerly the input itself comes back, with its grad_fn: autograd has
    # nothing to add. A layer below may return another tensor (functionalization
    # while compiling, a selective-checkpoint cache during recomputation): that
    # one needs the identity's gradient, or backward would silently stop here.
    with below_autograd():
        result: torch.Tensor = torch.ops.remat.named.default(tensor, label)
    if result is tensor or not (tensor.requires_grad and torch.is_grad_enabled()):
        return result
    if functorch_transform() is not None:
        # Under torch.func a custom Function cannot be applied from an autograd
        # kernel (no custom_function_call kernel at this key). Only a selective
        # region's replay gets here: it served the name's cached value, which
        # equals the recomputed input (the op is the identity), and the input
        # carries the gradient path (docs/design/tracing.md).
        return tensor
    linked: torch.Tensor = _IdentityGrad.apply(tensor, (result,))  # type: ignore[no-untyped-call]
    return linked


_LIBRARY.impl("named", _named_kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
_LIBRARY.impl("named", _named_functional, "CompositeImplicitAutograd")  # type: ignore[no-untyped-call]
_LIBRARY.impl("named", _named_autograd_kernel, "Autograd")  # type: ignore[no-untyped-call]

NAMED_OP: Any = torch.ops.remat.named.default
"""The ``OpOverload`` that carries a name; a policy sees it as ``op``."""


def _named_batched(info: Any, in_dims: tuple[Any, ...], tensor: torch.Tensor, label: str) -> tuple[torch.Tensor, Any]:
    # Under torch.func.vmap the name goes on the batched tensor, so a policy's
    # mode below vmap still sees it (the batch dimension stays where it was).
    result: torch.Tensor = NAMED_OP(tensor, label)
    return result, in_dims[0]


NAMES_BATCH = hasattr(torch.library, "register_vmap")  # torch >= 2.5; on 2.4 vmap cannot batch the op
if NAMES_BATCH:
    torch.library.register_vmap(NAMED_OP, _named_batched)


def _unseen_under(transforms: tuple[str, ...]) -> bool:
    """Whether a name must not be dispatched under these ``torch.func`` transforms."""
    return "jvp" in transforms or (not NAMES_BATCH and "vmap" in transforms)


def name(tensor: torch.Tensor, label: str) -> torch.Tensor:
    """Tag ``tensor`` with ``label`` for name-based policies; returns ``tensor`` itself.

    Under a dispatch mode (a selective checkpoint's, a user's policy), on a
    tensor subclass, or while compiling, it is one operator call that policies
    see; otherwise it returns at once. See the module docstring for how
    policies use names.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> def block(t):
        ...     return remat.name(t @ t.T, "scores").softmax(-1)
        >>> policy = remat.policies.save_only_names("scores")
        >>> remat.checkpoint(block, x, policy=policy).sum().backward()
    """
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointTypeError(f"remat.name: expected a tensor, got {type(tensor).__name__}.")
    if not isinstance(label, str) or not label:
        raise CheckpointUsageError(f"remat.name: the name must be a non-empty string, got {label!r}.")
    if type(tensor) is torch.Tensor and not torch.compiler.is_compiling() and not dispatch_modes_active():
        # Nothing below could see the operator: no tracing (asked first: Dynamo
        # traces this code), no tensor subclass, no dispatch mode (a selective
        # region's recorder or replay, a user's policy mode, a memory tracker).
        # It would return its input itself; dispatching it costs several Python
        # layers per call (4.3 us against 0.4 us on CPU).
        return tensor
    if (
        not torch.compiler.is_compiling()  # (Dynamo cannot trace functorch's interpreter stack)
        and functorch_transform() is not None
        and _unseen_under(functorch_transforms())
    ):
        # The operator has no forward-mode rule: under torch.func.jvp, jacfwd or
        # hessian it returned its input without the tangent (zero derivatives,
        # silently); torch 2.4 has no batching rule for it either. There the
        # name is not seen: a names policy recomputes the tensor instead of
        # keeping it (docs/design/tracing.md).
        return tensor
    result: torch.Tensor = NAMED_OP(tensor, label)
    return result


def tensor_name(op: Any, args: tuple[Any, ...]) -> str | None:
    """The name an op call carries: ``args[1]`` of the ``named`` op, else None."""
    if op is NAMED_OP and len(args) > 1 and isinstance(args[1], str):
        return args[1]
    return None
