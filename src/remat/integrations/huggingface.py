"""Gradient checkpointing of Hugging Face ``transformers`` models through remat.

``model.gradient_checkpointing_enable()`` (``activation_checkpointing_enable``
in recent transformers) always checkpoints with ``torch.utils.checkpoint``.
:func:`enable_gradient_checkpointing` turns checkpointing on the same way and
then points every checkpointing layer at :func:`remat.checkpoint`, so remat's
policies (save the matmuls, offload, ...) and its memory behaviour apply to
any ``PreTrainedModel`` that supports gradient checkpointing.
:func:`disable_gradient_checkpointing` turns it off again (transformers'
default function is restored, so a later ``gradient_checkpointing_enable()``
means torch's checkpoint again). While remat is on, the model's own
``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` (which
the ``Trainer`` calls) keeps remat and takes remat options, ``policy``
included; an unknown option raises.

``transformers`` is optional (``pip install remat[hf]``) and imported only
when one of these functions is called. Design notes:
``docs/design/distributed.md`` (section "Hugging Face transformers").

Example:
    >>> import remat.policies
    >>> from remat.integrations.huggingface import enable_gradient_checkpointing
    >>> from transformers import GPT2Config, GPT2LMHeadModel  # doctest: +SKIP
    >>> model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2))  # doctest: +SKIP
    >>> enable_gradient_checkpointing(model, policy=remat.policies.save_matmuls)  # doctest: +SKIP
    >>> model.train()(input_ids, labels=input_ids).loss.backward()  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType, ModuleType
from typing import Any

import torch

from remat.checkpoint import run_checkpoint
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError
from remat.options import CheckpointOptions
from remat.storage import offload

__all__ = [
    "RematCheckpointFunction",
    "disable_gradient_checkpointing",
    "enable_gradient_checkpointing",
    "is_remat_checkpointing",
]

_API = "remat.integrations.huggingface"
_INSTALL_HINT = "install it with: pip install remat[hf] (or pip install transformers)"


class RematCheckpointFunction:
    """The checkpoint function remat installs in a ``transformers`` model.

    Called by transformers as ``fn(layer_forward, *args)``; runs
    :func:`remat.checkpoint` with the options given here. Usable wherever a
    library accepts a ``torch.utils.checkpoint.checkpoint``-like function.

    Example:
        >>> import torch, remat.policies
        >>> fn = RematCheckpointFunction(policy=remat.policies.save_matmuls)
        >>> layer = torch.nn.Linear(4, 4)
        >>> fn(layer, torch.randn(2, 4, requires_grad=True)).sum().backward()
    """

    __slots__ = ("checkpoint_options", "offload_inputs", "options")

    def __init__(self, *, offload_inputs: bool = False, **options: Any) -> None:
        # Validated now, so a bad option fails here, not in the first training step.
        self.checkpoint_options = CheckpointOptions.from_kwargs(_API, options)
        if not isinstance(offload_inputs, bool):
            raise CheckpointTypeError(
                f"{_API}: offload must be True or False, got {offload_inputs!r}."
            )
        self.offload_inputs = offload_inputs
        self.options: Mapping[str, Any] = MappingProxyType(dict(options))  # as given

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # Options are fixed: every call argument goes to the layer, even one
        # named like an option.
        if not self.offload_inputs:
            return run_checkpoint(self.checkpoint_options, function, *args, **kwargs)
        # The layer's inputs (all the checkpoint keeps) wait in host memory.
        with offload(min_bytes=0):
            return run_checkpoint(self.checkpoint_options, function, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # Copies and pickles of a model carry this function (a mapping proxy
        # itself cannot be copied): rebuild it from its options.
        return (_rebuild_function, (self.offload_inputs, dict(self.options)))

    def __repr__(self) -> str:
        options = [f"{name}={value!r}" for name, value in self.options.items()]
        if self.offload_inputs:
            options.append("offload_inputs=True")
        return f"RematCheckpointFunction({', '.join(options)})"


def _rebuild_function(offload_inputs: bool, options: dict[str, Any]) -> RematCheckpointFunction:
    return RematCheckpointFunction(offload_inputs=offload_inputs, **options)


def enable_gradient_checkpointing(
    model: torch.nn.Module,
    *,
    policy: Callable[..., Any] | None = None,
    use_reentrant: bool = False,
    every_n_layers: int = 1,
    offload: bool = False,
    **checkpoint_kwargs: Any,
) -> None:
    """Turn on gradient checkpointing in a ``transformers`` model, run by remat.

    Does what ``model.gradient_checkpointing_enable()`` does (including making
    the input embeddings' output require grad), except that each layer is
    checkpointed with :func:`remat.checkpoint`. Checkpointing applies in
    training mode only (``model.train()``), as in transformers.

    Args:
        model: a ``transformers.PreTrainedModel`` whose class supports gradient
            checkpointing.
        policy: selective checkpointing: a policy from :mod:`remat.policies`
            (e.g. ``save_matmuls``), any ``(ctx, op, *args, **kwargs)``
            policy function, or a list of ``OpOverload``s to save.
        use_reentrant: ``False`` (default, recommended) or ``True``.
        every_n_layers: checkpoint only every n-th decoder layer (needs a
            transformers release that has it, e.g. 5.23; 1 checkpoints all).
        offload: keep each checkpointed layer's inputs (all that checkpointing
            keeps) in host memory until backward, as transformers' ``offload=True``.
        **checkpoint_kwargs: further options of :func:`remat.checkpoint`
            (``early_stop``, ``preserve_rng_state``, ``determinism_check``, ...).

    Example:
        >>> from remat.integrations.huggingface import enable_gradient_checkpointing
        >>> enable_gradient_checkpointing(model, policy=remat.policies.save_matmuls)  # doctest: +SKIP
    """
    api = "remat.integrations.huggingface.enable_gradient_checkpointing"
    transformers = _transformers(api)
    _check_model(model, transformers, api)
    if (
        isinstance(every_n_layers, bool)
        or not isinstance(every_n_layers, int)
        or every_n_layers < 1
    ):
        raise CheckpointUsageError(
            f"{api}: every_n_layers must be an int >= 1, got {every_n_layers!r}."
        )
    function = RematCheckpointFunction(
        offload_inputs=offload,
        use_reentrant=use_reentrant,
        **({"policy": policy} if policy is not None else {}),
        **checkpoint_kwargs,
    )
    _install(model, function, every_n_layers, api)


def disable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Turn gradient checkpointing off again (transformers' own disable).

    Example:
        >>> from remat.integrations.huggingface import disable_gradient_checkpointing
        >>> disable_gradient_checkpointing(model)  # doctest: +SKIP
    """
    api = "remat.integrations.huggingface.disable_gradient_checkpointing"
    _check_model(model, _transformers(api), api, needs_support=False)
    hf_model: Any = model
    _forget_remat_overrides(hf_model)
    disable = getattr(hf_model, "activation_checkpointing_disable", None)  # newer name
    if disable is None:
        disable = hf_model.gradient_checkpointing_disable
    disable()


def is_remat_checkpointing(model: torch.nn.Module) -> bool:
    """Whether some layer of ``model`` is checkpointed and remat runs it.

    Example:
        >>> import torch
        >>> is_remat_checkpointing(torch.nn.Linear(2, 2))
        False
    """
    return any(
        getattr(module, "gradient_checkpointing", False) is True
        and isinstance(_installed_function(module), RematCheckpointFunction)
        for module in model.modules()
    )


def _transformers(api: str) -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise UnsupportedCheckpointError(f"{api} needs transformers; {_INSTALL_HINT}.") from exc


def _check_model(
    model: object, transformers: ModuleType, api: str, *, needs_support: bool = True
) -> None:
    if not isinstance(model, transformers.PreTrainedModel):
        raise CheckpointTypeError(
            f"{api}: expected a transformers.PreTrainedModel, got {type(model).__name__}. For "
            "other modules use remat.nn.apply_activation_checkpointing or remat.checkpoint."
        )
    if needs_support and not model.supports_gradient_checkpointing:
        raise UnsupportedCheckpointError(
            f"{api}: {type(model).__name__} does not support gradient checkpointing in "
            "transformers (its supports_gradient_checkpointing is False); wrap its layers with "
            "remat.nn.apply_activation_checkpointing instead."
        )


# --- transformers' private API: everything below, nowhere else ----------------
#
# transformers offers no public way to choose the checkpoint function: its
# public enable method always binds torch.utils.checkpoint.checkpoint. It does
# route that function through PreTrainedModel._set_gradient_checkpointing(
# enable, gradient_checkpointing_func[, every_n_layers]) (since 4.35;
# every_n_layers is newer, present in 5.23.0), which stores it on every layer as
# `_gradient_checkpointing_func`. Checked against transformers 5.23.0, whose
# own enable method calls exactly this; models still on the pre-4.35 format
# (`_set_gradient_checkpointing(module, value)`) cannot take a function.


def _install(model: Any, function: RematCheckpointFunction, every_n_layers: int, api: str) -> None:
    setter = model._set_gradient_checkpointing
    parameters = inspect.signature(setter).parameters
    if "gradient_checkpointing_func" not in parameters:
        raise UnsupportedCheckpointError(
            f"{api}: {type(model).__name__} uses transformers' pre-4.35 checkpointing format, "
            "which cannot take a custom checkpoint function. Upgrade transformers (or the "
            "model's code), or use remat.nn.apply_activation_checkpointing on its layers."
        )
    layer_options: dict[str, Any] = {}
    if every_n_layers != 1:
        if "every_n_layers" not in parameters:
            raise UnsupportedCheckpointError(
                f"{api}: every_n_layers is not supported by transformers "
                f"{_transformers(api).__version__}; upgrade it, or leave every_n_layers=1."
            )
        layer_options["every_n_layers"] = every_n_layers
    # transformers' own enable first (the class's method: the instance may carry
    # remat's override below), for its bookkeeping (input embeddings that
    # require grad, checks, subclass overrides); then swap the function.
    # transformers 5 looks for overrides of the old name on the instance, so
    # remat's own (from an earlier enable) must not be there meanwhile.
    _forget_remat_overrides(model)
    enable = getattr(type(model), "activation_checkpointing_enable", None)  # newer name
    kwargs = {"use_reentrant": function.options.get("use_reentrant", False)}
    if enable is not None:
        enable(model, activation_checkpointing_kwargs=kwargs, **layer_options)
    else:
        type(model).gradient_checkpointing_enable(model, gradient_checkpointing_kwargs=kwargs)
    setter(enable=True, gradient_checkpointing_func=function, **layer_options)
    _keep_remat_on_reenable(
        model, {**function.options, "offload": function.offload_inputs}, every_n_layers
    )


# Hugging Face's Trainer calls model.gradient_checkpointing_enable(
# gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs) itself, and
# transformers' method binds torch's checkpoint: remat would be silently
# replaced. While remat is on, the instance carries its own enable and disable.
_ENABLE_NAMES = ("gradient_checkpointing_enable", "activation_checkpointing_enable")
_DISABLE_NAMES = ("gradient_checkpointing_disable", "activation_checkpointing_disable")


class _RematReenable:
    """``model.gradient_checkpointing_enable`` while remat runs the model's checkpointing.

    Enabling again keeps remat; the keyword options given there (the Trainer's
    ``gradient_checkpointing_kwargs``) are remat options merged over the ones
    given to :func:`enable_gradient_checkpointing`, so an unknown one raises.
    """

    def __init__(self, model: Any, options: dict[str, Any], every_n_layers: int) -> None:
        self.model = model
        self.options = options
        self.every_n_layers = every_n_layers

    def __call__(
        self,
        gradient_checkpointing_kwargs: dict[str, Any] | None = None,
        activation_checkpointing_kwargs: dict[str, Any] | None = None,
        **layer_options: Any,
    ) -> None:
        given = {**(gradient_checkpointing_kwargs or {}), **(activation_checkpointing_kwargs or {})}
        every_n_layers = layer_options.pop("every_n_layers", self.every_n_layers)
        if "offload" in layer_options:  # transformers' own argument, same meaning
            given["offload"] = layer_options.pop("offload")
        if layer_options:
            raise CheckpointUsageError(
                f"{_API}: gradient_checkpointing_enable got unknown arguments "
                f"{sorted(layer_options)}; remat options go in gradient_checkpointing_kwargs."
            )
        enable_gradient_checkpointing(
            self.model, every_n_layers=every_n_layers, **{**self.options, **given}
        )


class _RematDisable:
    """``model.gradient_checkpointing_disable`` while remat is on: off, and the
    instance's overrides go, so a later enable is transformers' own again."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self) -> None:
        disable_gradient_checkpointing(self.model)


def _keep_remat_on_reenable(model: Any, options: dict[str, Any], every_n_layers: int) -> None:
    for name in _ENABLE_NAMES:
        if hasattr(type(model), name):
            model.__dict__[name] = _RematReenable(model, options, every_n_layers)
    for name in _DISABLE_NAMES:
        if hasattr(type(model), name):
            model.__dict__[name] = _RematDisable(model)


def _forget_remat_overrides(model: Any) -> None:
    for name in (*_ENABLE_NAMES, *_DISABLE_NAMES):
        model.__dict__.pop(name, None)


def _installed_function(module: torch.nn.Module) -> object:
    return getattr(module, "_gradient_checkpointing_func", None)
