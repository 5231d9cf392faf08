"""At scale: every remat form on real models under DDP, FSDP2, tensor parallel and a 2-D mesh.

A composition matrix, run on CPU with gloo: a tiny Hugging Face Llama (built
from a local ``LlamaConfig``, nothing downloaded) and the embedded GPT
(``remat.models.GPT``), each trained for two AdamW steps on 2 and 4 ranks
under an engine (DDP; FSDP2 ``fully_shard`` with and without resharding
after forward, with and without bf16 ``MixedPrecisionPolicy``; tensor
parallel with ``parallelize_module``; FSDP2 + TP on a 2x2 mesh) after a remat
form put checkpointing on the blocks (the Hugging Face integration, selective
policies by op and by name, the wrappers, ``checkpoint_module``,
``apply_config``, a planner's decisions, offload, compression), in torchtitan's order:
checkpoint the blocks, then optionally ``torch.compile`` them, then shard.

The oracle of every row is the same engine without checkpointing (same
seeds, different data per data-parallel rank): each step's loss and every
gradient and final weight must be ``torch.equal``, rank by rank, on the
rank's own shard of each DTensor (every rank compares its part, so together
the whole tensor, without a collective per tensor); a compressing form: the
first loss equal, the gradients, gathered whole, within the format's
tolerance. The backward's aten ops are counted, so each row
also proves that it recomputes (full checkpointing reruns matmuls and
attention) and that a selective policy recomputes less. Where torch itself
fails on a release (a compiled row), a twin row runs the same layers under
torch's own checkpointing; when it fails the same way, the row is skipped
with torch's error as the reason.
The rows, their outcomes and the skips: docs/design/distributed.md.

One launch per world size runs every row: ``rank_records`` runs on each rank
by the library's launcher (``helpers.launch_on_ranks``, as in
``test_distributed.py``), each rank returns its records and the tests only
compare.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.util
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from helpers import OpCounter, launch_once, tiny_llama_config
from remat import policies
from remat._compat.versions import dynamo_traces_policy_objects
from remat.composable import checkpoint_module
from remat.integrations.huggingface import enable_gradient_checkpointing
from remat.models import GPT, GPTConfig, lm_loss
from remat.nn import apply_activation_checkpointing, checkpoint_wrapper

# One launch per world size serves every row (``ranks`` below): one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("distributed_models")

STEPS = 2
BATCH = 2
SEQ = 16
VOCAB = 128
LAUNCH_TIMEOUT_S = 240
# torch.compile rows use the aot_eager backend: the compiler's recomputation
# (AOT autograd's partitioner honouring remat's regions) without inductor's
# C++ builds, which take minutes on a small CPU machine.
COMPILE_BACKEND = "aot_eager"

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_FSDP2 = dist.is_available() and hasattr(
    importlib.import_module("torch.distributed.fsdp"), "fully_shard"
)
# Skip reasons for rows this torch cannot run (the rows are listed and skipped, never dropped).
NEEDS_FSDP2 = "torch.distributed.fsdp.fully_shard (FSDP2) is public from torch 2.6"
NEEDS_TRANSFORMERS = "transformers is not installed (pip install remat[hf])"
NEEDS_POLICY_OBJECTS = "torch.compile takes remat.policies objects into a region from torch 2.9"


# ----------------------------------------------------------------- the matrix


@dataclasses.dataclass(frozen=True)
class Engine:
    """How the model is distributed: ``kind`` plus FSDP2's options."""

    kind: str  # "ddp" | "fsdp" | "tp" | "fsdp+tp"
    world_size: int
    reshard: bool = True
    bf16: bool = False

    @property
    def data_parallel(self) -> int:
        return {"ddp": self.world_size, "fsdp": self.world_size, "tp": 1}.get(self.kind, 2)


ENGINES = {
    "ddp": Engine("ddp", 2),
    "fsdp": Engine("fsdp", 2),
    "fsdp-noreshard": Engine("fsdp", 2, reshard=False),
    "fsdp-bf16": Engine("fsdp", 2, bf16=True),
    "fsdp-bf16-noreshard": Engine("fsdp", 2, reshard=False, bf16=True),
    "tp": Engine("tp", 2),
    "fsdp-4ranks": Engine("fsdp", 4),
    "fsdp-tp-4ranks": Engine("fsdp+tp", 4),
    "fsdp-bf16-tp-4ranks": Engine("fsdp+tp", 4, bf16=True),
}

# What each form recomputes: the backward's extra ops against the oracle's, by
# group (see op_group): "zero" none; "some" more than none; "fewer" more than
# none and fewer than the same engine's fully checkpointed row ("module").
GROUPS = ("matmul", "attention", "norm")
FULL = {"matmul": "some", "attention": "some", "norm": "some"}
MATMULS_KEPT = {"matmul": "zero", "attention": "zero", "norm": "some"}
ATTENTION_KEPT = {"matmul": "some", "attention": "zero", "norm": "some"}
NOTHING = {"matmul": "zero", "attention": "zero", "norm": "zero"}
LLAMA_FORMS: dict[str, dict[str, str]] = {
    "hf": FULL,  # remat.integrations.huggingface: the function form for HF models
    "hf-matmuls": MATMULS_KEPT,
    # The attention module's output (its o_proj) is kept, the attention itself reruns:
    "hf-names": {"matmul": "fewer", "attention": "some", "norm": "some"},
    "hf-offload": FULL,
    "wrapper": FULL,
    "wrapper-matmuls": MATMULS_KEPT,
    "module": FULL,
    "module-matmuls": MATMULS_KEPT,
    "config-every2": {"matmul": "fewer", "attention": "fewer", "norm": "fewer"},
    "config-names": {"matmul": "fewer", "attention": "some", "norm": "some"},
    "config-offload": FULL,
    "offload": NOTHING,
    # Compression (approximate gradients: test_compressed_rows_stay_within_tolerance):
    "config-compress": NOTHING,
    "module-compress": MATMULS_KEPT,
    "plan": {},  # what the plan chose: checked against its decisions
}
GPT_FORMS: dict[str, dict[str, str]] = {
    "function": FULL,
    "function-matmuls": MATMULS_KEPT,
    "function-names": ATTENTION_KEPT,
    "function-offload-names": ATTENTION_KEPT,
    "module": FULL,
    "module-matmuls": MATMULS_KEPT,
    "wrapper-names": ATTENTION_KEPT,
    "config-selective": {"matmul": "zero", "attention": "some", "norm": "some"},
    "config-compress": NOTHING,
    "function-compress-inputs": FULL,
}
COMPRESSED = {"config-compress": "int8", "module-compress": "fp8", "function-compress-inputs": "int8"}
"""Forms that keep saved tensors compressed, with their format: the forward is the
oracle's, bitwise; the gradients are within the format's tolerance."""
TOLERANCE = {"fp8": 8e-2, "int8": 3e-2}  # as tests/offload/test_compress.py states them
FORMS = {"llama": LLAMA_FORMS, "gpt": GPT_FORMS}


# Compiled rows that fail on some torch release run a twin: the same layers
# under torch's own checkpointing, to tell torch's failure from remat's.
TORCH_TWIN = {("gpt", "tp", "module"): "torch-wrapper"}  # fails on torch 2.13.0


@dataclasses.dataclass(frozen=True)
class Row:
    model: str  # "llama" | "gpt"
    engine: str  # a key of ENGINES
    form: str  # "none" (the oracle) or a key of the model's forms
    compiled: bool = False

    @property
    def name(self) -> str:
        return f"{self.model}/{self.engine}/{self.form}" + ("-compiled" if self.compiled else "")

    @property
    def oracle(self) -> Row:
        return dataclasses.replace(self, form="none")

    @property
    def twin(self) -> Row | None:
        form = TORCH_TWIN.get((self.model, self.engine, self.form))
        return dataclasses.replace(self, form=form) if form and self.compiled else None

    @property
    def full(self) -> Row:
        return dataclasses.replace(self, form="module")

    @property
    def world_size(self) -> int:
        return ENGINES[self.engine].world_size

    def skip_reason(self) -> str | None:
        if self.model == "llama" and not HAS_TRANSFORMERS:
            return NEEDS_TRANSFORMERS
        if "fsdp" in ENGINES[self.engine].kind and not HAS_FSDP2:
            return NEEDS_FSDP2
        return None


# The other torch releases of the matrix (scripts/test-matrix.sh sets
# REMAT_DISTRIBUTED_ROWS=per-release) run every form under FSDP2 and, under each
# other engine, one form per front end kind (a selective function form, the
# composable hooks, a named config), instead of the whole cross product: every
# engine and every form still runs on every release, and the main release runs
# it all (it is most of the matrix's time).
_ACROSS_ENGINES = {"llama": ("hf-matmuls", "module", "config-names"), "gpt": ("function-matmuls", "module", "wrapper-names")}


def _forms(model: str, engine: str) -> tuple[str, ...]:
    every = tuple(FORMS[model])
    if engine == "fsdp" or os.environ.get("REMAT_DISTRIBUTED_ROWS", "all") != "per-release":
        return ("none", *every)
    return ("none", *_ACROSS_ENGINES[model])


def _rows() -> list[Row]:
    rows = []
    # 2 ranks: the Llama under every engine in every form; the GPT under each engine kind.
    for engine in ("ddp", "fsdp", "fsdp-noreshard", "fsdp-bf16", "fsdp-bf16-noreshard", "tp"):
        rows += [Row("llama", engine, form) for form in _forms("llama", engine)]
    for engine in ("ddp", "fsdp", "fsdp-bf16-noreshard", "tp"):
        rows += [Row("gpt", engine, form) for form in _forms("gpt", engine)]
    # torchtitan's order with the compiler in it: checkpoint, compile, shard.
    for model, engine, form in (
        ("llama", "fsdp", "module"),
        ("llama", "fsdp", "hf-matmuls"),
        ("gpt", "fsdp-bf16-noreshard", "wrapper-names"),
        ("gpt", "fsdp-bf16-noreshard", "module"),
        ("gpt", "tp", "module"),
    ):
        row = Row(model, engine, form, compiled=True)
        rows += [row.oracle, row] + ([row.twin] if row.twin is not None else [])
    # 4 ranks: FSDP2 alone, and FSDP2 + TP on a 2x2 mesh (every form on the Llama).
    rows += [Row("llama", "fsdp-4ranks", form) for form in ("none", "module", "hf-matmuls", "wrapper")]
    rows += [Row("llama", "fsdp-tp-4ranks", form) for form in ("none", *LLAMA_FORMS)]
    rows += [Row("llama", "fsdp-bf16-tp-4ranks", form) for form in ("none", "module", "hf-names")]
    rows += [Row("gpt", "fsdp-tp-4ranks", form) for form in ("none", "function-names", "module")]
    return list(dict.fromkeys(rows))


ROWS = _rows()
CHECKED = [row for row in ROWS if row.form != "none" and not row.form.startswith("torch-")]
EXACT = [row for row in CHECKED if row.form not in COMPRESSED]


# ----------------------------------------------------------------- the models


def llama() -> nn.Module:
    import transformers

    config = tiny_llama_config(
        vocab_size=VOCAB, max_position_embeddings=2 * SEQ, use_cache=False, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def gpt() -> nn.Module:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=4, n_layers=3, d_ff=64)
    return GPT(config).train()


BUILD = {"llama": llama, "gpt": gpt}


def blocks(model: nn.Module) -> nn.ModuleList:
    """The model's stack of blocks (whatever wrappers a form put in it)."""
    found = model.model.layers if hasattr(model, "model") else model.blocks
    assert isinstance(found, nn.ModuleList)
    return found


def batch(row: Row, step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=generator)
    if row.model == "llama":
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1]}
    return {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}


def loss_of(row: Row, model: nn.Module, data: dict[str, torch.Tensor], fn: Any) -> torch.Tensor:
    if row.model == "llama":
        loss: torch.Tensor = model(**data).loss
        return loss
    logits = model(data["idx"]) if fn is None else model(data["idx"], checkpoint_fn=fn)
    return lm_loss(logits, data["targets"])


# ------------------------------------------------------------------ the forms


def tag_attention(model: nn.Module) -> None:
    """Name each Llama attention output ``"attn_out"``, as a user of name policies would."""

    def tag(module: nn.Module, args: Any, output: Any) -> Any:
        return (remat.name(output[0], "attn_out"), *output[1:])

    for block in blocks(model):
        block.self_attn.register_forward_hook(tag)


def _checkpoint_fn(**options: Any) -> Callable[..., torch.Tensor]:
    def run(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = remat.checkpoint(block, h, **options)
        return out

    return run


def apply_form(row: Row, model: nn.Module, plan: list[tuple[str, Any]]) -> Any:
    """Put the row's form on ``model`` in place; returns the GPT's ``checkpoint_fn`` (or None)."""
    form = row.form
    block_type = type(blocks(model)[0])
    wrap = functools.partial(apply_activation_checkpointing, model, check_fn=lambda m: isinstance(m, block_type))
    if form == "none":
        return None
    if form == "hf":
        enable_gradient_checkpointing(model)
    elif form == "hf-matmuls":
        enable_gradient_checkpointing(model, policy=policies.save_matmuls)
    elif form == "hf-names":
        tag_attention(model)
        enable_gradient_checkpointing(model, policy=policies.save_only_names("attn_out"))
    elif form == "torch-wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper as torch_checkpoint_wrapper,
        )

        stack = blocks(model)
        for index, block in enumerate(stack):
            stack[index] = torch_checkpoint_wrapper(block)
    elif form == "hf-offload":
        enable_gradient_checkpointing(model, offload=True)
    elif form == "function":
        return _checkpoint_fn()
    elif form == "function-matmuls":
        return _checkpoint_fn(policy=policies.save_matmuls)
    elif form == "function-names":
        return _checkpoint_fn(policy=policies.save_only_names("attn_out"))
    elif form == "function-offload-names":
        return _checkpoint_fn(policy=policies.offload_names("attn_out"))
    elif form == "wrapper":
        wrap()
    elif form == "wrapper-matmuls":
        wrap(checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, policy=policies.save_matmuls))
    elif form == "wrapper-names":
        policy = policies.save_only_names("attn_out")
        wrap(checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, policy=policy))
    elif form == "module":
        for block in blocks(model):
            checkpoint_module(block)
    elif form == "module-matmuls":
        for block in blocks(model):
            checkpoint_module(block, policy=policies.save_matmuls)
    elif form == "config-every2":
        assert remat.apply_config(model, {"mode": "full", "every": 2}).blocks == ("model.layers.1",)
    elif form == "config-names":
        remat.apply_config(model, {"mode": "selective", "save_modules": ["self_attn"]})
    elif form == "config-selective":
        remat.apply_config(model, {"mode": "selective", "save_ops": ["aten.mm", "aten.addmm"]})
    elif form == "config-offload":
        remat.apply_config(model, {"mode": "full", "offload": True})
    elif form == "offload":
        remat.apply_config(model, {"mode": "none", "offload": True})
    elif form == "config-compress":
        remat.apply_config(model, {"mode": "none", "compress": COMPRESSED[form]})
    elif form == "module-compress":
        for block in blocks(model):
            checkpoint_module(
                block,
                policy=policies.compressed(policies.save_matmuls, COMPRESSED[form]),
                compress_inputs=COMPRESSED[form],
            )
    elif form == "function-compress-inputs":
        return _checkpoint_fn(compress_inputs=COMPRESSED[form])
    elif form == "plan":
        from remat.planner.apply import install

        for region, option in plan:
            install(model.get_submodule(region), option)
    else:
        raise AssertionError(f"unknown form {form}")
    return None


def make_plan(model_name: str) -> list[tuple[str, Any]]:
    """Plan the unsharded model on rank 0 and give every rank its decisions.

    Planning measures time, so ranks could decide differently: one decides.
    """
    decisions: list[Any] = [None]
    if dist.get_rank() == 0:
        from remat.planner import plan

        model = BUILD[model_name]()
        data = batch(Row(model_name, "ddp", "plan"), 0, 0)
        example = (data["input_ids"],) if model_name == "llama" else (data["idx"],)
        chosen = plan(model, example, budget="85%", repeats=1)
        decisions = [[(d.region, d.option) for d in chosen.decisions if d.option.kind != "keep"]]
    dist.broadcast_object_list(decisions, src=0)
    return list(decisions[0])


# ---------------------------------------------------------------- the engines


def _mesh(engine: Engine) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if engine.kind == "fsdp+tp":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (engine.world_size,))


TP_PLANS = {
    # Attention and MLP, as torchtitan splits a Llama: colwise in, rowwise out.
    "llama": {
        "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
        "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise",
    },
    # The GPT's attention splits its fused qkv output by the full width, so only its MLP.
    "gpt": {"mlp.0": "colwise", "mlp.2": "rowwise"},
}


def tensor_parallel(row: Row, model: nn.Module, mesh: Any) -> None:
    """Parallelize each projection in place, found by name (wrappers add path segments)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = TP_PLANS[row.model]
    for name, module in list(model.named_modules()):
        style = next((s for suffix, s in plan.items() if name.endswith("." + suffix)), None)
        if style is not None:
            parallelize_module(module, mesh, styles[style]())


def shard(row: Row, model: nn.Module) -> tuple[nn.Module, int]:
    """Distribute ``model`` as the row's engine does; (the module to call, data-parallel rank)."""
    engine = ENGINES[row.engine]
    rank = dist.get_rank()
    if engine.kind == "ddp":
        return nn.parallel.DistributedDataParallel(model), rank
    mesh = _mesh(engine)
    if engine.kind == "tp":
        tensor_parallel(row, model, mesh)
        return model, 0
    fsdp_mesh = mesh
    if engine.kind == "fsdp+tp":
        tensor_parallel(row, model, mesh["tp"])
        fsdp_mesh = mesh["dp"]
        rank = mesh.get_coordinate()[0]
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = {"mesh": fsdp_mesh, "reshard_after_forward": engine.reshard}
    if engine.bf16:
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model, rank


# -------------------------------------------------------------- rank worker


ATTENTION = "scaled_dot_product"
MATMULS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.")
# RMSNorm's rsqrt (Llama), LayerNorm (GPT): cheap ops that every checkpointed
# form reruns, also in compiled graphs (where the oracle's own backward may
# rerun an activation function).
NORMS = ("aten.rsqrt.", "aten.native_layer_norm.")


def op_group(op: str) -> str | None:
    """The group of an aten op's name that recomputation is counted by (None: not counted)."""
    if ATTENTION in op and "backward" not in op:
        return "attention"
    if op.startswith(MATMULS):
        return "matmul"
    if op.startswith(NORMS):
        return "norm"
    return None


# A dispatch mode sees the higher-order operators of a compiled backward from
# torch 2.11 on (checked: absent on 2.4.1 and 2.7.1); before, one in the mode's
# way is an error, so compiled rows are not counted there.
COUNTS_COMPILED = hasattr(TorchDispatchMode, "supports_higher_order_operators")
NEEDS_HOP_MODES = "dispatch modes see a compiled backward's higher-order ops from torch 2.11"


class BackwardOps(OpCounter):
    """Counts ops as ``OpCounter`` does, and the ops that higher-order operators run.

    A compiled backward reruns attention as ``run_with_rng_state(state, op, *args)``.
    """

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not isinstance(func, torch._ops.OpOverload):
            self.counts.update(str(arg) for arg in args if isinstance(arg, torch._ops.OpOverload))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a plain tensor as it is)."""
    local = getattr(tensor, "to_local", None)
    return (local() if local is not None else tensor).detach().clone()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (a collective)."""
    gather = getattr(tensor, "full_tensor", None)
    return (gather() if gather is not None else tensor).detach().clone()


def train(row: Row, plan: list[tuple[str, Any]]) -> dict[str, Any]:
    """Build, checkpoint, (compile,) shard, two AdamW steps: the row's record."""
    model = BUILD[row.model]()
    checkpoint_fn = apply_form(row, model, plan)
    if row.compiled:
        # Each row compiles afresh, as its own training job would: with static
        # shapes, and without the guards and recompilations of earlier rows
        # (torch 2.7.1 turns a second compile of the same code dynamic, and its
        # DTensor then fails on the symbolic sizes, without any checkpointing).
        # fullgraph, as torchtitan compiles its blocks: no silent fallback to eager.
        torch._dynamo.reset()
        stack = blocks(model)
        for index, block in enumerate(stack):
            stack[index] = torch.compile(
                block, backend=COMPILE_BACKEND, dynamic=False, fullgraph=True
            )
    module, dp_rank = shard(row, model)
    params = {n: p for n, p in model.state_dict(keep_vars=True).items() if isinstance(p, nn.Parameter)}
    optimizer = torch.optim.AdamW(params.values(), lr=1e-2)
    tensors: dict[str, torch.Tensor] = {}
    # Gathered whole where a test needs more than each rank's part: an oracle's
    # final weights (equal on every rank), a compressing row's first gradients
    # (their error over the whole model).
    gathered: dict[str, torch.Tensor] = {}
    backward_ops: collections.Counter[str] = collections.Counter()
    counted = COUNTS_COMPILED or not row.compiled
    for step in range(STEPS):
        loss = loss_of(row, module, batch(row, step, dp_rank), checkpoint_fn)
        with BackwardOps() if counted else contextlib.nullcontext() as counter:
            loss.backward()  # on CPU, backward runs on this thread: the mode sees it
        if counter is not None:
            backward_ops.update(counter.counts)
        tensors[f"step{step}.loss"] = loss.detach().clone()
        for name, param in params.items():
            assert param.grad is not None, f"step {step}: no gradient for {name}"
            tensors[f"step{step}.grad.{name}"] = _local(param.grad)
            if step == 0 and (row.form == "none" or row.form in COMPRESSED):
                gathered[f"step0.grad.{name}"] = _full(param.grad)
        optimizer.step()
        optimizer.zero_grad()
    for name, param in params.items():
        tensors[f"final.{name}"] = _local(param)
        if row.form == "none":
            gathered[f"final.{name}"] = _full(param)
    groups = dict.fromkeys(GROUPS, 0)
    for op, count in backward_ops.items():
        group = op_group(op)
        if group is not None:
            groups[group] += count
    # Whether attention ran as one fused op (its backward is one): the math
    # fallback (e.g. torch 2.7's CPU sdpa with grouped-query attention) runs
    # bmm and softmax instead, counted as matmuls and not as attention.
    groups["fused_attention"] = sum(
        count for op, count in backward_ops.items() if ATTENTION in op and "backward" in op
    )
    chosen = [(region, option.kind, option.policy or "") for region, option in plan]
    return {"tensors": tensors, "gathered": gathered, "backward_ops": groups if counted else None, "plan": chosen}


def rank_records(payload: None) -> dict[str, Any]:
    """Every row of this world size on this rank (the launcher runs this on each rank)."""
    results: dict[str, Any] = {}
    world_size = dist.get_world_size()
    rows = [row for row in ROWS if row.world_size == world_size and row.skip_reason() is None]
    plans = {m: make_plan(m) for m in sorted({r.model for r in rows if r.form == "plan"})}
    for row in rows:
        start = time.perf_counter()
        try:
            results[row.name] = train(row, plans.get(row.model, []))
        except Exception as exc:
            results[row.name] = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
            results[row.name + "#traceback"] = traceback.format_exc()
        results[row.name + "#seconds"] = time.perf_counter() - start
        dist.barrier()
    return results


# -------------------------------------------------------------------- launch

_LAUNCHED: dict[int, list[dict[str, Any]] | str] = {}


def ranks(world_size: int) -> list[dict[str, Any]]:
    """Every rank's records for ``world_size`` (one launch per world size per session).

    A failed launch is remembered too: every row of that world size fails at
    once with its message, instead of launching (and timing out) again.
    """
    return launch_once(_LAUNCHED, world_size, rank_records, timeout_s=LAUNCH_TIMEOUT_S)


@pytest.fixture
def records() -> Callable[[Row], list[dict[str, Any]]]:
    """The records of a row on every rank; skips rows this torch cannot run."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")

    def get(row: Row) -> list[dict[str, Any]]:
        reason = row.skip_reason()
        if reason is not None:
            pytest.skip(f"{row.name}: {reason}")
        per_rank = [results[row.name] for results in ranks(row.world_size)]
        error = per_rank[0] if isinstance(per_rank[0], str) else ""
        if row.compiled and "UnsupportedCheckpointError" in error:
            # Documented (docs/design/compile.md): Dynamo carries a remat.policies
            # object into a compiled region from torch 2.9 on; before, remat
            # raises UnsupportedCheckpointError, which Dynamo reports.
            assert not dynamo_traces_policy_objects(), error
            pytest.skip(f"{row.name}: {NEEDS_POLICY_OBJECTS}; remat raised UnsupportedCheckpointError")
        twin = row.twin
        if error and twin is not None:
            theirs = ranks(row.world_size)[0][twin.name]
            if isinstance(theirs, str) and theirs[:80] == error[:80]:
                pytest.skip(
                    f"{row.name}: torch's own checkpointing ({twin.form}) fails the same way on "
                    f"this torch: {theirs[:160]}"
                )
        for rank, record in enumerate(per_rank):
            assert isinstance(record, dict), (
                f"{row.name} failed on rank {rank}: {record}\n"
                f"{ranks(row.world_size)[rank][row.name + '#traceback']}"
            )
        return per_rank

    return get


# --------------------------------------------------------------------- tests


def _different(records: list[dict[str, Any]], key: str) -> bool:
    values = [record["tensors"][key] for record in records]
    return not all(torch.equal(values[0], value) for value in values[1:])


@pytest.mark.parametrize("oracle", sorted({row.oracle for row in ROWS}, key=lambda r: r.name), ids=lambda r: r.name)
def test_oracle_is_distributed(records: Callable[[Row], list[dict[str, Any]]], oracle: Row) -> None:
    # Data-parallel ranks see different data (losses differ) and end with the same weights.
    per_rank = records(oracle)
    if ENGINES[oracle.engine].data_parallel > 1:
        assert _different(per_rank, "step0.loss")
    finals = [{k: v for k, v in r["gathered"].items() if k.startswith("final.")} for r in per_rank]
    for final in finals[1:]:
        for key, value in finals[0].items():
            assert torch.equal(final[key], value), key


def _difference(actual: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """None if the records are bitwise equal, else the first difference."""
    assert actual["tensors"].keys() == expected["tensors"].keys()
    for key, value in expected["tensors"].items():
        if not torch.equal(actual["tensors"][key], value):
            return f"{key}: max diff {(actual['tensors'][key].float() - value.float()).abs().max()}"
    return None


@pytest.mark.parametrize("row", EXACT, ids=lambda r: r.name)
def test_gradients_and_weights_equal_unchecked(
    records: Callable[[Row], list[dict[str, Any]]], row: Row
) -> None:
    for actual, expected in zip(records(row), records(row.oracle), strict=True):
        difference = _difference(actual, expected)
        assert difference is None, difference


@pytest.mark.parametrize("row", [r for r in CHECKED if r.form in COMPRESSED], ids=lambda r: r.name)
def test_compressed_rows_stay_within_tolerance(
    records: Callable[[Row], list[dict[str, Any]]], row: Row
) -> None:
    """The first step's loss is the oracle's, bitwise (the forward is unchanged); its
    gradients, all together, are within the format's tolerance and not exact."""
    for actual, expected in zip(records(row), records(row.oracle), strict=True):
        assert torch.equal(actual["tensors"]["step0.loss"], expected["tensors"]["step0.loss"])
        keys = sorted(k for k in expected["gathered"] if k.startswith("step0.grad."))
        got = torch.cat([actual["gathered"][k].double().flatten() for k in keys])
        want = torch.cat([expected["gathered"][k].double().flatten() for k in keys])
        error = float((got - want).norm() / want.norm())
        assert 0 < error <= TOLERANCE[COMPRESSED[row.form]], f"{row.name}: relative error {error:.3g}"


def _plan_expectation(chosen: list[tuple[str, str, str]]) -> dict[str, str]:
    """What a plan's decisions recompute (its blocks are the model's: fewer than all)."""
    assert chosen, "the plan checkpoints nothing: raise the pressure in make_plan"
    checkpointed = [(kind, policy) for _, kind, policy in chosen if kind == "checkpoint"]
    if not checkpointed:
        return NOTHING
    full = ("checkpoint", "") in checkpointed
    return {"matmul": "some" if full else "zero", "attention": "some" if full else "zero",
            "norm": "some"}


def expectation(row: Row, plan: list[tuple[str, str, str]]) -> dict[str, str]:
    """What ``row`` recomputes, by op group (see LLAMA_FORMS), where the engine changes it."""
    expected = FORMS[row.model][row.form] or _plan_expectation(plan)
    if row.form.endswith("names") and row.compiled:
        # Under torch.compile a name's decision lands on the named value (traced
        # as a clone), not on its producer: the value is kept and the attention
        # that produced it reruns (docs/design/compile.md, "Names").
        expected = {**expected, "attention": "some"}
    if row.form.endswith("names") and row.model == "llama" and "tp" in ENGINES[row.engine].kind:
        # Under tensor parallel the attention module's output is the local result
        # of the rowwise o_proj, made inside DTensor's dispatch and its all-reduce,
        # where the recorder does not see a producer: the named value itself is
        # kept, and the matmul and the all-reduce rerun (docs/design/names.md).
        expected = {**expected, "matmul": "some"}
    return expected


@pytest.mark.parametrize("row", CHECKED, ids=lambda r: r.name)
def test_recomputation_counted(records: Callable[[Row], list[dict[str, Any]]], row: Row) -> None:
    def extra(of: Row) -> dict[str, int]:
        ops, base = records(of)[0]["backward_ops"], records(row.oracle)[0]["backward_ops"]
        return {group: ops[group] - base[group] for group in GROUPS}

    record = records(row)[0]
    if row.compiled and not COUNTS_COMPILED:
        pytest.skip(f"{row.name}: {NEEDS_HOP_MODES}")
    expected = expectation(row, record["plan"])
    if not records(row.oracle)[0]["backward_ops"]["fused_attention"]:
        # Attention ran as bmm and softmax: its reruns are counted as matmuls.
        expected = {group: relation for group, relation in expected.items() if group != "attention"}
    got = extra(row)
    full = extra(row.full) if "fewer" in expected.values() else {}
    for group, relation in expected.items():
        if relation == "zero":
            assert got[group] == 0, f"{row.name}: {group} recomputed: {got}"
        else:
            assert got[group] > 0, f"{row.name}: {group} not recomputed: {got}"
        if relation == "fewer":
            assert got[group] < full[group], f"{row.name}: {got}, fully checkpointed {full}"
