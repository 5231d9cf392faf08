"""Where a saved tensor lives: the one decision (``remat.storage.choice``) and the paths that ask it."""

from __future__ import annotations

import gc

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
    assert storage_for(Compress("fp8", must=False)) == Storage.compressed(
        compression("fp8"), must=False
    )


def test_a_policy_output_goes_where_the_policy_said_unless_the_format_cannot_shrink_it() -> None:
    # Inside the recording mode an op's output has no autograd history yet: the policy decides.
    out = torch.randn(8, 64)
    assert decide(out, FP8, "policy") == FP8
    assert decide(out, HOST, "policy") == HOST
    assert decide(torch.arange(64), FP8, "policy") == DEVICE  # integers never compress
    assert decide(torch.arange(64), HOST, "policy") == HOST
    assert (
        decide(out.bfloat16(), Storage.compressed(compression("bf16")), "policy") == DEVICE
    )  # as small already


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
    assert under_compiler(
        Storage.compressed(compression("fp8"), must=False), "api", "x"
    ) == Storage("device", must=False)
    assert under_compiler(RECOMPUTE, "api", "x") == RECOMPUTE
    with pytest.raises(
        UnsupportedCheckpointError, match=r"api under torch.compile: who asked keeps .* \(int8\)"
    ):
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


def _raises_refused(t: torch.Tensor) -> torch.Tensor:
    raise UnsupportedCheckpointError(
        "-".join(["the", "message", str(t.dim())])
    )  # (not the source line)


def _dynamo_shows_user_errors() -> bool:
    """Whether Dynamo, under fullgraph=True, passes on the message of an error user code raises.

    Dynamo 2.4 cannot build an exception of a user class; 2.7 reports "Observed
    exception" and the raising line without the message; 2.11 and newer pass it on.
    """
    try:
        torch.compile(_raises_refused, backend="eager", fullgraph=True)(torch.randn(2))
    except Exception as error:
        return "the-message-1" in str(error)
    return False


@pytest.mark.compile
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks"])
@pytest.mark.parametrize(
    "way", [pytest.param("policy", marks=needs_torch_sac), "compress_inputs", "context"]
)
def test_every_way_of_asking_for_compression_in_compiled_code_gets_one_error(
    way: str, fullgraph: bool
) -> None:
    """Never a silent drop: remat's refusal, or (where Dynamo breaks the graph) the region runs eagerly, compressed."""
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

    compiled = torch.compile(region, backend="aot_eager", fullgraph=fullgraph)
    x = torch.randn(4, 16)
    try:
        grads = _plain_grads(compiled, x)
    except Exception as error:
        message = str(error)
        if fullgraph and way != "policy" and not _dynamo_shows_user_errors():
            # Dynamo names where tracing stopped: remat's refusal, or (2.4) the remat.compress line.
            assert "remat" in message, message
            return
        assert "Put remat.compress around the compiled call" in message or (
            # a remat.compress block left open across a graph break, before torch 2.11
            way == "context" and not fullgraph and "needs torch 2.11 or newer" in message
        ), message
        assert (
            isinstance(error, UnsupportedCheckpointError) or "UnsupportedCheckpointError" in message
        )
        return
    assert not fullgraph, "compiled with fullgraph=True, the compression was dropped"
    if way == "compress_inputs":
        assert torch.equal(
            grads, _plain_grads(region, x)
        )  # Dynamo gave the region back to eager remat
        return
    # torch 2.11+: the compress block stays open around the graph after the break, which
    # compresses that graph's saved intermediates (not the same tensors as eagerly).
    exact = _plain_grads(block, x)
    error = float((grads - exact).norm() / exact.norm())
    assert 0 < error < 0.05, error  # compressed (int8: about 1e-2 here), not dropped


@pytest.mark.compile
@needs_torch_sac
def test_a_compression_a_compiler_may_override_is_kept_under_compile() -> None:
    """``Compress(..., must=False)``: the compiler keeps the value (exact), as for PREFER_SAVE."""
    w = torch.randn(16, 16)

    def block(t: torch.Tensor) -> torch.Tensor:
        return (t @ w).sigmoid() @ w

    compiled = torch.compile(
        lambda t: remat.checkpoint(block, t, policy=_may_compress_matmuls),
        backend="aot_eager",
        fullgraph=True,
    )
    x = torch.randn(4, 16)
    assert torch.allclose(_plain_grads(compiled, x), _plain_grads(block, x))


@pytest.mark.compile
@needs_torch_sac
def test_a_refusal_kept_alive_leaves_the_next_compilation_working() -> None:
    """The refusal is raised once the policy's mode has left the stack (torch 2.7-2.11 kept
    its checkpoint generator suspended otherwise, and collecting it later popped the next
    compilation's FakeTensorMode)."""
    w = torch.randn(16, 16)

    def block(t: torch.Tensor) -> torch.Tensor:
        return (t @ w).sigmoid() @ w

    refused = torch.compile(
        lambda t: remat.checkpoint(block, t, policy=_compress_matmuls), backend="aot_eager"
    )
    with pytest.raises(
        Exception, match="keeps saved tensors compressed"
    ) as kept:  # its traceback lives on
        _plain_grads(refused, torch.randn(4, 16))
    kept_alive = kept.value
    gc.disable()  # a collection now must find nothing to finish
    try:
        compiled = torch.compile(
            lambda t: remat.checkpoint(block, t, policy=_may_compress_matmuls), backend="aot_eager"
        )
        x = torch.randn(4, 16)
        assert torch.allclose(_plain_grads(compiled, x), _plain_grads(block, x))
        del kept_alive, kept
        gc.collect()
        assert torch.allclose(_plain_grads(compiled, x), _plain_grads(block, x))
    finally:
        gc.enable()


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
