"""Plan: what to checkpoint, what it is predicted to cost, and the profile it was made from.

Plans are data (pydantic, JSON with a schema version). Every number in a plan comes from
``solvers.simulate`` on the embedded profile, never from a solver's internal model.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from profiles.schema import GraphProfile
from solvers.schedule import Schedule

PLAN_SCHEMA_VERSION = 1
GIB = 2**30


class PlanMismatchError(ValueError):
    """The plan was made for a different model or input shapes."""


class InfeasibleBudgetError(ValueError):
    """No schedule fits the budget; ``min_budget_bytes`` is the smallest that could."""

    def __init__(self, message: str, min_budget_bytes: int) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputSpec(_Strict):
    """One model input, enough to rebuild a stand-in for capture in ``apply``."""

    name: str
    keyword: bool
    shape: list[int] | None = None
    dtype: str | None = None
    value: Any = None  # non-tensor inputs, as given
    same_as: str | None = Field(None, description="an earlier input that is the same tensor")


class PlanRegion(_Strict):
    start: int
    stop: int
    mode: Literal["store", "recompute"]
    nodes: list[str]
    kept: list[str] = Field(default_factory=list)
    children: list[PlanRegion] = Field(default_factory=list)


class SolverReport(_Strict):
    name: str
    status: str
    objective_ms: float | None
    bound_ms: float | None
    gap: float | None
    solve_time_s: float


class Plan(_Strict):
    """An activation-checkpointing plan for one model, input shapes and budget."""

    schema_version: int = PLAN_SCHEMA_VERSION
    model_name: str
    fingerprint: str
    budget_bytes: int = Field(ge=0)
    predicted_peak_bytes: int = Field(ge=0)
    peak_breakdown: dict[str, int]
    peak_at: str
    unplanned_peak_bytes: int = Field(ge=0)
    baseline_step_ms: float = Field(ge=0, description="forward + backward, no checkpointing")
    recompute_ms: float = Field(ge=0)
    checkpointing: bool
    note: str = ""
    solver: SolverReport
    regions: list[PlanRegion]
    schedule: Schedule
    inputs: list[InputSpec]
    profile: GraphProfile

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

    def summary(self) -> str:
        """A readable table of the plan."""
        lines = [
            f"Plan for {self.model_name} (fingerprint {self.fingerprint})",
            f"  budget {self.budget_bytes / GIB:.3f} GiB, predicted peak "
            f"{self.predicted_peak_bytes / GIB:.3f} GiB at {self.peak_at} "
            f"(no checkpointing: {self.unplanned_peak_bytes / GIB:.3f} GiB)",
            f"  predicted step overhead {100 * self.predicted_overhead:.1f} % "
            f"({self.recompute_ms:.2f} ms recompute on {self.baseline_step_ms:.2f} ms, "
            f"{self.profile.timing} on {self.profile.device})",
            f"  solver {self.solver.name}: {self.solver.status}, gap "
            f"{_percent(self.solver.gap)}, {self.solver.solve_time_s:.2f} s",
        ]
        if self.note:
            lines.append(f"  {self.note}")
        lines.append(f"  {'region':<14} {'mode':<10} {'nodes':>6} {'kept':>5}  first .. last")
        for region in self.regions:
            lines.append(f"  [{region.start:>4}, {region.stop:>4}) {region.mode:<10} "
                         f"{len(region.nodes):>6} {len(region.kept):>5}  "
                         f"{region.nodes[0]} .. {region.nodes[-1]}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>[{r.start}, {r.stop})</td><td>{r.mode}</td><td>{len(r.nodes)}</td>"
            f"<td>{html.escape(', '.join(r.kept[:6]))}{' …' if len(r.kept) > 6 else ''}</td>"
            f"<td>{html.escape(r.nodes[0])} … {html.escape(r.nodes[-1])}</td></tr>"
            for r in self.regions)
        return (
            f"<div><b>Plan for {html.escape(self.model_name)}</b>: predicted peak "
            f"{self.predicted_peak_bytes / GIB:.3f} GiB of {self.budget_bytes / GIB:.3f} GiB "
            f"budget (no checkpointing {self.unplanned_peak_bytes / GIB:.3f} GiB), overhead "
            f"{100 * self.predicted_overhead:.1f} %, solver {self.solver.name} "
            f"{self.solver.status} (gap {_percent(self.solver.gap)})"
            "<table><tr><th>region</th><th>mode</th><th>nodes</th><th>kept</th>"
            f"<th>span</th></tr>{rows}</table></div>")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan; a truncated or edited file raises pydantic's ValidationError naming
        the field."""
        return cls.model_validate_json(Path(path).read_text())


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f} %"
