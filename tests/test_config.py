"""remat.apply_config: one config (a dict or a TOML section) applies a whole policy."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import remat
from helpers import OpCounter, tiny_llama_config
from remat._scope import observe_saved_tensors
from remat.config import CheckpointConfig
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.models import GPT, GPTConfig, lm_loss, make_batch

CONFIG = GPTConfig(n_layers=4, d_model=32, seq_len=32)


def gpt() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    idx, targets = make_batch(CONFIG, 2, torch.Generator().manual_seed(0))
    return model, idx, targets


def step(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lm_loss(model(idx), targets).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def backward_mm_count(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(idx), targets)
    with OpCounter() as counter:
        loss.backward()
    counts = counter.take()
    return counts["aten.mm.default"] + counts["aten.addmm.default"]  # linear with a bias: addmm


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"mode": "full"}, ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
        ({"mode": "full", "every": 2}, ["blocks.1", "blocks.3"]),
        ({"mode": "selective", "every": 3}, ["blocks.2"]),
        ({"mode": "selective", "save_ops": ["aten.mm", "addmm"]}, ["blocks.0", "blocks.1",
                                                                    "blocks.2", "blocks.3"]),
        ({"mode": "selective", "save_modules": ["attn"]}, ["blocks.0", "blocks.1", "blocks.2",
                                                            "blocks.3"]),
        ({"mode": "full", "blocks": "re:blocks\\.[02]"}, ["blocks.0", "blocks.2"]),
        # recompute by module name: only the MLPs, every 2nd of them
        ({"mode": "full", "blocks": "re:blocks\\.\\d+\\.mlp", "every": 2},
         ["blocks.1.mlp", "blocks.3.mlp"]),
        ({"mode": "full", "blocks": "blocks.*.attn"}, ["blocks.0.attn", "blocks.1.attn",
                                                       "blocks.2.attn", "blocks.3.attn"]),
        ({"mode": "none"}, []),
        ({"mode": "selective", "policy": "save_nothing"}, ["blocks.0", "blocks.1", "blocks.2",
                                                           "blocks.3"]),
        ({"mode": "selective", "save_modules": ["attn"], "policy": "save_matmuls"},
         ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
    ],
)
def test_gradients_equal_the_unchecked_model(config: dict[str, Any], expected: list[str]) -> None:
    model, idx, targets = gpt()
    reference = step(copy.deepcopy(model), idx, targets)
    assert remat.apply_config(model, config).blocks == tuple(expected)
    got = step(model, idx, targets)
    assert got.keys() == reference.keys()
    for name, grad in reference.items():
        assert torch.equal(got[name], grad), name


def test_the_config_really_recomputes_what_it_says() -> None:
    model, idx, targets = gpt()
    plain = backward_mm_count(copy.deepcopy(model), idx, targets)
    full = copy.deepcopy(model)
    remat.apply_config(full, {"mode": "full"})
    half = copy.deepcopy(model)
    remat.apply_config(half, {"mode": "full", "every": 2})
    matmuls = copy.deepcopy(model)
    remat.apply_config(matmuls, {"mode": "selective", "save_ops": ["aten.mm", "aten.addmm"]})
    per_block = (backward_mm_count(full, idx, targets) - plain) // CONFIG.n_layers
    assert per_block > 0
    assert backward_mm_count(half, idx, targets) == plain + 2 * per_block
    assert backward_mm_count(matmuls, idx, targets) == plain  # no matmul recomputed
    nothing = copy.deepcopy(model)
    remat.apply_config(nothing, {"mode": "selective", "policy": "save_nothing"})
    assert backward_mm_count(nothing, idx, targets) == plain + CONFIG.n_layers * per_block
    named = copy.deepcopy(model)
    remat.apply_config(named, {"mode": "selective", "policy": "save_matmuls"})
    assert backward_mm_count(named, idx, targets) == plain
    mlps = copy.deepcopy(model)
    remat.apply_config(mlps, {"mode": "full", "blocks": "blocks.*.mlp"})
    # each MLP recomputes its first linear (addmm) and nothing else of a block: the
    # second linear's output is saved by nobody inside the MLP, so early stop skips it
    assert backward_mm_count(mlps, idx, targets) == plain + CONFIG.n_layers



class _TupleAttention(torch.nn.Module):
    """Returns (output, weights), as transformers' attention modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.proj(x), None


class _TupleBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _TupleAttention()
        self.mlp = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp((x + self.attn(x)[0]).sin()).relu()


def test_save_modules_keeps_a_module_output_given_in_a_tuple() -> None:
    # The tag went only on a bare tensor output: a module returning a tuple
    # (every transformers attention) was silently recomputed in full.
    torch.manual_seed(0)
    model = torch.nn.Sequential(_TupleBlock(), _TupleBlock())
    reference = copy.deepcopy(model)
    assert remat.apply_config(model, {"mode": "selective", "save_modules": ["attn"]}).blocks == ("0", "1")
    x = torch.randn(4, 8, requires_grad=True)
    loss = model(x).sum()
    with OpCounter() as counter:
        loss.backward()
    # Backward runs no addmm of its own: one per block is the MLP's recomputation,
    # the attention's projection comes from the cache.
    assert counter.take()["aten.addmm.default"] == 2
    reference(x).sum().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad), name  # type: ignore[arg-type]

def test_a_bad_config_leaves_the_model_as_it_was() -> None:
    model, _, _ = gpt()
    del model.blocks[3].attn  # the last block lacks the submodule save_modules names
    with pytest.raises(CheckpointUsageError, match=r"block 'blocks\.3' has no such submodule"):
        remat.apply_config(model, {"mode": "selective", "save_modules": ["attn"]})
    for block in model.blocks:
        for module in block.modules():
            assert not module._forward_hooks and not module._forward_pre_hooks


def test_names_do_not_change_and_it_can_be_undone() -> None:
    model, _, _ = gpt()
    names = [n for n, _ in model.named_parameters()]
    handle = remat.apply_config(model, {"mode": "selective", "save_modules": ["attn"], "offload": True})
    assert [n for n, _ in model.named_parameters()] == names
    handle.remove()
    # Everything is undone: hooks (the checkpoint's and the naming ones) and forwards.
    assert [n for n, _ in model.named_parameters()] == names
    for module in model.modules():
        assert "forward" not in vars(module)
        assert not module._forward_hooks and not module._forward_pre_hooks


@pytest.mark.parametrize("mode", ["full", "selective", "none"])
def test_offload_runs_the_chosen_blocks_in_host_memory_and_keeps_gradients(mode: str) -> None:
    model, idx, targets = gpt()
    reference = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    expected = step(reference, idx, targets)
    plain_mm = backward_mm_count(reference, idx, targets)
    handle = remat.apply_config(model, {"mode": mode, "every": 2, "offload": True})
    assert handle.blocks == ("blocks.1", "blocks.3")
    # No wrapper: the blocks run their forward inside remat.offload() in place.
    routed = [i for i, block in enumerate(model.blocks) if "forward" in vars(block)]
    assert routed == [1, 3]
    assert [n for n, _ in model.named_parameters()] == names
    offloaded: list[torch.Tensor] = []
    with observe_saved_tensors(
        lambda event, t: offloaded.append(t) if event == "offloaded" else None
    ):
        got = step(model, idx, targets)
    assert offloaded  # the host copies really ran
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    recomputed = backward_mm_count(model, idx, targets) - plain_mm
    assert (recomputed > 0) == (mode == "full")  # selective keeps the matmuls


def test_toml_file_and_text(tmp_path: Path) -> None:
    text = (
        "[training.activation_checkpoint]\n"
        'mode = "selective"\nevery = 2\nsave_ops = ["aten.mm"]\n'
    )
    path = tmp_path / "train.toml"
    path.write_text(text)
    expected = CheckpointConfig(mode="selective", every=2, save_ops=("aten.mm",))
    assert remat.config_from_toml(path, section="training.activation_checkpoint") == expected
    assert remat.config_from_toml(text, section="training.activation_checkpoint") == expected
    with pytest.raises(CheckpointUsageError, match=r"no \[activation_checkpoint\] table"):
        remat.config_from_toml(text)


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        ("[activation_checkpoint]\nmode = full\n", CheckpointUsageError, "not valid TOML"),
        ("activation_checkpoint = 3\n", CheckpointTypeError, "must be a table"),
        ("missing.toml", CheckpointUsageError, "cannot read 'missing.toml'"),
        (Path("missing.toml"), CheckpointUsageError, "cannot read 'missing.toml'"),
        (b"mode = 'full'", CheckpointTypeError, "path or TOML text"),
        ("[activation_checkpoint]\nac_mode = 'full'\n", CheckpointUsageError,
         r"unknown config keys \['ac_mode'\]"),
    ],
)
def test_bad_toml(
    source: Any, error: type[Exception], match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the relative paths above name no file
    with pytest.raises(error, match=match):
        remat.config_from_toml(source)


def test_a_hugging_face_llama() -> None:
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config(vocab_size=64, num_hidden_layers=4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)

    def grads(m: Any) -> dict[str, torch.Tensor]:
        m.zero_grad()
        m(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}

    expected = grads(reference)
    # The KV cache would be filled again by a recomputation: turned off, with a warning.
    with pytest.warns(UserWarning, match="use_cache = False"):
        chosen = remat.apply_config(
            model, {"mode": "selective", "every": 2, "save_modules": ["self_attn"]}
        )
    assert model.config.use_cache is False
    assert chosen.blocks == ("model.layers.1", "model.layers.3")
    got = grads(model)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"mode": "fast"}, CheckpointUsageError, "mode must be"),
        ({"every": 0}, CheckpointUsageError, "every must be"),
        ({"every": "2"}, CheckpointUsageError, "every must be"),
        ({"mode": "full", "save_ops": ["aten.mm"]}, CheckpointUsageError, "mode='selective'"),
        ({"mode": "full", "policy": "save_nothing"}, CheckpointUsageError, "mode='selective'"),
        ({"offload": "yes"}, CheckpointTypeError, "offload must be true or false"),
        ({"mode": "selective", "policy": "save_all"}, CheckpointUsageError,
         r"policy must be one of \['save_matmuls'"),
        ({"mode": "selective", "policy": ["save_nothing"]}, CheckpointTypeError,
         "policy name"),
        ({"mode": "selective", "save_ops": "aten.mm"}, CheckpointTypeError, "list of strings"),
        ({"mode": "selective", "save_ops": ["aten.no_such_op"]}, CheckpointUsageError, "no operator"),
        ({"mode": "selective", "save_modules": ["nope"]}, CheckpointUsageError, "no such submodule"),
        ({"blocks": "decoder.*"}, CheckpointUsageError, "no module name matches"),
        ({"blocks": "re:("}, CheckpointUsageError, "not a regex"),
        ({"ac_mode": "full"}, CheckpointUsageError, r"unknown config keys \['ac_mode'\]"),
        ([("mode", "full")], CheckpointTypeError, "mapping"),
        ({"regions": {"blocks.0": "keep+weight_pass:recompute"}}, CheckpointUsageError,
         "is a checkpoint's choice"),
        ({"regions": {"blocks.0": "checkpoint+weight_pass:twice"}}, CheckpointUsageError,
         r"optionally followed by '\+weight_pass:recompute'"),
    ],
)
def test_bad_configs(config: Any, error: type[Exception], match: str) -> None:
    model, _, _ = gpt()
    with pytest.raises(error, match=match):
        remat.apply_config(model, config)


def test_a_config_compresses_what_its_blocks_keep() -> None:
    import torch

    import remat
    from remat._scope import observe_saved_tensors
    from remat.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=2, seq_len=16, d_model=64))
    idx = torch.zeros(2, 16, dtype=torch.long)
    for text, event in (
        ('[activation_checkpoint]\nmode = "selective"\ncompress = "fp8"', "policy_compressed"),
        ('[activation_checkpoint]\nmode = "none"\ncompress = "int8"', "compressed"),
    ):
        handle = remat.apply_config(model, remat.config_from_toml(text))
        events: list[str] = []
        try:
            with observe_saved_tensors(lambda e, t, seen=events: seen.append(e)):
                model(idx).sum().backward()
        finally:
            handle.remove()
        assert event in events, (text, set(events))


@pytest.mark.parametrize(
    ("values", "error", "words"),
    [
        ({"compress": "fp9"}, CheckpointUsageError, "unknown compression format 'fp9'"),
        ({"compress": 8}, CheckpointTypeError, "compress must be a format name"),
        ({"compress": "fp8", "offload": True}, CheckpointUsageError, "choose one"),
        ({"regions": {"0": "checkpoint+compress:fp0"}}, CheckpointUsageError, "unknown compression format"),
        ({"regions": {"0": "offload+compress:fp8"}}, CheckpointUsageError, "does not combine with offload"),
    ],
)
def test_bad_compression_in_a_config(values: dict[str, object], error: type, words: str) -> None:
    from remat.config import CheckpointConfig

    with pytest.raises(error, match=words):
        CheckpointConfig.from_mapping(values)
