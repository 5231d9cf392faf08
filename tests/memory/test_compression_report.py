"""remat.memory.compression_report: bytes measured as predicted, errors measured and
predicted per group, the caller's gradients and RNG left alone, clear errors
(``docs/design/compression.md``, "Gradient error")."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.memory import compression_report, render_compression_report
from remat.models import GPT, GPTConfig, lm_loss, make_batch

FORMATS_BY_ERROR = ["fp16", "bf16", "int8", "fp8", "fp8_e5m2"]  # mantissa bits, most first


def _gpt() -> tuple[torch.nn.Module, Any]:
    config = GPTConfig(n_layers=2, seq_len=32, d_model=32, n_heads=4, d_ff=64, vocab_size=64)
    torch.manual_seed(0)
    model = GPT(config)
    idx, targets = make_batch(config, 2, torch.Generator().manual_seed(0))
    return model, lambda: lm_loss(model(idx), targets)


def test_a_gpt_report_by_module_measures_what_it_predicts() -> None:
    model, loss = _gpt()
    report = compression_report(model, loss, "int8", depth=2)
    # the loss's own saved tensors (outside every submodule) form the "(model)" group
    assert [group.name for group in report.groups] == ["blocks.0", "blocks.1", "ln_f", "head", "(model)"]
    assert report.original_bytes == report.predicted_original_bytes
    assert report.stored_bytes == report.predicted_stored_bytes["int8"] < report.original_bytes / 3
    assert 0 < report.relative_error < 3e-2 and report.cosine > 0.999
    for group in report.groups:
        assert group.saved_bytes > 0 and 0 < group.relative_error < 3e-2, group
        # the sensitivity model predicts each group's measured error to within a small factor
        assert 0.25 < group.predicted_error["int8"] / group.relative_error < 4, group
        errors = [group.activation_error[name] for name in FORMATS_BY_ERROR]
        assert errors == sorted(errors), group
    assert sorted(report.safest(), key=lambda g: g.name) == sorted(report.groups, key=lambda g: g.name)
    assert "blocks.0" in render_compression_report(report)


def test_the_report_leaves_the_gradients_and_the_rng_as_they_were() -> None:
    model, loss = _gpt()
    marks = [torch.full_like(p, 7.0) for p in model.parameters()]
    for parameter, mark in zip(model.parameters(), marks, strict=True):
        parameter.grad = mark
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    compression_report(model, loss, "fp8", per_group=False)
    assert torch.equal(torch.rand(4), expected)
    assert all(p.grad is mark for p, mark in zip(model.parameters(), marks, strict=True))


def test_by_tensor_names_each_saved_tensor_and_its_module() -> None:
    model, loss = _gpt()
    report = compression_report(model, loss, "bf16", by="tensor", depth=2)
    assert len(report.groups) > 5
    assert all(group.name.startswith("#") and " in " in group.name for group in report.groups)
    assert any(group.name.endswith(" in (model)") for group in report.groups)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m, f: compression_report(f, f), CheckpointTypeError, "model must be an nn.Module"),
        (lambda m, f: compression_report(m, f, "fp4"), CheckpointUsageError, "fp4"),
        (lambda m, f: compression_report(m, f, by="layer"), CheckpointUsageError, "by must be 'module' or 'tensor'"),
        (lambda m, f: compression_report(m, lambda: m.head.weight.sum()), CheckpointUsageError, "saves no tensor"),
    ],
    ids=["not-a-module", "unknown-format", "bad-by", "nothing-saved"],
)
def test_bad_requests_say_what_was_wrong(call: Any, error: type[Exception], match: str) -> None:
    model, loss = _gpt()
    with pytest.raises(error, match=match):
        call(model, loss)
