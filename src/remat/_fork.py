"""Run independent tasks on this process and forked copies of it, from one queue.

Layer: the bottom of the library; imports only ``remat.errors``. Used by the
static pipeline estimate and planner, whose ranks are simulated independently
on fake tensors (``docs/design/planner.md``, "Pipelined plans"): on N cores
they take about 1/N of the time.

A fork, not a fresh interpreter (``remat.launch``): a task is a closure over
this process's objects (a model builder, a planner's state), which a fork
inherits as they are and a fresh process would have to import and unpickle.
This process runs the first task itself (its caches stay warm), then every
process takes the next task from a queue (a pipe of task indices) when it is
free, so tasks of unequal length keep every process busy; each copy pickles
its results (or its exception) back through a pipe.
Whatever a task changes in a copy (caches, counters) stays there: the tasks
must not need each other's side effects, only their return values.

A copy may be unable to do what the tasks need: CUDA builds of torch refuse
every backward in a forked child once the parent's autograd engine has started
its device threads (its first backward). ``copy_can_run`` asks each copy first;
a copy that cannot takes no task, and the others run them.

Forking is used only on Linux (``os.fork`` elsewhere is absent or, on macOS,
unsafe with system frameworks) and only for more than one task; otherwise
the tasks run here, one after another, with the same results.

Example:
    >>> run_forked([lambda: 1 + 1, lambda: 2 * 3], processes=2)
    [2, 6]
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import IO, TypeVar

from remat.errors import CheckpointUsageError, WorkerError

__all__ = ["default_processes", "run_forked", "usable_cpus"]

T = TypeVar("T")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS reports one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def default_processes() -> int:
    """``REMAT_PROCESSES`` where set (the test suite sets 1: its workers already share the
    cores), else :func:`usable_cpus`."""
    text = os.environ.get("REMAT_PROCESSES", "").strip()
    if not text:
        return usable_cpus()
    if not text.isdigit() or int(text) < 1:
        raise CheckpointUsageError(f"remat: REMAT_PROCESSES must be a positive integer, got {text!r}.")
    return int(text)


def run_forked(
    tasks: Sequence[Callable[[], T]],
    processes: int | None = None,
    *,
    copy_can_run: Callable[[], bool] | None = None,
) -> list[T]:
    """Each task's result, in the tasks' order, computed by up to ``processes`` processes
    (default: :func:`default_processes`): this one and forked copies of it.

    This process runs the first task; the others are taken from a queue by whichever
    process is free, so a long task does not leave the other processes idle behind it.
    A task that raises in a copy raises here, the same exception where it pickles (else a
    :class:`~remat.errors.WorkerError` carrying its traceback); the other copies are
    stopped. ``copy_can_run`` is asked first in each copy; a copy that says no (it cannot
    do what the tasks need, such as torch's autograd after a fork) takes no task, and the
    others (this process at least) run them all: the same results, with less parallelism.
    """
    if processes is None:
        processes = default_processes()
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise CheckpointUsageError(
            f"remat: processes must be a positive int (or None: every usable CPU), got {processes!r}."
        )
    count = min(processes, len(tasks))
    if count <= 1 or not sys.platform.startswith("linux"):
        return [task() for task in tasks]
    queue, unqueued = _queue(range(1, len(tasks)))
    children: list[tuple[int, IO[bytes]]] = []
    try:
        for _ in range(count - 1):  # one by one: a fork that fails still reaps the copies before it
            children.append(_fork_worker(tasks, queue, copy_can_run))
        results: dict[int, T] = {0: tasks[0]()}
        for index in itertools.chain(_taken(queue), unqueued):  # one at a time, as the copies take them
            results[index] = tasks[index]()
        for pid, reader in children:
            results.update(_collect(pid, reader))  # type: ignore[arg-type]
    finally:
        os.close(queue)
        for pid, reader in children:
            reader.close()
            _reap(pid)
    return [results[index] for index in range(len(tasks))]


_RECORD = 4  # bytes per queued task index; a pipe hands each read of one record to one reader


def _queue(indices: Sequence[int]) -> tuple[int, list[int]]:
    """A pipe's read end holding ``indices`` (its write end closed, so a drained queue reads
    as empty), and the indices that did not fit in the pipe (this process runs those)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    data = b"".join(index.to_bytes(_RECORD, "little") for index in indices)
    try:
        written = os.write(write_end, data) if data else 0
    except BlockingIOError:
        written = 0
    finally:
        os.close(write_end)
    written -= written % _RECORD  # a partial record is left to this process, whole
    return read_end, list(indices[written // _RECORD:])


def _taken(queue: int) -> Iterator[int]:
    """The queue's indices this process takes, one at a time, until it is empty."""
    while True:
        record = os.read(queue, _RECORD)
        if not record:
            return
        yield int.from_bytes(record, "little")


def _fork_worker(
    tasks: Sequence[Callable[[], T]], queue: int, copy_can_run: Callable[[], bool] | None
) -> tuple[int, IO[bytes]]:
    """Fork a copy that takes tasks from ``queue`` until it is empty; its results come back
    through the returned pipe as ``(index, result)`` pairs."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the copy: run what it takes, send the results, and leave without cleanup
        os.close(read_end)
        code = 0
        try:
            try:
                if copy_can_run is not None and not copy_can_run():
                    payload = pickle.dumps(("ok", []))  # takes nothing: the others run it all
                else:
                    payload = pickle.dumps(("ok", [(index, tasks[index]()) for index in _taken(queue)]))
            except BaseException as exc:
                text = traceback.format_exc()
                try:  # the round trip, here: an exception whose __init__ differs fails to load
                    payload = pickle.dumps(("raised", exc, text))
                    pickle.loads(payload)
                except Exception:
                    payload = pickle.dumps(("raised", None, text))
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(payload)
        except BaseException:
            code = 1
        finally:
            # Skip atexit handlers and buffered-file flushes: they are the parent's.
            os._exit(code)
    os.close(write_end)
    return pid, os.fdopen(read_end, "rb")


def _collect(pid: int, reader: IO[bytes]) -> list[tuple[int, object]]:
    """The copy's ``(index, result)`` pairs (none where it could not run)."""
    data = reader.read()  # until the copy closes its end (it exits right after)
    if not data:
        _, status = os.waitpid(pid, 0)
        raise WorkerError(
            f"remat: a forked worker (pid {pid}) ended without a result (wait status {status}); "
            "run with processes=1 to see the failure in this process."
        )
    answer = pickle.loads(data)
    if answer[0] == "ok":
        return list(answer[1])
    _, exc, text = answer
    if isinstance(exc, BaseException):
        raise exc from WorkerError(f"in a forked worker:\n{text}")
    raise WorkerError(f"remat: a task failed in a forked worker:\n{text}")


def _reap(pid: int) -> None:
    """Stop the copy if it still runs (this process failed first) and wait for it."""
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        if finished == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except ChildProcessError:  # already waited for by _collect
        pass
