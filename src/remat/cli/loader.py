"""One model loader for every ``remat`` command: ``--model`` and ``--hf-config``.

Layer: ``remat.cli`` (the application), above :mod:`remat.models`; imports
the library (``remat._compat``, ``remat.errors``), ``transformers`` only for
``--hf-config`` and ``peft`` only for ``--lora``.

What ``remat report``, ``remat estimate`` and ``remat plan`` accept:

* ``--model gpt`` (the default), ``mlp`` or ``convnet``: a built-in model
  (:mod:`remat.models`), sized by the command's flags;
* ``--model package.module:factory``: a function of yours, imported (no file
  is ever unpickled) and called with no arguments; see :data:`FACTORY_CONTRACT`;
* ``--hf-config PATH``: a HuggingFace ``config.json`` (or a directory holding
  one), built with ``AutoModelForCausalLM.from_config``: random weights,
  nothing downloaded (``pip install remat[hf]``). The config gets
  ``use_cache=False`` (a training step keeps no KV cache) and the inputs are
  random token ids of ``--batch`` x ``--seq``; the loss is next-token
  cross-entropy on the logits.

``remat estimate`` builds every model on the ``meta`` device (shapes and
bytes, no data: a 7B model costs nothing), or as fake CPU tensors inside a
fake-tensor mode for a sharded estimate (FSDP2 refuses meta parameters); the
other commands build it on the CPU.

Example:
    >>> loaded = load_model(ModelRequest(command="remat report", model="remat.models:tiny_gpt"))
    >>> type(loaded.model).__name__, tuple(loaded.args[0].shape)
    ('GPT', (2, 32))
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch
from torch import Tensor, nn

from remat._compat.fake import outside_fake_mode
from remat._compat.pytree import tree_flatten, tree_unflatten
from remat._compat.versions import flash_cpu_takes_grouped_heads
from remat.errors import CheckpointUsageError, ModelLoadError, RematError
from remat.models import GPT, ConvNet, GPTConfig, MLPChain, lm_loss, make_batch, meta_model
from remat.planner.step import LossFn

__all__ = [
    "BUILTIN_MODELS",
    "FACTORY_CONTRACT",
    "HF_DEFAULT_SEQ",
    "LoadedModel",
    "ModelRequest",
    "import_factory",
    "load_model",
    "parse_model_spec",
]

FACTORY_CONTRACT = (
    "FACTORY() takes no arguments and returns (model, args), (model, args, kwargs), "
    "(model, args, loss_fn) or (model, args, kwargs, loss_fn): an nn.Module, its positional "
    "inputs (a tuple, or one value), a dict of keyword inputs, and loss_fn(output) -> scalar "
    "tensor (default: the sum of the output's floating-point tensors)"
)
"""The one contract of a ``--model package.module:factory`` (all commands)."""

BUILTIN_MODELS = ("gpt", "mlp", "convnet")
"""Names ``--model`` accepts besides ``package.module:factory``."""

HF_DEFAULT_SEQ = 2048
"""Tokens per sequence of an HF model when the command gives none (capped by its positions)."""

_FACTORY_SPEC = re.compile(r"([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)")

_HF_INSTALL_HINT = "install it with: pip install remat[hf] (or pip install transformers)"

# transformers' name for remat's meta-device attention (see _fused_hf_attention).
_HF_FUSED_ATTENTION = "remat_fused_causal"


Device = Literal["cpu", "meta", "fake"]


@dataclass(frozen=True)
class ModelRequest:
    """What a command asks the loader for.

    Attributes:
        command: the command, for messages (``"remat estimate"``).
        model: a name of :data:`BUILTIN_MODELS` or ``package.module:factory``;
            ``None`` is ``"gpt"`` unless ``hf_config`` is given.
        hf_config: a HuggingFace ``config.json`` or a directory holding one.
        batch: sequences (or samples) of the built-in and HF models' inputs.
        seq: tokens per sequence of the HF model's inputs; ``None``: the
            config's positions, at most :data:`HF_DEFAULT_SEQ`.
        gpt: the built-in GPT's shape (default ``GPTConfig(seq_len=seq)``).
        device: ``"meta"`` (nothing allocated), ``"cpu"``, or ``"fake"``: as
            on meta (no data, so nothing reads tensor values), but on the
            CPU inside the caller's fake-tensor mode, which FSDP2 accepts.
        dtype: floating dtype of parameters and floating inputs (on ``cpu``
            the model is initialized in float32, then converted).
        attention: on ``meta`` and ``fake``, ``"fused"`` runs attention through
            the fused op real runs use; ``"math"`` keeps the attention matrix.
        seed: seed of weights and inputs on the CPU.
        freeze: globs of parameter names (``model.named_parameters()``) to
            freeze (``requires_grad=False``: no gradient, no optimizer state).
        lora_rank: inject LoRA adapters of this rank into every linear layer
            but the output layer (``peft``'s ``target_modules="all-linear"``)
            and freeze everything else (``pip install remat[lora]``).

    Example:
        >>> ModelRequest(command="remat plan", batch=4).model is None
        True
    """

    command: str
    model: str | None = None
    hf_config: str | Path | None = None
    batch: int = 2
    seq: int | None = None
    gpt: GPTConfig | None = None
    device: Device = "cpu"
    dtype: torch.dtype = torch.float32
    attention: Literal["fused", "math"] = "fused"
    seed: int = 0
    freeze: tuple[str, ...] = ()
    lora_rank: int | None = None

    @property
    def builtin_gpt(self) -> bool:
        """Whether it asks for the embedded GPT (known before anything is built).

        Example:
            >>> ModelRequest(command="remat plan", model="gpt").builtin_gpt
            True
        """
        return self.hf_config is None and self.model in (None, "gpt")


@dataclass
class LoadedModel:
    """A model ready for a command: ``loss_fn(model(*args, **kwargs))`` is a training step.

    Attributes:
        model: the module (on the requested device).
        args: positional example inputs.
        kwargs: keyword example inputs.
        loss_fn: output -> scalar loss; ``None``: the command's default.
        title: one line naming the model and its input shape.
        notes: lines the command prints before its result (e.g. that
            ``use_cache`` was turned off).
        builtin_gpt: whether this is the embedded GPT (its forward takes a
            ``checkpoint_fn``).
        head: the output layer's submodule name and the per-position
            targets of ``loss_fn``, where the loader knows them (the embedded
            GPT, Hugging Face causal LMs): lets ``remat plan --head`` plan it.

    Example:
        >>> loaded = load_model(ModelRequest(command="remat report", model="mlp"))
        >>> loaded.title
        'MLPChain (4 blocks), batch 2'
    """

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    loss_fn: LossFn | None = None
    title: str = ""
    notes: tuple[str, ...] = ()
    head: tuple[str, Tensor] | None = None
    builtin_gpt: bool = False


def parse_model_spec(spec: str, command: str) -> tuple[str, str] | None:
    """``None`` for a built-in name, ``(module, attribute)`` for ``package.module:factory``.

    A spec of neither form is a usage error (exit status 2).

    Example:
        >>> parse_model_spec("mypkg.models:small", "remat plan")
        ('mypkg.models', 'small')
        >>> parse_model_spec("gpt", "remat plan") is None
        True
    """
    if spec in BUILTIN_MODELS:
        return None
    match = _FACTORY_SPEC.fullmatch(spec)
    if match is None:
        raise CheckpointUsageError(
            f"{command}: --model must be one of {', '.join(BUILTIN_MODELS)} or look like "
            f"package.module:factory, got {spec!r}."
        )
    return match.group(1), match.group(2)


def load_model(request: ModelRequest) -> LoadedModel:
    """Build the model a command was given (see the module docstring).

    Raises :class:`~remat.errors.CheckpointUsageError` for a malformed
    request and :class:`ModelLoadError` when the model cannot be built.

    Example:
        >>> loaded = load_model(ModelRequest(command="remat estimate", device="meta"))
        >>> loaded.model.head.weight.device.type, loaded.builtin_gpt
        ('meta', True)
    """
    if request.device not in ("cpu", "meta", "fake"):
        raise CheckpointUsageError(
            f"{request.command}: device must be 'cpu', 'meta' or 'fake', got {request.device!r}."
        )
    for name in ("batch", "seq"):
        value = getattr(request, name)
        if (value is not None or name == "batch") and (not isinstance(value, int) or value < 1):
            raise CheckpointUsageError(f"{request.command}: --{name} must be an int >= 1, got {value!r}.")
    if request.lora_rank is not None and (
        isinstance(request.lora_rank, bool) or not isinstance(request.lora_rank, int) or request.lora_rank < 1
    ):
        raise CheckpointUsageError(f"{request.command}: --lora must be an int >= 1, got {request.lora_rank!r}.")
    if request.hf_config is not None:
        if request.model is not None:
            raise CheckpointUsageError(
                f"{request.command}: give --model or --hf-config, not both."
            )
        loaded = _hf_model(request, Path(request.hf_config))
    else:
        spec = request.model or "gpt"
        target = parse_model_spec(spec, request.command)
        loaded = _builtin(spec, request) if target is None else _factory_model(spec, *target, request)
    if not _data_free(request) and request.dtype != torch.float32:
        # A real model is built in float32 (its own initialization); a step
        # measured for the estimate it is set beside runs in the same dtype.
        loaded.model.to(request.dtype)
        loaded.args, loaded.kwargs = _to_device((loaded.args, loaded.kwargs), "cpu", request.dtype)
    _adapt(loaded, request)
    if request.device == "fake":
        # Last, and once: Module.to cannot convert fake parameters (it swaps
        # them, which the fake mode's own references forbid), so the model is
        # built and adapted on meta and only then given fake CPU parameters.
        fake_parameters(loaded.model, request.dtype)
    return loaded


def _adapt(loaded: LoadedModel, request: ModelRequest) -> None:
    """Freeze parameters by name and inject LoRA adapters, as the request asks (in place)."""
    model = loaded.model
    if request.freeze:
        names = [name for name, _ in model.named_parameters()]
        for glob in request.freeze:
            if not any(fnmatch.fnmatchcase(name, glob) for name in names):
                raise CheckpointUsageError(
                    f"{request.command}: --freeze {glob!r} matches no parameter of the model "
                    f"(names look like {names[0]!r})."
                )
        for name, param in model.named_parameters():
            if any(fnmatch.fnmatchcase(name, glob) for glob in request.freeze):
                param.requires_grad_(False)
        loaded.notes += (f"frozen: {', '.join(request.freeze)}",)
    if request.lora_rank is not None:
        try:
            peft = importlib.import_module("peft")
        except ImportError as error:
            raise ModelLoadError(
                f"--lora needs the peft package, which is not installed ({error}); install it "
                "with: pip install remat[lora] (or pip install peft)."
            ) from error
        rank = request.lora_rank
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
        on_meta = request.device != "cpu" and all(p.device.type == "meta" for p in model.parameters())
        if request.device == "fake" and not on_meta:
            raise CheckpointUsageError(
                f"{request.command}: --lora on a model that --model builds inside the fake "
                "tensors of a sharded estimate cannot be converted (its parameters are fake "
                "already); add the adapters in the factory, or estimate on one rank."
            )
        try:
            with outside_fake_mode() if request.device == "fake" else contextlib.nullcontext():
                peft.inject_adapter_in_model(config, model)  # freezes all but the adapters
        except Exception as error:
            raise ModelLoadError(
                f"cannot add LoRA adapters (rank {rank}) to {loaded.title}: "
                f"{type(error).__name__}: {error}"
            ) from error
        loaded.notes += (f"LoRA rank {rank} on every linear layer but the output; the rest frozen",)
    if request.freeze or request.lora_rank is not None:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        loaded.title += f", {trainable:,} of {total:,} parameters trainable"


def _data_free(request: ModelRequest) -> bool:
    """Whether the model runs without data (meta or fake tensors): nothing may read values."""
    return request.device != "cpu"


def _builtin(name: str, request: ModelRequest) -> LoadedModel:
    if name == "gpt":
        return _gpt(request)
    torch.manual_seed(request.seed)
    generator = torch.Generator().manual_seed(request.seed)
    with _building(request):
        model: nn.Module = MLPChain() if name == "mlp" else ConvNet()
        if _data_free(request):
            model.to(request.dtype)
    shape = (request.batch, 256) if name == "mlp" else (request.batch, 3, 32, 32)
    if _data_free(request):
        inputs = torch.zeros(shape, dtype=request.dtype, device=_device(request))
    else:
        inputs = torch.randn(shape, generator=generator)
    blocks = sum(1 for _ in model.get_submodule("blocks").children())
    if isinstance(model, MLPChain):
        title = f"MLPChain ({blocks} blocks), batch {request.batch}"
    else:
        title = f"ConvNet ({blocks} blocks), 32x32 images, batch {request.batch}"
    return LoadedModel(model, (inputs,), title=title)


def _building(request: ModelRequest) -> contextlib.AbstractContextManager[Any]:
    """Where a built-in or transformers model is built: on the CPU, or on real
    meta tensors when the run has no data (outside the caller's fake mode for
    ``"fake"``: the model becomes fake last, in :func:`load_model`)."""
    if not _data_free(request):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    if request.device == "fake":
        stack.enter_context(outside_fake_mode())
    stack.enter_context(torch.device("meta"))
    return stack


def _gpt(request: ModelRequest) -> LoadedModel:
    config = request.gpt or GPTConfig(seq_len=request.seq or GPTConfig.seq_len)
    title = (
        f"GPT {config.n_layers} layers x d_model {config.d_model}, seq {config.seq_len}, "
        f"batch {request.batch}"
    )
    if _data_free(request):
        with _building(request):
            model = meta_model(config, dtype=request.dtype, attention=request.attention)
        # Laid out as make_batch lays them out (two views of one token row),
        # so that the loss copies what a real step's loss copies.
        tokens = torch.zeros(request.batch, config.seq_len + 1, dtype=torch.long, device=_device(request))
        idx, targets = tokens[:, :-1], tokens[:, 1:]
    else:
        torch.manual_seed(request.seed)
        model = GPT(config)
        idx, targets = make_batch(config, request.batch, torch.Generator().manual_seed(request.seed))

    def loss_fn(logits: Tensor) -> Tensor:
        return lm_loss(logits, targets)

    return LoadedModel(
        model, (idx,), loss_fn=loss_fn, title=title, builtin_gpt=True, head=("head", targets)
    )


# -- package.module:factory ----------------------------------------------------


def _factory_model(spec: str, module_name: str, attribute: str, request: ModelRequest) -> LoadedModel:
    factory = import_factory(spec, module_name, attribute)
    try:
        if request.device == "meta":
            # Parameters and example inputs the factory creates land on meta: no memory.
            with torch.device("meta"):
                made = factory()
        else:
            made = factory()  # on "fake", inside the caller's fake-tensor mode: no memory
    except RematError:
        raise
    except Exception as error:
        where = " under torch.device('meta')" if request.device == "meta" else ""
        raise ModelLoadError(
            f"the factory {spec}(){where} raised {type(error).__name__}: {error}"
        ) from error
    loaded = _check_factory_result(made, spec)
    if request.device == "meta":
        loaded.model.to(device="meta", dtype=request.dtype)
    if _data_free(request):
        loaded.args, loaded.kwargs = _to_device(
            (loaded.args, loaded.kwargs), _device(request), request.dtype
        )
    loaded.title = f"{type(loaded.model).__name__} from {spec}"
    return loaded


def import_factory(spec: str, module_name: str, attribute: str) -> Callable[[], Any]:
    """The function ``attribute`` of ``module_name`` (dots walk into objects), never called.

    Example:
        >>> import_factory("remat.models:tiny_gpt", "remat.models", "tiny_gpt").__name__
        'tiny_gpt'
    """
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as error:  # a module that fails while importing is as bad as a missing one
        raise ModelLoadError(
            f"cannot load {spec!r} for --model: cannot import {module_name!r} "
            f"({type(error).__name__}: {error}); check the module path and that its directory "
            "is on PYTHONPATH."
        ) from error
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ModelLoadError(
                f"cannot load {spec!r} for --model: {module_name!r} has no attribute {attribute!r}."
            )
        found = getattr(found, part)
    if not callable(found):
        raise ModelLoadError(
            f"cannot load {spec!r} for --model: it is a {type(found).__name__}, not a function."
        )
    factory: Callable[[], Any] = found
    return factory


def _check_factory_result(made: Any, spec: str) -> LoadedModel:
    shape_ok = isinstance(made, tuple) and len(made) in (2, 3, 4) and isinstance(made[0], nn.Module)
    if shape_ok and len(made) == 3:
        shape_ok = isinstance(made[2], dict) or callable(made[2])
    if shape_ok and len(made) == 4:
        shape_ok = isinstance(made[2], dict) and callable(made[3])
    if not shape_ok:
        got = (
            f"a tuple of ({', '.join(type(x).__name__ for x in made)})"
            if isinstance(made, tuple)
            else f"a value of type {type(made).__name__}"
        )
        raise ModelLoadError(f"the factory {spec} returned {got}; {FACTORY_CONTRACT}.")
    args = made[1] if isinstance(made[1], tuple) else (made[1],)
    kwargs: dict[str, Any] = {}
    loss_fn: LossFn | None = None
    for extra in made[2:]:
        if isinstance(extra, dict):
            kwargs = dict(extra)
        else:
            loss_fn = extra
    return LoadedModel(made[0], args, kwargs, loss_fn)


def _device(request: ModelRequest) -> str:
    """Where the model's tensors live: meta, or the CPU (real, or fake inside a fake mode)."""
    return "meta" if request.device == "meta" else "cpu"


def fake_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Give ``model`` new, empty CPU parameters and buffers (floating ones in ``dtype``).

    Called inside a fake-tensor mode, the new tensors are fake: sizes, no
    data. Parameters shared by several modules (tied embeddings) stay shared,
    and ``requires_grad`` is kept (frozen parameters stay frozen).
    ``Module.to`` cannot do this: it swaps fake parameters in place, which
    the fake mode's own references forbid (torch 2.13).

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> fake_parameters(layer, torch.bfloat16)
        >>> layer.weight.dtype
        torch.bfloat16
    """
    made: dict[int, Tensor] = {}

    def empty(tensor: Tensor) -> Tensor:
        new = made.get(id(tensor))
        if new is None:
            kind = dtype if tensor.is_floating_point() else tensor.dtype
            new = torch.empty(tensor.shape, dtype=kind, device="cpu")
            if isinstance(tensor, nn.Parameter):
                new = nn.Parameter(new, requires_grad=tensor.requires_grad)
            made[id(tensor)] = new
        return new

    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, empty(param))
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, empty(buffer))


def _to_device(tree: Any, device: str, dtype: torch.dtype) -> Any:
    """Tensors of ``tree`` on ``device`` (floating ones in ``dtype``), as the model is."""
    leaves, spec = tree_flatten(tree)
    moved = [
        leaf.to(device=device, dtype=dtype if leaf.is_floating_point() else leaf.dtype)
        if isinstance(leaf, Tensor)
        else leaf
        for leaf in leaves
    ]
    return tree_unflatten(moved, spec)


# -- --hf-config ---------------------------------------------------------------


def _transformers() -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ModelLoadError(
            f"--hf-config needs the transformers package, which is not installed "
            f"({error}); {_HF_INSTALL_HINT}."
        ) from error


def _config_file(path: Path) -> Path:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        what = f"{path} holds no config.json" if path.is_dir() else f"{path} does not exist"
        raise ModelLoadError(f"cannot read --hf-config: {what} (nothing is downloaded).")
    try:
        json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"cannot read --hf-config {file}: not a JSON file ({error}).") from error
    return file


def _hf_model(request: ModelRequest, path: Path) -> LoadedModel:
    transformers = _transformers()
    file = _config_file(path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(file), local_files_only=True)
    except Exception as error:  # transformers raises ValueError, KeyError, OSError...
        raise ModelLoadError(
            f"cannot read --hf-config {file}: {type(error).__name__}: {error}"
        ) from error
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ModelLoadError(f"--hf-config {file} has no vocab_size: not a language model config.")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = request.seq or min(HF_DEFAULT_SEQ, positions if isinstance(positions, int) else HF_DEFAULT_SEQ)
    if isinstance(positions, int) and seq > positions:
        raise CheckpointUsageError(
            f"{request.command}: --seq {seq} exceeds the config's {positions} positions "
            "(max_position_embeddings); pass a smaller --seq."
        )
    # A training step keeps no KV cache; with one, forward returns (and the
    # planner's profile holds on to) every layer's keys and values.
    config.use_cache = False
    options: dict[str, Any] = {}
    if _data_free(request) and request.attention == "fused":
        transformers.AttentionInterface.register(_HF_FUSED_ATTENTION, _fused_hf_attention)
        options["attn_implementation"] = _HF_FUSED_ATTENTION
    elif _data_free(request):
        # transformers' sdpa masks read tensor values, which meta tensors lack.
        options["attn_implementation"] = "eager"
    try:
        if _data_free(request):
            # On meta even for a fake model: its dtype is set there, and then
            # its parameters are replaced by fake ones.
            with _building(request):
                model = transformers.AutoModelForCausalLM.from_config(config, **options)
                model.to(request.dtype)
        else:
            torch.manual_seed(request.seed)
            model = transformers.AutoModelForCausalLM.from_config(config, **options)
    except Exception as error:
        raise ModelLoadError(
            f"cannot build a causal LM from --hf-config {file}: {type(error).__name__}: {error}"
        ) from error
    model.train()
    shape = (request.batch, seq)
    kwargs: dict[str, Any] = {}
    if _data_free(request):
        ids = torch.zeros(shape, dtype=torch.long, device=_device(request))
        if request.attention == "math":
            kwargs["attention_mask"] = torch.ones(shape, dtype=torch.long, device=_device(request))
    else:
        ids = torch.randint(vocab, shape, generator=torch.Generator().manual_seed(request.seed))

    # Next-token targets; the last position has none (-100: ignored by cross-entropy).
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)

    def loss_fn(output: Any) -> Tensor:
        return lm_loss(output.logits, targets)

    layers = getattr(config, "num_hidden_layers", "?")
    output_layer = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is output_layer and n), None)
    return LoadedModel(
        model,
        (ids,),
        kwargs,
        loss_fn=loss_fn,
        title=f"{type(model).__name__} {layers} layers from {file}, seq {seq}, "
        f"batch {request.batch}",
        notes=(f"{file.name}: use_cache=False (a training step keeps no KV cache)",),
        head=(head_name, targets) if head_name is not None else None,
    )


def _fused_hf_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention through the fused CPU flash op, for transformers models on meta.

    On ``meta`` transformers' sdpa path cannot build its mask (it reads
    values) and ``scaled_dot_product_attention`` would fall back to the math
    form that keeps the attention matrix; real runs use a fused kernel that
    keeps the output and a log-sum-exp, which this op records (on the CPU
    that holds without attention dropout; with it, CPU runs fall back to the
    math form while CUDA's flash kernel stays fused). Grouped
    key/value heads go in as they are (transformers' sdpa path passes them
    with ``enable_gqa`` when there is no mask); a torch whose op does not take
    them gets them repeated, as transformers does there.
    """
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if key.shape[1] != query.shape[1] and not flash_cpu_takes_grouped_heads():
        key, value = _repeat_heads(key, query.shape[1]), _repeat_heads(value, query.shape[1])
    try:
        out = fused(query, key, value, dropout, True, scale=scaling)[0]
    except RuntimeError:
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        out = fused(query, key, value, dropout, True, scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


def _repeat_heads(tensor: Tensor, heads: int) -> Tensor:
    # As transformers' sdpa path does without enable_gqa (expand, then a copy):
    # the same tensors, so the estimate counts what a real step keeps.
    batch, groups, seq, dim = tensor.shape
    repeats = heads // groups
    return tensor[:, :, None].expand(batch, groups, repeats, seq, dim).reshape(batch, heads, seq, dim)

