"""Selective checkpointing: keep some op outputs from the forward, rerun the rest.

Two small dispatch modes share one :class:`OpCache`:

* :class:`RecordOps` runs in the forward. For each operator it asks the
  policy; a "save" decision stores the output (detached, sharing the version
  counter so later in-place writes are detected) under ``(op, n-th call)``.
* :class:`ReplayOps` runs in the recomputation. The n-th call of an op whose
  output was saved returns the stored value instead of running. Entries serve
  every recomputation of the region (``retain_graph`` repeats, double
  backward) and are freed with the region's frame, when the graph lets go of
  the region (``docs/design/lifetimes.md``).

In-place *metadata* ops (``squeeze_``, ``t_``... tagged ``inplace_view``) bump
the version counter without touching data; ``torch.matmul`` on a vector does
exactly that to its own ``mm`` output. The recorder re-reads the version after
such an op instead of calling it a user mutation (torch 2.13 raises a false
"mutated" error there).

Ops that write their arguments (``mul_``, ``out=`` variants) are never served
from the cache, whatever the policy says: the recomputation must apply the
write to its own tensors (torch 2.13 replays the forward's alias instead, and
the recomputed values silently differ). They are also checked against the
cached outputs' storages: a write through an alias with its own version
counter (``torch.matmul``'s ``_unsafe_view`` of its ``mm``) marks the entry
stale, so replaying it is the usual "modified in place" error.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from remat._compat.autograd import version_of
from remat._compat.dispatch import (
    TorchDispatchMode,
    detach_sharing_version,
    detach_unseen,
    no_dispatch_modes,
    tracing_modes_active,
    written_arguments,
)
from remat._compat.pytree import tree_flatten, tree_unflatten
from remat._engine.optable import SAC_IGNORED_OPS, OpInfo, OpTable
from remat._scope import PolicyOpMeter, SavedTensorObserver, current_observer, policy_op_meter
from remat.errors import CheckpointError, CheckpointTypeError, CheckpointUsageError
from remat.names import NAMED_OP
from remat.policies import CheckpointPolicy, Decision, policy_of_ops
from remat.storage.choice import Storage, decide, event_of, storage_for
from remat.storage.host import HostTransfer
from remat.storage.stash import StoredTensor
from remat.storage.store import Stashes

__all__ = [
    "SAC_IGNORED_OPS",
    "OpCache",
    "RecordOps",
    "ReplayOps",
    "SelectiveContexts",
    "create_selective_checkpoint_contexts",
]



def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage object of ``tensor``, which its views share; None if it has none.

    Aliases are told apart by this object, never by its address
    (docs/design/architecture.md, "Principles the code cites"): wrapper subclasses (TwoTensor, DTensor, float8) have storages without
    data, and freed memory is reused. torch keeps one Python object per
    storage alive as long as the storage (checked 2.4-2.15), so ``is`` works.
    Sparse or jagged tensors, and subclasses that refuse, have no storage here.
    """
    if tensor.layout is not torch.strided:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class _Saved:
    """One cached op output: the detached value and the versions it had.

    An offloaded or compressed output is a stored copy taken in the forward
    (:class:`~remat.storage.stash.StoredTensor`); it is brought back to its
    device when the recomputation asks for it. The copies keep witnesses of
    the originals' version counters, so an in-place write after caching is
    reported as for outputs kept on the device.

    The entry serves every recomputation of its region (one per backward)
    and lives as long as the graph holds the region. A recomputation repeats
    the forward's in-place writes on what it is served, so an output the
    forward wrote into after caching is served as a private copy: the next
    backward must get the value as it was cached (docs/design/lifetimes.md).
    """

    __slots__ = ("copies", "origins", "rewritten", "storage_written", "tensors", "value", "versions")

    def __init__(self, out: Any, asked: Storage, stashes: Stashes | None, observer: SavedTensorObserver | None) -> None:
        # Tuples, not lists: an entry lives until backward, and a tuple of
        # ints (``versions``) or an empty one is not tracked by the garbage
        # collector (docs/design/performance.md, "Objects a region keeps").
        self.copies: tuple[StoredTensor, ...] = ()
        self.tensors: tuple[torch.Tensor, ...] = ()
        self.origins: tuple[Any, ...] = ()
        self.rewritten = False
        self.storage_written = False
        if isinstance(out, torch.Tensor):  # most ops: no pytree walk
            where = decide(out, asked, "policy") if asked.stored else asked
            if observer is not None:
                observer(event_of(where, "policy"), out)  # type: ignore[arg-type]  # saved: an event
            if not where.stored:
                kept = detach_sharing_version(out)
                self.tensors = (kept,)
                self.value: Any = kept
                self.versions: tuple[int, ...] = (version_of(kept),)
            else:
                self.origins = (_storage_ref(out),)
                assert stashes is not None, "remat bug: a stored output without its stashes"
                copied = stashes.store(out, where)
                self.copies = (copied,)
                self.value = copied
                self.versions = ()
            return
        leaves, spec = tree_flatten(out)
        # Each tensor where the decision puts it: with a format, the float
        # tensors it shrinks are compressed and the rest kept as they are.
        stored = asked.stored
        wheres = [
            (decide(x, asked, "policy") if stored else asked) if isinstance(x, torch.Tensor) else None
            for x in leaves
        ]
        if observer is not None:
            for leaf, leaf_where in zip(leaves, wheres, strict=True):
                if leaf_where is not None:
                    observer(event_of(leaf_where, "policy"), leaf)  # type: ignore[arg-type]
        if stored:
            self.origins = tuple(
                _storage_ref(x) for x, where in zip(leaves, wheres, strict=True) if where is not None and where.stored
            )
        leaves = [
            x if where is None
            else stashes.store(x, where) if where.stored and stashes is not None
            else detach_sharing_version(x)
            for x, where in zip(leaves, wheres, strict=True)
        ]
        self.copies = tuple(x for x in leaves if isinstance(x, StoredTensor))
        self.tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        self.value = tree_unflatten(leaves, spec)
        self.versions = tuple(version_of(x) for x in self.tensors)

    @classmethod
    def kept(cls, out: torch.Tensor) -> _Saved:
        """An entry for a plain tensor output of an op that is no view, made in
        the recording mode without a detach (see :meth:`settle`).

        Inside the mode a detach would get a counter of its own (the
        ADInplaceOrView key is off there), and the guard that turns it back on
        costs more than the rest of the entry. The op's output keeps its own
        version counter when autograd takes it over (it is no view), so its
        version now is the one to compare with, and a detach made once the
        mode is left shares that counter.
        """
        saved = cls.__new__(cls)
        saved.copies = saved.origins = ()
        saved.rewritten = saved.storage_written = False
        saved.tensors = (out,)
        saved.value = out
        saved.versions = (version_of(out),)
        return saved

    def settle(self, traced: bool) -> None:
        """Hold a detached alias instead of the op's output (whose autograd
        history would otherwise live as long as the region: a cycle through
        the saved-tensor hooks that the garbage collector cannot break).

        ``traced``: a tracer records tensors (its detach must be seen, or the
        replayed value is a constant to it: docs/design/tracing.md).
        """
        # (a plain tensor, and the recording mode is already off)
        kept = self.value.detach() if traced else detach_unseen(self.value)
        self.tensors = (kept,)
        self.value = kept

    def restore(self, mutated: bool) -> Any:
        """The saved value, on its original device, as new tensor objects.

        New objects because autograd attaches the recomputation's history to
        whatever the op returns: attached to the cached tensor itself, that
        history (whose hooks reference the frame, which references this cache)
        would form a cycle through C++ that gc cannot collect. A private copy
        when the recomputation will write into it (``mutated``: what
        :meth:`mutated` said; see the class docstring).
        """
        value = self.value
        private = mutated or self.rewritten
        if isinstance(value, torch.Tensor):
            return _private(value) if private else value.detach()
        if isinstance(value, StoredTensor):
            restored = value.restore(check_version=False)
            return _private(restored) if private else restored
        leaves, spec = tree_flatten(value)
        leaves = [
            x.restore(check_version=False) if isinstance(x, StoredTensor)
            else x.detach() if isinstance(x, torch.Tensor)
            else x
            for x in leaves
        ]
        if private:
            leaves = [_private(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        return tree_unflatten(leaves, spec)

    def refresh_if_aliased(self, storage: torch.UntypedStorage) -> None:
        """Accept the version bump of an in-place *metadata* op on a tensor of ``storage``.

        The bump happens in the ADInplaceOrView kernel, above this dispatch
        mode, after the op returns, so the recorder calls this at its next op
        (or on exit) and the version is read as it is then. Not ``+ 1`` at the
        op: a functorch batching rule calls ``squeeze_`` below that kernel (no
        bump), and the entry then looked modified (``torch.func.vmap`` over
        ``grad`` of a ``Linear``; docs/design/tracing.md).
        """
        self.versions = tuple(
            version_of(cached) if storage_of(cached) is storage else version
            for cached, version in zip(self.tensors, self.versions, strict=True)
        )

    def note_write(self, storage: torch.UntypedStorage) -> None:
        """An in-place op of the forward wrote into ``storage``: stale if it is ours.

        The version counters miss writes through an alias that has a counter of
        its own: ``torch.matmul`` returns its ``mm`` output through
        ``_unsafe_view``, and ``out.add_(...)`` on that result changes the
        cached ``mm`` value without bumping its version. Host copies are
        snapshots taken before the write, so they stay right.
        """
        if any(storage_of(cached) is storage for cached in self.tensors):
            self.storage_written = True
        elif any(origin() is storage for origin in self.origins):
            self.rewritten = True  # the snapshot stays right; the replay gets a copy

    def mutated(self) -> bool:
        if self.storage_written:
            return True
        for tensor, version in zip(self.tensors, self.versions, strict=True):  # (no generator: asked per replay)
            if version_of(tensor) != version:
                return True
        for copy in self.copies:
            if copy.modified():
                return True
        return False


def _storage_ref(tensor: torch.Tensor) -> Any:
    """A weak reference to ``tensor``'s storage (a dead one where it has none)."""
    storage = storage_of(tensor)
    return weakref.ref(storage) if storage is not None else _NO_STORAGE


def _NO_STORAGE() -> None:
    return None


def _private(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` that no dispatch mode sees (it is not the function's op)."""
    with no_dispatch_modes():
        return tensor.detach().clone()


_RECOMPUTE = "recompute"
_NONE: dict[Any, Any] = {}  # an empty mapping shared by the modes that track no producers (never written)


class OpCache:
    """Outputs saved by :class:`RecordOps`, replayed by :class:`ReplayOps`."""

    __slots__ = ("allow_mutation", "entries", "observer", "stashes")

    def __init__(self, allow_mutation: bool) -> None:
        self.allow_mutation = allow_mutation
        self.entries: dict[OpInfo, list[_Saved | str]] = {}
        self.observer = current_observer()
        self.stashes: Stashes | None = None  # made with the first stored output

    def save(self, out: Any, decision: Decision, op: Any) -> _Saved:
        """Cache ``out`` of ``op`` where ``decision`` says (on device, a host copy, or compressed).

        ``op`` names what made ``out`` in an error (an operator, or a name).
        """
        asked = storage_for(decision)
        stashes = self.stashes
        if asked.stored:
            if asked.format is not None:
                _require_float(out, asked, op)
            if stashes is None:
                # The recomputation replays host copies in save order; a cache that
                # allows writes after saving guards each copy against them.
                new_host = functools.partial(HostTransfer, backward_order=False, guard_writes=self.allow_mutation)
                stashes = self.stashes = Stashes(new_host)
        return _Saved(out, asked, stashes, self.observer)


def _require_float(out: Any, asked: Storage, op: Any) -> None:
    """Refuse to compress an output with no float tensor (a name or an op list on the wrong op)."""
    leaves = tree_flatten(out)[0]
    if not any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves):
        kinds = ", ".join(str(x.dtype) for x in leaves if isinstance(x, torch.Tensor)) or "none"
        raise CheckpointUsageError(
            f"selective checkpoint: the policy compresses {op if isinstance(op, str) else f'the output of {op}'} ({asked.format}), which "
            f"has no float tensor (dtypes: {kinds}). Integer and bool tensors are never "
            "compressed: keep or recompute this op (a name on such a tensor, or an op "
            "list that includes it, is the usual cause)."
        )


class _Producer:
    """Where a storage was first written in this forward, so a name can reach it."""

    __slots__ = ("outputs", "position", "recorded", "single", "version")

    def __init__(self, recorded: list[_Saved | str], out: Any, version: int) -> None:
        self.recorded = recorded
        self.position = len(recorded)  # index its entry is about to get
        self.version = version
        # Weak: the producer must not keep its output alive (RecordOps holds
        # the last few strongly). One tensor is the common case; keep it cheap.
        self.single = isinstance(out, torch.Tensor)
        self.outputs: Any = (
            weakref.ref(out)
            if self.single
            else tuple(weakref.ref(x) if isinstance(x, torch.Tensor) else x for x in out)
        )

    def output(self) -> Any:
        """The op's output again, or None if part of it is gone."""
        if self.single:
            return self.outputs()
        leaves = []
        for item in self.outputs:
            if isinstance(item, weakref.ref):
                item = item()
                if item is None:
                    return None
            leaves.append(item)
        return tuple(leaves)


_PRODUCERS_KEPT = 64
"""Names usually follow their producer closely; older storages are forgotten."""

_OUTPUTS_HELD = 2
"""Outputs of the last few producers are held strongly: a multi-output op's
other outputs (e.g. attention's log-sum-exp) would otherwise die at once
inside a region, and a name applied a few view ops later could not save the
producer whole."""


class RecordOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Forward half of selective checkpointing: ask the policy, save outputs."""

    def __init__(self, policy: Callable[..., Any], cache: OpCache, table: OpTable | None = None) -> None:
        # No TorchDispatchMode.__init__: torch makes the mode's flag stacks on
        # the first __enter__ when they are missing (checked 2.4-2.15), three
        # deques fewer per region (docs/design/performance.md).
        self.policy = policy
        self.cache = cache
        # Operator facts and by-op decisions (save_matmuls, op lists), shared
        # by the regions of one policy (docs/design/performance.md).
        self.table = table if table is not None else OpTable(policy)
        self.infos = self.table.infos
        self.passing = self.table.passing
        # id(storage) -> (the storage, weakly; the op that allocated it). Views and
        # in-place ops do not count. Weak, so a dead storage whose id is reused
        # is told apart. Insertion order = recency.
        # Producers are tracked so that a name's decision can move to the op
        # that made the tensor; a policy with no opinion on names needs none
        # (and its regions make neither container).
        self.tracks_producers = tracks = self.table.tracks_names
        self.producers: dict[int, tuple[weakref.ref[torch.UntypedStorage], _Producer]] = {} if tracks else _NONE
        self.held_outputs: deque[Any] | None = deque(maxlen=_OUTPUTS_HELD) if tracks else None
        # The last few saved entries: an in-place metadata op on one of them
        # refreshes its versions. Forward only (the mode lives as long as it).
        self.recent: deque[_Saved] = deque(maxlen=4)
        # Entries kept the short way, still holding the op's output itself
        # (detached when the mode exits: see _Saved.kept).
        self.unsettled: list[_Saved] = []
        self.quiet = cache.observer is None  # no memory tracker to tell
        # Storages an in-place metadata op just changed: the saved entries on
        # them re-read their versions at the next op (see _Saved.refresh_if_aliased).
        self.aliased: list[torch.UntypedStorage] = []
        # Told of every op this mode handles, where a modelled clock times the step
        # (remat._scope.policy_op_meter); found again at every entry.
        self.meter: PolicyOpMeter | None = None

    def __enter__(self) -> RecordOps:
        self.meter = policy_op_meter()
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def _reread_versions(self) -> None:
        for storage in self.aliased:
            for saved in self.recent:
                saved.refresh_if_aliased(storage)
        self.aliased = []

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        if self.aliased:
            self._reread_versions()
        if self.unsettled:
            traced = tracing_modes_active()
            for saved in self.unsettled:
                saved.settle(traced)
        self.unsettled = []
        if self.held_outputs is not None:  # (a mode kept by its caller holds no outputs)
            self.producers.clear()
            self.held_outputs.clear()
            self.recent.clear()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if self.aliased:  # versions to re-read now that the last op's bump, if any, is done
            self._reread_versions()
        if self.meter is not None:
            self.meter(func)
        out = func(*args, **kwargs) if kwargs else func(*args)
        key = id(func)
        if key in self.passing:  # (the table holds the operator: its id stays its own)
            return out
        info = self.infos.get(key)  # OpTable.info, inlined: asked for every other op
        if info is None or info.op is not func:
            info = self.table.info(func)
        if info.passes:
            return out
        if info.keeps and self.quiet and type(out) is torch.Tensor:  # save_matmuls' matmul
            saved = _Saved.kept(out)
            entries = self.cache.entries
            recorded = entries.get(info)
            if recorded is None:
                recorded = entries[info] = []
            recorded.append(saved)
            self.recent.append(saved)
            self.unsettled.append(saved)
            return out
        kwargs = kwargs or {}
        cache = self.cache
        inplace_view, mutates = info.inplace_view, info.mutates
        if inplace_view and args and isinstance(args[0], torch.Tensor):
            storage = storage_of(args[0])
            if storage is not None:
                self.aliased.append(storage)
        if mutates and not inplace_view:
            self._note_writes(written_arguments(func, args, kwargs))
        decision = info.decision  # known when the policy decides by the op alone
        if decision is None:
            decision = self.table.decide(info, args, kwargs, out)
        if self.table.unrecorded(info):
            return out  # rerun every time: the replay knows it from the op alone
        recorded = cache.entries.get(info)
        if recorded is None:
            recorded = cache.entries[info] = []
        what = func
        if func is NAMED_OP:
            what = f"the tensor named {args[1]!r}"
            decision = self._apply_to_producer(args[0], decision, what)
        elif self.tracks_producers and not info.is_view and not mutates:
            self._remember_producer(recorded, out)
        # An op that writes its arguments (mul_, out=...) always reruns: serving
        # its output from the cache would skip the write on the recomputation's
        # tensors, which later ops read (and its output only aliases them).
        saves = decision.saves and not mutates
        recorded.append(self._save(out, decision, what) if saves else _RECOMPUTE)
        return out

    def _save(self, out: Any, decision: Decision, op: Any) -> _Saved:
        saved = self.cache.save(out, decision, op)
        self.recent.append(saved)
        return saved

    def _note_writes(self, written: list[Any]) -> None:
        for tensor in written:
            storage = storage_of(tensor) if isinstance(tensor, torch.Tensor) else None
            if storage is None:
                continue
            for recorded in self.cache.entries.values():
                for entry in recorded:
                    if isinstance(entry, _Saved):
                        entry.note_write(storage)

    def _remember_producer(self, recorded: list[_Saved | str], out: Any) -> None:
        if isinstance(out, torch.Tensor):
            leaves: Any = (out,)
        elif isinstance(out, (tuple, list)):
            leaves = out  # aten ops return flat tuples or lists of tensors
        else:
            return
        producer: _Producer | None = None
        producers = self.producers
        for leaf in leaves:
            storage = storage_of(leaf) if isinstance(leaf, torch.Tensor) else None
            if storage is not None:
                key = id(storage)
                known = producers.pop(key, None)  # re-inserted last: most recent
                if known is not None and known[0]() is storage:
                    # An alias that is no view op (torch.matmul returns its mm
                    # through _unsafe_view): the op that wrote the storage first
                    # stays its producer, so a name saves the matmul itself.
                    producers[key] = known
                    continue
                if producer is None:
                    producer = _Producer(recorded, out, version_of(leaf))
                producers[key] = (weakref.ref(storage), producer)
        if producer is not None:
            assert self.held_outputs is not None, "remat bug: producers tracked without their outputs"
            self.held_outputs.append(out)
            while len(producers) > _PRODUCERS_KEPT:
                del producers[next(iter(producers))]

    def _apply_to_producer(self, tensor: torch.Tensor, decision: Decision, what: str) -> Decision:
        """A name's explicit decision moves to the op that produced the tensor.

        Returns the decision left for the ``named`` op itself: nothing when the
        producer took it, else the decision (the alias is kept instead).
        PREFER_RECOMPUTE (the default, "no opinion") leaves the producer alone.
        """
        if decision is CheckpointPolicy.PREFER_RECOMPUTE:
            return decision
        storage = storage_of(tensor)
        known = self.producers.get(id(storage)) if storage is not None else None
        producer = known[1] if known is not None and known[0]() is storage else None
        out = producer.output() if producer is not None else None
        if producer is None or out is None or version_of(tensor) != producer.version:
            return decision  # produced outside the region, gone, or modified since
        producer.recorded[producer.position] = (
            self._save(out, decision, what) if decision.saves else _RECOMPUTE
        )
        return CheckpointPolicy.PREFER_RECOMPUTE


class ReplayOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Recompute half of selective checkpointing: serve saved outputs."""

    def __init__(self, cache: OpCache, table: OpTable) -> None:
        # No TorchDispatchMode.__init__: torch makes the mode's flag stacks on
        # the first __enter__ when they are missing (checked 2.4-2.15), so a
        # region that is never recomputed, or not yet, keeps no empty deques.
        self.cache = cache
        self.table = table  # the forward's: cache entries are keyed by its OpInfo objects
        self.infos = table.infos
        self.passing = table.passing
        self.calls: dict[OpInfo, int] = _NONE  # made on entering: a region kept until backward keeps no dict
        self.meter: PolicyOpMeter | None = None  # as RecordOps.meter

    def __enter__(self) -> ReplayOps:
        self.calls = {}  # each recomputation counts op calls from zero
        self.meter = policy_op_meter()
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if self.meter is not None:
            self.meter(func)
        key = id(func)
        if key in self.passing:
            return func(*args, **kwargs) if kwargs else func(*args)
        info = self.infos.get(key)  # OpTable.info, inlined: asked for every other op
        if info is None or info.op is not func:
            info = self.table.info(func)
        if info.passes:
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if not info.keeps and (info.ignored or self.table.unrecorded(info)):
            return func(*args, **kwargs)  # never recorded: the forward reran it too
        index = self.calls.get(info, 0)
        self.calls[info] = index + 1
        recorded = self.cache.entries.get(info)
        if recorded is None or index >= len(recorded):
            raise CheckpointError(
                f"selective checkpoint: the recomputation ran {func} (call #{index}) that the "
                "forward did not run. The checkpointed function must run the same ops when "
                "recomputed (no randomness or global state that changes the control flow)."
            )
        entry = recorded[index]
        if entry is _RECOMPUTE:
            return func(*args, **kwargs)
        assert isinstance(entry, _Saved), "remat bug: unknown selective cache entry"
        mutated = entry.mutated()
        if mutated and not self.cache.allow_mutation:
            raise CheckpointError(
                f"selective checkpoint: the output of {func} saved in the forward was modified "
                "in place afterwards, so backward would use the wrong value. Avoid the "
                "in-place op, save a different op, or pass allow_cache_entry_mutation=True "
                "if the mutation is intended."
            )
        return entry.restore(mutated)


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Callable[..., Any] | list[Any],
    allow_cache_entry_mutation: bool = False,
) -> tuple[RecordOps, ReplayOps]:
    """The two contexts (forward, recompute) that make a checkpoint selective.

    Args:
        policy_fn_or_list: a policy ``(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool``,
            or a list of ``OpOverload``s to save (everything else is recomputed).
        allow_cache_entry_mutation: do not raise when a saved output was
            modified in place after it was saved.

    Example:
        >>> import functools, torch, remat
        >>> ops = [torch.ops.aten.mm.default]
        >>> context_fn = functools.partial(remat.create_selective_checkpoint_contexts, ops)
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> y = remat.checkpoint(lambda t: (t @ t).sigmoid(), x, context_fn=context_fn)
    """
    return SelectiveContexts(policy_fn_or_list, allow_cache_entry_mutation)()


class SelectiveContexts:
    """A ``context_fn`` for one policy: each call gives a region its two modes.

    The policy is checked and its :class:`~remat._engine.optable.OpTable`
    made once; every region it serves shares them (a policy given to
    :class:`remat.CheckpointOptions` is turned into one of these, once).
    Copies are the object itself, as for policies (the table is a cache).

    Example:
        >>> import torch, remat
        >>> from remat._engine.selective import SelectiveContexts
        >>> contexts = SelectiveContexts([torch.ops.aten.mm.default])
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> y = remat.checkpoint(lambda t: (t @ t).sigmoid(), x, context_fn=contexts)
    """

    __slots__ = ("allow_mutation", "policy", "table")

    def __init__(self, policy_fn_or_list: Callable[..., Any] | list[Any], allow_cache_entry_mutation: bool = False) -> None:
        if isinstance(policy_fn_or_list, list):
            # create_selective_checkpoint_contexts's list; CheckpointOptions hands a policy.
            chosen: Callable[..., Any] = policy_of_ops(policy_fn_or_list, "create_selective_checkpoint_contexts")
        elif callable(policy_fn_or_list):
            chosen = policy_fn_or_list
        else:
            raise CheckpointTypeError(
                "create_selective_checkpoint_contexts: policy_fn_or_list must be a policy function "
                "(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool, or a list of OpOverloads; "
                f"got {type(policy_fn_or_list).__name__}."
            )
        self.policy = chosen
        self.allow_mutation = allow_cache_entry_mutation
        self.table = _table_for(chosen)

    def __call__(self) -> tuple[RecordOps, ReplayOps]:
        cache = OpCache(self.allow_mutation)
        return RecordOps(self.policy, cache, self.table), ReplayOps(cache, self.table)

    def __copy__(self) -> SelectiveContexts:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SelectiveContexts:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (SelectiveContexts, (self.policy, self.allow_mutation))


# Tables of recently used policies, by identity (the entry holds the policy, so
# its id is not reused while the entry exists): create_selective_checkpoint_contexts
# is called once per region with the same policy. Bounded: policies made per
# call (a list of ops becomes a new save_ops value each time) only cycle it.
_TABLES: dict[int, tuple[Callable[..., Any], OpTable]] = {}
_TABLES_KEPT = 32


def _table_for(policy: Callable[..., Any]) -> OpTable:
    entry = _TABLES.get(id(policy))
    if entry is not None and entry[0] is policy:
        return entry[1]
    table = OpTable(policy)
    if len(_TABLES) >= _TABLES_KEPT:
        _TABLES.clear()
    _TABLES[id(policy)] = (policy, table)
    return table
