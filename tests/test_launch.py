"""remat.launch: one function on N new local processes joined by gloo, the launcher that the
commands, the tests of sharded training and the benchmarks share.

Each launch starts real processes (a few seconds each on a small machine).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

import remat
from helpers import launch_on_ranks
from remat.errors import CheckpointUsageError, RankError
from remat.launch import run_on_ranks

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)


def test_each_rank_runs_in_a_group_of_the_world_size() -> None:
    assert run_on_ranks(2, "remat.launch:rank_and_size", None, timeout_s=300) == [(0, 2), (1, 2)]


def test_a_group_that_cannot_form_is_launched_again_on_a_new_port(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first port handed out is held by a listener of ours, as when another process takes
    # it between choosing and binding: rank 0's store cannot bind, the try is stopped, and
    # the next try (a new port) forms the group.
    import socket

    import remat.launch

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = iter([held.getsockname()[1]])
        free_port = remat.launch._free_port
        monkeypatch.setattr(remat.launch, "_free_port", lambda: next(ports, None) or free_port())
        assert run_on_ranks(2, "remat.launch:rank_and_size", None, timeout_s=300) == [(0, 2), (1, 2)]
        assert next(ports, None) is None  # the held port was tried first


def test_a_group_that_never_forms_is_a_rank_error_after_its_tries(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import remat.launch

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        monkeypatch.setattr(remat.launch, "_free_port", lambda: held.getsockname()[1])
        monkeypatch.setattr(remat.launch, "_GROUP_TRIES", 2)
        with pytest.raises(RankError, match=r"could not form a gloo process group in 2 tries(.|\n)*rank 0: Traceback"):
            run_on_ranks(2, "remat.launch:rank_and_size", None, timeout_s=300)


def remat_file(payload: None) -> str:
    return remat.__file__


def test_the_ranks_import_the_callers_remat(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without PYTHONPATH the ranks could only find an installed remat; the launcher
    # puts the caller's own first, wherever it was imported from.
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert launch_on_ranks(2, remat_file, timeout_s=300) == [remat.__file__] * 2


def fails_on_rank_one(payload: None) -> int:
    if dist.get_rank() == 1:
        raise ValueError(f"rank one refuses {payload}")
    return 0


def test_a_failing_rank_is_a_rank_error_with_its_traceback() -> None:
    with pytest.raises(RankError, match=r"rank 1 of 2 failed:(.|\n)*ValueError: rank one refuses 42"):
        launch_on_ranks(2, fails_on_rank_one, 42, timeout_s=300)
    with pytest.raises(CheckpointUsageError, match="world_size must be an int >= 1"):
        run_on_ranks(0, "remat.launch:rank_and_size", None)


def never_leaves(payload: None) -> int:
    # A thread that is not a daemon keeps the interpreter alive after the result is
    # written, as gloo's teardown does when it waits for a peer that already left.
    import threading

    threading.Thread(target=threading.Event().wait, daemon=False).start()
    return dist.get_rank()


def test_a_rank_stuck_after_its_result_is_stopped_and_its_result_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.launch

    monkeypatch.setattr(remat.launch, "_TEARDOWN_GRACE_S", 1.0)
    assert launch_on_ranks(2, never_leaves, timeout_s=120) == [0, 1]


def sleeps(payload: None) -> int:
    import time

    time.sleep(60)
    return 0


def test_ranks_past_the_timeout_are_a_rank_error() -> None:
    with pytest.raises(RankError, match="the 2 ranks did not finish in 3 s"):
        launch_on_ranks(2, sleeps, timeout_s=3)


def aborts_on_rank_zero(payload: None) -> int:
    if dist.get_rank() == 0:
        import os

        os.abort()  # as glibc does on a corrupted heap
    return 1


def test_a_rank_killed_by_a_signal_is_named_with_its_python_stack() -> None:
    with pytest.raises(RankError) as info:
        run_on_ranks_here(aborts_on_rank_zero)
    assert info.value.rank == 0 and info.value.killed_by == 6
    assert "rank 0 of 2 was killed by SIGABRT (a crash in native code) before its result" in str(info.value)
    assert "aborts_on_rank_zero" in str(info.value)  # faulthandler's stack of the crash


def run_on_ranks_here(function: Callable[[None], int]) -> list[int]:
    # The library's launcher without the tests' retry after a crash.
    import os

    from helpers import TESTS

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
        return run_on_ranks(2, f"test_launch:{function.__name__}", None, timeout_s=120)


def crashes_on_the_first_launch(payload: str) -> int:
    import os
    import pathlib

    marker = pathlib.Path(payload)
    if dist.get_rank() == 0 and not marker.exists():
        marker.write_text("crashed once")
        os.abort()
    return dist.get_rank()


def test_the_tests_launch_once_more_after_a_crash(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="a rank crashed in native code; launching once more"):
        assert launch_on_ranks(2, crashes_on_the_first_launch, str(tmp_path / "marker"), timeout_s=120) == [0, 1]
