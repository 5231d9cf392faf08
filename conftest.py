"""Hooks for every test run, the tests' and the docstring examples'.

Under pytest-xdist (``scripts/test.sh`` runs two workers), each worker gets
its share of the machine's cores for torch's intra-op threads (and the
processes it starts, through ``OMP_NUM_THREADS``): without it, two workers on
CI's two cores would each run two OpenMP threads, four threads on two cores.
An ``OMP_NUM_THREADS`` set by the caller is left as it is.

Docstring examples (``pytest src/remat --doctest-modules``): free what Dynamo
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
import os
import sys
from typing import Any

import pytest
from _pytest.doctest import DoctestItem


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 0 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # what this worker starts: benchmarks, CLIs
        import torch

        torch.set_num_threads(threads)


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

