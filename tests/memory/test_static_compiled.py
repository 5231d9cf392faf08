"""``remat.memory.statically_compiled``: compiled blocks tracked without running a kernel.

The oracle is the allocator's count of the same step compiled for real
(:func:`remat.memory.measure_training_step`). What the compiler saves comes
from its own partitioner, so the end of the forward must match; the peak
carries the model of inductor's buffers (``docs/design/compile.md``,
"Static estimates") and is held to the tolerance measured there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from remat import policies
from remat._compat.fake import fake_tensor_mode
from remat._compat.partitioner import partitioner_settings, region_memory_budgets_available
from remat._compat.versions import static_compile_supported
from remat.errors import CheckpointUsageError, UnsupportedCheckpointError
from remat.memory import (
    BufferPlan,
    MemoryReport,
    StepBytes,
    measure_training_step,
    statically_compiled,
    track,
    track_training_step,
)
from remat.memory._buffer_plan import inductor_buffer_timeline
from remat.models import GPT, GPTConfig, lm_loss, make_batch
from remat.placement import BlockSetting, CompileSpec, place

pytestmark = [pytest.mark.compile, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
needs_static = pytest.mark.skipif(not static_compile_supported(), reason="static compiled estimates need torch 2.11+")

CONFIG = GPTConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=256, seq_len=64)
SETTINGS = {
    "keep": BlockSetting(checkpoint=False),
    "checkpoint": BlockSetting(),
    "save matmuls": BlockSetting(policy=policies.save_matmuls),
}


def _compiled_gpt(setting: BlockSetting, fake: bool) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    idx, targets = make_batch(CONFIG, 4, torch.Generator().manual_seed(0))
    mode = fake_tensor_mode() if fake else contextlib.nullcontext()
    with mode:  # fake: the parameters are made fake, nothing is allocated
        model = GPT(CONFIG)
    if fake:
        idx, targets = mode.from_tensor(idx), mode.from_tensor(targets)
    spec = dataclasses.replace(setting, compile=CompileSpec())
    place(model, {f"blocks.{i}": spec for i in range(CONFIG.n_layers)})
    return model, lambda: lm_loss(model(idx), targets)


def _static(setting: BlockSetting) -> MemoryReport:
    model, loss = _compiled_gpt(setting, fake=True)
    with statically_compiled(model):
        return track_training_step(model, loss)


def _measured(setting: BlockSetting) -> StepBytes:
    model, loss = _compiled_gpt(setting, fake=False)
    try:
        return measure_training_step(model, loss)
    finally:
        torch.compiler.reset()


@needs_static
@pytest.mark.parametrize(
    "name",
    # One real compile per option: only "keep" runs on every torch release (the matrix
    # skips slow tests), the others on the main release.
    [name if name == "keep" else pytest.param(name, marks=pytest.mark.slow) for name in SETTINGS],
)
def test_static_step_matches_the_measured_compiled_step(name: str) -> None:
    static, measured = _static(SETTINGS[name]), _measured(SETTINGS[name])
    # What the forward leaves for backward is the partitioner's choice, taken as is.
    assert static.forward_end_bytes == measured.forward_end_bytes
    assert abs(static.peak_bytes / measured.peak_bytes - 1) < 0.03


@needs_static
def test_an_earlier_compile_at_other_shapes_changes_no_estimate() -> None:
    """Dynamo's automatic dynamic shapes remember the shapes a function was compiled for
    in this process: the static compile specializes shapes, so every graph is still
    memory-planned by inductor (no warning) and the estimate is the same."""
    before = _static(SETTINGS["keep"])
    # Two compiles of the blocks' code at other shapes (Dynamo's state, whatever the backend).
    eager_backend = CompileSpec(backend="aot_eager")
    for seq in (32, 48):
        config = dataclasses.replace(CONFIG, seq_len=seq)
        model = GPT(config)
        place(model, {f"blocks.{i}": BlockSetting(checkpoint=False, compile=eager_backend) for i in range(2)})
        idx, targets = make_batch(config, 4, torch.Generator().manual_seed(0))
        lm_loss(model(idx), targets).backward()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not plan the buffers")
        after = _static(SETTINGS["keep"])
    torch.compiler.reset()
    assert (after.peak_bytes, after.forward_end_bytes) == (before.peak_bytes, before.forward_end_bytes)


class _GatedBlock(nn.Module):
    """Llama's MLP half (RMS norm, SwiGLU, residual): its recomputed backward is where
    inductor's fusion and ordering matter most (a model of its buffers missed 10-16%)."""

    def __init__(self, width: int = 64, hidden: int = 172) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(width))
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


GATED = {  # BlockSetting's arguments (a budget is refused below torch 2.13 when made)
    "checkpoint": {},
    # Part saved, part recomputed: the backward frees saved tensors before its peak.
    "budget 0.5": pytest.param(
        {"checkpoint": False, "memory_budget": 0.5},
        marks=pytest.mark.skipif(not region_memory_budgets_available(), reason="region budgets need torch 2.13+"),
    ),
}


def _compiled_gated(setting: BlockSetting, fake: bool) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(4, 64, 64)
    mode = fake_tensor_mode() if fake else contextlib.nullcontext()
    with mode:
        model = nn.Sequential(_GatedBlock(), _GatedBlock())
    if fake:
        x = mode.from_tensor(x)
    place(model, {name: dataclasses.replace(setting, compile=CompileSpec()) for name in ("0", "1")})
    return model, lambda: model(x).square().mean()


@needs_static
@pytest.mark.parametrize("arguments", list(GATED.values()), ids=list(GATED))
def test_a_recomputed_gated_mlp_follows_inductors_own_buffer_plan(arguments: dict[str, Any]) -> None:
    setting = BlockSetting(**arguments)
    model, loss = _compiled_gated(setting, fake=False)
    try:  # measured first: the compile caches now hold these graphs' real code
        measured = measure_training_step(model, loss)
    finally:
        torch.compiler.reset()
    model, loss = _compiled_gated(setting, fake=True)
    with statically_compiled(model) as compilation:
        static = track_training_step(model, loss)
    # Every graph's buffers come from inductor's scheduler and memory plan (not a model
    # of them, and not a cached real compile's code).
    assert compilation.modelled == 0
    assert all(plan.timeline is not None for plan in compilation.plans)
    assert static.forward_end_bytes == measured.forward_end_bytes
    assert abs(static.peak_bytes / measured.peak_bytes - 1) < 0.005


@needs_static
def test_checkpointing_is_seen_in_the_static_step() -> None:
    keep, checkpoint = _static(SETTINGS["keep"]), _static(SETTINGS["checkpoint"])
    assert checkpoint.forward_end_bytes < keep.forward_end_bytes


@needs_static
def test_the_compiled_blocks_are_named_in_the_report() -> None:
    model, loss = _compiled_gpt(SETTINGS["keep"], fake=True)
    with statically_compiled(model) as compilation, track(model) as tracker:
        loss().backward()
    assert compilation.blocks == ("blocks.0", "blocks.1")
    allocated = {usage.name: usage.allocated_bytes for usage in tracker.report().by_module}
    assert allocated["blocks.0"] > 0 and allocated["blocks.1"] > 0  # their graphs' buffers


@needs_static
def test_the_models_compiled_calls_are_restored() -> None:
    model, loss = _compiled_gpt(SETTINGS["checkpoint"], fake=False)
    before = [vars(block)["_compiled_call_impl"] for block in model.blocks]
    with statically_compiled(model):
        loss().backward()
    assert [vars(block)["_compiled_call_impl"] for block in model.blocks] == before


@needs_static
def test_a_block_compiled_for_real_before_is_compiled_statically_again() -> None:
    # The compile caches hold the real step's kernels under the same graph: served
    # from them, the static block would run real code (found planning on real tensors).
    model, loss = _compiled_gpt(SETTINGS["keep"], fake=False)
    loss().backward()  # compiled for real: the caches now hold these graphs
    torch.compiler.reset()  # only the in-memory versions go; the disk caches stay
    with statically_compiled(model) as compilation, track() as tracker:
        loss().backward()
    assert compilation.runs() == 2 * CONFIG.n_layers
    assert tracker.peak_bytes > 0


@needs_static
def test_process_wide_partitioner_settings_do_not_reach_the_static_graphs() -> None:
    default = _static(SETTINGS["keep"])
    with partitioner_settings({"activation_memory_budget": 0.5}):
        under_setting = _static(SETTINGS["keep"])
    assert under_setting.forward_end_bytes == default.forward_end_bytes
    assert under_setting.peak_bytes == default.peak_bytes


@needs_static
def test_a_model_with_nothing_compiled_is_refused() -> None:
    with pytest.raises(CheckpointUsageError, match="has no compiled module"), statically_compiled(nn.Linear(4, 4)):
        pass


@torch.compiler.disable
def _run_eagerly(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


class _Opaque(nn.Module):
    """A block whose whole forward torch.compile leaves to eager code."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run_eagerly(self.linear, x)


@needs_static
def test_a_block_the_compiler_runs_eagerly_is_refused() -> None:
    model = nn.Sequential(_Opaque())
    place(model, {"0": BlockSetting(checkpoint=False, compile=CompileSpec(fullgraph=False))})
    with pytest.raises(UnsupportedCheckpointError, match="ran without its compiled graph"), statically_compiled(model):
        model(torch.randn(2, 8)).sum().backward()


@pytest.mark.skipif(static_compile_supported(), reason="torch 2.11+ estimates statically")
def test_an_old_torch_is_refused_clearly() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    place(model, {"0": BlockSetting(checkpoint=False, compile=CompileSpec())})
    with pytest.raises(UnsupportedCheckpointError, match=r"needs torch 2\.11"), statically_compiled(model):
        pass


@needs_static
@pytest.mark.parametrize("follow_inductor", [True, False], ids=["inductor's plan", "modelled"])
def test_a_graph_lets_go_of_a_handed_over_input_after_its_last_reader(follow_inductor: bool) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return ((b * a.sum()) @ b,)  # ``a`` is read once, first; a tuple, as AOTAutograd's graphs

    side = 256 * 256 * 4  # bytes of one 256 x 256 float32 tensor
    graph = make_fx(step, tracing_mode="fake")(torch.ones(256, 256), torch.ones(256, 256))
    timeline = inductor_buffer_timeline(graph, [torch.ones(256, 256)] * 2) if follow_inductor else None
    plan = BufferPlan(graph, timeline)
    with track() as tracker:
        handed_over = [torch.ones(256, 256), torch.ones(256, 256)]
        out = plan(handed_over)  # the caller keeps no reference, as AOTAutograd's backward
    assert out[0].shape == (256, 256) and not handed_over
    # b, b * sum(a) and the product: ``a`` is gone by then (with it, 4 tensors).
    assert 3 * side <= tracker.peak_bytes < 3 * side + 1024
