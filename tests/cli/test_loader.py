"""The one model loader behind `remat report`, `estimate` and `plan` (remat/cli/loader.py):
``--model package.module:factory`` and ``--hf-config``, on the CPU and on meta tensors, and
its one-line errors."""

from __future__ import annotations

import json
import pathlib
import sys
import types
from functools import partial

import pytest
import torch

from helpers import needs_meta_autocast, one_error_line
from remat.cli import main
from remat.cli.loader import LoadedModel, ModelRequest, load_model
from remat.errors import CheckpointUsageError, ModelLoadError


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


# -- --hf-config ---------------------------------------------------------------


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
    from remat._compat.versions import flash_cpu_takes_grouped_heads
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
    assert "--seq 129 exceeds the config's 128 positions" in one_error_line(
        capsys.readouterr().err, "remat estimate"
    )


def _loss_of(loaded: LoadedModel) -> torch.Tensor:
    assert loaded.loss_fn is not None
    return loaded.loss_fn(loaded.model(*loaded.args, **loaded.kwargs))


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


# -- models that cannot be loaded ----------------------------------------------


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
    assert text in one_error_line(capsys.readouterr().err, f"remat {command}")


def test_a_model_that_cannot_run_on_meta_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    spec = f"{__name__}:value_reading_factory"
    assert main(["estimate", "--model", spec]) == 1
    line = one_error_line(capsys.readouterr().err, "remat estimate")
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
            assert text in one_error_line(capsys.readouterr().err, f"remat {command}")
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["estimate", "--hf-config", str(broken)]) == 1
    assert "pip install remat[hf]" in one_error_line(capsys.readouterr().err, "remat estimate")
