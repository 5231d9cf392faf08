"""Shared fixtures: ``impl`` runs a test once with torch.utils.checkpoint and once with remat.

``pytest -k torch`` validates a test against torch alone (works before remat exists).
"""

from __future__ import annotations

import logging
import pathlib
import sys

import pytest
import torch

_SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

from helpers import IMPL_NAMES, Impl, get_impl  # noqa: E402


@pytest.fixture(params=IMPL_NAMES)
def impl(request: pytest.FixtureRequest) -> Impl:
    return get_impl(request.param)


@pytest.fixture(autouse=True)
def _fresh_state() -> None:
    torch.manual_seed(0)
    # torch's checkpoint debug mode logs through the "LoggingTensor" logger
    # with printf-style extra args that only its own handler understands,
    # and leaves that logger non-propagating; pytest then attaches its capture
    # handler to it, which fails on those records. Keep it propagating between
    # tests (pytest enters the call phase's log capture after this fixture).
    logging.getLogger("LoggingTensor").propagate = True
