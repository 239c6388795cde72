"""One result type for every solver: `Solution`, re-scored by `simulate`."""

from __future__ import annotations

import logging
import time
from enum import Enum

from pydantic import BaseModel, ConfigDict

from solvers.problem import Problem
from solvers.schedule import Schedule
from solvers.simulate import Timeline, simulate
from solvers.spaces import SearchSpace

logger = logging.getLogger(__name__)

__all__ = ["Solution", "Status"]


class Status(str, Enum):
    """Outcome of a solve. INFEASIBLE: the solver found no schedule within the budget and
    ran to its end (with a `space`, it proved none of that space fits); TIMED_OUT: its time
    limit stopped it first, so whether one fits is not known."""

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    TIMED_OUT = "timed out"


class Solution(BaseModel):
    """A solver's answer; memory and time numbers come from `simulate`, never the solver.

    `objective_ms` is the time `schedule` adds to the step (recompute, and stalls on offload
    copies); `bound_ms` a proven lower bound on the
    added time of any schedule of `space` within the budget; `gap` is (objective - bound)
    / objective (0 when both are 0). OPTIMAL, the bound and the gap hold over `space` only
    (None: nothing is proven but the trivial bound 0). When INFEASIBLE, `schedule` is the
    lowest-peak schedule the solver found (or None) and `min_feasible_budget_bytes` the
    smallest budget that could work (exact when `min_feasible_budget_exact`, else a lower
    bound); with a `space`, no schedule of that space fits the budget (proven). TIMED_OUT
    is INFEASIBLE's fields with nothing proven about the budget (`space` None).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    solver: str
    status: Status
    schedule: Schedule | None
    budget_bytes: int
    objective_ms: float | None
    bound_ms: float | None = None
    gap: float | None = None
    solve_time_s: float = 0.0
    peak_bytes: int | None = None
    total_time_ms: float | None = None
    min_feasible_budget_bytes: int | None = None
    min_feasible_budget_exact: bool = False
    space: SearchSpace | None = None
    # `auto.lowest_peak`: no schedule of `least_peak_space` peaks below `least_peak_bytes`
    least_peak_bytes: int | None = None
    least_peak_space: SearchSpace | None = None
    least_peak_prover: str | None = None  # the solver that proved it ("CP-SAT", "the DP")

    @property
    def feasible(self) -> bool:
        """A schedule within the budget: OPTIMAL or FEASIBLE."""
        return self.status in (Status.OPTIMAL, Status.FEASIBLE)

    def timed_out(self) -> Solution:
        """This answer, TIMED_OUT where it found no schedule within the budget: for a
        search its time limit stopped, which proves nothing (its `space` dropped)."""
        if self.feasible:
            return self
        return self.model_copy(update={"status": Status.TIMED_OUT, "space": None})

    @classmethod
    def scored(
        cls,
        problem: Problem,
        schedule: Schedule,
        budget_bytes: int,
        *,
        solver: str,
        started_s: float,
        proven_optimal: bool = False,
        bound_ms: float | None = 0.0,
        min_feasible_budget_bytes: int | None = None,
        min_feasible_budget_exact: bool = False,
        space: SearchSpace | None = None,
        timeline: Timeline | None = None,
    ) -> Solution:
        """Simulate `schedule` and wrap it: FEASIBLE (or OPTIMAL) iff its peak fits the budget.

        `started_s` is the `time.perf_counter()` value when the solve began; `timeline`:
        `simulate(problem, schedule)`, where the caller has it already.
        """
        tl = simulate(problem, schedule) if timeline is None else timeline
        fits = tl.peak_bytes <= budget_bytes
        objective = tl.added_time_ms
        if fits:
            status = Status.OPTIMAL if proven_optimal else Status.FEASIBLE
            if proven_optimal:
                bound_ms = objective
        else:
            status = Status.INFEASIBLE
        gap = None
        if fits and bound_ms is not None:
            gap = 0.0 if objective <= 0 else max(0.0, (objective - bound_ms) / objective)
        return cls(
            solver=solver,
            status=status,
            schedule=schedule,
            budget_bytes=budget_bytes,
            objective_ms=objective if fits else None,
            bound_ms=bound_ms if fits else None,
            gap=gap,
            solve_time_s=time.perf_counter() - started_s,
            peak_bytes=tl.peak_bytes,
            total_time_ms=tl.total_time_ms,
            min_feasible_budget_bytes=None if fits else min_feasible_budget_bytes,
            min_feasible_budget_exact=min_feasible_budget_exact and not fits,
            space=space if fits else None,
        )
