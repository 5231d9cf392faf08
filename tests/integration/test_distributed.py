"""Distributed: remat under DDP and FSDP2 ``fully_shard`` (CPU, gloo, 2 ranks).

Each case trains a small residual MLP for two optimizer steps on two ranks and
records, per step, every parameter's gradient after DDP's all-reduce (or
FSDP2's reduce-scatter, gathered back to full tensors) and the final weights.
The oracle is the same distributed run without checkpointing: non-reentrant
checkpointing must match it bitwise. Design notes: docs/design/distributed.md.

Process launch costs seconds on a small machine, so a single launch runs
every case: the module fixture runs ``rank_results`` on rank 0 and rank 1
with the library's launcher (``remat.launch.run_on_ranks``, through
``helpers.launch_on_ranks``), each rank returns its records, and the tests
below only compare. A hang (a rank stuck in a collective) hits the launch
timeout and fails instead of blocking CI.
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import launch_on_ranks

WORLD_SIZE = 2
STEPS = 2
DIM = 16
LAUNCH_TIMEOUT_S = 150

# One launch serves the whole module (the ``ranks`` fixture): one xdist worker runs it.
pytestmark = pytest.mark.xdist_group("distributed")

HAS_NN = importlib.util.find_spec("remat.nn") is not None
HAS_COMPOSABLE = importlib.util.find_spec("remat.composable") is not None
# fully_shard is public in torch.distributed.fsdp from torch 2.6 on; older
# releases only have it under a private path, which these tests do not chase.
HAS_FSDP2 = dist.is_available() and hasattr(
    importlib.import_module("torch.distributed.fsdp"), "fully_shard"
)

CheckpointFn = Callable[..., torch.Tensor]


# --------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm residual MLP block; ``checkpoint_fn(body, x)`` checkpoints its body.

    Checkpointing the body rather than the block's ``__call__`` keeps module
    hooks (FSDP2's all-gather) outside the region, as transformers does.
    """

    def __init__(self, checkpoint_fn: CheckpointFn | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.checkpoint_fn = checkpoint_fn

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_fn is None:
            return self.body(x)
        return self.checkpoint_fn(self.body, x)


class Net(nn.Module):
    """Embedding, three blocks, head; ``reuse_first`` runs block 0 twice per step."""

    def __init__(self, checkpoint_fn: CheckpointFn | None = None, reuse_first: bool = False):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block(checkpoint_fn) for _ in range(3))
        self.head = nn.Linear(DIM, 1)
        self.reuse_first = reuse_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.reuse_first:
            h = self.blocks[0](h)
        for block in self.blocks:
            h = block(h)
        return self.head(h).square().mean()


# ---------------------------------------------------- checkpointing variants


def _remat(**options: Any) -> CheckpointFn:
    import remat

    def run(body: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(body, x, **options)

    return run


def build(variant: str, *, reuse_first: bool = False) -> Net:
    """A fresh, identically initialized Net checkpointed the ``variant`` way."""
    torch.manual_seed(0)
    if variant == "none":
        return Net(reuse_first=reuse_first)
    if variant == "function":
        return Net(_remat(), reuse_first=reuse_first)
    if variant == "policy":
        import remat.policies

        return Net(_remat(policy=remat.policies.save_matmuls), reuse_first=reuse_first)
    if variant == "reentrant":
        return Net(_remat(use_reentrant=True), reuse_first=reuse_first)
    net = Net(reuse_first=reuse_first)
    if variant == "wrapper":
        from remat.nn import apply_activation_checkpointing, checkpoint_wrapper

        apply_activation_checkpointing(
            net,
            checkpoint_wrapper_fn=checkpoint_wrapper,
            check_fn=lambda module: isinstance(module, Block),
        )
        return net
    if variant == "composable":
        from remat.composable import checkpoint_module

        for block in net.blocks:
            checkpoint_module(block)
        return net
    raise AssertionError(f"unknown variant {variant}")


# -------------------------------------------------------------- rank worker


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 shard) gathered to the full tensor; plain tensors as they are."""
    gather = getattr(tensor, "full_tensor", None)
    return (gather() if gather is not None else tensor).detach().clone()


def _batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 6, DIM, generator=generator)


def named_parameters(net: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by state-dict name: a checkpoint wrapper adds no prefix there
    (docs/design/modules.md, "Wrapper names")."""
    state = net.state_dict(keep_vars=True)
    return {name: value for name, value in state.items() if isinstance(value, nn.Parameter)}


def train(net: Net, model: nn.Module) -> dict[str, torch.Tensor]:
    """Two SGD-with-momentum steps; per-step losses and gradients, final weights."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    record: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        loss = model(_batch(step))
        loss.backward()
        record[f"step{step}.loss"] = loss.detach().clone()
        for name, param in named_parameters(net).items():
            assert param.grad is not None, f"step {step}: no gradient for {name}"
            record[f"step{step}.grad.{name}"] = _full(param.grad)
        optimizer.step()
        optimizer.zero_grad()
    for name, param in named_parameters(net).items():
        record[f"final.{name}"] = _full(param)
    return record


def ddp_case(
    variant: str, *, reuse_first: bool = False, **ddp_options: Any
) -> Callable[[], dict[str, torch.Tensor]]:
    def run() -> dict[str, torch.Tensor]:
        net = build(variant, reuse_first=reuse_first)
        return train(net, nn.parallel.DistributedDataParallel(net, **ddp_options))

    return run


class Twice(nn.Module):
    """One layer applied twice (each time under a reentrant checkpoint), nothing else."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.layer = nn.Linear(DIM, DIM)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import remat

        for _ in range(2):
            if self.checkpointed:
                x = remat.checkpoint(self.layer, x, use_reentrant=True).tanh()
            else:
                x = self.layer(x).tanh()
        return x.square().mean()


def ddp_silent_case(checkpointed: bool) -> Callable[[], dict[str, torch.Tensor]]:
    """Reentrant reuse where the reused layer is the last thing backward reaches.

    With torch's reentrant checkpoint, DDP finishes its reduction at the end
    of the first nested backward (every parameter has reported once), so the
    second one adds a rank-local gradient that is never all-reduced: no
    error, wrong and unsynchronized. remat's reentrant regions run no nested
    backward over parameters.
    """

    def run() -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        net = Twice(checkpointed)
        model = nn.parallel.DistributedDataParallel(net)
        x = _batch(0).requires_grad_()
        model(x).backward()
        return {name: _full(p.grad) for name, p in net.named_parameters() if p.grad is not None}

    return run


def fsdp_case(variant: str) -> Callable[[], dict[str, torch.Tensor]]:
    def run() -> dict[str, torch.Tensor]:
        from torch.distributed.fsdp import fully_shard

        net = build(variant)
        for block in net.blocks:  # a CheckpointWrapper for "wrapper": FSDP outside
            fully_shard(block)
        fully_shard(net)
        return train(net, net)

    return run


def cases() -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    """Every case, in the order both ranks run them."""
    table = {
        "ddp/none": ddp_case("none"),
        "ddp/function": ddp_case("function"),
        "ddp/policy": ddp_case("policy"),
        "ddp/reentrant": ddp_case("reentrant"),
        "ddp/none/reuse": ddp_case("none", reuse_first=True),
        "ddp/function/reuse": ddp_case("function", reuse_first=True),
        "ddp/twice/none": ddp_silent_case(checkpointed=False),
        "ddp/twice/reentrant": ddp_silent_case(checkpointed=True),
        "ddp/reentrant/reuse/static_graph": ddp_case(
            "reentrant", reuse_first=True, static_graph=True
        ),
        "ddp/none/find_unused": ddp_case("none", find_unused_parameters=True),
        "ddp/function/find_unused": ddp_case("function", find_unused_parameters=True),
    }
    if HAS_NN:
        table["ddp/wrapper"] = ddp_case("wrapper")
    if HAS_COMPOSABLE:
        table["ddp/composable"] = ddp_case("composable")
    if HAS_FSDP2:
        table["fsdp/none"] = fsdp_case("none")
        table["fsdp/function"] = fsdp_case("function")
        table["fsdp/policy"] = fsdp_case("policy")
        if HAS_NN:
            table["fsdp/wrapper"] = fsdp_case("wrapper")
        if HAS_COMPOSABLE:
            table["fsdp/composable"] = fsdp_case("composable")
    table["ddp/reentrant/reuse"] = ddp_case("reentrant", reuse_first=True)
    table["ddp/reentrant/find_unused"] = ddp_case("reentrant", find_unused_parameters=True)
    return table


def rank_results(payload: None) -> dict[str, Any]:
    """Every case's records on this rank (the launcher runs this on each rank)."""
    results: dict[str, Any] = {}
    for name, run in cases().items():
        try:
            results[name] = run()
        except Exception as exc:
            # A string result is an error; the tests decide whether one was expected.
            results[name] = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
            results[name + "#traceback"] = traceback.format_exc()
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    """Both ranks' results (one launch for the whole module)."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    return launch_on_ranks(WORLD_SIZE, rank_results, timeout_s=LAUNCH_TIMEOUT_S)


def result(ranks: list[dict[str, Any]], case: str) -> list[dict[str, torch.Tensor]]:
    """The case's record on every rank; a worker error fails with its traceback."""
    records = [results[case] for results in ranks]
    for rank, record in enumerate(records):
        assert isinstance(record, dict), (
            f"{case} failed on rank {rank}: {record}\n{ranks[rank][case + '#traceback']}"
        )
    return records


def assert_records(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, exact: bool = True
) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if exact:
            assert torch.equal(actual[key], value), (
                f"{key}: max diff {(actual[key] - value).abs().max()}"
            )
        else:
            torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-6, msg=key)


# --------------------------------------------------------------------- tests

needs_nn = pytest.mark.skipif(not HAS_NN, reason="remat.nn (checkpoint_wrapper) is not available")
needs_composable = pytest.mark.skipif(
    not HAS_COMPOSABLE, reason="remat.composable (checkpoint_module) is not available"
)
needs_fsdp2 = pytest.mark.skipif(
    not HAS_FSDP2, reason="torch.distributed.fsdp.fully_shard needs torch >= 2.6"
)


def test_ranks_really_synchronize(ranks: list[dict[str, Any]]) -> None:
    # Different data per rank, same reduced gradients: the oracle itself is distributed.
    rank0, rank1 = result(ranks, "ddp/none")
    assert not torch.equal(rank0["step0.loss"], rank1["step0.loss"])
    assert_records(
        rank0 | {"step0.loss": rank1["step0.loss"], "step1.loss": rank1["step1.loss"]}, rank1
    )


@pytest.mark.parametrize(
    "case",
    [
        "ddp/function",
        "ddp/policy",
        "ddp/function/find_unused",
        pytest.param("ddp/wrapper", marks=needs_nn),
        pytest.param("ddp/composable", marks=needs_composable),
    ],
)
def test_ddp_gradients_equal_unchecked(ranks: list[dict[str, Any]], case: str) -> None:
    oracle = "ddp/none/find_unused" if case.endswith("find_unused") else "ddp/none"
    for actual, expected in zip(result(ranks, case), result(ranks, oracle), strict=True):
        assert_records(actual, expected)


@needs_fsdp2
@pytest.mark.parametrize(
    "case",
    [
        "fsdp/function",
        "fsdp/policy",
        pytest.param("fsdp/wrapper", marks=needs_nn),
        pytest.param("fsdp/composable", marks=needs_composable),
    ],
)
def test_fsdp2_gradients_equal_unchecked(ranks: list[dict[str, Any]], case: str) -> None:
    for actual, expected in zip(result(ranks, case), result(ranks, "fsdp/none"), strict=True):
        assert_records(actual, expected)


def test_ddp_reused_parameters_non_reentrant(ranks: list[dict[str, Any]]) -> None:
    # Block 0 runs twice per step: fine without reentrancy, no DDP option needed.
    for actual, expected in zip(
        result(ranks, "ddp/function/reuse"), result(ranks, "ddp/none/reuse"), strict=True
    ):
        assert_records(actual, expected)


@pytest.mark.parametrize(
    ("case", "oracle"),
    [
        ("ddp/reentrant", "ddp/none"),
        ("ddp/reentrant/reuse", "ddp/none/reuse"),
        ("ddp/reentrant/reuse/static_graph", "ddp/none/reuse"),
        ("ddp/reentrant/find_unused", "ddp/none/find_unused"),
        ("ddp/twice/reentrant", "ddp/twice/none"),
    ],
)
def test_ddp_reentrant_gradients_equal_unchecked(
    ranks: list[dict[str, Any]], case: str, oracle: str
) -> None:
    # torch's reentrant checkpoint breaks DDP when a block is used twice per
    # step (an error, or silently unsynchronized ranks when the reused layer
    # is the last thing backward reaches) and under find_unused_parameters.
    # remat's reentrant node has an edge per use of each parameter, so every
    # parameter reports once, in the outer backward, and the gradients are
    # the unchecked run's (docs/design/distributed.md).
    for actual, expected in zip(result(ranks, case), result(ranks, oracle), strict=True):
        assert_records(actual, expected)
