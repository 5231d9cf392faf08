"""What the tests share; every folder imports it as ``from helpers import ...``
(tests/README.md says where a test goes).

* Oracles and counters (docs/design/architecture.md, "Principles the code
  cites"): ``Impl``, one namespace per implementation under test: ``PLAIN``
  runs the function without any checkpointing (the oracle), ``TORCH`` wraps
  ``torch.utils.checkpoint`` (always passing ``use_reentrant`` explicitly, since
  torch warns when it is omitted) and ``remat_impl()`` is the library itself;
  ``assert_same``, exact (``torch.equal``) comparison of nested results;
  ``OpCounter``, a dispatch mode counting aten ops by name
  (``"aten.exp.default"``); ``CallCounter``; ``LiveStorages``, storage-level
  accounting of tensors created under it; ``assert_same_memory`` for two
  ``remat.memory`` reports.
* Small programs and models: ``attention_block``, ``squared_loss_grads``,
  ``draw_ops`` (the property tests' op lists), ``with_heads`` (blocks beside a
  larger list of heads), ``tiny_llama_config`` (the one tiny Hugging Face
  Llama, built locally), ``uniform_chain`` and ``random_chain`` (planner
  tables); ``two_tensor_class`` and ``dtensor_api`` for tensor subclasses.
* Skips where this torch lacks something: ``torch_checkpoint_api``,
  ``needs_torch_sac``, ``needs_meta_autocast``.
* ``one_error_line``: a command's one-line error, checked.
* ``launch_on_ranks``: a test module's function on N local gloo ranks, by
  ``remat.launch.run_on_ranks``; ``REPO``, the checkout.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import inspect
import os
import random
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

IMPL_NAMES = ("torch", "remat")
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    checkpoint: Callable[..., Any]
    checkpoint_sequential: Callable[..., Any]
    set_checkpoint_early_stop: Callable[[bool], Any]
    set_checkpoint_debug_enabled: Callable[[bool | None], Any]
    GraphExecGroup: Callable[[], Any] | None
    CheckpointError: type[BaseException]

    def __repr__(self) -> str:
        return self.name

    def graph_exec_group(self) -> Any:
        """A new ``GraphExecGroup``; skips the test where this torch has none."""
        if self.GraphExecGroup is None:
            pytest.skip(f"torch {torch.__version__} has no torch.utils.checkpoint.GraphExecGroup")
        return self.GraphExecGroup()


_CHECKPOINT_OPTIONS = (
    "use_reentrant",
    "context_fn",
    "determinism_check",
    "debug",
    "early_stop",
    "preserve_rng_state",
)


def _plain_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    for option in _CHECKPOINT_OPTIONS:
        kwargs.pop(option, None)
    return function(*args, **kwargs)


def _plain_sequential(functions: Any, segments: int, input: Any, **kwargs: Any) -> Any:
    for function in functions:
        input = function(input)
    return input


def _null_context(*args: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


PLAIN = Impl(
    "plain",
    _plain_checkpoint,
    _plain_sequential,
    _null_context,
    _null_context,
    contextlib.nullcontext,
    RuntimeError,
)


# preserve_rng_state travels in **kwargs on every release; early_stop became a
# parameter in later releases (torch 2.4 passes it on to the function).
_TORCH_CHECKPOINT_OPTIONS = frozenset(inspect.signature(tuc.checkpoint).parameters) | {
    "preserve_rng_state"
}


def _torch_checkpoint(
    function: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any
) -> Any:
    for option in _CHECKPOINT_OPTIONS:
        # Older torch passes an option it does not know on to the function.
        if option in kwargs and option not in _TORCH_CHECKPOINT_OPTIONS:
            pytest.skip(f"torch {torch.__version__}'s checkpoint has no {option} argument")
    return tuc.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


def _torch_sequential(
    functions: Any, segments: int, input: Any, use_reentrant: bool = False, **kwargs: Any
) -> Any:
    return tuc.checkpoint_sequential(
        functions, segments, input, use_reentrant=use_reentrant, **kwargs
    )


TORCH = Impl(
    "torch",
    _torch_checkpoint,
    _torch_sequential,
    tuc.set_checkpoint_early_stop,
    tuc.set_checkpoint_debug_enabled,
    getattr(tuc, "GraphExecGroup", None),  # torch >= 2.9
    tuc.CheckpointError,
)


def remat_impl() -> Impl:
    import remat  # imported lazily so that the torch half runs before remat exists

    return Impl(
        "remat",
        remat.checkpoint,
        remat.checkpoint_sequential,
        remat.set_checkpoint_early_stop,
        remat.set_checkpoint_debug_enabled,
        remat.GraphExecGroup,
        remat.CheckpointError,
    )


def torch_checkpoint_api(name: str) -> Any:
    """``torch.utils.checkpoint.<name>``; skips the test where this torch lacks it.

    Tests that use torch as an oracle for a feature torch added later (selective
    checkpointing in 2.5, GraphExecGroup in 2.9) skip on older torch, with the
    reason, instead of failing; remat's side of such tests runs everywhere.
    """
    api = getattr(tuc, name, None)
    if api is None:
        pytest.skip(f"torch {torch.__version__} has no torch.utils.checkpoint.{name}")
    return api


# torch's own selective checkpointing (torch >= 2.5), or None where this torch has none.
TORCH_SAC: Callable[..., Any] | None = getattr(tuc, "create_selective_checkpoint_contexts", None)
TORCH_HAS_SAC = TORCH_SAC is not None
# remat's policies under torch.compile go through torch's own selective modes.
needs_torch_sac = pytest.mark.skipif(
    not TORCH_HAS_SAC,
    reason=f"torch {torch.__version__}: selective checkpointing in torch.utils.checkpoint "
    "(and so remat policies under torch.compile) needs torch >= 2.5",
)


# transformers' rotary embeddings enter torch.autocast(device_type=<the input's device>),
# which torch 2.4 does not accept for "meta".
needs_meta_autocast = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5),
    reason="torch < 2.5 has no autocast state for the meta device",
)


def get_impl(name: str) -> Impl:
    return {"torch": lambda: TORCH, "remat": remat_impl, "plain": lambda: PLAIN}[name]()


def builtin_base(exc_type: type[BaseException]) -> type[BaseException]:
    """The first builtin class in the MRO (torch's CheckpointError -> RuntimeError)."""
    return next(cls for cls in exc_type.__mro__ if cls.__module__ == "builtins")


def assert_same(actual: Any, expected: Any, path: str = "result") -> None:
    """Exact equality of nested tuples/lists/dicts of tensors (and None)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {actual!r}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        assert torch.equal(actual, expected), (
            f"{path}: values differ (max abs diff {(actual - expected).abs().max()})"
        )
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), f"{path}: keys differ"
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in module.named_parameters()}


Program = Callable[[torch.Tensor], torch.Tensor]


def live_frames() -> list[Any]:
    """Every engine ``Frame`` (one per region call) still alive after a collection."""
    import gc

    from remat._engine.frame import Frame

    gc.collect()
    return [obj for obj in gc.get_objects() if type(obj) is Frame]


def attention_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Self-attention with a residual and a norm, written with operators (``@``, ``+``)."""
    q = x @ w
    scores = (q @ x.transpose(-1, -2)).softmax(-1)
    return torch.nn.functional.layer_norm(x + scores @ q, x.shape[-1:])


def squared_loss_grads(
    program: Program, x: torch.Tensor, params: list[torch.Tensor], backwards: int = 1
) -> list[torch.Tensor]:
    """Gradients of ``program(x).pow(2).sum()`` for a fresh leaf copy of ``x`` and ``params``,
    after ``backwards`` backward calls with ``retain_graph`` (a missing one: an empty tensor)."""
    x = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    loss = program(x).pow(2).sum()
    for _ in range(backwards):
        loss.backward(retain_graph=True)
    grads = [x.grad] + [p.grad for p in params]
    return [g.clone() if g is not None else torch.zeros(0) for g in grads]


class ScaleByWeight(torch.autograd.Function):
    """A custom Function that reads its weight in Python (``h * w``), as most do:
    autograd reaches the weight only through this node's edge."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        return h * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = ctx.saved_tensors
        return grad * w, (grad * h).sum(0)


class OpCounter(TorchDispatchMode):
    """Counts every aten op that runs under it, by overload name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def take(self) -> collections.Counter[str]:
        """Counts since the last take (so a test can count per phase)."""
        counts, self.counts = self.counts, collections.Counter()
        return counts


class CallCounter:
    """Wraps a function and counts its calls (forward + recomputations)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


@dataclasses.dataclass
class _Tracked:
    ref: weakref.ref[torch.UntypedStorage]
    nbytes: int
    phase: str


class LiveStorages(TorchDispatchMode):
    """Storage-level accounting of tensors created by ops run under this mode.

    A storage counts from the op that first creates it (views and in-place ops
    reuse an input's storage and add nothing) until it is freed (weakref on
    the storage, whose Python object torch keeps alive exactly as long as the
    storage itself). ``peak_bytes`` is the maximum of ``live_bytes`` seen after
    each op. ``phase(name)`` labels storages created from now on.
    """

    def __init__(self) -> None:
        super().__init__()
        self._tracked: dict[int, _Tracked] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._phase = "start"

    def phase(self, name: str) -> None:
        self._phase = name

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def alive(self, phase: str | None = None) -> list[torch.UntypedStorage]:
        """Storages still alive that were created during ``phase`` (all if None)."""
        out = []
        for tracked in list(self._tracked.values()):
            storage = tracked.ref()
            if storage is not None and (phase is None or tracked.phase == phase):
                out.append(storage)
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {
            id(t.untyped_storage())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in inputs and key not in self._tracked and storage.nbytes() > 0:
                    self._add(storage)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        self._tracked[key] = _Tracked(weakref.ref(storage), nbytes, self._phase)
        self.live_bytes += nbytes
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.pop(key, None)
        self.live_bytes -= nbytes


def two_tensor_class() -> Any:
    """torch's test wrapper subclass ``TwoTensor`` (skips where this torch lacks it)."""
    try:
        module = importlib.import_module("torch.testing._internal.two_tensor")
    except ImportError:
        pytest.skip("torch.testing._internal.two_tensor.TwoTensor is missing in this torch")
    return module.TwoTensor


def dtensor_api() -> Any:
    """The module holding DTensor's public API in this torch (skips where there is none)."""
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            api = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(api, "distribute_tensor"):
            return api
    pytest.skip("DTensor is not available in this torch")


@contextlib.contextmanager
def seeded(seed: int = 0) -> Iterator[None]:
    """Run a block from a fixed global RNG state, restoring the previous one after."""
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(state)


def draw_ops(
    draw: Any, names: list[str], binary: Any, n_inputs: int, count: int
) -> list[tuple[str, tuple[int, ...]]]:
    """A random op list for the property tests: op ``i`` reads earlier values by index
    (the ``n_inputs`` inputs, then the outputs of ops before it); names in
    ``binary`` take two arguments, the others one."""
    from hypothesis import strategies as st

    ops: list[tuple[str, tuple[int, ...]]] = []
    for i in range(count):
        name = draw(st.sampled_from(names))
        arity = 2 if name in binary else 1
        ops.append((name, tuple(draw(st.integers(0, n_inputs + i - 1)) for _ in range(arity))))
    return ops


def draw_nested_blocks(draw: Any, lo: int, hi: int, depth: int) -> list[Any]:
    """Ops ``lo..hi-1`` of a drawn program grouped into blocks: ``("op", i)`` runs op ``i``,
    ``("ck", flag, blocks)`` a region (the flag is the test's: reentrant, or policy) of
    nested blocks, at most ``depth`` deep."""
    from hypothesis import strategies as st

    blocks: list[Any] = []
    i = lo
    while i < hi:
        if depth > 0 and draw(st.booleans()):
            j = draw(st.integers(i + 1, hi))
            blocks.append(("ck", draw(st.booleans()), draw_nested_blocks(draw, i, j, depth - 1)))
            i = j
        else:
            blocks.append(("op", i))
            i += 1
    return blocks


TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}


class NoBlocks(torch.nn.Module):
    """One layer, no list of blocks; a Sequential of one module is a wrapper, not a stack."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


NO_BLOCKS_RULE = (
    "NoBlocks has no stack of blocks (an nn.ModuleList of one module or more, or an "
    "nn.Sequential of two or more); "
)
"""How every entry point starts its error for :class:`NoBlocks` (``remat._blocks.require_blocks``)."""


def tiny_llama_config(**changes: Any) -> Any:
    """A tiny ``transformers.LlamaConfig`` (``TINY_LLAMA``: grouped key/value heads, rotary
    positions, RMSNorm, SwiGLU), built locally: nothing is downloaded. ``changes`` set any
    field. Skips the test where transformers is not installed."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(**(TINY_LLAMA | changes))


def uniform_chain(n: int, **fields: Any) -> Any:
    """A planner ``ChainProblem`` of ``n`` identical keep/checkpoint blocks: keep retains 100
    bytes (peak 150, 1 s), checkpoint 10 (peak 110, 1.5 s); ``fields`` add or change any field."""
    from remat.planner.data import CHECKPOINT, KEEP, ChainProblem

    table: dict[str, Any] = {
        "options": (KEEP, CHECKPOINT),
        "retained_bytes": ((100, 10),) * n,
        "local_bytes": ((150, 110),) * n,
        "time_s": ((1.0, 1.5),) * n,
        "tail_bytes": 0,
        "floor_bytes": 0,
    }
    return ChainProblem(**(table | fields))


def random_chain(rng: random.Random, n: int, width: int = 3) -> Any:
    """A random ChainProblem of ``n`` blocks with ``width`` options each (keep first), every
    field used: residues, forward peaks, links and their measured rises, shared inputs and a
    tail after the model; for checking the solvers against enumeration and the terms."""
    from remat.planner.data import CHECKPOINT, KEEP, SAVE_MATMULS, ChainProblem, SharedInput

    options = (KEEP, CHECKPOINT, SAVE_MATMULS)
    rows = []
    for _ in range(n):
        keep = rng.randint(50, 200)
        retained = [keep] + [rng.randint(1, keep) for _ in range(width - 1)]
        local = [r + rng.randint(0, 150) for r in retained]
        times = [1.0] + [1.0 + rng.random() for _ in range(width - 1)]
        residue = [rng.randint(0, 30) for _ in range(width)]
        forward = [rng.randint(0, 250) for _ in range(width)]
        rows.append((retained, local, times, residue, forward))
    links = tuple(
        tuple(tuple(rng.choice((0, 0, -16, 16, 32)) for _ in range(width)) for _ in range(width))
        for _ in rows
    )
    return ChainProblem(
        options=options[:width],
        retained_bytes=tuple(tuple(r[0]) for r in rows),
        local_bytes=tuple(tuple(r[1]) for r in rows),
        time_s=tuple(tuple(r[2]) for r in rows),
        tail_bytes=rng.randint(0, 100),
        floor_bytes=rng.randint(0, 100),
        residue_bytes=tuple(tuple(r[3]) for r in rows),
        forward_bytes=tuple(tuple(r[4]) for r in rows),
        link_bytes=links,
        # The measured rise of a backward peak: anywhere from 0 to the positive link.
        link_peak_bytes=tuple(
            tuple(tuple(rng.randint(0, max(value, 0)) for value in entry) for entry in table)
            for table in links
        ),
        # Shared inputs kept per option (a mask a checkpoint holds), and a tail
        # after the model's forward on which only the kept ones remain.
        shared=tuple(
            SharedInput(
                rng.choice((8, 24, 48)),
                takers=tuple(k for k in range(n) if rng.random() < 0.6),
                kept_under=tuple(o.name for o in options[:width] if rng.random() < 0.5),
            )
            for _ in range(rng.randint(0, 2))
        ),
        tail_after_bytes=rng.choice((None, rng.randint(0, 150))),
    )


def one_error_line(err: str, prog: str) -> str:
    """The one line a ``remat`` command wrote to stderr on an error, checked: one line, no
    traceback, ``"<prog>: error: "`` first."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def launch_once(
    launched: dict[int, Any], world_size: int, function: Callable[[Any], Any], payload: Any = None, *, timeout_s: float
) -> list[Any]:
    """:func:`launch_on_ranks`, once per world size: the results are kept in ``launched``
    (a module's own dict) and every later call reads them. A failed launch is kept too (its
    message): every test of that world size fails at once with it, instead of launching (and
    timing out) again."""
    from remat.errors import RankError

    if world_size not in launched:
        try:
            launched[world_size] = launch_on_ranks(world_size, function, payload, timeout_s=timeout_s)
        except RankError as error:
            launched[world_size] = str(error)
    result = launched[world_size]
    if isinstance(result, str):
        pytest.fail(result)
    return result  # type: ignore[no-any-return]


def launch_on_ranks(
    world_size: int, function: Callable[[Any], Any], payload: Any = None, *, timeout_s: float
) -> list[Any]:
    """``function(payload)`` on ``world_size`` new processes joined by gloo, by the library's
    launcher (``remat.launch.run_on_ranks``); the results in rank order.

    ``function`` is a top-level function of a test module: each rank imports that module by
    name, with its folder and ``tests/`` (for ``helpers``) first on the rank's path. A rank that
    fails, or a run past ``timeout_s``, raises ``remat.errors.RankError`` with its traceback.

    A rank killed by a signal before its result (a crash inside torch's native code: once in
    about 16 launches of ``integration/test_distributed_models.py`` on torch 2.15, glibc's
    "munmap_chunk(): invalid pointer", never reproduced alone) is launched once more, with a
    warning that carries the crash's output; the results are checked as ever. A second crash,
    or any other failure, raises.
    """
    import warnings

    from remat.errors import RankError
    from remat.launch import run_on_ranks

    folder = Path(inspect.getfile(function)).resolve().parent
    path = [str(folder), str(TESTS), os.environ.get("PYTHONPATH", "")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, dict.fromkeys(path))))
        target = f"{function.__module__}:{function.__name__}"
        try:
            return run_on_ranks(world_size, target, payload, timeout_s=timeout_s)
        except RankError as crash:
            if crash.killed_by is None:
                raise
            warnings.warn(f"a rank crashed in native code; launching once more. {crash}", stacklevel=2)
        return run_on_ranks(world_size, target, payload, timeout_s=timeout_s)


class WithHeads(torch.nn.Module):
    """A stack of 3 blocks and a larger list of 6 heads applied to the stack's output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3))
        self.heads = torch.nn.ModuleList(torch.nn.Linear(16, 64) for _ in range(6))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.stack([head(x) for head in self.heads]).sum(0) * scale


def with_heads() -> tuple[torch.nn.Module, tuple[torch.Tensor], dict[str, Any]]:
    torch.manual_seed(0)
    return WithHeads(), (torch.randn(4, 16),), {"scale": 0.5}


def assert_same_memory(estimated: Any, measured: Any) -> None:
    """Two ``remat.memory.MemoryReport``s agree: peak, end of forward and end, each category at
    those moments, and the rank."""
    assert (estimated.peak_bytes, estimated.forward_end_bytes, estimated.end_bytes) == (
        measured.peak_bytes,
        measured.forward_end_bytes,
        measured.end_bytes,
    )
    # By category at those three moments (the bytes allocated in between also
    # count kernels' transient scratch, which real data can change: the
    # attention of a real run builds a few small masks the fake one skips).
    def moments(report: Any) -> list[tuple[str, int, int, int]]:
        return [(u.name, u.at_peak_bytes, u.at_forward_end_bytes, u.at_end_bytes) for u in report.by_category]

    assert moments(estimated) == moments(measured)
    assert (estimated.rank, estimated.world_size) == (measured.rank, measured.world_size)
