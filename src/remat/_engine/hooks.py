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

import functools
import weakref
from collections.abc import Hashable
from contextvars import Token
from typing import Any

import torch

from remat._compat.autograd import (
    backward_key,
    on_backward_end,
    pop_saved_tensor_hooks,
    push_saved_tensor_hooks,
    read_root,
)
from remat._compat.dispatch import detach_unseen, no_dispatch_modes, tracing_modes_active
from remat._compat.tracers import compiled_autograd_active, outside_compiler
from remat._engine.forward_state import Undo, check_still_inside
from remat._engine.frame import TAKEN, Frame, Holder, RecomputeStore
from remat._engine.verify import OpLog, count_mismatch, metadata_mismatch, saved_meta, user_line
from remat._scope import INSIDE_REGION, Nested, RegionHooks, current_observer
from remat.errors import CheckpointError, StopRecompute

__all__ = ["ForwardHooks", "RecomputeHooks", "RecomputeScope", "recompute"]


class ForwardHooks(RegionHooks):
    """Pack tensors of a region's forward as holders; unpack by recomputing.

    The state the hooks read lives in slots, not in closure cells: every saved
    tensor keeps the unpack hook, and so the hooks' objects, until backward,
    and each object that lives that long costs the garbage collector a little
    on every full pass (docs/design/performance.md, "Objects a region keeps").
    """

    __slots__ = ("_debug", "_frame", "_holders", "_inputs", "_metas", "_observer", "_origin", "_reads", "_weak")

    def __init__(self, frame: Frame) -> None:
        checked = frame.options.check_determinism
        self._frame = frame
        self._holders = frame.holders
        self._metas = frame.metas if checked else None
        self._reads = frame.reads  # watched only with metas, when the determinism check is on
        self._origin = frame.origin
        self._debug = frame.options.debug
        self._observer = current_observer()
        # Inputs the frame keeps itself have their versions checked by the frame;
        # it holds them, so their ids stay theirs while the region lives. Then
        # nothing outside moves saved tensors either, and a watched tensor that
        # surely lives outside (it requires grad: a parameter, or has an older
        # grad_fn) is held strongly: the function reads it again in the
        # recomputation anyway, and a weak reference costs more than the watch.
        # A leaf that needs no grad may have been made inside the region (a
        # layer norm's statistics, a dropout mask, attention's log-sum-exp):
        # held strongly it would outlive the forward, so it is watched weakly.
        self._inputs = frame.input_ids
        self._weak = frame.input_tensors is None
        self._token = None

    def pack(self, tensor: torch.Tensor) -> Holder:
        holder = Holder()
        holders = self._holders
        holder.index = len(holders)
        holders.append(weakref.ref(holder))
        metas = self._metas
        if metas is not None:
            metas.append((tuple(tensor.shape), tensor.dtype, tensor.device))  # Meta, inlined
            inputs = self._inputs
            # An input the frame keeps is checked by the frame (asked first: cheaper than read_root)
            read = read_root(tensor, self._origin) if id(tensor) not in inputs else None
            if read is not None and id(read[0]) not in inputs:
                # read from outside: watch for in-place changes
                source = user_line() if self._debug else None
                root = read[0]
                strong = not self._weak and (root.requires_grad or root.grad_fn is not None)
                self._reads.append((root if strong else weakref.ref(root), read[1], holder.index, source))
        if self._observer is not None:
            self._observer("region_saved", tensor)
        return holder

    def unpack(self, holder: Holder) -> torch.Tensor:
        if compiled_autograd_active():
            # Compiled autograd puts this hook into the backward graph it hands
            # to Dynamo, which traces or compiles it. The recomputation must run
            # as Python, eagerly (its hooks and modes are no graph, and its
            # bookkeeping would become guards that fail every step): Dynamo
            # calls it as an opaque function instead (docs/design/tracing.md).
            return outside_compiler(self._unpack, holder)  # type: ignore[no-any-return]
        return self._unpack(holder)

    def _unpack(self, holder: Holder) -> torch.Tensor:
        frame = self._frame
        key = backward_key()
        if frame.split is not None:  # a pipeline microbatch: its split passes share a store
            key = frame.split.key_for(frame.options.weight_pass) or key
        store = frame.stores.get(key) if key is not None else None
        if store is None:
            store = recompute(frame, key)
        tensors = store.tensors
        value = tensors.get(holder.index)
        if not isinstance(value, torch.Tensor):
            raise _not_recomputed(frame, store, holder, value)
        if not store.keeps:
            tensors[holder.index] = TAKEN
        return value


def _not_recomputed(frame: Frame, store: RecomputeStore, holder: Holder, value: object) -> CheckpointError:
    """The error for a holder whose tensor the store does not hand out."""
    if value is TAKEN:
        return CheckpointError(
            f"{frame.options.api}: a tensor saved in a checkpointed region was unpacked "
            "twice in one backward call. Recomputed tensors are handed out once and then "
            "freed. If a custom autograd.Function reads ctx.saved_tensors more than once "
            "in backward, read it once into a local variable. Under GraphExecGroup, two "
            "backward calls must not need the same saved tensor."
        )
    return CheckpointError(
        f"{frame.options.api}: the recomputation did not produce saved tensor "
        f"#{holder.index} (it saved {store.saved_count} of {len(frame.holders)}). The "
        "checkpointed function ran differently when recomputed; with "
        "determinism_check='none' this is not detected earlier."
    )


# The frames that hold a store for each running backward call (graph task
# id), dropped together when that call ends: one engine callback per backward
# call, not one per region (docs/design/performance.md). Weak: a frame whose
# graph backward has freed must not wait for the end of the call.
_FRAMES_BY_TASK: dict[int, list[weakref.ref[Frame]]] = {}


def _register_store(frame: Frame, key: Hashable, store: RecomputeStore) -> None:
    frame.stores[key] = store
    if isinstance(key, int):  # a graph task: drop when the backward call ends
        fresh: list[weakref.ref[Frame]] = []
        frames = _FRAMES_BY_TASK.setdefault(key, fresh)
        if frames is fresh:
            _forget_finished_tasks(key)
            if not on_backward_end(functools.partial(_drop_task_stores, key)):
                del _FRAMES_BY_TASK[key]
                return
        frames.append(weakref.ref(frame))
        return
    register = getattr(key, "register_cleanup", None)
    if register is not None:  # remat's GraphExecGroup: drop when the group exits
        frame_ref = weakref.ref(frame)

        def drop() -> None:
            owner = frame_ref()
            if owner is not None:
                owner.stores.pop(key, None)

        register(drop)


def _drop_task_stores(key: int) -> None:
    for ref in _FRAMES_BY_TASK.pop(key, ()):
        frame = ref()
        if frame is not None:
            frame.stores.pop(key, None)


def _forget_finished_tasks(current: int) -> None:
    """Forget the calls whose frames are all gone (a backward that raised runs no callback)."""
    for key in [k for k, refs in _FRAMES_BY_TASK.items() if k != current and all(r() is None for r in refs)]:
        _FRAMES_BY_TASK.pop(key, None)


class RecomputeHooks:
    """Catch the tensors a recomputation saves into a frame's store.

    Entered, it is the recomputation's whole scope: the forward's replay state
    with grad mode on (:meth:`ReplayState.enter`), then the frame's recompute
    context (a selective region's replay mode) and the debug log when there
    are any, then the hooks. One object and two frames per recomputation
    (docs/design/performance.md).
    """

    __slots__ = (
        "_around",
        "_entered",
        "_expected",
        "_frame",
        "_holders",
        "_inputs",
        "_log",
        "_metas",
        "_replay",
        "_stop_after",
        "_store",
        "_tensors",
        "_token",
        "_undo",
        "_unseen",
    )

    def __init__(self, frame: Frame, store: RecomputeStore, stop_after: int, log: OpLog | None):
        around = () if frame.recompute_context is None else (frame.recompute_context,)
        self._around = around if log is None else (*around, log)
        self._entered: Nested | None = None
        self._replay = frame.replay
        self._undo: Undo | None = None
        self._token: Token[bool] | None = None
        self._frame = frame
        self._store = store
        self._stop_after = stop_after
        self._log = log
        self._holders = frame.holders
        self._metas = frame.metas if frame.options.check_determinism else None
        self._expected = len(frame.holders)
        self._tensors = store.tensors
        self._inputs = frame.input_ids  # held by the frame
        # Under a selective region's replay mode a plain detach would be seen
        # by the mode, a Python dispatch per saved tensor (docs/design/performance.md).
        # Under a tracer the detach must be seen: the tracer would take the
        # unseen result for a constant (docs/design/tracing.md).
        self._unseen = frame.recompute_context is not None and not tracing_modes_active()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Detached: a saved output would otherwise reference its own grad_fn
        # through the packed value, a C++ cycle that gc cannot break. Only
        # tensors the recomputation made can be such outputs: the region's
        # inputs and leaves are kept as they are.
        if not tensor.is_leaf and id(tensor) not in self._inputs:  # not a leaf: has a grad_fn
            if type(tensor) is not torch.Tensor:
                # A subclass (a fake tensor above all) detaches by an op: stepped over
                # by the user's modes and remat's own (a tracer's still record it), as
                # .data is for a plain tensor, so that a simulation on fake tensors
                # pays a selective region's modes and the modelled clock what the
                # real run pays (docs/design/planner.md, "Estimated plans").
                with no_dispatch_modes():
                    tensor = tensor.detach()
            else:  # .data runs no operator outside dispatch modes
                tensor = detach_unseen(tensor) if self._unseen else tensor.data
        store = self._store
        index = store.saved_count
        store.saved_count = index + 1
        metas = self._metas
        if index >= self._expected:
            if not self._frame.forward_done or metas is None:
                # Backward inside the forward itself: the forward has saved
                # only this much so far; anything later is not needed yet.
                return tensor
            raise self._mismatch(index, None)
        if metas is not None and (tensor.shape, tensor.dtype, tensor.device) != metas[index]:
            raise self._mismatch(index, tensor)
        holder = self._holders[index]()
        if holder is not None:
            self._tensors[index] = tensor
            if self._store.keeps:
                self._store.keep_while_alive(holder, index)
        if index == self._stop_after:
            raise StopRecompute
        # The recomputed graph keeps the tensor too, in case the function
        # itself runs backward through it (backward inside checkpoint);
        # unpacking restores its autograd history from the saved variable.
        return tensor

    def _mismatch(self, index: int, tensor: torch.Tensor | None) -> CheckpointError:
        """The determinism error: one tensor too many (``tensor`` None) or different metadata."""
        frame = self._frame
        logs = (frame.forward_log, self._log)
        blocked = frame.options.debug_blocked
        if tensor is None:
            return count_mismatch(self._expected, index + 1, logs, blocked)
        return metadata_mismatch(index, frame.metas[index], saved_meta(tensor), logs, blocked)

    def __enter__(self) -> None:
        undo = self._undo = self._replay.enter(enable_grad=True)
        try:
            if self._around:
                entered = Nested(self._around)
                entered.__enter__()
                self._entered = entered
            push_saved_tensor_hooks(self.pack, _as_is)
        except BaseException as exc:
            if self._entered is not None:
                self._entered.__exit__(type(exc), exc, exc.__traceback__)
            self._replay.exit(undo, exc)
            raise
        self._token = INSIDE_REGION.set(True)

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> bool:
        undo, token, entered = self._undo, self._token, self._entered
        self._undo = self._token = self._entered = None
        assert undo is not None and token is not None, "remat bug: recompute hooks exited twice"
        INSIDE_REGION.reset(token)
        pop_saved_tensor_hooks()
        try:  # a context_fn context may suppress the exception, as in a with statement
            return entered is not None and bool(entered.__exit__(kind, exc, traceback))
        finally:
            self._replay.exit(undo, exc)


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class RecomputeScope:
    """Where a recomputation's :class:`RecomputeHooks` are entered and left,
    for a front-end whose region starts and ends inside a larger call.

    Usually the engine enters the hooks around the whole recompute function.
    The hooks of ``checkpoint_module`` cannot: other hooks of the module run
    before and after the region. They open this scope where the forward's
    region started and close it where it ended, so the recomputation covers
    exactly what the forward's region covered (``docs/design/modules.md``).
    Closing is idempotent; the engine closes a scope left open by an error.
    """

    __slots__ = ("_hooks", "_open")

    def __init__(self, hooks: RecomputeHooks) -> None:
        self._hooks = hooks
        self._open = False

    def open(self) -> None:
        if self._open:
            raise RuntimeError("remat bug: a recomputation scope was opened twice")
        self._hooks.__enter__()
        self._open = True

    def close(self, exc: BaseException | None = None) -> None:
        if self._open:
            self._open = False
            if exc is None:
                self._hooks.__exit__(None, None, None)
            else:
                self._hooks.__exit__(type(exc), exc, exc.__traceback__)


def recompute(frame: Frame, key: Hashable | None) -> RecomputeStore:
    """Rerun a frame's function once for the backward call ``key`` (or a split
    microbatch's passes: a store that keeps)."""
    store = RecomputeStore(keeps=key is not None and key is frame.split)
    if key is not None:
        _register_store(frame, key, store)
    options = frame.options
    stop_after = frame.last_live_index() if options.early_stop else -1
    log = OpLog() if options.debug else None
    try:
        if frame.transform is not None:
            check_still_inside(frame.transform, options.api)
        args, kwargs = frame.load_inputs()
        frame.check_reads()
        hooks = RecomputeHooks(frame, store, stop_after, log)
        try:
            if frame.caller_scopes_recompute:
                scope = RecomputeScope(hooks)
                # The caller's hooks around the region run with grad on, as in a
                # forward. The scope closes inside: closing restores the grad
                # mode it found on opening (on), which must not outlive this
                # block, or the rest of the backward would build a graph.
                with torch.enable_grad():
                    try:
                        frame.recompute_fn(scope, *args, **kwargs)
                    except BaseException as exc:  # StopRecompute too: it ends inside the scope
                        scope.close(exc)
                        raise
                    scope.close()
            else:
                with hooks:
                    frame.recompute_fn(*args, **kwargs)
        except StopRecompute:
            return store  # every needed tensor is back: a normal end
        finally:
            frame.settle_reads()
        expected = len(frame.holders)
        if options.check_determinism and frame.forward_done and store.saved_count < expected:
            raise count_mismatch(expected, store.saved_count, (frame.forward_log, log), options.debug_blocked)
        return store
    except BaseException:
        if key is not None:
            frame.stores.pop(key, None)
        raise
