"""remat.offload / no_offload and the transfer they share with offloading policies.

On CPU the copies save no memory but run end to end, so what is tested here
is correctness: exact gradients, which tensors are moved, autograd's in-place
check, nesting with checkpoints, repeated backward. The CUDA stream path is
exercised on a GPU (see the closing note of the offload work).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat
import remat.policies as P
from helpers import dtensor_api, two_tensor_class
from remat._scope import observe_saved_tensors
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.memory import track
from remat.offload import HostCopy, HostTransfer
from remat.storage.copies import PinnedPool


def mlp() -> tuple[torch.nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    return model, torch.randn(8, 16, requires_grad=True)


def grads(model: torch.nn.Module, x: torch.Tensor, **kwargs: Any) -> list[torch.Tensor]:
    with remat.offload(**kwargs):
        out = model(x).tanh()
    return list(torch.autograd.grad(out.sum(), [x, *model.parameters()]))


def test_offload_gives_identical_gradients() -> None:
    model, x = mlp()
    want = list(torch.autograd.grad(model(x).tanh().sum(), [x, *model.parameters()]))
    for got, expected in zip(grads(model, x, min_bytes=0), want, strict=True):
        assert torch.equal(got, expected)


def offloaded_shapes(fn: Any, **kwargs: Any) -> list[tuple[int, ...]]:
    events: list[tuple[int, ...]] = []
    with observe_saved_tensors(lambda event, t: events.append(tuple(t.shape)) if event == "offloaded" else None):
        with remat.offload(**kwargs):
            fn()
    return events


def test_small_tensors_and_parameters_stay() -> None:
    model, x = mlp()
    # Linear saves its input and its weight (a parameter, never moved); GELU saves its input.
    shapes = offloaded_shapes(lambda: model(x), min_bytes=0)
    assert sorted(shapes) == [(8, 16), (8, 32), (8, 32)]
    assert offloaded_shapes(lambda: model(x), min_bytes=8 * 32 * 4) == [(8, 32), (8, 32)]
    assert offloaded_shapes(lambda: model(x), min_bytes=10**9) == []


def test_saved_values_are_host_copies() -> None:
    x = torch.randn(64, requires_grad=True)
    with remat.offload(min_bytes=0):
        y = x.exp()
    packed = y.grad_fn._raw_saved_result  # type: ignore[union-attr]
    assert isinstance(packed, torch._C._autograd.SavedTensor)
    y.sum().backward()
    assert torch.equal(x.grad, x.exp())  # type: ignore[arg-type]


def test_in_place_change_after_offload_is_caught() -> None:
    x = torch.randn(64, requires_grad=True)
    with remat.offload(min_bytes=0):
        h = x * 2
        y = h.sin()
    h.add_(1)  # sin saved h; backward would use a stale value
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()



def _wrapper_subclass(kind: str, request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """A maker of ``kind`` tensors from plain ones, and a function giving one inner tensor."""
    if kind == "TwoTensor":
        two_tensor = two_tensor_class()
        return (lambda t: two_tensor(t, t * 3 - 1)), (lambda t: t.a)
    api, mesh = dtensor_api(), request.getfixturevalue("one_process_mesh")
    return (lambda t: api.distribute_tensor(t, mesh, [api.Replicate()])), (lambda t: t.to_local())


@pytest.mark.parametrize("kind", ["TwoTensor", "DTensor"])
def test_offloaded_wrapper_subclass_frees_its_memory_and_is_exact(
    kind: str, request: pytest.FixtureRequest
) -> None:
    # Tensor parallel saves DTensor activations. The in-place witness of a
    # wrapper subclass was built with set_(), which DTensor does not implement
    # (and TwoTensor passes to its inner tensors, which refuse a meta storage).
    make, inner_of = _wrapper_subclass(kind, request)
    x = make(torch.randn(32, 64)).requires_grad_()
    with remat.offload(min_bytes=0):
        h = x * 2  # saves nothing (a scalar factor)
        y = h.sin()  # saves h: offloaded
    # Neither the host copy nor the witness keeps the device memory of h.
    storage = weakref.ref(inner_of(h).untyped_storage())
    del h
    assert storage() is None
    y.sum().backward()
    assert type(x.grad) is type(x)
    assert torch.equal(inner_of(x.grad), inner_of((x.detach() * 2).cos() * 2))


@pytest.mark.parametrize("kind", ["TwoTensor", "DTensor"])
def test_in_place_change_of_an_offloaded_wrapper_subclass_is_caught(
    kind: str, request: pytest.FixtureRequest
) -> None:
    make, _ = _wrapper_subclass(kind, request)
    x = make(torch.randn(32, 64)).requires_grad_()
    with remat.offload(min_bytes=0):
        h = x * 2
        y = h.sin()
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

def test_retain_graph_and_second_backward() -> None:
    model, x = mlp()
    with remat.offload(min_bytes=0):
        out = model(x).sum()
    first = torch.autograd.grad(out, x, retain_graph=True)[0]
    second = torch.autograd.grad(out, x)[0]
    assert torch.equal(first, second)


def test_no_offload_keeps_its_part() -> None:
    model, x = mlp()

    def step() -> None:
        h = model[0](x)
        with remat.no_offload():
            model[1](h)

    # Linear's input is offloaded; GELU's input (inside no_offload) is not.
    assert offloaded_shapes(step, min_bytes=0) == [(8, 16)]


def test_offload_around_a_checkpoint_moves_its_inputs_only() -> None:
    model, x = mlp()
    h = x * 1.0
    shapes = offloaded_shapes(lambda: remat.checkpoint(model, h), min_bytes=0)
    assert shapes == [(8, 16)]  # the region's input; its inner tensors are recomputed
    want = list(torch.autograd.grad(model(x).sum(), [x, *model.parameters()]))
    with remat.offload(min_bytes=0):
        out = remat.checkpoint(model, x * 1.0)
    got = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_offload_inside_a_checkpoint_stands_aside() -> None:
    model, x = mlp()

    def block(t: torch.Tensor) -> torch.Tensor:
        with remat.offload(min_bytes=0):
            return model(t)

    want = list(torch.autograd.grad(model(x).sum(), [x, *model.parameters()]))
    got = torch.autograd.grad(remat.checkpoint(block, x).sum(), [x, *model.parameters()])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_offload_policy_reports_host_copies() -> None:
    events: list[str] = []
    x = torch.randn(8, 8, requires_grad=True)
    with observe_saved_tensors(lambda event, t: events.append(event)):
        y = remat.checkpoint(lambda t: (t @ t).sin(), x, policy=P.save_ops(torch.ops.aten.mm.default))
    assert "policy_saved" in events
    events.clear()
    def offload_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> P.CheckpointPolicy:
        return P.CheckpointPolicy.MUST_OFFLOAD if op == torch.ops.aten.mm.default else P.CheckpointPolicy.PREFER_RECOMPUTE

    with observe_saved_tensors(lambda event, t: events.append(event)):
        y = remat.checkpoint(lambda t: (t @ t).sin(), x, policy=offload_mm)
    assert "policy_offloaded" in events
    y.sum().backward()
    assert torch.allclose(x.grad, torch.autograd.grad((x @ x).sin().sum(), x)[0])  # type: ignore[arg-type]


def test_transfer_restores_equal_values_in_fresh_memory_in_backward_order() -> None:
    # What prefetch overlaps (copies on side streams) is tested in the CUDA group;
    # on CPU the observable behaviour is the values and their independence.
    transfer = HostTransfer(prefetch=2)
    tensors = [torch.randn(4) for _ in range(3)]
    originals = [t.clone() for t in tensors]
    copies = [transfer.to_host(t) for t in tensors]
    assert all(isinstance(c, HostCopy) for c in copies)
    for copy, tensor, original in zip(reversed(copies), reversed(tensors), reversed(originals), strict=True):
        restored = copy.restore()
        assert torch.equal(restored, original)
        restored.add_(1.0)  # its own memory: the saved tensor is untouched
        assert torch.equal(tensor, original)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"min_bytes": -1}, CheckpointUsageError),
        ({"min_bytes": "1k"}, CheckpointTypeError),
        ({"prefetch": 1.5}, CheckpointTypeError),
        ({"pin_memory": "yes"}, CheckpointTypeError),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error, match=r"remat\.offload"):
        remat.offload(**kwargs)


def test_a_context_cannot_be_entered_twice() -> None:
    context = remat.offload()
    with context, pytest.raises(CheckpointUsageError, match="already active"):
        context.__enter__()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_overlaps_and_matches() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    x = torch.randn(256, 1024, device="cuda", requires_grad=True)
    want = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    with remat.offload():
        out = model(x)
    got = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "make",
    [
        lambda x, w: (x.expand(8, 16) * w).sin(),  # an expanded (stride 0) tensor is saved
        lambda x, w: (w.t()[::2] * 3).exp(),  # a strided view
        lambda x, w: (w * w).relu(),  # one tensor saved twice by one op
    ],
    ids=["expanded", "strided-view", "saved-twice"],
)
def test_views_and_aliases_round_trip(make: Any) -> None:
    x = torch.randn(8, 1, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    want = torch.autograd.grad(make(x, w).sum(), [x, w], allow_unused=True)
    with remat.offload(min_bytes=0):
        out = make(x, w)
    got = torch.autograd.grad(out.sum(), [x, w], allow_unused=True)
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_a_tensor_saved_twice_is_copied_once() -> None:
    transfer = HostTransfer()
    t = torch.randn(16)
    first = transfer.to_host(t)
    assert transfer.to_host(t) is first
    assert transfer.to_host(t.t()) is first  # same data, shape and strides
    assert transfer.to_host(t[1:]) is not first


# --- identity, versions, views and pairing with checkpoints ------------------


def residual_stack(d: int = 64, hidden: int = 256, blocks: int = 3) -> torch.nn.ModuleList:
    """Pre-norm residual MLP blocks: ``x = x + fc2(gelu(fc1(layer_norm(x))))``."""
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.ModuleDict(
            {"ln": torch.nn.LayerNorm(d), "fc1": torch.nn.Linear(d, hidden), "fc2": torch.nn.Linear(hidden, d)}
        )
        for _ in range(blocks)
    ).double()


def run_stack(stack: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in stack:
        x = x + block["fc2"](torch.nn.functional.gelu(block["fc1"](block["ln"](x))))
    return x


@pytest.mark.parametrize("min_bytes", [0, 1024])
def test_residual_stack_is_bitwise_over_many_runs(min_bytes: int) -> None:
    # Saves are de-duplicated by tensor, not by address: a freed tensor's address
    # reused by another saved tensor must not map onto the stale host copy. Address
    # reuse depends on the allocator, so the program is repeated.
    stack = residual_stack()
    x = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    params = [x, *stack.parameters()]
    want = torch.autograd.grad(run_stack(stack, x).sum(), params)
    for _ in range(30):
        with remat.offload(min_bytes=min_bytes):
            out = run_stack(stack, x)
        got = torch.autograd.grad(out.sum(), params)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_freed_tensor_address_is_not_its_identity() -> None:
    transfer = HostTransfer()
    first = transfer.to_host(torch.full((256,), 1.0))  # the tensor dies here
    second = transfer.to_host(torch.full((256,), 2.0))  # may get the same address
    assert first is not second
    assert torch.equal(first.restore(), torch.full((256,), 1.0))
    assert torch.equal(second.restore(), torch.full((256,), 2.0))


def test_policy_offload_of_a_tensor_changed_in_place_before_saving() -> None:
    # The version is read from the tensor itself, not from a detach() made inside the
    # recorder's dispatch mode, whose fresh counter would start again at 0.
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        h = t * 2
        h.add_(1)
        return remat.name(h, "h").sin() @ h

    want = torch.autograd.grad(f(x).sum(), x)[0]
    got = torch.autograd.grad(remat.checkpoint(f, x, policy=P.offload_names("h")).sum(), x)[0]
    assert torch.equal(got, want)


def test_policy_offload_still_catches_a_later_in_place_change() -> None:
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    holder: list[torch.Tensor] = []

    def f(t: torch.Tensor) -> torch.Tensor:
        h = remat.name(t * 2, "h")
        holder.append(h)
        return h.sin()

    out = remat.checkpoint(f, x, policy=P.offload_names("h"))
    with torch.no_grad():
        holder[0].add_(1)
    with pytest.raises(RuntimeError, match="modified in place afterwards"):
        out.sum().backward()


def test_policy_offload_with_mutation_allowed_replays_the_forward_value() -> None:
    # The host copy is a snapshot: with allow_cache_entry_mutation the
    # recomputation gets the value the op produced, as without checkpointing.
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        h = remat.name(t * 2, "h")
        y = h.exp()  # saves its result, not h
        h.mul_(3)  # after the save, inside the region: the recomputation redoes it
        return y * h

    contexts = functools.partial(
        remat.create_selective_checkpoint_contexts, P.offload_names("h"), allow_cache_entry_mutation=True
    )
    want = torch.autograd.grad(f(x).sum(), x)[0]
    got = torch.autograd.grad(remat.checkpoint(f, x, context_fn=contexts).sum(), x)[0]
    assert torch.equal(got, want)


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_offload_work_is_invisible_to_user_dispatch_modes() -> None:
    # Host buffers and copies are invisible to enclosing dispatch modes (a selective
    # region's recorder must not count them as user ops).
    x = torch.randn(16, 16, requires_grad=True)
    with OpLog() as plain:
        torch.autograd.grad((x * 2).sin().sum(), x)
    with OpLog() as log:
        with remat.offload(min_bytes=0):
            y = (x * 2).sin()
        torch.autograd.grad(y.sum(), x)
    # autograd itself detaches what an unpack hook returns (any hook does that)
    assert [op for op in log.ops if op != "aten.detach.default"] == plain.ops


def test_policy_offload_nested_in_a_selective_region() -> None:
    def offload_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> P.CheckpointPolicy:
        if op == torch.ops.aten.mm.default:
            return P.CheckpointPolicy.MUST_OFFLOAD
        return P.CheckpointPolicy.PREFER_RECOMPUTE

    stack = residual_stack(16, 32, 2)

    def inner(t: torch.Tensor) -> torch.Tensor:
        return run_stack(stack, t)

    def outer(t: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(inner, t.cos(), policy=offload_mm).tanh()

    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    params = [x, *stack.parameters()]
    want = torch.autograd.grad(outer(x).sum(), params)
    for _ in range(10):
        out = remat.checkpoint(outer, x, policy=P.save_ops(torch.ops.aten.native_layer_norm.default))
        got = torch.autograd.grad(out.sum(), params)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(
    "view",
    [
        lambda b: b[:, 1::2],
        lambda b: b.diagonal(),
        lambda b: b.t(),
        lambda b: b[2:5],
        lambda b: b[:, :1].expand(8, 16),
    ],
    ids=["strided", "diagonal", "transposed", "offset-rows", "expanded"],
)
def test_offloaded_views_keep_their_layout(view: Any) -> None:
    # Strided views come back with their strides and offset, not contiguous.
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    with remat.offload(min_bytes=0):
        v = view(x * 1)
        y = v.sin()
    saved = y.grad_fn._saved_self  # type: ignore[union-attr]
    assert (saved.shape, saved.stride()) == (v.shape, v.stride())
    assert torch.equal(saved, v)
    want = torch.autograd.grad(view(x * 1).sin().sum(), x)[0]
    assert torch.equal(torch.autograd.grad(y.sum(), x)[0], want)


def test_views_of_one_storage_share_one_host_block() -> None:
    transfer = HostTransfer()
    qkv = torch.randn(4, 3 * 8)
    q, k, v = qkv.split(8, dim=1)
    copies = [transfer.to_host(t) for t in (q, k, v)]
    assert transfer.copied_bytes == qkv.numel() * qkv.element_size()
    for copy, t in zip(copies, (q, k, v), strict=True):
        restored = copy.restore()
        assert (restored.stride(), restored.storage_offset()) == (t.stride(), t.storage_offset())
        assert torch.equal(restored, t)


class Block(torch.nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, hidden)
        self.fc2 = torch.nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def end_of_forward_bytes(wrap: Any) -> tuple[int, list[torch.Tensor]]:
    """Bytes of user tensors alive after the forward (offload's host copies are
    invisible to dispatch modes, so on CPU they stand for device bytes), and grads."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[wrap(Block(32, 64)) for _ in range(4)]).double()
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    with track() as tracker:
        out = blocks(x * 1.0)
        tracker.mark("forward_end")
    return tracker.marks["forward_end"], list(torch.autograd.grad(out.sum(), [x, *blocks.parameters()]))


def test_offload_wrapper_around_checkpoint_wrapper_offloads_region_inputs() -> None:
    # The classic pairing (offload around checkpoint) moves the checkpoints' inputs to the host.
    plain_bytes, want = end_of_forward_bytes(lambda m: m)
    checkpointed, got_ck = end_of_forward_bytes(remat.checkpoint_wrapper)
    paired, got_pair = end_of_forward_bytes(lambda m: remat.offload_wrapper(remat.checkpoint_wrapper(m)))
    offloaded, got_off = end_of_forward_bytes(remat.offload_wrapper)
    block_input = 64 * 32 * 8
    assert paired <= checkpointed - 3 * block_input  # inputs of blocks 2-4 left the device
    assert offloaded < checkpointed < plain_bytes
    for got in (got_ck, got_pair, got_off):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_offload_around_checkpoint_offloads_region_inputs() -> None:
    class Checkpointed(torch.nn.Module):
        def __init__(self, m: torch.nn.Module, offload: bool) -> None:
            super().__init__()
            self.m = m
            self.offload = offload

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with remat.offload(min_bytes=0) if self.offload else contextlib.nullcontext():
                return remat.checkpoint(self.m, x)  # type: ignore[no-any-return]

    checkpointed, want = end_of_forward_bytes(lambda m: Checkpointed(m, offload=False))
    paired, got = end_of_forward_bytes(lambda m: Checkpointed(m, offload=True))
    assert paired <= checkpointed - 3 * 64 * 32 * 8
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_pinned_pool_reuses_buffers_once_their_last_copy_finished() -> None:
    allocations: list[int] = []

    def allocate(nbytes: int) -> torch.Tensor:
        allocations.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    pool = PinnedPool(allocate)
    first = pool.acquire(3000)
    assert first.numel() == 4096 and allocations == [4096]  # power-of-two classes below 1 MiB
    busy = FakeEvent()
    pool.release(first, busy)
    second = pool.acquire(4000)  # same class, but the copy reading `first` has not finished
    assert second is not first and allocations == [4096, 4096]
    busy.done = True
    assert pool.acquire(2500) is first  # reused, not allocated again
    assert pool.acquire((3 << 20) + 1).numel() == 4 << 20  # whole MiB above 1 MiB
    pool.release(second, None)
    pool.clear()
    assert pool.allocated_bytes == 4096 + (4 << 20)  # `first` and the big one are still out


def test_host_copies_die_with_the_graph() -> None:
    transfer = HostTransfer()
    stack = residual_stack(16, 32, 2)
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(transfer.to_host, lambda copy: copy.restore()):
        out = run_stack(stack, x)
    assert any(ref() is not None for ref in transfer._copies)
    out.sum().backward()
    del out
    assert all(ref() is None for ref in transfer._copies)
    # entries of tensors still alive (x, the parameters) refer to dead blocks only
    assert all(ref() is None for refs in transfer._blocks.values() for ref in refs)
