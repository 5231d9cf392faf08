"""Docstring examples (``pytest src/remat --doctest-modules``): free what Dynamo
compiled in an example before doctest empties the example's globals.

Dynamo installs helper globals (``__builtins_dict___N``, ...) into the globals
of every function it compiles, and deletes them when the compiled code is
freed. An example's lambda has the doctest's own globals, which doctest clears
when the example ends; the compiled code was freed later and its deletion
raised ``KeyError`` in "Exception ignored" tracebacks at the end of the run.
Resetting Dynamo first lets every deletion find its name; nothing is hidden.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import pytest
from _pytest.doctest import DoctestItem


class _DoctestGlobals(dict):  # type: ignore[type-arg]
    def clear(self) -> None:
        dynamo: Any = sys.modules.get("torch._dynamo")
        if dynamo is not None and any("___" in name for name in self):
            dynamo.reset()
            gc.collect()
        super().clear()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, DoctestItem) and item.dtest is not None:
            item.dtest.globs = _DoctestGlobals(item.dtest.globs)
