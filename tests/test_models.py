"""remat.models: the embedded GPT's parameter count, and its presets named by that count and
built on meta tensors."""

from __future__ import annotations

import re

from remat.models import GPT, PRESETS, GPTConfig, meta_model


def test_gpt_parameter_count_is_the_built_model_count() -> None:
    for config in (GPTConfig(), GPTConfig(n_layers=3, d_model=64, n_heads=4, d_ff=100, vocab_size=77, seq_len=9)):
        assert config.parameter_count() == sum(p.numel() for p in GPT(config).parameters())


def test_every_preset_is_named_by_its_parameter_count() -> None:
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


def test_meta_model_allocates_nothing_and_has_the_preset_shape() -> None:
    model = meta_model(PRESETS["7b"])
    assert all(p.device.type == "meta" for p in model.parameters())
    # 32 blocks of 4*4096^2 + 2*4096*16384 weights (+ biases, norms), embeddings, head:
    # a true 7B, as its name says (a preset named 7b once had 5.31B parameters).
    params = sum(p.numel() for p in model.parameters())
    assert 6.6e9 < params < 6.8e9
    assert [name for name, _ in model.blocks[0].attn.named_children()] == ["qkv", "proj"]
