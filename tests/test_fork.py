"""remat._fork: independent tasks on forked copies of this process."""

from __future__ import annotations

import os
import sys

import pytest

from remat._fork import run_forked, usable_cpus
from remat.errors import CheckpointUsageError, WorkerError

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks only on Linux")


class _Refused(Exception):
    """An exception whose constructor takes two arguments: it pickles but does not load."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def _pid_and(value: int) -> tuple[int, int]:
    return os.getpid(), value * value


def test_results_come_back_in_the_tasks_order_from_several_processes() -> None:
    tasks = [lambda value=value: _pid_and(value) for value in range(7)]
    results = run_forked(tasks, processes=3)
    assert [square for _, square in results] == [value * value for value in range(7)]
    pids = {pid for pid, _ in results}
    if sys.platform.startswith("linux"):
        assert os.getpid() in pids and len(pids) == 3  # this process ran the first share
    assert run_forked(tasks, processes=1) == [(os.getpid(), value * value) for value in range(7)]


@linux_only
def test_a_copy_changes_only_itself() -> None:
    seen: list[int] = []
    run_forked([lambda: seen.append(0), lambda: seen.append(1)], processes=2)
    assert seen == [0]  # the second task ran in a copy
    run_forked([lambda: seen.append(2), lambda: seen.append(3)], processes=1)
    assert seen == [0, 2, 3]


@linux_only
def test_a_failure_in_a_copy_raises_here() -> None:
    def fails() -> None:
        raise CheckpointUsageError("the task was wrong")

    with pytest.raises(CheckpointUsageError, match="the task was wrong") as info:
        run_forked([lambda: 1, fails], processes=2)
    assert "in a forked worker" in str(info.value.__cause__)

    def refuses() -> None:
        raise _Refused("stage 3", "no such block")

    # An exception that cannot be rebuilt here arrives as its traceback.
    with pytest.raises(WorkerError, match=r"(?s)failed in a forked worker.*stage 3: no such block"):
        run_forked([lambda: 1, refuses], processes=2)


@linux_only
def test_a_failure_here_stops_the_copies() -> None:
    def waits() -> None:
        import time

        time.sleep(60)

    def fails() -> None:
        raise ValueError("here")

    with pytest.raises(ValueError, match="here"):
        run_forked([fails, waits], processes=2)  # returns at once: the copy is killed


@pytest.mark.parametrize("processes", [0, -1, 1.5, True, "2"])
def test_a_bad_process_count_is_refused(processes: object) -> None:
    with pytest.raises(CheckpointUsageError, match="processes must be a positive int"):
        run_forked([lambda: 1], processes=processes)  # type: ignore[arg-type]


def test_usable_cpus_is_at_least_one() -> None:
    assert usable_cpus() >= 1


@linux_only
def test_a_copy_that_cannot_run_its_share_leaves_it_to_this_process() -> None:
    # As a forked copy of a CUDA build of torch after a backward cannot run autograd.
    tasks = [lambda value=value: _pid_and(value) for value in range(4)]
    results = run_forked(tasks, processes=2, copy_can_run=lambda: False)
    assert results == [(os.getpid(), value * value) for value in range(4)]


def test_autograd_after_a_backward_runs_in_a_forked_copy_or_the_share_comes_back() -> None:
    import torch

    from remat._compat.autograd import autograd_runs_in_this_process

    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()  # the engine has run here (on CUDA builds: its device threads)
    assert autograd_runs_in_this_process()

    def gradient() -> list[float]:
        y = torch.arange(3.0, requires_grad=True)
        (y * y).sum().backward()
        assert y.grad is not None
        return y.grad.tolist()

    assert run_forked([gradient, gradient], processes=2, copy_can_run=autograd_runs_in_this_process) == [
        [0.0, 2.0, 4.0], [0.0, 2.0, 4.0]
    ]


def test_the_default_process_count_reads_remat_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat._fork import default_processes

    monkeypatch.setenv("REMAT_PROCESSES", "3")
    assert default_processes() == 3
    monkeypatch.delenv("REMAT_PROCESSES")
    assert default_processes() == usable_cpus()
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv("REMAT_PROCESSES", bad)
        with pytest.raises(CheckpointUsageError, match="REMAT_PROCESSES must be a positive integer"):
            default_processes()
