"""Exact CP-SAT model of the execution model: which regions to recompute, which nodes to keep.

Decision: one boolean per candidate RECOMPUTE region `(start, stop, keep)`; chosen regions
do not overlap, every other node is STORE. Memory is `solvers.accounting`'s decomposition of
`simulate` written as linear constraints: per storage, booleans `w` that say whether some
holder still holds it at each of its possible release points (a STORE saver, a frame, the SAC
cache, a rerun's saved copy); per event, the live bytes are constants plus running sums of
those `w` (chained integer variables, so the model stays linear in size); each candidate's
rerun adds its own precomputed profile on top of the bytes live when it starts. The model's
peak equals `simulate`'s for every non-nested schedule, so OPTIMAL means: least recompute
time among all schedules made of non-overlapping candidate regions whose simulated peak fits
the budget. The objective charges each chosen candidate its `RegionInfo.time_ms`: the rerun's
forward time plus `Problem.checkpoint_overhead_ms` (fixed per candidate: it depends only on
the region's start, early stop and keep), so it is `simulate`'s recompute time exactly, up
to rounding to 1e-6 ms per region. Candidates: for small problems every region and every
kept subset (exactly the brute-force space); for larger ones, regions between stage
boundaries (blocks, single nodes outside blocks) with keep = nothing or the matmul-like
nodes. Only nodes that `Problem.can_keep` are ever kept. The answer is re-scored with
`simulate`; a mismatch would add a no-good cut and re-solve (it is logged as a bug).

Why CP-SAT and not MathOpt + HiGHS/SCIP: memory constraints are in bytes (10^10 and more)
and must hold exactly at the budget; CP-SAT is integer-exact where a floating-point MIP
accepts violations of its feasibility tolerance, and it proves optimality on these models
(tested: <= 8 nodes in milliseconds; the 24-block chain in about a second).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Literal, NamedTuple

from ortools.sat.python import cp_model

from solvers.accounting import Context, RegionInfo
from solvers.bounds import memory_lower_bound
from solvers.clock import with_step_ms
from solvers.frame import worth_checkpointing
from solvers.problem import Problem
from solvers.region_analysis import BWD, STEP, rerun_savers
from solvers.result import Solution, Status
from solvers.schedule import RECOMPUTE, Region, Schedule
from solvers.simulate import simulate
from solvers.spaces import FULL_KEEP_MAX_LEN, SearchSpace, flat_regions

logger = logging.getLogger(__name__)

__all__ = ["MinPeak", "candidates", "complete", "min_peak", "solve"]

TIME_SCALE = 1_000_000  # objective units per ms
FULL_MAX_CANDIDATES = 4000


def _keep_options(problem: Problem, a: int, b: int, full: bool) -> list[frozenset[int]]:
    if full:
        nodes = [i for i in range(a, b) if problem.can_keep(i)]
        return [frozenset(c) for r in range(len(nodes) + 1)
                for c in itertools.combinations(nodes, r)]
    opts = [frozenset()]
    mm = problem.matmul_keep(a, b)
    if mm and len(mm) < b - a:
        opts.append(mm)
    return opts


def _check(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise TimeoutError


def candidates(ctx: Context, *, full: bool | None = None,
               deadline: float | None = None) -> tuple[list[RegionInfo], SearchSpace]:
    """Candidate regions and the space of schedules they span (`complete(space)`: every
    flat schedule, brute force's space).

    Raises ``TimeoutError`` past ``deadline`` (a ``time.perf_counter()`` value).
    """
    p = ctx.p
    n = p.n_nodes
    if p.module_spans is not None:
        return _span_candidates(ctx, full, deadline)
    if full is None:
        count = sum(2 ** min(b - a, 30) for a in range(n) for b in range(a + 1, n + 1))
        full = n <= 2 * FULL_KEEP_MAX_LEN and count <= FULL_MAX_CANDIDATES
    if full:
        cuts = list(range(n + 1))
    else:
        cuts = [a for a, _ in p.stages()] + [n]
    out: list[RegionInfo] = []
    for ia, a in enumerate(cuts):
        for b in cuts[ia + 1:]:
            if not all(p.recomputable[a:b]):
                break
            if not worth_checkpointing(p, a, b):
                continue  # never reruns; STORE is as good (frame rule 5)
            _check(deadline)
            for keep in _keep_options(p, a, b, full and b - a <= FULL_KEEP_MAX_LEN):
                out.append(ctx.region(a, b, keep))
    if not full:
        return out, flat_regions(p, "stages", "matmuls")
    all_short = all(b - a <= FULL_KEEP_MAX_LEN for a in range(n)
                    for b in range(a + 1, n + 1) if all(p.recomputable[a:b]))
    return out, flat_regions(p, "any", "any" if all_short else "short-any")


def complete(space: SearchSpace) -> bool:
    """Whether `space` holds every flat schedule (CP-SAT's answers are then brute force's)."""
    return space.cuts == "any" and space.keep == "any"


def _span_candidates(ctx: Context, full: bool | None,
                     deadline: float | None = None) -> tuple[list[RegionInfo], SearchSpace]:
    """Every module span that reruns, each with every kept subset when they are few
    (complete), else with keep = nothing or its matmul-like nodes."""
    p = ctx.p
    spans = [(sp.start, sp.stop) for sp in p.module_spans or ()
             if worth_checkpointing(p, sp.start, sp.stop)]
    if full is None:
        count = sum(2 ** min(sum(p.can_keep(i) for i in range(a, b)), 30) for a, b in spans)
        full = count <= FULL_MAX_CANDIDATES
    out = []
    for a, b in spans:
        _check(deadline)
        out.extend(ctx.region(a, b, keep) for keep in _keep_options(p, a, b, full))
    return out, flat_regions(p, "any", "any" if full else "matmuls")


def _rerun_delta(ctx: Context, r: RegionInfo) -> int:
    """Largest rerun event of `r` (a region without children: one rerun) minus the bytes
    live when it starts."""
    p = ctx.p
    (rerun,) = r.reruns
    steps = rerun.rules.rerun_steps(rerun.start)
    pos = {i: t for t, i in enumerate(steps)}
    diff = [0] * (len(steps) + 2)
    storage, _, step, kind, node, _ = (c.tolist() for c in r.regen_cols)
    for s, i, k, j in zip(storage, step, kind, node, strict=True):
        start, end = pos[i] + 1, len(steps) if k == BWD else pos[j]  # BWD: past the rerun
        if end >= start:
            diff[start] += p.storage_bytes[s]
            diff[end + 1] -= p.storage_bytes[s]
    for s, (k, j, _) in r.held.items():  # a kept original the rerun takes, last read at j
        if k == STEP:
            diff[pos[j] + 1] -= p.storage_bytes[s]
    best, live = None, 0
    for t, c in enumerate(rerun.step_const):
        live += diff[t]
        best = c + live if best is None else max(best, c + live)
    return int(best or 0)


def _regen_live(r: RegionInfo, nbytes: list[int]) -> list[int]:
    """Per node j in [r.a, r.trigger]: rerun-made saved bytes still live at backward j."""
    live = [0] * (r.trigger - r.a + 1)
    storage, _, _, kind, node, _ = (c.tolist() for c in r.regen_cols)
    for s, k, j in zip(storage, kind, node, strict=True):
        if k == BWD:  # held until the backward of its earliest saver has run
            live[j - r.a] += nbytes[s]
    for t in range(1, len(live)):
        live[t] += live[t - 1]
    return live


@dataclass
class _Model:
    model: cp_model.CpModel
    x: list[cp_model.IntVar]
    cands: list[RegionInfo]
    budget: cp_model.IntVar | int


class _Always(Enum):
    """A holder that keeps its storage whatever the schedule (a saver no candidate covers)."""

    HELD = "held"


ALWAYS = _Always.HELD


@dataclass(frozen=True)
class _SaverHolds:
    """Node `k` saves the storage for its backward unless a chosen candidate reruns it."""

    k: int


# a holder of a storage: a candidate's index (held iff chosen) or a saver
_Holder = int | _SaverHolds


def _build(ctx: Context, cands: list[RegionInfo], budget: int | None,
           deadline: float | None = None) -> _Model:
    """The CP-SAT model; `budget=None` makes the budget a variable (minimise the peak).

    Raises ``TimeoutError`` past ``deadline``."""
    p = ctx.p
    total = sum(p.storage_bytes) + ctx.loss_bytes + max(ctx.alloc) + 1
    md = cp_model.CpModel()
    x = [md.NewBoolVar(f"x{c}") for c in range(len(cands))]
    cover: dict[int, list[int]] = defaultdict(list)
    for c, r in enumerate(cands):
        for i in range(r.a, r.b):
            cover[i].append(c)
    for lst in cover.values():
        if len(lst) > 1:
            md.AddAtMostOne(x[c] for c in lst)
    upper = p.static_bytes + total + max(*ctx.g_event, *p.gradient_events.released) \
        + max(p.bwd_temp_bytes) \
        + max(p.fwd_event_bytes) + sum(p.storage_bytes)
    B: cp_model.IntVar | int = md.NewIntVar(0, upper, "budget") if budget is None else budget

    def indicator(h: _Holder) -> cp_model.LinearExprT | _Always:
        if isinstance(h, int):
            return x[h]
        if not cover.get(h.k):
            return ALWAYS
        return 1 - sum(x[c] for c in cover[h.k])

    delta_at, held_after = _hold_chains(md, ctx, _holders(ctx, cands), indicator, deadline)
    _backward_constraints(md, ctx, cands, x, B, delta_at, total, deadline)
    _forward_constraints(md, ctx, held_after, B, total)
    return _Model(md, x, cands, B)


def _bwd(j: int) -> int:
    """The position of backward event j: `_released(j)` comes after it in time, then
    `_rerun(j - 1)`; a storage released at position q is held at positions >= q."""
    return 3 * j + 1


def _released(j: int) -> int:
    """The position of node j's moment after it released its saved tensors."""
    return 3 * j


def _rerun(j: int) -> int:
    """The position just before backward event j, where reruns triggered at j start."""
    return 3 * j + 2


def _holders(ctx: Context, cands: list[RegionInfo]) -> dict[int, list[tuple[int, _Holder]]]:
    """Per storage, (release position, holder): `_bwd`, `_released` and `_rerun`."""
    p = ctx.p
    holders: dict[int, list[tuple[int, _Holder]]] = defaultdict(list)
    for s in range(p.n_storages):
        if s in ctx.loss:
            continue
        for k in ctx.savers[s]:
            holders[s].append((_bwd(k), _SaverHolds(k)))
    for c, r in enumerate(cands):
        if not r.packs:  # the frame never reruns
            continue
        inputs = frozenset(r.inputs)
        for s in r.held:  # its inputs and SAC cache
            if s in ctx.loss:  # caller-held: a constant already
                continue
            if s in inputs or not r.rules.takes_cached(r.a, p.storage_producer[s]):
                holders[s].append((_bwd(r.death), c))  # until the frame dies
            else:  # a kept output the rerun takes: until the rerun ends, and its savers
                # (the latest alone, `r.held[s]`, is the same model, but CP-SAT then searches
                # otherwise)
                holders[s].append((_rerun(r.trigger), c))
                holders[s].extend((_bwd(j), c) for j in rerun_savers(ctx, s, r.stop))
    return holders


def _hold_chains(md: cp_model.CpModel, ctx: Context,
                 holders: dict[int, list[tuple[int, _Holder]]],
                 indicator: Callable[[_Holder], cp_model.LinearExprT | _Always],
                 deadline: float | None) -> tuple[dict[int, list], dict[int, object]]:
    """Whether each storage is still held at each release position, as a chain of booleans
    that only fall; returns the bytes released per position ([(bytes, expr)]) and, per
    storage, whether it is held at all after the forward (a boolean, or ALWAYS)."""
    nbytes = ctx.p.storage_bytes
    delta_at: dict[int, list] = defaultdict(list)
    held_after: dict[int, object] = {}
    for s, hs in holders.items():
        _check(deadline)
        prev: object = None
        by_pos: dict[int, list] = defaultdict(list)
        for pos, h in hs:
            by_pos[pos].append(indicator(h))
        for pos in sorted(by_pos):
            exprs = by_pos[pos]
            if prev is ALWAYS or any(e is ALWAYS for e in exprs):
                if prev is not ALWAYS:
                    delta_at[pos].append((nbytes[s], 1 if prev is None else 1 - prev))
                prev = ALWAYS
                continue
            w = md.NewBoolVar(f"w{s}_{pos}")
            for e in exprs:
                md.Add(w >= e)
            if prev is not None:
                md.Add(w >= prev)
                delta_at[pos].append((nbytes[s], w - prev))
            else:
                delta_at[pos].append((nbytes[s], w))
            prev = w
        held_after[s] = prev
    return delta_at, held_after


def _backward_constraints(md: cp_model.CpModel, ctx: Context, cands: list[RegionInfo],
                          x: list, B: object, delta_at: dict[int, list], total: int,
                          deadline: float | None) -> None:
    """Every backward event, each node's moment after its release (`_released`), and every
    rerun's largest event fits the budget."""
    p = ctx.p
    n = p.n_nodes
    # positions 0 .. 3n-1: A[pos] = bytes of gen-0 storages held there
    A = []
    acc = 0
    for pos in range(3 * n):
        terms = delta_at.get(pos, [])
        if not terms:
            A.append(acc)
            continue
        v = md.NewIntVar(0, total, f"A{pos}")
        md.Add(v == acc + sum(b * e for b, e in terms))
        A.append(v)
        acc = v
    regen_terms: dict[int, list] = defaultdict(list)  # at backward event j
    regen_after: dict[int, list] = defaultdict(list)  # at j's moment after its release
    for c, r in enumerate(cands):
        if not r.packs:  # the frame never reruns
            continue
        live = _regen_live(r, p.storage_bytes)
        for j, g in enumerate(live, start=r.a):
            if g:
                regen_terms[j].append(g * x[c])
            if j > r.a and live[j - 1 - r.a]:  # those held to j's backward are gone
                regen_after[j].append(live[j - 1 - r.a] * x[c])
    grads = p.gradient_events
    for j in range(n):
        md.Add(p.static_bytes + ctx.g_event[j] + p.bwd_temp_bytes[j] + ctx.loss_bytes
               + A[_bwd(j)] + sum(regen_terms.get(j, [])) <= B)
        if ctx.releasing[j]:
            md.Add(p.static_bytes + grads.released[j] + ctx.loss_bytes + A[_released(j)]
                   + sum(regen_after.get(j, [])) <= B)
    for c, r in enumerate(cands):
        _check(deadline)
        if not r.packs:  # the frame never reruns
            continue
        rest = p.static_bytes + ctx.g_rest[r.trigger] + ctx.loss_bytes
        delta = _rerun_delta(ctx, r)
        big = rest + total + delta
        md.Add(rest + A[_rerun(r.trigger)] + delta <= B + big * (1 - x[c]))


def _forward_constraints(md: cp_model.CpModel, ctx: Context, held_after: dict[int, object],
                         B: object, total: int) -> None:
    """Every forward event fits: storages read later are live; past their last read, one is
    held iff its hold chain says so."""
    p = ctx.p
    n = p.n_nodes
    nbytes = p.storage_bytes
    enter: dict[int, list] = defaultdict(list)
    read_live = [0] * (n + 1)
    for s in range(p.n_storages):
        if s in ctx.loss:  # a constant from its producer on (`ctx.held_fwd`)
            continue
        prod, lr = p.storage_producer[s], ctx.last_read[s]
        if lr > prod:
            read_live[prod + 1] += nbytes[s]
            read_live[lr + 1] -= nbytes[s]
        h = held_after.get(s)
        if h is not None and max(prod, lr) + 1 < n:
            enter[max(prod, lr) + 1].append((nbytes[s], 1 if h is ALWAYS else h))
    live_read = 0
    hsum = 0
    for i in range(n):
        live_read += read_live[i]
        if enter.get(i):
            v = md.NewIntVar(0, total, f"H{i}")
            md.Add(v == hsum + sum(b * e for b, e in enter[i]))
            hsum = v
        md.Add(p.static_bytes + ctx.alloc[i] + p.fwd_event_bytes[i] + int(ctx.held_fwd[i])
               + live_read + hsum <= B)


def _schedule(n: int, chosen: list[RegionInfo]) -> Schedule:
    regions = [Region(r.a, r.b, RECOMPUTE, keep=r.keep) for r in chosen]
    return Schedule.from_segments(n, regions)


# A deterministic search stops on CP-SAT's measure of work; seconds only stop a runaway, at
# this many per unit of work. Not 3: on a quiet 2-core machine the tiny GPT's search did 3.2
# units in 9.5 s, so beside two other jobs a net of 3 s a unit stopped it before its proof
# and the "same answer on a loaded machine" changed (fresh-clone CI, 2026-12-01).
WALL_S_PER_WORK_UNIT = 10.0

# How CP-SAT best proves each model, measured. The least-time model's proofs come from the LP
# relaxation of its peak constraints, which CP-SAT's fullest linearization (its `max_lp`
# worker) tightens: the tiny zoo GPT at 40 %, one worker, 8.9 s -> 0.8 s to prove (3.2 ->
# 0.26 units of work); two workers, 13.2 s -> 1.5 s with `max_lp` in place of `default_lp`.
# The least-peak model proves sooner without it (1.6 s -> 3.9 s). Deterministic, a binary
# search on the peak (`binary_search_num_conflicts` 100) proved DeepLabV3-MobileNetV3's least
# peak in 5 units where 10 found nothing, and Inception-v3's 181.1 MiB where 185.0 MiB was
# found unproven (`benchmarks/results/cpsat-settings.md`). (Its least-peak schedule of the
# U-Net's traced op ranges once measured 0.96 % below its prediction: the simulator counted
# a max-pool's indices at the gradient sum after the pool's backward, which the engine runs
# once the pool released them; `lifetimes.GradientEvents.released`.)
FULL_LP_LEVEL = 2
FULL_LP_WORKERS = ("max_lp",)
PEAK_PROBE_CONFLICTS = 100


def _solver(time_limit_s: float, workers: int = 2, deterministic: bool = False,
            objective: Literal["time", "peak"] = "time") -> cp_model.CpSolver:
    """CP-SAT with a wall-time limit, or (``deterministic``) one worker, a fixed seed and a
    deterministic time limit, so the same model always gets the same answer; set as the
    model's ``objective`` proves best (above)."""
    sol = cp_model.CpSolver()
    params = sol.parameters
    if deterministic:
        params.num_workers = 1
        params.random_seed = 0
        params.max_deterministic_time = max(0.05, time_limit_s)
        params.max_time_in_seconds = max(0.5, WALL_S_PER_WORK_UNIT * time_limit_s)
        if objective == "time":
            params.linearization_level = FULL_LP_LEVEL
        else:
            params.binary_search_num_conflicts = PEAK_PROBE_CONFLICTS
    else:
        params.num_workers = workers
        params.max_time_in_seconds = max(0.05, time_limit_s)
        if objective == "time":
            params.subsolvers.extend(FULL_LP_WORKERS)
    return sol


def _say_if_the_clock_stopped(solver: cp_model.CpSolver, status: int) -> None:
    """A deterministic search that the wall-clock net stopped before its work limit (and
    before an answer it proved) may answer otherwise on a quieter machine: said as a
    warning, with what to do."""
    params = solver.parameters
    if status in (cp_model.OPTIMAL, cp_model.INFEASIBLE) or \
            solver.deterministic_time >= 0.99 * params.max_deterministic_time:
        return
    logger.warning(
        "cpsat: a deterministic search stopped at its wall-clock safety net (%.0f s) after "
        "%.2f of its %.2f units of work: the machine is too busy for the same answer as on a "
        "quiet one; give it a longer time limit or fewer jobs beside it",
        params.max_time_in_seconds, solver.deterministic_time, params.max_deterministic_time)


class MinPeak(NamedTuple):
    """CP-SAT's lowest peak: `bytes` (0: none found), its `schedule`, and `optimal_over`,
    the space over which no schedule peaks lower (None unless CP-SAT proved it)."""

    bytes: int
    schedule: Schedule | None
    optimal_over: SearchSpace | None

    @property
    def proven(self) -> bool:
        """Proven over every flat schedule (the candidates are complete)."""
        return self.optimal_over is not None and complete(self.optimal_over)


def min_peak(problem: Problem, time_limit_s: float = 10.0,
             ctx: Context | None = None, *, deterministic: bool = False,
             wall_s: float | None = None) -> MinPeak:
    """Lowest simulated peak over the candidate regions' space (see `MinPeak`); otherwise
    the best found, an upper bound on the least peak of non-nested schedules. ``wall_s``:
    seconds the whole call may take (a deterministic limit is CP-SAT's measure of work,
    which a busy machine turns into more seconds)."""
    ctx = ctx or Context(problem)
    started = time.perf_counter()
    deadline = started + min(time_limit_s, wall_s if wall_s is not None else time_limit_s)
    if deterministic and wall_s is None:
        deadline = math.inf  # the model built whatever it takes: work decides, not seconds
    try:
        cands, space = candidates(ctx, deadline=deadline)
        mdl = _build(ctx, cands, None, deadline)
    except TimeoutError:
        return MinPeak(0, None, None)
    mdl.model.Minimize(mdl.budget)
    left = time_limit_s if deterministic else deadline - time.perf_counter()
    solver = _solver(left, deterministic=deterministic, objective="peak")
    if wall_s is not None:
        solver.parameters.max_time_in_seconds = max(
            0.05, min(solver.parameters.max_time_in_seconds,
                      started + wall_s - time.perf_counter()))
    st = solver.Solve(mdl.model)
    if deterministic and wall_s is None:
        _say_if_the_clock_stopped(solver, st)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return MinPeak(0, None, None)
    chosen = [r for r, v in zip(cands, mdl.x, strict=True) if solver.Value(v)]
    sched = _schedule(problem.n_nodes, chosen)
    peak = simulate(problem, sched).peak_bytes
    # the model's peak is simulate's for every candidate schedule: trust a proof only
    # where the two agree on the answer
    exact = peak == round(solver.ObjectiveValue())
    return MinPeak(peak, sched, space if st == cp_model.OPTIMAL and exact else None)


def solve(problem: Problem, budget_bytes: int, time_limit_s: float = 60.0,
          *, hint: Schedule | None = None, deterministic: bool = False) -> Solution:
    """Least recompute time with simulated peak <= budget over the model's schedule space.
    ``deterministic``: one worker, a fixed seed and ``time_limit_s`` of CP-SAT's own measure
    of work (about seconds on a quiet machine), the model built whatever it takes: the same
    answer, status and bound on a loaded machine as on a quiet one."""
    t0 = time.perf_counter()
    ctx = Context(problem)
    deadline = None if deterministic else t0 + time_limit_s
    try:
        cands, space = candidates(ctx, deadline=deadline)
        mdl = _build(ctx, cands, budget_bytes, deadline)
    except TimeoutError:
        logger.info("cpsat: building the model took the whole %.1f s", time_limit_s)
        return _no_schedule(problem, budget_bytes, t0).timed_out()
    obj = sum(round(r.time_ms * TIME_SCALE) * v for r, v in zip(cands, mdl.x, strict=True))
    mdl.model.Minimize(obj)
    if hint is not None:
        chosen = {(r.start, r.stop, r.keep) for r in hint.regions if r.is_recompute}
        for r, v in zip(cands, mdl.x, strict=True):
            mdl.model.AddHint(v, (r.a, r.b, r.keep) in chosen)
    logger.debug("cpsat: %d candidates (%s), %d nodes", len(cands), space, problem.n_nodes)
    while True:
        left = time_limit_s if deterministic else time_limit_s - (time.perf_counter() - t0)
        solver = _solver(left, deterministic=deterministic, objective="time")
        st = solver.Solve(mdl.model)
        if deterministic:
            _say_if_the_clock_stopped(solver, st)
        if st == cp_model.INFEASIBLE:
            mfb = _min_budget(problem, ctx, left if deterministic
                              else time_limit_s - (time.perf_counter() - t0), deterministic)
            return _no_schedule(problem, budget_bytes, t0, mfb)
        if st == cp_model.MODEL_INVALID:
            raise RuntimeError(f"cpsat: invalid model ({mdl.model.Validate()})")
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):  # UNKNOWN: the limit came first
            logger.info("cpsat found no schedule in %.1f s", time_limit_s)
            return _no_schedule(problem, budget_bytes, t0).timed_out()
        chosen_x = [v for v in mdl.x if solver.Value(v)]
        chosen = [r for r, v in zip(cands, mdl.x, strict=True) if solver.Value(v)]
        sched = _schedule(problem.n_nodes, chosen)
        bound = solver.BestObjectiveBound() / TIME_SCALE
        sol = Solution.scored(problem, sched, budget_bytes, solver="cpsat", started_s=t0,
                              proven_optimal=st == cp_model.OPTIMAL,
                              bound_ms=with_step_ms(problem, min(
                                  bound, solver.ObjectiveValue() / TIME_SCALE)),
                              space=space)
        if sol.feasible:
            return sol
        if time.perf_counter() - t0 > time_limit_s:
            return sol.timed_out()
        logger.error("cpsat model/simulate mismatch on %s; adding a no-good cut",
                     sched.describe())
        mdl.model.AddBoolOr([v.Not() for v in chosen_x] +
                            [v for v in mdl.x if not solver.Value(v)])


def _no_schedule(problem: Problem, budget_bytes: int, started_s: float,
                 min_budget: tuple[int, bool] | None = None) -> Solution:
    """INFEASIBLE, with the least budget proven to be needed (or the memory lower bound)."""
    mfb, exact = min_budget or (memory_lower_bound(problem), False)
    return Solution(solver="cpsat", status=Status.INFEASIBLE, schedule=None,
                    budget_bytes=budget_bytes, objective_ms=None,
                    solve_time_s=time.perf_counter() - started_s,
                    min_feasible_budget_bytes=mfb, min_feasible_budget_exact=exact)


def _min_budget(problem: Problem, ctx: Context, time_limit_s: float,
                deterministic: bool = False) -> tuple[int, bool]:
    found = min_peak(problem, time_limit_s, ctx, deterministic=deterministic) \
        if time_limit_s > 0.1 else MinPeak(0, None, None)
    if found.bytes == 0:
        return memory_lower_bound(problem), False
    return found.bytes, found.proven
