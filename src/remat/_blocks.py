"""Find a model's stack of repeated blocks: what the planner plans and configs checkpoint.

Layer: just above the bottom (it needs only torch); ``remat.config`` and the
planner both use it, so that "the blocks" mean one thing everywhere.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> [name for name, _ in find_blocks(model)]
    ['0', '1']
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Stack", "block_stacks", "find_blocks", "forward_with_hooks"]

Container = tuple[str, list[tuple[str, nn.Module]], bool]


@dataclass(frozen=True)
class Stack:
    """A ``ModuleList``/``Sequential`` of two or more children: a candidate stack of blocks.

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


def block_stacks(model: nn.Module, inputs: Sequence[Any] | None = None) -> list[Stack]:
    """Every candidate stack of blocks, the likeliest first (see :func:`find_blocks`).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> [(stack.name, stack.same_class) for stack in block_stacks(model)]
        [('', False)]
    """
    containers: list[Container] = [
        (name, list(module.named_children()), isinstance(module, nn.ModuleList))
        for name, module in model.named_modules()
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2
    ]
    chained = _chained(model, inputs, containers) if inputs is not None else set()
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
    model: nn.Module, inputs: Sequence[Any] | None = None
) -> list[tuple[str, nn.Module]] | None:
    """The children of the ``ModuleList``/``Sequential`` that is the model's stack of blocks.

    Preferred, in order: children that ran as a chain in a ``no_grad``
    forward with ``inputs`` (each took the previous one's output; only when
    ``inputs`` are given), children all of one class, a ``ModuleList``, the
    most parameters, the most children. A list of heads or adapters applied
    to one input is not a chain, however large. None if the model has no
    container of two or more children. (The planner also measures which of
    several chained stacks of repeated blocks carries the most activations.)
    """
    stacks = block_stacks(model, inputs)
    return list(stacks[0].children) if stacks else None


def forward_with_hooks(model: nn.Module, inputs: Sequence[Any], handles: list[Any]) -> None:
    """One ``no_grad`` forward with ``handles``' hooks in place; removes them after."""
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()


def _chained(
    model: nn.Module,
    inputs: Sequence[Any],
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
    forward_with_hooks(model, inputs, handles)
    return {name for name, _, _ in containers if name not in broken and name in last}


def _first_tensor(values: Sequence[Any]) -> Tensor | None:
    return next((value for value in values if isinstance(value, Tensor)), None)
