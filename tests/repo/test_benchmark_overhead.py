"""benchmarks/overhead.py runs as one command and prints every row of its table."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO


def test_overhead_benchmark_prints_its_table() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--quick", "--rounds", "1"],
        capture_output=True, text=True, check=True, timeout=300,
    )
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| what | remat | torch |")
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert names[0] == "per-region overhead, chain of tiny regions"
    assert names[3].startswith("per-region overhead, 1-parameter blocks")
    assert names[3].endswith("floor of Python-mode SAC: full + do-nothing dispatch mode, vs torch's save matmuls")
    assert names[4].endswith("save matmuls vs the floor (torch column: the floor)")
    del names[3:5]  # the floor rows (torch 2.5+, where torch has selective checkpointing)
    for index, blocks in ((1, "1-parameter blocks"), (3, "residual MLP blocks"), (5, "GPT blocks")):
        assert names[index].startswith(f"per-region overhead, {blocks}")
        assert names[index].endswith(", full")
        assert names[index + 1].startswith(f"per-region overhead, {blocks}")
        assert names[index + 1].endswith(", save matmuls")
    assert names[7] == "SAC per-op overhead (save matmuls)"
    assert names[8].startswith("full checkpoint step, GPT")
    assert names[9].startswith("SAC save-matmuls step, GPT")
    assert len(names) == 10


def test_overhead_benchmark_runs_the_groups_asked_for() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--quick", "--rounds", "1",
         "--only", "tiny,sac-op"],
        capture_output=True, text=True, check=True, timeout=300,
    )
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip() for row in rows] == [
        "per-region overhead, chain of tiny regions",
        "SAC per-op overhead (save matmuls)",
    ]
