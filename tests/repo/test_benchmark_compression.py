"""benchmarks/compression.py runs as one command; its bytes are predicted exactly and its
gradient errors stay within the stated tolerances (docs/guide/compression.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

# The tolerances of tests/offload/test_compress.py (relative error of all parameter gradients).
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-2, "fp8": 8e-2, "fp8_e5m2": 1.6e-1, "int8": 3e-2}


@pytest.mark.slow
def test_compression_benchmark_predicts_its_bytes_and_stays_within_tolerance(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compression.py"), "--quick", "--rounds", "2",
         "--models", "gpt", "--json", str(out)],
        capture_output=True, text=True, check=True, timeout=900,
    )
    assert result.stdout.splitlines()[0].split()[:3] == ["model", "precision", "format"]
    rows = json.loads(out.read_text())
    assert {(r["precision"], r["format"]) for r in rows} == {
        (p, f) for p in ("fp32", "bf16 autocast") for f in ("keep", *TOLERANCE)
    }
    for row in rows:
        assert row["forward_end_bytes"] == row["predicted_bytes"], row
        if row["format"] == "keep":
            continue
        assert row["ratio"] < 1.0, row  # every format holds fewer bytes
        assert row["gradient_error"] <= TOLERANCE[row["format"]], row


@pytest.mark.slow
def test_convergence_benchmark_trains_every_format_from_the_same_start(tmp_path: Path) -> None:
    out = tmp_path / "curves.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compression_convergence.py"), "--steps", "3",
         "--models", "gpt", "--formats", "keep,fp8", "--seeds", "1", "--json", str(out)],
        capture_output=True, text=True, check=True, timeout=600,
    )
    result = json.loads(out.read_text())
    (keep,), (fp8,) = result["curves"]["gpt"]["keep"], result["curves"]["gpt"]["fp8"]
    assert len(keep) == len(fp8) == 3
    assert keep[0] == fp8[0]  # the first forward's loss is bitwise the same: only backward reads compressed values
    assert keep[1:] != fp8[1:]  # the updates differ: compression reached the gradients
    assert set(result["held_out"]["gpt"]) == {"keep", "fp8"}
