"""Find a model's blocks: the one finder behind every entry point.

Layer: the bottom (it needs only torch and ``remat.errors``). The planner,
:func:`remat.apply_config`, the sharding helpers and the ``remat`` commands
all call :func:`find_blocks`, so "the blocks" of a model mean one thing
everywhere: by a glob or regex on module names when one is given, otherwise
by structure (the ``ModuleList``/``Sequential`` of repeated blocks that run as
a chain), and, of several such chains, by what their blocks keep for
backward in a forward with the inputs.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> [name for name, _ in find_blocks(model)]
    ['0', '1']
"""

from __future__ import annotations

import fnmatch
import functools
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from remat.errors import CheckpointUsageError

__all__ = ["Stack", "block_stacks", "find_blocks", "forward_with_hooks", "require_blocks"]

Container = tuple[str, list[tuple[str, nn.Module]], bool]


@dataclass(frozen=True)
class Stack:
    """A candidate stack of blocks: a ``ModuleList`` (one child or more) or a ``Sequential`` (two or more).

    Attributes:
        name: the container's path in the model (``""`` for the root).
        children: its children as ``(path in the model, module)``.
        chained: its children ran as a chain in a forward with the inputs
            (each took the previous one's output); False without inputs.
        same_class: its children are all of one class (repeated blocks).
        is_list: it is an ``nn.ModuleList``.
        params: parameters of its children.
    """

    name: str
    children: tuple[tuple[str, nn.Module], ...]
    chained: bool
    same_class: bool
    is_list: bool
    params: int

    @property
    def rank(self) -> tuple[bool, bool, bool, int, int]:
        """What makes one stack the likelier stack of blocks: larger is likelier."""
        return (self.chained, self.same_class, self.is_list, self.params, len(self.children))


def block_stacks(
    model: nn.Module, inputs: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None
) -> list[Stack]:
    """Every candidate stack of blocks, the likeliest first (see :func:`find_blocks`).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> [(stack.name, stack.same_class) for stack in block_stacks(model)]
        [('', False)]
    """
    # A ModuleList is a list of blocks even with one (a one-layer model); a
    # Sequential of one module is a wrapper, not a stack.
    containers: list[Container] = [
        (name, list(module.named_children()), isinstance(module, nn.ModuleList))
        for name, module in model.named_modules()
        if (isinstance(module, nn.ModuleList) and len(module) >= 1)
        or (isinstance(module, nn.Sequential) and len(module) >= 2)
    ]
    chained = _chained(model, inputs, kwargs or {}, containers) if inputs is not None else set()
    stacks = []
    for name, children, is_list in containers:
        prefix = f"{name}." if name else ""
        stacks.append(
            Stack(
                name=name,
                children=tuple((prefix + child, module) for child, module in children),
                chained=name in chained,
                same_class=len({type(child) for _, child in children}) == 1,
                is_list=is_list,
                params=sum(p.numel() for _, child in children for p in child.parameters()),
            )
        )
    return sorted(stacks, key=lambda stack: stack.rank, reverse=True)


def find_blocks(
    model: nn.Module,
    pattern: str | None = None,
    inputs: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> list[tuple[str, nn.Module]]:
    """The model's blocks as ``(name, module)``, in module order; empty if it has none.

    With ``pattern``, the modules whose names match it: a glob
    (``"layers.*"``) or ``"re:<regex>"`` (a full match); a match inside
    another match is left out (it would be checkpointed twice), and a
    pattern that matches nothing is a ``CheckpointUsageError``.

    Otherwise the children of the ``ModuleList``/``Sequential`` that is the
    model's stack of blocks. Preferred, in order: children that ran as a
    chain in a ``no_grad`` forward with ``inputs`` (each took the previous
    one's output; only when ``inputs`` are given), children all of one class,
    a ``ModuleList``, the most parameters, the most children. A list of heads
    or adapters applied to one input is not a chain, however large. Of
    several chains of repeated blocks (an encoder and a decoder), the one
    whose blocks keep the most bytes for backward in a forward with gradients
    (a short decoder with cross-attention can have more parameters than a
    long encoder whose activations dominate the step). With ``inputs`` (and
    keyword inputs ``kwargs``) the model runs forward once or twice.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> [name for name, _ in find_blocks(model, "re:[0-9]")]
        ['0', '1']
    """
    if pattern is not None:
        return _matching(model, pattern)
    stacks = block_stacks(model, inputs, kwargs)
    if not stacks:
        return []
    repeated = [stack for stack in stacks if stack.chained and stack.same_class]
    if inputs is not None and len(repeated) > 1:
        kept = _saved_bytes(model, inputs, kwargs or {}, repeated)
        return list(max(zip(kept, repeated, strict=True), key=lambda pair: pair[0])[1].children)
    return list(stacks[0].children)


def require_blocks(
    model: nn.Module,
    pattern: str | None = None,
    inputs: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    api: str,
    remedy: str,
) -> list[tuple[str, nn.Module]]:
    """:func:`find_blocks` for a caller that needs blocks: none is a ``CheckpointUsageError``.

    Arguments as for :func:`find_blocks` (a ``pattern`` that matches nothing
    raises there). The message states the rule once for every caller (a ``ModuleList`` of
    one module or more, or a ``Sequential`` of two or more), then ``remedy``:
    what the caller offers instead ("pass blocks=").

    Example:
        >>> import torch
        >>> require_blocks(torch.nn.Linear(2, 2), api="my_api", remedy="pass blocks=")
        Traceback (most recent call last):
        ...
        remat.errors.CheckpointUsageError: my_api: Linear has no stack of blocks (an nn.ModuleList of one module or more, or an nn.Sequential of two or more); pass blocks=.
    """
    found = find_blocks(model, pattern, inputs, kwargs)
    if not found:
        raise CheckpointUsageError(
            f"{api}: {type(model).__name__} has no stack of blocks (an nn.ModuleList of one "
            f"module or more, or an nn.Sequential of two or more); {remedy}."
        )
    return found


def _matching(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    if not isinstance(pattern, str):
        raise CheckpointUsageError(
            f"remat: a block pattern is a glob such as 'layers.*' or 're:<regex>', got "
            f"{type(pattern).__name__}."
        )
    match = _matcher(pattern)
    found = [(fqn, m) for fqn, m in model.named_modules() if fqn and match(fqn)]
    outer = [(fqn, m) for fqn, m in found if not any(fqn.startswith(other + ".") for other, _ in found)]
    if not outer:
        raise CheckpointUsageError(
            f"remat: no module name matches the block pattern {pattern!r} (names look like "
            f"{next((n for n, _ in model.named_modules() if n), '(none)')!r})."
        )
    return outer


def _matcher(pattern: str) -> Callable[[str], bool]:
    if pattern.startswith("re:"):
        try:
            compiled = re.compile(pattern[3:])
        except re.error as error:
            raise CheckpointUsageError(f"remat: block pattern {pattern!r} is not a regex: {error}.") from error
        return lambda fqn: compiled.fullmatch(fqn) is not None
    return lambda fqn: fnmatch.fnmatchcase(fqn, pattern)


def _saved_bytes(
    model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any], stacks: Sequence[Stack]
) -> list[int]:
    """Per stack, the activation bytes its blocks save for backward in one forward with gradients.

    Activations are the storages the forward makes: parameters, buffers and
    the inputs, which exist anyway, do not count. Each storage counts once
    per stack (views and tensors saved twice do not add up); the storages are
    held only while the forward runs.
    """
    existing = {
        id(storage)
        for tensor in [*model.parameters(), *model.buffers(), *_tensors([*inputs, *kwargs.values()])]
        for storage in _storage(tensor)
    }
    running: list[int] = []  # the stacks of the blocks whose forward runs, innermost last
    saved: list[dict[int, torch.UntypedStorage]] = [{} for _ in stacks]
    handles = []
    def enter(position: int, *_: Any) -> None:
        running.append(position)

    def leave(*_: Any) -> None:  # returns None: a forward hook's result would replace the output
        running.pop()

    for position, stack in enumerate(stacks):
        for _, module in stack.children:
            handles.append(module.register_forward_pre_hook(functools.partial(enter, position)))
            handles.append(module.register_forward_hook(leave, always_call=True))

    def pack(tensor: Tensor) -> Tensor:
        if running:
            for storage in _storage(tensor):
                if id(storage) not in existing:
                    saved[running[-1]][id(storage)] = storage
        return tensor

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return [sum(storage.nbytes() for storage in found.values()) for found in saved]


def forward_with_hooks(
    model: nn.Module, inputs: Sequence[Any], handles: list[Any], kwargs: Mapping[str, Any] | None = None
) -> None:
    """One ``no_grad`` forward with ``handles``' hooks in place; removes them after."""
    try:
        with torch.no_grad():
            model(*inputs, **(kwargs or {}))
    finally:
        for handle in handles:
            handle.remove()


def _chained(
    model: nn.Module,
    inputs: Sequence[Any],
    kwargs: Mapping[str, Any],
    containers: Sequence[Container],
) -> set[str]:
    """Names of the containers whose children ran as a chain in one forward."""
    broken: set[str] = set()
    last: dict[str, weakref.ref[Any] | None] = {}
    handles = []
    for name, children, _ in containers:
        for position, (_, child) in enumerate(children):

            def before(
                module: nn.Module, args: Any, kwargs: Any, name: str = name, position: int = position
            ) -> None:
                previous = last.get(name)
                first = _first_tensor((*args, *kwargs.values()))
                if position > 0 and (previous is None or first is None or previous() is not first):
                    broken.add(name)

            def after(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
                # Blocks of transformers return (hidden_states, ...) in some releases.
                first = _first_tensor(output if isinstance(output, (tuple, list)) else (output,))
                last[name] = weakref.ref(first) if first is not None else None

            handles.append(child.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(child.register_forward_hook(after))
    forward_with_hooks(model, inputs, handles, kwargs)
    return {name for name, _, _ in containers if name not in broken and name in last}


def _storage(tensor: Tensor) -> list[torch.UntypedStorage]:
    try:
        return [tensor.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []  # sparse, nested or opaque subclasses own no plain storage


def _tensors(values: Sequence[Any]) -> list[Tensor]:
    return [value for value in values if isinstance(value, Tensor)]


def _first_tensor(values: Sequence[Any]) -> Tensor | None:
    return next((value for value in values if isinstance(value, Tensor)), None)
