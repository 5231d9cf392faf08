"""Per-region bookkeeping: what the forward saved and what each backward recomputed.

A :class:`Frame` is created for every checkpointed call whose forward runs with
grad enabled. It owns

* the region's inputs, saved through a no-op autograd node (:class:`InputSaver`),
  kept alive through that node's output tensor, so that (a) in-place changes to an input are caught by autograd's version
  check and (b) an enclosing checkpoint sees them as tensors *it* saved
  (see ``docs/design/nesting.md``);
* one weak reference and one metadata record per tensor the forward saved, in
  save order (``holders``, ``metas``); the graph holds the only strong
  reference to each :class:`Holder`, so a holder dies when autograd frees it;
* a watch on each tensor the region saved but did not make (a closure, a
  module's parameter): the tensor and the version it had when saved,
  so that a recomputation refuses to run on a tensor changed in place since
  (an optimizer step before backward); see ``docs/design/lifetimes.md``;
* one :class:`RecomputeStore` per backward call (key: graph task id or
  ``GraphExecGroup``): the recomputed tensors by save index, each handed out
  once and then dropped.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from remat._compat.autograd import (
    is_edgeless_view,
    next_sequence_nr,
    node_sequence_nr,
    saved_tensor_hooks_may_be_active,
    version_of,
)
from remat._compat.pytree import tree_flatten, tree_unflatten
from remat._engine.forward_state import ReplayState
from remat._engine.verify import Meta, OpLog, stale_read
from remat._scope import SAVING_REGION_INPUTS, current_observer
from remat.errors import CheckpointError
from remat.storage.choice import DEVICE, Storage, decide, event_of
from remat.storage.store import Stashes

if TYPE_CHECKING:
    from remat._engine.split import Microbatch, WeightPass
    from remat.storage.stash import StoredTensor

__all__ = ["TAKEN", "Frame", "Holder", "InputSaver", "ReadWatch", "RecomputeStore", "RegionOptions"]


@dataclass(frozen=True)
class RegionOptions:
    """Settings frozen when a region starts (hooks never read ambient state)."""

    early_stop: bool = True
    check_determinism: bool = True
    debug: bool = False
    preserve_rng: bool = True
    api: str = "remat.checkpoint"
    # debug=True was passed, but set_checkpoint_debug_enabled(False) turned it off
    # (a mismatch error then says so instead of advising debug=True).
    debug_blocked: bool = False
    # Where the region keeps its inputs: DEVICE (through autograd, or the frame),
    # or a stash (compress_inputs: the recomputation then starts from approximate
    # values; docs/design/compression.md).
    inputs: Storage = DEVICE
    # Under a backward split into an input and a weight pass (zero-bubble pipeline
    # schedules): keep the input pass's recomputation for the weight pass, or
    # recompute once more for it (docs/design/pipelining.md).
    weight_pass: WeightPass = "keep"


class Holder:
    """What the forward packs instead of a tensor: its position in save order.

    Made as ``Holder()`` and then given its ``index``: one per saved tensor,
    and an ``__init__`` would cost a Python frame each time.
    """

    __slots__ = ("__weakref__", "index")

    index: int


ReadWatch = tuple["torch.Tensor | weakref.ref[torch.Tensor]", int, int, "str | None"]
"""A tensor the forward saved without making it: (the tensor, version when
saved, save index, source line when debugging). Checked before each recompute.

Held strongly when the frame keeps the region's inputs itself (no saved-tensor
hooks outside: the graph held the tensor before checkpointing took it out, and
the recomputation reads it again anyway), weakly otherwise (an enclosing
offload must be able to free what it moved; docs/design/lifetimes.md)."""


class _Taken:
    """Marks a recomputed tensor already handed to backward (double-unpack check)."""

    __slots__ = ()


TAKEN = _Taken()


class _TensorSlot:
    """Stands in the flattened inputs for a tensor that the saver node keeps."""

    __slots__ = ()


_TENSOR_SLOT = _TensorSlot()
_CONSTANT_SLOT = _TensorSlot()
"""A view taken under ``no_grad`` of a tensor that requires grad (see
:func:`remat._compat.autograd.is_edgeless_view`). Unpacked through an enclosing region's
hooks it comes back as a leaf that requires grad, which ops differentiate; the
recomputation gets such a view again, so it saves what the forward saved."""


class _StoredInput:
    """A region input a stash keeps (``compress_inputs``), and whether it required grad."""

    __slots__ = ("requires_grad", "stored")

    def __init__(self, stored: StoredTensor, requires_grad: bool) -> None:
        self.stored = stored
        self.requires_grad = requires_grad

    def restore(self) -> torch.Tensor:
        """The input back (approximate, when compressed): a new leaf that requires grad
        as the input did, so the recomputation's ops save what the forward's saved."""
        return self.stored.restore().detach().requires_grad_(self.requires_grad)


def _edgeless_view(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tensor.view_as(tensor)


class RecomputeStore:
    """Recomputed tensors of one frame for one backward call (or for the calls of one
    split microbatch: ``keeps``).

    A store hands each tensor out once and then lets go of it. One that ``keeps``
    hands it out as often as asked and lets go of it when its ``Holder`` dies
    (autograd freed the saved tensor): the calls of a split backward rerun
    nodes (``_engine/split.py``).
    """

    __slots__ = ("keeps", "saved_count", "tensors", "watches")

    def __init__(self, keeps: bool = False) -> None:
        self.tensors: dict[int, torch.Tensor | _Taken] = {}
        self.saved_count = 0
        self.keeps = keeps
        self.watches: list[weakref.ref[Holder]] = []

    def keep_while_alive(self, holder: Holder, index: int) -> None:
        """Let go of tensor ``index`` when ``holder`` dies (a store that keeps)."""
        self.watches.append(weakref.ref(holder, _Forget(self.tensors, index)))


class _Forget:
    """A weakref callback dropping one recomputed tensor (no closure: nothing else is held)."""

    __slots__ = ("index", "tensors")

    def __init__(self, tensors: dict[int, Any], index: int) -> None:
        self.tensors = tensors
        self.index = index

    def __call__(self, _: object) -> None:
        self.tensors.pop(self.index, None)


class InputSaver(torch.autograd.Function):
    """No-op node whose only job is to save a region's tensor inputs.

    Its output is never used, so backward never runs it and its saved tensors
    stay until the graph (and the frame) is released. The frame must hold the
    *output*: the output owns the node, while the ``grad_fn`` object Python sees
    only refers to it weakly on older torch (checked: 2.4.1 and 2.11.0; 2.13 and 2.15 keep it), where the saved tensors are freed
    as soon as the output dies (see ``docs/design/lifetimes.md``).
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - never reached
        raise AssertionError("remat bug: the input-saver node was executed")


class Frame:
    """Bookkeeping of one checkpointed call; see the module docstring."""

    __slots__ = (
        "__weakref__",
        "caller_scopes_recompute",
        "forward_done",
        "forward_log",
        "holders",
        "input_anchor",
        "input_ids",
        "input_slots",
        "input_spec",
        "input_tensors",
        "input_versions",
        "metas",
        "options",
        "origin",
        "reads",
        "recompute_context",
        "recompute_fn",
        "replay",
        "split",
        "stores",
        "transform",
    )

    def __init__(
        self,
        recompute_fn: Callable[..., Any],
        options: RegionOptions,
        replay: ReplayState,
        recompute_context: AbstractContextManager[Any] | None,
        forward_log: OpLog | None,
        *,
        caller_scopes_recompute: bool = False,
    ) -> None:
        self.recompute_fn = recompute_fn
        # True: recompute_fn takes the RecomputeScope first and opens it itself.
        self.caller_scopes_recompute = caller_scopes_recompute
        self.options = options
        self.replay = replay
        self.recompute_context = recompute_context
        self.forward_log = forward_log
        self.holders: list[weakref.ref[Holder]] = []
        self.metas: list[Meta] = []
        self.stores: dict[Hashable, RecomputeStore] = {}
        self.forward_done = False
        self.input_anchor: torch.Tensor | None = None
        self.input_tensors: list[torch.Tensor] | None = None
        # ids of input_tensors, which the frame holds (so the ids stay theirs); a
        # tuple of ints, which the garbage collector stops tracking (a region has
        # few inputs, so ``in`` scans it quickly)
        self.input_ids: tuple[int, ...] = ()
        self.input_versions: tuple[int, ...] = ()
        self.input_slots: list[Any] = []
        self.input_spec: Any = None
        self.reads: list[ReadWatch] = []
        self.origin = -1
        # The torch.func transform the forward ran under, if any (forward_state.region_transform).
        self.transform: str | None = None
        # The pipeline microbatch the forward ran in, if any (_engine/split.py).
        self.split: Microbatch | None = None

    def save_inputs(self, leaves: list[Any], spec: Any, tensors: list[torch.Tensor]) -> None:
        """Keep the flattened inputs for recomputation: tensors through autograd,
        the rest as is. ``tensors`` are the tensor leaves, in order."""
        self.input_spec = spec
        if self.options.inputs.stored:
            self._save_stored_inputs(leaves, self.options.inputs)
            return
        if self.transform is not None or not saved_tensor_hooks_may_be_active():
            # (Under a torch.func transform the saver node, an autograd.Function,
            # could not run: functorch takes only Functions that declare their
            # transforms. The frame keeps the inputs; forward_state.region_transform.)
            # Nothing outside watches what autograd saves (no enclosing region,
            # offload or user hooks): the frame keeps the inputs and their
            # versions itself, autograd's in-place check done by hand, instead
            # of an autograd node (a third of a small region's setup;
            # docs/design/performance.md). The leaves are kept as they are.
            self.input_slots = leaves
            self.input_tensors = tensors
            self.input_ids = tuple(map(id, tensors))
            self.input_versions = tuple(map(version_of, tensors))
            self.origin = next_sequence_nr()  # nodes numbered from here on are the region's
            return
        # The saver node keeps the tensors (not the frame), so autograd checks them.
        self.input_slots = [
            (_CONSTANT_SLOT if is_edgeless_view(leaf) else _TENSOR_SLOT)
            if isinstance(leaf, torch.Tensor)
            else leaf
            for leaf in leaves
        ]
        # Saved through autograd, so enclosing hooks see them: an enclosing
        # region counts them as its saved tensors, offload moves them.
        anchor = torch.empty(0, requires_grad=True)
        token = SAVING_REGION_INPUTS.set(True)  # an enclosing remat.compress keeps them exact
        try:
            self.input_anchor = InputSaver.apply(anchor, *tensors)  # type: ignore[no-untyped-call]
        finally:
            SAVING_REGION_INPUTS.reset(token)
        # Nodes made from here on belong to the region's forward.
        self.origin = node_sequence_nr(self.input_anchor.grad_fn)

    def _save_stored_inputs(self, leaves: list[Any], storage: Storage) -> None:
        """Keep the inputs ``storage`` takes in a stash (the frame holds the stored
        copies, which check their own versions), the others as they are."""
        stashes = Stashes()
        observer = current_observer()
        slots: list[Any] = []
        kept: list[torch.Tensor] = []
        for leaf in leaves:
            where = decide(leaf, storage, "region_input") if isinstance(leaf, torch.Tensor) else DEVICE
            if where.stored:
                if observer is not None:
                    observer(event_of(where, "region_input"), leaf)  # type: ignore[arg-type]  # stored: an event
                slots.append(_StoredInput(stashes.store(leaf, where), leaf.requires_grad))
            else:
                slots.append(leaf)
                if isinstance(leaf, torch.Tensor):
                    kept.append(leaf)
        self.input_slots = slots
        self.input_tensors = kept
        self.input_ids = tuple(map(id, kept))
        self.input_versions = tuple(map(version_of, kept))
        self.origin = next_sequence_nr()

    def load_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The inputs again; unpacking may make an enclosing checkpoint recompute."""
        if self.input_tensors is not None:
            if tuple(map(version_of, self.input_tensors)) != self.input_versions:
                self._raise_input_changed()
            slots = self.input_slots
            if self.options.inputs.stored:
                slots = [slot.restore() if isinstance(slot, _StoredInput) else slot for slot in slots]
            if self.input_spec is FLAT_ARGS:
                return tuple(slots), {}
            return unflatten_inputs(slots, self.input_spec)
        assert self.input_anchor is not None, "remat bug: inputs loaded before they were saved"
        tensors = iter(self.input_anchor.grad_fn.saved_tensors)  # type: ignore[union-attr]
        leaves = [
            next(tensors)
            if slot is _TENSOR_SLOT
            else _edgeless_view(next(tensors))
            if slot is _CONSTANT_SLOT
            else slot
            for slot in self.input_slots
        ]
        return unflatten_inputs(leaves, self.input_spec)

    def _raise_input_changed(self) -> None:
        assert self.input_tensors is not None
        for position, (tensor, version) in enumerate(zip(self.input_tensors, self.input_versions, strict=True)):
            now = version_of(tensor)
            if now != version:
                raise CheckpointError(
                    f"{self.options.api}: one of the variables needed for gradient computation "
                    f"has been modified by an inplace operation: tensor input {position} of the "
                    f"checkpointed function ({tuple(tensor.shape)}, {tensor.dtype}) is at "
                    f"version {now}; expected version {version} instead. The recomputation "
                    "would read the changed value; clone the input before changing it, or "
                    "change it after backward."
                )

    def last_live_index(self) -> int:
        """Save index of the last tensor some graph node still needs (-1 if none)."""
        for index in range(len(self.holders) - 1, -1, -1):
            if self.holders[index]() is not None:
                return index
        return -1

    def check_reads(self) -> None:
        """Raise if a tensor the forward read from outside was changed in place since."""
        for watched, version, index, source in self.reads:
            tensor = watched() if isinstance(watched, weakref.ref) else watched
            if tensor is not None and version_of(tensor) != version:
                raise stale_read(self.options.api, index, tensor, version, source)

    def settle_reads(self) -> None:
        """Accept the versions a recomputation left behind.

        The recomputation reruns in-place updates of the region itself (batch
        norm's running statistics); only changes made *between* two runs of
        the region are the user's.
        """
        reads = self.reads
        for position, (watched, version, index, source) in enumerate(reads):
            tensor = watched() if isinstance(watched, weakref.ref) else watched
            if tensor is not None and version_of(tensor) != version:
                reads[position] = (watched, version_of(tensor), index, source)


# The usual call, f(tensor, ...) with no keywords and nothing nested, skips
# the pytree walk (a third of a small region's setup): its leaves are args.
FLAT_ARGS = object()
"""The spec of inputs that :func:`flatten_inputs` took as they are."""

_ATOMS = (torch.Tensor, int, float, bool, str, type(None))


def flatten_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any, list[torch.Tensor]]:
    """The region's inputs as leaves, a spec for :func:`unflatten_inputs`, and
    the tensor leaves in order."""
    if not kwargs:
        tensors = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                tensors.append(arg)
            elif not isinstance(arg, _ATOMS):
                break
        else:
            leaves = list(args)
            # All tensors (the usual call): one list serves as both.
            return leaves, FLAT_ARGS, leaves if len(tensors) == len(leaves) else tensors
    leaves, spec = tree_flatten((args, kwargs))
    return leaves, spec, [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def unflatten_inputs(leaves: list[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inverse of :func:`flatten_inputs`."""
    if spec is FLAT_ARGS:
        return tuple(leaves), {}
    args, kwargs = tree_unflatten(leaves, spec)
    return tuple(args), dict(kwargs)
