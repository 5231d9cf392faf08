"""One way to put checkpointing on a model's blocks, and one handle that takes it off.

Layer: above the module front-ends (it drives :func:`remat.checkpoint_module`,
:func:`remat.checkpoint.run_checkpoint` and :func:`remat.storage.storing`),
below everything that chooses blocks: :func:`remat.apply_config`, the planner
(``Plan.apply`` and its profiler) and the ``remat`` commands. Design:
``docs/design/architecture.md`` ("One placement mechanism").

Each block gets a :class:`BlockSetting`: keep it, checkpoint it (with a
selective policy or not), and say where what it keeps lives
(:attr:`BlockSetting.kept`, one :class:`~remat.storage.choice.Storage`: its
device, a host copy, a compressed copy). Every change is made in place,
without a wrapper: parameter, buffer and state-dict names stay the same, and
a sharding engine applied afterwards (FSDP2, in torchtitan's order) keeps its
hooks outside the checkpointed region.

* checkpoint: :func:`remat.checkpoint_module` (forward hooks); compressed,
  with ``compress_inputs`` and its policy's saves compressed
  (:func:`remat.policies.compressed`);
* a host copy or a compressed copy without checkpointing: an instance
  ``forward`` that runs the class's forward under the storage's context,
  :func:`remat.storage.storing` (``offload`` or ``compress``, ``min_bytes=0``);
* checkpoint and a host copy: the same context, with the class's forward
  checkpointed inside it, so the region's inputs are saved through the
  offload hooks (inside the region the context stands aside);
* ``name_outputs``: forward hooks that name submodules' outputs
  (:func:`remat.name`), for name-based policies;
* ``memory_budget``: an instance ``forward`` that, while torch.compile
  traces the block, runs the class's forward under torch's per-region
  activation memory budget (the min-cut partitioner's knapsack for this
  block's graph; torch 2.13 and newer); eagerly it runs as it is;
* ``compile``: the block's call (hooks and forward, with what the setting
  installed) compiled as ``block.compile(...)`` does, with a
  :class:`CompileSpec`, always under torch's default partitioner settings
  (a process-wide ``torch._functorch.config.activation_memory_budget`` and
  its kin do not reach the block's graphs; ``docs/design/compile.md``,
  "Isolation").

:func:`place` returns a :class:`Placement`; its ``remove()`` (or leaving a
``with`` block) restores every module exactly.

Example:
    >>> import torch
    >>> from remat.placement import BlockSetting, place
    >>> from remat.policies import save_matmuls
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    >>> handle = place(model, {"0": BlockSetting(), "2": BlockSetting(policy=save_matmuls)})
    >>> handle.blocks
    ('0', '2')
    >>> model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    >>> handle.remove()
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat._compat.modules import module_call, set_compiled_call
from remat._compat.partitioner import (
    partitioner_changes,
    partitioner_defaults,
    partitioner_settings,
    region_memory_budget,
    region_memory_budgets_available,
)
from remat.checkpoint import run_checkpoint
from remat.composable import checkpoint_module, remove_checkpoint_module
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError
from remat.names import name as name_tensor
from remat.options import CheckpointOptions
from remat.policies import compressed
from remat.storage.choice import DEVICE, HOST, Storage
from remat.storage.contexts import storing

if TYPE_CHECKING:
    from remat._engine.split import WeightPass

__all__ = ["BlockSetting", "CompileSpec", "Placement", "install", "place"]

_API = "remat.placement"


@dataclass(frozen=True)
class CompileSpec:
    """How a block is compiled: the arguments of ``block.compile(...)``.

    The way torchtitan compiles a transformer: each block on its own, whole
    (``fullgraph=True``), with inductor. The planner compiles every region
    this way while it measures them (``remat.plan(..., compile=True)``), and
    a plan made so compiles its regions the same way when applied.

    Example:
        >>> CompileSpec().arguments()
        {'fullgraph': True, 'backend': 'inductor'}
        >>> CompileSpec(mode="max-autotune-no-cudagraphs").arguments()["mode"]
        'max-autotune-no-cudagraphs'
    """

    fullgraph: bool = True
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fullgraph, bool):
            raise CheckpointTypeError(
                f"{_API}: CompileSpec.fullgraph must be a bool, got {self.fullgraph!r}."
            )
        if not isinstance(self.backend, str) or not self.backend:
            raise CheckpointTypeError(
                f"{_API}: CompileSpec.backend must name a torch.compile backend such as "
                f"'inductor', got {self.backend!r}."
            )
        if self.mode is not None and not isinstance(self.mode, str):
            raise CheckpointTypeError(f"{_API}: CompileSpec.mode must be a str or None, got {self.mode!r}.")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise CheckpointTypeError(
                f"{_API}: CompileSpec.dynamic must be a bool or None, got {self.dynamic!r}."
            )

    @classmethod
    def of(cls, value: object, api: str) -> CompileSpec | None:
        """A ``compile=`` argument as a spec: ``True`` is the default spec, a
        mapping holds ``torch.compile`` arguments, ``None``/``False`` is None.

        Example:
            >>> CompileSpec.of({"mode": "reduce-overhead"}, "remat.plan").mode
            'reduce-overhead'
            >>> CompileSpec.of(False, "remat.plan") is None
            True
        """
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, CompileSpec):
            return value
        if isinstance(value, Mapping):
            known = [field.name for field in fields(cls)]
            unknown = sorted(set(value) - set(known))
            if unknown:
                raise CheckpointUsageError(
                    f"{api}: compile has unknown keys {unknown}; valid keys are {known}."
                )
            return cls(**value)
        raise CheckpointTypeError(
            f"{api}: compile must be True, False, a mapping of torch.compile arguments or a "
            f"remat.placement.CompileSpec, got {type(value).__name__}."
        )

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.compile`` (unset ones left out)."""
        found: dict[str, Any] = {"fullgraph": self.fullgraph, "backend": self.backend}
        if self.mode is not None:
            found["mode"] = self.mode
        if self.dynamic is not None:
            found["dynamic"] = self.dynamic
        return found


@dataclass(frozen=True)
class BlockSetting:
    """What one block does in a training step.

    Attributes:
        checkpoint: recompute the block in backward (keep only its inputs,
            and what ``policy`` saves).
        policy: a selective policy for the checkpoint (any ``policy=`` value
            of :func:`remat.checkpoint`); None recomputes everything.
        offload: with ``checkpoint``, keep the block's inputs in host memory
            until its backward; without, send every tensor it saves there.
        name_outputs: submodules, named relative to the block (``"attn"``),
            whose outputs get their relative name as a :func:`remat.name`
            tag, for name-based policies.
        preserve_rng_state: as in :func:`remat.checkpoint`.
        memory_budget: for a block that is not checkpointed and will be
            compiled: torch's activation memory budget for its graph, in
            ``[0, 1]`` (0 keeps what full recomputation keeps, 1 what the
            compiler keeps by default); needs torch 2.13 or newer. Without
            compiling, the block runs as it is.
        compile: compile the block (its hooks and forward) with this
            :class:`CompileSpec`, as ``block.compile(...)`` would.
        compress: keep what the block keeps compressed in this format
            (``"fp8"``, ``"int8"``, ... or a :class:`~remat.compression.Compression`):
            with ``checkpoint``, its inputs (``compress_inputs``) and what its
            policy saves (:func:`remat.policies.compressed`); without, every
            activation it saves (:class:`remat.compress`). Gradients become
            approximate (``docs/design/compression.md``).
        weight_pass: with ``checkpoint``, in a pipeline stage whose backward
            is split into an input and a weight pass: keep the input pass's
            recomputation for the weight pass (``"keep"``) or recompute
            once more for it (``"recompute"``); see :func:`remat.checkpoint`.

    Example:
        >>> BlockSetting(checkpoint=False).keeps
        True
    """

    checkpoint: bool = True
    policy: Any = None
    offload: bool = False
    name_outputs: tuple[str, ...] = ()
    preserve_rng_state: bool = True
    memory_budget: float | None = None
    compile: CompileSpec | None = None
    compress: Any = None
    weight_pass: WeightPass = "keep"

    def __post_init__(self) -> None:
        for flag in ("checkpoint", "offload", "preserve_rng_state"):
            if not isinstance(getattr(self, flag), bool):
                raise CheckpointTypeError(
                    f"{_API}: BlockSetting.{flag} must be a bool, got {getattr(self, flag)!r}."
                )
        if self.policy is not None and not self.checkpoint:
            raise CheckpointUsageError(
                f"{_API}: BlockSetting has a policy but checkpoint=False; a policy decides what "
                "a checkpoint keeps."
            )
        if isinstance(self.name_outputs, str) or not all(isinstance(n, str) for n in self.name_outputs):
            raise CheckpointTypeError(
                f"{_API}: BlockSetting.name_outputs must be a tuple of submodule names, got "
                f"{self.name_outputs!r}."
            )
        object.__setattr__(self, "name_outputs", tuple(self.name_outputs))
        if self.weight_pass not in ("keep", "recompute"):
            raise CheckpointUsageError(
                f"{_API}: BlockSetting.weight_pass must be 'keep' or 'recompute', got {self.weight_pass!r}."
            )
        if self.weight_pass == "recompute" and not self.checkpoint:
            raise CheckpointUsageError(
                f"{_API}: BlockSetting.weight_pass='recompute' is a checkpoint's choice; this "
                "setting has checkpoint=False."
            )
        if self.compile is not None and not isinstance(self.compile, CompileSpec):
            raise CheckpointTypeError(
                f"{_API}: BlockSetting.compile must be a CompileSpec or None, got "
                f"{type(self.compile).__name__}."
            )
        if self.memory_budget is not None:
            self._check_memory_budget()
        if self.compress is not None:
            from remat.compression import compression  # loaded with the first compressing block

            object.__setattr__(self, "compress", compression(self.compress, api=f"{_API}: BlockSetting.compress"))
            if self.offload or self.memory_budget is not None:
                raise CheckpointUsageError(
                    f"{_API}: BlockSetting.compress keeps what the block keeps smaller on its device; "
                    "it does not combine with offload or memory_budget."
                )

    def _check_memory_budget(self) -> None:
        budget = self.memory_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 <= budget <= 1.0:
            raise CheckpointUsageError(
                f"{_API}: BlockSetting.memory_budget must be a number in [0, 1], got {budget!r}."
            )
        if self.checkpoint or self.offload:
            raise CheckpointUsageError(
                f"{_API}: BlockSetting.memory_budget is for a block the compiler plans on its own "
                "(checkpoint=False, offload=False); a checkpoint already decides what it keeps."
            )
        if not region_memory_budgets_available():
            raise UnsupportedCheckpointError(
                f"{_API}: BlockSetting.memory_budget needs torch's per-region compile budget "
                f"(torch.autograd.graph.region_activation_memory_budget, torch 2.13 and newer); "
                f"this is torch {torch.__version__}. Use checkpoint or a policy instead."
            )
        object.__setattr__(self, "memory_budget", float(budget))

    @property
    def kept(self) -> Storage:
        """Where what the block keeps for backward lives: a host copy (``offload``), a
        compressed copy (``compress``), or its device.

        Example:
            >>> BlockSetting(offload=True).kept
            Storage('host')
        """
        if self.offload:
            return HOST
        if self.compress is not None:
            return Storage.compressed(self.compress)
        return DEVICE

    @property
    def keeps(self) -> bool:
        """Whether the block runs as it is (nothing to install)."""
        return not (
            self.checkpoint or self.offload or self.memory_budget is not None or self.compile or self.compress
        )


@dataclass
class Placement:
    """Checkpointing placed on a model by :func:`place`; ``remove()`` takes it all off.

    Attributes:
        blocks: the names of the blocks that were changed, in order (the kept
            ones are not listed).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> with place(model, {"1": BlockSetting()}) as handle:
        ...     handle.blocks
        ('1',)
        >>> "forward" in vars(model[1])
        False
    """

    blocks: tuple[str, ...]
    _undo: list[Callable[[], None]] = field(repr=False)

    def remove(self) -> None:
        """Restore every changed block (idempotent)."""
        undo, self._undo = self._undo, []
        for step in reversed(undo):
            step()

    def __enter__(self) -> Placement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def place(
    model: nn.Module, settings: Mapping[str, BlockSetting] | Iterable[tuple[str, BlockSetting]]
) -> Placement:
    """Give each named block of ``model`` its setting, in place; return the handle.

    Every name is looked up, and every setting checked, before anything
    changes: a bad name leaves the model as it was. A block that something
    else already routed (an applied plan, a checkpointed module) is an error:
    remove that first.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> place(model, {"0": BlockSetting(offload=True)}).blocks
        ('0',)
    """
    if not isinstance(model, nn.Module):
        raise CheckpointTypeError(f"{_API}: model must be an nn.Module, got {type(model).__name__}.")
    items = list(settings.items() if isinstance(settings, Mapping) else settings)
    found = []
    for fqn, setting in items:
        if not isinstance(setting, BlockSetting):
            raise CheckpointTypeError(
                f"{_API}: the setting of {fqn!r} must be a BlockSetting, got {type(setting).__name__}."
            )
        try:
            block = model.get_submodule(fqn) if fqn else model
        except AttributeError as error:
            raise CheckpointUsageError(
                f"{_API}: {type(model).__name__} has no submodule {fqn!r}; name blocks as "
                "model.named_modules() does."
            ) from error
        for relative in setting.name_outputs:
            _submodule(block, fqn, relative)
        found.append((fqn, block, setting))
    if any(setting.compile is not None for _, _, setting in found):
        warn_of_partitioner_settings(_API)
    undo: list[Callable[[], None]] = []
    changed = []
    try:
        for fqn, block, setting in found:
            if setting.keeps:
                continue
            undo.append(install(block, setting))
            changed.append(fqn)
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    return Placement(tuple(changed), undo)


def install(module: nn.Module, setting: BlockSetting) -> Callable[[], None]:
    """Run ``module`` under ``setting`` from now on; returns a function that undoes it.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(4, 4)
        >>> undo = install(layer, BlockSetting())
        >>> layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
        >>> undo()
    """
    if setting.keeps:
        return lambda: None
    if "forward" in vars(module):
        raise CheckpointUsageError(
            f"{_API}: {type(module).__name__} already has its forward replaced on the instance "
            "(a plan or a checkpoint is applied, or something else patched it); remove that "
            "before placing another setting."
        )
    undo = [_name_outputs(module, relative) for relative in setting.name_outputs]
    try:
        kept = setting.kept
        if setting.checkpoint and kept.where != "host":
            # The region keeps its inputs where `kept` says, and a compressed
            # block's policy keeps its saves compressed too.
            policy = setting.policy
            if kept.format is not None and policy is not None:
                policy = compressed(policy, kept.format)
            checkpoint_module(
                module, policy=policy, preserve_rng_state=setting.preserve_rng_state, compress_inputs=kept.format,
                weight_pass=setting.weight_pass,
            )
            undo.append(functools.partial(_uncheckpoint, module))
        elif kept.stored:
            # What the forward saves lives where `kept` says: a storage context
            # around it (a region inside it saves only its inputs there).
            forward = module.forward
            if setting.checkpoint:
                options = CheckpointOptions(
                    api=_API, policy=setting.policy, preserve_rng_state=setting.preserve_rng_state,
                    weight_pass=setting.weight_pass,
                )
                forward = functools.partial(run_checkpoint, options, forward)
            undo.append(_route(module, _stored(forward, kept)))
        elif setting.memory_budget is not None:
            undo.append(_route(module, _budgeted(module.forward, setting.memory_budget)))
        if setting.compile is not None:
            undo.append(_compile(module, setting.compile))
    except BaseException:
        for step in reversed(undo):
            step()
        raise

    def remove() -> None:
        for step in reversed(undo):
            step()

    return remove


def _uncheckpoint(module: nn.Module) -> None:
    if "forward" in vars(module):
        remove_checkpoint_module(module)


def _stored(original: Callable[..., Any], storage: Storage) -> Callable[..., Any]:
    """``original`` with every tensor it saves for backward kept where ``storage`` says."""

    def stored(*args: Any, **kwargs: Any) -> Any:
        with storing(storage):
            return original(*args, **kwargs)

    return stored


def _budgeted(original: Callable[..., Any], budget: float) -> Callable[..., Any]:
    """``original`` run under torch's per-region memory budget while torch.compile traces it."""
    # A str: Dynamo turns a float that differs between two compiles of the
    # same code into a symbolic value, which the budget API cannot read; a
    # str stays a constant (and a guard), one compiled graph per budget.
    spelled = repr(budget)

    def budgeted(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return original(*args, **kwargs)
        region = region_memory_budget(float(spelled))
        assert region is not None, "remat bug: BlockSetting checked the budget API"
        with region:
            return original(*args, **kwargs)

    return budgeted


def _compile(module: nn.Module, spec: CompileSpec) -> Callable[[], None]:
    """Compile the module's call as ``module.compile(**spec)`` does; returns what undoes it."""
    if vars(module).get("_compiled_call_impl") is not None:
        raise CheckpointUsageError(
            f"{_API}: {type(module).__name__} is compiled already; place the setting on the "
            "module before compiling it (BlockSetting.compile compiles it), or leave compile out."
        )
    compiled = torch.compile(module_call(module), **spec.arguments())
    previous = set_compiled_call(module, DefaultPartitionerCall(compiled, spec))

    def remove() -> None:
        set_compiled_call(module, previous)

    return remove


class DefaultPartitionerCall:
    """A compiled call that compiles under torch's default partitioner settings.

    The min-cut partitioner reads process-wide settings
    (``torch._functorch.config.activation_memory_budget`` and its kin) when
    Dynamo compiles or recompiles, which can happen on any call, and Dynamo's
    cache does not key on them: a block measured under one setting would run
    a graph split under another. Every call therefore runs with the defaults
    in place (``docs/design/compile.md``, "Isolation").
    """

    def __init__(self, compiled: Callable[..., Any], spec: CompileSpec) -> None:
        self._compiled = compiled
        self._settings = partitioner_defaults()
        self.spec = spec  # how it was compiled: a static estimate compiles it the same way

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # an enclosing compile: its settings are its own
            return self._compiled(*args, **kwargs)
        changed = partitioner_changes(self._settings)
        if not changed:
            return self._compiled(*args, **kwargs)
        with partitioner_settings({name: self._settings[name] for name in changed}):
            return self._compiled(*args, **kwargs)


def warn_of_partitioner_settings(api: str) -> None:
    """Warn that the process-wide partitioner settings that differ from torch's do not reach
    the blocks remat compiles (see :class:`DefaultPartitionerCall`); nothing when none differ.

    Example:
        >>> warn_of_partitioner_settings("remat.plan")  # torch's defaults: silent
    """
    changed = partitioner_changes(partitioner_defaults())
    if not changed:
        return
    spelled = ", ".join(f"{name}={value!r}" for name, value in sorted(changed.items()))
    warnings.warn(
        f"{api}: the blocks remat compiles are compiled with torch's default partitioner "
        f"settings, not the process-wide torch._functorch.config {spelled}, so that they run "
        "as they were placed or planned. For a compiler-chosen budget on one block use "
        "BlockSetting.memory_budget (torch 2.13 and newer).",
        stacklevel=3,
    )


def _route(module: nn.Module, routed: Callable[..., Any]) -> Callable[[], None]:
    """Make ``routed`` the module's instance ``forward``; returns what undoes it."""
    module.forward = routed

    def remove() -> None:
        if vars(module).get("forward") is routed:
            del module.forward

    return remove


def _submodule(block: nn.Module, block_name: str, relative: str) -> nn.Module:
    try:
        return block.get_submodule(relative)
    except AttributeError as error:
        raise CheckpointUsageError(
            f"{_API}: name_outputs has {relative!r}, but block {block_name!r} has no such "
            "submodule."
        ) from error


def _name_outputs(block: nn.Module, relative: str) -> Callable[[], None]:
    """A forward hook naming ``relative``'s outputs; returns what removes it."""
    handle = block.get_submodule(relative).register_forward_hook(functools.partial(_tag, relative))
    return handle.remove


def _tag(name: str, module: nn.Module, args: Any, output: Any) -> Any:
    # Every tensor of a tuple or list output is named: transformers' attention
    # returns (output, weights), and tagging only bare tensors kept nothing.
    if isinstance(output, torch.Tensor):
        return name_tensor(output, name)
    if isinstance(output, (tuple, list)):
        return type(output)(name_tensor(x, name) if isinstance(x, torch.Tensor) else x for x in output)
    return output
