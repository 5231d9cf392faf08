"""Module-level checkpointing: wrappers and ``apply_activation_checkpointing``.

Drop-in for ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``.
A wrapper is an ``nn.Module`` holding the wrapped module as its only child,
under the same attribute name torch uses (``_checkpoint_wrapped_module``), so
that torch's own distributed tools (FSDP, distributed checkpoint), which strip
that name from FQNs, treat remat's wrappers like torch's. What a user sees:

* ``state_dict()`` keys and the wrapper's ``named_parameters()`` /
  ``named_buffers()`` carry no wrapper prefix; a state dict loads into the
  wrapped and the unwrapped model alike, in both directions;
* attributes and ``wrapper[i]`` reach the wrapped module;
* :class:`CheckpointWrapper` runs the module under
  :func:`remat.checkpoint.checkpoint` (every option of it works, and so does
  torch.compile); :class:`OffloadWrapper` runs it under :func:`remat.offload.offload`.

Design notes, including how ``check_fn`` and ``auto_wrap_policy`` combine and
what wrapping twice does: ``docs/design/modules.md``.

Example:
    >>> import torch
    >>> from remat.nn import apply_activation_checkpointing
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    >>> apply_activation_checkpointing(model, auto_wrap_policy={torch.nn.Linear})
    >>> sorted(model.state_dict())
    ['0.bias', '0.weight', '2.bias', '2.weight']
    >>> model(torch.randn(2, 8, requires_grad=True)).sum().backward()
"""

from __future__ import annotations

import enum
import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import nn

from remat._compat.modules import register_load_state_dict_pre_hook, register_state_dict_post_hook
from remat.checkpoint import run_checkpoint
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.options import OPTION_NAMES, CheckpointOptions

__all__ = [
    "ActivationWrapper",
    "CheckpointImpl",
    "CheckpointWrapper",
    "EveryNth",
    "OffloadWrapper",
    "WrapPolicy",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "every_nth",
    "offload_wrapper",
]

# torch's attribute name: FSDP and torch.distributed.checkpoint strip exactly it from FQNs.
_INNER = "_checkpoint_wrapped_module"


class CheckpointImpl(enum.Enum):
    """Which checkpoint variant a :class:`CheckpointWrapper` uses (torch's member names).

    Example:
        >>> CheckpointImpl.NO_REENTRANT.name
        'NO_REENTRANT'
    """

    REENTRANT = enum.auto()
    NO_REENTRANT = enum.auto()


def _clean(name: str) -> str:
    """An FQN without wrapper components (whole components only)."""
    if _INNER not in name:
        return name
    return ".".join(part for part in name.split(".") if part != _INNER)


def _strip_saved_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any
) -> None:
    # state_dict post-hook: the wrapped module's keys are the last ones added,
    # so re-inserting them keeps the dict's order.
    inner = prefix + _INNER + "."
    for key in [key for key in state_dict if key.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)
    # Version metadata too (keyed by module FQN), so e.g. BatchNorm's version
    # survives unwrapping; the wrapped module's entry replaces the wrapper's.
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [key for key in metadata if key.startswith(inner) or key == inner[:-1]]:
            metadata[_clean(key)] = metadata.pop(key)


def _add_loaded_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *_rest: Any
) -> None:
    # load_state_dict pre-hook: ``state_dict`` is load_state_dict's own copy.
    # Keys that already name the wrapper (torch-style FQNs) are left alone.
    inner = prefix + _INNER + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def _clean_incompatible_keys(module: nn.Module, keys: Any) -> None:
    # Missing/unexpected keys are reported in the names the user passed.
    keys.missing_keys[:] = [_clean(key) for key in keys.missing_keys]
    keys.unexpected_keys[:] = [_clean(key) for key in keys.unexpected_keys]


class ActivationWrapper(nn.Module, ABC):
    """Base of the wrappers: holds one module, hides itself from names and attributes.

    Subclasses implement ``forward``. Not meant to be instantiated directly.

    Example:
        >>> import torch
        >>> wrapped = checkpoint_wrapper(torch.nn.Linear(4, 4))
        >>> isinstance(wrapped, ActivationWrapper), wrapped.in_features
        (True, 4)
    """

    _checkpoint_wrapped_module: nn.Module

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise CheckpointTypeError(
                f"remat.nn.{type(self).__name__}: expected an nn.Module to wrap, got "
                f"{type(module).__name__}. To checkpoint a function use remat.checkpoint."
            )
        super().__init__()
        self._checkpoint_wrapped_module = module
        register_state_dict_post_hook(self, _strip_saved_prefix)
        register_load_state_dict_pre_hook(self, _add_loaded_prefix)
        self.register_load_state_dict_post_hook(_clean_incompatible_keys)  # type: ignore[no-untyped-call]

    @abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == _INNER:  # half-built (unpickling, deepcopy): no inner module yet
                raise
            return getattr(self._checkpoint_wrapped_module, name)

    def __getitem__(self, key: Any) -> Any:
        """``wrapper[i]`` indexes the wrapped module (an ``nn.Sequential``, say)."""
        return self._checkpoint_wrapped_module[key]  # type: ignore[index]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Like ``nn.Module.named_parameters``, without the wrapper's component in names."""
        for name, parameter in super().named_parameters(prefix, recurse, remove_duplicate):
            yield _clean(name), parameter

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Like ``nn.Module.named_buffers``, without the wrapper's component in names."""
        for name, buffer in super().named_buffers(prefix, recurse, remove_duplicate):
            yield _clean(name), buffer


# Reentrant checkpointing accepts none of these; the others are fine with both variants.
_NON_REENTRANT_ONLY = frozenset({"context_fn", "debug", "policy"})


def _impl(value: Any) -> CheckpointImpl:
    # torch's CheckpointImpl members are accepted too, so mixed imports keep working.
    if isinstance(value, enum.Enum) and value.name in CheckpointImpl.__members__:
        return CheckpointImpl[value.name]
    raise CheckpointTypeError(
        "remat.nn.checkpoint_wrapper: checkpoint_impl must be CheckpointImpl.NO_REENTRANT or "
        f"CheckpointImpl.REENTRANT, got {value!r}."
    )


def _reserved_names(function: Callable[..., Any]) -> frozenset[str]:
    """Keyword names a checkpoint function keeps for itself (not passed to the module)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: assume no clash
        return frozenset()
    return frozenset(p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


class CheckpointWrapper(ActivationWrapper):
    """Runs the wrapped module under activation checkpointing.

    Build it with :func:`checkpoint_wrapper`, which documents the arguments.
    ``checkpoint_impl`` and ``checkpoint_fn`` are kept as attributes
    (``checkpoint_fn`` with the options bound), as in torch.

    Example:
        >>> import torch
        >>> block = CheckpointWrapper(torch.nn.Linear(4, 4), early_stop=False)
        >>> block(torch.randn(2, 4, requires_grad=True)).sum().backward()
    """

    def __init__(
        self,
        mod: nn.Module,
        checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
        checkpoint_fn: Callable[..., Any] | None = None,
        **checkpoint_fn_kwargs: Any,
    ) -> None:
        super().__init__(mod)
        self.checkpoint_impl = _impl(checkpoint_impl)
        reentrant = self.checkpoint_impl is CheckpointImpl.REENTRANT
        if checkpoint_fn is None:
            # remat's own: one options value, every call keyword is the module's.
            self.checkpoint_options: CheckpointOptions | None = _options(reentrant, checkpoint_fn_kwargs)
            self.checkpoint_fn = functools.partial(run_checkpoint, self.checkpoint_options)
            self._reserved: frozenset[str] = frozenset()
            return
        if not callable(checkpoint_fn):
            raise CheckpointTypeError(
                "remat.nn.checkpoint_wrapper: checkpoint_fn must be a function like "
                f"remat.checkpoint, got {type(checkpoint_fn).__name__}."
            )
        self.checkpoint_options = None  # a function of the user's, with its own options
        self.checkpoint_fn = functools.partial(checkpoint_fn, **checkpoint_fn_kwargs)
        self._reserved = _reserved_names(self.checkpoint_fn)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Checkpoint ``module(*args, **kwargs)``."""
        function: Callable[..., Any] = self._checkpoint_wrapped_module
        if kwargs and self.checkpoint_impl is CheckpointImpl.REENTRANT:
            # Reentrant checkpointing takes positional inputs only: pass kwarg
            # values positionally (so their gradients flow) and rebuild them.
            names, count = tuple(kwargs), len(args)
            module = function

            def function(*inputs: Any) -> Any:
                return module(*inputs[:count], **dict(zip(names, inputs[count:], strict=True)))

            args, kwargs = (*args, *kwargs.values()), {}
        elif kwargs and (clashing := [name for name in kwargs if name in self._reserved]):
            # A module keyword that the checkpoint function would take as its
            # own option (e.g. ``debug``): bind it instead of passing it along.
            # (No set.intersection(dict): Dynamo on torch 2.4 cannot trace it.)
            bound = {name: kwargs.pop(name) for name in clashing}
            function = functools.partial(function, **bound)
        return self.checkpoint_fn(function, *args, **kwargs)


def _options(reentrant: bool, given: dict[str, Any]) -> CheckpointOptions:
    """The wrapper's options, checked when it is built, not at its first call."""
    api = "remat.nn.checkpoint_wrapper"
    if "use_reentrant" in given:
        raise CheckpointUsageError(
            f"{api}: pass checkpoint_impl=CheckpointImpl.REENTRANT (or NO_REENTRANT) instead "
            "of use_reentrant=."
        )
    accepted = OPTION_NAMES - {"use_reentrant"}
    unknown = set(given) - accepted
    if unknown:
        raise CheckpointUsageError(
            f"{api}: unknown checkpoint options {sorted(unknown)}; valid options are "
            f"{sorted(accepted)}. Module arguments go to the wrapper's call, not to "
            "checkpoint_wrapper."
        )
    if reentrant and (used := sorted(_NON_REENTRANT_ONLY.intersection(given))):
        raise CheckpointUsageError(
            f"{api}: {used} work only with checkpoint_impl=CheckpointImpl.NO_REENTRANT."
        )
    return CheckpointOptions.from_kwargs(api, {**given, "use_reentrant": reentrant})


class OffloadWrapper(ActivationWrapper):
    """Keeps the tensors the wrapped module saves for backward in host memory.

    Build it with :func:`offload_wrapper`, which documents the arguments.

    Example:
        >>> import torch
        >>> layer = OffloadWrapper(torch.nn.Linear(64, 64))
        >>> layer(torch.randn(32, 64, requires_grad=True)).sum().backward()
    """

    def __init__(
        self, mod: nn.Module, *, min_bytes: int = 1024, pin_memory: bool | None = None
    ) -> None:
        from remat.storage import (
            offload,  # the storage package: loaded with the first offload wrapper
        )

        offload(min_bytes=min_bytes, pin_memory=pin_memory)  # validates the arguments now
        super().__init__(mod)
        self._new_offload = functools.partial(offload, min_bytes=min_bytes, pin_memory=pin_memory)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module with its saved tensors offloaded."""
        # A fresh context per call: one context cannot be entered twice (recursion).
        with self._new_offload():
            return self._checkpoint_wrapped_module(*args, **kwargs)


def checkpoint_wrapper(
    module: nn.Module,
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
    checkpoint_fn: Callable[..., Any] | None = None,
    **checkpoint_fn_kwargs: Any,
) -> nn.Module:
    """Wrap ``module`` so that every call of it is checkpointed.

    Args:
        module: the module to wrap. Its parameter and state-dict names do not
            change (see the module docstring).
        checkpoint_impl: ``CheckpointImpl.NO_REENTRANT`` (default) or
            ``CheckpointImpl.REENTRANT`` (torch's enum members work too). With
            ``REENTRANT``, keyword arguments of the call are still supported.
        checkpoint_fn: the checkpoint function to run the module with, called
            as ``checkpoint_fn(module, *args, **checkpoint_fn_kwargs, **kwargs)``
            (e.g. ``torch.utils.checkpoint.checkpoint``). Default:
            :func:`remat.checkpoint.checkpoint`, with ``use_reentrant`` taken
            from ``checkpoint_impl``.
        **checkpoint_fn_kwargs: options for the checkpoint function. For the
            default one: ``policy``, ``context_fn``, ``preserve_rng_state``,
            ``determinism_check``, ``debug``, ``early_stop``; they are
            checked here (``CheckpointUsageError`` for unknown names).

    Example:
        >>> import torch
        >>> from remat.policies import save_matmuls
        >>> block = checkpoint_wrapper(torch.nn.Linear(8, 8), policy=save_matmuls)
        >>> block(torch.randn(2, 8, requires_grad=True)).sum().backward()
    """
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


def offload_wrapper(
    module: nn.Module, *, min_bytes: int = 1024, pin_memory: bool | None = None
) -> nn.Module:
    """Wrap ``module`` so that the tensors it saves for backward live in host memory.

    Built on :func:`remat.offload.offload`: saved tensors of at least
    ``min_bytes`` bytes (parameters excepted) are copied to the host, into
    pinned memory when they live on an accelerator (``pin_memory=None``), and
    copied back when backward needs them. Gradients do not change. Inside a
    checkpointed region the offload stands aside (the region decides what is
    kept); wrap the checkpointed module instead, ``offload_wrapper(checkpoint_wrapper(m))``,
    to offload its inputs.

    Example:
        >>> import torch
        >>> layer = offload_wrapper(torch.nn.Linear(64, 64))
        >>> layer(torch.randn(32, 64, requires_grad=True)).sum().backward()
    """
    return OffloadWrapper(module, min_bytes=min_bytes, pin_memory=pin_memory)


@dataclass(frozen=True)
class EveryNth:
    """Wrap every ``n``-th module that is an instance of ``classes`` (the n-th, 2n-th, ...).

    Modules are counted in the order :func:`apply_activation_checkpointing`
    visits them, which for a stack of layers is their order in the model.
    Build it with :func:`every_nth`.

    Example:
        >>> import torch
        >>> EveryNth(2, (torch.nn.Linear,)).n
        2
    """

    n: int
    classes: tuple[type[nn.Module], ...]


def every_nth(n: int, classes: type[nn.Module] | Iterable[type[nn.Module]]) -> EveryNth:
    """A wrap policy: checkpoint every ``n``-th layer of the given classes.

    Checkpointing every second transformer block halves the recomputation of
    checkpointing them all and keeps half the activations.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> apply_activation_checkpointing(model, auto_wrap_policy=every_nth(2, torch.nn.Linear))
        >>> [type(block).__name__ for block in model]
        ['Linear', 'CheckpointWrapper', 'Linear', 'CheckpointWrapper']
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CheckpointUsageError(f"remat.nn.every_nth: n must be an int >= 1, got {n!r}.")
    return EveryNth(n, _classes(classes, "remat.nn.every_nth"))


def _classes(value: Any, api: str) -> tuple[type[nn.Module], ...]:
    classes = (value,) if isinstance(value, type) else tuple(value)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise CheckpointTypeError(
            f"{api}: expected nn.Module classes (e.g. {{nn.TransformerEncoderLayer}}), got {value!r}."
        )
    return classes


WrapPolicy: TypeAlias = (
    "Callable[..., bool] | EveryNth | set[type[nn.Module]] | frozenset[type[nn.Module]]"
    " | tuple[type[nn.Module], ...] | list[type[nn.Module]]"
)
"""What ``auto_wrap_policy`` accepts: a torch-style ``(module, recurse, nonwrapped_numel) -> bool``
callable, an :class:`EveryNth`, or a collection of module classes."""

# (module, recurse, nonwrapped_numel) -> bool, always called with keywords, as torch does.
_Decide = Callable[..., bool]


def _decider(auto_wrap_policy: Any, check_fn: Callable[[nn.Module], bool] | None) -> _Decide:
    api = "remat.nn.apply_activation_checkpointing"
    if auto_wrap_policy is None:
        assert check_fn is not None, "remat bug: no policy and no check_fn"
        return lambda module, recurse, nonwrapped_numel: recurse or bool(check_fn(module))
    if isinstance(auto_wrap_policy, EveryNth):
        policy, seen = auto_wrap_policy, 0

        def nth(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            nonlocal seen
            if recurse or not isinstance(module, policy.classes):
                return recurse
            seen += 1  # a fresh count for every apply_activation_checkpointing call
            return seen % policy.n == 0

        return nth
    if isinstance(auto_wrap_policy, (set, frozenset, tuple, list)):
        classes = _classes(auto_wrap_policy, api)
        return lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, classes)
    if callable(auto_wrap_policy):
        return auto_wrap_policy  # type: ignore[no-any-return]
    raise CheckpointTypeError(
        f"{api}: auto_wrap_policy must be a (module, recurse, nonwrapped_numel) -> bool "
        "callable (e.g. torch's ModuleWrapPolicy or functools.partial(lambda_auto_wrap_policy, "
        f"...)), a set of module classes, or remat.nn.every_nth(n, classes); got "
        f"{type(auto_wrap_policy).__name__}. For torch's non-callable policies "
        "(CustomPolicy) pass check_fn instead."
    )


def _always(module: nn.Module) -> bool:
    return True


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = _always,
    auto_wrap_policy: WrapPolicy | None = None,
) -> None:
    """Wrap submodules of ``model`` in place (never ``model`` itself).

    Modules are visited children first. A module is wrapped when
    ``auto_wrap_policy`` says so or, without one, when ``check_fn(module)`` is
    true. Wrappers already in the model are left as they are and not entered,
    so applying twice wraps nothing twice.

    Args:
        model: the model to modify.
        checkpoint_wrapper_fn: builds the wrapper, e.g. :func:`checkpoint_wrapper`,
            :func:`offload_wrapper` or ``functools.partial(checkpoint_wrapper, policy=...)``.
        check_fn: ``module -> bool``; used only without ``auto_wrap_policy``.
        auto_wrap_policy: a torch-style policy ``(module, recurse, nonwrapped_numel) -> bool``
            (torch's ``ModuleWrapPolicy``, ``functools.partial(lambda_auto_wrap_policy,
            lambda_fn=...)``, ``size_based_auto_wrap_policy``...), a set of
            module classes, or :func:`every_nth`. Combining it with a
            ``check_fn`` is a ``CheckpointUsageError`` (torch silently ignores
            ``check_fn``; put the condition into one of them).

    Example:
        >>> import functools, torch
        >>> from remat.policies import save_matmuls
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
        >>> apply_activation_checkpointing(
        ...     model,
        ...     checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, policy=save_matmuls),
        ...     check_fn=lambda m: isinstance(m, torch.nn.Linear),
        ... )
        >>> type(model[0]).__name__, type(model[1]).__name__
        ('CheckpointWrapper', 'GELU')
    """
    api = "remat.nn.apply_activation_checkpointing"
    if not isinstance(model, nn.Module):
        raise CheckpointTypeError(f"{api}: model must be an nn.Module, got {type(model).__name__}.")
    for name, value in (("checkpoint_wrapper_fn", checkpoint_wrapper_fn), ("check_fn", check_fn)):
        if not callable(value):
            raise CheckpointTypeError(
                f"{api}: {name} must be callable, got {type(value).__name__}."
            )
    if auto_wrap_policy is not None and check_fn is not _always:
        raise CheckpointUsageError(
            f"{api}: pass check_fn or auto_wrap_policy, not both (torch ignores check_fn when "
            "both are given; remat refuses rather than guess). Fold the condition into one."
        )
    decide = _decider(auto_wrap_policy, check_fn)

    def wrap(module: nn.Module) -> nn.Module:
        wrapped = checkpoint_wrapper_fn(module)
        if not isinstance(wrapped, nn.Module):
            raise CheckpointTypeError(
                f"{api}: checkpoint_wrapper_fn must return an nn.Module, got "
                f"{type(wrapped).__name__}."
            )
        return wrapped

    _visit(model, decide, wrap, is_root=True)


def _visit(
    module: nn.Module, decide: _Decide, wrap: Callable[[nn.Module], nn.Module], *, is_root: bool
) -> tuple[nn.Module, int]:
    """Wrap inside ``module`` (children first), then maybe ``module`` itself.

    Returns the module or its wrapper, and how many parameters are now inside
    wrappers: torch's size-based policies see the parameters still unwrapped.
    """
    numel = sum(parameter.numel() for parameter in module.parameters())
    if not decide(module=module, recurse=True, nonwrapped_numel=numel):
        return module, 0
    wrapped_numel = 0
    for name, child in list(module.named_children()):
        if isinstance(child, ActivationWrapper):
            continue
        new_child, count = _visit(child, decide, wrap, is_root=False)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_numel += count
    if not is_root and decide(module=module, recurse=False, nonwrapped_numel=numel - wrapped_numel):
        return wrap(module), numel
    return module, wrapped_numel
