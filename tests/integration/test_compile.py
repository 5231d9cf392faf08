"""remat under torch.compile: same results as eager, and the compiled backward really recomputes.

Oracles: the eager (uncompiled) run of the same code, and torch.utils.checkpoint
under the same compile. Counters: a backend that runs AOTAutograd with the
min-cut partitioner and records the ops of the forward and backward graphs,
so "mm is recomputed" is a count of ``aten.mm`` in the backward graph.

Run alone with ``pytest -m compile``.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tuc
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import remat
from helpers import TORCH_HAS_SAC, needs_torch_sac
from remat import policies
from remat._compat.versions import dynamo_traces_policy_objects
from remat.compile import CompilerPolicy, compiler_contexts
from remat.composable import checkpoint_module
from remat.errors import (
    CheckpointTypeError,
    CheckpointUsageError,
    PolicyError,
    UnsupportedCheckpointError,
)
from remat.names import name
from remat.nn import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper

pytestmark = pytest.mark.compile

needs_policy_objects = pytest.mark.skipif(
    not dynamo_traces_policy_objects(),
    reason=f"torch {torch.__version__}: remat.policies objects under torch.compile need torch >= 2.9",
)

MM = torch.ops.aten.mm.default
SIGMOID = torch.ops.aten.sigmoid.default


@pytest.fixture(autouse=True)
def _fresh_compiler() -> Iterator[None]:
    torch.compiler.reset()
    yield
    torch.compiler.reset()


class GraphCounter:
    """A torch.compile backend recording the ops of each compiled forward and backward graph."""

    def __init__(self) -> None:
        self.forward: list[collections.Counter[Any]] = []
        self.backward: list[collections.Counter[Any]] = []

        def record(into: list[collections.Counter[Any]]) -> Callable[..., Any]:
            def compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
                into.append(
                    collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")
                )
                return make_boxed_func(gm.forward)

            return compiler

        self.backend = aot_autograd(
            fw_compiler=record(self.forward),
            bw_compiler=record(self.backward),
            partition_fn=min_cut_rematerialization_partition,
        )

    def count(self, op: Any, *, graph: str = "backward") -> int:
        graphs = self.backward if graph == "backward" else self.forward
        assert len(graphs) == 1, f"expected one {graph} graph, got {len(graphs)}"
        return graphs[0][op]


def leaves(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator, requires_grad=True) for shape in shapes]


def run(
    fn: Callable[..., Any], inputs: list[torch.Tensor], params: Sequence[torch.Tensor] = ()
) -> Any:
    """fn's output and the gradients of its inputs and of ``params``."""
    for tensor in [*inputs, *params]:
        tensor.grad = None
    out = fn(*inputs)
    torch.autograd.backward([t.sum() for t in (out if isinstance(out, (tuple, list)) else [out])])
    return out, [t.grad.clone() if t.grad is not None else None for t in [*inputs, *params]]


def assert_close(actual: Any, expected: Any) -> None:
    out, grads = actual
    out_ref, grads_ref = expected
    torch.testing.assert_close(out, out_ref)
    assert len(grads) == len(grads_ref)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want)


def sigmoid_mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x @ y)


def compiled(fn: Callable[..., Any], backend: Any) -> Callable[..., Any]:
    return torch.compile(fn, backend=backend, fullgraph=True)


# --- same results as eager ---------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_plain_region_matches_eager(backend: str) -> None:
    x, y = leaves((4, 4), (4, 4))

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(sigmoid_mm, a, b).cos()

    assert_close(run(compiled(fn, backend), [x, y]), run(fn, [x, y]))


def test_two_regions_kwargs_and_list_inputs_match_eager() -> None:
    x, y, z = leaves((4, 4), (4, 4), (4,))

    def pair(ts: list[torch.Tensor], *, bias: torch.Tensor) -> torch.Tensor:
        return (ts[0] @ ts[1]).relu() + bias

    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint(pair, [a, b], bias=c)
        return remat.checkpoint(sigmoid_mm, h, b)

    counter = GraphCounter()
    assert_close(run(compiled(fn, counter.backend), [x, y, z]), run(fn, [x, y, z]))
    # Both forward matmuls are recomputed in backward, next to the 4 gradient matmuls.
    assert counter.count(MM, graph="forward") == 2
    assert counter.count(MM) == 2 + 4


def test_module_region_parameter_grads_match_eager() -> None:
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    (x,) = leaves((3, 8))
    params = list(block.parameters())

    def fn(a: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(block, a)

    assert_close(run(compiled(fn, "aot_eager"), [x], params), run(block, [x], params))


@needs_policy_objects
@needs_torch_sac
def test_checkpointed_sequential_and_nested_compile_fullgraph() -> None:
    torch.manual_seed(0)
    chain = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(4)])
    (x,) = leaves((2, 6))
    params = list(chain.parameters())

    @remat.checkpointed(policy=policies.save_matmuls)
    def head(t: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(lambda u: chain[0](u).tanh(), t) * 2

    def fn(a: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint_sequential(chain[1:], 2, head(a))

    def plain(a: torch.Tensor) -> torch.Tensor:
        return chain[1:](chain[0](a).tanh() * 2)

    assert_close(run(compiled(fn, "aot_eager"), [x], params), run(plain, [x], params))


def test_reentrant_compiles_like_torch_with_the_same_results() -> None:
    # torch compiles use_reentrant=True as the non-reentrant variant; remat too.
    x, y = leaves((4, 4), (4, 4))
    counter = GraphCounter()

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(sigmoid_mm, a, b, use_reentrant=True)

    assert_close(run(compiled(fn, counter.backend), [x, y]), run(fn, [x, y]))
    assert counter.count(MM) == 3


def test_reentrant_rules_still_apply_under_compile() -> None:
    (x,) = leaves((3,))

    def fn(a: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(lambda t, s=1.0: t.sin() * s, a, s=2.0, use_reentrant=True)

    # Without fullgraph, Dynamo hands the error to the eager rerun: remat's own type.
    with pytest.raises(CheckpointUsageError, match="no keyword arguments"):
        torch.compile(fn, backend="eager")(x)


# --- the compiled backward recomputes what the policy says ---------------------------------


def test_backward_graph_recomputes_the_matmul() -> None:
    x, y = leaves((4, 4), (4, 4))
    plain, checkpointed = GraphCounter(), GraphCounter()
    run(compiled(sigmoid_mm, plain.backend), [x, y])
    run(compiled(lambda a, b: remat.checkpoint(sigmoid_mm, a, b), checkpointed.backend), [x, y])
    assert plain.count(MM) == 2  # the two gradient matmuls
    assert checkpointed.count(MM) == 3  # ... and the recomputed forward one
    assert checkpointed.count(SIGMOID) == 1


def _decide(mm_decision: remat.CheckpointPolicy) -> Callable[..., Any]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> remat.CheckpointPolicy:
        return mm_decision if op is MM else remat.CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@needs_torch_sac
@pytest.mark.parametrize(
    ("policy", "backward_mms"),
    [
        (_decide(remat.CheckpointPolicy.MUST_SAVE), 2),
        (_decide(remat.CheckpointPolicy.PREFER_SAVE), 2),
        (_decide(remat.CheckpointPolicy.MUST_RECOMPUTE), 3),
        (_decide(remat.CheckpointPolicy.MUST_OFFLOAD), 2),  # offload -> save under compile
        (_decide(getattr(tuc, "CheckpointPolicy", remat.CheckpointPolicy).MUST_SAVE), 2),  # torch's
        (lambda ctx, op, *a, **k: op is MM, 2),  # True = save
        pytest.param(policies.save_matmuls, 2, marks=needs_policy_objects),
        pytest.param(policies.save_matmuls_without_batch_dims, 2, marks=needs_policy_objects),
        pytest.param(policies.save_nothing, 3, marks=needs_policy_objects),
        pytest.param(
            policies.first_of(policies.save_ops(MM), policies.save_nothing),
            2,
            marks=needs_policy_objects,
        ),
        pytest.param(
            policies.save_any_of(policies.save_nothing, policies.save_ops(MM)),
            2,
            marks=needs_policy_objects,
        ),
        ([MM], 2),
    ],
    ids=[
        "must_save",
        "prefer_save",
        "must_recompute",
        "offload",
        "torch_enum",
        "bool",
        "save_matmuls",
        "save_matmuls_no_batch",
        "save_nothing",
        "first_of",
        "save_any_of",
        "op_list",
    ],
)
def test_policy_decides_what_backward_recomputes(policy: Any, backward_mms: int) -> None:
    x, y = leaves((4, 4), (4, 4))
    counter = GraphCounter()

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(sigmoid_mm, a, b, policy=policy)

    assert_close(run(compiled(fn, counter.backend), [x, y]), run(sigmoid_mm, [x, y]))
    assert counter.count(MM) == backward_mms
    assert counter.count(SIGMOID) == 1  # recomputed under every policy above


@needs_policy_objects
@needs_torch_sac
def test_policy_built_inside_the_compiled_function() -> None:
    # The usual idiom: the policy is written in the forward, so Dynamo builds it.
    x, y = leaves((4, 4), (4, 4))
    counter = GraphCounter()

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        keep_mm = policies.first_of(policies.save_ops(MM), policies.save_only_names("unused"))
        return remat.checkpoint(sigmoid_mm, a, b, policy=policies.save_any_of(keep_mm))

    assert_close(run(compiled(fn, counter.backend), [x, y]), run(sigmoid_mm, [x, y]))
    assert counter.count(MM) == 2


@needs_torch_sac
@pytest.mark.parametrize(
    "make_contexts",
    [remat.create_selective_checkpoint_contexts, "torch"],
    ids=["remat", "torch"],
)
def test_selective_context_fn_is_honoured(make_contexts: Any) -> None:
    if make_contexts == "torch":
        make_contexts = tuc.create_selective_checkpoint_contexts
    x, y = leaves((4, 4), (4, 4))
    counter = GraphCounter()
    context_fn = functools.partial(make_contexts, [MM])

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(sigmoid_mm, a, b, context_fn=context_fn)

    assert_close(run(compiled(fn, counter.backend), [x, y]), run(sigmoid_mm, [x, y]))
    assert counter.count(MM) == 2


@needs_torch_sac
def test_same_graphs_as_torch_checkpoint() -> None:
    x, y = leaves((4, 4), (4, 4))
    ours, theirs = GraphCounter(), GraphCounter()
    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, [MM])
    run(
        compiled(lambda a, b: remat.checkpoint(sigmoid_mm, a, b, policy=[MM]), ours.backend), [x, y]
    )
    torch.compiler.reset()
    run(
        compiled(
            lambda a, b: tuc.checkpoint(
                sigmoid_mm, a, b, use_reentrant=False, context_fn=context_fn
            ),
            theirs.backend,
        ),
        [x, y],
    )
    assert ours.forward == theirs.forward
    assert ours.backward == theirs.backward


@needs_torch_sac
def test_compiler_policy_maps_every_decision() -> None:
    expected = {
        remat.CheckpointPolicy.MUST_SAVE: tuc.CheckpointPolicy.MUST_SAVE,
        remat.CheckpointPolicy.PREFER_SAVE: tuc.CheckpointPolicy.PREFER_SAVE,
        remat.CheckpointPolicy.MUST_RECOMPUTE: tuc.CheckpointPolicy.MUST_RECOMPUTE,
        remat.CheckpointPolicy.PREFER_RECOMPUTE: tuc.CheckpointPolicy.PREFER_RECOMPUTE,
        remat.CheckpointPolicy.MUST_OFFLOAD: tuc.CheckpointPolicy.MUST_SAVE,
        remat.CheckpointPolicy.PREFER_OFFLOAD: tuc.CheckpointPolicy.PREFER_SAVE,
    }
    for decision, torch_decision in expected.items():
        assert CompilerPolicy(lambda *a, d=decision, **k: d)(None, MM) is torch_decision
    # A wrong answer is kept (the op saved) and raised as the forward mode exits, not inside
    # torch's mode (remat._compat.dispatch.checked_on_exit says why).
    wrong = CompilerPolicy(lambda *a, **k: "save")
    assert wrong(None, MM) is tuc.CheckpointPolicy.MUST_SAVE
    with pytest.raises(PolicyError, match="returned 'save'"):
        wrong.raise_refusal()
    wrong.raise_refusal()  # raised once


# --- names -------------------------------------------------------------------------------


def named_region(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(name(x @ y, "scores")).cos() @ y


@needs_policy_objects
@needs_torch_sac
@pytest.mark.parametrize(
    ("policy", "backward_mms"),
    [
        (policies.save_nothing, 1 + 4),
        (policies.save_only_names("scores"), 0 + 4),
        (policies.save_all_but_names("scores"), 1 + 4),
        (policies.offload_names("scores"), 0 + 4),
        (policies.first_of(policies.save_ops(MM), policies.save_all_but_names("scores")), 0 + 4),
    ],
    ids=["save_nothing", "save_only_names", "save_all_but_names", "offload_names", "first_of"],
)
def test_name_policies_change_the_compiled_backward(policy: Any, backward_mms: int) -> None:
    x, y = leaves((4, 4), (4, 4))
    counter = GraphCounter()

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(named_region, a, b, policy=policy)

    assert_close(run(compiled(fn, counter.backend), [x, y]), run(named_region, [x, y]))
    # The 4 gradient matmuls, plus x @ y when "scores" is recomputed (the last
    # matmul's output is not needed by backward).
    assert counter.count(MM) == backward_mms


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_name_keeps_gradients_when_compiled_without_checkpoint(backend: str) -> None:
    # The op's functional form while compiling must still pass the gradient on.
    x, y = leaves((4, 4), (4, 4))
    assert_close(run(compiled(named_region, backend), [x, y]), run(named_region, [x, y]))


# --- randomness --------------------------------------------------------------------------


def dropout_region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout((x @ w).tanh(), p=0.5, training=True).sin()


def seeded(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        torch.manual_seed(1234)
        return fn(*args)

    return call


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dropout_gradients_equal_eager(backend: str) -> None:
    x, w = leaves((8, 16), (16, 16))

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(dropout_region, a, b)

    assert_close(run(seeded(compiled(fn, backend)), [x, w]), run(seeded(dropout_region), [x, w]))


def test_graph_break_inside_a_region_still_gives_eager_results() -> None:
    x, w = leaves((8, 16), (16, 16))

    def body(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = (a @ b).tanh()
        torch._dynamo.graph_break()
        return torch.nn.functional.dropout(h, p=0.5, training=True).sin()

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(body, a, b) * 2

    compiled_fn = torch.compile(fn, backend="aot_eager")  # not fullgraph: it breaks
    assert_close(run(seeded(compiled_fn), [x, w]), run(seeded(lambda a, b: body(a, b) * 2), [x, w]))


# --- module front-ends under fullgraph ----------------------------------------------------


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.GELU(),
        torch.nn.Linear(8, 8),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 2),
    )


# Under compile a policy needs torch >= 2.5, and remat.policies objects 2.9.
_POLICY_THIS_TORCH_COMPILES: dict[str, Any] = (
    {"policy": policies.save_matmuls}
    if dynamo_traces_policy_objects()
    else {"policy": [MM, torch.ops.aten.addmm.default]}
    if TORCH_HAS_SAC
    else {}
)


def _wrapped() -> torch.nn.Module:
    model = _mlp()
    model[0] = checkpoint_wrapper(model[0])
    model[2] = checkpoint_wrapper(model[2], **_POLICY_THIS_TORCH_COMPILES)
    return model


def _reentrant_wrapped() -> torch.nn.Module:
    model = _mlp()
    model[0] = checkpoint_wrapper(model[0], checkpoint_impl=CheckpointImpl.REENTRANT)
    return model


def _applied() -> torch.nn.Module:
    model = _mlp()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, torch.nn.Linear))
    return model


def _composable() -> torch.nn.Module:
    model = _mlp()
    checkpoint_module(model[0])
    checkpoint_module(model[2], **_POLICY_THIS_TORCH_COMPILES)
    return model


@pytest.mark.parametrize(
    "build",
    [_wrapped, _reentrant_wrapped, _applied, _composable],
    ids=[
        "checkpoint_wrapper",
        "reentrant_wrapper",
        "apply_activation_checkpointing",
        "checkpoint_module",
    ],
)
def test_module_front_ends_compile_fullgraph(build: Callable[[], torch.nn.Module]) -> None:
    (x,) = leaves((3, 8))
    reference = _mlp()
    model = build()
    counter = GraphCounter()
    expected = run(reference, [x], list(reference.parameters()))
    assert_close(run(compiled(model, counter.backend), [x], list(model.parameters())), expected)
    # The first Linear's addmm is recomputed in every variant: the backward has
    # more addmm than the uncheckpointed model's (none: its grads are mm).
    assert counter.count(torch.ops.aten.addmm.default) >= 1


# --- errors ------------------------------------------------------------------------------


class _NotAMode:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _plain_contexts() -> tuple[_NotAMode, _NotAMode]:
    return _NotAMode(), _NotAMode()


@needs_torch_sac
def test_context_fn_without_dispatch_modes_is_a_clear_error() -> None:
    (x,) = leaves((3,))

    def fn(a: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(torch.sin, a, context_fn=_plain_contexts)

    with pytest.raises(CheckpointTypeError, match="two TorchDispatchModes"):
        compiled(fn, "eager")(x)
    torch.compiler.reset()
    # A tracing backend wraps it in torch's BackendCompilerFailed; remat's error is inside.
    with pytest.raises(Exception, match="CheckpointTypeError") as info:
        compiled(fn, "aot_eager")(x)
    assert isinstance(getattr(info.value, "inner_exception", None), CheckpointTypeError)


@pytest.mark.skipif(TORCH_HAS_SAC, reason="the limit of torch < 2.5 only")
def test_policy_under_compile_before_torch_2_5_says_what_is_needed() -> None:
    (x, y) = leaves((4, 4), (4, 4))

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(sigmoid_mm, a, b, policy=policies.save_matmuls)

    # fullgraph=True: Dynamo stops at remat's error and shows its line.
    with pytest.raises(Exception, match=r"UnsupportedCheckpointError.*needs torch >= 2.5"):
        compiled(fn, "aot_eager")(x, y)
    torch.compiler.reset()
    # Without fullgraph, Dynamo runs the failing frame eagerly: remat's own error.
    with pytest.raises(UnsupportedCheckpointError, match=r"needs torch >= 2.5.*run this region"):
        torch.compile(fn, backend="aot_eager")(x, y)
    torch.compiler.reset()
    # Plain regions compile on every torch.
    assert_close(
        run(compiled(lambda a, b: remat.checkpoint(sigmoid_mm, a, b), "aot_eager"), [x, y]),
        run(sigmoid_mm, [x, y]),
    )


@pytest.mark.skipif(
    not TORCH_HAS_SAC or dynamo_traces_policy_objects(), reason="the limit of torch 2.5-2.8 only"
)
def test_policy_object_under_compile_before_torch_2_9_says_what_to_pass() -> None:
    (x, y) = leaves((4, 4), (4, 4))

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(sigmoid_mm, a, b, policy=policies.save_matmuls)

    # fullgraph=True: Dynamo stops at remat's error; how it shows it varies by release.
    with pytest.raises(Exception, match=r"UnsupportedCheckpointError"):
        compiled(fn, "aot_eager")(x, y)
    torch.compiler.reset()
    # Without fullgraph the region falls back to eager Python: depending on the
    # release, Dynamo lets remat's error through or the eager region just runs.
    try:
        lenient = run(torch.compile(fn, backend="aot_eager"), [x, y])
    except UnsupportedCheckpointError as error:
        assert "list of ops to save" in str(error)
    else:
        assert_close(lenient, run(sigmoid_mm, [x, y]))
    torch.compiler.reset()
    # What the message suggests does compile on this torch.
    counter = GraphCounter()

    def with_op_list(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(sigmoid_mm, a, b, policy=[MM])

    assert_close(run(compiled(with_op_list, counter.backend), [x, y]), run(sigmoid_mm, [x, y]))
    assert counter.count(MM) == 2


def test_compiler_contexts_rejects_a_bad_pair_directly() -> None:
    with pytest.raises(CheckpointTypeError, match="_NotAMode, _NotAMode"):
        compiler_contexts(_plain_contexts)
    with pytest.raises(CheckpointTypeError, match="returned \\(list\\)"):
        compiler_contexts(lambda: [1, 2])


# --- inductor: a few key cases (slow to compile on CPU) -------------------------------------


@needs_policy_objects
@needs_torch_sac
def test_inductor_plain_and_selective_match_eager() -> None:
    x, y = leaves((16, 16), (16, 16))

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint(sigmoid_mm, a, b)
        return remat.checkpoint(named_region, h, b, policy=policies.save_only_names("scores"))

    def plain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return named_region(sigmoid_mm(a, b), b)

    assert_close(run(compiled(fn, "inductor"), [x, y]), run(plain, [x, y]))


def test_inductor_dropout_backward_uses_the_forward_mask() -> None:
    # Inductor draws its own random numbers, so compare with the same compiled
    # function without checkpointing, and check the mask against the output.
    (x,) = leaves((64, 32))

    def region(a: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(a * 3.0, p=0.5, training=True)

    checkpointed = run(seeded(compiled(lambda a: remat.checkpoint(region, a), "inductor")), [x])
    out, (grad,) = checkpointed
    kept = out != 0
    assert 0 < int(kept.sum()) < kept.numel()
    # d out / d x = 3 * 2 on kept elements, 0 on dropped ones: the recompute saw the same mask.
    torch.testing.assert_close(grad, kept.to(grad.dtype) * 6.0)
