"""benchmarks/compiled_planner.py runs as one command and prints its tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from remat._compat.partitioner import region_memory_budgets_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.skipif(not region_memory_budgets_available(), reason="needs torch's per-region compile budgets (2.13+)")
def test_compiled_planner_benchmark_prints_its_table() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compiled_planner.py"), "--quick", "--models", "gpt",
         "--rounds", "2"],
        capture_output=True, text=True, check=True, timeout=1200,
    )
    out = result.stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| budget | bytes (MiB) | remat predicted / measured |")
    plan_rows = [row for row in rows if row.startswith(("| 30% ", "| 70% "))]
    assert len(plan_rows) == 2 and all("| yes |" in row for row in plan_rows)  # every plan fits
    assert "remat peaks monotonic in the budget: True" in out
    assert "remat / torch at the same bytes: median" in out
