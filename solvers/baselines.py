"""Baseline schedules, scored by `simulate` like every solver.

All share `solve(problem, budget_bytes, time_limit_s) -> Solution`; `every_k(k)` builds one.
Stateful (non-recomputable) nodes are cut out of recompute regions, leaving them stored.

The hand-written policies (`POLICIES`, named as people write them: "every-2nd", "chen-sqrt-n")
are defined once here, over block indices: which consecutive blocks run under one checkpoint
(`policy_segments`) and which ops a selective policy keeps. The baselines score them on a
`Problem` (`policy_schedule`); `benchmarks/frontier.py` wraps a real model's layers by the same
`policy_segments` and replays its measured peers with `policy_schedule`, so a measured peer,
its replay and its baseline cannot disagree.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import NamedTuple

from solvers.bruteforce import min_feasible_budget
from solvers.problem import Problem
from solvers.result import Solution, Status
from solvers.schedule import Schedule

logger = logging.getLogger(__name__)

__all__ = ["BASELINES", "POLICIES", "Policy", "Solver", "chen_greedy", "chen_segments",
           "chen_sqrt", "every_block", "every_k", "every_k_blocks", "none", "policy_schedule",
           "policy_segments", "save_linear", "save_matmuls", "units"]

Solver = Callable[[Problem, int, float], Solution]


# ----------------------------------------------------------------- the hand-written policies


def every_k_blocks(n_blocks: int, k: int) -> list[int]:
    """The blocks "checkpoint every k-th layer" wraps: the k-th, 2k-th, ... counting from 1,
    so indices k-1, 2k-1, ... (every-2nd of 6: 1, 3, 5).

    As torchtitan's and torchtune's layer-selective AC write it (``_count += 1; if _count %
    ac_freq == 0: wrap``), and as "every 2nd layer" reads; ``i % k == 0`` (0, k, 2k, ...)
    would wrap the first layer instead of the k-th."""
    if k < 1:
        raise ValueError(f"every k-th block needs k >= 1, got {k}.")
    return list(range(k - 1, n_blocks, k))


def chen_segments(n_blocks: int) -> list[tuple[int, int]]:
    """Chen et al. 2016's sqrt(n) checkpointing: `[start, stop)` block ranges, each run under
    one checkpoint: segments of ceil(sqrt(n)) blocks from the first, all but the last.

    The paper's segments of sqrt(n) layers; where sqrt(n) is not whole, rounded up, so the
    segments never outnumber the blocks in one and the last one (the remainder) is never the
    longest. The last segment is stored, as PyTorch's own segment checkpointing
    (``torch.utils.checkpoint.checkpoint_sequential``) leaves its last chunk unchecked.
    Recomputing it too is another policy, not this one: it costs that segment's
    forward again and lowers the peak only where memory freed between its forward and its
    backward (a language model's logits) coincided with its activations."""
    size = max(1, math.ceil(math.sqrt(n_blocks)))
    starts = range(0, n_blocks, size)
    return [(a, min(a + size, n_blocks)) for a in starts][:-1]


class Policy(NamedTuple):
    """A hand-written policy: `segments(n_blocks)`, the block ranges each run under one
    non-reentrant checkpoint; `keep`, the ops a selective-checkpoint policy saves inside them
    ("matmul": matmuls and attention, torchtitan's op SAC; "linear": `mm`/`addmm` only; None:
    full recompute); `solver`, its name in `BASELINES`."""

    segments: Callable[[int], list[tuple[int, int]]]
    keep: str | None
    solver: str


def _each(indices: Callable[[int], list[int]]) -> Callable[[int], list[tuple[int, int]]]:
    return lambda n: [(i, i + 1) for i in indices(n)]


POLICIES: dict[str, Policy] = {
    "none": Policy(lambda n: [], None, "none"),
    "every-layer": Policy(_each(range), None, "every_block"),  # Hugging Face's, torchtitan "full"
    "every-2nd": Policy(_each(lambda n: every_k_blocks(n, 2)), None, "every_2"),
    "every-4th": Policy(_each(lambda n: every_k_blocks(n, 4)), None, "every_4"),
    "chen-sqrt-n": Policy(chen_segments, None, "chen_sqrt"),
    "sac-matmuls": Policy(_each(range), "matmul", "save_matmuls"),
    "sac-linear": Policy(_each(range), "linear", "save_linear"),
}


def policy_segments(name: str, n_blocks: int) -> list[tuple[int, int]]:
    """Policy `name`'s `[start, stop)` block ranges, each under one checkpoint."""
    return POLICIES[name].segments(n_blocks)


def units(problem: Problem) -> list[tuple[int, int]]:
    """The repeated blocks `(start, stop)`; one unit per node if the problem has no blocks."""
    blocks = problem.blocks()
    if not blocks:
        logger.debug("problem %r has no block_of_node; using single nodes as blocks",
                     problem.name)
        return [(i, i + 1) for i in range(problem.n_nodes)]
    return blocks


def _node_segments(problem: Problem, block_segments: list[tuple[int, int]]
                   ) -> list[tuple[int, int]]:
    """`[start, stop)` block ranges (over `units`) as node ranges."""
    blocks = units(problem)
    return [(blocks[a][0], blocks[b - 1][1]) for a, b in block_segments]


def _regions(problem: Problem, segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Node ranges as recompute regions: their runs of recomputable nodes."""
    return [run for a, b in segments for run in problem.recomputable_runs(a, b)]


def _schedule(problem: Problem, regions: list[tuple[int, int]], keep: str | None) -> Schedule:
    """`regions` recomputed, keeping inside them the `keep` ops that `Problem.can_keep`."""
    kept_op = {None: None, "matmul": problem.is_matmul, "linear": problem.is_linear}[keep]
    kept = [i for a, b in regions for i in range(a, b)
            if kept_op is not None and kept_op(i) and problem.can_keep(i)]
    return Schedule.from_segments(problem.n_nodes, regions, keep=kept)


def policy_schedule(name: str, problem: Problem) -> Schedule:
    """Hand-written policy `name` on `problem`'s blocks (`units`), as a schedule: each segment's
    recomputable runs are regions, keeping the policy's ops where `Problem.can_keep`. Regions
    need not be module spans (a Chen segment of several blocks runs under one checkpoint by
    hand); the `BASELINES` solver reports those as not applicable."""
    policy = POLICIES[name]
    segments = _node_segments(problem, policy.segments(len(units(problem))))
    return _schedule(problem, _regions(problem, segments), policy.keep)


# ----------------------------------------------------------------- the solvers


def _score(problem: Problem, segments: list[tuple[int, int]], budget_bytes: int,
           solver: str, t0: float, *, keep: str | None = None) -> Solution:
    """Node ranges `segments` recomputed (keeping `keep` ops) and scored at `budget_bytes`;
    not applicable (INFEASIBLE, no schedule) where a region is not a module span, and the
    least feasible budget named where it does not fit."""
    regions = _regions(problem, segments)
    if not all(problem.emittable(a, b) for a, b in regions):
        # e.g. Chen's segments of several blocks where no module call spans them
        logger.debug("%s: its regions are not module spans of %r; not applicable", solver,
                     problem.name)
        return Solution(solver=solver, status=Status.INFEASIBLE, schedule=None,
                        budget_bytes=budget_bytes, objective_ms=None,
                        solve_time_s=time.perf_counter() - t0)
    schedule = _schedule(problem, regions, keep)
    sol = Solution.scored(problem, schedule, budget_bytes, solver=solver, started_s=t0)
    if not sol.feasible:
        mfb, exact = min_feasible_budget(problem, exact_max_nodes=0)
        sol = sol.model_copy(update={"min_feasible_budget_bytes": mfb,
                                     "min_feasible_budget_exact": exact})
    return sol


def _policy(problem: Problem, budget_bytes: int, name: str) -> Solution:
    """Hand-written policy `name` as its `BASELINES` solver answers it."""
    t0 = time.perf_counter()
    policy = POLICIES[name]
    segments = _node_segments(problem, policy.segments(len(units(problem))))
    return _score(problem, segments, budget_bytes, policy.solver, t0, keep=policy.keep)


def none(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
    """No checkpointing: everything stored (policy "none")."""
    return _policy(problem, budget_bytes, "none")


def every_block(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
    """One recompute region per block (policy "every-layer": Hugging Face style gradient
    checkpointing)."""
    return _policy(problem, budget_bytes, "every-layer")


def every_k(k: int) -> Solver:
    """Recompute every k-th block (`every_k_blocks`: the k-th, 2k-th, ... counting from 1),
    one region per block. `every_k(2)` and `every_k(4)` are policies "every-2nd", "every-4th"."""
    every_k_blocks(0, k)  # checks k

    def solve(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
        t0 = time.perf_counter()
        blocks = units(problem)
        chosen = [blocks[i] for i in every_k_blocks(len(blocks), k)]
        return _score(problem, chosen, budget_bytes, f"every_{k}", t0)

    solve.__name__ = f"every_{k}"
    solve.__doc__ = f"Recompute every {k}-th block."
    return solve


def chen_sqrt(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
    """Chen et al. sqrt(n) (policy "chen-sqrt-n", `chen_segments`): segments of ceil(sqrt(n))
    blocks, all but the last recomputed; not applicable where no module call spans a segment."""
    return _policy(problem, budget_bytes, "chen-sqrt-n")


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
        regions = _regions(problem, segs)
        if not all(problem.emittable(a, b) for a, b in regions):
            continue
        peak, rt = evaluate(problem, Schedule.from_segments(problem.n_nodes, regions), ctx)
        key = (0, rt, peak) if peak <= budget_bytes else (1, float(peak), 0)
        if best is None or key < best[0]:
            best = (key, segs)
    segments = best[1] if best is not None else [(0, problem.n_nodes)]
    return _score(problem, segments, budget_bytes, "chen_greedy", t0)


def save_matmuls(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
    """Selective checkpointing per block keeping matmul-like outputs (policy "sac-matmuls":
    torchtitan's op policy).

    Without `op_kind` nothing is kept: the same as `every_block`. Matmuls that are not
    `Problem.can_keep` (not keepable) are recomputed, not kept.
    """
    return _policy(problem, budget_bytes, "sac-matmuls")


def save_linear(problem: Problem, budget_bytes: int, time_limit_s: float = 0.0) -> Solution:
    """Selective checkpointing per block keeping only the linear layers' outputs (`mm`,
    `addmm`; attention is recomputed; policy "sac-linear"): the one-line policy users write."""
    return _policy(problem, budget_bytes, "sac-linear")


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
