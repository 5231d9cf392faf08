"""Training split over ranks: how a model is sharded, and a step's memory on one rank.

Layer: ``remat.memory`` (the tracker's package); imports ``remat._blocks``,
``remat._compat`` and ``remat.errors``, and ``torch.distributed`` lazily.

* :class:`Sharding` says how the model is split: FSDP2 over the data-parallel
  ranks (``fully_shard`` on every block, then the root; optional mixed
  precision and ``reshard_after_forward``), tensor parallelism over ``tp``
  ranks (column- then row-wise linears), or both on a 2-D mesh.
* :func:`shard_model` applies it to a model, in torchtitan's order: tensor
  parallelism first, then FSDP2. Checkpoint the blocks before calling it.
* :func:`simulated_rank` runs a block of code as one rank of any number,
  on fake tensors, in a simulated process group;
* :func:`estimate_sharded_step` tracks one training step of rank 0 in this
  process, for any number of ranks: the ranks are simulated (a process
  group whose collectives move nothing) and the tensors are fake (shapes
  and sizes, no data), so a 64-rank estimate costs what a 2-rank one does.
  The same FSDP2 and tensor-parallel code runs as in training, which is why
  the estimate equals a real run's per-rank bytes (``docs/design/memory.md``,
  "Sharded training").

Example:
    >>> import torch
    >>> from remat.memory import Sharding, estimate_sharded_step
    >>> def build():
    ...     model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    ...     x = torch.zeros(8, 256)
    ...     return model, lambda: model(x).square().mean()
    >>> report = estimate_sharded_step(build, sharding=Sharding(world_size=4, fsdp=True))
    >>> report.world_size, report.category("parameter").at_peak_bytes   # a quarter of 4 x 257 KiB
    (4, 263168)
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor, nn

from remat._blocks import require_blocks
from remat._compat.dispatch import answering_ops
from remat._compat.distributed import (
    collectives_run_on_fake_tensors,
    distributed_rank,
    sharding_api_available,
    simulated_process_group,
    waits_return_their_input,
)
from remat._compat.fake import fake_tensor_mode
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError
from remat.memory._report import MemoryReport

__all__ = [
    "MIXED_PRECISIONS",
    "TP_STYLES",
    "Sharding",
    "estimate_sharded_step",
    "shard_model",
    "simulated_rank",
    "tensor_parallel_plan",
]

MixedPrecision = Literal["bf16", "fp16"]
MIXED_PRECISIONS: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``Sharding.mixed_precision`` names: FSDP2 computes in this dtype and reduces gradients in float32."""

TpStyle = Literal["colwise", "rowwise"]
TP_STYLES: tuple[TpStyle, ...] = ("colwise", "rowwise")
"""Tensor-parallel styles a plan may name: ``torch.distributed.tensor.parallel``'s
``ColwiseParallel`` (output features split) and ``RowwiseParallel`` (input
features split, outputs summed)."""

OptimizerName = Literal["adamw", "sgd", "none"]


@dataclass(frozen=True)
class Sharding:
    """How a training step is split over ranks.

    Attributes:
        world_size: number of ranks.
        fsdp: FSDP2: ``fully_shard`` every block, then the root, over the
            ``world_size // tp`` data-parallel ranks.
        tp: tensor-parallel degree (divides ``world_size``); ``1``: none.
        mixed_precision: with ``fsdp``, compute in ``"bf16"`` or ``"fp16"``
            (``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)``).
        reshard_after_forward: with ``fsdp``, free each block's gathered
            parameters after its forward (gather again in backward); False
            keeps them until backward.

    Example:
        >>> Sharding(world_size=8, fsdp=True, tp=2).data_parallel
        4
    """

    world_size: int = 1
    fsdp: bool = False
    tp: int = 1
    mixed_precision: MixedPrecision | None = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        for name in ("world_size", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointUsageError(
                    f"remat.memory.Sharding: {name} must be an int >= 1, got {value!r}."
                )
        if self.world_size % self.tp:
            raise CheckpointUsageError(
                f"remat.memory.Sharding: tp={self.tp} must divide world_size={self.world_size} "
                "(the ranks form a data-parallel x tensor-parallel grid)."
            )
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISIONS:
            raise CheckpointUsageError(
                f"remat.memory.Sharding: mixed_precision must be one of {list(MIXED_PRECISIONS)} "
                f"or None, got {self.mixed_precision!r}."
            )
        if self.mixed_precision is not None and not self.fsdp:
            raise CheckpointUsageError(
                "remat.memory.Sharding: mixed_precision is FSDP2's MixedPrecisionPolicy; pass "
                "fsdp=True with it."
            )
        if self.data_parallel > 1 and not self.fsdp:
            raise CheckpointUsageError(
                f"remat.memory.Sharding: {self.data_parallel} data-parallel ranks without fsdp "
                "would each hold a full replica (DDP), whose memory is the single-process "
                "step's: estimate with world_size=tp, or pass fsdp=True."
            )

    @property
    def data_parallel(self) -> int:
        """Ranks that hold different data (``world_size // tp``)."""
        return self.world_size // self.tp

    def describe(self) -> str:
        """One line for reports, e.g. ``"4 ranks: FSDP2 x 2, TP x 2, bf16"``.

        Example:
            >>> Sharding(world_size=2, fsdp=True).describe()
            '2 ranks: FSDP2 x 2'
        """
        parts = []
        if self.fsdp:
            parts.append(f"FSDP2 x {self.data_parallel}")
            if not self.reshard_after_forward:
                parts.append("no reshard after forward")
        if self.tp > 1:
            parts.append(f"TP x {self.tp}")
        if self.mixed_precision is not None:
            parts.append(self.mixed_precision)
        ranks = f"{self.world_size} rank" + ("s" if self.world_size != 1 else "")
        return ranks + (": " + ", ".join(parts) if parts else "")


def _require_sharding_api(api: str) -> None:
    if not sharding_api_available():
        raise UnsupportedCheckpointError(
            f"{api}: sharded training needs torch >= 2.6, where FSDP2 (fully_shard, "
            f"MixedPrecisionPolicy) is public; this is torch {torch.__version__}."
        )


def tensor_parallel_plan(model: nn.Module) -> dict[str, TpStyle]:
    """The tensor-parallel plan a transformers model brings: module-name globs to styles.

    Its config's ``base_model_tp_plan``, prefixed with the base model's
    attribute name. Pass ``tp_plan=`` to :func:`shard_model` for any other
    model.

    Example:
        >>> import torch
        >>> tensor_parallel_plan(torch.nn.Linear(2, 2))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        remat.errors.CheckpointUsageError: ...
    """
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    if not base_plan:
        raise CheckpointUsageError(
            f"remat: {type(model).__name__} has no known tensor-parallel plan (a transformers "
            "config's base_model_tp_plan); pass tp_plan={module glob: 'colwise' | 'rowwise'} "
            "to shard it."
        )
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not isinstance(getattr(model, prefix, None), nn.Module):
        prefix = ""  # the model is the base model itself
    unknown = sorted({style for style in base_plan.values() if style not in TP_STYLES})
    if unknown:
        raise CheckpointUsageError(
            f"remat: {type(model).__name__}'s tensor-parallel plan uses styles {unknown} that "
            f"remat does not map (it maps {list(TP_STYLES)}); pass tp_plan= with those modules "
            "left out or mapped."
        )
    return {(f"{prefix}.{glob}" if prefix else glob): style for glob, style in base_plan.items()}


def shard_model(
    model: nn.Module,
    sharding: Sharding,
    *,
    blocks: Sequence[nn.Module] | None = None,
    tp_plan: Mapping[str, str] | None = None,
    mesh: Any = None,
) -> nn.Module:
    """Split ``model`` over the ranks of the default process group, in place.

    Tensor parallelism first (``parallelize_module`` with the plan), then
    FSDP2 (``fully_shard`` on each block, then on the model). Checkpoint the
    blocks before (torchtitan's order): a wrapped block is sharded as its
    wrapper, so the checkpoint runs inside FSDP2's gather.

    Args:
        model: the model (parameters on the device the ranks train on).
        sharding: how to split it; ``world_size`` must be the process group's.
        blocks: the modules to ``fully_shard`` one by one; default: the
            model's stack of blocks (:func:`remat._blocks.find_blocks`).
        tp_plan: module-name globs to ``"colwise"``/``"rowwise"``; default:
            :func:`tensor_parallel_plan`.
        mesh: a ``DeviceMesh`` to use (``("dp", "tp")`` dimensions when both
            are split), of ``sharding.world_size`` ranks; default: built over
            the process group.

    Example:
        >>> model = shard_model(model, Sharding(world_size=2, fsdp=True))  # doctest: +SKIP
    """
    api = "remat.memory.shard_model"
    _require_sharding_api(api)
    if not isinstance(model, nn.Module):
        raise CheckpointTypeError(f"{api}: model must be an nn.Module, got {type(model).__name__}.")
    if not isinstance(sharding, Sharding):
        raise CheckpointTypeError(
            f"{api}: sharding must be a remat.memory.Sharding, got {type(sharding).__name__}."
        )
    ranks = distributed_rank()
    # Over a given mesh (a pipeline stage's data-parallel ranks), the mesh is the world.
    size = None if ranks is None else (mesh.size() if mesh is not None else ranks[1])
    if size != sharding.world_size:
        have = "no process group" if ranks is None else f"a {'mesh' if mesh is not None else 'process group'} of {size} ranks"
        raise CheckpointUsageError(
            f"{api}: the sharding has world_size={sharding.world_size} but there is {have}; "
            "call torch.distributed.init_process_group first (or estimate with "
            "remat.memory.estimate_sharded_step, which simulates the ranks)."
        )
    if mesh is None:
        mesh = _device_mesh(sharding, _device_type(model))
    dp_mesh, tp_mesh = _mesh_parts(mesh, sharding)
    if sharding.tp > 1:
        _parallelize(model, tp_mesh, tp_plan if tp_plan is not None else tensor_parallel_plan(model))
    if sharding.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        options: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": sharding.reshard_after_forward}
        if sharding.mixed_precision is not None:
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=MIXED_PRECISIONS[sharding.mixed_precision], reduce_dtype=torch.float32
            )
        for block in _blocks_of(model, blocks, api):
            fully_shard(block, **options)
        fully_shard(model, **options)
    return model


_Built = TypeVar("_Built", bound=tuple[Any, ...])

Build = Callable[[], tuple[nn.Module, Callable[[], Tensor]]]
"""``build()`` returns ``(model, loss)``: the model, checkpointed as it will
train, and ``loss()``, which runs its forward on one rank's batch and
returns the scalar loss."""


def estimate_sharded_step(
    build: Build,
    *,
    sharding: Sharding,
    optimizer: OptimizerName = "adamw",
    blocks: Sequence[str] | None = None,
    tp_plan: Mapping[str, str] | None = None,
    compiled: bool = False,
) -> MemoryReport:
    """The memory of one training step on one rank of a sharded run, estimated in this process.

    ``build`` runs inside a fake-tensor mode: the model and inputs it makes
    have shapes, dtypes and storage sizes but no data, and allocate nothing.
    The ranks are simulated by a process group whose collectives move no
    data. The model is sharded with :func:`shard_model` (the real FSDP2 and
    tensor-parallel code), runs one untracked step (to create the optimizer
    state) and one tracked step. Every rank holds the same bytes (shards are
    padded to equal sizes), so rank 0 stands for all. The report's
    categories split the peak into sharded parameters (``parameter``),
    gathered ones (``unsharded_parameter``), gradients, optimizer state,
    activations and communication buffers; ``world_size`` says how many
    ranks it stands for. A model that reads tensor values (``.item()``,
    data-dependent shapes) cannot be estimated without data.

    Args:
        build: makes the model and its loss (see :data:`Build`); build it as
            for a CPU run and checkpoint it before returning it.
        sharding: how the step is split.
        optimizer: ``"adamw"``, ``"sgd"`` or ``"none"`` (as
            :func:`remat.memory.track_training_step`).
        blocks: paths of the modules to ``fully_shard`` one by one; default:
            the model's stack of blocks.
        tp_plan: as :func:`shard_model`.
        compiled: the model's compiled blocks (``build`` compiles them, e.g.
            with ``BlockSetting(compile=...)``, before sharding as torchtitan
            does) run under :func:`remat.memory.statically_compiled`: the
            estimate of the compiled step.

    Raises:
        UnsupportedCheckpointError: torch older than 2.6 (no public FSDP2), or
            one whose collectives do not run on fake tensors (2.7 does not).
        CheckpointUsageError: a process group already exists in this process
            (the ranks are simulated in a group of their own; estimate before
            ``init_process_group``, or in another process).

    Example:
        >>> import torch
        >>> from remat.memory import Sharding, estimate_sharded_step
        >>> def build():
        ...     model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        ...     x = torch.zeros(8, 64)
        ...     return model, lambda: model(x).sum()
        >>> report = estimate_sharded_step(build, sharding=Sharding(world_size=4, fsdp=True))
        >>> report.world_size, report.category("parameter").at_peak_bytes   # a quarter each
        (4, 16640)
    """
    api = "remat.memory.estimate_sharded_step"
    from remat.memory._compiled import statically_compiled
    from remat.memory._estimate import track_training_step

    with simulated_rank(build, sharding=sharding, blocks=blocks, tp_plan=tp_plan, api=api) as built:
        if not (isinstance(built, tuple) and len(built) == 2 and callable(built[1])):
            raise CheckpointTypeError(
                f"{api}: build() must return (model, loss) with loss() -> scalar tensor, got "
                f"{type(built).__name__}."
            )
        model, loss = built
        compiling = statically_compiled(model) if compiled else contextlib.nullcontext()
        with compiling:
            return track_training_step(model, loss, optimizer=optimizer)


@contextlib.contextmanager
def simulated_rank(
    build: Callable[[], _Built],
    *,
    sharding: Sharding,
    blocks: Sequence[str] | None = None,
    tp_plan: Mapping[str, str] | None = None,
    api: str = "remat.memory.simulated_rank",
) -> Iterator[_Built]:
    """One rank of a sharded run, simulated in this process on fake tensors, for a block of code.

    ``build()`` runs in a fake-tensor mode and returns ``(model, ...)``; the
    model is sharded as ``sharding`` says (:func:`shard_model`, the real
    FSDP2 and tensor-parallel code) in a simulated process group of
    ``sharding.world_size`` ranks whose collectives move nothing, and the
    block runs with the fake mode on: a step of the model there allocates
    nothing and stands for every rank. :func:`estimate_sharded_step` tracks
    one; ``remat.planner.plan(..., estimate=...)`` plans in one.

    Example:
        >>> import torch
        >>> from remat.memory import Sharding, simulated_rank
        >>> def build():
        ...     return (torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),)
        >>> with simulated_rank(build, sharding=Sharding(world_size=8, fsdp=True)) as (model,):
        ...     model[0].weight.to_local().shape   # this rank's eighth
        torch.Size([8, 64])
    """
    _require_sharding_api(api)
    if not isinstance(sharding, Sharding):
        raise CheckpointTypeError(
            f"{api}: sharding must be a remat.memory.Sharding, got {type(sharding).__name__}."
        )
    if not collectives_run_on_fake_tensors():
        raise UnsupportedCheckpointError(
            f"{api}: simulating ranks needs a torch whose collectives run on fake tensors (2.11 "
            f"and newer have them; 2.7 does not); this is torch {torch.__version__}. Use a newer "
            "torch, or run every rank for real (under torchrun)."
        )
    if distributed_rank() is not None:
        raise CheckpointUsageError(
            f"{api}: a process group is already initialized in this process; the ranks are "
            "simulated in a process group of their own. Call it before "
            "torch.distributed.init_process_group, or in a separate process."
        )
    with simulated_process_group(sharding.world_size):
        # Device meshes read their rank tables, which must be real tensors:
        # they are built, and the model sharded, outside the fake mode. The
        # parameters are fake by then, so sharding them allocates nothing.
        mesh = _device_mesh(sharding, "cpu")
        fake = fake_tensor_mode()
        with fake:
            built = build()
        if not (isinstance(built, tuple) and built and isinstance(built[0], nn.Module)):
            raise CheckpointTypeError(
                f"{api}: build() must return a tuple whose first item is the model, got "
                f"{type(built).__name__}."
            )
        model = built[0]
        chosen = None if blocks is None else [model.get_submodule(path) for path in blocks]
        shard_model(model, sharding, blocks=chosen, tp_plan=tp_plan, mesh=mesh)
        with fake, answering_ops(waits_return_their_input()):
            yield built


def _device_type(model: nn.Module) -> str:
    for param in model.parameters():
        return "cpu" if param.device.type == "meta" else param.device.type
    return "cpu"


def _device_mesh(sharding: Sharding, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if sharding.tp > 1 and sharding.fsdp:  # 2-D, even over one data-parallel rank
        return init_device_mesh(
            device_type, (sharding.data_parallel, sharding.tp), mesh_dim_names=("dp", "tp")
        )
    name = "tp" if sharding.tp > 1 else "dp"
    return init_device_mesh(device_type, (sharding.world_size,), mesh_dim_names=(name,))


def _mesh_parts(mesh: Any, sharding: Sharding) -> tuple[Any, Any]:
    """(data-parallel mesh, tensor-parallel mesh) of ``mesh``; None where not split."""
    if sharding.tp > 1 and sharding.fsdp:
        return mesh["dp"], mesh["tp"]
    if sharding.tp > 1:
        return None, mesh
    return mesh, None


def _parallelize(model: nn.Module, mesh: Any, plan: Mapping[str, str]) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    bad = sorted({str(style) for style in plan.values() if style not in styles})
    if bad:
        raise CheckpointUsageError(
            f"remat.memory.shard_model: tp_plan styles must be 'colwise' or 'rowwise', got {bad}."
        )
    concrete: dict[str, Any] = {}
    for name, _ in model.named_modules():
        for glob, style in plan.items():
            if name and fnmatch.fnmatchcase(name, glob):
                concrete[name] = styles[style]()
                break
    if not concrete:
        raise CheckpointUsageError(
            f"remat.memory.shard_model: the tensor-parallel plan {dict(plan)} matches no module "
            f"of {type(model).__name__}; check its module names (model.named_modules())."
        )
    parallelize_module(model, mesh, concrete)


def _blocks_of(model: nn.Module, blocks: Sequence[nn.Module] | None, api: str) -> list[nn.Module]:
    if blocks is not None:
        return list(blocks)
    return [module for _, module in require_blocks(model, api=api, remedy="pass blocks= to shard")]
