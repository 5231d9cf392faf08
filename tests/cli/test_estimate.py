"""`remat estimate`: the embedded GPT's estimate (estimate_training_step), whose meta-tensor
figures equal real CPU runs, and the command's output for built-in, preset and Hugging Face
models."""

from __future__ import annotations

import functools
import json
import pathlib

import pytest
import torch

import remat
from helpers import needs_meta_autocast
from remat import policies
from remat.cli import main
from remat.cli.estimate import estimate_training_step
from remat.errors import CheckpointUsageError
from remat.memory import FORWARD_END, MemoryReport, track
from remat.models import GPT, CheckpointFn, GPTConfig, lm_loss

CONFIG = GPTConfig(n_layers=2, seq_len=32)
BATCH = 2


def _real_step(checkpoint_fn: CheckpointFn | None) -> MemoryReport:
    """The same steady-state step as the estimate, on real CPU tensors."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    idx = torch.zeros(BATCH, CONFIG.seq_len, dtype=torch.long)

    def step(tracker: object = None) -> None:
        loss = lm_loss(model(idx, checkpoint_fn=checkpoint_fn), idx)
        if tracker is not None:
            tracker.mark(FORWARD_END)  # type: ignore[attr-defined]
        loss.backward()
        del loss
        optimizer.step()
        model.zero_grad(set_to_none=True)

    step()
    with track(model, optimizer=optimizer) as t:
        step(t)
    return t.report()


@pytest.mark.parametrize(
    "checkpoint_fn",
    [None, functools.partial(remat.checkpoint, policy=policies.save_matmuls)],
    ids=["none", "save_matmuls"],
)
def test_estimate_equals_the_real_cpu_step(checkpoint_fn: CheckpointFn | None) -> None:
    estimate = estimate_training_step(CONFIG, batch=BATCH, checkpoint_fn=checkpoint_fn)
    real = _real_step(checkpoint_fn)
    assert estimate.report.peak_bytes == real.peak_bytes
    assert estimate.report.forward_end_bytes == real.forward_end_bytes
    assert estimate.report.start_bytes == real.start_bytes
    assert [u.at_peak_bytes for u in estimate.report.by_category] == [
        u.at_peak_bytes for u in real.by_category
    ]
    assert [u.at_forward_end_bytes for u in estimate.report.by_category] == [
        u.at_forward_end_bytes for u in real.by_category
    ]


def test_steady_state_counts_parameters_gradients_and_adam_state() -> None:
    estimate = estimate_training_step(CONFIG, batch=BATCH)
    params = sum(p.numel() for p in GPT(CONFIG).parameters())
    assert estimate.parameter_count == params
    report = estimate.report
    assert report.category("parameter").at_peak_bytes == 4 * params
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a 4-byte step per tensor.
    n_tensors = len(list(GPT(CONFIG).parameters()))
    assert report.category("optimizer_state").at_peak_bytes == 8 * params + 4 * n_tensors
    assert report.category("gradient").allocated_bytes == 4 * params
    assert report.category("gradient").at_end_bytes == 0  # zero_grad(set_to_none=True)


def test_checkpointing_and_dtype_change_the_estimate() -> None:
    plain = estimate_training_step(CONFIG, batch=BATCH, optimizer="none")
    ckpt = estimate_training_step(CONFIG, batch=BATCH, optimizer="none", checkpoint_fn=remat.checkpoint)
    names = estimate_training_step(
        CONFIG,
        batch=BATCH,
        optimizer="none",
        checkpoint_fn=functools.partial(remat.checkpoint, policy=policies.save_only_names("attn_out")),
    )
    plain_act = plain.report.category("activation").at_forward_end_bytes
    ckpt_act = ckpt.report.category("activation").at_forward_end_bytes
    names_act = names.report.category("activation").at_forward_end_bytes
    assert ckpt_act < names_act < plain_act
    # Each block's attention op is replayed from the cache: its output
    # [batch, heads, seq, head_dim] and its log-sum-exp [batch, heads, seq].
    per_block = BATCH * CONFIG.seq_len * CONFIG.d_model * 4 + BATCH * CONFIG.n_heads * CONFIG.seq_len * 4
    assert names_act - ckpt_act == CONFIG.n_layers * per_block
    half = estimate_training_step(CONFIG, batch=BATCH, optimizer="none", dtype=torch.bfloat16)
    assert 2 * half.report.category("parameter").at_peak_bytes == plain.report.category("parameter").at_peak_bytes
    assert half.dtype == "torch.bfloat16"


def test_math_attention_keeps_the_attention_matrix() -> None:
    fused = estimate_training_step(CONFIG, batch=BATCH, optimizer="none", attention="fused")
    math = estimate_training_step(CONFIG, batch=BATCH, optimizer="none", attention="math")
    assert math.report.forward_end_bytes > fused.report.forward_end_bytes

    def softmaxes(report: MemoryReport) -> list[int]:
        return [e.delta_bytes for e in report.timeline if e.kind == "alloc" and "softmax" in e.name]

    # The math form materializes a [batch, heads, seq, seq] attention matrix per block.
    matrix = BATCH * CONFIG.n_heads * CONFIG.seq_len**2 * 4
    assert softmaxes(math.report).count(matrix) >= CONFIG.n_layers
    assert matrix not in softmaxes(fused.report)




@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch": 0}, "batch must be an int >= 1"),
        ({"optimizer": "adam"}, "optimizer must be"),
        ({"attention": "flash"}, "attention must be"),
        ({"dtype": torch.int64}, "floating torch.dtype"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(CheckpointUsageError, match=match):
        estimate_training_step(CONFIG, **kwargs)  # type: ignore[arg-type]


# -- the command -----------------------------------------------------------------


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


def test_estimate_help_lists_presets_with_their_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "7b (6.71B)" in out and "13b (12.92B)" in out and "1b (1.01B)" in out


def test_estimate_builtin_models(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    none, remat = tmp_path / "none.json", tmp_path / "remat.json"
    assert main(["estimate", "--model", "mlp", "--batch", "8", "--json", str(none)]) == 0
    assert main(["estimate", "--model", "mlp", "--batch", "8", "--strategy", "remat", "--json", str(remat)]) == 0
    assert capsys.readouterr().out.startswith("MLPChain (4 blocks), batch 8;")
    plain, checked = json.loads(none.read_text()), json.loads(remat.read_text())
    assert plain["parameter_count"] == checked["parameter_count"] > 0
    assert checked["forward_end_bytes"] < plain["forward_end_bytes"]


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


def test_an_unwritable_json_path_ends_before_the_estimate(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import remat.cli.estimate as estimate_command

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the estimate ran although --json cannot be written")

    monkeypatch.setattr(estimate_command, "model_request", never)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert main(["estimate", "--json", str(not_a_folder / "out.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--json" in err and "cannot write there" in err, err
