"""Where a saved tensor lives: the one decision (``remat.storage.choice``) and the paths that ask it."""

from __future__ import annotations

import pytest
import torch

import remat
from helpers import needs_torch_sac
from remat._scope import SAVING_REGION_INPUTS, observe_saved_tensors
from remat.compression import compression
from remat.errors import UnsupportedCheckpointError
from remat.policies import CheckpointPolicy, Compress
from remat.storage.choice import (
    DEVICE,
    HOST,
    RECOMPUTE,
    Storage,
    decide,
    storage_for,
    under_compiler,
)
from remat.storage.compressed import CompressedSizes, Compressor, compressed_bytes

FP8 = Storage.compressed(compression("fp8"))
INT8 = Storage.compressed(compression("int8"))


def test_every_policy_decision_names_one_storage() -> None:
    assert storage_for(CheckpointPolicy.MUST_SAVE) == DEVICE
    assert storage_for(CheckpointPolicy.PREFER_SAVE) == Storage("device", must=False)
    assert storage_for(CheckpointPolicy.MUST_RECOMPUTE) == RECOMPUTE
    assert not storage_for(CheckpointPolicy.PREFER_RECOMPUTE).saves
    assert storage_for(CheckpointPolicy.MUST_CPU_OFFLOAD) == HOST
    assert storage_for(CheckpointPolicy.PREFER_OFFLOAD) == Storage("host", must=False)
    assert storage_for(Compress("int8")) == INT8
    assert storage_for(Compress("fp8", must=False)) == Storage.compressed(compression("fp8"), must=False)


def test_a_policy_output_goes_where_the_policy_said_unless_the_format_cannot_shrink_it() -> None:
    # Inside the recording mode an op's output has no autograd history yet: the policy decides.
    out = torch.randn(8, 64)
    assert decide(out, FP8, "policy") == FP8
    assert decide(out, HOST, "policy") == HOST
    assert decide(torch.arange(64), FP8, "policy") == DEVICE  # integers never compress
    assert decide(torch.arange(64), HOST, "policy") == HOST
    assert decide(out.bfloat16(), Storage.compressed(compression("bf16")), "policy") == DEVICE  # as small already


def test_a_context_keeps_parameters_small_tensors_and_non_activations_as_they_are() -> None:
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)
    activation = layer(x)
    for asked in (HOST, FP8):
        assert decide(layer.weight, asked, "context") == DEVICE
        assert decide(layer.weight.t(), asked, "context") == DEVICE  # a view of a parameter
        assert decide(activation, asked, "context", min_bytes=1 << 20) == DEVICE
        assert decide(activation, asked, "context") == asked
    # Offload takes a model's input; compression only activations (autograd history).
    assert decide(x, HOST, "context") == HOST
    assert decide(x, FP8, "context") == DEVICE
    assert decide(activation.detach(), FP8, "context") == DEVICE
    # A region's inputs saved under a compress context stay exact; under offload they move.
    token = SAVING_REGION_INPUTS.set(True)
    try:
        assert decide(activation, FP8, "context") == DEVICE
        assert decide(activation, HOST, "context") == HOST
    finally:
        SAVING_REGION_INPUTS.reset(token)
    # A region's own compress_inputs: its activation inputs are compressed.
    assert decide(activation, FP8, "region_input") == FP8
    assert decide(x, FP8, "region_input") == DEVICE
    # Keeping and recomputing are what they are, for every origin.
    for origin in ("policy", "context", "region_input", "graph"):
        assert decide(activation, DEVICE, origin) == DEVICE  # type: ignore[arg-type]
        assert decide(activation, RECOMPUTE, origin) == RECOMPUTE  # type: ignore[arg-type]


def test_under_a_compiler_only_a_compression_that_must_happen_is_refused() -> None:
    assert under_compiler(HOST, "api", "x") == DEVICE
    assert under_compiler(Storage("host", must=False), "api", "x") == Storage("device", must=False)
    assert under_compiler(Storage.compressed(compression("fp8"), must=False), "api", "x") == Storage("device", must=False)
    assert under_compiler(RECOMPUTE, "api", "x") == RECOMPUTE
    with pytest.raises(UnsupportedCheckpointError, match=r"api under torch.compile: who asked keeps .* \(int8\)"):
        under_compiler(INT8, "api", "who asked")


def _plain_grads(fn: object, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    fn(x).sum().backward()  # type: ignore[operator]
    assert x.grad is not None
    return x.grad


MM = torch.ops.aten.mm.default


def _compress_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    return Compress("int8") if op is MM else CheckpointPolicy.PREFER_RECOMPUTE


def _may_compress_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    return Compress("int8", must=False) if op is MM else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.compile
@pytest.mark.parametrize("way", [pytest.param("policy", marks=needs_torch_sac), "compress_inputs", "context"])
def test_every_way_of_asking_for_compression_in_compiled_code_gets_one_error(way: str) -> None:
    w = torch.randn(16, 16)

    def block(t: torch.Tensor) -> torch.Tensor:
        return (t @ w).sigmoid() @ w

    def region(t: torch.Tensor) -> torch.Tensor:
        if way == "policy":
            return remat.checkpoint(block, t, policy=_compress_matmuls)
        if way == "compress_inputs":
            return remat.checkpoint(block, t * 2, compress_inputs="int8")
        with remat.compress("int8"):
            return block(t)

    compiled = torch.compile(region, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"Put remat\.compress around the compiled call") as caught:
        compiled(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert isinstance(caught.value, UnsupportedCheckpointError) or "UnsupportedCheckpointError" in str(caught.value)


@pytest.mark.compile
@needs_torch_sac
def test_a_compression_a_compiler_may_override_is_kept_under_compile() -> None:
    """``Compress(..., must=False)``: the compiler keeps the value (exact), as for PREFER_SAVE."""
    w = torch.randn(16, 16)

    def block(t: torch.Tensor) -> torch.Tensor:
        return (t @ w).sigmoid() @ w

    compiled = torch.compile(lambda t: remat.checkpoint(block, t, policy=_may_compress_matmuls), backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 16)
    assert torch.allclose(_plain_grads(compiled, x), _plain_grads(block, x))


def test_old_import_paths_name_the_same_objects() -> None:
    import sys

    import remat.storage

    old = sys.modules["remat.offload"]  # the package; ``remat.offload`` itself is the context
    for name in old.__all__:
        assert getattr(old, name) is getattr(remat.storage, name), name
    assert remat.offload is remat.storage.offload


def test_compressed_region_inputs_are_reported_like_offloaded_ones() -> None:
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    events: list[str] = []
    with observe_saved_tensors(lambda event, tensor: events.append(event)):
        remat.checkpoint(layer, x * 2, compress_inputs="fp8").sum().backward()
    assert events.count("compressed") == 1  # the activation input; the parameters stay exact


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, 64),
        lambda: torch.randn(6, 64)[1:],  # most of the storage: the whole storage is kept
        lambda: torch.randn(64, 64)[:3],  # a small span of it: only the span
        lambda: torch.randn(64, 6).t(),  # not contiguous
        lambda: torch.randn(5, 7)[:, :3],  # rows that do not divide the block
        lambda: torch.randn(48, dtype=torch.float64),
        lambda: torch.randn(4, 4, 32).bfloat16(),
    ],
)
@pytest.mark.parametrize("format", ["bf16", "fp16", "fp8", "int8", "fp8_e5m2"])
def test_one_byte_rule_for_the_stash_the_report_and_the_payload(make: object, format: str) -> None:
    chosen = compression(format)
    tensor = make()  # type: ignore[operator]
    original, stored = compressed_bytes(tensor, chosen)
    if not chosen.applies_to(tensor.dtype):  # decide() never hands it to a compressor
        assert stored == original
        return
    compressor, sizes = Compressor(chosen), CompressedSizes(chosen)
    copy = compressor.store(tensor)
    sizes.store(tensor)
    assert (compressor.original_bytes, compressor.stored_bytes) == (original, stored)
    assert (sizes.original_bytes, sizes.stored_bytes) == (original, stored)
    block = copy.block
    payload = block.payload.numel() * block.payload.element_size()  # type: ignore[attr-defined]
    scales = 0 if block.scales is None else block.scales.numel() * block.scales.element_size()  # type: ignore[attr-defined]
    assert payload + scales == stored  # the rule prices what is really kept
