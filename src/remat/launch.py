"""Run one function on N new local processes joined by a gloo process group.

Layer: the bottom of the library; imports only ``remat.errors``. Used by the
commands that run a sharded step for real (``remat estimate --measure``,
``remat plan --world-size``), by the tests of sharded training and by the
benchmarks.

Each rank is a fresh ``python -m remat.launch`` process with one thread
(``OMP_NUM_THREADS=1``): it joins a gloo process group over TCP on
127.0.0.1, calls ``function(payload)`` and pickles the result (or its
traceback) into a private directory, which the parent reads back in rank
order. Payloads and results are the parent's own objects passed through its
own temporary files, never files from elsewhere. A rank that fails, or a run
that outlives its timeout (a rank stuck in a collective), is a
:class:`~remat.errors.RankError` with the end of that rank's traceback.

A group that cannot form is launched again on a new port, up to
:data:`_GROUP_TRIES` times in all: a rank whose ``init_process_group`` raises
says so in a marker file before ``function`` runs, and the parent then stops
every rank of that try. Two causes were seen on a busy machine: the port
chosen was taken before the store bound it, and gloo's full mesh failed with
"Connection closed by peer" (torch 2.11, under a parallel test run; gloo's
own tests flake the same way). The rank that could not join ran none of the
function; another rank of that try that did join is stopped where it is, so
a function with effects beyond its result may see them from a stopped try.

Example:
    >>> results = run_on_ranks(2, "remat.launch:rank_and_size", None)  # doctest: +SKIP
    >>> results  # doctest: +SKIP
    [(0, 2), (1, 2)]
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from remat.errors import CheckpointUsageError, RankError

__all__ = ["rank_and_size", "run_on_ranks"]

# How long a collective may wait for the slowest rank before gloo gives up.
_COLLECTIVE_TIMEOUT_S = 120.0
# How long a rank that has written its result may take to leave the process group.
_TEARDOWN_GRACE_S = 20.0
# How many times a group is launched while some rank's init_process_group raises.
_GROUP_TRIES = 3


def run_on_ranks(world_size: int, function: str, payload: Any, *, timeout_s: float = 900.0) -> list[Any]:
    """``function(payload)`` on ``world_size`` new processes; their results in rank order.

    ``function`` is ``"package.module:name"``, importable in a fresh
    interpreter. Inside it, ``torch.distributed`` is initialized (gloo, CPU)
    with this rank and world size.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointUsageError(f"remat: world_size must be an int >= 1, got {world_size!r}.")
    with tempfile.TemporaryDirectory(prefix="remat-ranks-") as folder:
        directory = Path(folder)
        (directory / "payload.pkl").write_bytes(pickle.dumps(payload))
        launched: tuple[list[str], list[int]] | str = ""
        for _ in range(_GROUP_TRIES):
            launched = _launch(world_size, function, directory, timeout_s)
            if not isinstance(launched, str):
                break
        if isinstance(launched, str):
            raise RankError(
                f"remat: the {world_size} local ranks could not form a gloo process group in "
                f"{_GROUP_TRIES} tries (a new port each time); the last try said:\n{launched[-3000:]}"
            )
        outputs, codes = launched
        results = []
        for rank in range(world_size):
            file = _result_file(directory, rank)
            if not file.exists():
                killed_by = -codes[rank] if codes[rank] < 0 else None
                how = "exited without a result" if killed_by is None else (
                    f"was killed by {signal.Signals(killed_by).name} (a crash in native code) before its result"
                )
                raise RankError(
                    f"remat: rank {rank} of {world_size} {how}:\n{outputs[rank][-3000:]}", rank, killed_by
                )
            status, value = pickle.loads(file.read_bytes())
            if status != "ok":
                raise RankError(f"remat: rank {rank} of {world_size} failed:\n{value[-3000:]}", rank)
            results.append(value)
        return results


def rank_and_size(payload: object) -> tuple[int, int]:
    """(rank, world size) of the calling rank: the smallest function to run on ranks."""
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _launch(
    world_size: int, function: str, directory: Path, timeout_s: float
) -> tuple[list[str], list[int]] | str:
    """Start every rank and wait: each rank's output and exit code, or, where the group could
    not form, what the first rank that said so printed (every rank of the try is stopped)."""
    port = _free_port()
    # faulthandler: a rank that crashes in native code prints its Python stack.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    # The ranks import this very remat, wherever it was imported from.
    source = str(Path(__file__).resolve().parents[1])  # the folder holding the remat package
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "remat.launch", function, str(directory), str(world_size), str(port)]
    logs = [directory / f"rank{rank}.log" for rank in range(world_size)]
    procs = []
    for rank, log in enumerate(logs):
        with log.open("w") as sink:  # the child keeps its own descriptor
            procs.append(subprocess.Popen([*command, str(rank)], env=env, stdout=sink, stderr=subprocess.STDOUT))
    results = [_result_file(directory, rank) for rank in range(world_size)]
    no_group = [_no_group_file(directory, rank) for rank in range(world_size)]
    deadline = time.monotonic() + timeout_s
    all_written_at: float | None = None
    while any(proc.poll() is None for proc in procs):
        if any(file.exists() for file in no_group):
            break  # the others may wait for the failed rank until gloo's timeout
        now = time.monotonic()
        if all_written_at is None and all(file.exists() for file in results):
            all_written_at = now
        # Every rank wrote its result before leaving the group; gloo's teardown can still wait
        # forever for a peer that already left (seen on torch 2.4), so a rank stuck there
        # after the grace period has nothing left to say and is stopped.
        stuck_in_teardown = all_written_at is not None and now - all_written_at > _TEARDOWN_GRACE_S
        if now > deadline or stuck_in_teardown:
            _stop(procs)
            if stuck_in_teardown:
                break
            tails = "\n".join(f"rank {r}: {log.read_text(errors='replace')[-1500:]}" for r, log in enumerate(logs))
            raise RankError(f"remat: the {world_size} ranks did not finish in {timeout_s:.0f} s:\n{tails}")
        time.sleep(0.05)
    failed_to_join = [file for file in no_group if file.exists()]
    if failed_to_join:
        _stop(procs)
        said = failed_to_join[0].read_text(errors="replace")
        for rank in range(world_size):  # the next try starts clean
            _result_file(directory, rank).unlink(missing_ok=True)
            no_group[rank].unlink(missing_ok=True)
        return said
    outputs = [log.read_text(errors="replace") for log in logs]
    codes = [proc.returncode for proc in procs]
    return outputs, codes


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill every rank of a try (those already gone included) and wait for each."""
    for proc in procs:
        proc.kill()
        proc.wait()


def _result_file(directory: Path, rank: int) -> Path:
    """Where a rank leaves its pickled ``(status, value)``."""
    return directory / f"rank{rank}.pkl"


def _no_group_file(directory: Path, rank: int) -> Path:
    """Where a rank whose ``init_process_group`` raised leaves the traceback (no function ran)."""
    return directory / f"rank{rank}.no-group"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_main(function: str, directory: Path, world_size: int, port: int, rank: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: tuple[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S),
        )
    except Exception:  # the parent launches the group again on another port
        marker = _no_group_file(directory, rank)
        partial = marker.with_name(marker.name + ".partial")
        partial.write_text(f"rank {rank}: {traceback.format_exc()}")
        os.replace(partial, marker)
        return
    try:
        module_name, _, name = function.partition(":")
        target = getattr(importlib.import_module(module_name), name)
        payload = pickle.loads((directory / "payload.pkl").read_bytes())
        result = ("ok", target(payload))
    except BaseException:
        result = ("error", traceback.format_exc())
    # The result is written (whole, by rename) before the group is destroyed: the parent
    # needs nothing more from a rank whose teardown hangs.
    final = _result_file(directory, rank)
    partial = final.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(result))
    os.replace(partial, final)
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
