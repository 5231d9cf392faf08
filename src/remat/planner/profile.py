"""Measure what each candidate region costs under each option, on the real device.

One profiled step per option (every region under that option) under
:func:`remat.memory.track`, plus a few timed steps per option without the
tracker; for an option that compresses, one more step per region with that
region alone under it, for its gradient error. Markers at the regions' boundaries (forward hooks, and identity
autograd functions whose backward fires when the region's backward starts
or ends) split the step into windows (:mod:`~remat.planner.phases`); the
tracker's timeline has the live bytes after every op, so each window's own
peak is known.
What the numbers mean, and how they combine into a plan's peak, is in
``docs/design/planner.md`` ("Profile" and "Cost model").

Example:
    >>> import torch
    >>> from remat.planner.profile import profile_model
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    >>> profile = profile_model(model, (torch.randn(8, 32),), repeats=1)
    >>> [region.name for region in profile.regions]
    ['0', '1', '2']
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from remat._blocks import forward_with_hooks, require_blocks
from remat._compat.devices import device_is_initialized
from remat._compat.dynamo import compile_cache_room, compile_errors, graph_break_errors
from remat._compat.modules import compiled_call
from remat._compat.partitioner import region_memory_budgets_available
from remat._compat.pytree import tree_flatten
from remat._compat.versions import dynamo_traces_policy_objects
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError
from remat.memory import (
    AllocationMeter,
    MemoryTracker,
    statically_compiled,
    track,
    track_allocations,
)
from remat.placement import CompileSpec, warn_of_partitioner_settings
from remat.planner.apply import install
from remat.planner.data import (
    CHECKPOINT,
    CHECKPOINT_OFFLOAD,
    COMPILED_BUDGETS,
    DEFAULT_OPTIONS,
    KEEP,
    OFFLOAD,
    HeadCost,
    Option,
    OptionCost,
    Profile,
    RegionCost,
    SharedInput,
)
from remat.planner.head import Head
from remat.planner.phases import StepRecorder, instrumented
from remat.planner.step import LossFn, counted_device, default_loss, input_key, run_step
from remat.planner.timing import DeviceRates, ModelledClock, tensor_bytes

__all__ = ["compressed_options", "default_options", "find_candidates", "profile_model"]

def find_candidates(
    model: nn.Module,
    candidates: Sequence[str | nn.Module] | None = None,
    inputs: Sequence[Any] | None = None,
) -> list[tuple[str, nn.Module]]:
    """The regions to plan: ``candidates`` (names or modules), or the repeated blocks.

    Without ``candidates``, the children of one ``nn.ModuleList`` or
    ``nn.Sequential``: preferably one whose children run as a chain in a
    forward with ``inputs`` (each takes the previous one's output), then one
    whose children are all of one class. Of several such chains of repeated
    blocks (an encoder and a decoder), the one that keeps the most
    activations in a forward with ``inputs``; then a ModuleList, the most
    parameters. With ``inputs``, the model runs forward once or twice
    (gradients on for the activations; call it where RNG and running
    statistics may move, as the profiler does).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> [name for name, _ in find_candidates(model)]
        ['0', '1']
    """
    api = "remat.planner: candidates"
    names = {id(module): name for name, module in model.named_modules()}
    if candidates is not None:
        chosen = []
        for item in candidates:
            if isinstance(item, str):
                try:
                    chosen.append((item, model.get_submodule(item)))
                except AttributeError as exc:
                    raise CheckpointUsageError(f"{api}: the model has no submodule {item!r}.") from exc
            elif isinstance(item, nn.Module):
                if id(item) not in names:
                    raise CheckpointUsageError(
                        f"{api}: a {type(item).__name__} that is not part of the model was given."
                    )
                chosen.append((names[id(item)], item))
            else:
                raise CheckpointTypeError(
                    f"{api} must be submodule names or modules, got {type(item).__name__}."
                )
        if any(module is model for _, module in chosen):
            raise CheckpointUsageError(f"{api}: the root module cannot be a region; name its parts.")
        if not chosen:
            raise CheckpointUsageError(f"{api}: the list is empty; name at least one submodule.")
        return chosen
    return require_blocks(
        model, inputs=inputs, api="remat.planner", remedy="pass candidates=[...] with the submodules to plan"
    )


def compressed_options(options: Sequence[Option], formats: Sequence[str]) -> tuple[Option, ...]:
    """``options`` and, for each format, each keep or checkpoint among them keeping what it
    keeps compressed (:meth:`Option.compressed`).

    Example:
        >>> [o.name for o in compressed_options(DEFAULT_OPTIONS, ["fp8"])][3:]
        ['keep+compress:fp8', 'checkpoint+compress:fp8', 'checkpoint:save_matmuls+compress:fp8']
    """
    from remat.compression import compression  # the names are checked here, once

    for name in formats:
        compression(name, api="remat.planner: compress")
    bases = [o for o in options if o.kind in ("keep", "checkpoint") and not o.offload_inputs and o.compress is None]
    return (*options, *(base.compressed(name) for name in formats for base in bases))


def default_options(
    model: nn.Module, inputs: Sequence[Any], compile: CompileSpec | None = None
) -> tuple[Option, ...]:
    """Keep, checkpoint, checkpoint with ``save_matmuls``; on an accelerator also offload
    (every saved tensor of the region to the host) and checkpoint with offloaded inputs.

    Compiled (``compile``), also the compiler's own choices under torch's
    per-region activation memory budget (:data:`~remat.planner.data.COMPILED_BUDGETS`)
    where this torch has them (2.13 and newer): the partitioner recomputes
    the cheap fused ops of a region first, a finer choice than a region's
    policy. ``save_matmuls`` is left out where torch.compile cannot take a
    ``remat.policies`` object (before 2.9).
    """
    tensors = [t for t in tree_flatten(list(inputs))[0] if isinstance(t, Tensor)]
    tensors += list(model.parameters())
    on_accelerator = any(t.device.type not in ("cpu", "meta") for t in tensors)
    chosen = (*DEFAULT_OPTIONS, OFFLOAD, CHECKPOINT_OFFLOAD) if on_accelerator else DEFAULT_OPTIONS
    if compile is None:
        return chosen
    if not dynamo_traces_policy_objects():
        chosen = tuple(option for option in chosen if option.policy is None)
    if region_memory_budgets_available():
        chosen = (*chosen, *COMPILED_BUDGETS)
    return chosen


@contextlib.contextmanager
def _everywhere(
    regions: Sequence[tuple[str, nn.Module]], option: Option, compile: CompileSpec | None
) -> Iterator[None]:
    removers = [install(module, option, compile) for _, module in regions]
    try:
        yield
    finally:
        for remove in reversed(removers):
            remove()


@contextlib.contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Gradients, buffers (running stats) and RNG as they were before profiling."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None  # profiled steps must not accumulate into the caller's gradients
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device for p in params if p.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


@dataclass(frozen=True)
class _Loss:
    """How a profiled step computes its loss: ``loss_fn``, or the head in ``chunks`` slices."""

    loss_fn: LossFn
    head: Head | None = None
    chunks: int = 1

    def with_chunks(self, chunks: int) -> _Loss:
        return _Loss(self.loss_fn, self.head, chunks)

    def run(self, model: nn.Module, inputs: Sequence[Any], **kwargs: Any) -> None:
        run_step(model, inputs, self.loss_fn, head=self.head, chunks=self.chunks, **kwargs)


def _step(
    model: nn.Module,
    inputs: Sequence[Any],
    loss: _Loss,
    regions: Sequence[tuple[str, nn.Module]],
    recorder: StepRecorder,
) -> list[bool]:
    model.zero_grad(set_to_none=True)
    with instrumented(regions, recorder) as input_marked:
        recorder.start()
        loss.run(
            model, inputs, on_forward_end=recorder.loss_done, on_model_end=recorder.model_done
        )
        recorder.finish()
    if sorted(recorder.order) != list(range(len(regions))):
        counts = {regions[i][0]: recorder.order.count(i) for i in range(len(regions))}
        raise UnsupportedCheckpointError(
            "remat.planner: every candidate region must run exactly once per step, in a "
            f"chain; calls per region were {counts}. Pass candidates=[...] that form a chain."
        )
    return input_marked


def _tracked_step(
    model: nn.Module,
    inputs: Sequence[Any],
    loss: _Loss,
    regions: Sequence[tuple[str, nn.Module]],
    option: Option,
    compile: CompileSpec | None,
) -> tuple[StepRecorder, int, list[bool]]:
    """One measured step with every region under ``option``, after a warm-up (lazy
    init, caches; compiled, the compiles: a second step catches a recompile the
    first one's state asks for). Counted by the dispatch tracker, or by the
    allocator when compiled (compiled code allocates its buffers where no
    dispatch mode sees them)."""
    with _everywhere(regions, option, compile):
        with _compiled_as_asked(compile, option):
            for _ in range(1 if compile is None else 2):
                loss.run(model, inputs)
        device = counted_device(model)
        meter: AllocationMeter | MemoryTracker = (
            track_allocations(device, quiet=True) if compile is not None else track(device=device)
        )
        with meter:
            recorder = StepRecorder(len(regions), tracker=meter)
            input_marked = _step(model, inputs, loss, regions, recorder)
    recorder.measure()
    return recorder, meter.peak_bytes, input_marked


def _estimated_step(
    model: nn.Module,
    inputs: Sequence[Any],
    loss: _Loss,
    regions: Sequence[tuple[str, nn.Module]],
    option: Option,
    compile: CompileSpec | None,
    rates: DeviceRates,
) -> tuple[StepRecorder, int, list[bool]]:
    """One step with every region under ``option``, counted by the tracker and timed by
    the time model, its compiled regions under the static compiler: bytes and seconds
    without running a kernel."""
    compiling = statically_compiled(model) if compile is not None else contextlib.nullcontext()
    with _everywhere(regions, option, compile), _compiled_as_asked(compile, option), compiling:
        clock, tracker = ModelledClock(rates), track(device=counted_device(model))
        tracker.observe_ops(clock)  # timed by the tracker's mode: no second mode on the stack
        with tracker:
            recorder = StepRecorder(len(regions), tracker=tracker, clock=clock.seconds)
            input_marked = _step(model, inputs, loss, regions, recorder)
    recorder.measure()
    return recorder, tracker.peak_bytes, input_marked


def _boundary_bytes(
    model: nn.Module, inputs: Sequence[Any], regions: Sequence[tuple[str, nn.Module]]
) -> list[tuple[int, int]]:
    """Input and output bytes of each region, from one forward without grad."""
    sizes = [(0, 0)] * len(regions)
    handles = []
    for index, (_, module) in enumerate(regions):

        def seen(module: nn.Module, args: Any, output: Any, index: int = index) -> None:
            sizes[index] = (tensor_bytes(args), tensor_bytes(output))

        handles.append(module.register_forward_hook(seen))
    forward_with_hooks(model, inputs, handles)
    return sizes


def profile_model(
    model: nn.Module,
    inputs: Sequence[Any],
    *,
    loss_fn: LossFn = default_loss,
    candidates: Sequence[str | nn.Module] | None = None,
    options: Sequence[Option] | None = None,
    repeats: int = 3,
    head: Head | None = None,
    compile: CompileSpec | None = None,
    compress: Sequence[str] = (),
    estimate: DeviceRates | None = None,
) -> Profile:
    """Measure every candidate region under every option (see the module docstring).

    The model's gradients, buffers and RNG state are restored afterwards.
    With a ``head``, the step's loss is the head's (``loss_fn`` must be left
    out) and each of its slice counts is measured too: one tracked step and
    timed steps with every region checkpointed (``Profile.heads``).

    Args:
        model: the model; it is run ``(1 + repeats) * len(options) + 1`` times.
        inputs: positional inputs of ``model``.
        loss_fn: output -> scalar loss (default: sum of the floating outputs).
        candidates: submodule names or modules; default: the repeated blocks.
        options: what to measure; default :func:`default_options`.
        repeats: timed steps per option, at least (medians are used); up to
            three times as many while the step times still spread by more
            than 10%. Compiled, three times as many again: a compiled step
            is short beside the compile of its option.
        head: the output layer and loss, to plan in slices (see
            :class:`remat.planner.Head`).
        compile: measure every region compiled this way (as
            ``region.compile(...)`` does), each option compiled on its own,
            with the allocator's count of bytes
            (:func:`remat.memory.track_allocations`). The regions must not
            be compiled already. torch.compile's in-memory caches are reset
            when the profile is done (``torch.compiler.reset()``): the
            compiled versions of every profiled option would otherwise use
            up the versions torch keeps of one function.
        compress: formats (``"fp8"``, ``"int8"``, ...) in which the keep and
            checkpoint options are also measured keeping what they keep
            compressed (:func:`compressed_options`), each with its gradient
            error, region by region. Not with ``compile``.
        estimate: estimate instead of measuring, at these rates: one step
            per option on the tensors the model and ``inputs`` have (fake
            ones for a model too large for this machine: nothing is
            computed), counted by :func:`remat.memory.track`, compiled
            regions under :func:`remat.memory.statically_compiled`, timed by
            :class:`~remat.planner.timing.ModelledClock`. No timed steps;
            ``Profile.estimated_with`` says so. Not with ``compress`` (its
            gradient errors need data).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        >>> profile_model(model, (torch.randn(4, 8),), repeats=1).regions[1].costs["keep"].retained_bytes > 0
        True
    """
    if not isinstance(model, nn.Module):
        raise CheckpointTypeError(
            f"remat.planner: model must be an nn.Module, got {type(model).__name__}."
        )
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise CheckpointUsageError(f"remat.planner: repeats must be an int >= 1, got {repeats!r}.")
    inputs = tuple(inputs)
    loss = _Loss(loss_fn, head)
    head_chunks = _head_chunks(model, head, loss_fn)
    if compile is not None and not isinstance(compile, CompileSpec):
        raise CheckpointTypeError(
            f"remat.planner: compile must be a remat.placement.CompileSpec or None, got "
            f"{type(compile).__name__}."
        )
    chosen = _chosen_options(model, inputs, options, compile, compress, estimate)
    _check_not_compiled(model, compile)
    if compile is not None:
        warn_of_partitioner_settings("remat.planner")
    with _preserved(model), _compiling(compile, len(chosen) + len(head_chunks)):
        regions = find_candidates(model, candidates, inputs)
        if head is not None and any(name == head.module for name, _ in regions):
            raise CheckpointUsageError(
                f"remat.planner: the head {head.module!r} is also a candidate region; plan it "
                "as the head only."
            )
        sizes = _boundary_bytes(model, inputs, regions)
        # Every step variant: (regions' option, head slices). Chunked heads run
        # with every region checkpointed, against the unchunked step likewise.
        reference = CHECKPOINT if CHECKPOINT in chosen else KEEP
        variants = [(option, 1) for option in chosen]
        variants += [(reference, c) for c in head_chunks[1:]]
        memory: dict[tuple[str, int], StepRecorder] = {}
        peaks: dict[str, int] = {}
        input_marked: list[bool] = []
        for option, chunks in variants:
            step_loss = loss.with_chunks(chunks)
            if estimate is not None:
                recorder, peak, input_marked = _estimated_step(model, inputs, step_loss, regions, option, compile, estimate)
            else:
                recorder, peak, input_marked = _tracked_step(model, inputs, step_loss, regions, option, compile)
            memory[option.name, chunks] = recorder
            if chunks == 1:
                peaks[option.name] = peak
        if estimate is not None:  # the modelled clock timed the counted step: nothing to repeat
            timings = {key: [record] for key, record in memory.items()}
        else:
            timings = _timed_steps(model, inputs, loss, regions, variants, compile, repeats)
        model.zero_grad(set_to_none=True)
        errors = _gradient_errors(model, inputs, loss, regions, chosen, compile)
    profile = _assemble(
        regions, chosen, sizes,
        {o.name: memory[o.name, 1] for o in chosen},
        {o.name: timings[o.name, 1] for o in chosen},
        peaks, input_marked, inputs, compile is not None,
    )
    if estimate is not None:
        profile = dataclasses.replace(profile, estimated_with=estimate.describe())
    if errors:
        profile = _with_gradient_errors(profile, errors)
    if len(head_chunks) < 2:
        return profile
    return dataclasses.replace(
        profile, heads=_head_costs(head_chunks, reference.name, memory, timings)
    )


def _chosen_options(
    model: nn.Module,
    inputs: tuple[Any, ...],
    options: Sequence[Option] | None,
    compile: CompileSpec | None,
    compress: Sequence[str],
    estimate: DeviceRates | None,
) -> tuple[Option, ...]:
    """The options to measure: as given (or the defaults), with their compressed twins
    for ``compress``, and always the unchecked step (the reference for fractions)."""
    chosen = tuple(options) if options is not None else default_options(model, inputs, compile)
    if compress:
        if compile is not None:
            raise UnsupportedCheckpointError(
                "remat.planner: compress and compile do not combine: a compiled region's saved "
                "tensors are the compiler's, which cannot keep them compressed. Plan compression "
                "eagerly, or compiled without compress (docs/design/compression.md)."
            )
        if estimate is not None:
            raise UnsupportedCheckpointError(
                "remat.planner: compress needs measured steps (its gradient errors are computed on "
                "data); plan compression without estimate=."
            )
        chosen = compressed_options(chosen, compress)
    if KEEP not in chosen:
        chosen = (KEEP, *chosen)
    if len({o.name for o in chosen}) != len(chosen):
        raise CheckpointUsageError(f"remat.planner: options repeat a name: {[o.name for o in chosen]}.")
    return chosen


def _timed_steps(
    model: nn.Module,
    inputs: tuple[Any, ...],
    loss: _Loss,
    regions: Sequence[tuple[str, nn.Module]],
    variants: Sequence[tuple[Option, int]],
    compile: CompileSpec | None,
    repeats: int,
) -> dict[tuple[str, int], list[StepRecorder]]:
    """Timed steps of every variant, in rotating rounds: at least ``repeats`` rounds
    (three times as many compiled), more (up to 3x) while any variant's step times
    still spread widely (docs/design/planner.md, "Noise")."""
    device_sync = torch.cuda.synchronize if any(
        p.device.type == "cuda" for p in model.parameters()
    ) else None
    timings: dict[tuple[str, int], list[StepRecorder]] = {(o.name, c): [] for o, c in variants}
    rounds = repeats if compile is None else _COMPILED_ROUNDS_FACTOR * repeats
    round_ = 0
    while round_ < rounds or (round_ < _MAX_ROUNDS_FACTOR * rounds and _noisy(timings)):
        shift = round_ % len(variants)  # rotate so drift in load hits every option alike
        for option, chunks in (*variants[shift:], *variants[:shift]):
            with _everywhere(regions, option, compile):
                recorder = StepRecorder(len(regions), sync=device_sync)
                _step(model, inputs, loss.with_chunks(chunks), regions, recorder)
            timings[option.name, chunks].append(recorder)
        round_ += 1
    return timings


def _with_gradient_errors(profile: Profile, errors: dict[tuple[int, str], float]) -> Profile:
    """``profile`` with each region's measured gradient error under each compressing option."""
    return dataclasses.replace(profile, regions=tuple(
        dataclasses.replace(region, costs={
            name: dataclasses.replace(cost, gradient_error=errors.get((index, name), 0.0))
            for name, cost in region.costs.items()
        })
        for index, region in enumerate(profile.regions)
    ))


def _gradient_errors(
    model: nn.Module,
    inputs: Sequence[Any],
    loss: _Loss,
    regions: Sequence[tuple[str, nn.Module]],
    options: Sequence[Option],
    compile: CompileSpec | None,
) -> dict[tuple[int, str], float]:
    """Per (region, compressing option): the relative gradient error of that region alone
    under the option, the other regions kept (``docs/design/planner.md``, "Gradient error").

    Every step starts from the same RNG state (dropout draws the same masks),
    so what differs from the kept step is the compression alone.
    """
    compressing = [option for option in options if option.compress is not None]
    if not compressing:
        return {}
    parameters = [p for p in model.parameters() if p.requires_grad]
    start = _rng_states()

    def gradients() -> Tensor:
        _set_rng_states(start)
        model.zero_grad(set_to_none=True)
        loss.run(model, inputs)
        return torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
            for p in parameters
        ])

    reference = gradients()
    norm = float(reference.norm()) or 1.0
    errors = {}
    for option in compressing:
        for index, (_, module) in enumerate(regions):
            remove = install(module, option, compile)
            try:
                errors[index, option.name] = float((gradients() - reference).norm()) / norm
            finally:
                remove()
    model.zero_grad(set_to_none=True)
    return errors


def _rng_states() -> tuple[Tensor, list[Tensor]]:
    devices = torch.cuda.get_rng_state_all() if device_is_initialized(torch.cuda) else []
    return torch.get_rng_state(), devices


def _set_rng_states(states: tuple[Tensor, list[Tensor]]) -> None:
    torch.set_rng_state(states[0])
    if states[1]:
        torch.cuda.set_rng_state_all(states[1])


@contextlib.contextmanager
def _compiling(compile: CompileSpec | None, versions: int) -> Iterator[None]:
    """Room for a compiled version of every option while profiling, none left after."""
    if compile is None:
        yield
        return
    try:
        with compile_cache_room(versions + _COMPILED_VERSIONS_SPARE):
            yield
    finally:
        # Every option profiled left a compiled version of the regions' call
        # behind, and torch keeps only a few per function: the user's own
        # compiles would run out of room (recompile limit). The disk caches
        # keep the graphs, so compiling the chosen options again is quick.
        torch.compiler.reset()


_COMPILED_VERSIONS_SPARE = 8
"""Versions beyond one per option: a region that recompiles once (a guard on
its first call's state), the prefix and suffix if the user compiled them."""


@contextlib.contextmanager
def _compiled_as_asked(compile: CompileSpec | None, option: Option) -> Iterator[None]:
    """torch.compile's refusal to compile a region, as the planner's error."""
    if compile is None:
        yield
        return
    try:
        yield
    except compile_errors() as error:
        first = _gist(error)
        if isinstance(error, graph_break_errors()):
            raise UnsupportedCheckpointError(
                f"remat.planner: the regions do not compile as {compile} asks (option "
                f"{option.name!r}): a graph break, {type(error).__name__}: {first}. Fix what "
                "torch.compile names, or plan with compile=CompileSpec(fullgraph=False); the "
                "model is left as it was."
            ) from error
        raise UnsupportedCheckpointError(
            f"remat.planner: torch.compile failed on the regions as {compile} asks (option "
            f"{option.name!r}): {type(error).__name__}: {first}. This is the compiler failing, "
            "not a graph break: try another backend or mode in the CompileSpec, or leave this "
            "option out of options=; the model is left as it was."
        ) from error


def _gist(error: BaseException) -> str:
    """The first line of an error's message, and the next one when the first only introduces it
    (``backend='inductor' raised:``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def _check_not_compiled(model: nn.Module, compile: CompileSpec | None) -> None:
    compiled = [name or "the model" for name, module in model.named_modules() if compiled_call(module) is not None]
    if not compiled:
        return
    hint = (
        "pass compile=True (or a CompileSpec) to plan: it compiles each region as it profiles "
        "it, and Plan.apply compiles them the same way"
        if compile is None
        else "plan first: the planner compiles each region itself (compile=...), and so does "
        "Plan.apply"
    )
    raise CheckpointUsageError(
        f"remat.planner: {compiled} compiled already (module.compile()); {hint}."
    )


def _head_chunks(model: nn.Module, head: Head | None, loss_fn: LossFn) -> tuple[int, ...]:
    """The head's slice counts to measure (``()`` without a head)."""
    if head is None:
        return ()
    if not isinstance(head, Head):
        raise CheckpointTypeError(
            f"remat.planner: head must be a remat.planner.Head, got {type(head).__name__}."
        )
    if loss_fn is not default_loss:
        raise CheckpointUsageError(
            "remat.planner: pass loss_fn= or head=, not both; with a head the loss is the "
            "head's (Head(..., loss=...))."
        )
    try:
        model.get_submodule(head.module)
    except AttributeError as exc:
        raise CheckpointUsageError(
            f"remat.planner: Head names {head.module!r} but the model has no such submodule."
        ) from exc
    return head.chunk_options(head.positions())


def _suffix(record: StepRecorder) -> tuple[int, int, float]:
    """Tail peak and bytes at the blocks' backward start (above the last forward's end), time."""
    end = record.forward[-1].end_bytes
    tail = record.suffix_high - end
    return tail, record.backward[-1].start_bytes - end, (
        record.suffix_forward.seconds + record.suffix_backward.seconds
    )


def _group_shared_inputs(memory: dict[str, StepRecorder]) -> tuple[SharedInput, ...]:
    """The shared inputs of the profiled steps, grouped by takers and the options that keep them.

    Each step made its own copies; the n-th tensor of the same bytes and
    takers is the same input in every step (the prefix runs the same ops).
    """
    kept_under: dict[tuple[tuple[int, ...], int, int], list[str]] = {}
    for name, record in memory.items():
        seen: dict[tuple[tuple[int, ...], int], int] = {}
        for takers, nbytes, held in record.shared:
            nth = seen[takers, nbytes] = seen.get((takers, nbytes), -1) + 1
            options = kept_under.setdefault((takers, nbytes, nth), [])
            if held:
                options.append(name)
    groups: dict[tuple[tuple[int, ...], tuple[str, ...]], int] = {}
    for (takers, nbytes, _), names in kept_under.items():
        key = (takers, tuple(names))
        groups[key] = groups.get(key, 0) + nbytes
    return tuple(
        SharedInput(nbytes, takers, names)
        for (takers, names), nbytes in groups.items()
        if names  # kept by no option: gone with the model's forward whatever the plan
    )


def _after_model(records: Sequence[StepRecorder]) -> int | None:
    """Highest point of the suffix once the model's forward returned, above the last forward's end."""
    rises = []
    for record in records:
        if record.suffix_after_model_high is None:
            return None
        rises.append(record.suffix_after_model_high - record.forward[-1].end_bytes)
    return max(rises)


def _head_costs(
    chunk_counts: tuple[int, ...],
    reference: str,
    memory: dict[tuple[str, int], StepRecorder],
    timings: dict[tuple[str, int], list[StepRecorder]],
) -> tuple[HeadCost, ...]:
    """Each slice count's shifts against the unchunked head, measured with the same regions.

    A chunked head does the unchunked head's work and recomputes its
    forward, so a faster reading is noise: its time is floored at the
    unchunked head's (docs/design/planner.md, "The head").
    """
    base_tail, base_start, _ = _suffix(memory[reference, 1])
    base_time = _median([_suffix(run)[2] for run in timings[reference, 1]])
    costs = []
    for chunks in chunk_counts:
        tail, start, _ = _suffix(memory[reference, chunks])
        seconds = _median([_suffix(run)[2] for run in timings[reference, chunks]])
        costs.append(
            HeadCost(
                chunks=chunks,
                tail_peak_shift_bytes=tail - base_tail,
                backward_start_shift_bytes=start - base_start,
                time_s=base_time if chunks == 1 else max(seconds, base_time),
            )
        )
    return tuple(costs)


def _twins(regions: Sequence[tuple[str, nn.Module]], sizes: list[tuple[int, int]]) -> list[int]:
    """For each region, the index of the first region identical to it.

    Identical: same class, same parameter shapes and dtypes, same boundary
    bytes in and out (the same input shapes, in practice). Such blocks do
    the same work, so they share one measured cost.
    """
    first: dict[tuple[Any, ...], int] = {}
    twins = []
    for index, (_, module) in enumerate(regions):
        signature = (
            type(module).__qualname__,
            tuple((tuple(p.shape), p.dtype) for p in module.parameters()),
            sizes[index],
        )
        twins.append(first.setdefault(signature, index))
    return twins


_RECOMPUTE_FLOOR = 0.5
"""Least price of a full recomputation, as a fraction of the kept forward phase."""
_MAX_ROUNDS_FACTOR = 3
_COMPILED_ROUNDS_FACTOR = 3
"""Timed rounds of a compiled profile per ``repeats``: its options differ by a
few percent, and its steps are short beside the compiles."""
_SPREAD = 0.10
"""Largest spread of an option's step times, (max - min) / median, taken as settled."""


def _noisy(timings: dict[Any, list[StepRecorder]]) -> bool:
    """Whether some option's timed steps still differ by more than ``_SPREAD``."""
    for runs in timings.values():
        steps = [run.step_end_s - run.step_start_s for run in runs]
        if len(steps) < 2:
            continue
        middle = statistics.median(steps)
        if middle > 0 and (max(steps) - min(steps)) / middle > _SPREAD:
            return True
    return False


def _release(label: str) -> Literal["own", "next", "other"]:
    return "own" if label == "own" else "next" if label == "next" else "other"


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _shared_times(
    regions: Sequence[tuple[str, nn.Module]],
    options: tuple[Option, ...],
    sizes: list[tuple[int, int]],
    timings: dict[str, list[StepRecorder]],
    compiled: bool,
) -> list[dict[str, float]]:
    """Each region's time per option, as the cost model should see it.

    Identical blocks share one time: the median over every timed step and
    every one of them, so one noisy measurement (a block priced 33 ms beside
    twins at 4-5 ms) cannot steer the solver. Eagerly no option is priced
    below keeping, and full recomputation not below keeping plus half of the
    forward it reruns: a checkpoint does all of keep's work and then some,
    so a faster reading is noise (docs/design/planner.md, "Noise"). Compiled
    (``compiled``), only full recomputation keeps its floor: the compiler's
    partial recomputation can be faster than keeping (it writes and reads
    fewer saved bytes), so a selective or budget option is priced as measured.
    """
    twins = _twins(regions, sizes)
    groups: dict[int, list[int]] = {}
    for index, first in enumerate(twins):
        groups.setdefault(first, []).append(index)
    times: list[dict[str, float]] = [{} for _ in regions]
    keep_forward: list[float] = [0.0] * len(regions)
    for members in groups.values():
        for option in options:
            samples = [
                run.forward[i].seconds + run.backward[i].seconds
                for run in timings[option.name]
                for i in members
            ]
            for i in members:
                times[i][option.name] = _median(samples)
        forward = _median([run.forward[i].seconds for run in timings[KEEP.name] for i in members])
        for i in members:
            keep_forward[i] = forward
    for index, per_option in enumerate(times):
        keep = per_option[KEEP.name]
        for option in options:
            # Full recomputation runs the forward again. Not the whole measured
            # forward phase, which also pays first allocations and hooks: the
            # recompute cost 0.6-1.3x of it (MLP chain, conv net, GPT on CPU).
            # Half is a floor against noise, not an estimate. Selective and
            # offload: at least keeping.
            full = option.kind == "checkpoint" and option.policy is None
            if full:
                floor = keep + _RECOMPUTE_FLOOR * keep_forward[index]
            else:
                floor = 0.0 if compiled else keep
            per_option[option.name] = max(per_option[option.name], floor)
    return times


def _assemble(
    regions: Sequence[tuple[str, nn.Module]],
    options: tuple[Option, ...],
    sizes: list[tuple[int, int]],
    memory: dict[str, StepRecorder],
    timings: dict[str, list[StepRecorder]],
    peaks: dict[str, int],
    input_marked: list[bool],
    inputs: Sequence[Any],
    compiled: bool,
) -> Profile:
    costs: list[dict[str, OptionCost]] = [{} for _ in regions]
    times = _shared_times(regions, options, sizes, timings, compiled)
    for option in options:
        record = memory[option.name]
        for index in range(len(regions)):
            forward, backward = record.forward[index], record.backward[index]
            costs[index][option.name] = OptionCost(
                retained_bytes=forward.end_bytes - forward.start_bytes,
                forward_peak_bytes=forward.high_bytes - forward.start_bytes,
                backward_peak_bytes=backward.high_bytes - backward.start_bytes,
                backward_delta_bytes=backward.end_bytes - backward.start_bytes,
                time_s=times[index][option.name],
                output_release=_release(record.released.get(index, "other")),
                backward_peak_after_input_free_bytes=(
                    None
                    if backward.high_after_input_free is None
                    else backward.high_after_input_free - backward.start_bytes
                ),
            )
    records = list(memory.values())
    keep_runs = timings[KEEP.name]
    in_regions = [
        sum(r.forward[i].seconds + r.backward[i].seconds for i in range(len(regions)))
        for r in keep_runs
    ]
    steps = [r.step_end_s - r.step_start_s for r in keep_runs]
    return Profile(
        key=input_key(inputs),
        options=options,
        regions=tuple(
            RegionCost(name, sizes[i][0], sizes[i][1], costs[i])
            for i, (name, _) in enumerate(regions)
        ),
        prefix_bytes=max(r.forward[0].start_bytes for r in records),
        tail_peak_bytes=max(_suffix(r)[0] for r in records),
        tail_after_model_bytes=_after_model(records),
        shared_input_bytes=max(sum(nbytes for _, nbytes, _ in r.shared) for r in records),
        shared_inputs=_group_shared_inputs(memory),
        backward_start_bytes={name: _suffix(r)[1] for name, r in memory.items()},
        prefix_backward_peak_bytes=max(
            r.prefix_backward.high_bytes - r.prefix_backward.start_bytes if input_marked[0] else 0
            for r in records
        ),
        other_time_s=max(0.0, _median([s - t for s, t in zip(steps, in_regions, strict=True)])),
        unchecked_peak_bytes=peaks[KEEP.name],
        unchecked_step_s=_median(steps),
        step_noise_s=_step_noise(regions, options, sizes, timings),
    )


def _step_noise(
    regions: Sequence[tuple[str, nn.Module]],
    options: tuple[Option, ...],
    sizes: list[tuple[int, int]],
    timings: dict[str, list[StepRecorder]],
) -> float:
    """The standard error of a plan's predicted step time (docs/design/planner.md, "Ties").

    A region's time under an option is the median of ``m`` samples (timed
    rounds x identical blocks, as :func:`_shared_times` takes them); its
    standard error is about ``1.86 * MAD / sqrt(m)`` (a median's, 1.2533
    sigma / sqrt(m), with 1.4826 MAD standing for sigma: one stalled round
    does not inflate it). Identical blocks share that median, so their
    errors add; distinct groups' errors are independent and add in
    quadrature. Per group, the median over the options. The time outside
    the regions is the same for every plan and left out. 0.0 where no time
    was sampled twice (one round of distinct blocks, or a time model).
    """
    twins = _twins(regions, sizes)
    groups: dict[int, list[int]] = {}
    for index, first in enumerate(twins):
        groups.setdefault(first, []).append(index)
    variance = 0.0
    for members in groups.values():
        errors = []
        for option in options:
            samples = [
                run.forward[i].seconds + run.backward[i].seconds
                for run in timings[option.name]
                for i in members
            ]
            if len(samples) < 2:
                continue
            middle = statistics.median(samples)
            spread = statistics.median(abs(sample - middle) for sample in samples)
            errors.append(_MEDIAN_ERROR * spread / math.sqrt(len(samples)))
        if errors:
            variance += (len(members) * _median(errors)) ** 2
    return math.sqrt(variance)


_MEDIAN_ERROR = 1.2533 * 1.4826
"""Standard error of a median of m normal samples, 1.2533 sigma / sqrt(m), per unit of
median absolute deviation (sigma = 1.4826 MAD)."""
