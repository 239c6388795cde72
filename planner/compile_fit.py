"""Plans for compiled steps: a byte budget the step ``torch.compile`` runs holds.

A compiled step keeps what inductor and its partitioner decide around our checkpoints'
tags (``MUST_SAVE`` for what a region keeps, ``PREFER_RECOMPUTE``, which compile treats as
must-recompute, for the rest): less than eager where it fuses pointwise ops, more where its
buffers outlive eager's (measured: ``benchmarks/results/compile-cpu.md``). The eager
simulator does not predict it, so the compiled step is measured, not simulated
(:class:`planner.compiled_step.CompiledStep`), and the search is over the eager budget at
which the schedule is solved, up to the largest eager budget whose schedule, compiled, peaks
within the budget. Each probe solves the eager profile at a budget and measures that
schedule compiled (its peak, and its time: the eager clock does not say what a compiled
schedule costs), at most ``MAX_PROBES`` times:

1. no checkpointing (the eager step's own peak as budget); done if it fits;
2. the eager budget scaled by what compiling did to the last probe's peak, then
3. between the largest eager budget that fit and the least that did not, at the point
   where the line through their measured peaks meets the budget;
4. where nothing fit before the last probe, the eager schedule of the least peak.

Then up to ``POLICY_PROBES`` hand policies of the repeated blocks (`HAND_POLICIES`: a
selective policy's recompute fuses into the compiled backward), where their eager peak,
scaled as compiling scaled the nearest probe, fits; where still nothing fits, every
repeated block checkpointed, whatever its estimate. Then, where the unplanned step does
not fit, nothing checkpointed under the partitioner's own budget
(``activation_memory_budget``) at up to ``PARTITIONER_PROBES`` fractions
(`_Search.probe_partitioner`); a plan records the fraction it was measured under, which
``apply`` sets (`planner.runtime.partitioner`). The plan is the fastest measured of those
that fit, or within `TIME_NOISE` of it, the one of the largest compiled peak (the least
recompute); timed, the choice may differ from one run to the next; the budget holds for
either.

With ``execution='fake'`` every schedule is counted on fake tensors instead
(:class:`planner.compiled_fake.FakeCompiledStep`: nothing runs, and each step's time is
predicted from the kernels its generated code calls on the profile's device,
:mod:`profiles.compiled_time`; on a CPU the host's roofline measured, and its matmuls timed
per shape), and the same rule picks among the predicted times; measuring for real, a
schedule that runs the device out of memory is counted, and the search goes on.

A schedule already measured under a fraction is not compiled again. The plan records every probe
(``plan.compiled``); where none fits, :class:`InfeasibleBudgetError` names the least
compiled peak measured and carries its plan, which holds it (a search at that budget
starts afresh and need not end on the same schedule).
"""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import profiles
from planner.arguments import SolveOptions
from planner.bucket_planning import BucketPlanner, bucket_label
from planner.compiled_fake import FakeCompiledStep
from planner.compiled_step import Batch, CompiledStep
from planner.config import PARALLEL, PROFILING, STEP, PlanConfig
from planner.envelope import (
    Envelope,
    batch_at,
    branches,
    mask_inputs,
    other_batches_bytes,
    ragged,
)
from planner.plan import (
    CompiledFit,
    InfeasibleBudgetError,
    Plan,
    PlanMismatchWarning,
    format_bytes,
)
from planner.profiling import ProfiledStep, profile_model
from planner.runtime.partitioner import partitioner_budget
from planner.solving import plan_for_schedule, solve_profiled
from profiles.devices import DeviceSpec, device_spec
from profiles.host_roofline import host_roofline
from profiles.inputs import normalize_inputs
from profiles.progress import _bar
from solvers.baselines import policy_schedule
from solvers.from_profile import block_calls
from solvers.simulate import optimizer_step_peak

__all__ = ["HAND_POLICIES", "MAX_COMPILES", "MAX_PROBES", "fit_compiled", "plan_compiled",
           "warn_eager_plan_compiled"]

log = logging.getLogger(__name__)

MAX_PROBES = 6  # compiled steps the eager search measures (each compiles: seconds to minutes)
POLICY_PROBES = 3  # hand policies compiled and measured beyond those
# a hand policy is compiled where its estimated compiled peak is within this share over the
# budget: the estimate scales by what compiling did to an eager optimum, and compiled, a
# selective policy keeps less than that (saving the linears, 3-7 % under its eager peak on
# GPT small, Llama and ResNet per block, where eager optima kept about their eager peak)
ESTIMATE_SLACK = 0.10
# one process times schedules one after another, not in turns, and a step's time moves by
# several % with the host: within this share of the fastest, the larger peak is kept (GPT
# small per block at 0.5 chose every block checkpointed in one of two plans without it,
# which measured 11 % slower than saving the linears head to head)
TIME_NOISE = 0.05
# the partitioner's own budget, nothing checkpointed, compiled and measured: the least
# first, then toward the budget (its peak is not monotone in the fraction: GPT small whole
# measured 15.09 MiB at 0.5 and 15.10 at 0.2)
PARTITIONER_PROBES = 4
MAX_COMPILES = MAX_PROBES + POLICY_PROBES + PARTITIONER_PROBES
# tried in this order: selective policies first (compiled, their recompute fuses), then
# whole blocks, the fewer first
HAND_POLICIES = ("sac-matmuls", "sac-linear", "every-2nd", "every-layer")
CLOSE_ENOUGH = 0.01  # of the budget: a fitting probe this close to it ends the search
SOLVES = 3 * MAX_PROBES  # eager solves per plan (a schedule solved again is not measured)


@dataclass(frozen=True)
class _Probe:
    eager_budget: int  # solved at
    plan: Plan
    peak: int  # compiled, measured
    step_ms: float | None  # compiled, measured (None: a step that does not time)
    source: str  # where the schedule came from, in words
    fraction: float  # the partitioner's activation_memory_budget it was compiled under
    batch_peaks: tuple[int, ...] = ()  # each batch's, where the step measures several

    @property
    def lowest_budget(self) -> int:
        """The least eager budget known to give this schedule: its own eager peak (an exact
        solve finds it feasible there, and nothing faster)."""
        return min(self.eager_budget, self.plan.predicted_peak_bytes)

    @property
    def ratio(self) -> float:
        """What compiling did to this schedule's peak (compiled over eager)."""
        return self.peak / max(self.plan.predicted_peak_bytes, 1)


class _Search:
    """The probes of one fit: each schedule solved at an eager budget, compiled, measured."""

    def __init__(self, profiled: ProfiledStep, options: SolveOptions, step: CompiledStep,
                 report: Callable[[str], None],
                 counter: Callable[[], FakeCompiledStep] | None = None) -> None:
        self.profiled, self.options, self.step, self.report = profiled, options, step, report
        self.counter = counter  # where a schedule runs the device out of memory
        # (schedule, fraction) counted because it ran the device out of memory: it never
        # fits, whatever its count (a budget above the device's memory would let it)
        self.counted: set[tuple[Any, float]] = set()
        self.budget = options.budget_bytes
        self.optimizer_state = profiled.profile.static.optimizer_state_bytes
        self.resident = profiled.profile.static.resident_input_bytes
        self.optimizer_step = optimizer_step_peak(profiled.problem())
        self.probes: list[_Probe] = []
        self.least_eager: int | None = None  # the eager budget of the least eager peak
        self.fraction = partitioner_budget()  # what the process's compiles use
        self.timed_how = " predicted" if isinstance(step, FakeCompiledStep) else ""

    def solve(self, eager_budget: int) -> tuple[int, Plan]:
        """The eager plan at ``eager_budget``, or below the eager minimum the least one."""
        try:
            return eager_budget, solve_profiled(self.profiled, self.options.at(eager_budget))
        except InfeasibleBudgetError as error:
            if error.plan is None:
                raise
            return error.min_budget_bytes, error.plan

    def probe(self, eager_budget: int) -> _Probe:
        eager_budget, plan = self.solve(eager_budget)
        return self.add(eager_budget, plan, f"the eager optimum at {format_bytes(eager_budget)}")

    def add(self, eager_budget: int, plan: Plan, source: str,
            fraction: float | None = None) -> _Probe:
        """``plan``'s schedule compiled under the partitioner's ``fraction`` (None: the
        process's) and measured, once per schedule and fraction."""
        fraction = self.fraction if fraction is None else fraction
        seen = next((p for p in self.probes
                     if (p.plan.schedule, p.fraction) == (plan.schedule, fraction)), None)
        peak, step_ms, batch_peaks = (seen.peak, seen.step_ms, seen.batch_peaks) \
            if seen is not None else self.measure(plan, fraction)
        if (plan.schedule, fraction) in self.counted:
            source += " (counted on fake tensors: it ran the device out of memory)"
        probe = _Probe(eager_budget, plan, peak, step_ms, source, fraction, batch_peaks)
        self.probes.append(probe)
        if seen is None:
            timed = "" if step_ms is None else f", {step_ms:.1f} ms{self.timed_how}"
            self.report(f"{source}: compiled peak {format_bytes(peak)}{timed}")
        return probe

    def measure(self, plan: Plan, fraction: float
                ) -> tuple[int, float | None, tuple[int, ...]]:
        """The training step's peak and time with ``plan``, compiled under the partitioner's
        ``fraction``, and each batch's peak: the optimizer's state and the other resident
        batches are held through the forward and backward (measured without them: planning
        makes no state, and the step holds one batch), and the optimizer's step runs after
        the backward, eager, as the profile measured it. A schedule that runs the device out
        of memory (the unplanned step of a model that does not fit) is counted on fake
        tensors instead, where the fit has a ``counter``: it does not fit, and its count
        says by how much (the next probe scales by it)."""
        try:
            measured = self.step.run(plan, partitioner_budget=fraction)
        except torch.OutOfMemoryError:
            if self.counter is None:
                raise
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            measured = self.counter().run(plan, partitioner_budget=fraction)
            self.counted.add((plan.schedule, fraction))
        peaks = tuple(max(peak + self.optimizer_state + self.resident, self.optimizer_step)
                      for peak in measured.batch_peaks or (measured.peak_bytes,))
        return max(peaks), measured.step_ms, peaks

    @property
    def measured(self) -> int:
        return len({(p.plan.schedule, p.fraction) for p in self.probes})

    def fitting(self) -> list[_Probe]:
        return [p for p in self.probes if p.peak <= self.budget
                and (p.plan.schedule, p.fraction) not in self.counted]

    def next_budget(self) -> int | None:
        """The eager budget to try next; None when the search is done."""
        fit = max(self.fitting(), key=lambda p: p.eager_budget, default=None)
        over = min((p for p in self.probes if p.peak > self.budget),
                   key=lambda p: p.lowest_budget, default=None)
        if over is None or (fit is not None and fit.peak >= self.budget * (1 - CLOSE_ENOUGH)):
            return None
        if fit is None:  # scaled as compiling scaled the least schedule over the budget
            least = self._least_eager()
            if self.measured == MAX_PROBES - 1 or over.lowest_budget <= least:
                return least
            return max(least, over.lowest_budget * self.budget // over.peak)
        gap = over.lowest_budget - fit.eager_budget
        if gap <= CLOSE_ENOUGH * self.budget:
            return None
        share = (self.budget - fit.peak) / max(over.peak - fit.peak, 1)
        return fit.eager_budget + int(min(max(share, 0.25), 0.75) * gap)

    def _least_eager(self) -> int:
        if self.least_eager is None:
            self.least_eager = self.solve(1)[0]
        return self.least_eager

    def run(self, unplanned_eager_peak: int) -> Plan:
        """Probe from no checkpointing on, then the hand policies compiling may fit; the
        fastest plan that fit."""
        self.probe(unplanned_eager_peak)
        while self.measured < MAX_PROBES and len(self.probes) < SOLVES:
            budget = self.next_budget()
            if budget is None or any(p.eager_budget == budget for p in self.probes):
                break
            self.probe(budget)
        self.probe_policies()
        self.probe_partitioner()
        return self.result()

    def probe_policies(self) -> None:
        """The hand policies of repeated blocks (`HAND_POLICIES`), compiled, where their
        eager peak, scaled as compiling scaled the probe of the nearest eager peak, may fit:
        no eager optimum at any budget, but compiled a selective policy's recompute fuses
        into the backward (GPT small per block: saving its linears measured as fast as no
        checkpointing, where the eager optimum at that peak recomputed whole blocks, +32 %).
        Where nothing fits, every block checkpointed is tried whatever its estimate."""
        problem = self.profiled.problem()
        if not problem.blocks():
            return
        tried = 0
        for name in HAND_POLICIES:
            last_resort = name == "every-layer" and not self.fitting()
            if tried == POLICY_PROBES and not last_resort:
                continue
            plan = plan_for_schedule(self.profiled.profile, policy_schedule(name, problem),
                                     self.profiled.inputs, self.profiled.structure)
            if any(p.plan.schedule == plan.schedule for p in self.probes):
                continue
            if last_resort or self._estimate(plan) <= self.budget * (1 + ESTIMATE_SLACK):
                self.add(plan.predicted_peak_bytes, plan, f"hand policy {name!r}")
                tried += 1

    def probe_partitioner(self) -> None:
        """Nothing checkpointed, the partitioner's own budget (``activation_memory_budget``)
        compiled and measured where the unplanned step does not fit: its least (0) first,
        then `_next_fraction`. Compiled per block, the partitioner recomputes fused
        pointwise ops inside a block, which regions of whole ops do not (the zoo Llama per
        block: 5.26 MiB at 0.5, where the least whole-op schedule found peaks at 5.36)."""
        unplanned = self._unplanned()
        if unplanned.peak <= self.budget:
            return
        tried = [unplanned, self._partitioned(unplanned, 0.0)]
        for _ in range(PARTITIONER_PROBES - 1):
            fraction = self._next_fraction(tried)
            if fraction is None:
                return
            tried.append(self._partitioned(unplanned, fraction))

    def _next_fraction(self, tried: list[_Probe]) -> float | None:
        """Where one fit: between the largest fraction that fit and the next one tried, where
        the line through their peaks meets the budget (a quarter to three quarters of the
        way). Where none did (its peak is not monotone in the fraction: the zoo Llama per
        block measured 5.36 MiB at 0 and 5.26 at 0.5), halfway across the wider gap beside
        the least peak. None: nothing left between the fractions tried."""
        tried = sorted(tried, key=lambda p: p.fraction)
        fits = [i for i, p in enumerate(tried) if p.peak <= self.budget]
        if fits and fits[-1] + 1 < len(tried):
            low, high = tried[fits[-1]], tried[fits[-1] + 1]
            share = (self.budget - low.peak) / max(high.peak - low.peak, 1)
            share = min(max(share, 0.25), 0.75)
        elif fits:
            return None
        else:
            least = min(range(len(tried)), key=lambda k: tried[k].peak)
            gaps = [(tried[k], tried[k + 1]) for k in (least - 1, least)
                    if 0 <= k < len(tried) - 1]
            low, high = max(gaps, key=lambda gap: gap[1].fraction - gap[0].fraction)
            share = 0.5
        fraction = round(low.fraction + share * (high.fraction - low.fraction), 3)
        return None if fraction in (low.fraction, high.fraction) else fraction

    def _unplanned_seen(self) -> _Probe | None:
        """Nothing checkpointed, compiled under the process's partitioner budget, where
        measured (the first probe, where its eager optimum recomputes nothing)."""
        return next((p for p in self.probes if p.fraction == self.fraction
                     and not p.plan.schedule.recompute_regions()), None)

    def _unplanned(self) -> _Probe:
        """`_unplanned_seen`, measured now where it was not."""
        seen = self._unplanned_seen()
        if seen is not None:
            return seen
        profiled = self.profiled
        plan = plan_for_schedule(profiled.profile, policy_schedule("none", profiled.problem()),
                                 profiled.inputs, profiled.structure)
        return self.add(plan.predicted_peak_bytes, plan, "no checkpointing")

    def _partitioned(self, unplanned: _Probe, fraction: float) -> _Probe:
        note = (f"Nothing checkpointed: compiled, torch's partitioner recomputes what it "
                f"chooses under activation_memory_budget={fraction:g} (0: all it can, 1: its "
                "default), which apply sets.")
        return self.add(unplanned.eager_budget, unplanned.plan.model_copy(update={"note": note}),
                        f"torch's partitioner at activation_memory_budget={fraction:g}",
                        fraction)

    def _estimate(self, plan: Plan) -> float:
        eager = plan.predicted_peak_bytes
        nearest = min(self.probes, key=lambda p: abs(p.plan.predicted_peak_bytes - eager))
        return eager * nearest.ratio

    def result(self) -> Plan:
        fitting = self.fitting()
        if fitting:
            return self._compiled_plan(_fastest(fitting))
        least = min(self.probes, key=lambda p: p.peak)
        plan = self._compiled_plan(least, budget=least.peak)
        raise InfeasibleBudgetError(
            f"no schedule found whose compiled step ({self.step.mode}) peaks within "
            f"{format_bytes(self.budget)}: the least measured is {format_bytes(least.peak)} "
            f"({least.source}; {self.measured} schedules compiled). Its plan, error.plan, "
            "holds that peak compiled (apply(model, error.plan)); or reduce the batch",
            least.peak, plan=plan)

    def _compiled_plan(self, chosen: _Probe, budget: int | None = None) -> Plan:
        fit = CompiledFit(mode=self.step.mode, peak_bytes=chosen.peak,
                          blocks=self.step.blocks if self.step.mode == "blocks" else [],
                          eager_budget_bytes=chosen.eager_budget,
                          probes=[(p.eager_budget, p.peak) for p in self.probes],
                          probe_step_ms=[p.step_ms for p in self.probes],
                          step_ms=chosen.step_ms, source=chosen.source,
                          unplanned_step_ms=getattr(self._unplanned_seen(), "step_ms", None),
                          partitioner_budget=chosen.fraction,
                          compiles=self.measured,
                          optimizer_state_bytes=self.optimizer_state,
                          optimizer_step_peak_bytes=self.optimizer_step,
                          measure=self.step.measure,
                          recompile_limit_hit=getattr(self.step, "recompile_limit_hit", None),
                          garbage_collected=getattr(self.step, "garbage_collected", False),
                          batches=self._batch_record(chosen))
        return chosen.plan.model_copy(update={"budget_bytes": budget or self.budget,
                                              "compiled": fit})

    def _batch_record(self, chosen: _Probe) -> list[tuple[str, int]]:
        batches = getattr(self.step, "batches", [])
        if len(batches) < 2:
            return []
        return [(batch.label, peak) for batch, peak in zip(batches, chosen.batch_peaks,
                                                             strict=True)]


def _fastest(fitting: list[_Probe]) -> _Probe:
    """The fastest probe measured (or predicted, counted on fake tensors); among those
    within `TIME_NOISE` of it, the one of the largest compiled peak (the least recompute:
    exact where the times are not). Untimed, that rule alone: the one of the largest
    compiled peak, our schedules and the partitioner's alike (the eager clock knows neither
    what compiling fuses into a rerun nor what the partitioner recomputes)."""
    timed = [p for p in fitting if p.step_ms is not None]
    if not timed:
        return max(fitting, key=lambda p: (p.peak, p.eager_budget))
    least = min(p.step_ms for p in timed)
    close = [p for p in timed if p.step_ms <= least * (1 + TIME_NOISE)]
    return max(close, key=lambda p: (p.peak, -p.step_ms, p.eager_budget))


def fit_compiled(profiled: ProfiledStep, options: SolveOptions, step: CompiledStep,
                 report: Callable[[str], None] = lambda line: None, *,
                 counter: Callable[[], FakeCompiledStep] | None = None) -> Plan:
    """The fastest plan measured whose schedule, compiled as ``step`` runs it, peaks
    within ``options.budget_bytes`` (the search above); ``report`` hears each probe;
    ``counter`` makes the step that counts, on fake tensors, a schedule that ran the
    device out of memory (None: the error is raised).

    Raises:
        InfeasibleBudgetError: no schedule tried fits; ``min_budget_bytes`` is the least
            compiled peak measured, ``plan`` its schedule.
    """
    return _Search(profiled, options, step, report, counter).run(
        profiled.unplanned_peak_bytes)


# what a compiled step's plan does not cover yet, and why
_NOT_COMPILED = {
    "offload": "offload's hooks are refused under torch.compile (docs/recipes.md)",
    "sharding": "a rank's compiled step is measured on one process only",
    "parallelize": "a rank's compiled step is measured on one process only",
}


def plan_compiled(model: nn.Module, example_inputs: Any, budget_bytes: int,
                  config: PlanConfig) -> Plan:
    """``optimize(..., compiled=mode)``: the eager step profiled once (at the envelope's
    longest batch, where one is given), then :func:`fit_compiled` with the model itself
    compiled as ``mode`` says, measured on every batch :func:`training_batches` names."""
    given = sorted(set(config.given()) & set(_NOT_COMPILED))
    if given:
        raise ValueError(f"compiled={config.compiled!r} with {given[0]}= is not planned yet: "
                         f"{_NOT_COMPILED[given[0]]}")
    if config.envelope is not None and config.envelope.buckets != "one":
        raise ValueError(f"compiled={config.compiled!r} covers an envelope with one plan, "
                         "measured on its batches (a plan per bucket would switch schedules "
                         "inside the compiled graph): give Envelope(buckets='one')")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"compiled={config.compiled!r} measures the compiled step, or with "
                         "execution='fake' counts it on fake twins of the model's tensors: "
                         "either needs real ones, and this model is on the meta device. "
                         "Materialize it (to_empty(), then its weights' init), on the CPU "
                         "if it does not fit the device, with execution='fake'")
    args, kwargs = normalize_inputs(model, example_inputs)
    batches, profiled_batch = training_batches(args, kwargs, config.envelope)
    options = config.solve_options(budget_bytes)
    profile_options = config.options(STEP, PROFILING, PARALLEL)
    if config.envelope is None:
        profiled = profile_model(model, example_inputs, **profile_options)
    else:
        resident = other_batches_bytes(config.envelope, profiled_batch.args,
                                       profiled_batch.kwargs)
        profiled = BucketPlanner(model, options, profile_options, resident).profiled(
            profiled_batch.args, profiled_batch.kwargs)
    step, counter = _compiled_steps(model, profiled, profiled_batch, batches, config)
    counting = " counted on fake tensors" if isinstance(step, FakeCompiledStep) else ""
    if counting:
        _warn_kernel_workspace(profiled)
    bar = _bar(range(MAX_COMPILES), f"compiled steps{counting} ({config.compiled})",
               config.progress)

    def report(line: str) -> None:
        bar.update(1)
        bar.set_postfix_str(line)
        log.info("compiled step, %s", line)

    try:
        return fit_compiled(profiled, options, step, report, counter=counter)
    finally:
        bar.close()
        _warn_recompile_limit(step)
        gc.collect()  # what the fit's compiles left (compile_garbage), before training


def _compiled_steps(model: nn.Module, profiled: ProfiledStep, profiled_batch: Batch,
                    batches: list[Batch], config: PlanConfig
                    ) -> tuple[CompiledStep | FakeCompiledStep,
                               Callable[[], FakeCompiledStep] | None]:
    """The step the fit measures each schedule on, and what counts a schedule that runs
    the device out of memory: with ``execution='fake'`` every schedule is counted on fake
    tensors and its time predicted on the profile's device (:func:`compiled_clock`); else
    each runs, and one that does not fit the device is counted (untimed: it never fits)."""
    def make(kind: type, **options: Any) -> Any:
        return kind(model, profiled_batch.args, profiled_batch.kwargs,
                    config.loss_fn or profiles.default_loss, config.compiled,
                    [c.path for c in block_calls(profiled.profile)],
                    autocast_dtype=profiled.profile.autocast_dtype,
                    grads_at_start=config.grad_accumulation,
                    grads_in_forward=config.zero_grad_after_forward,
                    batches=batches, garbage_collected=config.compile_garbage_collected,
                    **options)

    if config.execution == "fake":
        return make(FakeCompiledStep, spec=compiled_clock(profiled.profile.device)), None
    return make(CompiledStep), lambda: make(FakeCompiledStep)


def compiled_clock(device: str) -> DeviceSpec:
    """The roofline a counted compiled step is timed on: the profile's device, except the
    CPU's rough stand-in, for which this host's own is measured (the CPU a model on it
    runs on; :func:`profiles.host_roofline.host_roofline`)."""
    return host_roofline() if device == "cpu" else device_spec(device)


def training_batches(args: tuple, kwargs: dict, envelope: Envelope | None
                     ) -> tuple[list[Batch], Batch]:
    """The batches a compiled plan is measured on, in the order training meets them, and
    the one profiled and timed. Without an envelope the example; with one, a batch shorter
    than the longest first (its shape compiles, and the next length compiles again with the
    length dynamic, as dynamo does in training: every later length runs that graph), then
    the longest in each mask branch, the padded one profiled (its mask takes attention's
    masked branch, and the plan's guard lets unpadded batches through a padded plan, not
    the other way round), and the longest again with rows of many lengths
    (:func:`~planner.envelope.ragged`)."""
    if envelope is None:
        return [Batch("", args, kwargs)], Batch("", args, kwargs)
    pads = branches(envelope, mask_inputs(args, kwargs))[::-1]  # the padded first
    longest = envelope.max_length
    shorter = max(envelope.min_length, 2)  # dynamo specializes a size of 1: its own graph
    lengths = [shorter, longest] if longest is not None and shorter < longest else [longest]
    batches = [Batch(bucket_label(length, pad),
                     *batch_at(args, kwargs, length, envelope.batch_size, pad))
               for length in lengths for pad in (pads if length == longest else pads[:1])]
    profiled = batches[len(lengths) - 1]
    if pads[0]:  # rows of many lengths, as a collator pads them: the mask's values differ
        batches.append(Batch(bucket_label(longest, True) + " (rows of 1 to all tokens)",
                             *ragged(profiled.args, profiled.kwargs)))
    return batches, profiled


def _warn_kernel_workspace(profiled: ProfiledStep) -> None:
    """Said where a step counted on fake tensors has convolutions: what a kernel allocates
    inside itself is not counted, so the plan's peak may be under the measured one."""
    if not any(name.endswith("convolution") for name in profiled.problem().node_names):
        return
    warnings.warn(
        "execution='fake' counts the compiled step on fake tensors, which do not see what a "
        "kernel allocates inside itself, as a convolution's workspace: the zoo ResNet's "
        "plans measured 0.2-3.9 % above their counts on the CPU "
        "(benchmarks/results/compiled-fake-fit-cpu.md), one over its budget. Leave that "
        "margin in the budget, or plan with execution='real', which measures each schedule",
        PlanMismatchWarning, stacklevel=4)


def _warn_recompile_limit(step: CompiledStep) -> None:
    """Said once per plan (to ``optimize``'s caller) where a measured step reached dynamo's
    recompile limit: the plan holds for training under that limit only."""
    if step.recompile_limit_hit is None:
        return
    warnings.warn(
        f"compiling the {step.mode} reached dynamo's recompile limit "
        f"(torch._dynamo.config.recompile_limit = {step.recompile_limit_hit}): the calls past "
        "it ran eager, and the plan's peak is of that step, which training runs only under "
        "the same limit. To compile every call, raise the limit above the number of input "
        "shapes your blocks see, before planning and training, or plan with "
        "compiled='model'", PlanMismatchWarning, stacklevel=4)


def warn_eager_plan_compiled(trainer: str, why: str) -> None:
    """A trainer switch plans the eager step, and ``trainer`` compiles it: said once, with
    ``why`` the compiled step is not planned, and what to do instead."""
    warnings.warn(
        f"{trainer}: the switch plans the eager step, and compiled, a step keeps what inductor "
        "and its partitioner keep (over the budget on a ResNet, docs/recipes.md "
        f"'torch.compile'). The compiled step is not planned here: {why}. Leave a margin, or "
        "plan with planner.optimize(..., compiled='model', envelope=..., optimizer=...) and "
        "planner.apply() yourself, without this switch", PlanMismatchWarning, stacklevel=3)
