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

Not a chain (a storage read two or more stages later): a storage whose skip spans a block
(an attention mask or rotary table read by every block) is pinned (`pinned_storages`): left
out of the window accounting and counted by position over the longest life any schedule can
give it (conservative: the schedule stays safe; a second pass counting only its sure life,
producer to last reader, gives a valid lower bound and the gap; when both agree the result is
OPTIMAL). Short skips across single nodes (a position id read two nodes later, logits read by
the loss after an `output` node) merge the stages they skip (exact over a slightly coarser
space; logged). Parameters, tied ones included, are static memory and their gradients are
schedule-independent constants, so a tied embedding read by the LM head is exact as is.

Speed on real graphs: stages of only `_empty` nodes (parameter placeholders) join the next
stage (`compact_stages`); window profiles are cached by a translation-invariant signature
without gradient bytes or forward times (`accounting.WindowParts` adds gradients by position,
`_run` the recompute time), so identical blocks are profiled once per window length; a
segment from stage t stops growing once the saved bytes of its largest recomputed run exceed
the room left. `simulate` is called once, on the final schedule, whose numbers are reported.

Nested regions are not produced: torch's nested non-reentrant checkpoints rerun the parent's
saves early, which rarely pays off. OPTIMAL therefore means optimal over this schedule space,
with the memory model exact.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from solvers.accounting import Context, RegionInfo, profile_parts
from solvers.bounds import memory_lower_bound
from solvers.milp import stages as problem_stages
from solvers.problem import Problem
from solvers.result import Solution, Status
from solvers.schedule import RECOMPUTE, Region, Schedule

logger = logging.getLogger(__name__)

__all__ = ["applies", "chain_stages", "compact_stages", "pinned_storages", "solve"]

SUBSET_MAX_NODES = 8  # problems this small try every kept subset per segment


def pinned_storages(problem: Problem) -> frozenset[int]:
    """Storages read across a multi-node stage (a block) after the one that makes them.

    Merging the stages such a storage spans (an attention mask or rotary table read by every
    block) would fuse the whole chain, so the DP pins it instead: it is left out of the
    window accounting and counted by position, live from its producer to the end of the
    forward and through the backward down to its producer's backward (conservative: no
    schedule holds it longer). Short skips across single nodes are merged (exact).
    """
    st = problem_stages(problem)
    stage_of = [0] * problem.n_nodes
    for t, (a, b) in enumerate(st):
        for i in range(a, b):
            stage_of[i] = t
    loss = set(problem.outputs[-1])
    out = set()
    for s, cons in enumerate(problem.consumers):
        if not cons or s in loss:
            continue
        t, u = stage_of[problem.storage_producer[s]], stage_of[cons[-1]]
        if any(st[v][1] - st[v][0] > 1 for v in range(t + 1, u)):
            out.add(s)
    return frozenset(out)


def chain_stages(problem: Problem,
                 pinned: frozenset[int] = frozenset()) -> tuple[list[tuple[int, int]], bool]:
    """Stages, merged until the problem is a chain of them; True if nothing was merged.

    Storages in `pinned` (see `pinned_storages`) are ignored when looking for skips.
    """
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
            if not cons or s in pinned:
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


def _empty(problem: Problem, i: int) -> bool:
    """Node i touches no activation memory: no storage read, made or saved, no temporaries.

    Such nodes (parameter placeholders, `size()` calls) change no live bytes wherever they
    sit, in a region or not; only their forward time differs (a rerun pays it).
    """
    p = problem
    return not (p.inputs[i] or p.outputs[i] or p.packs[i] or p.fwd_temp_bytes[i]
                or p.bwd_temp_bytes[i])


def compact_stages(problem: Problem, st: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge every stage made only of `_empty` nodes into the next stage (the last: previous).

    Exact for the DP's space: a cut next to an empty stage changes no memory, and `_runs`
    starts each region at its first non-empty node, so no schedule of the finer stages is
    lost or beaten on time.
    """
    out: list[tuple[int, int]] = []
    pending: int | None = None
    for a, b in st:
        if all(_empty(problem, i) for i in range(a, b)):
            if pending is None:
                pending = a
            continue
        out.append((a if pending is None else pending, b))
        pending = None
    if pending is not None:
        if out:
            out[-1] = (out[-1][0], problem.n_nodes)
        else:
            out.append((pending, problem.n_nodes))
    return out


def _runs(problem: Problem, a: int, b: int) -> list[tuple[int, int]]:
    out = []
    for x, y in problem.recomputable_runs(a, b):
        if not any(problem.packs[x:y]):
            continue
        while _empty(problem, x):  # leading empty nodes: same memory, rerun time saved
            x += 1
        out.append((x, y))
    return out


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
    """Translation-invariant description of nodes [a, b) for caching window profiles.

    Gradient and loss bytes and forward times are left out: `WindowParts` adds the first by
    position and `_run` the recompute time, so identical blocks share one signature although
    parameter gradients pile up along the chain and measured times differ from block to block.
    """
    p = ctx.p

    def rel(s: int) -> tuple:
        prod = p.storage_producer[s]
        lr = ctx.last_read[s]
        return (prod - a, p.outputs[prod].index(s), p.storage_bytes[s],
                p.storage_grad_bytes[s], lr - a if lr >= 0 else None, s in ctx.loss,
                tuple(k - a for k in ctx.savers[s]))

    return tuple((p.fwd_temp_bytes[i], p.bwd_temp_bytes[i],
                  p.recomputable[i], p.packs[i], p.is_matmul(i), p.can_keep(i),
                  tuple(rel(s) for s in p.inputs[i]), tuple(rel(s) for s in p.outputs[i]),
                  tuple(rel(s) for s in p.saved[i])) for i in range(a, b))


def _pin_tables(ctx: Context, pinned: frozenset[int]) -> tuple[np.ndarray, np.ndarray]:
    """`ctx.g_table` plus the pinned storages: conservative (upper) and sure (lower) lives.

    Upper: live at forward events after the producer, at reruns triggered by and backward
    events of nodes >= the producer. Lower: live at the forward events after the producer up
    to its last reader (a later reader holds it: true under every schedule).
    """
    n = ctx.n
    up = ctx.g_table.copy()
    low = ctx.g_table.copy()
    for s in pinned:
        nbytes = ctx.p.storage_bytes[s]
        prod, last = ctx.p.storage_producer[s], ctx.last_read[s]
        up[2 * n + prod + 1:3 * n] += nbytes
        up[prod:n] += nbytes
        up[n + prod:2 * n] += nbytes
        low[2 * n + prod + 1:2 * n + last + 1] += nbytes
    return up, low


def _run(ctx: Context, st: list[tuple[int, int]], limit: int, max_front: int,
         optimistic: bool, deadline: float, cache: dict, table: np.ndarray,
         pinned: frozenset[int]) -> tuple[tuple[float, list[RegionInfo]] | None, bool]:
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

    def run_lb(a: int, b: int) -> int:
        """Max over the recomputable runs of [a, b) of the bytes made and saved inside it.

        At the backward of a run's trigger, after its rerun, every such storage is alive
        (a regenerated copy, or the kept original), whatever the kept subset.
        """
        best = 0
        for x, y in _runs(p, a, b):
            key = (x, y)
            v = lb_cache.get(key)
            if v is None:
                made = {s for i in range(x, y) for s in p.saved[i]
                        if x <= p.storage_producer[s] and s not in ctx.loss
                        and s not in pinned}
                v = lb_cache[key] = sum(p.storage_bytes[s] for s in made)
            best = max(best, v)
        return best

    lb_cache: dict[tuple[int, int], int] = {}
    fwd = np.asarray(p.fwd_time_ms, dtype=float)
    fwd_sum = np.concatenate([[0.0], np.cumsum(fwd)])

    for t in range(m):
        if time.perf_counter() > deadline:
            raise TimeoutError
        a = st[t][0]
        for held_rel, front in fronts[t].items():
            rounded |= front.prune(max_front, optimistic)
            held_in = frozenset(p.outputs[a + r][k] for r, k in held_rel)
            room = limit - int(front.held[0])  # the least held bytes of this front
            for u in range(t + 1, m + 1):
                b = st[u - 1][1]
                # every multi-stage option recomputes the recomputable runs of [a, b): the
                # saved bytes of its largest run are a lower bound on its peak that only grows
                # with u, so once it exceeds the room no longer segment from t can fit
                if u > t + 1 and run_lb(a, b) > room:
                    break
                key = (tuple(stage_sig[t:u]), u == t + 1, held_rel)
                profs = cache.get(key)
                if profs is None:
                    # profiling a long window costs time linear in its length: check the
                    # deadline per window and per option, not only per stage
                    if time.perf_counter() > deadline:
                        raise TimeoutError
                    profs = []
                    for regions in _options(ctx, a, b, u == t + 1, subsets):
                        if time.perf_counter() > deadline:
                            raise TimeoutError
                        parts = profile_parts(ctx, a, b, regions, held_in, pinned)
                        spans = [(r.a - a, r.stop - a) for r in regions if r.packs]
                        kept = [k - a for r in regions if r.packs for k in r.keep if k < r.stop]
                        profs.append((parts, tuple(sorted(rel(s, a) for s in parts.held_out)),
                                      spans, np.asarray(kept, dtype=np.int64)))
                    cache[key] = profs
                for oi, (parts, out_rel, spans, kept) in enumerate(profs):
                    peak = parts.peak(ctx, a, table)
                    # recompute time by position (the window's structure is shared)
                    tms = float(sum(fwd_sum[a + y] - fwd_sum[a + x] for x, y in spans)
                                - fwd[kept + a].sum())
                    cnt = int(np.searchsorted(front.held, limit - peak, side="right"))
                    if cnt == 0:
                        continue
                    nxt_rel = tuple((r - (st[u][0] - a) if u < m else r, k)
                                    for r, k in out_rel)
                    dst = fronts[u].setdefault(nxt_rel, _Front())
                    dst.add(front.held[:cnt] + parts.residue_bytes,
                            front.time[:cnt] + tms, (t, held_rel, u, oi))
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
    pinned = pinned_storages(problem)
    st = compact_stages(problem, chain_stages(problem, pinned)[0])
    up, low = _pin_tables(ctx, pinned)
    limit = budget_bytes - problem.static_bytes
    cache: dict = {}
    for attempt in range(4):
        try:
            best, rounded = _run(ctx, st, limit, max_front, False, deadline, cache, up, pinned)
        except TimeoutError:
            logger.warning("dp hit its %.1f s limit", time_limit_s)
            best, rounded = None, True
        if best is None:
            break
        sched = Schedule.from_segments(problem.n_nodes, [
            Region(r.a, r.b, RECOMPUTE, keep=r.keep) for r in best[1]])
        bound = best[0]
        exact = not rounded and not pinned
        if not exact:
            try:
                lower, _ = _run(ctx, st, budget_bytes - problem.static_bytes, max_front, True,
                                deadline, cache, low, pinned)
                bound = lower[0] if lower is not None else best[0]
            except TimeoutError:
                bound = 0.0
        sol = Solution.scored(problem, sched, budget_bytes, solver="dp", started_s=t0,
                              proven_optimal=exact, bound_ms=bound)
        if sol.feasible and not exact and sol.objective_ms <= bound + 1e-9 * max(1.0, bound):
            sol = Solution.scored(problem, sched, budget_bytes, solver="dp", started_s=t0,
                                  proven_optimal=True)
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
