"""Fixtures of the command-line tests."""

from __future__ import annotations

import pathlib

import pytest

from helpers import tiny_llama_config


@pytest.fixture
def tiny_llama(tmp_path: pathlib.Path) -> pathlib.Path:
    """A tiny Llama's config.json, as ``--hf-config`` reads it (named tiny_llama_config.json)."""
    config = tiny_llama_config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
        max_position_embeddings=2048,  # transformers' default
    )
    path = tmp_path / "tiny_llama_config.json"
    config.to_json_file(path)
    return path
