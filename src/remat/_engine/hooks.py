"""Saved-tensor hooks of a region: pack in forward, recompute on first unpack.

Forward (:class:`ForwardHooks`): each tensor autograd wants to save is replaced
by a :class:`~remat._engine.frame.Holder` carrying its save index; nothing of
the tensor is kept except its metadata for the determinism check.

Backward: the first unpack of a frame within a backward call runs
:func:`recompute`, which reruns the region under :class:`RecomputeHooks`; they
catch the tensors the recomputation saves, by index, into the frame's store for
that backward call. With early stop, the recomputation is cut short (by the
:class:`~remat.errors.StopRecompute` signal) right after the last tensor that a
live holder still needs. Each unpack takes its tensor out of the store, so it
is freed as soon as backward is done with it, even with ``retain_graph=True``.
See ``docs/design/lifetimes.md``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable

import torch

from remat._compat import (
    current_backward_id,
    get_exec_group,
    on_backward_end,
    read_root,
    version_of,
)
from remat._engine.frame import TAKEN, Frame, Holder, RecomputeStore
from remat._engine.observe import current_observer
from remat._engine.scope import RegionHooks
from remat._engine.verify import OpLog, count_mismatch, metadata_mismatch, saved_meta, user_line
from remat.errors import CheckpointError, StopRecompute

__all__ = ["ForwardHooks", "RecomputeHooks", "RecomputeScope", "recompute"]


class ForwardHooks(RegionHooks):
    """Pack tensors of a region's forward as holders; unpack by recomputing."""

    def __init__(self, frame: Frame) -> None:
        holders = frame.holders
        checked = frame.options.check_determinism
        metas = frame.metas if checked else None
        reads = frame.reads if checked else None
        origin = frame.origin
        debug = frame.options.debug
        observer = current_observer()

        def pack(tensor: torch.Tensor) -> Holder:
            holder = Holder(len(holders))
            holders.append(weakref.ref(holder))
            if metas is not None:
                metas.append(saved_meta(tensor))
            if reads is not None:
                root = read_root(tensor, origin)
                if root is not None:  # read from outside: watch for in-place changes
                    source = user_line() if debug else None
                    reads.append((weakref.ref(root), version_of(root), holder.index, source))
            if observer is not None:
                observer("region_saved", tensor)
            return holder

        def unpack(holder: Holder) -> torch.Tensor:
            return _unpack(frame, holder)

        super().__init__(pack, unpack)


def _unpack(frame: Frame, holder: Holder) -> torch.Tensor:
    key = _backward_key()
    store = frame.stores.get(key) if key is not None else None
    if store is None:
        store = recompute(frame, key)
    value = store.tensors.get(holder.index)
    if isinstance(value, torch.Tensor):
        store.tensors[holder.index] = TAKEN
        return value
    if value is TAKEN:
        raise CheckpointError(
            f"{frame.options.api}: a tensor saved in a checkpointed region was unpacked "
            "twice in one backward call. Recomputed tensors are handed out once and then "
            "freed. If a custom autograd.Function reads ctx.saved_tensors more than once "
            "in backward, read it once into a local variable. Under GraphExecGroup, two "
            "backward calls must not need the same saved tensor."
        )
    raise CheckpointError(
        f"{frame.options.api}: the recomputation did not produce saved tensor "
        f"#{holder.index} (it saved {store.saved_count} of {len(frame.holders)}). The "
        "checkpointed function ran differently when recomputed; with "
        "determinism_check='none' this is not detected earlier."
    )


def _backward_key() -> Hashable | None:
    """Which backward call is unpacking: the exec group, else the graph task."""
    group = get_exec_group()
    if group is not None:
        return group
    task = current_backward_id()
    return task if task != -1 else None


def _register_store(frame: Frame, key: Hashable, store: RecomputeStore) -> None:
    frame.stores[key] = store
    frame_ref = weakref.ref(frame)

    def drop() -> None:
        owner = frame_ref()
        if owner is not None:
            owner.stores.pop(key, None)

    if isinstance(key, int):  # a graph task: drop when the backward call ends
        on_backward_end(drop)
        return
    register = getattr(key, "register_cleanup", None)
    if register is not None:  # remat's GraphExecGroup: drop when the group exits
        register(drop)


class RecomputeHooks(RegionHooks):
    """Catch the tensors a recomputation saves into a frame's store."""

    def __init__(self, frame: Frame, store: RecomputeStore, stop_after: int, log: OpLog | None):
        holders = frame.holders
        metas = frame.metas if frame.options.check_determinism else None
        expected = len(holders)
        tensors = store.tensors
        forward_log = frame.forward_log
        blocked = frame.options.debug_blocked

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            # Detached: a saved output would otherwise reference its own grad_fn
            # through the packed value, a C++ cycle that gc cannot break.
            tensor = tensor.detach() if tensor.requires_grad else tensor
            index = store.saved_count
            store.saved_count = index + 1
            if index >= expected:
                if not frame.forward_done or metas is None:
                    # Backward inside the forward itself: the forward has saved
                    # only this much so far; anything later is not needed yet.
                    return tensor
                raise count_mismatch(expected, index + 1, (forward_log, log), blocked)
            if metas is not None and saved_meta(tensor) != metas[index]:
                raise metadata_mismatch(index, metas[index], saved_meta(tensor), (forward_log, log), blocked)
            if holders[index]() is not None:
                tensors[index] = tensor
            if index == stop_after:
                raise StopRecompute
            # The recomputed graph keeps the tensor too, in case the function
            # itself runs backward through it (backward inside checkpoint);
            # unpacking restores its autograd history from the saved variable.
            return tensor

        def unpack(tensor: torch.Tensor) -> torch.Tensor:
            return tensor

        super().__init__(pack, unpack)


class RecomputeScope:
    """What a recomputation runs under: the forward's RNG and autocast state,
    the ``context_fn`` recompute context, the debug op log and the hooks that
    catch the saved tensors.

    Usually the engine opens it around the whole recompute function. A
    front-end whose region starts and ends inside a larger call (the hooks
    of ``checkpoint_module``: other hooks of the module run before and after
    the region) opens it where the forward's region started and closes it
    where it ended, so the recomputation covers exactly what the forward's
    region covered (``docs/design/modules.md``). Closing is idempotent.
    """

    __slots__ = ("_frame", "_log", "_stack", "_stop_after", "_store")

    def __init__(self, frame: Frame, store: RecomputeStore, stop_after: int, log: OpLog | None):
        self._frame = frame
        self._store = store
        self._stop_after = stop_after
        self._log = log
        self._stack: contextlib.ExitStack | None = None

    def open(self) -> None:
        if self._stack is not None:
            raise RuntimeError("remat bug: a recomputation scope was opened twice")
        frame = self._frame
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(frame.replay.restore())
            if frame.recompute_context is not None:
                stack.enter_context(frame.recompute_context)
            if self._log is not None:
                stack.enter_context(self._log)
            stack.enter_context(RecomputeHooks(frame, self._store, self._stop_after, self._log))
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def close(self, exc: BaseException | None = None) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            if exc is None:
                stack.__exit__(None, None, None)
            else:
                stack.__exit__(type(exc), exc, exc.__traceback__)


def recompute(frame: Frame, key: Hashable | None) -> RecomputeStore:
    """Rerun a frame's function once for the backward call ``key``."""
    store = RecomputeStore()
    if key is not None:
        _register_store(frame, key, store)
    options = frame.options
    stop_after = frame.last_live_index() if options.early_stop else -1
    log = OpLog() if options.debug else None
    try:
        args, kwargs = frame.load_inputs()
        frame.check_reads()
        scope = RecomputeScope(frame, store, stop_after, log)
        stopped = False
        try:
            with torch.enable_grad():
                try:
                    if frame.caller_scopes_recompute:
                        frame.recompute_fn(scope, *args, **kwargs)
                    else:
                        scope.open()
                        frame.recompute_fn(*args, **kwargs)
                except StopRecompute:
                    stopped = True  # every needed tensor is back: a normal end
                except BaseException as exc:
                    scope.close(exc)
                    raise
                scope.close()
        finally:
            frame.settle_reads()
        if stopped:
            return store
        expected = len(frame.holders)
        if options.check_determinism and frame.forward_done and store.saved_count < expected:
            raise count_mismatch(expected, store.saved_count, (frame.forward_log, log), options.debug_blocked)
        return store
    except BaseException:
        if key is not None:
            frame.stores.pop(key, None)
        raise
