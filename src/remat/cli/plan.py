"""``remat plan``: plan the embedded GPT (or a model of yours) under a budget, apply, measure.

Layer: ``remat.cli`` (the application), above the model loader.

``remat plan --budget 50%`` profiles the embedded GPT, prints the plan,
applies it and prints predicted versus measured peak and step time;
``--save plan.toml`` writes it for :func:`remat.apply_config`. With
``--world-size N`` (and ``--fsdp`` / ``--tp K``) it plans sharded training:
N local processes (CPU, gloo) shard the model as asked, profile together,
agree on one plan (the budget is per rank) and measure it on every rank.
With ``--estimate DEVICE`` (chosen by itself, with this machine's rates,
for a model too large to profile here) nothing runs: the model is built on
fake tensors (sharded on one simulated rank with ``--world-size``), each
option's step is estimated (compiled ones as the compiler decides) and timed
by a time model at the device's rates (:mod:`remat.planner.timing`); with
``--measure`` the estimated plan is also set beside the measured plan here.
The model is read as by every ``remat`` command (:mod:`remat.cli.arguments`).

Example:
    >>> from remat.cli import main
    >>> main(["plan", "--budget", "60%", "--layers", "2", "--seq", "32", "--batch", "2",
    ...       "--repeats", "1", "--steps", "1"])   # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat._compat.dynamo import compile_cache_room
from remat._compat.fake import fake_tensor_mode
from remat.cli.arguments import (
    add_model_arguments,
    add_sharding_arguments,
    model_request,
    sharding_from,
)
from remat.cli.console import add_quiet_argument, check_writable, progress, progress_wanted
from remat.cli.loader import LoadedModel, ModelRequest, load_model
from remat.cli.pipelined import PipelineCase, add_pipeline_arguments, pipeline_from
from remat.compression import FORMATS, compression
from remat.errors import CheckpointUsageError
from remat.launch import run_on_ranks
from remat.memory import Pipeline, Sharding, format_bytes, shard_model, simulated_rank
from remat.memory._render import format_table
from remat.models import GPT_TP_PLAN, GPTConfig
from remat.planner._planner import Planner
from remat.planner.budget import Budget
from remat.planner.head import Head
from remat.planner.pipeline import PipelinePlanner
from remat.planner.render import render_measurement, render_pareto_plot
from remat.planner.result import Plan
from remat.planner.step import LossFn, default_loss, run_step
from remat.planner.timing import DEVICES, DeviceRates

__all__ = ["add_arguments", "measure_step", "plan_on_rank", "run"]

HELP = "plan checkpointing under a memory budget, apply it and measure it"
DESCRIPTION = (
    "Find the fastest checkpoint plan that fits a memory budget, apply it and compare "
    "predicted with measured peak memory and step time. An unreachable budget exits 2."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``remat plan``."""
    parser.add_argument("--budget", default="50%",
                        help="bytes ('300MiB', '6GiB', 1000000) or a percentage of the unchecked "
                        "peak ('50%%'; default 50%%)")
    add_model_arguments(parser)
    parser.add_argument("--solver", default="auto", choices=["auto", "dp", "milp", "greedy", "enumerate"])
    parser.add_argument("--layers", type=int, default=12, help="embedded GPT: blocks (default 12)")
    parser.add_argument("--d-model", type=int, default=64, help="embedded GPT: width (default 64)")
    parser.add_argument("--seq", type=int, default=128,
                        help="sequence length of the embedded GPT and --hf-config (default 128)")
    parser.add_argument("--batch", type=int, default=4,
                        help="batch size of the built-in models and --hf-config (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed profiling steps per option")
    parser.add_argument("--steps", type=int, default=3, help="measured steps with the plan applied")
    parser.add_argument("--head", action="store_true",
                        help="also plan the output layer and loss in slices (reaches budgets "
                        "below checkpointing every block; the embedded GPT and --hf-config)")
    parser.add_argument("--compile", action="store_true",
                        help="plan for blocks compiled one by one (fullgraph=True, inductor), as "
                        "torchtitan compiles them: every option is measured compiled, with the "
                        "allocator's count of bytes, and the plan compiles its blocks when applied "
                        "(and records it with --save)")
    parser.add_argument("--compress", default=None, metavar="FORMATS",
                        help="also offer keeping what a block keeps compressed, in these formats "
                        f"(comma-separated: {', '.join(FORMATS)}); needs --max-gradient-error")
    parser.add_argument("--max-gradient-error", type=float, default=None, metavar="E",
                        help="with --compress: the largest relative gradient error the plan may "
                        "have (e.g. 0.02); the plan's error is measured too")
    parser.add_argument("--estimate", default=None, metavar="DEVICE", choices=["here", *sorted(DEVICES)],
                        help="plan without running the model: bytes estimated on fake tensors "
                        "(compiled blocks as the compiler decides), times modelled at DEVICE's "
                        f"rates ({', '.join(sorted(DEVICES))}: datasheet; here: measured on this "
                        "machine). Chosen by itself, with 'here', for a model too large to "
                        "profile on this machine")
    parser.add_argument("--measure", action="store_true",
                        help="with --estimate (one process): also plan the model measured here at "
                        "the same budget, run both plans and compare them")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="with --estimate: also write the plan's figures (and with --measure both "
                        "plans' measured ones) as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="write the memory-time Pareto plot (needs matplotlib)")
    parser.add_argument("--save", default=None, metavar="PLAN.toml",
                        help="write the plan as TOML; remat.apply_config(model, "
                        "remat.config_from_toml(PATH)) applies it on any rank or machine")
    add_sharding_arguments(
        parser,
        "plan for N ranks: N local CPU processes (gloo) shard the model, profile together and "
        "agree on one plan; --budget is per rank",
    )
    add_pipeline_arguments(
        parser,
        "one plan for pipelined training: each rank's blocks checkpointed as its own peak needs "
        "(the first ones fully, the next with save_matmuls, the rest kept), every rank within "
        "--budget (per rank; a percentage is of the largest rank's unchecked peak), chosen from "
        "ranks simulated on fake tensors and times modelled at --estimate's rates (default h100); "
        "--measure also runs the plan on local gloo processes",
    )
    add_quiet_argument(parser)


class _WithKeywords(nn.Module):
    """Runs ``model(*args, **kwargs)`` with the factory's keyword inputs bound.

    The planner calls ``model(*inputs)``; a factory may return keyword inputs too.
    """

    def __init__(self, model: nn.Module, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.kwargs = kwargs

    def forward(self, *args: Any) -> Any:
        return self.model(*args, **self.kwargs)


def _user_model(loaded: LoadedModel) -> tuple[nn.Module, tuple[Any, ...], LossFn]:
    """The loaded model as the planner calls it (``model(*inputs)``, keyword inputs bound),
    its positional inputs and its loss."""
    model = _WithKeywords(loaded.model, loaded.kwargs) if loaded.kwargs else loaded.model
    return model, loaded.args, loaded.loss_fn or default_loss


def _head(loaded: LoadedModel, model: nn.Module) -> Head:
    if loaded.head is None:
        raise CheckpointUsageError(
            "remat plan: --head needs a model whose output layer and targets are known: the "
            "embedded GPT or --hf-config. For a model of yours use remat.planner.Head in Python."
        )
    name, targets = loaded.head
    # The keyword wrapper puts the user's model under "model".
    return Head(name if model is loaded.model else f"model.{name}", targets)


def _request(args: argparse.Namespace) -> ModelRequest:
    gpt = GPTConfig(
        n_layers=args.layers, d_model=args.d_model, seq_len=args.seq,
        n_heads=4 if args.d_model % 4 == 0 else 1, d_ff=4 * args.d_model,
    )
    return model_request(args, "remat plan", gpt=gpt)


def measure_step(
    plan: Plan, model: nn.Module, inputs: Sequence[Any], loss_fn: LossFn, steps: int
) -> tuple[int, float]:
    """The plan's measured peak (:meth:`Plan.verify`), and the median time of ``steps``
    steps with the plan applied."""
    peak = plan.verify(model, tuple(inputs), loss_fn=loss_fn)
    times = []
    with plan.apply(model):
        for _ in range(steps + 1):  # the first step warms up (a compiled plan's compiles)
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            run_step(model, inputs, loss_fn, head=plan.head, chunks=plan.head_chunks)
            times.append(time.perf_counter() - started)
        del times[0]
    model.zero_grad(set_to_none=True)
    return peak, statistics.median(times)


@dataclasses.dataclass(frozen=True)
class _RankJob:
    """What every rank of ``remat plan --world-size N`` does (pickled to the ranks)."""

    request: ModelRequest
    sharding: Sharding
    budget: Budget
    solver: str
    repeats: int
    steps: int
    head: bool
    compile: bool = False
    compress: tuple[str, ...] = ()
    max_gradient_error: float | None = None


def plan_on_rank(job: _RankJob) -> tuple[Plan, int, float]:
    """One rank of a sharded ``remat plan``: shard, plan together, measure the plan here.

    Every rank builds the same model (same seed), shards it, profiles in
    step with the others and gets the plan every rank agreed on; it returns
    that plan and its own measured peak and step time.
    """
    loaded = load_model(job.request)
    model, inputs, loss_fn = _user_model(loaded)
    head = _head(loaded, model) if job.head else None
    shard_model(loaded.model, job.sharding, tp_plan=GPT_TP_PLAN if loaded.builtin_gpt else None)
    planner = Planner(
        model, loss_fn=default_loss if head is not None else loss_fn, head=head, repeats=job.repeats,
        compile=job.compile, compress=job.compress or None, max_gradient_error=job.max_gradient_error,
    )
    chosen = planner.plan(inputs, budget=job.budget, solver=job.solver, verify=True)  # type: ignore[arg-type]  # solver: an argparse choice
    peak, step_s = measure_step(chosen, model, inputs, loss_fn, job.steps)
    return chosen, peak, step_s


def _run_sharded(args: argparse.Namespace, sharding: Sharding, budget: Budget) -> int:
    if args.plot:
        raise CheckpointUsageError("remat plan: --plot plans one process; drop it with --world-size.")
    job = _RankJob(
        _request(args), sharding, budget, args.solver, args.repeats, args.steps, args.head, args.compile,
        _formats(args), args.max_gradient_error,
    )
    with progress(1, "remat plan", enabled=progress_wanted(args.quiet)) as tick:
        results: list[tuple[Plan, int, float]] = run_on_ranks(
            sharding.world_size, "remat.cli.plan:plan_on_rank", job
        )
        tick()
    chosen = results[0][0]
    assert all(plan.decisions == chosen.decisions for plan, _, _ in results), (
        "remat bug: the ranks of a sharded plan disagree"
    )
    print(f"model: {load_model(dataclasses.replace(job.request, device='meta')).title}")
    print(f"{sharding.describe()}; budget per rank")
    print(chosen.report())
    print()
    rows = [
        (str(rank), format_bytes(chosen.predicted_peak_bytes), format_bytes(peak),
         f"{1e3 * chosen.predicted_step_s:.1f}", f"{1e3 * step_s:.1f}",
         "yes" if peak <= chosen.budget_bytes else "NO")
        for rank, (_, peak, step_s) in enumerate(results)
    ]
    header = ("rank", "predicted peak", "measured peak", "predicted ms", "measured ms", "within budget")
    print(format_table(header, rows))
    over = [rank for rank, (_, peak, _) in enumerate(results) if peak > chosen.budget_bytes]
    print("within budget on every rank" if not over else f"OVER BUDGET on ranks {over}")
    if args.save:
        print(f"plan written to {chosen.save(args.save)}")
    return 0


_PROFILE_BYTES_PER_PARAMETER = 16
"""What profiling holds per parameter at least: the parameter, its gradient and
AdamW's two moments in float32."""


def _run_pipelined(args: argparse.Namespace, pipeline: Pipeline, budget: Budget) -> int:
    """``remat plan --pipeline S``: one choice per rank, from simulated ranks."""
    if args.save:
        check_writable(args.save, "--save", "remat plan")
    case = PipelineCase(_request(args), "none", pipeline)
    rates = _rates(args.estimate or "h100")
    with progress(1, "remat plan", enabled=progress_wanted(args.quiet)) as tick:
        chosen = PipelinePlanner(case.build, pipeline=pipeline, rates=rates).plan(budget)
        tick("simulated ranks")
    print(f"model: {load_model(dataclasses.replace(case.request, device='meta')).title}")
    print(chosen.report())
    if args.measure:
        measured = dataclasses.replace(case, regions=tuple(chosen.regions.items())).measure()
        rows = [(str(r.rank), format_bytes(r.peak_bytes), format_bytes(m.peak_bytes),
                 "yes" if m.peak_bytes <= chosen.budget_bytes else "NO")
                for r, m in zip(chosen.ranks, measured, strict=True)]
        print()
        print("measured on local CPU processes (gloo):")
        print(format_table(("rank", "simulated peak", "measured peak", "within budget"), rows))
    if args.save:
        print(f"plan written to {chosen.save(args.save)}")
    return 0


def _too_large_to_profile(request: ModelRequest) -> str | None:
    """Why the model cannot be profiled on this machine, or None when it can: its
    parameters, gradients and optimizer state alone would not fit in host memory."""
    loaded = load_model(dataclasses.replace(request, device="meta"))  # nothing allocated
    count = sum(p.numel() for p in loaded.model.parameters())
    needed = count * _PROFILE_BYTES_PER_PARAMETER
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed <= host:
        return None
    return (
        f"{loaded.title} needs at least {format_bytes(needed)} to profile (parameters, gradients "
        f"and AdamW state), this machine has {format_bytes(host)}"
    )


def _rates(name: str) -> DeviceRates:
    if name != "here":
        return DeviceRates.named(name)
    return DeviceRates.measure("cuda" if torch.cuda.is_available() else "cpu")


def _run_estimated(
    args: argparse.Namespace, request: ModelRequest, sharding: Sharding | None, budget: Budget
) -> int:
    """``remat plan --estimate DEVICE``: plan on fake tensors (one simulated rank when sharded)."""
    if args.compress is not None:
        raise CheckpointUsageError(
            "remat plan: --compress needs measured gradient errors; drop --estimate to plan compression."
        )
    if args.measure and sharding is not None:
        raise CheckpointUsageError(
            "remat plan: --measure runs the model in this process; to compare sharded plans, run "
            "remat plan --world-size N without --estimate (it measures on every rank)."
        )
    rates = _rates(args.estimate)
    fake_request = dataclasses.replace(request, device="fake")

    def build() -> tuple[nn.Module, LoadedModel]:
        loaded = load_model(fake_request)
        return loaded.model, loaded

    started = time.perf_counter()
    with progress(2 if args.measure else 1, "remat plan", enabled=progress_wanted(args.quiet)) as tick:
        if sharding is None:
            fake = fake_tensor_mode()
            with fake:
                _, loaded = build()
                chosen = _estimated_plan(args, loaded, budget, rates)
        else:
            tp_plan = GPT_TP_PLAN if request.builtin_gpt else None
            with simulated_rank(build, sharding=sharding, tp_plan=tp_plan, api="remat plan") as (_, loaded):
                chosen = _estimated_plan(args, loaded, budget, rates)
        elapsed_s = time.perf_counter() - started
        tick("planning and measuring here" if args.measure else "")
        compared, measured_json = _compare_with_measured(args, request, chosen) if args.measure else (None, None)
        pareto = chosen.pareto() if args.plot else None
        tick()
    print(f"model: {loaded.title}")
    if sharding is not None:
        print(f"{sharding.describe()}; budget per rank; one simulated rank stands for all")
    print(f"planned from estimates in {elapsed_s:.1f} s (nothing ran: fake tensors, modelled times)")
    print(chosen.report())
    if compared is not None:
        print()
        print(compared)
    if args.plot and pareto is not None:
        render_pareto_plot(pareto, args.plot, chosen=chosen)
        print(f"Pareto plot written to {args.plot}")
    if args.save:
        print(f"plan written to {chosen.save(args.save)}")
    if args.json is not None:
        payload: dict[str, Any] = {"estimated": _plan_json(chosen), "elapsed_s": round(elapsed_s, 3)}
        if measured_json is not None:
            payload.update(measured_json)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def _plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "decisions": _choices(plan),
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_step_s": plan.predicted_step_s,
        "unchecked_peak_bytes": plan.unchecked_peak_bytes,
        "estimated_with": plan.estimated_with,
    }


def _estimated_plan(args: argparse.Namespace, loaded: LoadedModel, budget: Budget, rates: DeviceRates) -> Plan:
    model, inputs, loss_fn = _user_model(loaded)
    head = _head(loaded, model) if args.head else None
    planner = Planner(
        model, loss_fn=default_loss if head is not None else loss_fn, head=head,
        compile=args.compile, estimate=rates,
    )
    return planner.plan(inputs, budget=budget, solver=args.solver)


def _compare_with_measured(
    args: argparse.Namespace, request: ModelRequest, estimated: Plan
) -> tuple[str, dict[str, Any]]:
    """The estimated plan beside the plan measured here at the same budget in bytes: both
    run on the real model, their peaks and step times (interleaved steps, medians)."""
    loaded = load_model(request)
    model, inputs, loss_fn = _user_model(loaded)
    head = _head(loaded, model) if args.head else None
    planner = Planner(
        model, loss_fn=default_loss if head is not None else loss_fn, head=head,
        repeats=args.repeats, compile=args.compile,
    )
    measured = planner.plan(inputs, budget=estimated.budget_bytes, solver=args.solver)
    plans = {"estimated": estimated, "measured": measured}
    peaks, times = _run_side_by_side(plans, model, inputs, loss_fn, args.steps)
    ratios = [e / m for e, m in zip(times["estimated"], times["measured"], strict=True)]
    rows = [
        (name, ", ".join(_choices(plan)), format_bytes(plan.predicted_peak_bytes),
         format_bytes(peaks[name]), "yes" if peaks[name] <= plan.budget_bytes else "NO",
         f"{1e3 * plan.predicted_step_s:.2f}", f"{1e3 * statistics.median(times[name]):.2f}")
        for name, plan in plans.items()
    ]
    header = ("plan", "decisions", "predicted peak", "measured peak", "within budget", "predicted ms", "measured ms")
    same = "same decisions" if _choices(estimated) == _choices(measured) else "different decisions"
    summary = (
        f"step time, estimated plan / measured plan: {statistics.median(ratios):.3f} (median of "
        f"{len(ratios)} interleaved steps; {same})"
    )
    payload = {
        "measured": _plan_json(measured),
        "run": {
            name: {"peak_bytes": peaks[name], "step_s": statistics.median(times[name])} for name in plans
        },
        "step_time_ratio": statistics.median(ratios),
    }
    return format_table(header, rows) + "\n" + summary, payload


def _choices(plan: Plan) -> list[str]:
    return [decision.option.name for decision in plan.decisions]


def _run_side_by_side(
    plans: Mapping[str, Plan], model: nn.Module, inputs: Sequence[Any], loss_fn: LossFn, steps: int
) -> tuple[dict[str, int], dict[str, list[float]]]:
    """Each plan's measured peak (:meth:`Plan.verify`) and ``steps`` step times, the plans'
    steps interleaved.

    Each plan runs on a model of its own (copies with the same weights),
    applied and compiled once; their steps then alternate, so drift in the
    machine's load hits every plan alike. Two warm-up rounds come first (the
    compiles, and a recompile the first step's state may ask for).
    """
    names = list(plans)
    models = {name: model if index == 0 else copy.deepcopy(model) for index, name in enumerate(names)}
    peaks = {name: plans[name].verify(models[name], tuple(inputs), loss_fn=loss_fn) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    regions = sum(len(plan.decisions) for plan in plans.values())
    with compile_cache_room(2 * regions + 8), contextlib.ExitStack() as applied:
        for name in names:
            applied.enter_context(plans[name].apply(models[name]))
        for round_ in range(steps + 2):
            for name in names if round_ % 2 == 0 else reversed(names):
                models[name].zero_grad(set_to_none=True)
                started = time.perf_counter()
                run_step(models[name], inputs, loss_fn, head=plans[name].head, chunks=plans[name].head_chunks)
                if round_ >= 2:
                    times[name].append(time.perf_counter() - started)
    for each in models.values():
        each.zero_grad(set_to_none=True)
    return peaks, times


def _formats(args: argparse.Namespace) -> tuple[str, ...]:
    """The formats of --compress, checked (an unknown one is a usage error, exit 2)."""
    if args.compress is None:
        return ()
    formats = tuple(name.strip() for name in args.compress.split(",") if name.strip())
    for name in formats:
        compression(name, api="remat plan: --compress")
    return formats


def run(args: argparse.Namespace) -> int:
    """Run ``remat plan``; returns the exit status (2 for an unreachable budget)."""
    if args.steps < 1 or args.repeats < 1:
        raise CheckpointUsageError("remat plan: --steps and --repeats must be >= 1.")
    if (args.compress is None) != (args.max_gradient_error is None):
        raise CheckpointUsageError(
            "remat plan: --compress and --max-gradient-error go together: compression makes the "
            "gradients approximate, and the bound says how much they may be."
        )
    _formats(args)
    budget = Budget.parse(args.budget)  # refused here, before a model is built
    pipeline = pipeline_from(args, "remat plan")
    if pipeline is not None:
        return _run_pipelined(args, pipeline, budget)
    sharding = sharding_from(args, "remat plan")
    if args.save:
        check_writable(args.save, "--save", "remat plan")  # before planning, not after
    if args.plot:
        check_writable(args.plot, "--plot", "remat plan")  # before any model is built
    if args.json is not None:
        check_writable(args.json, "--json", "remat plan")
    if args.measure and args.estimate is None:
        raise CheckpointUsageError(
            "remat plan: --measure compares an estimated plan with the measured one; add "
            "--estimate DEVICE (a plan without it is measured anyway)."
        )
    request = _request(args)
    if args.json is not None and args.estimate is None:
        raise CheckpointUsageError("remat plan: --json writes an estimated plan's figures; add --estimate DEVICE.")
    if args.estimate is None:
        reason = _too_large_to_profile(request)
        if reason is not None:
            print(f"{reason}: planning from estimates (--estimate here)")
            args.estimate = "here"
    if args.estimate is not None:
        return _run_estimated(args, request, sharding, budget)
    if sharding is not None:
        return _run_sharded(args, sharding, budget)
    with progress(4, "remat plan", enabled=progress_wanted(args.quiet)) as tick:
        loaded = load_model(request)
        model, inputs, loss_fn = _user_model(loaded)
        head = _head(loaded, model) if args.head else None
        tick("profiling and solving")
        # With a head, the loss is the head's: loss_fn stays the default.
        planner = Planner(
            model, loss_fn=default_loss if head is not None else loss_fn, head=head,
            repeats=args.repeats, compile=args.compile, compress=_formats(args) or None,
            max_gradient_error=args.max_gradient_error,
        )
        chosen = planner.plan(inputs, budget=budget, solver=args.solver)
        if chosen.problem.approximate:
            chosen = dataclasses.replace(
                chosen, measured_gradient_error=chosen.measure_gradient_error(model, inputs, loss_fn=loss_fn)
            )
        tick("measuring the plan")
        peak, step_s = measure_step(chosen, model, inputs, loss_fn, args.steps)
        tick("Pareto front" if args.plot else "")
        pareto = chosen.pareto() if args.plot else None
        tick()
    for note in loaded.notes:
        print(note)
    print(f"model: {loaded.title}")
    print(chosen.report())
    print()
    print(render_measurement(chosen.predicted_peak_bytes, peak, chosen.predicted_step_s, step_s))
    print("within budget" if peak <= chosen.budget_bytes else "OVER BUDGET")
    if args.plot and pareto is not None:
        render_pareto_plot(pareto, args.plot, chosen=chosen)
        print(f"Pareto plot written to {args.plot}")
    if args.save:
        print(f"plan written to {chosen.save(args.save)}")
    return 0
