"""benchmarks/overhead.py runs as one command and prints every row of its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_benchmark_prints_its_table() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--quick", "--rounds", "1"],
        capture_output=True, text=True, check=True, timeout=300,
    )
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| what | remat | torch |")
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert names[0] == "per-region overhead, chain of tiny regions"
    assert names[1] == "SAC per-op overhead (save matmuls)"
    assert names[2].startswith("full checkpoint step, GPT")
    assert names[3].startswith("SAC save-matmuls step, GPT")
