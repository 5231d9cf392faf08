"""Fake tensors: a ``FakeTensorMode`` to build models in without memory, the
mode a fake tensor belongs to, and leaving the active fake mode for a block.

Private names used: ``torch._subclasses.fake_tensor`` (``FakeTensorMode``,
``FakeTensor``, ``unset_fake_temporarily``), imported on first use, and the
fake slot of the dispatch-mode stack (``torch._C._get_dispatch_mode``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["fake_mode_of", "fake_tensor_mode", "is_fake", "outside_fake_mode"]


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode``: tensors with shapes, dtypes and storage sizes but no data.

    Unlike the ``meta`` device, fake tensors report a real device (``cpu``),
    which FSDP2 requires of the parameters it shards (it refuses meta ones).
    ``torch._subclasses.fake_tensor`` has no public home (checked 2.4.1-2.15.0).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real (meta) tensors may come in: the model's parameters are converted
    # by ``to_empty`` under the mode, which reads them first.
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_mode_of(values: Sequence[Any]) -> Any:
    """The fake-tensor mode of the first fake tensor in ``values`` if that mode is not
    active already, else None. ``FakeTensor`` and its ``fake_mode`` are private
    (``torch._subclasses.fake_tensor``; checked 2.4.1-2.15.0)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for value in values:
        if isinstance(value, FakeTensor):
            mode = value.fake_mode
            active = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
            return None if active is mode else mode
    return None


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (``FakeTensor`` is private; checked 2.4.1-2.15.0)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def outside_fake_mode() -> contextlib.AbstractContextManager[Any]:
    """Leave the active fake-tensor mode for a block (tensors made there are real).

    A sharded estimate builds its model inside a fake mode, but ``Module.to``
    (dtype changes, peft's adapters) cannot convert fake parameters: it swaps
    them, which the mode's own references forbid (torch 2.13). The loader
    builds on real meta tensors out here, then makes them fake.
    ``unset_fake_temporarily`` is private (checked 2.4.1, 2.7.1, 2.13.0, 2.15.0).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    manager: contextlib.AbstractContextManager[Any] = unset_fake_temporarily()
    return manager
