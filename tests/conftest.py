"""Shared fixtures: ``impl`` runs a test once with torch.utils.checkpoint and once with remat.

``pytest -k torch`` validates a test against torch alone (works before remat exists).
``one_process_mesh`` is a one-rank CPU device mesh for DTensor tests.
``tiny_llama`` is a tiny Llama's config file, as ``remat --hf-config`` reads it.

pytest puts this folder first on ``sys.path`` when it imports this file (its
default "prepend" import mode; no folder under it is a package), so every
test, in any folder, imports the shared pieces as ``from helpers import ...``.
"""

from __future__ import annotations

import os

# Simulated pipeline ranks run in this process (remat._fork.default_processes): the suite's
# pytest-xdist workers already share the cores, and forking from them made the suite slower.
# The tests of the forked path ask for processes=2 themselves.
os.environ.setdefault("REMAT_PROCESSES", "1")

import logging
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

# remat is imported as installed (scripts/setup.sh installs this checkout in
# editable mode; the matrix does the same per torch release), never through a
# path put first here: what is tested is what users import.
from helpers import IMPL_NAMES, Impl, dtensor_api, get_impl, tiny_llama_config


@pytest.fixture(params=IMPL_NAMES)
def impl(request: pytest.FixtureRequest) -> Impl:
    return get_impl(request.param)


@pytest.fixture
def one_process_mesh(tmp_path: pathlib.Path) -> Iterator[Any]:
    """A one-rank gloo device mesh on CPU (a file store: no port to race for)."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    api = dtensor_api()
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield api.DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


@pytest.fixture
def tiny_llama(tmp_path: pathlib.Path) -> pathlib.Path:
    """A tiny Llama's config.json, as ``--hf-config`` reads it (named tiny_llama_config.json)."""
    config = tiny_llama_config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
        max_position_embeddings=2048,  # transformers' default
    )
    path = tmp_path / "tiny_llama_config.json"
    config.to_json_file(path)
    return path


@pytest.fixture(autouse=True)
def _fresh_state() -> None:
    torch.manual_seed(0)
    # torch's checkpoint debug mode logs through the "LoggingTensor" logger
    # with printf-style extra args that only its own handler understands,
    # and leaves that logger non-propagating; pytest then attaches its capture
    # handler to it, which fails on those records. Keep it propagating between
    # tests (pytest enters the call phase's log capture after this fixture).
    logging.getLogger("LoggingTensor").propagate = True

