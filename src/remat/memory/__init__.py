"""See the memory a training step uses.

* :func:`track` counts the bytes of tensor storages live inside a ``with``
  block (forward and backward), their peak and named marks; its
  :meth:`~MemoryTracker.report` is a :class:`MemoryReport` (timeline with
  phases and module markers, bytes by module and by category).
* :func:`track_allocations` counts what the allocator hands out instead:
  code made by torch.compile too (inductor's buffers never pass a dispatch
  mode);
* :func:`saved_tensors` lists what a forward keeps for backward and the fate
  of each tensor (kept, dropped by a checkpoint, saved or offloaded by a
  policy, offloaded).
* :func:`track_training_step` tracks a steady-state training step (forward,
  backward, optimizer) of any model, meant for meta tensors: the memory of a
  7B model's step, on a laptop; :func:`measure_training_step` measures one
  for real with the allocator's count (compiled models);
* :func:`estimate_sharded_step` estimates one rank's step of sharded
  training (FSDP2, tensor parallel), any number of ranks, in one process;
* :func:`estimate_pipeline_step` estimates every rank's steps of pipelined
  training (:class:`Pipeline`: any schedule of ``torch.distributed.pipelining``)
  in one process, and :func:`measure_pipeline_step` measures them on processes;
* :func:`statically_compiled` compiles a model's compiled blocks as
  inductor decides at trace time and shows a tracker the buffers it would
  allocate: a compiled step of any size, tracked on fake tensors;
* :func:`compression_report` measures what compressing a step's saved
  tensors does to its gradients, group by group, and ranks what is safe to
  compress.

Data only: ``render_*`` functions format text, ``plot_*`` functions draw
(``pip install remat[plot]``). Definitions: ``docs/design/memory.md``.

Modules, in reading order:

* ``_tracker``: :class:`MemoryTracker` and :func:`track`, live bytes per storage;
* ``_report``: what it measured, as plain data (:class:`MemoryReport`,
  :class:`Usage`, :class:`Timeline`, the categories and phases);
* ``_allocations``: :class:`AllocationMeter` and :func:`track_allocations`,
  the allocator's count (compiled code included), in the tracker's timeline shape;
* ``_saved``: :func:`saved_tensors`, what a forward keeps and each tensor's fate;
* ``_estimate``: :func:`track_training_step`, one steady-state step of any
  model, and :func:`measure_training_step`, one measured by the allocator;
* ``_sharded``: :class:`Sharding`, :func:`shard_model`,
  :func:`simulated_rank` and :func:`estimate_sharded_step`, one rank of
  sharded training;
* ``_pipeline``: :class:`Pipeline`, :class:`StagedModel`,
  :func:`estimate_pipeline_step` and :func:`measure_pipeline_step`, every
  rank of pipelined training;
* ``_compiled``: :func:`statically_compiled`, :class:`BufferPlan` (the model
  of inductor's buffers), compiled steps without kernels;
* ``_buffer_plan``: inductor's own buffer plan for one compiled graph, read
  as the allocations and frees its code makes (what a :class:`BufferPlan`
  replays where inductor can plan the graph);
* ``_compression``: :func:`compression_report`, the gradient error of
  compressed saved tensors, measured and predicted;
* ``_render``: the text tables (``render_*``, :func:`format_bytes`);
* ``_plot``: the figures (``plot_*``).

Example:
    >>> import torch
    >>> from remat.memory import track
    >>> with track() as t:
    ...     x = torch.zeros(256, 256)            # float32: 262144 bytes
    ...     t.mark("forward_end")
    >>> t.marks["forward_end"], t.peak_bytes
    (262144, 262144)
"""

from remat.memory._allocations import AllocationMeter, track_allocations
from remat.memory._compiled import BufferPlan, StaticCompilation, statically_compiled
from remat.memory._compression import CompressedGroup, CompressionReport, compression_report
from remat.memory._estimate import StepBytes, measure_training_step, track_training_step
from remat.memory._pipeline import (
    PIPELINE_SCHEDULES,
    Pipeline,
    RankAllocations,
    StagedModel,
    estimate_pipeline_step,
    measure_pipeline_step,
    measure_this_rank,
)
from remat.memory._plot import plot_saved_by_module, plot_timeline
from remat.memory._render import (
    format_bytes,
    render_compression_report,
    render_memory_report,
    render_saved_tensors,
)
from remat.memory._report import (
    CATEGORIES,
    OUTSIDE_MODULES,
    Category,
    MemoryReport,
    Phase,
    StorageLifetime,
    Timeline,
    TimelineEvent,
    Usage,
)
from remat.memory._saved import FATES, Fate, SavedTensor, SavedTensorReport, saved_tensors
from remat.memory._sharded import (
    Sharding,
    estimate_sharded_step,
    shard_model,
    simulated_rank,
    tensor_parallel_plan,
)
from remat.memory._tracker import FORWARD_END, MemoryTracker, track

__all__ = [
    "AllocationMeter",
    "BufferPlan",
    "CATEGORIES",
    "Category",
    "CompressedGroup",
    "CompressionReport",
    "FATES",
    "FORWARD_END",
    "Fate",
    "MemoryReport",
    "MemoryTracker",
    "OUTSIDE_MODULES",
    "PIPELINE_SCHEDULES",
    "Phase",
    "Pipeline",
    "SavedTensor",
    "RankAllocations",
    "SavedTensorReport",
    "Sharding",
    "StagedModel",
    "StaticCompilation",
    "StepBytes",
    "StorageLifetime",
    "Timeline",
    "TimelineEvent",
    "Usage",
    "compression_report",
    "estimate_pipeline_step",
    "estimate_sharded_step",
    "format_bytes",
    "measure_pipeline_step",
    "measure_this_rank",
    "measure_training_step",
    "plot_saved_by_module",
    "plot_timeline",
    "render_compression_report",
    "render_memory_report",
    "render_saved_tensors",
    "saved_tensors",
    "shard_model",
    "simulated_rank",
    "statically_compiled",
    "tensor_parallel_plan",
    "track",
    "track_allocations",
    "track_training_step",
]
