"""Every public surface, name by name: what users call, nothing more.

A change to one of these lists is a change of the API: deliberate, with a
CHANGELOG line. The top level is split in ``docs/api.md`` into the names
that mirror torch and remat's own; the two lists there must cover it exactly.
The command line's package exports ``main`` only (``tests/cli/test_main.py``).
"""

from __future__ import annotations

import importlib
import re

import pytest

import remat
from helpers import REPO

SURFACES = {
    "remat.memory": [
        "AllocationMeter", "StepBytes", "measure_training_step", "track_allocations",
        "CompressedGroup", "CompressionReport", "compression_report", "render_compression_report",
        "CATEGORIES", "Category", "FATES", "FORWARD_END", "Fate", "MemoryReport", "MemoryTracker",
        "OUTSIDE_MODULES", "Phase", "SavedTensor", "SavedTensorReport", "Sharding", "StorageLifetime",
        "Timeline", "TimelineEvent",
        "Usage", "estimate_sharded_step", "format_bytes", "plot_saved_by_module", "plot_timeline",
        "render_memory_report", "render_saved_tensors", "saved_tensors", "shard_model",
        "tensor_parallel_plan", "track", "track_training_step",
        "BufferPlan", "StaticCompilation", "statically_compiled", "simulated_rank",
        "PIPELINE_SCHEDULES", "Pipeline", "StagedModel", "estimate_pipeline_step", "measure_pipeline_step",
        "measure_this_rank", "RankAllocations",
    ],
    "remat.placement": ["BlockSetting", "CompileSpec", "Placement", "install", "place"],
    "remat.nn": [
        "ActivationWrapper", "CheckpointImpl", "CheckpointWrapper", "EveryNth", "OffloadWrapper",
        "WrapPolicy", "apply_activation_checkpointing", "checkpoint_wrapper", "every_nth",
        "offload_wrapper",
    ],
    "remat.composable": ["checkpoint_module", "remove_checkpoint_module"],
    "remat.policies": [
        "MATMUL_OPS", "UNBATCHED_MATMUL_OPS", "CheckpointPolicy", "Compress", "Decision", "Policy",
        "SelectiveCheckpointContext", "compress_names", "compressed", "first_of", "offload_names", "save_all_but_names", "save_any_of", "save_matmuls",
        "save_matmuls_without_batch_dims", "save_nothing", "save_only_names", "save_ops",
    ],
    "remat.config": ["CheckpointConfig", "apply_config", "config_from_toml", "region_setting"],
    "remat.losses": ["TokenLoss", "chunked_head_loss", "chunked_loss"],
    "remat.names": ["name", "tensor_name"],
    "remat.compression": ["FORMATS", "Compression", "FormatName", "Scale", "compression"],
    "remat.offload": ["HostCopy", "HostTransfer", "compress", "compressible", "exact", "no_offload", "offload"],
    "remat.storage": [
        "DEVICE", "HOST", "RECOMPUTE", "HostCopy", "HostTransfer", "Storage", "compress", "compressible",
        "decide", "exact", "no_offload", "offload", "storing",
    ],
    "remat.errors": [
        "CheckpointError", "CheckpointKeyError", "CheckpointStateError", "CheckpointTypeError",
        "CheckpointUsageError", "DeviceStateError",
        "FrontierTooLargeError", "InfeasibleBudgetError", "ModelLoadError", "PolicyError", "RankError", "RecomputeMismatchError", "RematError",
        "UnsupportedCheckpointError", "WorkerError",
    ],
}


@pytest.mark.parametrize("module", list(SURFACES))
def test_surface(module: str) -> None:
    loaded = importlib.import_module(module)
    assert sorted(loaded.__all__) == sorted(SURFACES[module])
    for name in loaded.__all__:
        assert hasattr(loaded, name), name


def _listed(section: str, text: str) -> set[str]:
    """The names in backticks of one marked list (module paths have dots: not names)."""
    block = text.split(section, 1)[1].split("<!-- end -->", 1)[0]
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", block))


def test_the_docs_say_which_top_level_names_mirror_torch() -> None:
    text = (REPO / "docs" / "api.md").read_text()
    torch_names = _listed("<!-- torch-compatible names", text)
    own = _listed("<!-- remat's own names -->", text)
    assert not torch_names & own, torch_names & own
    assert torch_names | own == set(remat.__all__), (torch_names | own) ^ set(remat.__all__)
