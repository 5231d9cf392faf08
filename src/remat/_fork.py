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

A copy may be unable to do what the tasks need: on a machine with a GPU, torch
refuses every backward in a forked child once the parent's autograd engine has
started its device threads, and a child forked after the parent touched the CUDA
runtime fails its first backward. ``copy_can_run`` asks each copy first; a copy
that cannot takes no task, and the others run them.

Where the next jobs depend on earlier results (the pipeline planner's rank
searches: a rank's next simulation is chosen from its last), one batch waits for
its slowest task before the next can start. :class:`ForkedPool` keeps its copies
for a whole search instead: jobs (plain data, pickled) are handed to whichever
copy is free as they come, and results come back one by one.

Forking is used only on Linux (``os.fork`` elsewhere is absent or, on macOS,
unsafe with system frameworks) and only for more than one task; otherwise
the tasks run here, one after another, with the same results.

Example:
    >>> run_forked([lambda: 1 + 1, lambda: 2 * 3], processes=2)
    [2, 6]
"""

from __future__ import annotations

import collections
import gc
import itertools
import os
import pickle
import select
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import IO, Generic, TypeVar

from remat.errors import CheckpointUsageError, WorkerError

__all__ = ["ForkedPool", "default_processes", "run_forked", "usable_cpus"]

T = TypeVar("T")
J = TypeVar("J")


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
    count = min(_checked(processes), len(tasks))
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


def _checked(processes: int | None) -> int:
    if processes is None:
        return default_processes()
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise CheckpointUsageError(
            f"remat: processes must be a positive int (or None: every usable CPU), got {processes!r}."
        )
    return processes


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

    def copy() -> None:  # run what it takes, then send the results
        os.close(read_end)
        try:
            if copy_can_run is not None and not copy_can_run():
                payload = pickle.dumps(("ok", []))  # takes nothing: the others run it all
            else:
                payload = pickle.dumps(("ok", [(index, tasks[index]()) for index in _taken(queue)]))
        except BaseException as exc:
            payload = _failure(exc)
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(payload)

    pid = _forked(copy)
    os.close(write_end)
    return pid, os.fdopen(read_end, "rb")


def _forked(copy: Callable[[], None]) -> int:
    """Fork; the copy runs ``copy()`` and leaves (exit status 1 if it raised) without
    cleanup: atexit handlers and buffered-file flushes are this process's. The copy's pid.

    The copy first freezes what it inherited (``gc.freeze``): its collections then skip
    the hundreds of thousands of objects torch and its neighbours made here, which they
    would walk (and copy, page by page, on write) at every full collection."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            gc.freeze()
            copy()
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    return pid


def _failure(exc: BaseException) -> bytes:
    """``("raised", exc, traceback)`` pickled, with None for an exception that would not
    load here (the round trip is tried: one whose ``__init__`` differs fails to load)."""
    text = "".join(traceback.format_exception(exc))
    try:
        payload = pickle.dumps(("raised", exc, text))
        pickle.loads(payload)
    except Exception:
        payload = pickle.dumps(("raised", None, text))
    return payload


def _reraised(answer: tuple[object, ...]) -> BaseException:
    """The exception a copy's ``("raised", exc, traceback)`` answer stands for, to raise here."""
    _, exc, text = answer
    if isinstance(exc, BaseException):
        exc.__cause__ = WorkerError(f"in a forked worker:\n{text}")
        return exc
    return WorkerError(f"remat: a task failed in a forked worker:\n{text}")


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
    raise _reraised(answer)


def _reap(pid: int) -> None:
    """Stop the copy if it still runs (this process failed first) and wait for it."""
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        if finished == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except ChildProcessError:  # already waited for by _collect
        pass


class ForkedPool(Generic[J, T]):
    """Forked copies of this process, kept while the pool is entered, that each run
    ``work(job)`` on the jobs handed to them, as the jobs come.

    For work whose next jobs depend on earlier results (a search), where
    :func:`run_forked`'s batches would wait for their slowest task each time: a job is
    handed to whichever copy is free, in the order submitted, and :meth:`next_result`
    returns results as they finish. A copy keeps what it learned (caches) for its later
    jobs. This process only hands out jobs and collects results: while it ran one, it
    could hand out no other.

    Jobs and results cross pipes pickled; ``work`` itself, and whatever it reads, the
    copies inherit at the fork. A job that raises in a copy raises in :meth:`next_result`
    (the same exception where it pickles, else a :class:`~remat.errors.WorkerError` with
    its traceback), and the pool takes no more jobs. Without copies (one process, not
    Linux, or no copy passes ``copy_can_run``) the jobs run here, one at a time, as
    :meth:`next_result` asks for them: the same results.

    Example:
        >>> with ForkedPool(lambda job: job * job, processes=2) as pool:
        ...     tickets = {pool.submit(job): job for job in range(3)}
        ...     sorted((tickets[ticket], square) for ticket, square in (pool.next_result() for _ in range(3)))
        [(0, 0), (1, 1), (2, 4)]
    """

    def __init__(
        self, work: Callable[[J], T], processes: int | None = None, *, copy_can_run: Callable[[], bool] | None = None
    ) -> None:
        self._work, self._processes, self._copy_can_run = work, _checked(processes), copy_can_run
        self._waiting: collections.deque[tuple[int, J]] = collections.deque()
        self._copies: list[_Copy] = []
        self._idle: list[_Copy] = []
        self._running: dict[int, tuple[_Copy, int]] = {}  # by the copy's result pipe
        self._tickets = itertools.count()
        self._entered = self._broken = False

    def __enter__(self) -> ForkedPool[J, T]:
        if self._entered:
            raise CheckpointUsageError("remat: a ForkedPool can be entered once; make a new one.")
        self._entered = True
        if self._processes > 1 and sys.platform.startswith("linux"):
            try:
                for _ in range(self._processes):  # one by one: a fork that fails still reaps those before it
                    self._copies.append(_Copy.fork(self._work, self._copy_can_run, self._copies))
                self._idle = [copy for copy in self._copies if copy.ready()]
            except BaseException:
                self._close()
                raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close()

    @property
    def pending(self) -> int:
        """Jobs submitted whose results :meth:`next_result` has not returned yet."""
        return len(self._waiting) + len(self._running)

    def submit(self, job: J) -> int:
        """Hand ``job`` to a free copy (or queue it); its ticket, which :meth:`next_result`
        returns with its result."""
        if not self._entered or self._broken:
            raise CheckpointUsageError("remat: submit to a ForkedPool inside its `with` block, before a job failed.")
        ticket = next(self._tickets)
        self._waiting.append((ticket, job))
        self._hand_out()
        return ticket

    def next_result(self) -> tuple[int, T]:
        """The next job to finish, as ``(ticket, result)`` (here: the next queued job, run now)."""
        if not self.pending:
            raise CheckpointUsageError("remat: ForkedPool.next_result with no job submitted and unfinished.")
        if not self._idle and not self._running:  # no copy can run: this process runs the jobs
            ticket, job = self._waiting.popleft()
            return ticket, self._work(job)
        ready, _, _ = select.select(list(self._running), [], [])
        copy, ticket = self._running.pop(ready[0])
        answer = copy.receive()
        if answer is None or answer[0] != "ok":
            self._broken = True
            raise _reraised(answer) if answer is not None else WorkerError(
                f"remat: a forked worker (pid {copy.pid}) ended without a result; "
                "run with processes=1 to see the failure in this process."
            )
        self._idle.append(copy)
        self._hand_out()  # before the caller looks at the result: the copy works meanwhile
        return ticket, answer[1]  # type: ignore[return-value]

    def _hand_out(self) -> None:
        while self._idle and self._waiting:
            ticket, job = self._waiting.popleft()
            copy = self._idle.pop()
            copy.send(job)
            self._running[copy.results] = (copy, ticket)

    def _close(self) -> None:
        for copy in self._copies:
            copy.stop(busy=any(busy is copy for busy, _ in self._running.values()))
        self._copies, self._idle, self._running = [], [], {}


class _Copy:
    """One forked copy of a :class:`ForkedPool`, seen from this process: the pipe it takes
    jobs from and the pipe its answers come back on, each message length-prefixed."""

    def __init__(self, pid: int, jobs: int, results: int) -> None:
        self.pid, self.jobs, self.results = pid, jobs, results

    @classmethod
    def fork(cls, work: Callable[[J], T], copy_can_run: Callable[[], bool] | None, siblings: Sequence[_Copy]) -> _Copy:
        """A new copy; ``siblings`` are the copies forked before it, whose pipes' ends it
        closes (else an earlier copy would never read the end of its jobs: this one would
        hold their write end open)."""
        jobs_read, jobs_write = os.pipe()
        results_read, results_write = os.pipe()

        def copy() -> None:  # serve jobs until the pool closes the pipe
            for fd in (jobs_write, results_read, *(end for sibling in siblings for end in (sibling.jobs, sibling.results))):
                os.close(fd)
            _serve(work, copy_can_run, jobs_read, results_write)

        pid = _forked(copy)
        os.close(jobs_read)
        os.close(results_write)
        return cls(pid, jobs_write, results_read)

    def ready(self) -> bool:
        """Whether the copy can run jobs (it said so first; one that cannot has left)."""
        answer = self.receive()
        return answer is not None and answer[0] == "ready"

    def send(self, message: object) -> None:
        _write_message(self.jobs, pickle.dumps(message))

    def receive(self) -> tuple[object, ...] | None:
        data = _read_message(self.results)
        return None if data is None else pickle.loads(data)

    def stop(self, *, busy: bool) -> None:
        """Close its pipes (an idle copy then leaves) and wait for it; stop a busy one first."""
        os.close(self.jobs)
        os.close(self.results)
        if busy:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _serve(work: Callable[[J], T], copy_can_run: Callable[[], bool] | None, jobs: int, results: int) -> None:
    """A pool copy's life: say whether it can run jobs, then run each one it is handed."""
    if copy_can_run is not None and not copy_can_run():
        _write_message(results, pickle.dumps(("cannot",)))
        return
    _write_message(results, pickle.dumps(("ready",)))
    while (data := _read_message(jobs)) is not None:
        job = pickle.loads(data)
        try:
            payload = pickle.dumps(("ok", work(job)))
        except BaseException as exc:
            _write_message(results, _failure(exc))
            return
        _write_message(results, payload)


_LENGTH = 8  # bytes of a message's length prefix


def _write_message(fd: int, data: bytes) -> None:
    view = memoryview(len(data).to_bytes(_LENGTH, "little") + data)
    while view:
        view = view[os.write(fd, view):]


def _read_message(fd: int) -> bytes | None:
    """The next message on ``fd``, or None where the other end closed it first."""
    head = _read_exactly(fd, _LENGTH)
    if head is None:
        return None
    return _read_exactly(fd, int.from_bytes(head, "little"))


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
