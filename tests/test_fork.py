"""remat._fork: independent tasks on forked copies of this process, in one batch
(``run_forked``) or handed out as they come (``ForkedPool``)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from remat._fork import ForkedPool, run_forked, usable_cpus
from remat.errors import CheckpointUsageError, WorkerError

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks only on Linux")


class _Refused(Exception):
    """An exception whose constructor takes two arguments: it pickles but does not load."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def _pid_and(value: int) -> tuple[int, int]:
    return os.getpid(), value * value


def _signal() -> tuple[Callable[[int], None], Callable[[], None]]:
    """``wait(n)`` blocks until ``post()`` ran ``n`` times, in any process."""
    read_end, write_end = os.pipe()

    def wait(n: int) -> None:
        for _ in range(n):
            os.read(read_end, 1)

    return wait, lambda: os.write(write_end, b"x") and None


def test_results_come_back_in_the_tasks_order_from_several_processes() -> None:
    tasks = [lambda value=value: _pid_and(value) for value in range(7)]
    assert run_forked(tasks, processes=1) == [(os.getpid(), value * value) for value in range(7)]
    if not sys.platform.startswith("linux"):
        assert run_forked(tasks, processes=3) == run_forked(tasks, processes=1)
        return
    wait, post = _signal()

    def first() -> tuple[int, int]:
        wait(6)  # this process is busy until every other task ran: the copies took them
        return _pid_and(0)

    def other(value: int) -> tuple[int, int]:
        post()
        return _pid_and(value)

    results = run_forked([first, *(lambda value=value: other(value) for value in range(1, 7))], processes=3)
    assert [square for _, square in results] == [value * value for value in range(7)]
    assert results[0][0] == os.getpid()  # this process ran the first task
    copies = {pid for pid, _ in results[1:]}
    assert os.getpid() not in copies and 1 <= len(copies) <= 2


@linux_only
def test_a_free_process_takes_the_next_task() -> None:
    # This process's first task outlasts all the others: one copy runs them all, instead of
    # this process running half of them after its long one.
    wait, post = _signal()

    def long() -> int:
        wait(5)
        return os.getpid()

    def short() -> int:
        post()
        return os.getpid()

    pids = run_forked([long, short, short, short, short, short], processes=2)
    assert pids[0] == os.getpid() and len(set(pids[1:])) == 1 and pids[1] != os.getpid()


@linux_only
def test_this_process_takes_one_task_at_a_time() -> None:
    # Tasks 1 and 2 each wait (up to 20 s) for the other to start: they meet only if two
    # processes run them at once, which a process taking the whole queue at once prevents.
    a_read, a_write = os.pipe()
    b_read, b_write = os.pipe()

    def meet(post: int, wait: int) -> bool:
        import select

        os.write(post, b"x")
        ready, _, _ = select.select([wait], [], [], 20.0)
        return bool(ready)

    results = run_forked([lambda: True, lambda: meet(a_write, b_read), lambda: meet(b_write, a_read)], processes=2)
    assert results == [True, True, True]


@linux_only
def test_more_tasks_than_the_queue_holds_all_run() -> None:
    # 20,000 indices of 4 bytes do not fit a pipe (64 KiB by default): this process runs the rest.
    count = 20_000
    assert run_forked([lambda value=value: value for value in range(count)], processes=2) == list(range(count))


@linux_only
def test_a_copy_changes_only_itself() -> None:
    seen: list[int] = []
    wait, post = _signal()

    def first() -> None:
        wait(1)
        seen.append(0)

    run_forked([first, lambda: seen.append(1) or post()], processes=2)
    assert seen == [0]  # the second task ran in a copy
    run_forked([lambda: seen.append(2), lambda: seen.append(3)], processes=1)
    assert seen == [0, 2, 3]


@linux_only
def test_a_failure_in_a_copy_raises_here() -> None:
    wait, post = _signal()

    def first() -> int:
        wait(1)  # the failing task runs in a copy
        return 1

    def fails() -> None:
        post()
        raise CheckpointUsageError("the task was wrong")

    with pytest.raises(CheckpointUsageError, match="the task was wrong") as info:
        run_forked([first, fails], processes=2)
    assert "in a forked worker" in str(info.value.__cause__)

    def refuses() -> None:
        post()
        raise _Refused("stage 3", "no such block")

    # An exception that cannot be rebuilt here arrives as its traceback.
    with pytest.raises(WorkerError, match=r"(?s)failed in a forked worker.*stage 3: no such block"):
        run_forked([first, refuses], processes=2)


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
def test_a_copy_that_cannot_run_takes_no_task() -> None:
    # As a forked copy of a CUDA build of torch after a backward cannot run autograd.
    tasks = [lambda value=value: _pid_and(value) for value in range(4)]
    results = run_forked(tasks, processes=2, copy_can_run=lambda: False)
    assert results == [(os.getpid(), value * value) for value in range(4)]


def test_autograd_after_a_backward_runs_in_a_forked_copy_or_here() -> None:
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


def test_a_copy_forked_after_the_cuda_runtime_was_touched_cannot_run_autograd_where_a_gpu_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a machine with a GPU, torch.cuda.is_available() in the parent is enough for a
    # forked copy's CUDA device thread to fail at its first backward; torch marks such a
    # copy as in a bad fork, and the probe answers no before trying (so the copy takes no
    # task and this process runs them).
    import torch

    from remat._compat.autograd import autograd_runs_in_this_process

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert not autograd_runs_in_this_process()
    tasks = [lambda value=value: _pid_and(value) for value in range(3)]
    assert run_forked(tasks, processes=2, copy_can_run=autograd_runs_in_this_process) == [
        (os.getpid(), value * value) for value in range(3)
    ]


def test_a_copy_marked_by_a_cuda_build_without_a_gpu_runs_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CUDA build on a machine without a GPU marks every fork after is_available() too,
    # but there the copy's backward runs: the copies must take their share (before, the CI
    # matrix's CUDA builds ran every pipeline simulation in one process).
    import torch

    from remat._compat.autograd import autograd_runs_in_this_process

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert autograd_runs_in_this_process()


_ASK_FOR_CUDA_THEN_FORK = """
import json, os, select, sys
import torch
from remat._compat.autograd import autograd_runs_in_this_process
from remat._fork import run_forked

torch.cuda.is_available()  # a CUDA build marks every later fork here
if torch.cuda.device_count() > 0:
    print(json.dumps("gpu"))
    sys.exit()
parent = os.getpid()
ran_in_a_copy_read, ran_in_a_copy = os.pipe()
heard = []

def pid_and_gradient():
    if os.getpid() != parent:
        os.write(ran_in_a_copy, b"x")
    elif not heard:  # hold this process's first task until a copy ran one (or a long while)
        heard.append(bool(select.select([ran_in_a_copy_read], [], [], 30.0)[0]))
    y = torch.arange(3.0, requires_grad=True)
    (y * y).sum().backward()
    return os.getpid(), y.grad.tolist()

results = run_forked([pid_and_gradient] * 4, processes=2, copy_can_run=autograd_runs_in_this_process)
print(json.dumps({"parent": parent, "results": results}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="copies are forked on Linux only")
def test_copies_forked_after_asking_for_cuda_run_autograd_on_a_machine_without_a_gpu() -> None:
    # In a fresh interpreter, so that only what the script does decides: in a test process
    # that ran much of the suite before, the CUDA builds' copies have still been seen to
    # refuse (2.11 and 2.15 in CI), rightly: their probe met torch's own "Unable to handle
    # autograd's threading in combination with fork-based multiprocessing", so the parent's
    # engine had started device threads by then. Which earlier test starts them on a machine
    # without a GPU is not known yet (a backward and is_available(), in either order, do not).
    answer = subprocess.run([sys.executable, "-c", _ASK_FOR_CUDA_THEN_FORK], capture_output=True, text=True,
                            check=True, timeout=300)
    found = json.loads(answer.stdout.splitlines()[-1])
    if found == "gpu":
        pytest.skip("on a machine with a GPU a marked copy cannot run autograd (the test above)")
    assert all(gradient == [0.0, 2.0, 4.0] for _, gradient in found["results"])
    assert {pid for pid, _ in found["results"]} - {found["parent"]}, "no forked copy ran a task"


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


def _pool_work(job: tuple[str, int]) -> tuple[int, int]:
    """A pool job: ``("square", n)``, or ``("after", n)``: wait for ``n`` posts on the
    module's gate first (set by the test before the pool forks)."""
    kind, value = job
    if kind == "after":
        _GATE[0](value)
    if kind == "exit":
        os._exit(3)  # a copy that dies without an answer
    if kind == "fail":
        raise CheckpointUsageError(f"job {value} was wrong")
    return os.getpid(), value * value


_GATE: list[Callable[[int], None]] = []


def _gate() -> Callable[[], None]:
    wait, post = _signal()
    _GATE[:] = [wait]
    return post


def test_a_pool_runs_every_job_and_returns_each_result_with_its_ticket() -> None:
    for processes in (1, 3):
        with ForkedPool(_pool_work, processes=processes) as pool:
            tickets = {pool.submit(("square", value)): value for value in range(7)}
            assert pool.pending == 7
            results = [pool.next_result() for _ in range(7)]
            assert pool.pending == 0
        assert sorted(tickets[ticket] for ticket, _ in results) == list(range(7))
        assert all(square == tickets[ticket] ** 2 for ticket, (_, square) in results)
        pids = {pid for _, (pid, _) in results}
        if processes == 1 or not sys.platform.startswith("linux"):
            assert pids == {os.getpid()}  # no copies: the jobs ran here
        else:
            assert os.getpid() not in pids  # this process only hands out and collects


@linux_only
def test_a_result_comes_back_as_soon_as_its_job_ends_and_the_free_copy_takes_the_next() -> None:
    post = _gate()
    with ForkedPool(_pool_work, processes=2) as pool:
        slow = pool.submit(("after", 1))  # holds one copy until the gate opens
        quick = pool.submit(("square", 3))
        ticket, (quick_pid, _) = pool.next_result()
        assert ticket == quick  # not held behind the slower job submitted first
        # A job submitted after a result (as a search's next try is) runs on the free copy.
        follow = pool.submit(("square", 4))
        assert pool.next_result() == (follow, (quick_pid, 16))
        post()
        ticket, (slow_pid, _) = pool.next_result()
        assert ticket == slow and slow_pid != quick_pid


@linux_only
def test_a_copy_keeps_what_it_learned_for_its_later_jobs() -> None:
    seen: list[int] = []

    def counts(job: int) -> tuple[int, int]:
        seen.append(job)  # in the copy: each copy's own list grows from job to job
        return os.getpid(), len(seen)

    with ForkedPool(counts, processes=2) as pool:
        for job in range(6):
            pool.submit(job)
        results = [pool.next_result()[1] for _ in range(6)]
    for pid in {pid for pid, _ in results}:
        assert sorted(count for other, count in results if other == pid) == list(
            range(1, 1 + sum(other == pid for other, _ in results)))
    assert seen == []  # nothing ran here


@linux_only
def test_a_failed_job_raises_here_and_the_pool_takes_no_more() -> None:
    post = _gate()
    with pytest.raises(CheckpointUsageError, match="job 7 was wrong") as info, \
            ForkedPool(_pool_work, processes=2) as pool:
        pool.submit(("after", 1))  # still running when the pool closes: its copy is stopped
        pool.submit(("fail", 7))
        try:
            pool.next_result()
        finally:
            with pytest.raises(CheckpointUsageError, match="before a job failed"):
                pool.submit(("square", 1))
    assert "in a forked worker" in str(info.value.__cause__)
    post()
    with pytest.raises(WorkerError, match="ended without a result"), ForkedPool(_pool_work, processes=2) as pool:
        pool.submit(("exit", 0))
        pool.next_result()


def test_a_pool_is_used_inside_its_block_once() -> None:
    pool: ForkedPool[tuple[str, int], tuple[int, int]] = ForkedPool(_pool_work, processes=2)
    with pytest.raises(CheckpointUsageError, match="inside its `with` block"):
        pool.submit(("square", 1))
    with pool, pytest.raises(CheckpointUsageError, match="no job submitted"):
        pool.next_result()
    with pytest.raises(CheckpointUsageError, match="entered once"), pool:
        pass
    with pytest.raises(CheckpointUsageError, match="processes must be a positive int"):
        ForkedPool(_pool_work, processes=0)


@linux_only
def test_a_pool_whose_copies_cannot_run_runs_its_jobs_here() -> None:
    with ForkedPool(_pool_work, processes=2, copy_can_run=lambda: False) as pool:
        tickets = [pool.submit(("square", value)) for value in range(3)]
        assert [pool.next_result() for _ in range(3)] == [(ticket, (os.getpid(), value * value))
                                                          for value, ticket in enumerate(tickets)]


@linux_only
def test_a_copys_collections_skip_what_it_inherited() -> None:
    inherited = len(gc.get_objects())

    def frozen(_: None) -> int:
        return gc.get_freeze_count()

    with ForkedPool(frozen, processes=2) as pool:
        pool.submit(None)
        _, count = pool.next_result()
    assert count >= inherited // 2  # what this process had when it forked is frozen there
