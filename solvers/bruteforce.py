"""Exhaustive search over schedules of tiny problems: the reference every solver is held to.

The enumerated space: every cut of the node order into consecutive regions (adjacent STORE
regions merged, which changes nothing), each RECOMPUTE region (a module span, when the
problem has them) with every subset of kept nodes (`Problem.can_keep`). Nested regions are
not enumerated. Non-recomputable nodes are never recomputed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from solvers.bounds import memory_lower_bound
from solvers.problem import Problem
from solvers.result import Solution
from solvers.schedule import RECOMPUTE, STORE, Region, Schedule
from solvers.simulate import simulate
from solvers.spaces import every_flat

logger = logging.getLogger(__name__)

__all__ = ["MAX_NODES", "enumerate_schedules", "min_feasible_budget", "solve"]

MAX_NODES = 8
EXACT_BUDGET_MAX_NODES = 6


def _subsets(items: list[int]) -> Iterator[frozenset[int]]:
    for mask in range(1 << len(items)):
        yield frozenset(x for b, x in enumerate(items) if mask >> b & 1)


def _tails(problem: Problem, start: int, prev_store: bool) -> Iterator[tuple[Region, ...]]:
    n = problem.n_nodes
    if start == n:
        yield ()
        return
    for stop in range(start + 1, n + 1):
        if not prev_store:
            for rest in _tails(problem, stop, True):
                yield (Region(start, stop, STORE), *rest)
        if all(problem.recomputable[start:stop]) and problem.emittable(start, stop):
            for keep in _subsets([i for i in range(start, stop) if problem.can_keep(i)]):
                region = Region(start, stop, RECOMPUTE, keep=keep)
                for rest in _tails(problem, stop, False):
                    yield (region, *rest)


def enumerate_schedules(problem: Problem) -> Iterator[Schedule]:
    """Every schedule of the space above; refuses more than `MAX_NODES` nodes.

    >>> from solvers.problem import Problem
    >>> p = Problem.chain([8, 4, 8, 1], [1.0, 1.0, 1.0, 1.0])
    >>> schedules = [s.describe() for s in enumerate_schedules(p)]
    >>> len(schedules), schedules[0], schedules[-1]
    (269, 'S[0:1] R[1:2] S[2:3] R[3:4]', 'R[0:4 keep=0,1,2,3]')
    """
    if problem.n_nodes > MAX_NODES:
        raise ValueError(
            f"brute force enumerates exponentially many schedules; {problem.n_nodes} nodes is "
            f"over its limit of {MAX_NODES}. Use an exact solver (dp) for larger problems."
        )
    for regions in _tails(problem, 0, False):
        yield Schedule(regions=regions)


def solve(problem: Problem, budget_bytes: int, time_limit_s: float = 60.0) -> Solution:
    """Least recompute time with simulated peak <= budget (ties: lower peak).

    OPTIMAL when the enumeration finished, FEASIBLE when the time limit cut it short.
    Below every schedule's peak: INFEASIBLE, with the lowest peak found.

    >>> from solvers.problem import Problem
    >>> p = Problem.chain([8, 4, 8, 1], [1.0, 1.0, 1.0, 1.0])  # unplanned peak: 30 bytes
    >>> found = solve(p, 24)
    >>> found.status.value, found.schedule.describe(), found.objective_ms, found.peak_bytes
    ('optimal', 'R[0:2 keep=1] S[2:3] R[3:4 keep=3]', 1.0, 22)
    >>> below = solve(p, 20)
    >>> below.status.value, below.min_feasible_budget_bytes
    ('infeasible', 22)
    """
    t0 = time.perf_counter()
    best: tuple[float, int, Schedule] | None = None
    lowest: tuple[int, Schedule] | None = None
    complete = True
    for schedule in enumerate_schedules(problem):
        if time.perf_counter() - t0 > time_limit_s:
            complete = False
            logger.debug("brute force hit its %.1f s limit", time_limit_s)
            break
        tl = simulate(problem, schedule)
        if lowest is None or tl.peak_bytes < lowest[0]:
            lowest = (tl.peak_bytes, schedule)
        if tl.peak_bytes <= budget_bytes:
            key = (tl.recompute_time_ms, tl.peak_bytes)
            if best is None or key < best[:2]:
                best = (*key, schedule)
    assert lowest is not None
    if best is not None:
        return Solution.scored(problem, best[2], budget_bytes, solver="bruteforce",
                               started_s=t0, proven_optimal=complete,
                               space=every_flat(problem) if complete else None)
    if complete:
        mfb, exact = lowest[0], True
    else:
        mfb, exact = memory_lower_bound(problem), False
    return Solution.scored(problem, lowest[1], budget_bytes, solver="bruteforce", started_s=t0,
                           min_feasible_budget_bytes=mfb, min_feasible_budget_exact=exact)


def min_feasible_budget(problem: Problem,
                        exact_max_nodes: int = EXACT_BUDGET_MAX_NODES) -> tuple[int, bool]:
    """Smallest budget any schedule fits, and whether that number is exact.

    Exact (lowest simulated peak over the brute-force space) up to `exact_max_nodes` nodes;
    beyond, `memory_lower_bound`: the largest single-step working set plus static memory.

    >>> from solvers.problem import Problem
    >>> p = Problem.chain([8, 4, 8, 1], [1.0, 1.0, 1.0, 1.0])
    >>> min_feasible_budget(p), min_feasible_budget(p, exact_max_nodes=3)
    ((22, True), (22, False))
    """
    if problem.n_nodes <= exact_max_nodes:
        return min(simulate(problem, s).peak_bytes for s in enumerate_schedules(problem)), True
    return memory_lower_bound(problem), False
