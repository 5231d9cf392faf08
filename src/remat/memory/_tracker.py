"""Live tensor bytes over a block of code, counted per storage.

A :class:`MemoryTracker` pushes a ``TorchDispatchMode`` that looks at the
outputs of every aten op run inside the block, forward and backward alike
(autograd runs backward ops through the dispatcher, where the mode is active).
Each output storage is counted once, when first seen, and subtracted when it
is freed:

* views share their base's storage, so they cost nothing;
* in-place and ``out=`` ops return a storage that is already counted, or one
  of their inputs' storages; neither is new memory;
* a storage that grows (``resize_``) is re-measured whenever an op returns it;
* storages that existed before the block (parameters, data) are not counted,
  unless they belong to the tracked model or optimizer (then they are counted
  from the start, as ``start_bytes``), even when an op returns a view of them;
* a wrapper tensor subclass (``DTensor``, ...) is counted by the tensors it
  wraps: a sharded parameter costs its local shard, not its global shape.

Sharding engines change memory outside the ops this tracker sees. FSDP2
gathers a block's parameters into storages it resizes in place (grown before
the block runs, shrunk to nothing after), and runs its collectives on flat
buffers. A parameter storage that appears while the block runs is counted as
``unsharded_parameter`` and watched: its size is read again before every op
and at every module boundary, so each regrowth is an allocation and each
shrink to zero a free. Storages passed to an in-place collective
(``torch.ops.c10d``) are ``communication``. Under ``torch.distributed`` the
report carries the rank. See ``docs/design/memory.md`` ("Sharded training").

Frees are seen through ``weakref`` callbacks on the storage's Python object:
since PyTorch 2.0 that object lives exactly as long as the C++ storage, so
the callback fires when the memory is released, not when Python drops its
handle. This holds for CPU, CUDA, meta and fake tensors alike. The tracker
holds weak references only, so it keeps nothing alive; leaving the block drops
them, so later frees are not counted.

With ``model=``, module hooks give each storage a module path and the
timeline module enter/exit markers; with ``optimizer=``, step hooks mark the
optimizer phase. Categories, phases and the end of forward are defined in
``docs/design/memory.md``.

Example:
    >>> import torch
    >>> from remat.memory import track
    >>> with track() as t:
    ...     x = torch.ones(256, 256)          # float32: 262144 bytes
    ...     y = x.t()                          # a view: no new storage
    ...     t.mark("after_views")
    >>> t.marks["after_views"], t.peak_bytes
    (262144, 262144)
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from functools import partial
from types import TracebackType
from typing import Any

import torch
from torch import nn

from remat._compat.autograd import current_backward_id
from remat._compat.dispatch import (
    DEVICE_QUERY,
    OpAnswer,
    TorchDispatchMode,
    answered_or_run,
    wrapped_tensors,
)
from remat._compat.distributed import distributed_rank
from remat._compat.modules import compiled_call
from remat._scope import COMPILED_GRAPH_RAN, METERS_POLICY_OPS, OpObserver
from remat._source import user_frame
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.memory._report import (
    CATEGORIES,
    OUTSIDE_MODULES,
    Category,
    EventKind,
    MemoryReport,
    Phase,
    StorageLifetime,
    Timeline,
    TimelineEvent,
    Usage,
)

__all__ = ["MemoryTracker", "StorageRecord", "track"]

_StorageRef = weakref.ReferenceType[torch.UntypedStorage]

FORWARD_END = "forward_end"
"""A :meth:`MemoryTracker.mark` of this name sets the end of forward explicitly."""


class StorageRecord:
    """One storage the tracker counted (mutable bookkeeping, not a report).

    ``created``/``freed`` are timeline indices (``freed`` None while live).
    ``op`` is the aten op that made it (None for storages counted from the
    start); ``source`` the user's ``file:line`` when source capture is on;
    ``index`` its position among the tracker's records. Read-only views of
    it are :class:`~remat.memory.StorageLifetime` (:meth:`MemoryTracker.timeline`).
    """

    __slots__ = (
        "category", "created", "device", "freed", "index", "module", "nbytes", "op", "source",
    )

    def __init__(
        self,
        nbytes: int,
        device: str,
        category: Category,
        module: str,
        op: object,
        created: int,
        index: int,
    ) -> None:
        self.index = index
        self.nbytes = nbytes
        self.device = device
        self.category: Category = category
        self.module = module
        self.op = op
        self.created = created
        self.freed: int | None = None
        self.source: str | None = None

    def live_at(self, index: int) -> bool:
        """Whether the storage was live right after timeline event ``index``."""
        return self.created <= index and (self.freed is None or self.freed > index)


# One timeline entry while tracking: (kind, subject, live bytes, delta, phase, module).
# Tuples keep the hot path cheap; report() turns them into TimelineEvents.
_Event = tuple[EventKind, object, int, int, Phase, str]


class MemoryTracker:
    """Counts bytes of tensor storages created while it is active.

    Use it through :func:`track` (or as a context manager itself); a tracker
    tracks one block only. Its fields stay readable after the block ends, and
    :meth:`report` turns them into a :class:`~remat.memory.MemoryReport`.

    Args:
        model: an ``nn.Module`` whose parameters count from the start and
            whose modules get paths (see :func:`track`).
        optimizer: a ``torch.optim.Optimizer`` whose state counts from the
            start and whose ``step()`` is the ``optimizer`` phase.
        capture_source: remember the user's ``file:line`` that made each
            storage (walks the stack once per new storage: slower).
        device: count only storages on this device type (``"cuda"``: the
            accelerator's memory, not host copies such as offloaded
            activations); ``None`` counts every device.

    Attributes:
        marks: live bytes recorded by :meth:`mark`, by name.

    Example:
        >>> import torch
        >>> from remat.memory import MemoryTracker
        >>> with MemoryTracker() as t:
        ...     a = torch.zeros(1024)               # 4096 bytes
        ...     del a
        >>> t.peak_bytes, t.live_bytes
        (4096, 0)
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: Any = None,
        *,
        capture_source: bool = False,
        device: str | None = None,
    ) -> None:
        if device is not None and not isinstance(device, str):
            raise CheckpointTypeError(
                f"remat.memory.track: device must be a device type such as 'cuda', got "
                f"{type(device).__name__}."
            )
        if model is not None and not isinstance(model, nn.Module):
            raise CheckpointTypeError(
                f"remat.memory.track: model must be a torch.nn.Module, got {type(model).__name__}."
            )
        if optimizer is not None and not (
            hasattr(optimizer, "state") and hasattr(optimizer, "register_step_pre_hook")
        ):
            raise CheckpointTypeError(
                "remat.memory.track: optimizer must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}."
            )
        self.marks: dict[str, int] = {}
        self._model = model
        self._op_observer: OpObserver | None = None
        self._answers: dict[Any, OpAnswer] = {}
        self._optimizer = optimizer
        self._capture_source = capture_source
        self._device_type = None if device is None else torch.device(device).type
        self._live_bytes = 0
        self._peak_bytes = 0
        self._peak_index = 0
        self._start_bytes = 0
        # id(storage) -> (weak reference whose callback subtracts it, its record)
        self._storages: dict[int, tuple[_StorageRef, StorageRecord]] = {}
        self._records: list[StorageRecord] = []
        self._events: list[_Event] = []
        self._mark_index: dict[str, int] = {}
        self._device_live: dict[str, int] = {}
        self._device_names: dict[torch.device, str] = {}
        self._device_peak: dict[str, int] = {}
        self._phase: Phase = "forward"
        self._forward_end_index: int | None = None
        self._module_stack: list[str] = []
        self._grad_module = OUTSIDE_MODULES
        self._last_grad: weakref.ReferenceType[torch.Tensor] | None = None
        self._optimizer_depth = 0
        self._param_paths: dict[int, str] = {}  # id(parameter) -> owning module path
        self._compiled_paths: dict[int, str] = {}  # id(compiled module) -> its path
        # Storages a sharding engine resizes in place (gathered parameters):
        # id -> (weak reference, the latest record counted for it).
        self._resizable: dict[int, tuple[_StorageRef, StorageRecord]] = {}
        # Their sizes at the last full poll (None: the set changed since), so that the
        # poll before every op costs one pass over them when nothing changed (most ops).
        self._resizable_sizes: list[int | None] | None = None
        self._grad_hooked: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        self._rank: tuple[int, int] | None = None
        # Frees can arrive on autograd's worker threads, and inside our own
        # bookkeeping (a dealloc in the middle of a dict update): re-entrant.
        self._lock = threading.RLock()
        self._scope: ExitStack | None = None
        self._used = False

    @property
    def live_bytes(self) -> int:
        """Bytes of counted storages not yet freed.

        Frozen at its last value once the block ends.
        """
        return self._live_bytes

    @property
    def peak_bytes(self) -> int:
        """The largest :attr:`live_bytes` seen inside the block."""
        return self._peak_bytes

    def timeline(self) -> Timeline:
        """The timeline so far as immutable values: live bytes per event, marks, storages.

        Example:
            >>> import torch
            >>> from remat.memory import track
            >>> with track() as t:
            ...     x = torch.zeros(1024)           # 4096 bytes
            ...     t.mark("made")
            ...     del x
            >>> timeline = t.timeline()
            >>> dict(timeline.marks)["made"], max(timeline.live_bytes), timeline.storages[0].freed
            (2, 4096, 3)
        """
        with self._lock:
            return Timeline(
                live_bytes=tuple(event[2] for event in self._events),
                marks=tuple(
                    (str(event[1]), index)
                    for index, event in enumerate(self._events)
                    if event[0] == "mark"
                ),
                storages=tuple(
                    StorageLifetime(record.nbytes, record.created, record.freed)
                    for record in self._records
                ),
            )

    @property
    def active(self) -> bool:
        """Whether the tracker is counting right now."""
        return self._scope is not None

    def storage_index(self, tensor: torch.Tensor) -> int | None:
        """Where a live tensor's counted storage is in :attr:`Timeline.storages`, or None.

        None when the storage is not counted (made before the block, or on
        another device). A wrapper subclass (``DTensor``) answers for the first
        tensor it wraps.
        """
        record = self._record_of(tensor)
        return None if record is None else record.index

    def _record_of(self, tensor: torch.Tensor) -> StorageRecord | None:
        """The record of a live tensor's storage, or None if it is not counted."""
        for storage in _storage_list(tensor):
            entry = self._storages.get(id(storage))
            return None if entry is None else entry[1]
        return None

    def mark(self, name: str) -> None:
        """Record the current :attr:`live_bytes` under ``marks[name]``.

        Marking a name again overwrites the earlier value. A mark named
        ``"forward_end"`` sets the end of forward of :meth:`report`.

        Example:
            >>> from remat.memory import track
            >>> with track() as t:
            ...     t.mark("start")
            >>> t.marks
            {'start': 0}
        """
        with self._lock:
            self.marks[name] = self._live_bytes
            self._mark_index[name] = self._event("mark", name, 0)

    def observe_ops(self, observer: OpObserver) -> None:
        """Tell ``observer`` of every op the tracker sees, from its own dispatch mode
        (:class:`remat._scope.OpObserver`); before the block starts, once. The planner's
        modelled clock is told so: a mode of its own would be one more that every op
        passes through.

        Example:
            >>> import torch
            >>> from remat.memory import track
            >>> class Counter:
            ...     ops = 0
            ...     def op_ran(self, func, args, kwargs, out):
            ...         self.ops += 1
            >>> counter, tracker = Counter(), track()
            >>> tracker.observe_ops(counter)
            >>> with tracker:
            ...     total = torch.ones(4).exp().sum()
            >>> counter.ops
            3
        """
        if self._used or self._op_observer is not None:
            raise CheckpointUsageError(
                "remat.memory: a tracker takes one op observer, before its block starts."
            )
        self._op_observer = observer

    def answer_ops(self, answers: Mapping[Any, OpAnswer]) -> None:
        """Answer the ops in ``answers`` (``OpOverload`` to ``answer(args, kwargs)``, which
        returns the op's result or ``NotImplemented`` to run it) in the tracker's own
        dispatch mode, below its count; before the block starts. A simulated pipeline rank
        answers its collective waits and its schedule's shape vote so, where a mode of their
        own would be one more that every op passes through.

        Example:
            >>> import torch
            >>> from remat.memory import track
            >>> tracker = track()
            >>> tracker.answer_ops({torch.ops.aten.exp.default: lambda args, kwargs: args[0]})
            >>> with tracker:
            ...     x = torch.ones(1024)
            ...     y = x.exp()           # answered: x itself, no new storage
            >>> y is x, tracker.peak_bytes
            (True, 4096)
        """
        if self._used:
            raise CheckpointUsageError("remat.memory: a tracker takes its answers before its block starts.")
        self._answers.update(answers)

    def __enter__(self) -> MemoryTracker:
        if self._used:
            raise CheckpointUsageError(
                "remat.memory: a MemoryTracker tracks one block only and this one "
                "was already used; create a new one with remat.memory.track()."
            )
        self._used = True
        self._rank = distributed_rank()
        scope = ExitStack()
        try:
            self._event("start", "", 0)
            if self._model is not None:
                self._count_model(self._model, scope)
            if self._optimizer is not None:
                self._count_optimizer(self._optimizer, scope)
            self._start_bytes = self._live_bytes
            scope.enter_context(_TrackingMode(self))
        except BaseException:
            scope.close()
            self._storages.clear()
            raise
        self._scope = scope
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.close()
        with self._lock:
            self._poll_resizes()
            self._classify_model_tensors()
            # Dropping the weak references cancels their callbacks: frees after
            # the block are not subtracted, and nothing points back at us.
            self._storages.clear()
            self._resizable.clear()
            self._resizable_sizes = None

    # -- reports -------------------------------------------------------------

    def report(self) -> MemoryReport:
        """The measurements so far as a :class:`~remat.memory.MemoryReport`.

        Example:
            >>> import torch
            >>> from remat.memory import track
            >>> w = torch.randn(64, 64, requires_grad=True)
            >>> with track() as t:
            ...     torch.sigmoid(w).sum().backward()
            >>> r = t.report()
            >>> r.forward_end_bytes   # sigmoid output (saved), loss, seed gradient
            16392
        """
        with self._lock:
            if self.active:
                self._classify_model_tensors()
            events = list(self._events)
            records = list(self._records)
            last = len(events) - 1
            forward_end = self._mark_index.get(FORWARD_END, self._forward_end_index)
            if forward_end is None:
                forward_end = last
            peak_index = self._peak_index
            device_peaks = dict(self._device_peak)
        timeline = tuple(
            TimelineEvent(i, kind, _name(subject), live, delta, phase, module)
            for i, (kind, subject, live, delta, phase, module) in enumerate(events)
        )
        return MemoryReport(
            peak_bytes=self._peak_bytes,
            forward_end_bytes=timeline[forward_end].live_bytes,
            end_bytes=timeline[last].live_bytes,
            start_bytes=self._start_bytes,
            peak_bytes_by_device=device_peaks,
            peak_index=peak_index,
            forward_end_index=forward_end,
            timeline=timeline,
            by_category=_usages(
                records, lambda r: r.category, peak_index, forward_end, last, CATEGORIES
            ),
            by_module=_usages(records, lambda r: r.module, peak_index, forward_end, last, ()),
            rank=None if self._rank is None else self._rank[0],
            world_size=None if self._rank is None else self._rank[1],
        )

    def enter_compiled_module(self, module: nn.Module) -> str | None:
        """Mark a compiled module's call starting (its hooks are not ours, see
        :func:`_compiled_modules`); returns its path, or None when it is not
        one of the tracked model's compiled modules."""
        path = self._compiled_paths.get(id(module))
        if path is not None:
            self._enter_module(module, path)
        return path

    def exit_compiled_module(self, path: str, output: object) -> None:
        """Mark the call :meth:`enter_compiled_module` marked ending, with its output."""
        self._exit_module(path, output)

    def compiled_graph_starts(self) -> None:
        """A compiled module's graph is about to run: count what its eager hooks gathered.

        A compiled call runs the module's hooks too, and a sharding engine's
        (FSDP2's gather: Dynamo runs its hooks eagerly) run there with no
        dispatch mode to see them. The parameters they gathered are the
        graph's inputs: counted from here, and watched for the engine's
        resizes (freed after forward, gathered again in backward) as in an
        eager module (``docs/design/compile.md``, "Static estimates").
        """
        with self._lock:
            # In forward the innermost module running is the compiled one (its
            # inner modules are opaque to the tracker's hooks).
            path = self._module_stack[-1] if self._module_stack else None
            if path is None or self._model is None or self._phase == "backward" or path not in self._compiled_paths.values():
                return
            if self._resizable:
                self._poll_resizes()
            for inner_path, inner in self._model.get_submodule(path).named_modules(prefix=path):
                self._watch_gathered_parameters(inner, inner_path)

    def count_compiled_output(self, op: object, inputs: object, outputs: object) -> None:
        """Count what a compiled graph's node allocates, as if an op had returned it.

        Compiled code runs outside dispatch modes; a static estimate
        (:func:`remat.memory.statically_compiled`) shows the tracker each
        buffer the compiler would allocate through here. Storages already
        counted, or aliasing ``inputs``, are not new memory.
        """
        with self._lock:
            if self._resizable:
                self._poll_resizes()
        self._record(op, inputs, outputs)

    # -- counting (hot path: once per op output) -----------------------------

    def _record(self, func: object, inputs: object, outputs: object) -> None:
        """Count the output storages of one op that are new memory."""
        input_ids: set[int] | None = None
        with self._lock:
            self._sync_phase()
            for storage in _storage_list(outputs):
                key = id(storage)
                entry = self._storages.get(key)
                if entry is not None:
                    nbytes = storage.nbytes()
                    record = entry[1]
                    if nbytes != record.nbytes:  # resized in place
                        delta, record.nbytes = nbytes - record.nbytes, nbytes
                        self._event("resize", record, delta, record.module)
                        self._on_device(record.device, delta)
                    continue
                if input_ids is None:
                    input_ids = {id(s) for s in _storage_list(inputs)}
                if key in input_ids:
                    continue  # aliases an input made before the block (or untracked)
                self._count(storage, func, self._new_category(), self._current_module())

    def _count(
        self, storage: torch.UntypedStorage, op: object, category: Category, module: str
    ) -> StorageRecord | None:
        device = storage.device
        if self._device_type is not None and device.type != self._device_type:
            return None  # another device: not what this tracker counts
        key = id(storage)
        name = self._device_names.get(device)
        if name is None:
            name = self._device_names[device] = str(device)
        record = StorageRecord(
            storage.nbytes(), name, category, module, op, len(self._events), len(self._records)
        )
        if self._capture_source and op is not None:
            record.source = _user_source()
        ref = weakref.ref(storage, partial(self._forget, key))
        self._storages[key] = (ref, record)
        self._records.append(record)
        self._event("alloc", record, record.nbytes, module)
        self._on_device(record.device, record.nbytes)
        return record

    def _event(self, kind: EventKind, subject: object, delta: int, module: str = "") -> int:
        """Append a timeline event (caller holds the lock); returns its index."""
        index = len(self._events)
        if delta:
            self._live_bytes += delta
            if self._live_bytes > self._peak_bytes:
                self._peak_bytes = self._live_bytes
                self._peak_index = index
        self._events.append((kind, subject, self._live_bytes, delta, self._phase, module))
        return index

    def _forget(self, key: int, _ref: _StorageRef) -> None:
        """Weakref callback: the storage with this id was freed."""
        with self._lock:
            entry = self._storages.pop(key, None)
            if entry is not None:
                record = entry[1]
                record.freed = len(self._events)
                self._event("free", record, -record.nbytes, record.module)
                self._on_device(record.device, -record.nbytes)

    def _poll_resizes(self) -> None:
        """Re-read the size of every watched storage (caller holds the lock).

        A shrink to zero is a free and a regrowth a new allocation (its own
        record, so the timeline and the per-category bytes at any moment are
        right); any other change is a resize of the live record.
        """
        if self._resizable_sizes is not None and self._resizable_sizes == _sizes(self._resizable):
            return  # nothing resized since the last full poll, which left every record in step
        for key, (ref, last) in list(self._resizable.items()):
            storage = ref()
            if storage is None:
                del self._resizable[key]
                continue
            nbytes = storage.nbytes()
            entry = self._storages.get(key)
            if entry is None:
                if nbytes:
                    record = self._count(storage, last.op, last.category, last.module)
                    if record is not None:
                        self._resizable[key] = (ref, record)
                continue
            record = entry[1]
            if nbytes == record.nbytes:
                continue
            if nbytes == 0:
                del self._storages[key]
                record.freed = len(self._events)
                self._event("free", record, -record.nbytes, record.module)
                self._on_device(record.device, -record.nbytes)
            else:
                delta, record.nbytes = nbytes - record.nbytes, nbytes
                self._event("resize", record, delta, record.module)
                self._on_device(record.device, delta)
        self._resizable_sizes = _sizes(self._resizable)

    def _watch_gathered_parameters(self, module: nn.Module, path: str) -> None:
        """Count the parameters a sharding engine gathered for ``module`` (lock held).

        Runs when the module's forward starts, after the engine's own
        pre-forward hook (FSDP2 prepends it): a parameter storage the tracker
        did not count from the start, or one an op made inside the block, is
        a gathered (unsharded) parameter.
        """
        for param in module.parameters(recurse=False):
            for storage in _storage_list(param):
                key = id(storage)
                if key in self._resizable:
                    continue
                entry = self._storages.get(key)
                if entry is None:
                    if not storage.nbytes():
                        continue
                    record = self._count(storage, "(gathered)", "unsharded_parameter", path)
                    if record is None:
                        continue
                elif entry[1].op is not None:  # made inside the block (a first all-gather)
                    record = entry[1]
                    record.category, record.module = "unsharded_parameter", path
                else:
                    continue  # counted from the start: the model's own parameter
                self._resizable[key] = (weakref.ref(storage), record)
                self._resizable_sizes = None
                self._hook_gathered_gradient(param, path)

    def _hook_gathered_gradient(self, param: torch.Tensor, path: str) -> None:
        """Gradients accumulated into a gathered parameter are gradients too."""
        scope = self._scope
        if (
            scope is None
            or not (isinstance(param, nn.Parameter) and param.requires_grad)
            or param in self._grad_hooked
        ):
            return
        self._grad_hooked.add(param)
        hook = partial(_on_grad_accumulated, weakref.ref(self), path)
        scope.enter_context(param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    def _mark_communication(self, args: object) -> None:
        """Buffers an in-place collective reads or writes (lock held)."""
        for storage in _storage_list(args):
            entry = self._storages.get(id(storage))
            if entry is not None and entry[1].category in ("activation", "temporary"):
                entry[1].category = "communication"

    def _on_device(self, device: str, delta: int) -> None:
        """Per-device live and peak bytes (each device apart from the others)."""
        live = self._device_live.get(device, 0) + delta
        self._device_live[device] = live
        if live > self._device_peak.get(device, 0):
            self._device_peak[device] = live

    # -- phases and attribution ----------------------------------------------

    def _sync_phase(self) -> None:
        """Move to the phase the running op belongs to (caller holds the lock)."""
        if current_backward_id() != -1:
            phase: Phase = "backward"
        elif self._optimizer_depth:
            phase = "optimizer"
        elif self._phase in ("backward", "optimizer"):
            phase = "other"
        else:
            phase = self._phase
        if phase != self._phase:
            self._set_phase(phase)

    def _set_phase(self, phase: Phase) -> None:
        if self._phase == "forward" and self._forward_end_index is None:
            self._forward_end_index = len(self._events) - 1
        self._phase = phase
        self._module_stack.clear()  # forwards do not span phases; drop anything stale
        self._event("phase", phase, 0)

    def _recomputing(self) -> bool:
        """Whether a module's forward is being re-run inside backward.

        Backward ops run with grad mode off (unless ``create_graph=True``), a
        recomputation with it on. The grad-mode test also skips modules left
        on the stack by a recomputation that stopped early (an exception that
        skips forward hooks).
        """
        return bool(self._module_stack) and torch.is_grad_enabled()

    def _new_category(self) -> Category:
        if self._phase == "forward" or (self._phase == "backward" and self._recomputing()):
            return "activation"
        return "temporary"

    def _current_module(self) -> str:
        if self._phase == "backward":
            return self._module_stack[-1] if self._recomputing() else self._grad_module
        return self._module_stack[-1] if self._module_stack else OUTSIDE_MODULES

    def _enter_module(self, module: nn.Module, path: str) -> None:
        with self._lock:
            self._sync_phase()
            if path == "" and self._phase != "backward" and self._phase != "forward":
                self._set_phase("forward")  # the model's forward starts a new step
            if self._resizable:
                self._poll_resizes()
            self._module_stack.append(path)
            self._event("enter", path, 0, path)
            self._watch_gathered_parameters(module, path)

    def _exit_module(self, path: str, output: object) -> None:
        with self._lock:
            if self._resizable:
                self._poll_resizes()
            if path in self._module_stack:
                while self._module_stack.pop() != path:
                    pass
            self._event("exit", path, 0, path)
            in_backward = self._phase == "backward"
        if in_backward or not torch.is_grad_enabled():
            return
        # The gradient of a module's output arrives just before its backward ops
        # run; tensor hooks tell us which module's backward is running.
        ref = weakref.ref(self)
        for tensor in _tensors(output):
            # Leaves (a module returning a parameter or its input) are skipped:
            # a hook would stay on them for good, and no module backward follows.
            if tensor.requires_grad and tensor.grad_fn is not None:
                tensor.register_hook(partial(_on_output_grad, ref, path))  # type: ignore[no-untyped-call]

    def _on_output_grad(self, path: str, grad: torch.Tensor) -> None:
        with self._lock:
            # A tensor that is the output of nested modules gets one hook per
            # module, innermost first: the innermost module's backward runs next.
            if self._last_grad is not None and self._last_grad() is grad:
                return
            self._last_grad = weakref.ref(grad)
            self._sync_phase()
            if self._resizable:
                self._poll_resizes()
            self._grad_module = path
            self._module_stack.clear()  # no forward runs while a gradient arrives
            self._event("backward_enter", path, 0, path)

    def _count_model(self, model: nn.Module, scope: ExitStack) -> None:
        ref = weakref.ref(self)
        opaque = _compiled_modules(model)
        for path, module in model.named_modules():
            if id(module) in opaque:
                if compiled_call(module) is not None:
                    self._compiled_paths[id(module)] = path
            else:
                scope.enter_context(module.register_forward_pre_hook(partial(_on_enter, ref, path)))
                # always_call: a recomputation stopped early (an exception) still exits.
                exit_hook = partial(_on_exit, ref, path)
                scope.enter_context(module.register_forward_hook(exit_hook, always_call=True))
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                self._param_paths[id(tensor)] = path
                self._count_existing(tensor, "parameter", path)
                if tensor.grad is not None:
                    self._count_existing(tensor.grad, "gradient", path)
                if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
                    hook = partial(_on_grad_accumulated, ref, path)
                    handle = tensor.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
                    scope.enter_context(handle)

    def _count_optimizer(self, optimizer: Any, scope: ExitStack) -> None:
        ref = weakref.ref(self)
        scope.enter_context(optimizer.register_step_pre_hook(partial(_on_step, ref, 1)))
        scope.enter_context(optimizer.register_step_post_hook(partial(_on_step, ref, -1)))
        for param, state in optimizer.state.items():
            path = self._param_paths.get(id(param), OUTSIDE_MODULES)
            for tensor in _tensors(state):
                self._count_existing(tensor, "optimizer_state", path)

    def _count_existing(self, tensor: torch.Tensor, category: Category, module: str) -> None:
        """Count a tensor that exists at the start (parameter, gradient, state)."""
        for storage in _storage_list(tensor):
            if id(storage) not in self._storages:
                self._count(storage, None, category, module)

    def _classify(self, tensor: torch.Tensor, category: Category, module: str) -> None:
        record = self._record_of(tensor)
        if record is not None and record.category not in ("parameter", "unsharded_parameter"):
            record.category = category
            record.module = module

    def _classify_model_tensors(self) -> None:
        """Gradients and optimizer state are known by where they end up."""
        if self._model is not None:
            for path, module in self._model.named_modules():
                for param in module.parameters(recurse=False):
                    if param.grad is not None:
                        self._classify(param.grad, "gradient", path)
        if self._optimizer is not None:
            for param, state in self._optimizer.state.items():
                path = self._param_paths.get(id(param), OUTSIDE_MODULES)
                for tensor in _tensors(state):
                    self._classify(tensor, "optimizer_state", path)


def track(
    model: nn.Module | None = None,
    *,
    optimizer: Any = None,
    device: str | None = None,
) -> MemoryTracker:
    """Track live tensor bytes inside a ``with`` block.

    Returns a fresh :class:`MemoryTracker`; entering it starts counting,
    leaving it stops. Without ``model``, only storages created inside the
    block count. With ``model`` (an ``nn.Module``), its parameters, buffers
    and gradients count from the start, every storage gets the path of the
    module that made it, and the timeline gets module enter/exit markers.
    With ``optimizer``, its state counts from the start and its ``step()`` is
    the ``optimizer`` phase. With ``device`` (``"cuda"``), only storages on
    that device type count. Call :meth:`MemoryTracker.report` for the data.

    Example:
        >>> import torch
        >>> from remat.memory import track
        >>> w = torch.randn(256, 256, requires_grad=True)
        >>> with track() as t:
        ...     loss = torch.sigmoid(w).sum()   # sigmoid saves its output
        ...     t.mark("forward_end")
        ...     loss.backward()
        >>> t.marks["forward_end"]     # sigmoid(w): 262144 bytes, loss: 4 bytes
        262148
    """
    return MemoryTracker(model, optimizer, device=device)


def tracker_of(mode: object) -> MemoryTracker | None:
    """The tracker a dispatch mode counts for, or None when it is not a tracker's mode."""
    return mode._tracker if isinstance(mode, _TrackingMode) else None


def _compiled_modules(model: nn.Module) -> set[int]:
    """The ids of the compiled modules and of the modules inside them.

    Compiled code is opaque to module hooks, and the compiler would trace a
    hook of ours into its graph (a lock it cannot trace) instead of calling
    it: a compiled module's caller marks its call instead
    (:meth:`MemoryTracker.enter_compiled_module`).
    """
    opaque: set[int] = set()
    for module in model.modules():
        if id(module) not in opaque and compiled_call(module) is not None:
            opaque.update(id(sub) for sub in module.modules())
    return opaque


# Hook trampolines hold the tracker weakly: hooks left on tensors after the
# block (output-gradient hooks) must neither keep it alive nor count anything.
def _live(ref: weakref.ReferenceType[MemoryTracker]) -> MemoryTracker | None:
    tracker = ref()
    return tracker if tracker is not None and tracker.active else None


def _on_enter(ref: weakref.ReferenceType[MemoryTracker], path: str, module: nn.Module, args: object) -> None:
    tracker = _live(ref)
    if tracker is not None:
        tracker._enter_module(module, path)


def _on_exit(
    ref: weakref.ReferenceType[MemoryTracker], path: str, module: nn.Module, args: object, output: object
) -> None:
    tracker = _live(ref)
    if tracker is not None:
        tracker._exit_module(path, output)


def _on_output_grad(ref: weakref.ReferenceType[MemoryTracker], path: str, grad: torch.Tensor) -> None:
    tracker = _live(ref)
    if tracker is not None:
        tracker._on_output_grad(path, grad)


def _on_grad_accumulated(ref: weakref.ReferenceType[MemoryTracker], path: str, param: torch.Tensor) -> None:
    tracker = _live(ref)
    if tracker is not None and param.grad is not None:
        with tracker._lock:
            tracker._classify(param.grad, "gradient", path)


def _on_step(ref: weakref.ReferenceType[MemoryTracker], step: int, optimizer: Any, *args: object) -> None:
    tracker = _live(ref)
    if tracker is None:
        return
    with tracker._lock:
        tracker._optimizer_depth += step
        tracker._sync_phase()
        if step < 0:
            tracker._classify_model_tensors()


# TorchDispatchMode is unannotated in torch, hence the two ignores.
class _TrackingMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Forwards every op unchanged and reports its inputs and outputs."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._tracker = tracker
        self._answers = tracker._answers
        observer = tracker._op_observer
        self._observe = None if observer is None else observer.op_ran
        # Those who look for these methods on the mode stack find the observer's here.
        for protocol in (METERS_POLICY_OPS, COMPILED_GRAPH_RAN):
            method = getattr(observer, protocol, None)
            if method is not None:
                setattr(self, protocol, method)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is DEVICE_QUERY:
            # Fake tensors answer C++'s every ``tensor.device()`` through dispatch: most
            # of a simulated step's calls (61,220 of 101,411 for a pipelined Llama-3.1-8B
            # step). It allocates nothing, so neither polling nor counting is due;
            # the next op polls what a sharding engine resized before it.
            return func(*args, **(kwargs or {}))
        tracker = self._tracker
        if tracker._resizable:  # sizes a sharding engine changed since the last op
            with tracker._lock:
                tracker._poll_resizes()
        out = answered_or_run(self._answers, func, args, kwargs or {})
        # A view op's output aliases its input by schema: nothing new, even where
        # a fake-tensor kernel hands back a fresh storage for it.
        if not getattr(func, "is_view", False):
            tracker._record(func, (args, kwargs), out)
            if getattr(func, "namespace", None) == "c10d":
                with tracker._lock:
                    tracker._mark_communication((args, kwargs))
        if self._observe is not None:
            self._observe(func, args, kwargs or {}, out)
        return out


def _sizes(watched: dict[int, tuple[_StorageRef, StorageRecord]]) -> list[int | None]:
    """The byte sizes of watched storages, in the dict's order (None: freed)."""
    return [None if (storage := ref()) is None else storage.nbytes() for ref, _ in watched.values()]


def _storage_list(tree: object) -> list[torch.UntypedStorage]:
    """The storages of the tensors in a nest of tuples, lists and dicts.

    A list built without generators: this runs twice for most ops."""
    found: list[torch.UntypedStorage] = []
    _collect_storages(tree, found)
    return found


def _collect_storages(tree: object, found: list[torch.UntypedStorage]) -> None:
    if isinstance(tree, torch.Tensor):
        cls = type(tree)
        if cls is not torch.Tensor and cls is not nn.Parameter:
            inner = wrapped_tensors(tree)
            if inner is not None:  # DTensor & co.: the memory is in the tensors it wraps
                for tensor in inner:
                    _collect_storages(tensor, found)
                return
        try:
            found.append(tree.untyped_storage())
        except (RuntimeError, NotImplementedError, TypeError):
            pass  # sparse, nested or opaque subclasses own no plain storage
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            if isinstance(item, (torch.Tensor, tuple, list, dict)):
                _collect_storages(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            if isinstance(item, (torch.Tensor, tuple, list, dict)):
                _collect_storages(item, found)


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _name(subject: object) -> str:
    if isinstance(subject, StorageRecord):
        return "(existing)" if subject.op is None else str(subject.op)
    return str(subject)


def _usages(
    records: list[StorageRecord],
    key: Callable[[StorageRecord], str],
    peak: int,
    forward_end: int,
    end: int,
    order: tuple[str, ...],
) -> tuple[Usage, ...]:
    """Bytes per key at the peak, end of forward and end, plus allocated bytes."""
    table: dict[str, list[int]] = {name: [0, 0, 0, 0] for name in order}
    for record in records:
        row = table.setdefault(key(record), [0, 0, 0, 0])
        for column, index in enumerate((peak, forward_end, end)):
            if record.live_at(index):
                row[column] += record.nbytes
        if record.op is not None:
            row[3] += record.nbytes
    usages = [Usage(name, *row) for name, row in table.items()]
    if not order:
        usages.sort(key=lambda u: (-u.at_peak_bytes, -u.allocated_bytes, u.name))
    return tuple(usages)


def _user_source() -> str | None:
    """``file:line`` of the innermost frame of user code (remat's models count)."""
    frame = user_frame()
    return None if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
