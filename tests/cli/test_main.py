"""The `remat` command: demo, report, estimate, plan, on tiny sizes."""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import sys
import types
from functools import partial

import pytest
import torch

from helpers import tiny_llama_config
from remat.cli import main
from remat.cli.demo import (
    STRATEGIES,
    DemoOptions,
    StrategyResult,
    compare_strategies,
    render_table,
    trade_off_note,
)
from remat.cli.loader import LoadedModel, ModelRequest, load_model
from remat.cli.strategies import ALL_STRATEGIES
from remat.errors import CheckpointUsageError, ModelLoadError
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
    assert "policy_saved" in out and "dropped" in out and "gpt.py:" in out
    assert out.splitlines()[-1].startswith("totals (parameters excluded): kept ")


def test_report_with_a_factory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--model", "remat.models:tiny_gpt", "--limit", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "none: GPT from remat.models:tiny_gpt"
    assert out[1].split()[0] == "fate" and out[4].endswith("more")


def load_factory(spec: str) -> LoadedModel:
    return load_model(ModelRequest(command="remat", model=spec))


def test_load_factory_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_factory("remat.no_such_module:factory")
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_factory("remat.models:no_such_factory")
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


def test_plan_is_a_subcommand_like_the_others(capsys: pytest.CaptureFixture[str]) -> None:
    # One parser for every command: `remat plan` reads the same model and
    # sharding arguments as `remat estimate` (defined once, remat.cli.arguments).
    assert main(["plan", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--hf-config", "--freeze", "--lora", "--world-size", "--fsdp", "--save"):
        assert flag in text, flag
    assert main(["plan", "--budget", "50%", "--no-such-flag"]) == 2
    assert "remat: error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_plan_reads_the_budget_before_building_a_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # One reading of a budget (remat.planner.Budget), for the command too.
    import remat.cli.plan as plan_command

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the budget is read before the model is built")

    monkeypatch.setattr(plan_command, "load_model", no_model)
    assert main(["plan", "--budget", "lots"]) == 2  # a usage error
    assert "cannot read 'lots'" in capsys.readouterr().err


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


# -- presets -------------------------------------------------------------------


def test_gpt_parameter_count_is_the_built_model_count() -> None:
    from remat.models import GPT, GPTConfig

    for config in (GPTConfig(), GPTConfig(n_layers=3, d_model=64, n_heads=4, d_ff=100, vocab_size=77, seq_len=9)):
        assert config.parameter_count() == sum(p.numel() for p in GPT(config).parameters())


def test_every_preset_is_named_by_its_parameter_count() -> None:
    import re

    from remat.cli.estimate import PRESETS
    from remat.models import meta_model

    assert {"tiny", "1b", "7b", "13b"} <= set(PRESETS)  # --preset 7b is in the README
    for name, config in PRESETS.items():
        count = config.parameter_count()
        if name == "tiny":
            assert count < 5e6
            continue
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([mb])", name)
        assert match is not None, name
        nominal = float(match.group(1)) * {"m": 1e6, "b": 1e9}[match.group(2)]
        assert abs(count - nominal) <= 0.05 * nominal, (name, count)
    # The formula is the built model's count, on the 7b shape too.
    assert sum(p.numel() for p in meta_model(PRESETS["7b"]).parameters()) == PRESETS["7b"].parameter_count()


def test_estimate_help_lists_presets_with_their_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "7b (6.71B)" in out and "13b (12.92B)" in out and "1b (1.01B)" in out


# -- one model loader: --model and --hf-config -----------------------------------


def keyword_factory() -> tuple[object, ...]:
    """(model, args, kwargs, loss_fn): a residual block stack whose forward takes a keyword."""
    import torch

    class Residual(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)
            self.ff = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = x + self.ff(self.norm(x))
            return out

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Residual() for _ in range(3))

        def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x * scale

    torch.manual_seed(0)
    return Stack(), (torch.randn(4, 8, 16),), {"scale": 0.5}, lambda out: out.pow(2).mean()


def raising_factory() -> tuple[object, ...]:
    raise ValueError("no weights here")


def value_reading_factory() -> tuple[object, ...]:
    """A model whose forward reads a tensor's value: fine on the CPU, impossible on meta."""

    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.layer(x)
            return out if out.sum().item() > 0 else -out

    return Gate(), torch.randn(2, 4)


def list_factory() -> list[object]:
    import torch

    return [torch.nn.Linear(2, 2), torch.randn(1, 2)]


@pytest.fixture
def tiny_llama(tmp_path: pathlib.Path) -> pathlib.Path:
    config = tiny_llama_config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
        max_position_embeddings=2048,  # transformers' default
    )
    path = tmp_path / "tiny_llama_config.json"
    config.to_json_file(path)
    return path


def test_every_command_reads_the_same_factory(capsys: pytest.CaptureFixture[str]) -> None:
    spec = f"{__name__}:keyword_factory"
    assert main(["report", "--model", spec, "--strategy", "remat"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"remat: Stack from {spec}")
    assert "dropped" in out  # the blocks (children of the ModuleList) were checkpointed
    assert main(["estimate", "--model", spec, "--optimizer", "sgd", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Stack from {spec};") and "estimated on meta tensors" in out
    assert main(["plan", "--model", spec, "--budget", "100%", "--repeats", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert f"model: Stack from {spec}" in out and "model.blocks.2" in out and "within budget" in out


def test_estimate_of_a_factory_checkpointed_keeps_less() -> None:
    import torch

    from remat._blocks import find_blocks
    from remat.cli.loader import ModelRequest, load_model

    loaded = load_model(ModelRequest(command="t", model="remat.models:tiny_gpt", device="meta"))
    assert all(p.device.type == "meta" for p in loaded.model.parameters())
    assert loaded.args[0].device.type == "meta" and loaded.args[0].dtype == torch.long
    assert len(find_blocks(loaded.model)) == 2


def test_estimate_builtin_models(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    none, remat = tmp_path / "none.json", tmp_path / "remat.json"
    assert main(["estimate", "--model", "mlp", "--batch", "8", "--json", str(none)]) == 0
    assert main(["estimate", "--model", "mlp", "--batch", "8", "--strategy", "remat", "--json", str(remat)]) == 0
    assert capsys.readouterr().out.startswith("MLPChain (4 blocks), batch 8;")
    plain, checked = json.loads(none.read_text()), json.loads(remat.read_text())
    assert plain["parameter_count"] == checked["parameter_count"] > 0
    assert checked["forward_end_bytes"] < plain["forward_end_bytes"]


# transformers' rotary embeddings enter torch.autocast(device_type=<the input's device>),
# which torch 2.4 does not accept for "meta".
needs_meta_autocast = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5),
    reason="torch < 2.5 has no autocast state for the meta device",
)


def _hf_config(tmp_path: pathlib.Path, kind: str) -> pathlib.Path:
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}
    if kind == "gpt2":  # learned positions; no dropout, so the CPU runs the fused kernel too
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, attn_pdrop=0.0,
                                         resid_pdrop=0.0, embd_pdrop=0.0, **small)
    else:  # grouped key/value heads, rotary positions, RMSNorm, SwiGLU
        config = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[kind])(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, **small,
        )
    path = tmp_path / f"{kind}.json"
    config.to_json_file(path)
    return path


@needs_meta_autocast
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_hf_config_estimate_matches_a_real_cpu_step(kind: str, tmp_path: pathlib.Path) -> None:
    """On meta (fused attention) the tracked step equals the same step on real CPU tensors."""
    from remat._compat import flash_cpu_takes_grouped_heads
    from remat.cli.loader import ModelRequest, load_model

    if kind in ("llama", "qwen2") and not flash_cpu_takes_grouped_heads():
        pytest.skip(
            "before torch 2.11 the CPU's fused attention cannot take grouped key/value heads "
            "(checked 2.7.1), so the real CPU step runs the math kernel, which keeps the "
            "attention matrix the fused estimate (CUDA's behaviour) does not"
        )
    from remat.memory import track_training_step

    path = _hf_config(tmp_path, kind)
    peaks = {}
    for device in ("cpu", "meta"):
        loaded = load_model(ModelRequest(command="t", hf_config=path, batch=2, seq=32, device=device))  # type: ignore[arg-type]
        assert loaded.model.config.use_cache is False
        report = track_training_step(loaded.model, partial(_loss_of, loaded))
        peaks[device] = (report.peak_bytes, report.forward_end_bytes)
    assert peaks["meta"] == peaks["cpu"]


def test_hf_sequence_length_defaults_to_the_config_positions(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _hf_config(tmp_path, "gpt2")
    assert main(["estimate", "--hf-config", str(path), "--optimizer", "none", "--top", "1"]) == 0
    title = capsys.readouterr().out.splitlines()[1]
    assert title.startswith("GPT2LMHeadModel 2 layers from ") and "seq 128, batch 1;" in title  # not 2048
    assert main(["estimate", "--hf-config", str(path), "--seq", "129"]) == 2
    assert "--seq 129 exceeds the config's 128 positions" in _one_error_line(
        capsys.readouterr().err, "remat estimate"
    )


def _loss_of(loaded: LoadedModel) -> torch.Tensor:
    assert loaded.loss_fn is not None
    return loaded.loss_fn(loaded.model(*loaded.args, **loaded.kwargs))


@needs_meta_autocast
def test_estimate_hf_config(tiny_llama: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    real = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tiny_llama))
    count = sum(p.numel() for p in real.parameters())
    out_json = tmp_path / "e.json"
    argv = ["estimate", "--hf-config", str(tiny_llama), "--seq", "32", "--batch", "2", "--json", str(out_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "tiny_llama_config.json: use_cache=False (a training step keeps no KV cache)"
    assert out[1].startswith("LlamaForCausalLM 2 layers from ") and "seq 32, batch 2;" in out[1]
    payload = json.loads(out_json.read_text())
    assert payload["parameter_count"] == count
    assert payload["config"]["model_type"] == "llama" and payload["config"]["use_cache"] is False
    # A directory holding config.json works the same; checkpointing the layers keeps less.
    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(tiny_llama.read_text())
    checked_json = tmp_path / "checked.json"
    argv = ["estimate", "--hf-config", str(model_dir), "--seq", "32", "--batch", "2", "--strategy", "remat",
            "--json", str(checked_json)]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("config.json: use_cache=False")
    checked = json.loads(checked_json.read_text())
    assert checked["parameter_count"] == count
    assert checked["forward_end_bytes"] < payload["forward_end_bytes"]


def test_plan_and_report_on_a_tiny_llama(tiny_llama: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--hf-config", str(tiny_llama), "--budget", "90%", "--seq", "32", "--batch", "2",
            "--repeats", "1", "--steps", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny_llama_config.json: use_cache=False")
    assert "model.layers.0" in out and "model.layers.1" in out and "within budget" in out
    assert main(["report", "--hf-config", str(tiny_llama), "--seq", "16", "--limit", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("use_cache=False (a training step keeps no KV cache)")
    assert out[1].startswith("none: LlamaForCausalLM 2 layers")


# -- exit codes and one-line errors ----------------------------------------------


def _one_error_line(err: str, prog: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "prog", "text"),
    [
        (["demo", "--steps", "x"], "remat demo", "invalid int value"),
        (["demo", "--nope"], "remat", "unrecognized arguments: --nope"),
        (["nope"], "remat", "invalid choice: 'nope'"),
        (["report", "--strategy", "fast"], "remat report", "invalid choice: 'fast'"),
        (["estimate", "--dtype", "int8"], "remat estimate", "invalid choice: 'int8'"),
        (["plan", "--steps", "x"], "remat plan", "invalid int value"),
        (["plan", "--steps", "0"], "remat plan", "--steps and --repeats must be >= 1"),
        (["report", "--model", "not a path"], "remat report", "package.module:factory, got 'not a path'"),
        (["estimate", "--model", "pkg/mod.py"], "remat estimate", "package.module:factory"),
        (["plan", "--model", "remat.models"], "remat plan", "package.module:factory"),
        (["estimate", "--model", "mlp", "--layers", "4"], "remat estimate", "--layers shape the built-in GPT"),
        (["estimate", "--model", "mlp", "--hf-config", "x.json"], "remat estimate", "not allowed with argument"),
        (["estimate", "--batch", "0"], "remat estimate", "--batch must be an int >= 1, got 0"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    argv: list[str], prog: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert text in _one_error_line(capsys.readouterr().err, prog)


@pytest.mark.parametrize(
    ("model", "text"),
    [
        ("no_such_module_xyz:factory", "cannot import 'no_such_module_xyz' (ModuleNotFoundError"),
        ("remat.models:no_such_factory", "'remat.models' has no attribute 'no_such_factory'"),
        ("remat.models:GPT_TP_PLAN", "it is a dict, not a function"),
        (f"{__name__}:raising_factory", "raised ValueError: no weights here"),
        (f"{__name__}:list_factory", "returned a value of type list; FACTORY() takes no arguments"),
    ],
)
@pytest.mark.parametrize("command", ["report", "estimate", "plan"])
def test_bad_factories_exit_1_with_one_line(
    command: str, model: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--model", model]) == 1
    assert text in _one_error_line(capsys.readouterr().err, f"remat {command}")


def test_a_model_that_cannot_run_on_meta_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    spec = f"{__name__}:value_reading_factory"
    assert main(["estimate", "--model", spec]) == 1
    line = _one_error_line(capsys.readouterr().err, "remat estimate")
    assert f"a training step of Gate from {spec} failed on meta tensors" in line
    assert main(["report", "--model", spec]) == 0  # on the CPU it runs


def test_bad_hf_configs_exit_1_with_one_line(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    typeless = tmp_path / "typeless.json"
    typeless.write_text(json.dumps({"hidden_size": 64}))
    cases = [
        (tmp_path / "missing.json", "does not exist (nothing is downloaded)"),
        (tmp_path, "holds no config.json"),
        (broken, "not a JSON file"),
        (typeless, "cannot read --hf-config"),
    ]
    for path, text in cases:
        for command in ("estimate", "plan", "report"):
            assert main([command, "--hf-config", str(path)]) == 1, (command, path)
            assert text in _one_error_line(capsys.readouterr().err, f"remat {command}")
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["estimate", "--hf-config", str(broken)]) == 1
    assert "pip install remat[hf]" in _one_error_line(capsys.readouterr().err, "remat estimate")


def test_exit_codes_of_the_installed_command() -> None:
    import subprocess

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "remat", *argv], capture_output=True, text=True)

    usage = run("estimate", "--model", "a b")
    assert usage.returncode == 2 and usage.stdout == ""
    assert usage.stderr.splitlines() == [
        "remat estimate: error: --model must be one of gpt, mlp, convnet or look like "
        "package.module:factory, got 'a b'."
    ]
    bad = run("plan", "--model", "no_such_module_xyz:f")
    assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1


# -- progress --------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("command", [["estimate", "--layers", "1", "--seq", "16"],
                                     ["demo", *TINY, "--strategies", "none", "--no-plots"],
                                     pytest.param(["plan", "--layers", "2", "--d-model", "16", "--seq", "16",
                                                   "--batch", "1", "--budget", "100%", "--repeats", "1",
                                                   "--steps", "1"], marks=pytest.mark.slow)])
def test_progress_on_a_terminal_only_and_not_with_quiet(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the built-in bar, deterministic text
    label = f"remat {command[0]} ["
    assert main(command) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(command) == 0
    assert label in terminal.getvalue()
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main([*command, "--quiet"]) == 0
    assert quiet.getvalue() == ""


def test_progress_draws_with_tqdm_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["estimate", "--layers", "1", "--seq", "16", "--optimizer", "none"]) == 0
    assert "remat estimate" in terminal.getvalue() and "2/2" in terminal.getvalue()
