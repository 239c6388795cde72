"""Exact dynamic program over chains of stages (Rotor-style, for the checkpoint execution model).

Stages are the problem's blocks and the single nodes between them. When every storage made in
a stage is read only in that stage or the next (a chain), `simulate`'s peak splits into
segments: the peak of a schedule is the max over its segments of (bytes the earlier segments
still hold + the segment's own local peak), where the local peak and the held bytes depend
only on the segment, its option and which of its inputs the previous segment holds
(`solvers.accounting.profile`). The DP walks the stages keeping, per (stage, inputs-held
state), the Pareto front of (bytes held so far, recompute time); a segment of stages is STORE
or one RECOMPUTE region per recomputable run, with keep = nothing, the matmul-like nodes, or,
for tiny problems, any subset (only nodes that `Problem.can_keep` are ever kept). Fronts
larger than `max_front` are discretised into that many memory slots, rounding held bytes up
(the schedule is still simulated and safe); a second pass rounding down gives the lower
bound, and the difference is reported as the gap.

Not a chain (a storage read two or more stages later, e.g. a mask or a tied embedding
output used at the end): the stages it skips are merged (conservative; logged), so the DP
still answers, over a coarser space. Nested regions are not produced: torch's nested
non-reentrant checkpoints rerun the parent's saves early, which rarely pays off.
OPTIMAL therefore means optimal over this schedule space, with the memory model exact.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from solvers.accounting import Context, RegionInfo, profile
from solvers.bounds import memory_lower_bound
from solvers.milp import stages as problem_stages
from solvers.problem import Problem
from solvers.result import Solution, Status
from solvers.schedule import RECOMPUTE, Region, Schedule

logger = logging.getLogger(__name__)

__all__ = ["applies", "chain_stages", "solve"]

SUBSET_MAX_NODES = 8  # problems this small try every kept subset per segment


def chain_stages(problem: Problem) -> tuple[list[tuple[int, int]], bool]:
    """Stages, merged until the problem is a chain of them; True if nothing was merged."""
    st = problem_stages(problem)
    merged = False
    while True:
        stage_of = [0] * problem.n_nodes
        for t, (a, b) in enumerate(st):
            for i in range(a, b):
                stage_of[i] = t
        cut = [True] * len(st)  # cut[t]: boundary before stage t kept
        bad = False
        for s, cons in enumerate(problem.consumers):
            if not cons:
                continue
            t, u = stage_of[problem.storage_producer[s]], stage_of[cons[-1]]
            if u > t + 1:
                bad = True
                for v in range(t + 2, u + 1):
                    cut[v] = False
        if not bad:
            return st, not merged
        merged = True
        new: list[tuple[int, int]] = []
        for t, (a, b) in enumerate(st):
            if new and not cut[t]:
                new[-1] = (new[-1][0], b)
            else:
                new.append((a, b))
        logger.info("dp: %s is not a chain of its stages; merged %d stages into %d",
                    problem.name, len(st), len(new))
        st = new


def applies(problem: Problem) -> bool:
    """True when the problem is a chain of its stages (no merging needed)."""
    return chain_stages(problem)[1]


def _runs(problem: Problem, a: int, b: int) -> list[tuple[int, int]]:
    runs, start = [], None
    for i in range(a, b + 1):
        ok = i < b and problem.recomputable[i]
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            runs.append((start, i))
            start = None
    return [(x, y) for x, y in runs if any(problem.packs[x:y])]


def _options(ctx: Context, a: int, b: int, single: bool,
             subsets: bool) -> list[tuple[RegionInfo, ...]]:
    p = ctx.p
    opts: list[tuple[RegionInfo, ...]] = [()] if single else []
    runs = _runs(p, a, b)
    if not runs:
        return opts
    opts.append(tuple(ctx.region(x, y) for x, y in runs))
    mm = tuple(ctx.region(x, y, [i for i in range(x, y) if p.is_matmul(i) and p.can_keep(i)])
               for x, y in runs)
    if mm != opts[-1]:
        opts.append(mm)
    if subsets and len(runs) == 1:
        x, y = runs[0]
        keepable = [i for i in range(x, y) if p.can_keep(i)]
        for r in range(1, len(keepable) + 1):
            for keep in itertools.combinations(keepable, r):
                opts.append((ctx.region(x, y, keep),))
    return opts


class _Front:
    """Pareto front of (held bytes, recompute ms) with back-pointers, as numpy arrays."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, tuple]] = []
        self.held = np.zeros(0, dtype=np.int64)
        self.time = np.zeros(0)
        self.src = np.zeros(0, dtype=np.int64)  # chunk index of each entry
        self.idx = np.zeros(0, dtype=np.int64)  # entry index in the chunk's source front
        self.info: list[tuple] = []

    def add(self, held: np.ndarray, tms: np.ndarray, info: tuple) -> None:
        self.chunks.append((held, tms, np.arange(len(held)), info))

    def prune(self, max_front: int, optimistic: bool) -> bool:
        held = np.concatenate([c[0] for c in self.chunks])
        tms = np.concatenate([c[1] for c in self.chunks])
        src = np.concatenate([np.full(len(c[0]), k) for k, c in enumerate(self.chunks)])
        idx = np.concatenate([c[2] for c in self.chunks])
        order = np.lexsort((tms, held))
        held, tms, src, idx = held[order], tms[order], src[order], idx[order]
        prev_min = np.minimum.accumulate(np.concatenate([[np.inf], tms[:-1]]))
        keep = tms < prev_min - 1e-12
        held, tms, src, idx = held[keep], tms[keep], src[keep], idx[keep]
        rounded = False
        if len(held) > max_front:
            rounded = True
            lo, hi = int(held[0]), int(held[-1])
            width = max(1, -(-(hi - lo) // max_front))
            bucket = (held - lo) // width
            first = np.concatenate([[True], bucket[1:] != bucket[:-1]])
            last = np.concatenate([bucket[1:] != bucket[:-1], [True]])
            # times decrease along the front: the last entry of a bucket is its fastest
            sel = np.nonzero(last)[0]
            edge = lo + (bucket[sel] * width if optimistic
                         else np.minimum(hi, (bucket[sel] + 1) * width))
            held, tms, src, idx = edge.astype(np.int64), tms[sel], src[sel], idx[sel]
            del first
        self.held, self.time, self.src, self.idx = held, tms, src, idx
        self.info = [c[3] for c in self.chunks]
        self.chunks = []
        return rounded


def _signature(ctx: Context, a: int, b: int) -> tuple:
    """Translation-invariant description of nodes [a, b) for caching window profiles."""
    p = ctx.p

    def rel(s: int) -> tuple:
        prod = p.storage_producer[s]
        return (prod - a, p.outputs[prod].index(s), p.storage_bytes[s],
                p.storage_grad_bytes[s], ctx.last_read[s] - a, s in ctx.loss,
                tuple(k - a for k in ctx.savers[s]))

    return tuple((p.fwd_time_ms[i], p.fwd_temp_bytes[i], p.bwd_temp_bytes[i],
                  p.recomputable[i], p.packs[i], p.is_matmul(i), p.can_keep(i),
                  ctx.g_event[i], ctx.g_rest[i],
                  tuple(rel(s) for s in p.inputs[i]), tuple(rel(s) for s in p.outputs[i]),
                  tuple(rel(s) for s in p.saved[i])) for i in range(a, b))


def _run(ctx: Context, st: list[tuple[int, int]], limit: int, max_front: int,
         optimistic: bool, deadline: float,
         cache: dict) -> tuple[tuple[float, list[RegionInfo]] | None, bool]:
    p = ctx.p
    m = len(st)
    subsets = p.n_nodes <= SUBSET_MAX_NODES
    sig_ids: dict[tuple, int] = {}
    stage_sig = [sig_ids.setdefault(_signature(ctx, a, b), len(sig_ids)) for a, b in st]
    fronts: list[dict[tuple, _Front]] = [dict() for _ in range(m + 1)]
    f0 = _Front()
    f0.add(np.zeros(1, dtype=np.int64), np.zeros(1), ())
    fronts[0][()] = f0
    rounded = False

    def rel(s: int, a: int) -> tuple[int, int]:
        prod = p.storage_producer[s]
        return prod - a, p.outputs[prod].index(s)

    for t in range(m):
        if time.perf_counter() > deadline:
            raise TimeoutError
        a = st[t][0]
        for held_rel, front in fronts[t].items():
            rounded |= front.prune(max_front, optimistic)
            held_in = frozenset(p.outputs[a + r][k] for r, k in held_rel)
            for u in range(t + 1, m + 1):
                b = st[u - 1][1]
                key = (tuple(stage_sig[t:u]), u == t + 1, held_rel)
                profs = cache.get(key)
                if profs is None:
                    profs = [profile(ctx, a, b, regions, held_in)
                             for regions in _options(ctx, a, b, u == t + 1, subsets)]
                    profs = [(pr.peak_bytes, pr.residue_bytes, pr.time_ms,
                              tuple(sorted(rel(s, a) for s in pr.held_out))) for pr in profs]
                    cache[key] = profs
                for oi, (peak, residue, tms, out_rel) in enumerate(profs):
                    cnt = int(np.searchsorted(front.held, limit - peak, side="right"))
                    if cnt == 0:
                        continue
                    nxt_rel = tuple((r - (st[u][0] - a) if u < m else r, k)
                                    for r, k in out_rel)
                    dst = fronts[u].setdefault(nxt_rel, _Front())
                    dst.add(front.held[:cnt] + residue, front.time[:cnt] + tms,
                            (t, held_rel, u, oi))
    finals = [(float(f.time.min()), key, f) for key, f in fronts[m].items()
              if f.chunks and (f.prune(max_front, optimistic) or True) and len(f.time)]
    if not finals:
        return None, rounded
    best_t, _, f = min(finals, key=lambda x: x[0])
    regions: list[RegionInfo] = []
    pos = int(np.argmin(f.time))
    while True:
        info = f.info[int(f.src[pos])]
        if not info:
            break
        t, held_rel, u, oi = info
        a, b = st[t][0], st[u - 1][1]
        regions.extend(_options(ctx, a, b, u == t + 1, subsets)[oi])
        pos, f = int(f.idx[pos]), fronts[t][held_rel]
    return (best_t, sorted(regions, key=lambda r: r.a)), rounded


def solve(problem: Problem, budget_bytes: int, time_limit_s: float = 60.0,
          *, max_front: int = 2000) -> Solution:
    """Least recompute time within the budget over chain segmentations (see module doc)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    ctx = Context(problem)
    st, _ = chain_stages(problem)
    limit = budget_bytes - problem.static_bytes
    cache: dict = {}
    for attempt in range(4):
        try:
            best, rounded = _run(ctx, st, limit, max_front, False, deadline, cache)
        except TimeoutError:
            logger.warning("dp hit its %.1f s limit", time_limit_s)
            best, rounded = None, True
        if best is None:
            break
        sched = Schedule.from_segments(problem.n_nodes, [
            Region(r.a, r.b, RECOMPUTE, keep=r.keep) for r in best[1]])
        bound = best[0]
        if rounded:
            try:
                low, _ = _run(ctx, st, limit, max_front, True, deadline, cache)
                bound = low[0] if low is not None else best[0]
            except TimeoutError:
                bound = 0.0
        sol = Solution.scored(problem, sched, budget_bytes, solver="dp", started_s=t0,
                              proven_optimal=not rounded, bound_ms=bound)
        if sol.feasible:
            return sol
        logger.error("dp schedule peaks at %d > budget %d (attempt %d); tightening",
                     sol.peak_bytes, budget_bytes, attempt)
        limit -= sol.peak_bytes - budget_bytes
    mfb = memory_lower_bound(problem)
    return Solution(solver="dp", status=Status.INFEASIBLE, schedule=None,
                    budget_bytes=budget_bytes, objective_ms=None,
                    solve_time_s=time.perf_counter() - t0,
                    min_feasible_budget_bytes=mfb, min_feasible_budget_exact=False)
