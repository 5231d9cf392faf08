"""torch.distributed: this process's rank, whether FSDP2 is public, a simulated
process group of any size, and collectives on fake tensors.

Private names used: torch's "fake" process-group backend
(``torch.testing._internal.distributed.fake_pg``), the module that registers
c10d's Meta kernels (``torch.distributed._meta_registrations``), and the
functional collectives' ``_c10d_functional.wait_tensor`` op. Distributed
modules are imported on first use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from remat._compat.dispatch import OpAnswer

__all__ = [
    "collectives_run_on_fake_tensors",
    "distributed_rank",
    "sends_held_by_their_works",
    "sharding_api_available",
    "simulated_process_group",
    "waits_return_their_input",
]


def distributed_rank() -> tuple[int, int] | None:
    """(rank, world size) of the default process group; None when there is none
    (or ``torch.distributed`` is not built in)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return None
    return distributed.get_rank(), distributed.get_world_size()


def sharding_api_available() -> bool:
    """Whether FSDP2 and its ``MixedPrecisionPolicy`` are public (torch >= 2.6).

    torch 2.4 and 2.5 have ``fully_shard`` only under
    ``torch.distributed._composable.fsdp``; remat's sharded estimate and
    planning need the public one (checked 2.4.1: absent; 2.7.1 onwards:
    present). Callers raise ``UnsupportedCheckpointError`` below it.
    """
    distributed = torch.distributed
    if not distributed.is_available():
        return False
    import torch.distributed.fsdp as fsdp

    return hasattr(fsdp, "fully_shard") and hasattr(fsdp, "MixedPrecisionPolicy")


@contextlib.contextmanager
def simulated_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Make this process rank ``rank`` of ``world_size`` ranks that do not exist.

    Uses torch's "fake" process-group backend: collectives complete at once
    and move no data, so FSDP2 and tensor parallelism run their real code
    (shard sizes, gathers, buffers) for any world size in one process. The
    backend is registered by a module of torch's test utilities
    (``torch.testing._internal.distributed.fake_pg``, the same that
    torchtitan's memory estimation uses); no public module offers it
    (checked 2.7.1, 2.11.0, 2.13.0, 2.15.0). The default process group is
    destroyed on exit.
    """
    import sys

    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg as fake_pg

    # init_process_group wraps sys.excepthook to prefix tracebacks with "[rank<r>]:" (2.13,
    # 2.15), and destroying the group leaves it: simulating rank after rank would stack one
    # prefix per rank onto every later traceback of this process.
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        _forget_sharding_decisions()


def _forget_sharding_decisions() -> None:
    """Clear DTensor's caches of sharding decisions, which hold the meshes they were made on.

    A mesh equals another of the same ranks, layout and dimension names
    (``DeviceMesh.__eq__``, 2.13), whatever process groups it names. A later
    simulated group's equal mesh then hits a cached decision whose specs carry
    the old mesh, whose groups (destroyed on exit) no longer resolve: "Could
    not resolve the process group registered under the name 7" in a
    tensor-parallel estimate run after a tensor-parallel pipeline simulation
    in the same process. The cache that held it is the C++ dispatch fast
    path's (``torch._C._clear_DTensor_sharding_propagator_cache``: 2.11.0,
    2.13.0, 2.15.0; absent in 2.7.1); the Python ones beside it
    (``ShardingPropagator.propagate_op_sharding`` per thread, its tensor-meta
    cache, ``_redistribute._gen_transform_infos``; 2.7.1 has the last only)
    are keyed the same way and cleared too. 2.4.1 has no public DTensor.
    """
    try:
        from torch.distributed.tensor import DTensor, _redistribute
    except ImportError:  # no public DTensor (2.4.1)
        return
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    caches = [
        getattr(propagator, "propagate_op_sharding", None),
        getattr(type(propagator), "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    ]
    for cache in caches:
        clear = getattr(cache, "cache_clear", None)
        if clear is not None:
            clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ dispatch fast path's own cache of the same decisions
        native()


def collectives_run_on_fake_tensors() -> bool:
    """Whether c10d's collectives have Meta kernels, which fake tensors run.

    torch registers them in ``torch.distributed._meta_registrations``
    (present in 2.11.0, 2.13.0, 2.15.0; absent in 2.7.1, where a collective on
    a fake tensor raises ``UnsupportedOperatorException``).
    """
    import importlib.util

    return importlib.util.find_spec("torch.distributed._meta_registrations") is not None


def _return_the_waited_tensor(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    return args[0]


def waits_return_their_input() -> dict[Any, OpAnswer]:
    """Under a fake mode, ``_c10d_functional.wait_tensor`` returns its input: answers
    (``remat._compat.dispatch.answering_ops``, ``MemoryTracker.answer_ops``).

    On real tensors the op hands back the very tensor it waited for; its fake
    implementation returns a new tensor with a storage of its own (checked
    2.13.0, 2.15.0), which a memory tracker counts as one more allocation,
    and which the real run never makes. Answered below the tracker's count (by the
    tracker itself, or by a mode under it), so the tracker sees what a real run
    does. Empty where the
    functional collectives are not registered.
    """
    namespace = getattr(torch.ops, "_c10d_functional", None)
    packet = getattr(namespace, "wait_tensor", None) if namespace is not None else None
    if packet is None:
        return {}
    return {packet.default: _return_the_waited_tensor}


class _HeldWork:
    """A work of the simulated group that keeps the tensors it sends while it exists."""

    def __init__(self, work: Any, sent: list[Any]) -> None:
        self._work, self._sent = work, sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def sends_held_by_their_works() -> Iterator[None]:
    """In a simulated process group, keep each tensor a point-to-point send takes alive
    as long as its work object, as a real backend's work does.

    A gloo work holds the tensors it sends until the work itself is destroyed
    (waited or not); the "fake" backend's holds nothing, so on a simulated
    rank a pipeline stage's sent gradient would be freed while the schedule
    still keeps the send's work in its list (several microbatches, up to the
    step's end under GPipe), and the rank's peak would come out lower than the
    real one (4.8% on a middle stage of 4, measured). ``torch.distributed.isend`` and
    ``batch_isend_irecv`` are wrapped for the block, in ``torch.distributed``
    and in ``distributed_c10d`` (whose ``P2POp`` checks its op against its own
    globals); the schedules of ``torch.distributed.pipelining`` send through
    them (checked 2.11.0, 2.13.0, 2.15.0).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    isend, batch = c10d.isend, c10d.batch_isend_irecv

    def held_isend(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return _HeldWork(isend(tensor, *args, **kwargs), [tensor])

    def held_batch(ops: list[Any]) -> list[Any]:
        sent = [op.tensor for op in ops if op.op in (held_isend, isend)]
        return [_HeldWork(work, sent) for work in batch(ops)]

    places = (dist, c10d)
    saved = [(place, place.isend, place.batch_isend_irecv) for place in places]
    for place in places:
        place.isend = held_isend  # type: ignore[attr-defined]
        place.batch_isend_irecv = held_batch  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for place, old_isend, old_batch in saved:
            place.isend = old_isend  # type: ignore[attr-defined]
            place.batch_isend_irecv = old_batch  # type: ignore[attr-defined]
