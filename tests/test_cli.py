"""The `remat` command: demo, report, estimate, plan, on tiny sizes."""

from __future__ import annotations

import json
import pathlib
import sys
import types

import pytest

from remat._models import ModelLoadError
from remat.cli import (
    ALL_STRATEGIES,
    STRATEGIES,
    DemoOptions,
    StrategyResult,
    compare_strategies,
    format_bytes,
    load_factory,
    main,
    render_table,
)
from remat.errors import CheckpointUsageError

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
        assert "yes (bitwise)" in rows[strategy], rows[strategy]
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


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["report", "--help"], ["estimate", "--help"]])
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: remat")
    assert argv[0] == "--help" or argv[0] in out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "0"]) == 2
    assert "steps must be an int >= 1" in capsys.readouterr().err
    assert main(["nope"]) == 2
    assert main(["demo", "--strategies", "torch"]) == 2
    assert "including 'none'" in capsys.readouterr().err
    assert main(["report", "--model", "not a path"]) == 2
    assert "package.module:factory" in capsys.readouterr().err


def test_unknown_or_baseline_free_strategies_rejected() -> None:
    with pytest.raises(CheckpointUsageError, match="including 'none'"):
        compare_strategies(DemoOptions(steps=1), strategies=["torch"])


def test_report_on_the_embedded_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--layers", "1", "--seq", "16", "--batch", "1", "--strategy", "remat:save_matmuls"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("remat:save_matmuls: GPT 1 layers")
    assert "policy_saved" in out and "dropped" in out and "_demo.py:" in out
    assert out.splitlines()[-1].startswith("totals (parameters excluded): kept ")


def test_report_with_a_factory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--model", "remat.cli:tiny_gpt", "--limit", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "none: GPT from remat.cli:tiny_gpt"
    assert out[1].split()[0] == "fate" and out[4].endswith("more")


def test_load_factory_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_factory("remat.no_such_module:factory")
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_factory("remat.cli:no_such_factory")
    fake = types.ModuleType("remat_test_factories")
    fake.bad = lambda: 42  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "remat_test_factories", fake)
    with pytest.raises(ModelLoadError, match=r"returned a value of type int; FACTORY\(\) takes no arguments"):
        load_factory("remat_test_factories:bad")
    with pytest.raises(CheckpointUsageError, match=r"package\.module:factory"):
        load_factory("not a spec")


def test_estimate_prints_and_writes_json(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "estimate.json"
    argv = ["estimate", "--layers", "2", "--seq", "32", "--batch", "2", "--strategy", "remat", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPT 2 layers x d_model 128, seq 32, batch 2;")
    assert "estimated on meta tensors" in out and "optimizer_state" in out
    payload = json.loads(path.read_text())
    assert payload["strategy"] == "remat" and payload["config"]["n_layers"] == 2
    assert 0 < payload["forward_end_bytes"] <= payload["peak_bytes"]
    assert main(["estimate", "--strategy", "remat:offload"]) == 2  # host memory: not on meta


def test_plan_is_passed_through(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("remat.planner._command")
    fake.main = lambda argv: seen.append(argv) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "remat.planner._command", fake)
    assert main(["plan", "--budget", "0.5", "--help"]) == 7
    assert seen == [["--budget", "0.5", "--help"]]
    monkeypatch.setitem(sys.modules, "remat.planner._command", None)
    assert main(["plan"]) == 2
    assert "`remat plan` is not available" in capsys.readouterr().err


def test_every_strategy_is_known_to_the_benchmark() -> None:
    assert set(STRATEGIES) <= set(ALL_STRATEGIES)
    assert ALL_STRATEGIES[0] == "none"


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


def test_python_dash_m_remat_is_the_remat_command() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "remat", "--help"], capture_output=True, text=True, check=True
    )
    assert "demo" in result.stdout and "plan" in result.stdout
