"""What compressing saved tensors does to a step's gradients, measured group by group.

:func:`compression_report` runs one training step several times, with the
same RNG state each time (so dropout draws the same masks):

1. exactly, for the reference gradients ``g``;
2. with every saved tensor that ``remat.compress`` would compress
   (:func:`remat.offload.compressible`) compressed in the format asked: the
   bytes before and after, and the error of the whole step;
3. per group (a module, or a single saved tensor), with only that group
   compressed: its measured error, ``||g' - g|| / ||g||`` over every
   parameter gradient, and the cosine similarity of ``g'`` and ``g``;
4. per group, with that group's tensors perturbed by Gaussian noise of a
   known relative size ``e``: its *sensitivity*, the relative gradient error
   per unit of relative activation error (GACT's linear model of how an
   activation's error reaches the gradient). Times each format's own
   activation error, measured on the saved tensors without any backward,
   it *predicts* the group's gradient error in every format, and ranks the
   groups by how safe they are to compress (predicted error per byte saved).

Two steps plus two per group. Definitions: ``docs/design/compression.md``.

Example:
    >>> import torch
    >>> from remat.memory import compression_report
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    >>> x = torch.randn(32, 64)
    >>> report = compression_report(model, lambda: model(x).pow(2).sum(), "int8")
    >>> [group.name for group in report.groups]  # "(model)": the loss's pow, outside every submodule
    ['1', '2', '(model)']
    >>> report.stored_bytes < report.original_bytes / 3
    True
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from remat._compat.autograd import base_of
from remat.compression import FORMATS, Compression, compression
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.offload import compress, compressible

__all__ = ["CompressedGroup", "CompressionReport", "compression_report"]

By = Literal["module", "tensor"]
_PROBE = 1e-3
"""Relative size of the sensitivity probe's noise: small enough for the linear model."""


@dataclass(frozen=True)
class CompressedGroup:
    """One group of saved tensors, compressed alone.

    Attributes:
        name: the module path (``"(model)"``: saved by no submodule), or ``"#i <op> in <module>"``
            for one saved tensor.
        tensors: how many storages its saved tensors live in (views of one
            storage count once; a storage two groups save counts in both).
        original_bytes: their bytes as they are.
        stored_bytes: their bytes compressed in the report's format.
        relative_error: ``||g' - g|| / ||g||`` of every parameter gradient, this
            group alone compressed (measured).
        cosine: cosine similarity of ``g'`` and ``g``.
        sensitivity: relative gradient error per unit of relative activation
            error (measured with the probe).
        activation_error: the relative error each format puts on these tensors.
        predicted_error: ``sensitivity * activation_error`` per format.
    """

    name: str
    tensors: int
    original_bytes: int
    stored_bytes: int
    relative_error: float
    cosine: float
    sensitivity: float
    activation_error: dict[str, float]
    predicted_error: dict[str, float]

    @property
    def saved_bytes(self) -> int:
        return self.original_bytes - self.stored_bytes


@dataclass(frozen=True)
class CompressionReport:
    """:func:`compression_report`'s result: the groups, and the whole step compressed.

    Attributes:
        format: the format measured (``str`` of a :class:`~remat.compression.Compression`).
        groups: one entry per group, in forward order.
        original_bytes: bytes of every compressible saved tensor, as compressed
            (each storage once; measured by the compressed stash).
        stored_bytes: the same tensors compressed (measured).
        relative_error: gradient error with all of them compressed.
        cosine: cosine similarity of the gradients, all of them compressed.
        predicted_original_bytes: the storages of the compressible saved
            tensors, each once, from their shapes (no compression run).
        predicted_stored_bytes: what they take compressed, per format, from
            their shapes (:meth:`~remat.compression.Compression.stored_bytes`).
    """

    format: str
    groups: tuple[CompressedGroup, ...]
    original_bytes: int
    stored_bytes: int
    relative_error: float
    cosine: float
    predicted_original_bytes: int = 0
    predicted_stored_bytes: dict[str, int] = field(default_factory=dict)

    def safest(self) -> list[CompressedGroup]:
        """The groups ordered by predicted error per byte saved, safest first."""
        return sorted(
            self.groups,
            key=lambda group: group.predicted_error[self.format] / max(group.saved_bytes, 1),
        )


def compression_report(
    model: nn.Module,
    loss: Callable[[], Tensor],
    format: Compression | str = "fp8",
    *,
    by: By = "module",
    depth: int | None = None,
    min_bytes: int = 1024,
    formats: Sequence[str] = FORMATS,
    per_group: bool = True,
) -> CompressionReport:
    """Measure what compressing a step's saved tensors does to its gradients.

    ``loss`` runs the forward and returns the scalar loss (as for
    :func:`track_training_step`); ``model``'s parameters are the gradients
    compared. ``by="module"`` groups the saved tensors by the module that
    saved them (cut to ``depth`` path components; ``"(model)"`` for those
    saved by no submodule, such as the loss's), ``by="tensor"`` makes
    each saved tensor a group. ``per_group=False`` measures the whole step
    only (two steps; ``groups`` is then empty). The model's gradients are
    left as they were. See the module docstring for what is measured and how.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
        >>> x = torch.randn(16, 64)
        >>> report = compression_report(model, lambda: model(x).sum(), "bf16", by="tensor")
        >>> len(report.groups), report.relative_error < 1e-2
        (1, True)
    """
    api = "remat.memory.compression_report"
    if not isinstance(model, nn.Module):
        raise CheckpointTypeError(f"{api}: model must be an nn.Module, got {type(model).__name__}.")
    if not callable(loss):
        raise CheckpointTypeError(f"{api}: loss must be a function returning the step's loss, got {type(loss).__name__}.")
    if by not in ("module", "tensor"):
        raise CheckpointUsageError(f"{api}: by must be 'module' or 'tensor', got {by!r}.")
    chosen = compression(format, api=api)
    others = [compression(name, api=api) for name in formats]
    step = _Step(model, loss, api)
    with step.preserved():
        reference = step.gradients(None)
        census = _Census(model, by, depth, chosen, others, min_bytes)
        step.gradients(census)
        if not census.tensors:
            raise CheckpointUsageError(
                f"{api}: the step saves no tensor that {chosen} would compress (activations of at "
                f"least {min_bytes} bytes of a float dtype it makes smaller). Lower min_bytes, "
                "or check that the forward runs with grad enabled."
            )
        block = compress(chosen, min_bytes=min_bytes)
        with_all = step.gradients(block)
        groups = []
        for group in census.groups() if per_group else ():
            compressed = step.gradients(_Selected(census, group, chosen, noise=False))
            probed = step.gradients(_Selected(census, group, chosen, noise=True))
            sensitivity = _relative(probed, reference) / _PROBE
            activation = census.activation_error(group)
            groups.append(
                CompressedGroup(
                    name=group,
                    tensors=census.count(group),
                    original_bytes=census.original_bytes(group),
                    stored_bytes=census.stored_bytes(group),
                    relative_error=_relative(compressed, reference),
                    cosine=_cosine(compressed, reference),
                    sensitivity=sensitivity,
                    activation_error=activation,
                    predicted_error={name: sensitivity * error for name, error in activation.items()},
                )
            )
    return CompressionReport(
        format=str(chosen),
        groups=tuple(groups),
        original_bytes=block.original_bytes,
        stored_bytes=block.stored_bytes,
        relative_error=_relative(with_all, reference),
        cosine=_cosine(with_all, reference),
        predicted_original_bytes=census.total_bytes,
        predicted_stored_bytes=dict(census.total_stored),
    )


class _Step:
    """Runs the step again and again from the same RNG state; collects the gradients."""

    def __init__(self, model: nn.Module, loss: Callable[[], Tensor], api: str) -> None:
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        if not self.parameters:
            raise CheckpointUsageError(f"{api}: the model has no parameter that requires grad: no gradient to compare.")
        self.loss = loss
        self.api = api

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """The parameters' gradients and the caller's RNG state are as they were afterwards."""
        grads = [p.grad for p in self.parameters]
        devices = sorted({p.device.index or 0 for p in self.parameters if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices):
            self._rng = torch.get_rng_state()
            self._device_rng = [torch.cuda.get_rng_state(d) for d in devices]
            self._devices = devices
            try:
                yield
            finally:
                for parameter, grad in zip(self.parameters, grads, strict=True):
                    parameter.grad = grad

    def gradients(self, around: contextlib.AbstractContextManager[Any] | None) -> Tensor:
        torch.set_rng_state(self._rng)
        for device, state in zip(self._devices, self._device_rng, strict=True):
            torch.cuda.set_rng_state(state, device)
        for parameter in self.parameters:
            parameter.grad = None
        with around if around is not None else contextlib.nullcontext():
            value = self.loss()
        if not isinstance(value, Tensor) or value.numel() != 1:
            raise CheckpointTypeError(f"{self.api}: loss() must return the step's scalar loss tensor, got {value!r}.")
        value.backward()  # type: ignore[no-untyped-call]
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in self.parameters])


class _Census(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that note every compressible saved tensor: its group and its errors."""

    def __init__(
        self, model: nn.Module, by: By, depth: int | None, chosen: Compression, formats: list[Compression], min_bytes: int
    ) -> None:
        self.path = _ModulePath(model, depth)
        # the chosen format first, each format once
        self.by, self.chosen, self.min_bytes = by, chosen, min_bytes
        self.formats = [f for f in dict.fromkeys(formats) if f != chosen]
        self.tensors: list[tuple[str, int, dict[str, int], dict[str, float]]] = []  # group, bytes, stored, error
        self._seen: set[tuple[str, int]] = set()  # (group, id of a storage seen)
        self._seen_anywhere: set[int] = set()
        self._storages: list[Any] = []
        self.total_bytes = 0
        self.total_stored: dict[str, int] = {}
        super().__init__(self._pack, _as_is)

    def _pack(self, tensor: Tensor) -> Tensor:
        if compressible(tensor, self.chosen, self.min_bytes):
            index = len(self.tensors)
            module = self.path.current()
            # "(model)": saved by the model's own code or outside it (the loss), not by a submodule
            module = module or "(model)"
            name = module if self.by == "module" else f"#{index} {_op_of(tensor)} in {module}"
            base = base_of(tensor)
            # Views of one storage: counted once per group (compressed alone, a group
            # stores it). Keyed by the storage object, held here so its id stays its own.
            storage = base.untyped_storage()
            self._storages.append(storage)
            first = (name, id(storage)) not in self._seen
            self._seen.add((name, id(storage)))
            nbytes = base.untyped_storage().nbytes() if first else 0
            stored = {str(f): _stored_bytes(base, f) if first else 0 for f in (self.chosen, *self.formats)}
            errors = {str(f): _activation_error(tensor, f) for f in (self.chosen, *self.formats)}
            self.tensors.append((name, nbytes, stored, errors))
            if id(storage) not in self._seen_anywhere:  # the whole step: each storage once
                self._seen_anywhere.add(id(storage))
                self.total_bytes += base.untyped_storage().nbytes()
                for f in (self.chosen, *self.formats):
                    self.total_stored[str(f)] = self.total_stored.get(str(f), 0) + _stored_bytes(base, f)
        return tensor.detach()

    def __enter__(self) -> None:
        self.path.__enter__()
        super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.path.__exit__(*exc)

    def groups(self) -> list[str]:
        return list(dict.fromkeys(name for name, *_ in self.tensors))

    def members(self, group: str) -> list[int]:
        return [i for i, (name, *_) in enumerate(self.tensors) if name == group]

    def count(self, group: str) -> int:
        return sum(1 for i in self.members(group) if self.tensors[i][1])

    def original_bytes(self, group: str) -> int:
        return sum(self.tensors[i][1] for i in self.members(group))

    def stored_bytes(self, group: str) -> int:
        return sum(self.tensors[i][2][str(self.chosen)] for i in self.members(group))

    def activation_error(self, group: str) -> dict[str, float]:
        """Each format's relative error on the group's tensors, weighted by their bytes."""
        members = self.members(group)
        weights = [max(self.tensors[i][1], 1) for i in members]
        return {
            str(f): sum(w * self.tensors[i][3][str(f)] for w, i in zip(weights, members, strict=True)) / sum(weights)
            for f in (self.chosen, *self.formats)
        }


class _Selected(torch.autograd.graph.saved_tensors_hooks):
    """Compress (or, ``noise``: perturb by the probe) only the group's saved tensors."""

    def __init__(self, census: _Census, group: str, chosen: Compression, *, noise: bool) -> None:
        self.census, self.members = census, set(census.members(group))
        self.chosen, self.noise = chosen, noise
        self.index = 0
        self.generator = torch.Generator().manual_seed(0)
        self.block = compress(chosen, min_bytes=census.min_bytes)
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> Any:
        if not compressible(tensor, self.chosen, self.census.min_bytes):
            return tensor.detach()
        index, self.index = self.index, self.index + 1
        if index not in self.members:
            return tensor.detach()
        if self.noise:
            noise = torch.randn(tensor.shape, generator=self.generator).to(tensor.device, torch.float32)
            scale = _PROBE * tensor.detach().float().pow(2).mean().sqrt()
            return (tensor.detach().float() + noise * scale).to(tensor.dtype)
        return self._compress(tensor)

    def _compress(self, tensor: Tensor) -> Any:
        from remat._engine.compressed import Compressor  # the stash remat.compress uses

        stash = getattr(self, "_stash", None)
        if stash is None:
            stash = self._stash = Compressor(self.chosen)
        return stash.store(tensor)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed if isinstance(packed, Tensor) else packed.restore()


class _ModulePath:
    """The path of the innermost module running now (forward hooks on every submodule)."""

    def __init__(self, model: nn.Module, depth: int | None) -> None:
        self.model, self.depth = model, depth
        self.stack: list[str] = []
        self.handles: list[Any] = []

    def current(self) -> str:
        path = self.stack[-1] if self.stack else ""
        if self.depth is not None and path:
            path = ".".join(path.split(".")[: self.depth])
        return path

    def __enter__(self) -> None:
        for name, module in self.model.named_modules():
            if name:
                self.handles.append(module.register_forward_pre_hook(self._entering(name)))
                self.handles.append(module.register_forward_hook(self._leaving))

    def _entering(self, name: str) -> Callable[..., None]:
        def enter(*_: Any) -> None:
            self.stack.append(name)

        return enter

    def _leaving(self, *_: Any) -> None:
        self.stack.pop()  # (returns nothing: a forward hook's result would replace the output)

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _as_is(tensor: Tensor) -> Tensor:
    return tensor


def _op_of(tensor: Tensor) -> str:
    node = tensor.grad_fn
    return type(node).__name__.removesuffix("Backward0") if node is not None else "?"


def _stored_bytes(base: Tensor, format: Compression) -> int:
    """Bytes of a storage compressed as the compressed stash does it (rows of its base)."""
    row = int(base.shape[-1]) if base.dim() and base.is_contiguous() else 0
    numel = base.untyped_storage().nbytes() // base.element_size()
    return format.stored_bytes(numel, base.dtype, row if row and numel % row == 0 else 0)


def _activation_error(tensor: Tensor, format: Compression) -> float:
    """``||Q(a) - a|| / ||a||`` of the format on this tensor (no backward needed)."""
    if not format.applies_to(tensor.dtype):
        return 0.0
    values = tensor.detach().contiguous()
    row = int(values.shape[-1]) if values.dim() else 0
    flat = values.reshape(-1)
    payload, scales = format.compress(flat, row)
    restored = format.decompress(payload, scales, torch.float32, row)
    norm = float(flat.float().norm())
    return float((restored - flat.float()).norm()) / norm if norm else 0.0


def _relative(got: Tensor, want: Tensor) -> float:
    norm = float(want.norm())
    return float((got - want).norm()) / norm if norm else math.inf


def _cosine(got: Tensor, want: Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=0))
