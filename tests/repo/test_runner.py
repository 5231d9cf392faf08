"""The test run itself: what ``scripts/test.sh`` counts on from pytest and pytest-xdist."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("runner_check")
def test_xdist_groups_take_effect(request: pytest.FixtureRequest) -> None:
    # Under --dist loadgroup the tests of a group share a costly module-scoped
    # result (a launch of ranks, a profile) on one worker; with groups lost,
    # every worker pays for it. pytest 9.2 with pytest-xdist 3.8 loses them
    # silently (pytest-xdist issue 1386): pyproject.toml's test extra pins pytest.
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("not under pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@runner_check"), (
        f"pytest-xdist's --dist loadgroup did not group {request.node.nodeid}: this pytest "
        f"({pytest.__version__}) and pytest-xdist do not work together; install the versions "
        "pyproject.toml's test extra pins."
    )
