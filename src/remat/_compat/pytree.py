"""Pytrees: flattening nested containers with torch's registry.

``torch.utils._pytree`` is the registry libraries register their containers
with (transformers' ``ModelOutput``, ...); a region's inputs and outputs and
a planner's step arguments are flattened through it, so that every tensor a
registered container holds is found.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as _pytree

__all__ = ["tree_flatten", "tree_unflatten"]


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """Flatten nested containers with torch's pytree registry.

    ``torch.utils._pytree`` is private by name but is the registry that
    libraries (transformers' ModelOutput, ...) register their containers with;
    no public equivalent exists (checked 2.4.1-2.15.0).
    """
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """Inverse of :func:`tree_flatten`."""
    return _pytree.tree_unflatten(leaves, spec)
