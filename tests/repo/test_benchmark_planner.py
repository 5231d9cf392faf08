"""benchmarks/planner.py runs as one command and prints its table and solver checks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.slow
def test_planner_benchmark_prints_its_table() -> None:
    result = subprocess.run(
        # Two of its four models: a chain, and the language model with its head in slices
        # (the planner on each model is tests/planner's; here, that the command runs whole).
        [sys.executable, str(REPO / "benchmarks" / "planner.py"), "--quick", "--rounds", "1",
         "--models", "mlp-16", "gpt-lm"],
        capture_output=True, text=True, check=True, timeout=600,
    )
    out = result.stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| model | budget |")
    assert {row.split("|")[1].strip() for row in rows[1:]} == {"mlp-16", "gpt-lm"}
    assert any("60% of full" in row and "head/" in row for row in rows)  # the head reaches it
    assert "measured peak within budget:" in out
    assert "worst gap to the optimum dp 0.00%, milp 0.00%" in out
    assert "192 non-uniform blocks, 3 options: auto -> milp" in out
