"""Baseline schedules, scored by `simulate` like every solver.

All share `solve(problem, budget_bytes, time_limit_s) -> Solution`; `every_k(k)` builds one.
Stateful (non-recomputable) nodes are cut out of recompute regions, leaving them stored.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from solvers.bruteforce import min_feasible_budget
from solvers.problem import Problem
from solvers.result import Solution
from solvers.schedule import Schedule

logger = logging.getLogger(__name__)

__all__ = ["BASELINES", "Solver", "chen_sqrt", "every_block", "every_k", "none", "units"]

Solver = Callable[[Problem, int, float], Solution]


def _recomputable_runs(problem: Problem, start: int, stop: int) -> list[tuple[int, int]]:
    """Maximal runs of recomputable nodes inside [start, stop)."""
    runs: list[tuple[int, int]] = []
    a = None
    for i in range(start, stop + 1):
        ok = i < stop and problem.recomputable[i]
        if ok and a is None:
            a = i
        elif not ok and a is not None:
            runs.append((a, i))
            a = None
    return runs


def units(problem: Problem) -> list[tuple[int, int]]:
    """The repeated blocks `(start, stop)`; one unit per node if the problem has no blocks."""
    blocks = problem.blocks()
    if not blocks:
        logger.info("problem %r has no block_of_node; using single nodes as blocks",
                    problem.name)
        return [(i, i + 1) for i in range(problem.n_nodes)]
    return blocks


def _score(problem: Problem, segments: list[tuple[int, int]], budget_bytes: int,
           solver: str, t0: float) -> Solution:
    regions = [run for a, b in segments for run in _recomputable_runs(problem, a, b)]
    schedule = Schedule.from_segments(problem.n_nodes, regions)
    sol = Solution.scored(problem, schedule, budget_bytes, solver=solver, started_s=t0)
    if not sol.feasible:
        mfb, exact = min_feasible_budget(problem, exact_max_nodes=0)
        sol = sol.model_copy(update={"min_feasible_budget_bytes": mfb,
                                     "min_feasible_budget_exact": exact})
    return sol


def none(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
    """No checkpointing: everything stored."""
    return _score(problem, [], budget_bytes, "none", time.perf_counter())


def every_block(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
    """One recompute region per block (Hugging Face style gradient checkpointing)."""
    return _score(problem, units(problem), budget_bytes, "every_block", time.perf_counter())


def every_k(k: int) -> Solver:
    """Recompute every k-th block (blocks 0, k, 2k, ...), one region per block."""
    if k < 1:
        raise ValueError(f"every_k needs k >= 1, got {k}.")

    def solve(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
        chosen = units(problem)[::k]
        return _score(problem, chosen, budget_bytes, f"every_{k}", time.perf_counter())

    solve.__name__ = f"every_{k}"
    solve.__doc__ = f"Recompute every {k}-th block."
    return solve


def chen_sqrt(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
    """Chen et al. sqrt(n): about sqrt(#blocks) segments, all but the last recomputed."""
    blocks = units(problem)
    size = max(1, math.ceil(math.sqrt(len(blocks))))
    groups = [blocks[g:g + size] for g in range(0, len(blocks), size)]
    segments = [(grp[0][0], grp[-1][1]) for grp in groups[:-1]]
    return _score(problem, segments, budget_bytes, "chen_sqrt", time.perf_counter())


BASELINES: dict[str, Solver] = {
    "none": none,
    "every_block": every_block,
    "every_2": every_k(2),
    "every_4": every_k(4),
    "chen_sqrt": chen_sqrt,
}
