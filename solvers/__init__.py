"""Torch-free decision code: problems, schedules, the simulator and the solvers."""

from solvers import baselines, bruteforce
from solvers.bounds import memory_lower_bound, recompute_time_lower_bound
from solvers.bruteforce import min_feasible_budget
from solvers.problem import Problem, ProblemError
from solvers.result import Solution, Status
from solvers.schedule import RECOMPUTE, STORE, Region, Schedule, ScheduleError
from solvers.simulate import Event, PeakBreakdown, SimulationError, Timeline, simulate

__all__ = [
    "RECOMPUTE",
    "STORE",
    "Event",
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
    "baselines",
    "bruteforce",
    "memory_lower_bound",
    "min_feasible_budget",
    "recompute_time_lower_bound",
    "simulate",
]
