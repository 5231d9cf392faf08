"""One configuration applies a whole checkpointing policy to a model.

What torchtitan's ``[activation_checkpoint]`` section and torchtune's
``enable_activation_checkpointing`` / ``ac_mode`` do, in one value:

.. code-block:: toml

    [activation_checkpoint]
    mode = "selective"            # "none" | "full" | "selective"
    every = 2                     # every 2nd block (blocks 1, 3, 5, ...)
    blocks = "layers.*"           # which modules are blocks (glob or "re:<regex>")
    save_ops = ["aten.mm", "aten._scaled_dot_product_flash_attention"]
    save_modules = ["attn"]       # keep these submodules' outputs (relative names)

or, as a plan saved by the planner (``Plan.save``), one option per module:

.. code-block:: toml

    [activation_checkpoint.regions]
    "layers.0" = "checkpoint"
    "layers.1" = "checkpoint:save_matmuls"
    "layers.2" = "keep"

:func:`apply_config` checkpoints every chosen block in place with
:func:`remat.checkpoint_module` through :func:`remat.placement.place` (no
wrapper: parameter and state-dict names do not change) and returns the
:class:`~remat.placement.Placement`, whose ``blocks`` names what changed
and whose ``remove()`` undoes it. Design and the torchtitan/torchtune
mapping: ``docs/design/config.md``.

Layer: beside ``remat.memory`` and ``remat.integrations``, above
:mod:`remat.placement`.

Example:
    >>> import torch, remat
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> remat.apply_config(model, {"mode": "selective", "every": 2}).blocks
    ('1', '3')
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from remat import policies
from remat._blocks import require_blocks
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.placement import BlockSetting, CompileSpec, Placement, place
from remat.policies import first_of, save_matmuls, save_only_names, save_ops

__all__ = ["CheckpointConfig", "apply_config", "config_from_toml", "region_setting"]

_API = "remat.apply_config"
# The built-in policies a config file (key ``policy``) or a region's option
# can name: every ready-made policy value of remat.policies.
_POLICIES: dict[str, Callable[..., Any]] = {
    name: value for name, value in vars(policies).items() if isinstance(value, policies.Policy)
}
Mode = Literal["none", "full", "selective"]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """A whole model's checkpointing, as a config file would state it.

    Attributes:
        mode: ``"none"`` (nothing), ``"full"`` (recompute each chosen block)
            or ``"selective"`` (keep what ``save_ops`` / ``save_modules`` say;
            with neither, the matmul and attention outputs).
        every: checkpoint every ``every``-th block, counting from 1 as
            torchtitan does (``every=2``: the 2nd, 4th, ... blocks, i.e.
            ``blocks.1``, ``blocks.3``); 1 checkpoints them all.
        blocks: which modules are blocks: ``None`` finds the stack of
            repeated blocks (:func:`remat._blocks.find_blocks`: the
            ``ModuleList``/``Sequential`` of one class with the most
            parameters); otherwise a glob on module names
            (``"layers.*"``) or ``"re:<regex>"`` (full match).
        save_ops: selective mode: ops whose outputs are kept, as
            ``"aten.mm"``, ``"mm"`` or ``"aten.mm.default"`` (every overload
            of a packet).
        save_modules: selective mode: submodules, named relative to their
            block (``"attn"``, ``"mlp.fc1"``), whose outputs are kept.
        policy: selective mode: a built-in policy by name
            (``"save_matmuls"``, ``"save_matmuls_without_batch_dims"``,
            ``"save_nothing"``), asked about every op that ``save_ops`` and
            ``save_modules`` do not keep. ``None``: ``"save_matmuls"`` when
            both lists are empty, else nothing more is kept.
        offload: also keep each chosen block's saved tensors (with
            checkpointing: its inputs) in host memory, as torchtune's
            ``enable_activation_offloading`` does: the block's forward runs
            inside ``remat.offload()`` (and checkpoints there unless
            ``mode="none"``); no name changes.
        compress: keep what each chosen block keeps compressed in this format
            (``"bf16"``, ``"fp8"``, ``"int8"``, ...): with checkpointing its
            inputs and what the policy saves, with ``mode="none"`` every
            activation it saves (``docs/design/compression.md``). The
            gradients become approximate; not with ``offload``.
        preserve_rng_state: as in :func:`remat.checkpoint`.
        regions: instead of the keys above, one option per module (a plan,
            as :meth:`remat.planner.Plan.save` writes it): module name to
            ``"keep"``, ``"checkpoint"``, ``"checkpoint:<policy>"`` (a
            built-in policy as for ``policy``), ``"offload"``, a
            checkpoint with ``"+offload"`` (its inputs wait in host memory),
            or ``"budget:<fraction>"`` (compiled regions: torch's per-region
            activation memory budget, torch 2.13 and newer); keep and the
            checkpoints may end in ``"+compress:<format>"``.
        compile: compile every chosen block (and, with ``regions``, every
            region) as ``block.compile(...)`` does, after checkpointing is
            placed: ``True`` for ``fullgraph=True`` with inductor, or a
            table of ``torch.compile`` arguments (``backend``, ``mode``,
            ``fullgraph``, ``dynamic``), or a
            :class:`~remat.placement.CompileSpec`. A plan made for compiled
            blocks (``remat.plan(..., compile=True)``) saves it.

    Example:
        >>> CheckpointConfig(mode="full", every=2).every
        2
        >>> CheckpointConfig(regions={"blocks.0": "checkpoint:save_matmuls"}).regions
        {'blocks.0': 'checkpoint:save_matmuls'}
    """

    mode: Mode = "full"
    every: int = 1
    blocks: str | None = None
    save_ops: tuple[str, ...] = ()
    save_modules: tuple[str, ...] = ()
    policy: str | None = None
    offload: bool = False
    compress: str | None = None
    preserve_rng_state: bool = True
    regions: Mapping[str, str] | None = None
    compile: CompileSpec | bool | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("none", "full", "selective"):
            raise CheckpointUsageError(
                f"{_API}: mode must be 'none', 'full' or 'selective', got {self.mode!r}."
            )
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise CheckpointUsageError(f"{_API}: every must be an int >= 1, got {self.every!r}.")
        if self.blocks is not None and not isinstance(self.blocks, str):
            raise CheckpointTypeError(
                f"{_API}: blocks must be a glob such as 'layers.*' or 're:<regex>', got "
                f"{type(self.blocks).__name__}."
            )
        for field in ("save_ops", "save_modules"):
            value = getattr(self, field)
            if isinstance(value, str) or not all(isinstance(item, str) for item in value):
                raise CheckpointTypeError(
                    f"{_API}: {field} must be a list of strings, got {value!r}."
                )
            object.__setattr__(self, field, tuple(value))
        if self.policy is not None and not isinstance(self.policy, str):
            raise CheckpointTypeError(
                f"{_API}: policy must be a policy name (a string), got "
                f"{type(self.policy).__name__}."
            )
        if self.policy is not None and self.policy not in _POLICIES:
            raise CheckpointUsageError(
                f"{_API}: policy must be one of {sorted(_POLICIES)}, got {self.policy!r}; "
                "for another policy pass it to remat.checkpoint_module yourself."
            )
        if self.mode != "selective" and (self.save_ops or self.save_modules or self.policy):
            raise CheckpointUsageError(
                f"{_API}: save_ops, save_modules and policy apply to mode='selective', not "
                f"{self.mode!r}."
            )
        for flag in ("offload", "preserve_rng_state"):
            if not isinstance(getattr(self, flag), bool):
                raise CheckpointTypeError(
                    f"{_API}: {flag} must be true or false, got {getattr(self, flag)!r}."
                )
        if self.compress is not None:
            if not isinstance(self.compress, str):
                raise CheckpointTypeError(
                    f"{_API}: compress must be a format name such as 'fp8', got {type(self.compress).__name__}."
                )
            from remat.compression import compression  # the name checked here, once

            compression(self.compress, api=f"{_API}: compress")
            if self.offload:
                raise CheckpointUsageError(
                    f"{_API}: compress keeps what a block keeps smaller on its device, offload sends "
                    "it to the host; choose one."
                )
        object.__setattr__(self, "compile", CompileSpec.of(self.compile, _API))
        if self.regions is not None:
            self._check_regions(self.regions)

    @property
    def compile_spec(self) -> CompileSpec | None:
        """How blocks are compiled (``compile`` as a :class:`~remat.placement.CompileSpec`), or None."""
        assert self.compile is None or isinstance(self.compile, CompileSpec), "remat bug: unchecked"
        return self.compile

    def _check_regions(self, regions: Mapping[str, str]) -> None:
        if not isinstance(regions, Mapping) or not all(
            isinstance(name, str) and isinstance(option, str) for name, option in regions.items()
        ):
            raise CheckpointTypeError(
                f"{_API}: regions must map module names to option names, got {regions!r}."
            )
        others = [
            field.name
            for field in dataclasses.fields(self)
            if field.name not in ("regions", "preserve_rng_state", "compile")
            and getattr(self, field.name) != field.default
        ]
        if others:
            raise CheckpointUsageError(
                f"{_API}: regions gives every module its own option; {others} do not apply "
                "with it. Drop them (a saved plan has regions only)."
            )
        for option in regions.values():
            region_setting(option, preserve_rng_state=self.preserve_rng_state, compile=self.compile_spec)
        object.__setattr__(self, "regions", dict(regions))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CheckpointConfig:
        """Build from a dict (a TOML/YAML/JSON section); unknown keys are an error.

        Example:
            >>> CheckpointConfig.from_mapping({"mode": "none"}).mode
            'none'
        """
        if not isinstance(values, Mapping):
            raise CheckpointTypeError(f"{_API}: a config is a mapping, got {type(values).__name__}.")
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise CheckpointUsageError(f"{_API}: unknown config keys {unknown}; valid keys are {known}.")
        return cls(**values)


def config_from_toml(source: str | Path, *, section: str = "activation_checkpoint") -> CheckpointConfig:
    """Read a :class:`CheckpointConfig` from a TOML file (a path) or TOML text.

    ``section`` is a dotted table name (``"training.activation_checkpoint"``);
    ``""`` reads the top level.

    Example:
        >>> config_from_toml('[activation_checkpoint]\\nmode = "full"\\nevery = 2').every
        2
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef, import-not-found, unused-ignore]
        except ModuleNotFoundError as error:
            raise CheckpointUsageError(
                f"{_API}: reading TOML on Python 3.10 needs tomli: pip install tomli"
            ) from error
    text = _toml_text(source)
    try:
        table: Any = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise CheckpointUsageError(f"remat.config_from_toml: not valid TOML: {error}.") from error
    for part in [p for p in section.split(".") if p]:
        if not isinstance(table, dict) or part not in table:
            raise CheckpointUsageError(
                f"remat.config_from_toml: the TOML has no [{section}] table; pass "
                "section='...' to name the table that holds the keys."
            )
        table = table[part]
    if not isinstance(table, dict):
        raise CheckpointTypeError(
            f"remat.config_from_toml: [{section}] must be a table of keys, got "
            f"{type(table).__name__}."
        )
    return CheckpointConfig.from_mapping(table)


def _toml_text(source: str | Path) -> str:
    # A one-line string ending in .toml is a path; anything else is TOML text
    # (TOML text with a table always has a newline).
    if not isinstance(source, (str, Path)):
        raise CheckpointTypeError(
            f"remat.config_from_toml: source must be a path or TOML text, got "
            f"{type(source).__name__}."
        )
    if isinstance(source, str) and ("\n" in source or not source.endswith(".toml")):
        return source
    path = Path(source)
    try:
        return path.read_text()
    except OSError as error:
        raise CheckpointUsageError(
            f"remat.config_from_toml: cannot read {str(path)!r}: {error.strerror}."
        ) from error


def apply_config(model: nn.Module, config: CheckpointConfig | Mapping[str, Any]) -> Placement:
    """Checkpoint ``model``'s blocks in place as ``config`` says; return the handle.

    The blocks are found by :func:`remat._blocks.find_blocks` (``blocks`` is
    its pattern) and changed by :func:`remat.placement.place`: checkpointed
    blocks get :func:`remat.checkpoint_module`; with ``save_modules``, each
    named submodule's output is tagged with :func:`remat.name` (a forward
    hook) and kept by the policy; with ``offload=True`` each block's forward
    runs inside ``remat.offload()`` (checkpointing inside it). No
    wrapper is added: parameter and state-dict names do not change. The
    returned :class:`~remat.placement.Placement` names the changed blocks
    (``.blocks``) and ``remove()`` undoes everything, hooks included.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> handle = remat.apply_config(model, {"mode": "selective", "every": 2, "save_ops": ["aten.mm"]})
        >>> handle.blocks
        ('1', '3')
        >>> handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise CheckpointTypeError(f"{_API}: model must be an nn.Module, got {type(model).__name__}.")
    chosen = config if isinstance(config, CheckpointConfig) else CheckpointConfig.from_mapping(config)
    if chosen.regions is not None:
        settings = {
            fqn: region_setting(
                option, preserve_rng_state=chosen.preserve_rng_state, compile=chosen.compile_spec
            )
            for fqn, option in chosen.regions.items()
        }
    elif chosen.mode == "none" and not chosen.offload and chosen.compile is None and chosen.compress is None:
        return place(model, {})
    else:
        blocks = require_blocks(model, chosen.blocks, api=_API, remedy="name them with blocks='layers.*'")
        setting = BlockSetting(
            checkpoint=chosen.mode != "none",
            policy=_policy(chosen) if chosen.mode == "selective" else None,
            offload=chosen.offload,
            name_outputs=chosen.save_modules,
            preserve_rng_state=chosen.preserve_rng_state,
            compile=chosen.compile_spec,
            compress=chosen.compress,
        )
        # Every chosen block is checkpointed; with compile, every block is compiled.
        plain = BlockSetting(checkpoint=False, compile=chosen.compile_spec)
        settings = {
            fqn: setting if position % chosen.every == 0 else plain
            for position, (fqn, _) in enumerate(blocks, start=1)
        }
    placed = place(model, settings)  # checks every name before it changes anything
    if placed.blocks:
        _no_kv_cache(model)
    return placed


# How a region's option reads: "keep", "offload", "checkpoint" with an
# optional ":policy" and an optional "+offload", or "budget:<fraction>" (the
# planner's Option names).
_REGION_OPTION = re.compile(
    r"(keep|offload|checkpoint(?::(\w+))?(\+offload)?|budget:(\d+(?:\.\d*)?|\.\d+))"
    r"(?:\+weight_pass:(keep|recompute))?(?:\+compress:(\w+))?"
)


def region_setting(
    option: str, *, preserve_rng_state: bool = True, compile: CompileSpec | None = None
) -> BlockSetting:
    """The :class:`~remat.placement.BlockSetting` of a region's option name.

    The names are the planner's (``remat.planner.Option.name``) and a saved
    plan's: ``"keep"``, ``"checkpoint"``, ``"checkpoint:<policy>"`` (a
    built-in policy), ``"offload"``, ``"checkpoint+offload"`` and
    ``"budget:<fraction>"`` (a compiled region under torch's per-region
    activation memory budget); a checkpoint may add
    ``"+weight_pass:recompute"`` (under a pipeline's split backward, the
    weight pass recomputes again: ``BlockSetting.weight_pass``); ``keep``
    and the checkpoints may end in ``"+compress:<format>"`` (what the region
    keeps, kept compressed: ``BlockSetting.compress``).

    Example:
        >>> region_setting("checkpoint:save_matmuls").policy is save_matmuls
        True
        >>> region_setting("keep").keeps
        True
        >>> str(region_setting("checkpoint+compress:int8").compress)
        'int8'
        >>> region_setting("checkpoint:save_matmuls+weight_pass:recompute").weight_pass
        'recompute'
    """
    match = _REGION_OPTION.fullmatch(option)
    if match is None:
        raise CheckpointUsageError(
            f"{_API}: region option {option!r} is not one of 'keep', 'checkpoint', "
            "'checkpoint:<policy>', 'offload', 'checkpoint+offload', 'budget:<fraction>', "
            "optionally followed by '+weight_pass:recompute' (checkpoints) and "
            "'+compress:<format>' (keep and checkpoints)."
        )
    policy_name = match.group(2)
    if policy_name is not None and policy_name not in _POLICIES:
        raise CheckpointUsageError(
            f"{_API}: region option {option!r} names policy {policy_name!r}; the built-in "
            f"policies are {sorted(_POLICIES)}."
        )
    kind = match.group(1)
    budget = match.group(4)
    weight_pass = match.group(5) or "keep"
    if match.group(5) is not None and not kind.startswith("checkpoint"):
        raise CheckpointUsageError(
            f"{_API}: region option {option!r}: '+weight_pass:' is a checkpoint's choice (what a "
            "split backward's weight pass reads); drop it or checkpoint the region."
        )
    return BlockSetting(
        checkpoint=kind.startswith("checkpoint"),
        policy=None if policy_name is None else _POLICIES[policy_name],
        offload=kind == "offload" or match.group(3) is not None,
        preserve_rng_state=preserve_rng_state,
        memory_budget=None if budget is None else float(budget),
        compile=compile,
        compress=match.group(6),
        weight_pass=weight_pass,  # type: ignore[arg-type]  # the pattern allows only the two values
    )


def _no_kv_cache(model: nn.Module) -> None:
    # A Hugging Face model with use_cache appends each layer's keys and values
    # to a cache in the forward; a recomputation would append again and see
    # a longer cache (transformers turns the cache off under its own
    # checkpointing for the same reason).
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        config.use_cache = False  # type: ignore[union-attr]
        warnings.warn(
            f"{_API}: set {type(model).__name__}.config.use_cache = False: a KV cache filled in "
            "the forward would be filled again by the recomputation.",
            stacklevel=3,
        )


def _policy(config: CheckpointConfig) -> Callable[..., Any]:
    parts: list[Callable[..., Any]] = []
    if config.save_ops:
        parts.append(save_ops(*[op for name in config.save_ops for op in _overloads(name)]))
    if config.save_modules:
        parts.append(save_only_names(*config.save_modules))
    if config.policy is not None:
        parts.append(_POLICIES[config.policy])
    if not parts:
        return save_matmuls
    return parts[0] if len(parts) == 1 else first_of(*parts)


def _overloads(name: str) -> list[Any]:
    """``"aten.mm"``, ``"mm"`` or ``"aten.mm.default"`` as OpOverloads."""
    parts = name.split(".")
    namespace, rest = (parts[0], parts[1:]) if len(parts) > 1 else ("aten", parts)
    packet = getattr(getattr(torch.ops, namespace, None), rest[0], None) if rest else None
    if packet is None or not hasattr(packet, "overloads"):
        raise CheckpointUsageError(
            f"{_API}: save_ops has {name!r}, which is no operator; write e.g. 'aten.mm' or "
            "'aten._scaled_dot_product_flash_attention'."
        )
    if len(rest) == 2:
        overload = getattr(packet, rest[1], None)
        if overload is None:
            raise CheckpointUsageError(f"{_API}: save_ops: {name!r} has no such overload.")
        return [overload]
    return [getattr(packet, overload) for overload in packet.overloads()]


