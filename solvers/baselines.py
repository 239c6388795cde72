"""Baseline schedules, scored by `simulate` like every solver.

All share `solve(problem, budget_bytes, time_limit_s) -> Solution`; `every_k(k)` builds one.
Stateful (non-recomputable) nodes are cut out of recompute regions, leaving them stored.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable

from solvers.bruteforce import min_feasible_budget
from solvers.problem import Problem
from solvers.result import Solution, Status
from solvers.schedule import Schedule

logger = logging.getLogger(__name__)

__all__ = ["BASELINES", "Solver", "chen_greedy", "chen_sqrt", "every_block", "every_k", "none",
           "save_linear", "save_matmuls", "units"]

Solver = Callable[[Problem, int, float], Solution]


def units(problem: Problem) -> list[tuple[int, int]]:
    """The repeated blocks `(start, stop)`; one unit per node if the problem has no blocks."""
    blocks = problem.blocks()
    if not blocks:
        logger.debug("problem %r has no block_of_node; using single nodes as blocks",
                     problem.name)
        return [(i, i + 1) for i in range(problem.n_nodes)]
    return blocks


def _score(problem: Problem, segments: list[tuple[int, int]], budget_bytes: int,
           solver: str, t0: float, *, keep: Callable[[int], bool] | None = None) -> Solution:
    regions = [run for a, b in segments for run in problem.recomputable_runs(a, b)]
    if not all(problem.emittable(a, b) for a, b in regions):
        # e.g. Chen's segments of several blocks where no module call spans them
        logger.debug("%s: its regions are not module spans of %r; not applicable", solver,
                     problem.name)
        return Solution(solver=solver, status=Status.INFEASIBLE, schedule=None,
                        budget_bytes=budget_bytes, objective_ms=None,
                        solve_time_s=time.perf_counter() - t0)
    kept = [i for a, b in regions for i in range(a, b)
            if keep is not None and keep(i) and problem.can_keep(i)]
    schedule = Schedule.from_segments(problem.n_nodes, regions, keep=kept)
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


def _greedy_segments(problem: Problem, blocks: list[tuple[int, int]],
                     threshold: int) -> list[tuple[int, int]]:
    """Chen's greedy: close a segment once its activation bytes exceed `threshold`."""
    sizes = [0] * problem.n_nodes
    for s, b in enumerate(problem.storage_bytes):
        sizes[problem.storage_producer[s]] += b
    segs: list[tuple[int, int]] = []
    start, acc = 0, 0
    for k, (a, b) in enumerate(blocks):
        acc += sum(sizes[a:b])
        if acc > threshold and k < len(blocks) - 1:
            segs.append((blocks[start][0], b))
            start, acc = k + 1, 0
    return segs


def chen_greedy(problem: Problem, budget_bytes: int, time_limit_s: float = 10.0) -> Solution:
    """Chen et al. 2016 greedy: segments closed at a byte threshold, threshold searched.

    Tries thresholds from the largest block up to the total activation bytes (32 values);
    keeps the fitting schedule with least recompute time (else the lowest peak).
    """
    from solvers.accounting import Context, evaluate

    t0 = time.perf_counter()
    blocks = units(problem)
    ctx = Context(problem)
    total = sum(problem.storage_bytes)
    # bytes made per node, prefix-summed: each block's activation bytes in O(1)
    made = [0] * (problem.n_nodes + 1)
    for s, nbytes in enumerate(problem.storage_bytes):
        made[problem.storage_producer[s] + 1] += nbytes
    made = list(itertools.accumulate(made))
    lo = max(1, min(total, max(made[b] - made[a] for a, b in blocks)))
    best: tuple[tuple[int, float, int], list[tuple[int, int]]] | None = None
    for k in range(32):
        if k and time.perf_counter() - t0 > time_limit_s:  # always try one threshold
            break
        threshold = int(lo * (total / lo) ** (k / 31)) if total > lo else lo
        segs = _greedy_segments(problem, blocks, threshold)
        regions = [run for a, b in segs for run in problem.recomputable_runs(a, b)]
        if not all(problem.emittable(a, b) for a, b in regions):
            continue
        peak, rt = evaluate(problem, Schedule.from_segments(problem.n_nodes, regions), ctx)
        key = (0, rt, peak) if peak <= budget_bytes else (1, float(peak), 0)
        if best is None or key < best[0]:
            best = (key, segs)
    segments = best[1] if best is not None else [(0, problem.n_nodes)]
    return _score(problem, segments, budget_bytes, "chen_greedy", t0)


def save_matmuls(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
    """Selective checkpointing per block keeping matmul-like outputs (torchtitan's op policy).

    Without `op_kind` nothing is kept: the same as `every_block`. Matmuls that are not
    `Problem.can_keep` (not keepable) are recomputed, not kept.
    """
    return _score(problem, units(problem), budget_bytes, "save_matmuls", time.perf_counter(),
                  keep=problem.is_matmul)


def save_linear(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
    """Selective checkpointing per block keeping only the linear layers' outputs (`mm`,
    `addmm`; attention is recomputed): the one-line policy users write by hand."""
    return _score(problem, units(problem), budget_bytes, "save_linear", time.perf_counter(),
                  keep=problem.is_linear)


BASELINES: dict[str, Solver] = {
    "none": none,
    "every_block": every_block,
    "every_2": every_k(2),
    "every_4": every_k(4),
    "chen_sqrt": chen_sqrt,
    "chen_greedy": chen_greedy,
    "save_matmuls": save_matmuls,
    "save_linear": save_linear,
}
