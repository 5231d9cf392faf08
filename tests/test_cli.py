"""The `remat` command: `remat demo` on a tiny model, and --help."""

from __future__ import annotations

import pytest

from remat.cli import (
    STRATEGIES,
    DemoOptions,
    StrategyResult,
    compare_strategies,
    format_bytes,
    main,
    render_table,
)
from remat.errors import CheckpointUsageError

TINY = ["--steps", "1", "--layers", "2", "--seq", "32", "--batch", "2"]


def test_demo_prints_the_three_strategies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["strategy", "step"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {"none", "torch", "remat"}
    assert "(baseline)" in rows["none"]
    assert "yes (bitwise)" in rows["torch"]
    assert "yes (bitwise)" in rows["remat"]
    assert "MiB" in out or "KiB" in out


def test_compare_strategies_data() -> None:
    results = compare_strategies(DemoOptions(steps=2, warmup=0, layers=2, batch=2, seq=32))
    assert [r.strategy for r in results] == list(STRATEGIES)
    by_name = {r.strategy: r for r in results}
    none = by_name["none"]
    assert none.step_time_ratio == 1.0
    assert none.grads_match is None
    for name in ("torch", "remat"):
        r = by_name[name]
        assert r.grads_match is True
        assert r.max_grad_abs_diff == 0.0
        assert len(r.step_s) == 2
        # Checkpointing every block keeps far less until the end of forward.
        assert r.forward_end_bytes < none.forward_end_bytes
    for r in results:
        assert 0 < r.forward_end_bytes <= r.peak_bytes


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]])
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: remat")
    assert "demo" in out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "0"]) == 2
    assert "steps must be an int >= 1" in capsys.readouterr().err
    assert main(["nope"]) == 2


def test_unknown_or_baseline_free_strategies_rejected() -> None:
    with pytest.raises(CheckpointUsageError, match="including 'none'"):
        compare_strategies(DemoOptions(steps=1), strategies=["torch"])


def test_render_table_marks_mismatch() -> None:
    row = StrategyResult("remat", 0.5, 2.0, 2**20, 2**21, False, 1e-3, (0.5,))
    table = render_table([row])
    assert "no (max |diff| 1.0e-03)" in table
    assert "1.0 MiB" in table and "2.00x" in table and "500.0" in table


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(262144) == "256.0 KiB"
    assert format_bytes(50 * 2**20) == "50.0 MiB"
    assert format_bytes(5 * 2**40) == "5120.0 GiB"
