"""Replay the ambient state of a forward during its recomputation.

The last part of this module is the ambient state a recomputation cannot
replay: a ``torch.func`` transform (:func:`region_transform`,
:func:`check_still_inside`; ``docs/design/tracing.md``). Under functorch's grad
transform (``grad``, ``vjp``, ``jacrev``, ``hessian``) saved-tensor hooks are
off, so the hook engine cannot run there (torch's checkpoint neither): the
front-ends take ``remat._engine.transformed`` instead; under ``vmap``
and ``jvp`` the non-reentrant variant runs, but a backward after the
transform returned would recompute outside it, and is refused; the reentrant
variant (an ``autograd.Function`` written for autograd's own backward) is
refused under every transform once it would build its node.

A recomputation must see what the forward saw: the CPU RNG and the RNG of the
device the inputs live on (so dropout draws the same mask), and the autocast
state of that device and of the CPU (so the same dtypes come out). The state
is captured once, when a region starts, into an immutable :class:`ReplayState`;
:meth:`ReplayState.restore` re-enters it around the recomputation without
disturbing the caller's RNG (``torch.random.fork_rng``).

Device RNG is captured only where the device already has a context, so
checkpointing never initializes CUDA by accident; a device that gets
initialized *inside* the forward cannot be replayed and is reported by
:meth:`ReplayState.check_device_unchanged`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from remat._compat.autograd import saved_tensor_hooks_enabled, set_grad_mode
from remat._compat.devices import (
    current_device_context,
    device_is_initialized,
    function_mode_count,
)
from remat._compat.pytree import tree_flatten
from remat._compat.tracers import functorch_transform
from remat.errors import DeviceStateError, UnsupportedCheckpointError

__all__ = [
    "DefaultDeviceType",
    "ReplayState",
    "check_still_inside",
    "get_device_states",
    "infer_device_type",
    "needs_function_path",
    "region_transform",
    "set_device_states",
    "tensor_leaves",
]

_DEFAULT_DEVICE_TYPE: ContextVar[str | None] = ContextVar("remat_default_device", default=None)


class DefaultDeviceType:
    """The device type whose RNG is preserved when no input is on a device.

    Mirrors ``torch.utils.checkpoint.DefaultDeviceType``; the setting is
    context-local instead of a class attribute shared by every thread.

    Example:
        >>> import remat
        >>> remat.DefaultDeviceType.set_device_type("cpu")
        >>> remat.DefaultDeviceType.get_device_type()
        'cpu'
    """

    @staticmethod
    def set_device_type(device: str = "cuda") -> None:
        """Set the default device type (e.g. ``"cuda"``, ``"xpu"``)."""
        _DEFAULT_DEVICE_TYPE.set(device)

    @staticmethod
    def get_device_type() -> str:
        """The default device type: the one set, else the current accelerator, else cpu."""
        chosen = _DEFAULT_DEVICE_TYPE.get()
        return _detected_device_type() if chosen is None else chosen


@functools.cache
def _detected_device_type() -> str:
    # Asked by every region whose inputs are on the CPU; the accelerator a
    # process has does not change while it runs.
    accelerator_api = getattr(torch, "accelerator", None)
    if accelerator_api is not None and hasattr(accelerator_api, "current_accelerator"):
        accelerator = accelerator_api.current_accelerator()
        if accelerator is not None and accelerator_api.is_available():
            return str(accelerator.type)
    return "cuda" if torch.cuda.is_available() else "cpu"


def tensor_leaves(values: Iterable[Any]) -> list[torch.Tensor]:
    """Every tensor in ``values``, also inside nested containers."""
    leaves, _ = tree_flatten(list(values))
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def infer_device_type(*args: Any) -> str:
    """The non-CPU device type of the tensors in ``args`` (cuda first), else the default."""
    return _pick_device_type(tensor_leaves(args))


def _pick_device_type(tensors: Iterable[torch.Tensor]) -> str:
    found: list[str] = []
    for tensor in tensors:
        if tensor.is_cpu:  # a bool, no torch.device built (every region asks)
            continue
        kind = tensor.device.type
        if kind != "cpu" and kind not in found:
            found.append(kind)
    if not found:
        return DefaultDeviceType.get_device_type()
    if len(found) > 1:
        warnings.warn(
            "remat.checkpoint: tensor arguments live on several device types "
            f"{sorted(found)}; only the RNG of one ({'cuda' if 'cuda' in found else found[0]}) "
            "is preserved, so random ops on the others may give different gradients.",
            stacklevel=3,
        )
    return "cuda" if "cuda" in found else found[0]


def _device_module(device_type: str) -> Any:
    return getattr(torch, device_type, None)


def get_device_states(*args: Any) -> tuple[list[int], list[torch.Tensor]]:
    """Device ids of the device tensors in ``args`` and their RNG states.

    Example:
        >>> import torch, remat
        >>> remat.get_device_states(torch.zeros(2))  # CPU tensors have no device RNG
        ([], [])
    """
    tensors = tensor_leaves(args)
    return _device_rng_states(tensors, _pick_device_type(tensors))


def _device_rng_states(
    tensors: Iterable[torch.Tensor], device_type: str
) -> tuple[list[int], list[torch.Tensor]]:
    ids: list[int] = []
    for tensor in tensors:
        if tensor.device.type not in ("cpu", "meta"):
            index = tensor.get_device()
            if index not in ids:
                ids.append(index)
    if not ids:
        return [], []
    module = _device_module(device_type)
    states = []
    for index in ids:
        with module.device(index):
            states.append(module.get_rng_state())
    return ids, states


def set_device_states(
    devices: list[int], states: list[torch.Tensor], *, device_type: str | None = None
) -> None:
    """Set the RNG state of each device id in ``devices`` (the inverse of
    :func:`get_device_states`).

    Example:
        >>> import remat
        >>> remat.set_device_states([], [])  # nothing to restore on a CPU-only run
    """
    kind = device_type or DefaultDeviceType.get_device_type()
    if kind == "meta" or not devices:
        return
    module = _device_module(kind)
    for index, state in zip(devices, states, strict=False):
        with module.device(index):
            module.set_rng_state(state)


AutocastState = tuple[str, bool, "torch.dtype | None", "bool | None"]
"""(device type, enabled, dtype, cache enabled): a plain tuple, built for every
region and compared with the current state before each recomputation. Autocast
off is ``(device type, False, None, None)``: its dtype and cache setting change
nothing, and the usual region (no autocast) then asks one question, not three."""


def _autocast_state(device_type: str) -> AutocastState:
    if not torch.is_autocast_enabled(device_type):
        return _CPU_OFF if device_type == "cpu" else (device_type, False, None, None)
    return (
        device_type,
        True,
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


_CPU_OFF: AutocastState = ("cpu", False, None, None)
_CPU_AUTOCAST_OFF: tuple[AutocastState, ...] = (_CPU_OFF,)
"""The autocast part of a region's state without CPU autocast, shared (no tuple per region)."""


def _enter_autocast(state: AutocastState) -> contextlib.AbstractContextManager[Any]:
    device_type, enabled, dtype, cache_enabled = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


# Built for every region: slotted, not frozen (a frozen dataclass sets each
# field through object.__setattr__, several times slower). Never mutated.
@dataclass(slots=True)
class ReplayState:
    """RNG, autocast and default-device state of a forward, re-entered for its recompute."""

    device_type: str
    preserve_rng: bool
    cpu_rng: torch.Tensor | None
    device_ids: tuple[int, ...]
    device_rngs: tuple[torch.Tensor, ...]
    device_was_initialized: bool
    autocast: tuple[AutocastState, ...]
    device_context: Any = None

    @classmethod
    def capture(cls, tensors: Sequence[torch.Tensor], *, preserve_rng: bool) -> ReplayState:
        """Snapshot the state a region's forward starts in; ``tensors`` are its inputs."""
        for tensor in tensors:
            if not tensor.is_cpu:  # a bool: no torch.device built (every region asks)
                device_type = _pick_device_type(tensors)
                break
        else:  # every input on the CPU: the default device type (usual on a CPU machine)
            chosen = _DEFAULT_DEVICE_TYPE.get()
            device_type = _detected_device_type() if chosen is None else chosen
        # The CPU is always "initialized"; only an accelerator's context is asked about.
        module = _device_module(device_type) if device_type != "cpu" else None
        initialized = device_type == "cpu" or (module is not None and device_is_initialized(module))
        ids: list[int] = []
        rngs: list[torch.Tensor] = []
        if preserve_rng and initialized and device_type != "cpu":
            ids, rngs = _device_rng_states(tensors, device_type)
        cpu_autocast = _autocast_state("cpu")
        autocast = _CPU_AUTOCAST_OFF if cpu_autocast is _CPU_OFF else (cpu_autocast,)
        if device_type != "cpu" and torch.amp.is_autocast_available(device_type):
            autocast += (_autocast_state(device_type),)
        return cls(
            device_type,
            preserve_rng,
            torch.default_generator.get_state() if preserve_rng else None,
            tuple(ids),
            tuple(rngs),
            initialized,
            autocast,
            current_device_context() if function_mode_count() else None,
        )

    def check_device_unchanged(self, api: str) -> None:
        """Raise if the device got its first context during the forward."""
        if not self.preserve_rng or self.device_was_initialized:
            return
        module = _device_module(self.device_type)
        if module is not None and device_is_initialized(module):
            raise DeviceStateError(
                f"{api}: the {self.device_type} device was first initialized inside the "
                "checkpointed forward, so its RNG state could not be saved for the "
                "recomputation. Initialize the device before the checkpoint (for example "
                f"create a tensor on it), or pass preserve_rng_state=False."
            )

    def restore(self, *, enable_grad: bool = False) -> contextlib.AbstractContextManager[None]:
        """Run a block under the captured RNG and autocast state.

        The caller's RNG state is saved and put back afterwards. With
        ``enable_grad``, grad mode is on inside (a region's forward ran with it
        on) and back as it was afterwards.
        """
        return _Restoring(self, enable_grad)

    def enter(self, *, enable_grad: bool = False) -> Undo:
        """What :meth:`restore` does on entering; pass the result to :meth:`exit`.

        The usual case (CPU inputs, autocast as it was in the forward, no
        ``torch.device`` context) touches only grad mode and the CPU generator,
        without a context-manager object or an ExitStack: a recomputation calls
        this directly (docs/design/performance.md). Anything else goes on an
        ExitStack.
        """
        caller_grad = None
        if enable_grad:
            caller_grad = torch.is_grad_enabled()
            set_grad_mode(True)
        caller_rng = None
        stack = None
        try:
            if self.preserve_rng:
                if self.device_ids:
                    stack = contextlib.ExitStack()
                    stack.enter_context(
                        torch.random.fork_rng(devices=list(self.device_ids), device_type=self.device_type)
                    )
                else:
                    # CPU state only. fork_rng would also look up a device module,
                    # which torch 2.4 lacks for "meta" (the type of meta inputs).
                    caller_rng = torch.default_generator.get_state()
                assert self.cpu_rng is not None, "remat bug: preserve_rng without cpu state"
                torch.default_generator.set_state(self.cpu_rng)
                if self.device_ids:
                    set_device_states(list(self.device_ids), list(self.device_rngs), device_type=self.device_type)
            for setting in self.autocast:
                if _autocast_state(setting[0]) != setting:
                    stack = stack or contextlib.ExitStack()
                    stack.enter_context(_enter_autocast(setting))
            if self.device_context is not None:  # `with torch.device(...)` around the forward
                stack = stack or contextlib.ExitStack()
                stack.enter_context(self.device_context)
        except BaseException:
            self.exit((caller_grad, caller_rng, stack), None)
            raise
        return caller_grad, caller_rng, stack

    @staticmethod
    def exit(undo: Undo, exc: BaseException | None) -> None:
        """Undo :meth:`enter` (``exc``: the exception leaving the block, if any)."""
        caller_grad, caller_rng, stack = undo
        try:
            if stack is not None:
                if exc is None:
                    stack.close()
                else:
                    stack.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            if caller_rng is not None:
                torch.default_generator.set_state(caller_rng)
            if caller_grad is not None:
                set_grad_mode(caller_grad)


Undo = tuple["bool | None", "torch.Tensor | None", "contextlib.ExitStack | None"]
"""What :meth:`ReplayState.enter` changed: caller's grad mode and RNG state, other contexts."""


class _Restoring:
    """The context of :meth:`ReplayState.restore`."""

    __slots__ = ("_enable_grad", "_state", "_undo")

    def __init__(self, state: ReplayState, enable_grad: bool) -> None:
        self._state = state
        self._enable_grad = enable_grad
        self._undo: Undo | None = None

    def __enter__(self) -> None:
        self._undo = self._state.enter(enable_grad=self._enable_grad)

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> None:
        undo, self._undo = self._undo, None
        assert undo is not None, "remat bug: restore() exited before it was entered"
        self._state.exit(undo, exc)


_GRAD = "grad"
_ALTERNATIVE = (
    "Take the gradient with torch.autograd instead (loss.backward() or "
    "torch.autograd.grad, which remat checkpoints, also inside torch.compile), or "
    "call the function without remat.checkpoint under torch.func (no memory saved)."
)


def needs_function_path() -> bool:
    """Whether a region starting now must run as one recomputing autograd.Function
    (:func:`remat._engine.transformed.run_transformed`): a ``torch.func`` transform is
    active and saved-tensor hooks are off (the grad transform, at any depth; on torch 2.4
    vmap and jvp too). Asked here, in the core every region imports, so that the
    transformed path's module loads only when a transform needs it."""
    transform = functorch_transform()
    return transform is not None and (transform == "grad" or not saved_tensor_hooks_enabled())


def region_transform(api: str, *, reentrant: bool) -> str | None:
    """The ``torch.func`` transform a region starting now runs under (None: none).

    Raises the region's refusal where it cannot run (see the module docstring).
    """
    transform = functorch_transform()
    if transform is None:
        return None
    if reentrant:
        raise UnsupportedCheckpointError(
            f"{api}(use_reentrant=True) under torch.func.{transform}: the reentrant variant is "
            "an autograd.Function written for autograd's own backward, which functorch "
            "transforms do not run. Pass use_reentrant=False (it runs under every torch.func "
            "transform: grad, vjp, jacrev, jacfwd, hessian, vmap, jvp), or call remat.checkpoint "
            "outside the transform."
        )
    if transform == _GRAD:
        # remat.checkpoint and the wrappers take the torch.func path before a
        # Region exists (remat._engine.transformed); a Region driven by hand cannot.
        raise UnsupportedCheckpointError(
            f"{api} under torch.func.grad (or vjp, jacrev, hessian): these transforms turn "
            "off the saved-tensor hooks that a Region's enter/exit protocol is built on. "
            f"Call remat.checkpoint(fn, ...) there instead, which runs the region as one "
            f"recomputing autograd.Function. {_ALTERNATIVE}"
        )
    if not saved_tensor_hooks_enabled():
        raise UnsupportedCheckpointError(
            f"{api} under torch.func.{transform}: on torch {torch.__version__} this transform "
            "turns off the saved-tensor hooks that activation checkpointing is built on (from "
            f"torch 2.7 it does not). {_ALTERNATIVE}"
        )
    return transform


def check_still_inside(transform: str, api: str) -> None:
    """Refuse to recompute a region made under ``transform`` once the transform has returned."""
    if functorch_transform() is None:
        raise UnsupportedCheckpointError(
            f"{api}: backward reached a region that ran under torch.func.{transform} after the "
            f"transform returned. Its recomputation needs the transform's inputs, which exist "
            f"only inside it. Put remat.checkpoint around the transformed function instead "
            f"(remat.checkpoint(torch.func.{transform}(fn), ...)), or take the gradient "
            "inside the transform."
        )
