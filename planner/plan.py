"""Plan: which module calls to checkpoint, what it is predicted to cost, and its profile.

Plans are data (pydantic, JSON with a schema version). Every number in a plan comes from
``solvers.simulate`` on the embedded profile, never from a solver's internal model; a plan
read from a file is checked against itself (``Plan.check``: regions, schedule, profile and
numbers agree), so an edited or truncated file is refused naming the field.
"""

from __future__ import annotations

import html
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from planner.sharding import Sharding, rank_problem
from profiles.kernels import attention_kernels
from profiles.schema import (
    Bytes,
    Count,
    GraphProfile,
    Ms,
    Seconds,
    Shape,
    SignedBytes,
    SignedMs,
    format_bytes,
)
from solvers.problem import Problem
from solvers.schedule import Region, Schedule

PLAN_SCHEMA_VERSION = 2
GIB = 2**30

# torch dtype names an input spec may name (checked without importing torch)
DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32",
    "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
})


class PlanMismatchError(ValueError):
    """The plan was made for a different model, precision or input shapes."""


class InfeasibleBudgetError(ValueError):
    """No schedule fits the budget.

    ``min_budget_bytes`` is the peak of the lowest-peak plan found, ``plan``: asking for it
    (``budget_gb=error.min_budget_gb``) returns that plan. ``lower_bound_bytes``, when not
    None, is proven: no schedule peaks below it.
    """

    def __init__(self, message: str, min_budget_bytes: int,
                 lower_bound_bytes: int | None = None, plan: Plan | None = None) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.lower_bound_bytes = lower_bound_bytes
        self.plan = plan

    @property
    def min_budget_gb(self) -> float:
        """The minimum as ``budget_gb`` (exact: a power-of-two division)."""
        return self.min_budget_bytes / GIB


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

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, dtype: str | None) -> str | None:
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"{dtype!r} is not a torch dtype; expected one of "
                             f"{sorted(DTYPES)}")
        return dtype


class PlanRegion(_Strict):
    start: Count
    stop: Count
    mode: Literal["store", "recompute"]
    module: str | None = Field(None, description="the module whose call a RECOMPUTE region "
                               "is ('' is the model itself)")
    nodes: list[str]
    kept: list[str] = Field(default_factory=list)
    children: list[PlanRegion] = Field(default_factory=list)


class SolverReport(_Strict):
    name: str
    status: str
    objective_ms: SignedMs | None
    bound_ms: SignedMs | None
    gap: float | None = Field(ge=0, allow_inf_nan=False)
    solve_time_s: Seconds
    space: str = Field("", description="the schedules the status and gap are proven over")


class Plan(_Strict):
    """An activation-checkpointing plan for one model, precision, input shapes and budget."""

    schema_version: int = PLAN_SCHEMA_VERSION
    model_name: str
    fingerprint: str = Field(description="the profiled step: ops, module calls, shapes")
    structure_fingerprint: str = Field(description="module tree, parameter and buffer "
                                       "shapes and dtypes: what apply() checks")
    autocast_dtype: str | None = None
    budget_bytes: Bytes
    predicted_peak_bytes: Bytes
    peak_breakdown: dict[str, SignedBytes]
    peak_at: str
    unplanned_peak_bytes: Bytes
    baseline_step_ms: Ms = Field(description="forward + backward, no checkpointing")
    recompute_ms: Ms
    checkpointing: bool
    note: str = ""
    solver: SolverReport
    regions: list[PlanRegion]
    schedule: Schedule
    inputs: list[InputSpec]
    profile: GraphProfile
    sharding: Sharding | None = Field(None, description="data-parallel training: the "
                                      "budget and every number are per rank")

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version != PLAN_SCHEMA_VERSION:
            raise ValueError(f"plan schema_version {version} is not {PLAN_SCHEMA_VERSION}: "
                             "re-run planner.optimize() with this version")
        return version

    @property
    def predicted_overhead(self) -> float:
        """Predicted extra step time over no checkpointing, as a fraction."""
        return self.recompute_ms / self.baseline_step_ms if self.baseline_step_ms else 0.0

    def problem(self) -> Problem:
        """The step the plan's numbers replay: its profile, as one rank runs it."""
        from solvers.from_profile import problem_from_profile

        return rank_problem(problem_from_profile(self.profile), self.profile.static,
                            self.sharding)

    def check(self) -> None:
        """Raise ``ValueError`` naming the field where the plan disagrees with itself: its
        regions with its schedule, either with its profile, or its numbers with a replay."""
        from solvers import simulate

        names = [n.name for n in self.profile.nodes]
        if self.schedule.n_nodes != len(names):
            raise ValueError(f"schedule: covers {self.schedule.n_nodes} nodes but the "
                             f"profile has {len(names)}")
        _check_regions(self.regions, list(self.schedule.regions), names, self.profile,
                       "regions")
        problem = self.problem()
        try:
            timeline = simulate(problem, self.schedule)
        except ValueError as error:
            raise ValueError(f"schedule: {error}") from error
        for field, value in (("predicted_peak_bytes", timeline.peak_bytes),
                             ("recompute_ms", timeline.recompute_time_ms)):
            recorded = getattr(self, field)
            if not math.isclose(recorded, value, rel_tol=1e-9, abs_tol=1e-9):
                raise ValueError(f"{field}: the plan says {recorded} but its schedule on its "
                                 f"profile gives {value}")
        if self.autocast_dtype != self.profile.autocast_dtype:
            raise ValueError(f"autocast_dtype: {self.autocast_dtype!r} but the profile ran "
                             f"under {self.profile.autocast_dtype!r}")

    def step_description(self) -> str:
        """The training step the budget holds for: how its gradients start, and whether
        the optimizer's step is in it."""
        static = self.profile.static
        start = ("steps start with every .grad allocated (gradient accumulation, "
                 "zero_grad(set_to_none=False))" if static.grads_at_start else
                 "steps start without .grad (zero_grad() before each)")
        optimizer = (", optimizer state and step included" if static.optimizer_state_bytes
                     or static.optimizer_step_bytes else ", no optimizer counted")
        return f"forward + backward{optimizer}; {start}"

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
            f"  budget {format_bytes(self.budget_bytes)}, predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} at {self.peak_at} "
            f"(no checkpointing: {format_bytes(self.unplanned_peak_bytes)})",
            f"  predicted step overhead {100 * self.predicted_overhead:.1f} % "
            f"({self.recompute_ms:.2f} ms recompute on {self.baseline_step_ms:.2f} ms, "
            f"{self.profile.timing} on {self.profile.device})",
            f"  solver {solver.name}: {_proof(solver)}, {solver.solve_time_s:.2f} s",
            f"  {self.step_description()}",
        ]
        kernels = self.attention_kernels()
        if kernels:
            lines.append(f"  attention kernel assumed: "
                         f"{', '.join(f'{k} x{n}' for k, n in kernels.items())} (profiled on "
                         f"{self.profile.execution} tensors for {self.profile.device})")
        if self.note:
            lines.append(f"  {self.note}")
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

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>[{r.start}, {r.stop})</td><td>{r.mode}</td>"
            f"<td>{html.escape(_module_label(r.module)) if r.mode == 'recompute' else ''}</td>"
            f"<td>{len(r.nodes)}</td>"
            f"<td>{html.escape(', '.join(r.kept[:6]))}{' …' if len(r.kept) > 6 else ''}</td>"
            f"</tr>" for r in self.regions)
        return (
            f"<div><b>Plan for {html.escape(self.model_name)}</b>: predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} of {format_bytes(self.budget_bytes)} "
            f"budget (no checkpointing {format_bytes(self.unplanned_peak_bytes)}), overhead "
            f"{100 * self.predicted_overhead:.1f} %, solver {html.escape(self.solver.name)} "
            f"{html.escape(_proof(self.solver))}"
            "<table><tr><th>nodes</th><th>mode</th><th>module</th><th>ops</th><th>kept</th>"
            f"</tr>{rows}</table></div>")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan; a truncated or edited file raises ``ValueError`` (pydantic's
        ``ValidationError`` for malformed fields) naming the field."""
        plan = cls.model_validate_json(Path(path).read_text())
        try:
            plan.check()
        except ValueError as error:
            if isinstance(error, ValidationError):
                raise
            raise ValueError(f"{path}: {error}") from error
        return plan


def _kept_ops(kept: list[str]) -> str:
    """`, keeps addmm x4, _softmax`: the ops of kept nodes (`module/op_2` names), counted."""
    ops = Counter(re.sub(r"_\d+$", "", name.rsplit("/", 1)[-1]) for name in kept)
    return (", keeps " + ", ".join(op if n == 1 else f"{op} x{n}" for op, n in ops.items())
            if ops else "")


def _module_label(module: str | None) -> str:
    return "<the model>" if module == "" else (module or "?")


def _check_regions(regions: list[PlanRegion], expected: list[Region], names: list[str],
                   profile: GraphProfile, where: str) -> None:
    if len(regions) != len(expected):
        raise ValueError(f"{where}: {len(regions)} regions but the schedule has "
                         f"{len(expected)}")
    spans = {(c.start, c.stop): c.path for c in profile.module_calls}
    for k, (region, sched) in enumerate(zip(regions, expected, strict=True)):
        field = f"{where}[{k}]"
        if (region.start, region.stop, region.mode) != (sched.start, sched.stop, sched.mode):
            raise ValueError(f"{field}: [{region.start}, {region.stop}) {region.mode} but the "
                             f"schedule has [{sched.start}, {sched.stop}) {sched.mode}")
        if region.nodes != names[region.start:region.stop]:
            raise ValueError(f"{field}.nodes: not the profile's nodes "
                             f"{region.start}..{region.stop - 1}")
        unknown = [name for name in region.kept if name not in names]
        if unknown:
            raise ValueError(f"{field}.kept: no node named {unknown[0]!r} in the profile")
        if sorted(region.kept) != sorted(names[i] for i in sched.keep):
            raise ValueError(f"{field}.kept: {region.kept} but the schedule keeps "
                             f"{[names[i] for i in sorted(sched.keep)]}")
        if region.mode == "recompute" and spans.get((region.start, region.stop)) is None:
            raise ValueError(f"{field}.module: no module call of the profile spans nodes "
                             f"[{region.start}, {region.stop})")
        if region.mode == "recompute" and region.module is not None and \
                region.module != spans.get((region.start, region.stop)) and not any(
                    c.path == region.module and (c.start, c.stop) == (region.start,
                                                                      region.stop)
                    for c in profile.module_calls):
            raise ValueError(f"{field}.module: {region.module!r} did not run nodes "
                             f"[{region.start}, {region.stop})")
        _check_regions(region.children, list(sched.children), names, profile,
                       f"{field}.children")


def _proof(solver: SolverReport) -> str:
    """What the solver proved, and over which schedules: never a claim without its space."""
    if solver.status == "optimal":
        return f"optimal over {solver.space or 'its solver space (not recorded)'}"
    if solver.status == "infeasible":
        return "infeasible"
    if solver.gap is not None and solver.space:
        return f"feasible, within {100 * solver.gap:.2f} % of the optimum over {solver.space}"
    return "feasible, no proven bound"
