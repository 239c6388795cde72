"""Torch-free decision code: problems, schedules, the simulator and the solvers.

`SOLVERS` maps a name to `solve(problem, budget_bytes, time_limit_s) -> Solution`: the exact
solvers (`cpsat`, `dp`, `auto`, `bruteforce` for tiny graphs) and every baseline;
`deterministic_solver(name)` the same solver deciding by its work, never by the clock.
"""

import functools
import math
from collections.abc import Callable

from solvers import auto, baselines, bruteforce, cpsat, dp, joint
from solvers.auto import min_feasible_budget
from solvers.bounds import memory_lower_bound, recompute_time_lower_bound
from solvers.decision import Decision
from solvers.dp import search as dp_search
from solvers.problem import MATMUL_KINDS, ModuleSpan, Problem, ProblemError
from solvers.result import Solution, Status
from solvers.schedule import (
    RECOMPUTE,
    STORE,
    ModuleCall,
    Offload,
    OpRange,
    Region,
    Schedule,
    ScheduleError,
)
from solvers.simulate import Event, PeakBreakdown, SimulationError, Timeline, simulate

SOLVERS: dict[str, Callable[[Problem, int, float], Solution]] = {
    "auto": auto.solve,
    "cpsat": cpsat.solve,
    "milp": cpsat.solve,  # its name before 2026-11 (scripts, plans and the CLI may use it)
    "dp": dp_search.solve,
    "bruteforce": bruteforce.solve,
    **baselines.BASELINES,
}


def deterministic_solver(name: str) -> Callable[[Problem, int, float], Solution]:
    """`SOLVERS[name]` with the same answer on a loaded machine as on a quiet one: CP-SAT
    (and `auto`, which runs it) counts the limit in its own measure of work, the DP and
    brute force run to their own end; the baselines read no clock that decides."""
    solve = SOLVERS[name]
    if solve in (auto.solve, cpsat.solve):
        return functools.partial(solve, deterministic=True)
    if solve in (dp_search.solve, bruteforce.solve):
        return lambda problem, budget_bytes, _limit_s: solve(problem, budget_bytes, math.inf)
    return solve


__all__ = [
    "MATMUL_KINDS",
    "RECOMPUTE",
    "SOLVERS",
    "STORE",
    "Decision",
    "Event",
    "ModuleCall",
    "ModuleSpan",
    "Offload",
    "OpRange",
    "PeakBreakdown",
    "Problem",
    "ProblemError",
    "Region",
    "Schedule",
    "ScheduleError",
    "SimulationError",
    "Solution",
    "Status",
    "Timeline",
    "auto",
    "baselines",
    "bruteforce",
    "cpsat",
    "deterministic_solver",
    "dp",
    "joint",
    "memory_lower_bound",
    "min_feasible_budget",
    "recompute_time_lower_bound",
    "simulate",
]
