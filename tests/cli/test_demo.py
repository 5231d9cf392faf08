"""`remat demo`: every strategy on the embedded GPT, the table, the plots, the trade-off note."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import pytest

from remat.cli import main
from remat.cli.demo import (
    STRATEGIES,
    DemoOptions,
    StrategyResult,
    compare_strategies,
    compression_note,
    render_table,
    trade_off_note,
)
from remat.cli.strategies import ALL_STRATEGIES, COMPRESSED_STRATEGIES
from remat.errors import CheckpointUsageError
from remat.memory import format_bytes

TINY = ["--steps", "1", "--warmup", "0", "--layers", "2", "--seq", "32", "--batch", "2"]


def test_demo_prints_every_strategy_and_writes_plots(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out_dir = tmp_path / "out"
    assert main(["demo", *TINY, "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["strategy", "step"]
    rows = {line.split()[0]: line for line in lines[2 : 2 + len(STRATEGIES)]}
    assert set(rows) == set(STRATEGIES)
    assert "(baseline)" in rows["none"]
    for strategy in STRATEGIES[1:]:
        expected = "approx. (error" if strategy in COMPRESSED_STRATEGIES else "yes (bitwise)"
        assert expected in rows[strategy], rows[strategy]
    assert "remat:save_matmuls+fp8 keeps what remat:save_matmuls keeps in" in out
    for name in ("timeline.png", "saved_by_module.png"):
        assert (out_dir / name).read_bytes().startswith(b"\x89PNG")
    assert f"plots: {out_dir / 'timeline.png'}" in out


def test_demo_without_matplotlib_still_prints_the_table(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    argv = ["demo", *TINY, "--strategies", "none", "remat", "--out", str(tmp_path)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "pip install remat[plot]" in captured.err
    assert not list(tmp_path.iterdir())
    assert main([*argv, "--no-plots"]) == 0
    assert "plots skipped" not in capsys.readouterr().err


def test_demo_runs_every_strategy_and_writes_json(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    # What benchmarks/strategies.py runs: `remat demo --strategies all --json PATH`.
    path = tmp_path / "demo.json"
    assert main(["demo", *TINY, "--layers", "1", "--strategies", "all", "--no-plots", "--json", str(path)]) == 0
    table = capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert [row["strategy"] for row in payload["results"]] == list(ALL_STRATEGIES)
    assert payload["options"]["layers"] == 1 and payload["model"]["n_layers"] == 1
    assert set(payload["environment"]) == {"torch", "python", "threads", "machine"}
    for row in payload["results"]:
        assert row["peak_bytes"] >= row["forward_end_bytes"] > 0 and row["memory_by_category"], row
        assert format_bytes(row["peak_bytes"]) in table


def test_compare_strategies_data() -> None:
    strategies = ["none", "torch", "remat", "remat:save_matmuls"]
    results = compare_strategies(
        DemoOptions(steps=2, warmup=0, layers=2, batch=2, seq=32),
        strategies=strategies,  # type: ignore[arg-type]
    )
    assert [r.strategy for r in results] == strategies
    by_name = {r.strategy: r for r in results}
    none = by_name["none"]
    assert none.step_time_ratio == 1.0
    assert none.grads_match is None
    for name in strategies[1:]:
        r = by_name[name]
        assert r.grads_match is True
        assert r.max_grad_abs_diff == 0.0
        assert len(r.step_s) == 2
        # Checkpointing every block keeps less until the end of forward.
        assert r.forward_end_bytes < none.forward_end_bytes
    assert by_name["remat"].forward_end_bytes < by_name["remat:save_matmuls"].forward_end_bytes
    for r in results:
        assert r.memory is not None
        assert r.memory.start_bytes < r.forward_end_bytes <= r.peak_bytes  # parameters first


def test_compressed_strategies_keep_less_with_a_measured_gradient_error() -> None:
    strategies = ["none", "remat:save_matmuls", *COMPRESSED_STRATEGIES]
    results = compare_strategies(
        DemoOptions(steps=1, warmup=0, layers=2, batch=2, seq=32),
        strategies=strategies,  # type: ignore[arg-type]
    )
    by_name = {r.strategy: r for r in results}
    assert by_name["remat:save_matmuls"].grad_error == 0.0
    # fp8 (e4m3, row scales) of the inputs and matmul outputs; int8 of every activation.
    assert 0.0 < by_name["remat:save_matmuls+fp8"].grad_error < 0.1
    assert 0.0 < by_name["remat:keep+int8"].grad_error < 0.05
    assert by_name["remat:save_matmuls+fp8"].forward_end_bytes < by_name["remat:save_matmuls"].forward_end_bytes
    assert by_name["remat:keep+int8"].forward_end_bytes < by_name["none"].forward_end_bytes
    note = compression_note(results)
    assert note is not None and note.count("\n") == 1
    assert compression_note(results[:2]) is None


def test_unknown_or_baseline_free_strategies_rejected() -> None:
    with pytest.raises(CheckpointUsageError, match="including 'none'"):
        compare_strategies(DemoOptions(steps=1), strategies=["torch"])


def test_every_strategy_is_known_to_the_benchmark() -> None:
    assert set(STRATEGIES) <= set(ALL_STRATEGIES)
    assert ALL_STRATEGIES[0] == "none"


def test_render_table_marks_mismatch() -> None:
    row = StrategyResult("remat", 0.5, 2.0, 2**20, 2**21, False, 1e-3, (0.5,))
    table = render_table([row])
    assert "no (max |diff| 1.0e-03)" in table
    assert "1.0 MiB" in table and "2.00x" in table and "500.0" in table


def test_trade_off_note_says_whether_save_matmuls_bought_time() -> None:
    full = StrategyResult("remat", 0.3, 1.31, 10 * 2**20, 20 * 2**20, True, 0.0, (0.3,))
    slower = StrategyResult("remat:save_matmuls", 0.4, 1.62, 40 * 2**20, 44 * 2**20, True, 0.0, (0.4,))
    note = trade_off_note([full, slower])
    assert note is not None
    assert "30.0 MiB more than remat" in note and "1.62x none against remat's 1.31x" in note
    assert "yet slower here" in note and "on a GPU" in note
    faster = dataclasses.replace(slower, step_time_ratio=1.2)
    assert "the faster of the two here" in (trade_off_note([full, faster]) or "")
    assert trade_off_note([full]) is None


def test_progress_bar_fallback_goes_to_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the built-in bar
    options = DemoOptions(steps=1, warmup=0, layers=1, batch=1, seq=16)
    compare_strategies(options, strategies=["none"], progress=True)
    captured = capsys.readouterr()
    assert "remat demo [" in captured.err and "] 2/2" in captured.err
    assert captured.out == ""
    compare_strategies(options, strategies=["none"])  # off by default
    assert capsys.readouterr().err == ""


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("the strategies ran although an output path cannot be written")


@pytest.mark.parametrize("flag", ["--json", "--out"])
def test_an_unwritable_output_ends_before_the_strategies_run(
    flag: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import remat.cli.demo as demo_command

    monkeypatch.setattr(demo_command, "compare_strategies", _never)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    target = not_a_folder / "inside"
    assert main(["demo", flag, str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert err.startswith(f"remat demo: error: {flag} {target}")
    assert "cannot write there" in err
    assert sorted(tmp_path.iterdir()) == [not_a_folder]
