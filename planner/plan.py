"""Plan: which module calls to checkpoint, what it is predicted to cost, and its profile.

Plans are data (pydantic, JSON with a schema version) holding the schedule, the profile and
the solver's report once. Every number of a plan is derived from them by
``solvers.simulate``, never taken from a solver's internal model or from the file; a plan
read from a file is checked against its profile (``Plan.check``: every checkpoint is a call
the profile ran), so an edited or truncated file is refused naming the field.
"""

from __future__ import annotations

import html
import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from planner.sharding import Sharding, rank_problem
from profiles.kernels import attention_kernels
from profiles.schema import (
    Bytes,
    FileFormatError,
    GraphProfile,
    Model,
    Seconds,
    Shape,
    SignedMs,
    format_bytes,
    read_model,
    write_atomic,
)
from solvers.baselines import policy_schedule
from solvers.bounds import memory_lower_bound
from solvers.from_profile import host_link, op_range_name, op_range_targets
from solvers.pipeline import StageSpec
from solvers.problem import Problem
from solvers.routing import RoutingSpread, WorstRouting, worst_routing
from solvers.schedule import Mode, ModuleCall, OpRange, Region, Schedule

PLAN_SCHEMA_VERSION = 4  # 4: a checkpoint in an offloaded call says what it moves per node
GIB = 2**30

# torch dtype names an input spec may name (checked without importing torch)
DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32",
    "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
})


class PlanMismatchError(ValueError):
    """The plan was made for a different model, precision or input shapes."""


class PlanMismatchWarning(UserWarning):
    """A planned model runs outside what its plan guarantees (larger inputs, precision,
    a changed model or forward); ``apply(..., strict=True)`` raises
    :class:`PlanMismatchError` instead."""


class InfeasibleBudgetError(ValueError):
    """No schedule fits the budget.

    ``min_budget_bytes`` is the peak of the lowest-peak plan found, ``plan``: asking for it
    (``budget_gb=error.min_budget_gb``) returns that plan. ``lower_bound_bytes``, when not
    None, is proven: no schedule peaks below it.
    """

    def __init__(self, message: str, min_budget_bytes: int,
                 lower_bound_bytes: int | None = None, plan: Plan | None = None, *,
                 shell_message: str | None = None) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.lower_bound_bytes = lower_bound_bytes
        self.plan = plan
        self.shell_message = shell_message  # the same, its remedies as the CLI's flags

    @property
    def min_budget_gb(self) -> float:
        """The minimum as ``budget_gb`` (exact: a power-of-two division)."""
        return self.min_budget_bytes / GIB


class InfeasibleRankBudgetError(InfeasibleBudgetError):
    """No plans of a pipeline rank's chunks fit its budget (``planner.plan_rank``).

    ``plans``: one per chunk, together the lowest rank peak found (``min_budget_bytes``);
    ``plan`` is chunk 0's, as for one module.
    """

    def __init__(self, message: str, min_budget_bytes: int, plans: list[Plan]) -> None:
        super().__init__(message, min_budget_bytes, plan=plans[0])
        self.plans = plans


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputSpec(_Strict):
    """One model input as planned: its shape bounds what the plan guarantees."""

    name: str
    keyword: bool
    shape: Shape | None = None
    dtype: str | None = None
    value: Any = None  # non-tensor inputs, as given
    same_as: str | None = Field(None, description="an earlier input that is the same tensor")
    padded: bool | None = Field(None, description="an attention mask: whether it held a "
                                "zero when planned (None: not a mask)")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, dtype: str | None) -> str | None:
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"{dtype!r} is not a torch dtype; expected one of "
                             f"{sorted(DTYPES)}")
        return dtype


class PlanRegion(NamedTuple):
    """One region of a plan as people read it (derived from the plan's schedule): profile
    node names instead of indices, the module whose call a RECOMPUTE region checkpoints
    ('' is the model itself; ``path[first..last]`` for an op range of its traced forward),
    the nodes it keeps and the checkpoints nested in it."""

    start: int
    stop: int
    mode: Mode
    module: str | None
    nodes: list[str]
    kept: list[str]
    children: list[PlanRegion]


class SolverReport(_Strict):
    name: str
    status: str
    objective_ms: SignedMs | None
    bound_ms: SignedMs | None
    gap: float | None = Field(ge=0, allow_inf_nan=False)
    solve_time_s: Seconds
    space: str = Field("", description="the schedules the status and gap are proven over")
    time_limit_s: Seconds | None = Field(None, description="the search's limit (None: none "
                                         "ran, or a plan file from before it was recorded)")
    any_choice_bound_ms: SignedMs | None = Field(
        None, description="no schedule of any planner fitting the budget adds less time "
        "(reruns and copy stalls): the per-tensor LP of solvers.choice_bound; set on "
        "plans made with offload=True (None: not computed)")


class PlanOffload(NamedTuple):
    """One offloaded module call as people read it: what it moves each way, and the
    module whose output's gradient fetches it back (None: when first needed)."""

    start: int
    stop: int
    module: str | None
    nbytes: int
    saved_nodes: list[str]
    prefetch_module: str | None
    kept_nodes: tuple[str, ...] = ()  # of saved_nodes, those whose outputs a checkpoint keeps
    release_module: str | None = None  # at whose end the device copies go (None: its own)


# what a plan derives and caches, and the fields it derives it from
_DERIVED_FROM = {"_problem": frozenset({"profile", "sharding"}),
                 "_replay": frozenset({"profile", "sharding", "schedule", "routing"})}


class _Replay(NamedTuple):
    """What ``simulate`` says of a plan's schedule on its profile (and of no checkpointing)."""

    peak_bytes: int
    breakdown: dict[str, int]
    peak_at: str
    recompute_ms: float
    unplanned_peak_bytes: int
    baseline_step_ms: float
    stall_ms: float
    transfer_ms: float
    offloaded_bytes: int
    worst: WorstRouting | None = None  # with routed experts: the worst routing's


class PipelineStage(_Strict):
    """The stage a plan is for, its budget, and its peak over one step of its schedule as
    replayed when planned (from the stage's profiles before and after its first backward,
    :mod:`planner.pipeline.stage`); ``None`` once the schedule is edited."""

    spec: StageSpec
    budget_bytes: Bytes
    peak_bytes: Bytes | None
    chunk: int = 0  # the rank's model chunk this plan is for (interleaved schedules)

    def describe(self) -> str:
        spec = self.spec
        peak = "not replayed for this schedule" if self.peak_bytes is None else \
            f"predicted {format_bytes(self.peak_bytes)}"
        if spec.num_chunks > 1:
            return (f"pipeline rank {spec.stage_index} of {spec.num_stages}, chunk "
                    f"{self.chunk} of {spec.num_chunks} (stage {spec.chunk_stage(self.chunk)} "
                    f"of {spec.num_chunks * spec.num_stages}; {spec.schedule}, "
                    f"{spec.in_flight()} chunk microbatches in flight): rank budget "
                    f"{format_bytes(self.budget_bytes)}, {peak}; the numbers below are one "
                    "microbatch's of this chunk")
        return (f"pipeline stage {spec.stage_index} of {spec.num_stages} ({spec.schedule}, "
                f"{spec.in_flight()} of {spec.n_microbatches} microbatches in flight): stage "
                f"budget {format_bytes(self.budget_bytes)}, {peak}; the numbers below are one "
                "microbatch's")


class CompiledFit(_Strict):
    """A plan for the step ``torch.compile`` runs (``optimize(..., compiled=)``,
    :mod:`planner.compile_fit`): its peak is the compiled step's, measured with the schedule
    applied and compiled at the profiled inputs, not the eager simulator's (inductor fuses,
    and its partitioner decides what untagged ops keep)."""

    mode: Literal["model", "blocks"] = Field(description="'model': torch.compile(model); "
                                             "'blocks': each repeated block's .compile() "
                                             "after apply (torchtitan's order)")
    blocks: list[str] = Field(default_factory=list, description="with 'blocks': the "
                              "modules compiled, each with its .compile()")
    peak_bytes: Bytes = Field(description="the compiled step's peak with this schedule: its "
                              "forward and backward measured, plus the optimizer's state, "
                              "or the optimizer's step where that is larger")
    optimizer_state_bytes: Bytes = Field(0, description="the optimizer's state, held "
                                         "through the compiled forward and backward (0: "
                                         "planned without an optimizer)")
    optimizer_step_peak_bytes: Bytes = Field(0, description="the peak of the optimizer's "
                                             "step after the backward, run eager, the same "
                                             "under every schedule (the profile's)")
    eager_budget_bytes: Bytes = Field(description="the budget the eager schedule was "
                                      "solved at")
    probes: list[tuple[Bytes, Bytes]] = Field(description="each eager solve: (eager budget, "
                                              "compiled peak measured), in order")
    probe_step_ms: list[float | None] = Field(
        default_factory=list, description="each probe's compiled step, timed (the least "
        "of its timed steps, ms; counted on fake tensors: predicted from its kernels, as "
        "`measure` says; None: not timed), in the order of probes")
    step_ms: float | None = Field(None, description="this schedule's compiled step, timed "
                                  "or predicted as the probes are (ms): among the probes "
                                  "that fit, the fastest, or within noise of it the "
                                  "largest peak")
    source: str = Field("", description="where this schedule came from: the eager optimum "
                        "at a budget, a hand policy, or the partitioner at a budget")
    unplanned_step_ms: float | None = Field(
        None, description="the compiled step with nothing checkpointed, timed as the probes "
        "are (ms; None: not timed): what step_ms is set against")
    partitioner_budget: float | None = Field(
        None, ge=0.0, le=1.0, description="torch's activation_memory_budget (the min-cut "
        "partitioner's 0-1 budget for what untagged ops keep) this schedule was compiled "
        "and measured under; apply sets it while the plan is applied, remove puts the "
        "process's value back (None: the process's own)")
    garbage_collected: bool = Field(False, description="measured for a training loop that "
                                    "calls planner.collect_compile_garbage() after each "
                                    "step; False: every later step holds what each compile "
                                    "left to Python's cycle collector (the peak counts it)")
    compiles: int = Field(ge=1, description="distinct schedules compiled and measured (a "
                          "solve that gave one already measured is not compiled again)")
    measure: str = Field(description="what measured the peaks")
    recompile_limit_hit: int | None = Field(
        default=None, description="dynamo's recompile_limit when compiling reached it: the "
        "calls past it ran eager in the measured step, as they will in training under that "
        "limit (None: not reached)")
    batches: list[tuple[str, Bytes]] = Field(
        default_factory=list, description="planned with an envelope: each batch this "
        "schedule's compiled step was measured on, in the order training meets them (a "
        "shorter one first, whose length the next compile makes dynamic), and its peak; "
        "peak_bytes is the largest (empty: the profiled batch alone)")

    def describe(self, budget_bytes: int) -> str:
        what = self.mode if self.mode == "model" else \
            f"blocks {self.blocks[0]} .. {self.blocks[-1]}" if self.blocks else self.mode
        return (f"compiled ({what}): measured peak {format_bytes(self.peak_bytes)} of "
                f"the compiled step within budget {format_bytes(budget_bytes)} ("
                f"{self.measure}; {self.compiles} schedules compiled{self._optimizer()}); "
                f"the schedule: {self._chosen()}{self._batches()}, and the eager numbers "
                "below are the eager step's" + (
                    "; for a loop that calls planner.collect_compile_garbage() after each "
                    "step" if self.garbage_collected else "") + (
                    "" if self.recompile_limit_hit is None else
                    f"; dynamo's recompile limit ({self.recompile_limit_hit}) was reached: "
                    "the calls past it ran eager, measured as such"))

    def _chosen(self) -> str:
        source = self.source or \
            f"the eager optimum at {format_bytes(self.eager_budget_bytes)}"
        if self.step_ms is None:
            return source
        overhead = "" if not self.unplanned_step_ms else \
            f" ({self.step_ms / self.unplanned_step_ms - 1:+.1%} against " \
            f"{self.unplanned_step_ms:.1f} ms with nothing checkpointed)"
        how = " (predicted)" if "predicted" in self.measure else ""
        return (f"{source}, the fastest that fit (within noise, the least recompute), "
                f"{self.step_ms:.1f} ms a step compiled{how}{overhead}")

    def _batches(self) -> str:
        if not self.batches:
            return ""
        return "; measured on the batches " + ", then ".join(
            f"{label} ({format_bytes(peak)})" for label, peak in self.batches)

    def _optimizer(self) -> str:
        if not self.optimizer_state_bytes and not self.optimizer_step_peak_bytes:
            return ""
        return (f"; the optimizer's state {format_bytes(self.optimizer_state_bytes)} "
                "counted through it, and its eager step, peaking at "
                f"{format_bytes(self.optimizer_step_peak_bytes)}")


def moved_keeps_named(schedule: Any) -> Any:
    """A schema-3 schedule (JSON) in schema 4's words: a top-level checkpoint inside an
    offloaded call moved every output it kept ("keep"), which schema 4 writes "offload"
    (its "keep" stays on the device)."""
    if not isinstance(schedule, dict):
        return schedule
    spans = [(o.get("start"), o.get("stop")) for o in schedule.get("offloads") or ()
             if isinstance(o, dict)]
    regions = []
    for region in schedule.get("regions") or ():
        if isinstance(region, dict) and isinstance(region.get("saves"), dict) and any(
                a <= region.get("start", -1) and region.get("stop", -1) <= b
                for a, b in spans if isinstance(a, int) and isinstance(b, int)):
            region = {**region, "saves": {k: "offload" if d == "keep" else d
                                          for k, d in region["saves"].items()}}
        regions.append(region)
    return {**schedule, "regions": regions}


class Plan(_Strict):
    """An activation-checkpointing plan for one model, precision, input shapes and budget.

    It stores the schedule, the profile and the solver's report once; its numbers
    (``predicted_peak_bytes``, ``recompute_ms``, ...) and its readable ``regions`` are
    derived from them, by ``simulate`` for the numbers, so they cannot disagree.
    """

    schema_version: int = PLAN_SCHEMA_VERSION
    structure_fingerprint: str = Field(description="module tree, parameter and buffer "
                                       "shapes and dtypes: what apply() checks")
    budget_bytes: Bytes
    note: str = ""
    solver: SolverReport
    schedule: Schedule = Field(description="the regions; every RECOMPUTE region targets "
                               "one of the profile's module calls")
    inputs: list[InputSpec]
    profile: GraphProfile
    sharding: Sharding | None = Field(None, description="data-parallel training: the "
                                      "budget and every number are per rank")
    host_budget_bytes: Bytes | None = Field(None, description="offload was allowed, within "
                                            "this much host memory; None: not allowed, or "
                                            "not recorded (files before it was)")
    pipeline: PipelineStage | None = Field(None, description="a pipeline stage's plan: "
                                           "one microbatch's step, planned for what the stage "
                                           "holds over its schedule")
    routing: RoutingSpread | None = Field(None, description="routed experts that loop over "
                                          "the experts a batch's tokens went to: the peak "
                                          "is the worst over every routing "
                                          "(solvers.routing)")
    compiled: CompiledFit | None = Field(None, description="planned for the step torch.compile "
                                         "runs: budget_bytes holds its measured peak")

    @model_validator(mode="before")
    @classmethod
    def _upgraded(cls, data: Any) -> Any:
        """A schema-3 file read as schema 4 (`moved_keeps_named`); others as they are."""
        if isinstance(data, dict) and data.get("schema_version") == 3:
            data = {**data, "schema_version": 4,
                    "schedule": moved_keeps_named(data.get("schedule"))}
        return data

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version != PLAN_SCHEMA_VERSION:
            raise ValueError(f"plan schema_version {version} is not {PLAN_SCHEMA_VERSION}: "
                             "re-run planner.optimize() with this version")
        return version

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> Plan:
        """A copy; what it derives from a field ``update`` changes is derived again, the
        rest kept (a plan given the profile's notes keeps its problem and replay: on a 70B
        profile a replay takes seconds)."""
        copied = super().model_copy(update=update, deep=deep)
        if update and "schedule" in update and copied.pipeline is not None and \
                "pipeline" not in update:  # the stage's replay was of the old schedule
            copied.__dict__["pipeline"] = copied.pipeline.model_copy(
                update={"peak_bytes": None})
        changed = set(update or ())
        for derived, sources in _DERIVED_FROM.items():
            if deep or changed & sources:
                copied.__dict__.pop(derived, None)
        return copied

    def reusing(self, problem: Problem) -> Plan:
        """This plan, taking ``problem`` as what ``problem()`` would build (the caller built
        it from this plan's profile and sharding) rather than building it again."""
        self.__dict__["_problem"] = problem
        return self

    @cached_property
    def _replay(self) -> _Replay:
        from solvers import simulate

        problem = self.problem()
        timeline = simulate(problem, self.schedule)
        unplanned = simulate(problem, Schedule.store_all(problem.n_nodes))
        b = timeline.breakdown
        breakdown = {"static": b.static_bytes, "kept_activations": b.kept_activation_bytes,
                     "recomputed_activations": b.recomputed_activation_bytes,
                     "prefetched_activations": b.prefetched_activation_bytes,
                     "gradients": b.gradient_bytes, "temporaries": b.temp_bytes}
        peak, peak_at, unplanned_peak = timeline.peak_bytes, timeline.peak_label, \
            unplanned.peak_bytes
        worst = None
        if self.routing is not None:  # the bound over routings, not the profiled one
            worst = worst_routing(problem, self.routing, self.schedule, timeline)
            if worst.peak_bytes > peak:
                breakdown["routing"] = worst.peak_bytes - peak
                peak, peak_at = worst.peak_bytes, f"{worst.label} (worst routing)"
            unplanned_peak = worst_routing(problem, self.routing,
                                           Schedule.store_all(problem.n_nodes),
                                           unplanned).peak_bytes
        return _Replay(peak, breakdown, peak_at, timeline.recompute_time_ms,
                       unplanned_peak, unplanned.total_time_ms,
                       timeline.stall_time_ms, timeline.transfer_time_ms,
                       timeline.offloaded_bytes, worst)

    @property
    def model_name(self) -> str:
        return self.profile.model_name

    @property
    def fingerprint(self) -> str:
        """The profiled step's: ops, module calls, shapes."""
        return self.profile.fingerprint

    @property
    def autocast_dtype(self) -> str | None:
        return self.profile.autocast_dtype

    @property
    def predicted_peak_bytes(self) -> int:
        return self._replay.peak_bytes

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """What the predicted peak holds: static, kept and recomputed activations, ..."""
        return dict(self._replay.breakdown)

    @property
    def peak_at(self) -> str:
        return self._replay.peak_at

    @property
    def recompute_ms(self) -> float:
        return self._replay.recompute_ms

    @property
    def stall_ms(self) -> float:
        """Predicted time compute waits for offload copies (0 without offload)."""
        return self._replay.stall_ms

    @property
    def transfer_ms(self) -> float:
        """Predicted time the copy queues (to the host and back) are busy."""
        return self._replay.transfer_ms

    @property
    def offloaded_bytes(self) -> int:
        """Bytes that go to host memory and come back each step: the host memory it needs."""
        return self._replay.offloaded_bytes

    @property
    def offloads(self) -> list[PlanOffload]:
        """The offloaded module calls as people read them."""
        from solvers.offload import offload_groups

        problem, names = self.problem(), [n.name for n in self.profile.nodes]
        return [PlanOffload(o.start, o.stop, o.target.path if o.target else None,
                            g.nbytes(problem), [names[i] for i in sorted(set(g.moved.values()))],
                            o.prefetch_target.path if o.prefetch_target else None,
                            tuple(names[i] for i in sorted({g.moved[s] for s in g.cached})),
                            o.release_target.path if o.release_target else None)
                for o, g in zip(self.schedule.offloads, offload_groups(problem, self.schedule),
                                strict=True)]

    @property
    def unplanned_peak_bytes(self) -> int:
        return self._replay.unplanned_peak_bytes

    @property
    def baseline_step_ms(self) -> float:
        """Forward + backward, no checkpointing."""
        return self._replay.baseline_step_ms

    @property
    def checkpointing(self) -> bool:
        return any(r.is_recompute for r in self.schedule.regions)

    @property
    def regions(self) -> list[PlanRegion]:
        """The schedule's regions as people read them."""
        return _plan_regions([n.name for n in self.profile.nodes], self.schedule.regions)

    @property
    def guard_ms(self) -> float:
        """What the planned model's guard (`planner.runtime.guard`) takes at each step, as
        measured on the model (0 where the profile did not time it)."""
        costs = self.profile.checkpoint_costs
        return costs.guard_ms if costs is not None else 0.0

    @property
    def predicted_overhead(self) -> float:
        """Predicted extra step time over the unplanned model (recompute, stalls on offload
        copies and the guard's checks), as a fraction."""
        added = self.recompute_ms + self.stall_ms + self.guard_ms
        return added / self.baseline_step_ms if self.baseline_step_ms else 0.0

    def problem(self) -> Problem:
        """The step the plan's numbers replay: its profile, as one rank runs it."""
        return self._problem

    @cached_property
    def _problem(self) -> Problem:
        from solvers.from_profile import problem_from_profile

        return rank_problem(problem_from_profile(self.profile),
                            self.sharding)

    def check(self) -> None:
        """Raise ``ValueError`` naming the field where the plan's schedule does not fit its
        profile: nodes it does not have, a checkpoint on a span no module call ran."""
        if self.schedule.n_nodes != len(self.profile.nodes):
            raise ValueError(f"schedule: covers {self.schedule.n_nodes} nodes but the "
                             f"profile has {len(self.profile.nodes)}")
        calls = {(c.start, c.stop, c.path) for c in self.profile.module_calls}
        ranges = op_range_targets(self.profile)
        checkpointed: dict[str, int] = {}
        for k, region in enumerate(self.schedule.recompute_regions()):
            where = f"schedule: checkpoint {k} [{region.start}, {region.stop})"
            target = region.target
            if target is None:
                raise ValueError(f"{where} has no target module call")
            if isinstance(target, OpRange):
                if ranges.get((region.start, region.stop)) != target:
                    raise ValueError(f"{where}: its target, ops {target.first}..{target.last} "
                                     f"of module {target.path!r}, is not an op range of a "
                                     "traced forward that ran these nodes in the profile")
            elif (region.start, region.stop, target.path) not in calls:
                raise ValueError(f"{where}: its target, module {target.path!r}, did "
                                 "not run these nodes in the profile")
            elif target.path in checkpointed:
                raise ValueError(f"{where}: module {target.path!r} is checkpointed by "
                                 f"checkpoint {checkpointed[target.path]} too; one forward runs "
                                 "both of its calls, so it can carry one checkpoint")
            else:
                checkpointed[target.path] = k
        for k, off in enumerate(self.schedule.offloads):
            spans = [((off.start, off.stop), off.target, "target")]
            if off.prefetch is not None:
                spans.append((off.prefetch, off.prefetch_target, "prefetch_target"))
            if off.release is not None:
                spans.append((off.release, off.release_target, "release_target"))
            for (a, b), target, name in spans:
                if target is None or (a, b, target.path) not in calls:
                    raise ValueError(f"schedule: offload {k} [{off.start}, {off.stop}): its "
                                     f"{name} is not a module call that ran nodes [{a}, {b}) "
                                     "in the profile")
        try:
            self._replay  # noqa: B018 (simulates the schedule: the numbers it derives)
        except ValueError as error:
            raise ValueError(f"schedule: {error}") from error
        self._check_budget()

    def _check_budget(self) -> None:
        """A plan's own numbers are within its budget (as every plan the planner makes is):
        one that is not was edited, and would promise what it does not hold."""
        what = "budget_bytes"
        budget, peak = self.budget_bytes, self.predicted_peak_bytes
        stage = self.pipeline
        if stage is not None and stage.peak_bytes is not None and stage.peak_bytes > \
                stage.budget_bytes:
            what, budget, peak = "pipeline.budget_bytes", stage.budget_bytes, stage.peak_bytes
        if self.compiled is not None:
            what, peak = "budget_bytes (compiled)", self.compiled.peak_bytes
        if peak > budget:
            raise ValueError(
                f"{what}: {format_bytes(budget)} is below the plan's own predicted peak "
                f"{format_bytes(peak)}: the plan was edited and does not hold that budget. "
                "Plan again at the budget you want (planner.replan(plan, budget_bytes=...) or "
                "planner.optimize()).")

    def step_description(self) -> str:
        """The training step the budget holds for: how its gradients start, and whether
        the optimizer's step is in it."""
        static = self.profile.static
        if static.grads_at_start:
            start = ("steps start with every .grad allocated (gradient accumulation, "
                     "zero_grad(set_to_none=False))")
        elif static.grads_in_forward:
            start = ("steps start with the last .grad and free them before the backward "
                     "(zero_grad() between forward and backward)")
        else:
            start = "steps start without .grad (zero_grad() before each)"
        optimizer = (", optimizer state and step included" if static.optimizer_state_bytes
                     or static.optimizer_step_bytes else ", no optimizer counted")
        return f"forward + backward{optimizer}; {start}"

    @property
    def worst_routing(self) -> WorstRouting | None:
        """With routed experts (``routing``): the routing the predicted peak is at."""
        return self._replay.worst

    def routing_description(self) -> str:
        """What the peak assumes of the routing ('' without routed experts)."""
        spread, worst = self.routing, self.worst_routing
        if spread is None or worst is None:
            return ""
        full = [e for e, c in enumerate(worst.counts) if c == spread.tokens]
        where = (f"the worst sends every token to experts {full}" if full else
                 "no routing peaks above them")
        return (f"routing: the peak is the worst over every routing of {spread.tokens} tokens "
                f"to {spread.top_k} of {spread.experts} experts in each of {spread.layers} "
                f"routed layers ({format_bytes(worst.profiled_peak_bytes)} at balanced "
                f"counts; {where})")

    def attention_kernels(self) -> dict[str, int]:
        """The attention kernels the profiled step ran (kernel -> calls): the ones this plan
        assumes the device runs (``profiles.kernels``; the planned model warns, where a
        checkpointed call shows it, when another one runs)."""
        return attention_kernels([node.target for node in self.profile.nodes])

    def summary(self) -> str:
        """A readable table of the plan."""
        solver = self.solver
        lines = [
            f"Plan for {self.model_name} (fingerprint {self.fingerprint}"
            f"{', autocast ' + self.autocast_dtype if self.autocast_dtype else ''})",
            *([f"  {self.sharding.describe()}"] if self.sharding else []),
            *([f"  {self.profile.parallel.describe()}"] if self.profile.parallel else []),
            *([f"  {self.pipeline.describe()}"] if self.pipeline else []),
            *([f"  {self.routing_description()}"] if self.routing else []),
            *([f"  {self.compiled.describe(self.budget_bytes)}"] if self.compiled else []),
            f"  budget {format_bytes(self.budget_bytes)}, predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} at {self.peak_at} "
            f"(no checkpointing: {format_bytes(self.unplanned_peak_bytes)})",
            f"  predicted step overhead {100 * self.predicted_overhead:.1f} % "
            f"({self.recompute_ms:.2f} ms recompute"
            f"{f', {self.stall_ms:.2f} ms waiting for copies' if self.offloads else ''} on "
            f"{self.baseline_step_ms:.2f} ms, {self.profile.timing} on {self.profile.device})",
            *self._offload_lines(),
            f"  solver {solver.name}: {_proof(solver, short=True)}, "
            f"{solver.solve_time_s:.2f} s",
            *[f"  {line}" for line in [_stopped_by_the_limit(solver), _any_choice(solver)]
              if line],
            f"  {self.step_description()}",
        ]
        kernels = self.attention_kernels()
        if kernels:
            lines.append(f"  attention kernel assumed: "
                         f"{', '.join(f'{k} x{n}' for k, n in kernels.items())} (profiled on "
                         f"{self.profile.execution} tensors for {self.profile.device})")
        if self.note:
            lines.append(f"  {self.note}")
        lines.extend(self._next_steps())
        lines.append(f"  {'nodes':<14} {'mode':<10} {'kept':>5}  module")
        for region in self.regions:
            lines.append(f"  [{region.start:>4}, {region.stop:>4}) {region.mode:<10} "
                         f"{len(region.kept):>5}  "
                         + (_module_label(region.module) + _kept_ops(region.kept)
                            if region.mode == "recompute"
                            else f"{region.nodes[0]} .. {region.nodes[-1]}"))
            for child in region.children:
                lines.append(f"      nested [{child.start}, {child.stop}) keep "
                             f"{len(child.kept)}  {_module_label(child.module)}")
        return "\n".join(lines)

    def log_summary(self, logger: logging.Logger) -> None:
        """:meth:`summary` at INFO on ``logger``, made only when INFO is on: a trainer
        switch's report. A failure to make it is a warning, never an error: the plan is
        applied by then, and training goes on with it."""
        log_summary(self, logger)

    def _next_steps(self) -> list[str]:
        """What to try next, in the simulator's numbers: the budget that needs no recompute,
        how low fixed schedules and any schedule go, offload; or the budget left unused."""
        if not self.checkpointing:
            spare = self.budget_bytes - self.unplanned_peak_bytes
            return [f"  next: {format_bytes(spare)} of the budget is unused; a bigger batch "
                    "may fit (plan it to know)"] if spare > 0 and not self.offloads else []
        from solvers import simulate  # as _replay imports it

        problem = self.problem()
        hints = [f"no recompute at a {format_bytes(self.unplanned_peak_bytes)} budget"]
        if problem.blocks():  # without repeated blocks there is no "every block" to compare
            every = simulate(problem, policy_schedule("every-layer", problem)).peak_bytes
            if every < self.predicted_peak_bytes:
                hints.append(f"every block checkpointed peaks at {format_bytes(every)}")
        hints.append(f"no schedule below {format_bytes(memory_lower_bound(problem))}")
        if self.host_budget_bytes is None and host_link(self.profile.device) is not None:
            hints.append("offload=True may trade recompute for copies to host memory")
        return [f"  next: {'; '.join(hints)}"]

    def _offload_lines(self) -> list[str]:
        offloads = self.offloads
        if not offloads:
            return self._no_offload_lines()
        link = self.problem().host_link
        lines = [f"  offload: {len(offloads)} module calls' saved activations, "
                 f"{format_bytes(self.offloaded_bytes)} to host memory and back "
                 f"(copies busy {self.transfer_ms:.2f} ms, compute waits {self.stall_ms:.2f} "
                 f"ms; {link.d2h_gbps:g} GB/s each way"
                 f"{', synchronous' if link.synchronous else ''})"]
        for o in offloads:
            lines.append(f"    [{o.start:>4}, {o.stop:>4}) offload    "
                         f"{_module_label(o.module)}: {format_bytes(o.nbytes)} saved by "
                         f"{len(o.saved_nodes)} ops"
                         + (f" ({len(o.kept_nodes)} of them kept by its checkpoint)"
                            if o.kept_nodes else "") + f", {_release_label(o)}, back "
                         f"{_fetch_label(o)}")
        return lines

    def _no_offload_lines(self) -> list[str]:
        """Why a plan that was allowed to offload offloads nothing."""
        if self.host_budget_bytes is None:
            return []
        if not self.checkpointing and self.unplanned_peak_bytes <= self.budget_bytes:
            return ["  offload: allowed, none needed (the step fits the budget as it is)"]
        if self.problem().host_link is None:
            return [f"  offload: allowed, but no host link is known for "
                    f"{self.profile.device} (profiles.devices): planned without offload"]
        return [f"  offload: allowed (host budget {format_bytes(self.host_budget_bytes)}), "
                "but no call is offloaded: no offload that fits was found faster than "
                "checkpointing alone at this budget"]

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>[{r.start}, {r.stop})</td><td>{r.mode}</td>"
            f"<td>{html.escape(_module_label(r.module)) if r.mode == 'recompute' else ''}</td>"
            f"<td>{len(r.nodes)}</td>"
            f"<td>{html.escape(', '.join(r.kept[:6]))}{' …' if len(r.kept) > 6 else ''}</td>"
            f"</tr>" for r in self.regions) + "".join(
            f"<tr><td>[{o.start}, {o.stop})</td><td>offload</td>"
            f"<td>{html.escape(_module_label(o.module))}</td><td>{len(o.saved_nodes)}</td>"
            f"<td>{format_bytes(o.nbytes)} to host, {html.escape(_release_label(o))}, back "
            f"{html.escape(_fetch_label(o))}"
            f"</td></tr>" for o in self.offloads)
        return (
            f"<div><b>Plan for {html.escape(self.model_name)}</b>: predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} of {format_bytes(self.budget_bytes)} "
            f"budget (no checkpointing {format_bytes(self.unplanned_peak_bytes)}), overhead "
            f"{100 * self.predicted_overhead:.1f} %, solver {html.escape(self.solver.name)} "
            f"{html.escape(_proof(self.solver))}"
            "<table><tr><th>nodes</th><th>mode</th><th>module</th><th>ops</th><th>kept</th>"
            f"</tr>{rows}</table></div>")

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically: a save that fails or is killed part-way
        leaves the file that was there whole (``profiles.schema.write_atomic``)."""
        write_atomic(path, self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan. A file that is not one (binary, not JSON, truncated, another kind
        of file, an edited field out of bounds, a schedule its profile did not run) raises
        ``FileFormatError`` (a ``ValueError``) naming the file and the field; a missing
        file ``OSError``."""
        return read_checked(cls, path, "plan")


def read_checked(cls: type[Model], path: str | Path, what: str) -> Model:
    """``read_model``, then the model's own ``check()``: a file that does not hold
    together raises ``FileFormatError`` naming the file."""
    found = read_model(cls, path, what)
    try:
        found.check()
    except ValueError as error:
        raise FileFormatError(f"{path}: {error}") from error
    return found


def log_summary(plan: Any, logger: logging.Logger) -> None:
    """``plan.summary()`` (a plan's or a plan table's) at INFO on ``logger``
    (:meth:`Plan.log_summary`)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    try:
        text = plan.summary()
    except Exception as error:  # a report must not stop a training run
        logger.warning("could not summarize the plan for %s (%s: %s); it is applied, and "
                       "training goes on", plan.model_name, type(error).__name__, error)
        return
    logger.info("%s", text)


def _kept_ops(kept: list[str]) -> str:
    """`, keeps addmm x4, _softmax`: the ops of kept nodes (`module/op_2` names), counted."""
    ops = Counter(re.sub(r"_\d+$", "", name.rsplit("/", 1)[-1]) for name in kept)
    return (", keeps " + ", ".join(op if n == 1 else f"{op} x{n}" for op, n in ops.items())
            if ops else "")


def _release_label(offload: PlanOffload) -> str:
    """Where an offloaded call's device copies are let go (its copies out waited for)."""
    if offload.release_module is None:
        return "freed on the device at its end"
    return f"freed on the device at the end of {_module_label(offload.release_module)}"


def _fetch_label(offload: PlanOffload) -> str:
    """When an offloaded call's copies come back."""
    if offload.prefetch_module is None:
        return "when first needed"
    return f"at {_module_label(offload.prefetch_module)}'s output gradient"


def _module_label(module: str | None) -> str:
    return "<the model>" if module == "" else (module or "?")


def _target_label(target: ModuleCall | OpRange | None) -> str | None:
    """A region's module path, or for an op range ``path[first..last]`` (fx node names)."""
    if isinstance(target, OpRange):
        return op_range_name(target.path, target.first, target.last)
    return target.path if target else None


def _plan_regions(names: list[str], regions: Iterable[Region]) -> list[PlanRegion]:
    return [PlanRegion(r.start, r.stop, r.mode, _target_label(r.target),
                       names[r.start:r.stop], [names[i] for i in sorted(r.keep)],
                       _plan_regions(names, r.children)) for r in regions]


STOPPED_SHARE = 0.8  # a search that took this much of its limit was stopped by it


def _stopped_by_the_limit(solver: SolverReport) -> str:
    """What a longer time limit could buy, when the limit stopped a search short of a proof
    (empty otherwise: then a longer limit changes nothing)."""
    limit = solver.time_limit_s
    if (solver.status != "feasible" or limit is None or solver.objective_ms is None
            or solver.solve_time_s < STOPPED_SHARE * limit):
        return ""
    if solver.gap is None or not solver.space:
        return (f"the search stopped at its {limit:g} s limit with no proven bound: a longer "
                "time_limit_s may find a faster plan")
    return (f"the search stopped at its {limit:g} s limit: a longer time_limit_s can save at "
            f"most {solver.gap * solver.objective_ms:.3g} ms more recompute (the proven gap)")


def _any_choice(solver: SolverReport) -> str:
    """How far the plan is from what any planner could reach (empty where not computed)."""
    bound, objective = solver.any_choice_bound_ms, solver.objective_ms
    if bound is None or objective is None:
        return ""
    above = f"{100 * (objective - bound) / objective:.1f} %" if objective > 0 else "0 %"
    return (f"any planner's schedule adds at least {bound:.3g} ms within this budget "
            f"(per-tensor keep / recompute / offload LP): this plan is {above} above it")


def _proof(solver: SolverReport, short: bool = False) -> str:
    """What the solver proved, and over which schedules: never a claim without its space
    (``short``: the space by the field that states it, for one line of a summary)."""
    space = solver.space or "its solver space (not recorded)"
    if short and solver.space:
        space = "its search space (plan.solver.space)"
    if solver.status == "optimal":
        return f"optimal over {space}"
    if solver.status == "infeasible":
        return "infeasible"
    if solver.gap is not None and solver.space:
        return f"feasible, within {100 * solver.gap:.2f} % of the optimum over {space}"
    return "feasible, no proven bound"
