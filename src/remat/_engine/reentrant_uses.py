"""What a reentrant region uses, and what its recomputation uses instead.

Part of the reentrant variant (``reentrant``, ``docs/design/reentrant.md``).
In the forward a torch-function mode shows each torch call to the active
regions' frames: a :class:`Record` notes each use of a tensor that requires
grad (an input, a closure, a parameter) and which tensors are read at all.
In the recomputation a :class:`Substitute` gives each use a stand-in leaf,
so the nested backward ends at the stand-ins. :class:`RegionState` holds what
a region's backward needs, and :meth:`RegionState.lay_out` turns the record
into the node's edges; :class:`Recomputed` is one recomputation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from contextvars import ContextVar
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from remat._compat.autograd import is_edgeless_view, next_sequence_nr, version_of
from remat._engine.forward_state import ReplayState

__all__ = ["Active", "Frame", "Recomputed", "Record", "RegionState", "Substitute", "UsesMode", "active_frames"]


# Properties that make a new autograd edge to the tensor they are read from
# (``w.T`` is a view with a gradient). Reading any other property is not a use.
_EDGE_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
# Methods that ask a tensor about itself: what they return has no gradient, so
# a call is no use either (as a property read). A non-reentrant region's own
# bookkeeping asks them (its pack hook: ``Tensor._is_view``), and inside an
# enclosing recomputation it runs where the enclosing region's forward, under
# no_grad, ran none: counted as uses, the recomputation's uses no longer
# matched the forward's (the gradients reassociated), and the call got a
# stand-in, which is no view even where the tensor is one.
_QUERIES = frozenset(
    {
        "_is_view",
        "data_ptr",
        "dim",
        "element_size",
        "get_device",
        "is_complex",
        "is_contiguous",
        "is_floating_point",
        "ndimension",
        "nelement",
        "numel",
        "size",
        "storage_offset",
        "stride",
        "untyped_storage",
    }
)


class Record:
    """The forward's frame: the tensors it uses that require grad, use by use.

    The forward runs under ``no_grad``, so a tensor that requires grad there
    was made outside the region (an input, a closure, a parameter); a view of
    one taken inside is edgeless and stands for nothing new (its base was
    used by the view op). Each use is kept with the tensor the call really
    received: inside an enclosing recomputation, that is the enclosing
    region's stand-in for this use, and the node's edge goes there.
    """

    __slots__ = ("call", "index", "read_targets", "tensors", "uses")

    def __init__(self) -> None:
        self.index: dict[int, int] = {}  # id() of a tensor in ``tensors`` (kept alive there)
        self.tensors: list[torch.Tensor] = []
        self.uses: list[tuple[int, int, torch.Tensor]] = []  # (call, target, tensor received)
        self.read_targets: set[int] = set()  # read: a use, a property, an inner region's argument
        self.call = 0

    def target(self, tensor: torch.Tensor) -> int:
        """The index of ``tensor`` among the region's targets (added if new)."""
        known = self.index.get(id(tensor))
        if known is None:
            known = self.index[id(tensor)] = len(self.tensors)
            self.tensors.append(tensor)
        return known

    def touch(self, tensor: torch.Tensor, read: bool = True) -> int | None:
        """A tensor the forward reads (a property, a use), or with ``read=False``
        one the region takes as an input: its target, if it is one."""
        known = self.index.get(id(tensor))
        if known is None and tensor.requires_grad and not is_edgeless_view(tensor):
            known = self.target(tensor)
        if read and known is not None:
            self.read_targets.add(known)
        return known

    def see(self, original: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        target = self.touch(original)
        if target is not None:
            self.uses.append((self.call, target, current))
        return current

    def read(self, original: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        self.touch(original)
        return current

    def end_call(self, out: Any) -> None:
        self.call += 1


class Substitute:
    """The recomputation's frame: each use of a target gets a stand-in leaf of its own.

    A stand-in shares the target's data and version counter but has no
    history, so the recomputed graph ends at the stand-ins: the nested
    backward cannot walk into the graph outside the region, and the gradient
    of each use comes back separately. (A recomputation runs in backward,
    never inside another region's frame.)
    """

    __slots__ = ("call", "doors", "index", "leaves", "quiet", "reads", "standins")

    def __init__(self, index: dict[int, int], doors: list[torch.Tensor | None] | None = None) -> None:
        # id() of each tensor that stands for a target; the backward keeps
        # them alive (arguments, captures), the stand-ins live in ``standins``.
        self.index = index
        # Under double backward, one tensor per target that every use gets
        # instead of a stand-in of its own (see _recompute_inputs); else None.
        self.doors = doors
        self.call = 0
        self.standins: list[tuple[int, int, torch.Tensor]] = []  # (call, target, stand-in)
        # Uses made with grad off: inside a custom Function's forward, whose
        # node takes the target itself. (Position in ``standins``, and the
        # sequence number after that node's: the next one.)
        self.quiet: list[tuple[int, int]] = []
        self.reads: list[tuple[int, torch.Tensor]] = []  # (target, stand-in) of an inner region's edge
        self.leaves: list[torch.Tensor] = []  # leaves that require grad, made by the region

    def touch(self, tensor: torch.Tensor) -> int | None:
        return None

    def _standin(self, original: torch.Tensor, current: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """The target ``original`` is and what stands for it here (its door when
        doors are kept, else a new leaf); None when it is no target."""
        target = self.index.get(id(original))
        if target is None:
            return None
        if self.doors is not None:
            return target, self.doors[target]  # type: ignore[return-value]  # alive: indexed
        standin = current.detach()
        standin.requires_grad_(True)
        return target, standin

    def see(self, original: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        found = self._standin(original, current)
        if found is None or self.doors is not None:
            return current if found is None else found[1]
        target, standin = found
        if not torch.is_grad_enabled() and len(active_frames.get()) == 1:  # (not an inner region's forward)
            self.quiet.append((len(self.standins), next_sequence_nr()))
        self.standins.append((self.call, target, standin))
        # An op may hand its argument back (remat.name, in-place ops): where
        # the forward then used the target again, this is used again.
        self.index[id(standin)] = target
        return standin

    def read(self, original: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """A stand-in for an edge of a region nested in this recomputation that
        goes to a target with no use of its own (an input the inner function
        never used): its gradient reaches the target whole, as a capture does."""
        found = self._standin(original, current)
        if found is None or self.doors is not None:
            return current if found is None else found[1]
        self.reads.append(found)
        return found[1]

    def end_call(self, out: Any) -> None:
        self.call += 1
        if isinstance(out, torch.Tensor) and out.requires_grad and out.grad_fn is None:
            self.leaves.append(out)


Frame = Record | Substitute
active_frames: ContextVar[tuple[Frame, ...]] = ContextVar("remat_reentrant_frames", default=())


def _through(frames: tuple[Frame, ...], values: Any) -> Any:
    """``values`` (a tuple or list of call arguments) with every tensor passed
    through the frames, outermost first; the same object when nothing changed."""
    changed: list[Any] | None = None
    for position, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            new = value
            for frame in frames:
                new = frame.see(value, new)
        elif type(value) in (list, tuple):  # TensorList arguments (torch.cat)
            new = _through(frames, value)
        else:
            continue
        if new is not value:
            if changed is None:
                changed = list(values)
            changed[position] = new
    if changed is None:
        return values
    return tuple(changed) if isinstance(values, tuple) else changed


def _read(frames: tuple[Frame, ...], tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as an edge of a node made inside the ``frames`` (outermost
    first): inside an enclosing recomputation, a stand-in of its own. (Called
    with no frames active: making it is no use they should see.)"""
    current = tensor
    for frame in frames:
        current = frame.read(tensor, current)
    return current


class UsesMode(TorchFunctionMode):
    """Shows every torch call of the active reentrant regions to their frames.

    One instance serves all nested regions, so that an inner region records
    the stand-ins an enclosing recomputation substituted (frames run outermost
    first); it is entered with the first frame and left with the last.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        frames = active_frames.get()
        called = getattr(func, "__name__", None)
        if called == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", None)
            query = name not in _EDGE_PROPERTIES
        else:
            query = called in _QUERIES
        if query:
            # Reading .shape is no use, but a custom autograd.Function may
            # take the tensor as it is: it must be one of the region's targets.
            if args and isinstance(args[0], torch.Tensor):
                for frame in frames:
                    frame.touch(args[0])
            return func(*args, **kwargs)
        args = _through(frames, args)
        if kwargs:
            values = tuple(kwargs.values())
            new = _through(frames, values)
            if new is not values:
                kwargs = dict(zip(kwargs, new, strict=True))
        out = func(*args, **kwargs)
        for frame in frames:
            frame.end_call(out)
        return out


class Active:
    """Push a frame on ``outer`` (the active frames) for the block, and the
    mode if it is the first frame."""

    __slots__ = ("frame", "mode", "outer", "token")

    def __init__(self, frame: Frame, outer: tuple[Frame, ...] | None = None) -> None:
        self.frame = frame
        self.outer = outer
        self.mode: UsesMode | None = None
        self.token: Any = None

    def __enter__(self) -> None:
        frames = active_frames.get() if self.outer is None else self.outer
        self.token = active_frames.set((*frames, self.frame))
        if not frames:
            self.mode = UsesMode()
            self.mode.__enter__()  # type: ignore[no-untyped-call]

    def __exit__(self, *exc: object) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        active_frames.reset(self.token)


class RegionState:
    """What a region's backward needs, set up by :func:`run_reentrant`."""

    __slots__ = (
        "api",
        "args",
        "dead_ends",
        "edges_of",
        "function",
        "input_targets",
        "materialized",
        "outputs",
        "positions",
        "reads_no_target",
        "replay",
        "targets",
        "use_edges",
        "use_targets",
    )

    def __init__(self, function: Callable[..., Any], api: str, replay: ReplayState, args: tuple[Any, ...]) -> None:
        self.function = function
        self.api = api
        self.replay = replay
        self.positions = [i for i, value in enumerate(args) if isinstance(value, torch.Tensor)]
        self.args: list[Any] = [None if isinstance(value, torch.Tensor) else value for value in args]
        self.input_targets: list[int] = []  # per tensor input: its target, -1 for a constant
        # Per target: the tensor (weakly: what the function reads keeps it alive)
        # and its version when the forward ended.
        self.targets: list[tuple[weakref.ref[torch.Tensor], int]] = []
        # Per target: its edges, in the order autograd adds their gradients.
        self.edges_of: list[list[int]] = []
        # Targets whose one edge leads to a leaf of its own (see lay_out): a
        # gradient for one is no edge's, it goes where torch's variant sends it.
        self.dead_ends: frozenset[int] = frozenset()
        self.reads_no_target = False  # its targets are all inputs its forward never read
        self.use_targets: list[int] = []  # per use in the forward: its target
        self.use_edges: list[int] = []  # per use in the forward: its edge
        self.outputs: Any = None
        # Recomputations made under create_graph=True before this region's own
        # backward needed them (see _materialize), by the backward call they are for.
        self.materialized: dict[Hashable, Recomputed] = {}

    def lay_out(self, record: Record, frames: tuple[Frame, ...]) -> list[torch.Tensor]:
        """The node's edges: per target one per use, latest call first (the order
        in which autograd adds the uses' gradients without checkpointing; a
        call's arguments in order), or one for a target the forward only read
        (a custom autograd.Function's input) or never read (an input).

        Every target has an edge wherever the node is made, so whether its
        outputs require grad depends on the region alone. The enclosing
        ``frames`` only say where an edge leads: a non-reentrant region made
        inside an enclosing recomputation is recomputed later with no frame
        active, and must then save what its forward saved (an output that
        requires grad in one and not in the other changes what the ops after
        it save). Inside an enclosing recomputation an input never read gets
        a stand-in of that region; at the top level a *dead end*, a leaf of
        its own: an edge to the input would make autograd run the input's
        node with no gradient, which a custom Function's node turns into
        zeros where the unchecked run leaves None."""
        uses_of: list[list[int]] = [[] for _ in record.tensors]
        for position in sorted(range(len(record.uses)), key=lambda j: -record.uses[j][0]):
            uses_of[record.uses[position][1]].append(position)
        self.use_targets = [target for _, target, _ in record.uses]
        self.use_edges = [0] * len(record.uses)
        edges: list[torch.Tensor] = []
        dead_ends = []
        for target, tensor in enumerate(record.tensors):
            mine = []
            for position in uses_of[target]:
                self.use_edges[position] = len(edges)
                mine.append(len(edges))
                edges.append(record.uses[position][2])
            if not mine:
                mine.append(len(edges))
                if frames or target in record.read_targets:
                    edges.append(_read(frames, tensor))
                else:
                    dead_ends.append(target)
                    edges.append(tensor.detach().requires_grad_(True))
            self.edges_of.append(mine)
        self.dead_ends = frozenset(dead_ends)
        self.reads_no_target = not record.read_targets
        self.targets = [(weakref.ref(tensor), version_of(tensor)) for tensor in record.tensors]
        return edges


class Recomputed:
    """One recomputation of a region: what its backward differentiates."""

    __slots__ = ("inputs", "made", "outputs", "saved", "sources", "substitute")

    def __init__(
        self,
        saved: tuple[torch.Tensor, ...],
        outputs: tuple[Any, ...],
        substitute: Substitute,
        inputs: list[tuple[int, torch.Tensor]],
        sources: list[torch.Tensor | None],
        made: range,
    ) -> None:
        self.saved = saved  # the node's saved tensors, unpacked once (enclosing hooks hand them out once)
        self.outputs = outputs  # as a tuple, in the node's output order
        self.substitute = substitute
        self.inputs = inputs  # the arguments that stand for a target
        self.sources = sources  # per target, the tensor it is (None once gone)
        self.made = made  # the autograd nodes it made, by sequence number
