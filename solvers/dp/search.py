"""Exact dynamic program over chains of stages (Rotor-style, for the checkpoint execution model).

Stages are the problem's blocks and the single nodes between them. When every storage made in
a stage is read only in that stage or the next (a chain), `simulate`'s peak splits into
segments: the peak of a schedule is the max over its segments of (bytes the earlier segments
still hold + the segment's own local peak), where the local peak and the held bytes depend
only on the segment, its option and which of its inputs the previous segment holds
(`solvers.accounting.profile`). The DP walks the stages keeping, per (stage, inputs-held
state), the Pareto front of (bytes held so far, recompute time); a segment of stages is STORE
or one RECOMPUTE region per recomputable run, with keep = nothing, the matmul-like nodes, or,
for tiny problems, any subset (only nodes that `Problem.can_keep` are ever kept); a segment
of 2..`NEST_MAX_STAGES` stages may also be one parent region with one nested child per stage
(`nested_options`: Rotor's two-level persistent checkpoints, for budgets below every flat
schedule; children keep nothing or their matmuls). Recompute times are `solvers.clock`'s,
as `simulate` charges them (`_rerun_ms`, through prefix sums). Fronts
larger than `max_front` are thinned to one entry per memory bucket (`Front.prune`): the
upper-bound pass keeps each bucket's fastest real entry, a second, lower-bound pass pairs
that time with the bucket's least held bytes; the difference is reported as the gap.

Keep fronts (`keep_front`, the default beyond `SUBSET_MAX_NODES` nodes): a stage's outermost
region (a layer's call; each call inside a layer that is no call; a stage's recomputable run
without module spans, `top_regions`) may keep any subset of its ops. The upper pass
offers each point of its Pareto front of (bytes held past the forward, rerun time saved),
the hand-written policies (linear outputs, matmuls) and sets that stay under a few caps on the
window's peak (`solvers.keep`), each with its exact window profile; the lower-bound pass
pairs each front point with the floor no keep set goes below, so its optimum bounds every
subset. With keep fronts the answer is proven by that second pass (gap reported), not by the
upper pass alone.

Regions inside a layer (`solvers.dp.inner`, with module spans): a single stage may also
recompute a set of disjoint regions strictly inside it, module calls or op ranges of traced
forwards at any depth, each keeping nothing or its matmuls (an attention's dropout and the
matmul reading it, an MLP's activation and the projection reading it). The sets offered are
a front of (bytes freed, rerun time) built from each region's own profile; each is then
profiled exactly like any other option, in both passes, so the bound holds over the space
with those sets in it.

Long chains (more than `FULL_SPAN_STAGES` stages): segments are capped at a span of 16 (8
beyond `SPLIT_RELAXED_STAGES`) stages, doubled while time is left. Each span's upper-bound
pass is a real schedule; its lower-bound pass also admits longer segments, relaxed to
prefix-sum bounds on their peak, residue and time (`solvers.dp.bounds`), so it bounds the
full flat space (nested options are left out on long chains: the bounds do not cover them).
When the widest pass thinned its fronts and left a gap, both passes run again with longer
fronts (`solve`): on a long chain the held bytes span a wide range, so the memory buckets
are coarse and thinning, not the space, makes most of the gap.

Not a chain (a storage read two or more stages later): `solvers.dp.chain` pins, merges or
detaches such storages (merging stages so as to keep the boundaries at module calls; where
nothing of that chain fits, the chain that keeps the first boundary after each producer is
solved too, `_other_chain_differs`);
parameters, tied ones included, are static memory and their gradients schedule-independent
constants, so a tied embedding read by the LM head is exact.
The lower-bound pass counts a pinned storage as held to its saver's backward where only a
region rerunning longer than the answer could free it earlier, and splits the schedules
where a cheaper region could (`solvers.dp.pinned`); the upper passes, which count it by its
conservative life, also try the schedules whose segments keep all its nodes together, where
it is counted exactly (`_covered_upper_passes`); and a lower-bound pass's own path, which
counts it by its sure life, is a schedule of the space too: `simulate` scores those faster
than the answer, and the fastest that fits is taken (`_try_bound_paths`).

Speed on real graphs: window profiles are cached by a translation-invariant signature
without gradient bytes, forward times or the storages left out of the windows, such as the
rotary tables every layer reads (`dp_options.window_signature`;
`accounting.WindowParts` adds gradients by position, `_run` the recompute time), so
identical blocks are profiled once per window length; a segment from stage t stops growing
once the saved bytes of its largest recomputed run exceed the room left. `simulate` is
called on the passes' answers only, whose numbers are reported. Measured speed and gaps:
`benchmarks/solver_scaling.py` and its results.

OPTIMAL means optimal over this schedule space (flat segments, plus two-level nesting with
one child per stage), with the memory and time model exactly `simulate`'s; deeper nesting
and other child splits are not searched.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from solvers.accounting import (
    BACKWARD,
    FORWARD,
    RELEASED,
    RERUN,
    Context,
    WindowParts,
    profile_parts,
    table_slice,
)
from solvers.bounds import memory_lower_bound
from solvers.clock import rerun_overhead_ms, with_step_ms
from solvers.dp import chain
from solvers.dp.bounds import SpanBounds
from solvers.dp.chain import (
    applies,
    chain_stages,
    compact_stages,
    long_skips,
    pinned_storages,
    stage_index,
)
from solvers.dp.inner import inner_options
from solvers.dp.options import (
    RerunRel,
    Spec,
    flat_options,
    flat_rerun_rel,
    nested_options,
    regions_at,
    reruns_rel,
    span_options,
    top_regions,
    window_signature,
    window_spec,
)
from solvers.dp.pinned import (
    Cover,
    PinnedHold,
    ReaderHold,
    bound_over_holds,
    cut_table,
    held_table,
    one_stage_holders,
    pinned_holds,
    reader_holds,
    reader_split_bound,
    sure_holds,
)
from solvers.dp.space import stop_limits
from solvers.front import Front
from solvers.keep import KeepSpace, under_caps
from solvers.keep import choices as keep_choices
from solvers.problem import Problem
from solvers.result import Solution, Status
from solvers.schedule import Region, Schedule
from solvers.spaces import SearchSpace, chain_segments

logger = logging.getLogger(__name__)

__all__ = ["applies", "chain_stages", "compact_stages", "pinned_storages",
           "solve"]

SUBSET_MAX_NODES = 8  # problems this small try every kept subset per segment
# chains of up to this many stages get the full segment space in one pass; longer ones grow
# the longest segment from FIRST_SPAN stages, doubling, each step with a proven lower bound
FULL_SPAN_STAGES = 160
FIRST_SPAN = 16
NEST_MAX_STAGES = 8  # longest window given a two-level (nested) option
SPLIT_RELAXED_STAGES = 160
RELAXED_FRONT = 128  # lower-bound entries a relaxed window hands on (optimistic corners)
TIGHT_SPANS = 3  # beyond SPLIT_RELAXED_STAGES: relaxed windows up to 3 spans long are tight
MAX_FRONT_GROWTH = 4  # a gap left by thinned fronts: passes again with fronts up to 4x longer
GROWN_GAP = 0.01  # ... while the gap is above 1 % and the last growth raised the bound
FINER_MAX_NODES = 2000  # `_raise_bound`
BOUND_PATHS = "bound paths"  # the cache's key for the lower-bound passes' schedules (`_run`)
BOUND_PATHS_SCORED = 4  # of those, the most `_try_bound_paths` scores at a time


class _Option(NamedTuple):
    """One option of a window, placeable at any window with its signature: its parts, the
    outputs it holds on (relative), its reruns (`reruns_rel`), its regions (`window_spec`) and
    the rerun time it saves beyond what `reruns` says (an optimistic keep corner's)."""

    parts: WindowParts
    out_rel: tuple
    reruns: list[RerunRel]
    spec: Spec
    saved_ms: float = 0.0


class _Step(NamedTuple):
    """A back-pointer: the front entry came from segment [stage `start`, stage `stop`) with
    option `option` of `options(start, stop, flat, nested)` (-1: a relaxed window of the
    lower-bound pass), from the front of stage `start` keyed by `held_rel`."""

    start: int
    held_rel: tuple
    stop: int
    option: int
    flat: bool
    nested: bool


class _Layout(NamedTuple):
    """What one solve's passes share: the stages, the storages left out of the window
    accounting (`outside`: pinned ones and long skips) and their bytes by position in the
    upper (conservative) and lower (sure) tables, the span bounds, and per stage t the
    largest stop u of a segment t..u-1 (`stop_limit`: a segment never holds a long skip's
    producer and one of its far readers); `keep_front`: single-stage regions may keep
    any subset of their ops (`solvers.keep`)."""

    stages: list[tuple[int, int]]
    pinned: frozenset[int]
    skips: dict[int, list[int]]
    upper_table: np.ndarray
    lower_table: np.ndarray
    bounds: SpanBounds
    stop_limit: list[int]
    keep_front: bool = True
    holds: tuple[PinnedHold, ...] = ()
    one_stage: frozenset[int] = frozenset()
    bound_table: np.ndarray | None = None  # `lower_table` cut for `one_stage` (`cut_table`)
    through_forward: frozenset[int] = frozenset()  # of `one_stage`: read in the last stage
    calls_first: bool = True  # the chain over module calls (`chain.chain_stages`)
    readers: tuple[ReaderHold, ...] = ()  # pinned storages only reading regions hold

    @property
    def outside(self) -> frozenset[int]:
        return self.pinned | frozenset(self.skips)


def _layout(ctx: Context, keep_front: bool = True, calls_first: bool = True) -> _Layout:
    problem = ctx.p
    pinned = pinned_storages(problem)
    skips, st = long_skips(problem, pinned, calls_first)
    up, low = _pin_tables(ctx, pinned, skips)
    tiny = problem.n_nodes <= SUBSET_MAX_NODES  # segments keep any set
    one_stage = {} if tiny else one_stage_holders(ctx, st, pinned)
    # read in the last stage (autocast's casts, which its cache keeps to the end of the
    # forward): the bound pass counts them by position at every forward event, `cut_table`
    # the others
    through = frozenset(s for s in one_stage if ctx.last_read[s] + 1 >= st[-1][0])
    cut = {s: t for s, t in one_stage.items() if s not in through}
    holds = () if tiny else tuple(pinned_holds(problem, st, pinned))
    readers = () if tiny else tuple(reader_holds(
        problem, st, pinned, frozenset(one_stage) | {h.storage for h in holds}))
    return _Layout(st, pinned, skips, up, low, SpanBounds(ctx, pinned | frozenset(skips)),
                   stop_limits(problem, st, skips), keep_front, holds,
                   frozenset(one_stage), cut_table(ctx, low, st, cut), through, calls_first,
                   readers)


def _other_chain_differs(ctx: Context, lay: _Layout) -> bool:
    """Whether the chain that keeps each storage's first boundary differs from `lay`'s,
    which keeps the boundaries at module calls (`chain.chain_stages`)."""
    p = ctx.p
    return (p.module_spans is not None
            and long_skips(p, lay.pinned, calls_first=False)[1] != lay.stages)


def _other_chain_answer(problem: Problem, first: Solution, second: Solution,
                        budget_bytes: int, t0: float) -> Solution:
    """The other chain's answer where nothing of the calls' chain fits (`first`): bounded
    over both chains where the first proved that nothing of its chain fits and the second
    proved its bound, else with no bound."""
    both = _either_space(first.space, second.space)
    if not second.feasible:
        return first.model_copy(update={"space": both,
                                        "solve_time_s": time.perf_counter() - t0})
    bound = second.bound_ms if both is not None and second.bound_ms is not None else 0.0
    return Solution.scored(problem, second.schedule, budget_bytes, solver="dp", started_s=t0,
                           proven_optimal=_proven(second, bound), bound_ms=bound,
                           space=both if bound > 0 else None)


def _either_space(a: SearchSpace | None, b: SearchSpace | None) -> SearchSpace | None:
    if a is None or b is None:
        return None
    return a.model_copy(update={
        "text": f"{a.text}; over either of two chains of stages (a storage read two stages on "
                "merges them: keeping the boundaries at module calls, or the first after it)",
        "nested": a.nested and b.nested})


def _pin_tables(ctx: Context, pinned: frozenset[int], skips: dict[int, list[int]]
                ) -> tuple[np.ndarray, np.ndarray]:
    """`ctx.g_table` plus the pinned storages and long skips: conservative (upper) and sure
    (lower) lives.

    Upper (both): live at forward events after the producer, at reruns triggered by and
    backward events of nodes >= the producer. Lower, pinned: live at the forward events
    after the producer up to its last reader (a later reader holds it: true under every
    schedule). Lower, long skip with a far reader that saves it: that reader is never in
    the producer's segment, so it holds the storage (saved, or as its checkpoint's input)
    from the forward to its own backward: live at every forward event after the producer
    and every rerun and backward event down to the first such reader's; else as pinned.
    """
    n = ctx.n
    up = ctx.g_table.copy()
    low = ctx.g_table.copy()
    for s in pinned | frozenset(skips):
        nbytes = ctx.p.storage_bytes[s]
        prod, last = ctx.p.storage_producer[s], ctx.last_read[s]
        _add_conservative(ctx, up, s, 1)
        holders = [r for r in skips.get(s, ()) if s in ctx.p.saved[r]]
        if holders:
            low[table_slice(n, FORWARD, prod + 1, n)] += nbytes
            low[table_slice(n, RERUN, holders[0], n)] += nbytes
            low[table_slice(n, BACKWARD, holders[0], n)] += nbytes
            low[table_slice(n, RELEASED, holders[0] + 1, n)] += nbytes
        else:
            low[table_slice(n, FORWARD, prod + 1, last + 1)] += nbytes
    return up, low


def _add_conservative(ctx: Context, table: np.ndarray, s: int, sign: int) -> None:
    """Add (`sign` 1) or take out (-1) storage `s` at its conservative life in `table`: the
    forward events after its producer, the reruns and backward events of nodes from it."""
    n, nbytes, prod = ctx.n, sign * ctx.p.storage_bytes[s], ctx.p.storage_producer[s]
    table[table_slice(n, FORWARD, prod + 1, n)] += nbytes
    table[table_slice(n, RERUN, prod, n)] += nbytes
    table[table_slice(n, BACKWARD, prod, n)] += nbytes
    table[table_slice(n, RELEASED, prod, n)] += nbytes


def _rerun_ms(p: Problem, a: int, fwd_sum: np.ndarray, fwd: np.ndarray,
              reruns: list[RerunRel]) -> float:
    """Recompute time of a window option placed at `a`: `clock.rerun_ms` of each rerun
    through prefix sums (the forward time of its nodes less the idle ones, plus its
    `clock.rerun_overhead_ms`), equal to it up to float rounding."""
    total = 0.0
    for x, y, idle, kept, end in reruns:
        total += float(fwd_sum[a + y] - fwd_sum[a + x] - fwd[idle + a].sum())
        total += rerun_overhead_ms(p, a + x, a + y, (kept + a).tolist(), a + end)
    return total


class _PassResult(NamedTuple):
    """A pass's best time and regions (None: nothing fits), whether a front was thinned
    (`rounded`), a relaxed window is on the best path, and keep fronts were offered
    (`loose`: then only the lower-bound pass proves anything)."""

    found: tuple[float, list[Region]] | None
    rounded: bool
    relaxed: bool
    loose: bool


def _run(ctx: Context, lay: _Layout, limit: int, max_front: int, optimistic: bool,
         deadline: float, cache: dict, max_span: int, *, sure_lives: bool = False,
         table: np.ndarray | None = None, charged: frozenset[int] = frozenset(),
         held_on: frozenset[int] = frozenset(), local: frozenset[int] = frozenset(),
         covers: tuple[Cover, ...] = (), left_out: tuple[ReaderHold, ...] = (),
         by_position: frozenset[int] = frozenset(),
         until: dict[int, int] | None = None) -> _PassResult:
    """One DP pass (`_PassResult`).

    Segments span at most `max_span` stages. `sure_lives`: count the storages left out of
    the windows by their sure lives (an upper pass whose answer `simulate` must check).
    With `optimistic` (the lower-bound pass), longer segments are relaxed
    (`SpanBounds.relaxed`; every output read later counts as held by them, so the next
    window leaves it out): each costs no more than any option of that window, so the pass's
    optimum is a lower bound of the full space. On long chains windows up to
    `TIGHT_SPANS * max_span` stages are relaxed tightly, and split-safe ones up to twice
    that (longer windows split into those). `table`: the lower-bound pass's own
    positional bytes (`dp_pinned.held_table`) in place of the layout's; `charged`: pinned
    storages the windows also count where their own savers and regions hold them after the
    forward (`profile_parts`' `after_forward`), those in `held_on` in their residue too;
    `local`: storages left out that the windows count as their own (`table` leaves them
    out: the segment holding all their nodes counts them exactly); `covers`: no segment
    ends between the stages of any, and in the lower-bound pass the one holding them has a
    region that covers it; `left_out`: the lower-bound pass leaves out the options that
    hold any of these storages after the forward (`ReaderHold.held_by`); `by_position`: of
    `held_on`, the storages `table` also counts at the forward events after their stage
    (each window's forward then counts the residues without them, `Front.fwd`); `until`:
    of `charged`, storages the windows count only at the reruns and backward events of
    nodes up to `until[s]`, where `table` holds them at the later nodes' (a hold's).

    A lower-bound pass's own path, where no relaxed window is on it, is a schedule of the
    space (its keep corners keep less than they count): it goes to `cache[BOUND_PATHS]`
    for `_try_bound_paths` to score.
    """
    found = _Pass(ctx, lay, limit, max_front, optimistic, deadline, cache, max_span,
                  sure_lives, table, (charged, held_on, local, by_position), covers,
                  left_out, until).run()
    if optimistic and found.found is not None and not found.relaxed:
        cache.setdefault(BOUND_PATHS, {}).setdefault(
            tuple(r.describe() for r in found.found[1]), found.found)
    return found


def _stage_signatures(ctx: Context, st: list[tuple[int, int]], outside: frozenset[int]
                      ) -> list[int]:
    """Per stage, an id shared by stages with equal `window_signature`s (window cache keys)."""
    spans_at: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for span in ctx.p.module_spans or ():
        spans_at.setdefault(span.start, []).append((span.stop, span.inputs))
    sig_ids: dict[tuple, int] = {}
    return [sig_ids.setdefault(window_signature(ctx, a, b, spans_at, outside), len(sig_ids))
            for a, b in st]


class _Pass:
    """The state of one `_run`: per stage, Pareto fronts keyed by the held-inputs state."""

    def __init__(self, ctx: Context, lay: _Layout, limit: int, max_front: int,
                 optimistic: bool, deadline: float, cache: dict, max_span: int,
                 sure_lives: bool, table: np.ndarray | None = None,
                 counted: tuple[frozenset[int], ...] = (frozenset(),) * 4,
                 covers: tuple[Cover, ...] = (), left_out: tuple[ReaderHold, ...] = (),
                 until: dict[int, int] | None = None) -> None:
        p = self.p = ctx.p
        self.ctx, self.lay, self.limit, self.max_front = ctx, lay, limit, max_front
        self.optimistic, self.deadline, self.cache, self.max_span = (optimistic, deadline,
                                                                     cache, max_span)
        self.st, self.outside, self.bounds = lay.stages, lay.outside, lay.bounds
        self.table = lay.lower_table if optimistic or sure_lives else lay.upper_table
        if table is not None:
            self.table = table
        self.charged, self.held_on, self.local, self.by_position = counted
        self.until = {s: k for s, k in (until or {}).items() if s in self.charged}
        self._until_key = frozenset(self.until.items())  # part of `_charged_in`'s key
        self.skip, self.covers = self.outside - self.charged - self.local, covers
        self.left_out = left_out if optimistic else ()
        m = self.m = len(self.st)
        # relaxed windows up to `tight` stages count every kept output in their residue;
        # longer ones, up to 2 * tight + 1 stages, leave the unsaved ones out so that any
        # longer window splits into them (`SpanBounds`); short chains relax every length
        # tightly
        self.tight = m if m <= SPLIT_RELAXED_STAGES else TIGHT_SPANS * max_span
        self.subsets = p.n_nodes <= SUBSET_MAX_NODES
        self.stage_sig = _stage_signatures(ctx, self.st, self.outside)
        self.fronts: list[dict[tuple, Front]] = [dict() for _ in range(m + 1)]
        start = Front()
        start.add(np.zeros(1, dtype=np.int64), np.zeros(1), None)
        self.fronts[0][()] = start
        self.rounded = False
        self.relaxed_state: dict[int, tuple] = {}
        self.fwd = np.asarray(p.fwd_time_ms, dtype=float)
        self.fwd_sum = np.concatenate([[0.0], np.cumsum(self.fwd)])
        # `SpanBounds` does not bound nested options: full-span passes only
        self.nest = max_span >= m
        self.min_nest = 1 if p.module_spans is not None else 2
        self.keep_front = lay.keep_front and not self.subsets
        self.loose = False  # keep options were offered: the upper pass alone proves nothing

    def run(self) -> _PassResult:
        for t in range(self.m):
            self._check_deadline()
            for held_rel, front in self.fronts[t].items():
                self._extend_from(t, held_rel, front)
        finals = [(float(f.time.min()), key, f) for key, f in self.fronts[self.m].items()
                  if f.chunks and (f.prune(self.max_front, self.optimistic) or True)
                  and len(f.time)]
        if not finals:
            return _PassResult(None, self.rounded, False, self.loose)
        best_t, _, f = min(finals, key=lambda x: x[0])
        regions, relaxed = _backtrack(f, self.fronts, self.st, self._spec_of)
        return _PassResult((best_t, regions), self.rounded, relaxed, self.loose)

    def _check_deadline(self) -> None:
        if time.perf_counter() > self.deadline:
            raise TimeoutError

    def options(self, t: int, u: int, flat: bool, nested: bool) -> list[tuple]:
        """The window `t..u-1`'s options: tuples of regions (`()`: STORE), once per solve
        (a window is profiled anew for each set of storages held into it)."""
        key = ("options", t, u, flat, nested)
        if key not in self.cache:
            self.cache[key] = self._options(t, u, flat, nested)
        return self.cache[key]

    def _options(self, t: int, u: int, flat: bool, nested: bool) -> list[tuple]:
        ctx, st = self.ctx, self.st
        a, b = st[t][0], st[u - 1][1]
        if self.p.module_spans is not None:
            span_flat, span_nested = span_options(ctx, a, b, u == t + 1, self.subsets)
            pieces = self._inner(a, b) if flat and u == t + 1 else []
            return (span_flat + pieces if flat else []) + (span_nested if nested else [])
        out = flat_options(ctx, a, b, u == t + 1, self.subsets) if flat else []
        return out + (nested_options(ctx, st[t:u]) if nested else [])

    def _inner(self, a: int, b: int) -> list[tuple]:
        """Stage `[a, b)`'s sets of inner regions (`solvers.dp.inner`), once per solve."""
        key = ("inner", a, b)
        if key not in self.cache:
            self.cache[key] = inner_options(self.ctx, a, b, self.outside)
        return self.cache[key]

    def _rel(self, s: int, a: int) -> tuple[int, int]:
        prod = self.p.storage_producer[s]
        return prod - a, self.p.outputs[prod].index(s)

    def _front(self, u: int, state: tuple) -> Front:
        dst = self.fronts[u].get(state)
        if dst is None:
            dst = self.fronts[u][state] = Front()
        return dst

    def _read_after(self, u: int) -> tuple[tuple[int, int], ...]:
        """State after a relaxed window ending at stage u: all it hands on counts as held."""
        key = self.relaxed_state.get(u)
        if key is None:  # a chain of stages: only the last stage's outputs are read later
            p, ctx = self.p, self.ctx
            c, b = self.st[u - 1]
            nxt = self.st[u][0] if u < self.m else 0
            key = self.relaxed_state[u] = tuple(sorted(
                self._rel(s, nxt) for i in range(c, b) for s in p.outputs[i]
                if ctx.last_read[s] >= b and s not in ctx.loss and s not in self.outside))
        return key

    def _extend_from(self, t: int, held_rel: tuple, front: Front) -> None:
        """Every segment t..u-1 appended to `front`'s entries, into the fronts of stage u."""
        self.rounded |= front.prune(self.max_front, self.optimistic)
        a = self.st[t][0]
        room = self.limit - int(front.held[0])  # the least held bytes of this front
        thinned = (front.corners(RELAXED_FRONT) if self.optimistic and self.max_span < self.m
                   else None)
        for u in range(t + 1, self.lay.stop_limit[t] + 1):
            b = self.st[u - 1][1]
            # every flat multi-stage option recomputes the recomputable runs of [a, b): the
            # saved bytes of its largest run are a lower bound on its peak that only grows
            # with u, so once it exceeds the room no longer flat segment from t can fit;
            # nested ones (short windows, full-span passes) may still
            flat = u == t + 1 or self.bounds.memory(a, b) <= room
            nested = self.nest and self.min_nest <= u - t <= NEST_MAX_STAGES
            if not flat and not nested:
                break
            if any(c.first < u <= c.last for c in self.covers):
                continue  # no segment may end between a cover's stages
            if u - t <= self.max_span:
                self._add_window(t, u, held_rel, front, flat, nested)
            elif not self.optimistic or u - t > 2 * self.tight + 1:
                break
            else:
                self._add_relaxed(t, u, held_rel, front, thinned)

    def _add_relaxed(self, t: int, u: int, held_rel: tuple, front: Front,
                     thinned: Callable) -> None:
        """A window longer than the span, relaxed (`SpanBounds.relaxed`): lower pass only."""
        a, b = self.st[t][0], self.st[u - 1][1]
        options = self.bounds.relaxed(a, b, u - t > self.tight)
        for oi, (peak, residue, tms) in enumerate(options):
            if oi == 0 and u - t > 2 * self.max_span + 1:
                continue  # plain (no residue): split-dominated, see SpanBounds
            cnt = int(np.searchsorted(front.held, self.limit - peak, side="right"))
            if cnt:
                held, times, idx, fwd = thinned(cnt)
                self._front(u, self._read_after(u)).add(
                    held + residue, times + tms, _Step(t, held_rel, u, -1, True, False), idx,
                    fwd + residue if self.by_position else None)

    def _spec_of(self, step: _Step) -> Spec:
        return self._profiles(step.start, step.stop, step.held_rel, step.flat,
                              step.nested)[step.option].spec

    def _profiles(self, t: int, u: int, held_rel: tuple, flat: bool, nested: bool
                  ) -> list[_Option]:
        """Every `_Option` of window t..u-1, cached by the window's signature (identical
        blocks share them); a single stage's keep options also by its forward times."""
        key = (tuple(self.stage_sig[t:u]), u == t + 1, held_rel, flat, nested,
               self._charged_in(t, u))
        profs = self.cache.get(key)
        a, b = self.st[t][0], self.st[u - 1][1]
        held_in = frozenset(self.p.outputs[a + r][k] for r, k in held_rel)
        if profs is None:
            # profiling a long window costs time linear in its length: check the deadline
            # per window and per option, not only per stage
            self._check_deadline()
            profs = []
            for regions in self.options(t, u, flat, nested):
                self._check_deadline()
                parts = profile_parts(self.ctx, a, b, regions, held_in, self.skip,
                                      after_forward=self.charged, held_on=self.held_on,
                                      by_position=self.by_position, until=self.until)
                profs.append(_Option(parts, self._out_rel(parts, a), reruns_rel(regions, a),
                                     window_spec(regions, a)))
            self.cache[key] = profs
        if not (self.keep_front and flat and u == t + 1):
            return profs
        keyed = (key, tuple(self.p.fwd_time_ms[a:b]), self.optimistic)
        kept = self.cache.get(keyed)
        if kept is None:
            kept = self.cache[keyed] = [
                opt for x, y in top_regions(self.p, a, b, True)
                for opt in self._keep_options(a, b, x, y, held_in, key)]
        self.loose |= bool(kept)
        return profs + kept

    def _charged_in(self, t: int, u: int) -> tuple[tuple, ...]:
        """Which storages left out of window t..u-1's signature that it touches are
        `charged`, `held_on`, skipped and `by_position`, and where `until` stops counting
        them, in order of first touch (part of its profiles' cache key)."""
        if not self.charged and self.skip == self.outside:
            return ()
        key = ("charged", t, u, self.charged, self.held_on, self.skip, self.by_position,
               self._until_key)
        found = self.cache.get(key)
        if found is None:
            a, b = self.st[t][0], self.st[u - 1][1]
            found = self.cache[key] = tuple((s in self.charged, s in self.held_on,
                                             s in self.skip, s in self.by_position,
                                             self._cap_in(s, a, b))
                                            for s in self._touched(t, u))
        return found

    def _cap_in(self, s: int, a: int, b: int) -> int | None:
        """`until[s]` relative to the window [a, b), the same for every cap outside it."""
        cap = self.until.get(s)
        return None if cap is None or cap + 1 >= b else max(-1, cap - a)

    def _touched(self, t: int, u: int) -> tuple[int, ...]:
        """The storages left out of the windows that window t..u-1 touches, in order of
        first touch, once per solve (each pass counting others apart asks again)."""
        key = ("touched", t, u)
        found = self.cache.get(key)
        if found is None:
            p, (a, b) = self.p, (self.st[t][0], self.st[u - 1][1])
            found = self.cache[key] = tuple(dict.fromkeys(
                s for i in range(a, b) for s in (*p.uses[i], *p.outputs[i])
                if s in self.outside))
        return found

    def _out_rel(self, parts: WindowParts, a: int) -> tuple:
        return tuple(sorted(self._rel(s, a) for s in parts.held_out))

    def _keep_options(self, a: int, b: int, x: int, y: int, held_in: frozenset[int],
                      key: tuple) -> list[_Option]:
        """Region `[x, y)` of window `[a, b)` keeping each point of its keep front
        (`solvers.keep`); the lower-bound pass gets each point's floor, or the corners of
        a thinned front. The per-node terms are cached by `key` (no times in them)."""
        self._check_deadline()
        cached = self.cache.get((key, x - a, y - a, "keep"))
        if cached is None:
            cached = self.cache[(key, x - a, y - a, "keep")] = (KeepSpace.analyse(
                self.ctx, a, b, x, y, held_in, self.outside - self.local) or False, a)
        space, origin = cached
        if space is False:
            return []
        # analysed in the window at `origin` (an identical block, maybe another): its nodes
        # and storages are that window's, its rerun savings that block's forward times
        shift = a - origin
        p = self.p
        space = space.at_times(p.fwd_time_ms, shift)
        info = self.ctx.region(x, y)
        by_hand = [[i for i, k in enumerate(space.nodes) if wanted(k + shift)]
                   for wanted in (p.is_linear, p.is_matmul)]
        also = [] if self.optimistic else by_hand + under_caps(
            space, self.table[space.base.g_index + a])
        out = []
        for choice in keep_choices(space, optimistic=self.optimistic, also=also)[0]:
            keep = frozenset(space.nodes[i] + shift for i in choice.chosen)
            parts = (space.floor_parts(choice.residue_bytes, choice.exported)
                     if self.optimistic else space.parts(choice.chosen))
            held_rel = self._out_rel(parts, origin)  # its storages are the origin window's
            spec = ((x - a, y - a, tuple(sorted(k - a for k in keep)), ()),)
            if choice.real:
                out.append(_Option(parts, held_rel, [flat_rerun_rel(p, info, keep, a)], spec))
            else:  # a corner: keeping nothing's rerun with the SAC overhead, less its saving
                sac = flat_rerun_rel(p, info, frozenset(), a)._replace(
                    kept=np.asarray([x - a], dtype=np.int64))
                out.append(_Option(parts, held_rel, [sac], spec, choice.saved_ms))
        return out

    def _add_window(self, t: int, u: int, held_rel: tuple, front: Front, flat: bool,
                    nested: bool) -> None:
        """Each option of window t..u-1, placed after the entries of `front` it fits."""
        a = self.st[t][0]
        shift = self.st[u][0] - a if u < self.m else 0
        straddled = [c for c in self.covers if t <= c.first < u] if self.optimistic else []
        for oi, (parts, out_rel, reruns, spec, saved_ms) in enumerate(
                self._profiles(t, u, held_rel, flat, nested)):
            if not all(c.by(spec, a) for c in straddled) or any(
                    h.held_by(spec, a) for h in self.left_out):
                continue
            # recompute time by position (the window's structure is shared)
            tms = _rerun_ms(self.p, a, self.fwd_sum, self.fwd, reruns) - saved_ms
            fits = self._fitting(front, parts, a, self.st[u - 1][1] - a)
            prefix = isinstance(fits, slice)
            if (fits.stop if prefix else len(fits)) == 0:
                continue
            state = tuple((r - shift, k) for r, k in out_rel)
            self._front(u, state).add(
                front.held[fits] + parts.residue_bytes, front.time[fits] + tms,
                _Step(t, held_rel, u, oi, flat, nested), None if prefix else fits,
                front.fwd[fits] + (parts.residue_bytes - parts.by_position_bytes)
                if self.by_position else None)

    def _fitting(self, front: Front, parts: WindowParts, a: int, n_forward: int
                 ) -> slice | np.ndarray:
        """`front`'s entries after which the window of `parts` at node `a` fits: a prefix
        (a slice), or where the windows count storages in their residue that the table also
        counts by position at the forward events (`by_position`), their indices: an entry's
        `fwd` stands for its held bytes at the window's forward."""
        if not self.by_position:
            peak = parts.peak(self.ctx, a, self.table)
            return slice(0, int(np.searchsorted(front.held, self.limit - peak, side="right")))
        forward, rest = parts.peaks(a, self.table, n_forward)
        cnt = int(np.searchsorted(front.held, self.limit - rest, side="right"))
        return np.flatnonzero(front.fwd[:cnt] <= self.limit - forward)


def _backtrack(f: Front, fronts: list[dict[tuple, Front]], st: list[tuple[int, int]],
               spec_of: Callable[[_Step], Spec]) -> tuple[list[Region], bool]:
    """The regions of `f`'s fastest entry, following back-pointers to the chain's start;
    and whether a relaxed window (lower-bound pass, no real regions) is on the way."""
    regions: list[Region] = []
    relaxed = False
    pos = int(np.argmin(f.time))
    while (step := f.info[int(f.src[pos])]) is not None:
        if step.option < 0:
            relaxed = True
            logger.debug("dp: relaxed window [%d, %d) on the lower-bound path",
                         st[step.start][0], st[step.stop - 1][1])
        else:
            regions.extend(regions_at(spec_of(step), st[step.start][0]))
        pos, f = int(f.idx[pos]), fronts[step.start][step.held_rel]
    return sorted(regions, key=lambda r: r.start), relaxed


def _space(problem: Problem, lay: _Layout, *, nested: bool) -> SearchSpace:
    return chain_segments(problem, nested=nested, any_keep=problem.n_nodes <= SUBSET_MAX_NODES,
                          long_skips=len(lay.skips), long_skip_nodes=chain.LONG_SKIP_NODES,
                          stage_keep=lay.keep_front, calls_chain=lay.calls_first)


def _same_ms(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def _spans(m: int) -> list[int]:
    """Segment-length caps to try, growing: the full space at once for short chains."""
    if m <= FULL_SPAN_STAGES:
        return [m]
    spans = [FIRST_SPAN if m <= SPLIT_RELAXED_STAGES else FIRST_SPAN // 2]
    while spans[-1] < m:
        spans.append(min(m, 2 * spans[-1]))
    return spans


def _upper_pass(ctx: Context, lay: _Layout, budget_bytes: int, max_front: int,
                deadline: float, cache: dict, span: int, t0: float, *,
                sure_lives: bool = False, table: np.ndarray | None = None,
                local: frozenset[int] = frozenset(), cover: Cover | None = None
                ) -> Solution | None:
    """The best real schedule with segments of at most `span` stages, scored by `simulate`
    (OPTIMAL when the pass was exact over the whole space); None if none fits. Should
    `simulate` find it over the budget, the pass is repeated with the limit tightened.

    The storages left out of the windows count by their conservative lives, or with
    `sure_lives` by their sure ones: then the answer may exceed the budget, and the
    tightened retries are what find one that fits (often faster than the conservative).
    `table`, `local`, `cover`: as `_run`'s (`_covered_upper_passes`)."""
    problem = ctx.p
    limit = budget_bytes - problem.static_bytes
    for attempt in range(4):
        try:
            found, rounded, _, loose = _run(ctx, lay, limit, max_front, False, deadline,
                                            cache, span, sure_lives=sure_lives, table=table,
                                            local=local, covers=(cover,) if cover else ())
        except TimeoutError:
            logger.info("dp hit its %.1f s limit (segments of <= %d of %d stages)",
                           deadline - t0, span, len(lay.stages))
            return None
        if found is None:
            return None
        sched = Schedule.from_segments(problem.n_nodes, found[1])
        exact = not rounded and not loose and not lay.outside and span >= len(lay.stages)
        sol = Solution.scored(problem, sched, budget_bytes, solver="dp", started_s=t0,
                              proven_optimal=exact,
                              bound_ms=with_step_ms(problem, found[0]) if exact else None,
                              space=_space(problem, lay, nested=True) if exact else None)
        if sol.feasible and not rounded and not _same_ms(with_step_ms(problem, found[0]),
                                                         sol.objective_ms):
            logger.error("dp: its model gives %.6f ms but simulate %.6f ms for %s; please "
                         "report this", found[0], sol.objective_ms, sched.describe())
        if sol.feasible:
            return sol
        if not sure_lives:
            logger.error("dp schedule peaks at %d > budget %d (attempt %d); tightening",
                         sol.peak_bytes, budget_bytes, attempt)
        limit -= sol.peak_bytes - budget_bytes
    return None


def _faster(best: Solution | None, sol: Solution | None) -> Solution | None:
    if sol is None or (best is not None and best.objective_ms <= sol.objective_ms):
        return best
    return sol


def _proven(best: Solution | None, bound: float) -> bool:
    return best is not None and best.objective_ms <= bound + 1e-9 * max(1.0, bound)


def _answer(problem: Problem, lay: _Layout, best: Solution, bound: float,
            nested_bound: float | None, budget_bytes: int, t0: float) -> Solution:
    """`best` with the bound the lower-bound passes proved: capped-span passes bound flat
    segmentations only (no claim for a nested answer), a full-span pass nested ones too
    (both of the regions' costs: with the step's, `clock.with_step_ms`)."""
    bound = with_step_ms(problem, bound)
    nested_bound = None if nested_bound is None else with_step_ms(problem, nested_bound)
    if nested_bound is not None and (nested_bound >= bound or any(
            r.children for r in best.schedule.regions)):
        bound, nested = nested_bound, True
    elif not any(r.children for r in best.schedule.regions):
        nested = False
    else:
        return Solution.scored(problem, best.schedule, budget_bytes, solver="dp", started_s=t0,
                               bound_ms=None)
    return Solution.scored(problem, best.schedule, budget_bytes, solver="dp", started_s=t0,
                           proven_optimal=_proven(best, bound), bound_ms=bound,
                           space=_space(problem, lay, nested=nested))


@dataclass
class _Proof:
    """What the passes of one `solve` found so far: the fastest real schedule, the best
    lower bound over flat segmentations (`bound`) and over nested ones too (`nested`: from
    a full-span pass only), whether the last lower pass thinned a front (`rounded`), and
    `final`: an upper pass proved its answer optimal by itself."""

    best: Solution | None = None
    bound: float = 0.0
    nested: float | None = None
    rounded: bool = False
    final: bool = False
    infeasible_over: SearchSpace | None = None  # a lower pass fit nothing: none of it fits
    first_fit: bool = False  # any schedule that fits ends the search (`solve`'s)
    answered_deadline: float = 0.0  # `solve`'s `answered_limit_s`, from its start

    def deadline(self, deadline: float) -> float:
        """The deadline of what follows: `answered_deadline` once an answer is bounded."""
        return max(deadline, self.answered_deadline) if self.bounded else deadline

    @property
    def bounded(self) -> bool:
        return self.best is not None and self.bound > 0

    @property
    def proven(self) -> bool:
        return (self.final or _proven(self.best, self.bound)
                or (self.first_fit and self.best is not None))


def _lower_pass(ctx: Context, lay: _Layout, limit: int, max_front: int, deadline: float,
                cache: dict, span: int, best: Solution | None
                ) -> tuple[float | None, bool, bool]:
    """The lower-bound pass's bound (None: nothing fits even relaxed), whether it thinned a
    front and whether a relaxed window is on its path. With an answer of `best` ms, the
    pinned storages that a region could only free by rerunning at least that long are
    counted as held (`dp_pinned`): the bound is then the smaller of the pass's and `best`'s,
    and a pass that fits nothing proves `best`."""
    floor = best.objective_ms if best is not None else math.inf
    sure = sure_holds(lay.holds, floor)
    found, rounded, relaxed, _ = _run(ctx, lay, limit, max_front, True, deadline, cache, span,
                                      table=held_table(ctx.p, lay.lower_table, ctx.last_read,
                                                       sure))
    lower = math.inf if found is None else found[0]
    if sure:
        lower = min(lower, floor)
    return (None if lower == math.inf else lower), rounded, relaxed


def _finer_bound(ctx: Context, lay: _Layout, limit: int, max_front: int, deadline: float,
                 cache: dict, span: int, floor: float, readers_only: bool = False
                 ) -> tuple[float, bool, bool]:
    """Lower-bound passes that also count where each window holds the pinned storages
    after the forward (a counted hold's only at the nodes before its holder, where the
    table does not count it), and split the schedules by the holds whose cover is cheaper
    than `floor` (`dp_pinned.bound_over_holds`); and, where some pinned storages only one
    stage can hold (`dp_pinned.one_stage_holders`), the same counting those in that
    stage's residue instead; where pinned storages are held only by regions reading them,
    `_reader_bound`'s split too. The highest bound (inf: nothing fits; -inf: none came in
    the time). The other windows are profiled anew (they count more than the upper passes'
    do), so `_passes` runs these last, in the time left (`readers_only`: the reader split
    alone).
    """
    def counting(table: np.ndarray, held_on: frozenset[int]) -> Callable:
        def run(holds: list[PinnedHold], covers: tuple[Cover, ...] = ()
                ) -> tuple[float, bool, bool]:
            found, rounded, relaxed, _ = _run(
                ctx, lay, limit, max_front, True, deadline, cache, span,
                table=held_table(ctx.p, table, ctx.last_read, holds), charged=lay.pinned,
                held_on=held_on & lay.pinned, covers=covers,
                by_position=held_on & lay.pinned & lay.through_forward,
                until={h.storage: h.holder - 1 for h in holds})
            return (math.inf if found is None else found[0]), rounded, relaxed
        return run

    others = [] if readers_only else [(lay.lower_table, frozenset(), lay.holds)]
    if lay.one_stage and not readers_only:
        apart = [h for h in lay.holds if h.storage not in lay.one_stage]
        if len(apart) == len(lay.holds) and lay.one_stage <= lay.through_forward:
            others = []  # the pass below counts all the first does, and more
        others.append((lay.bound_table, lay.one_stage, apart))
    bounds: list[Callable[[], tuple[float, bool, bool]]] = [
        functools.partial(bound_over_holds, counting(table, held_on), ctx.p, lay.stages, holds,
                          floor) for table, held_on, holds in others]
    if lay.readers:
        def reader() -> tuple[float, bool, bool]:
            return (_reader_bound(ctx, lay, limit, max_front, deadline, cache, span, floor),
                    False, False)

        # the reader split's passes reuse the lower pass's windows, so it goes first, but
        # after a split over cheap holds (Inception-v3 at its lowest peak: 64 reader passes
        # in 18 s bound nothing, the holds' three passes prove the answer)
        cheap = any(h.cover_ms < floor for h in lay.holds)
        bounds = [*bounds, reader] if cheap else [reader, *bounds]
    found = (-math.inf, False, False)
    for bound in bounds:
        if found[0] >= floor:
            break
        try:
            other = bound()
        except TimeoutError:
            if found[0] == -math.inf:
                raise
            break
        if other[0] > found[0]:
            found = other
    return found


def _reader_bound(ctx: Context, lay: _Layout, limit: int, max_front: int, deadline: float,
                  cache: dict, span: int, floor: float) -> float:
    """`dp_pinned.reader_split_bound` over `lay.readers`, each pass counting the holds
    sure below `floor` as `_lower_pass` does (so the optimum is at least the smaller of
    the bound and `floor` where one counted)."""
    sure = sure_holds(lay.holds, floor)
    base = held_table(ctx.p, lay.lower_table, ctx.last_read, sure)

    def run(held: tuple[ReaderHold, ...], left_out: tuple[ReaderHold, ...]) -> float:
        holds = [h.as_hold() for h in held]
        found = _run(ctx, lay, limit, max_front, True, deadline, cache, span,
                     table=held_table(ctx.p, base, ctx.last_read, holds),
                     charged=lay.pinned, left_out=left_out,
                     until={h.storage: h.holder - 1 for h in (*sure, *holds)})[0]
        return math.inf if found is None else found[0]

    lower = reader_split_bound(run, lay.readers, floor)
    return min(lower, floor) if sure else lower


def _passes(ctx: Context, lay: _Layout, budget_bytes: int, max_front: int, spans: list[int],
            deadline: float, cache: dict, t0: float, proof: _Proof) -> None:
    """The upper and lower passes for each segment-length cap in `spans`, widest last, into
    `proof`, until one proves the answer or the deadline passes."""
    problem = ctx.p
    for span in spans:
        sol = _upper_pass(ctx, lay, budget_bytes, max_front, deadline, cache, span, t0)
        if sol is not None and sol.status == Status.OPTIMAL:
            proof.best, proof.final = sol, True
            return
        proof.best = _faster(proof.best, sol)
        if time.perf_counter() > deadline or proof.proven:
            return
        try:
            bound, rounded, relaxed = _lower_pass(ctx, lay, budget_bytes - problem.static_bytes,
                                                  max_front, deadline, cache, span, proof.best)
        except TimeoutError:
            return
        if bound is None:  # even the relaxed space has no schedule: infeasible
            if proof.best is None:
                proof.infeasible_over = _space(problem, lay, nested=span >= len(lay.stages))
            return
        proof.bound, proof.rounded = max(proof.bound, bound), rounded
        if span >= len(lay.stages):
            proof.nested = max(proof.nested or 0.0, bound)
        deadline = proof.deadline(deadline)
        _try_bound_paths(problem, budget_bytes, cache, t0, proof)
        if lay.outside and not proof.proven:
            # the left-out storages counted by their sure lives may fit a faster schedule
            # (the conservative lives hold them longest); simulate checks it
            proof.best = _faster(proof.best, _upper_pass(
                ctx, lay, budget_bytes, max_front, deadline, cache, span, t0, sure_lives=True))
        if lay.holds and not proof.proven:
            _covered_upper_passes(ctx, lay, budget_bytes, max_front, deadline, cache, span,
                                  t0, proof)
        if lay.pinned and proof.best is not None and not proof.proven:
            _raise_bound(ctx, lay, budget_bytes, max_front, deadline, cache, span, proof)
            if ctx.n <= FINER_MAX_NODES:  # beyond, none fitted (80-layer Llama: 2 s lost)
                _try_bound_paths(problem, budget_bytes, cache, t0, proof)
        if lay.readers and not proof.proven and time.perf_counter() < deadline:
            _covered_upper_passes(ctx, lay, budget_bytes, max_front, deadline, cache, span,
                                  t0, proof, readers=True)
        if proof.best is not None:
            logger.debug("dp: segments of <= %d stages, fronts of <= %d: %.3f ms, lower bound "
                         "%.3f ms%s", span, max_front, proof.best.objective_ms, proof.bound,
                         " (relaxed windows)" if relaxed else "")
            if proof.proven:
                return


def _try_bound_paths(problem: Problem, budget_bytes: int, cache: dict, t0: float,
                     proof: _Proof) -> None:
    """The lower-bound passes' own schedules (`_run`) scored by `simulate`, the fastest that
    fits into `proof`: a pass that counts the pinned storages by their sure lives may find
    one faster than every upper pass, which counts them by their conservative ones
    (ConvNeXt-atto under bf16: the pass counting the cast weights in the residues finds
    its bound's schedule, and it fits). A path no faster than the answer is not scored
    (the pass's time is at most its real one); of the others, the `BOUND_PATHS_SCORED`
    slowest (the least optimistic, the likeliest to fit), as `simulate` takes 0.25 s on an
    80-layer Llama."""
    beat = proof.best.objective_ms if proof.best is not None else math.inf
    paths = sorted((f for f in cache.pop(BOUND_PATHS, {}).values() if f[0] < beat),
                   key=lambda f: -f[0])
    for found in paths[:BOUND_PATHS_SCORED]:
        sched = Schedule.from_segments(problem.n_nodes, found[1])
        sol = Solution.scored(problem, sched, budget_bytes, solver="dp", started_s=t0)
        if sol.feasible:
            proof.best = _faster(proof.best, sol)


def _raise_bound(ctx: Context, lay: _Layout, budget_bytes: int, max_front: int,
                 deadline: float, cache: dict, span: int, proof: _Proof) -> None:
    """`proof`'s bound raised by `_finer_bound` where it gets higher in the time left. On
    graphs over `FINER_MAX_NODES` nodes only where it splits or counts a residue: its
    counting alone raised no bound there (80-layer Llama: 5 s more, the same gap)."""
    best = proof.best.objective_ms if proof.best is not None else math.inf
    counting_raises_nothing = ctx.n > FINER_MAX_NODES and not lay.one_stage and all(
        h.cover_ms >= best for h in lay.holds)
    if counting_raises_nothing and not lay.readers:
        return
    try:
        finer = _finer_bound(ctx, lay, budget_bytes - ctx.p.static_bytes, max_front, deadline,
                             cache, span, best, readers_only=counting_raises_nothing)
    except TimeoutError:
        return
    if min(finer[0], best) > proof.bound:
        proof.bound, proof.rounded = min(finer[0], best), finer[1]
        if span >= len(lay.stages):
            proof.nested = max(proof.nested or 0.0, proof.bound)


def _covered_upper_passes(ctx: Context, lay: _Layout, budget_bytes: int, max_front: int,
                          deadline: float, cache: dict, span: int, t0: float,
                          proof: _Proof, readers: bool = False) -> None:
    """Upper passes over the schedules whose segments keep together all the nodes of a
    pinned storage that a region rerunning less than the answer could free (a hold's),
    so that the segment holding them counts it exactly (`local`), not by its conservative
    life: the three-block rotary model with a 300 MiB table answered 5.17 ms where
    rerunning every block together keeping the matmuls costs 1.42 ms and fits. `readers`:
    the same over the stages of the storages only reading regions hold (`lay.readers`),
    the widest spans only (one per DenseNet block: a segment holding it holds those
    inside). Shortest spans first: the schedules keeping a span together keep every span
    inside it together too, so where a span's cannot beat the answer, no span around it's
    can (Inception-v3 at 50 %: 10 checks of 15)."""
    p = ctx.p
    floor = proof.best.objective_ms if proof.best is not None else math.inf
    stage_of = stage_index(p, lay.stages)

    def stages_of(s: int) -> tuple[int, int]:
        return stage_of[p.storage_producer[s]], stage_of[ctx.last_read[s]]

    if readers:
        read = {stages_of(h.storage) for h in lay.readers}
        spans = {(a, b) for a, b in read
                 if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in read)}
    else:
        spans = {stages_of(h.storage) for h in lay.holds if h.cover_ms < floor}
    sure = held_table(p, lay.lower_table, ctx.last_read, sure_holds(lay.holds, floor))
    beaten: list[tuple[int, int]] = []  # a span holding one of these is beaten too
    for first, last in sorted(spans, key=lambda s: (s[1] - s[0], s)):
        if any(first <= a and b <= last for a, b in beaten) or _beaten(
                ctx, lay, budget_bytes, max_front, deadline, cache, span, sure, floor,
                Cover(first, last, -1, -1)):
            beaten.append((first, last))
            continue
        local = frozenset(s for s in lay.pinned
                          if first <= stages_of(s)[0] and stages_of(s)[1] <= last)
        table = lay.upper_table.copy()
        for s in local:
            _add_conservative(ctx, table, s, -1)
        proof.best = _faster(proof.best, _upper_pass(
            ctx, lay, budget_bytes, max_front, deadline, cache, span, t0, table=table,
            local=local, cover=Cover(first, last, -1, -1)))
        if proof.proven or time.perf_counter() > deadline:
            return


def _beaten(ctx: Context, lay: _Layout, budget_bytes: int, max_front: int, deadline: float,
            cache: dict, span: int, table: np.ndarray, floor: float, cover: Cover) -> bool:
    """Whether a lower-bound pass over the schedules of `cover` proves that none beats an
    answer of `floor` ms (most of `_covered_upper_passes`' cannot: Inception-v3 at its
    lowest peak, 12 upper passes in 10 s found nothing, their lower passes take 3 s);
    False without an answer (no pass to spare when a first fit is sought)."""
    if floor == math.inf:
        return False
    try:
        found = _run(ctx, lay, budget_bytes - ctx.p.static_bytes, max_front, True, deadline,
                     cache, span, table=table, covers=(cover,)).found
    except TimeoutError:
        return False  # the upper pass then stops at the deadline too
    return found is None or found[0] >= floor


def solve(problem: Problem, budget_bytes: int, time_limit_s: float = 60.0,
          *, max_front: int = 2000, keep_front: bool = True, first_fit: bool = False,
          answered_limit_s: float | None = None, shared: dict | None = None) -> Solution:
    """Least recompute time within the budget over chain segmentations (see module doc);
    `keep_front=False` lets regions keep only nothing or their matmuls; `first_fit`: the
    first schedule found that fits, with no search for a faster one or a bound (a search
    for the least budget that fits asks only that, or a proof that nothing does);
    `answered_limit_s`: once an answer and a lower bound are found, the search for a proof
    may go on to this limit instead (`auto`: the time no other solver would get then);
    `shared`: a dict that solves of this same problem share (`auto`'s bisection over
    budgets): the context, layouts and windows' profiles, none of which depends on the
    budget (Swin-T's first fits in 0.1 s where profiling anew took 0.9).

    When the widest pass thinned its fronts and left a gap, both passes run again with
    fronts twice as long (up to `MAX_FRONT_GROWTH` times `max_front`) while time is left,
    the gap is above `GROWN_GAP` and the last growth raised the bound:
    thinning, not the space, is then what the gap measures (a long chain's held bytes span
    a wide range, so its memory buckets are coarse)."""
    t0 = time.perf_counter()
    shared = {} if shared is None else shared
    if shared.get("problem") is not problem:
        shared.clear()
        shared.update(problem=problem, ctx=Context(problem))
    ctx = shared["ctx"]

    def layout(calls_first: bool) -> tuple[_Layout, dict]:
        key = ("layout", keep_front, calls_first)
        if key not in shared:
            shared[key] = _layout(ctx, keep_front, calls_first), {}
        lay, cache = shared[key]
        cache.pop(BOUND_PATHS, None)  # found at another budget
        return lay, cache

    lay, cache = layout(True)
    answered = t0 + (answered_limit_s or 0.0)
    first = _solve_layout(ctx, lay, budget_bytes, t0 + time_limit_s, max_front, first_fit, t0,
                          answered, cache)
    if (first.feasible or time.perf_counter() >= t0 + time_limit_s
            or not _other_chain_differs(ctx, lay)):
        return first
    # nothing of the calls' chain fits: the other chain, in the time left, may hold a
    # schedule that does (timm's ResNet-18d at its lowest peak); its answer is bounded by
    # its own bound only where the first proved that nothing of its chain fits
    lay, cache = layout(False)
    second = _solve_layout(ctx, lay, budget_bytes, t0 + time_limit_s, max_front, first_fit,
                           t0, answered, cache)
    return _other_chain_answer(problem, first, second, budget_bytes, t0)


def _solve_layout(ctx: Context, lay: _Layout, budget_bytes: int, deadline: float,
                  max_front: int, first_fit: bool, t0: float, answered_deadline: float = 0.0,
                  cache: dict | None = None) -> Solution:
    """`solve` over one chain of stages (`cache`: its windows' profiles, `solve`'s)."""
    problem = ctx.p
    cache = {} if cache is None else cache
    proof = _Proof(first_fit=first_fit, answered_deadline=answered_deadline)
    spans = _spans(len(lay.stages))
    front = max_front
    while True:
        before = proof.bound
        _passes(ctx, lay, budget_bytes, front, spans, proof.deadline(deadline), cache, t0,
                proof)
        if (proof.proven or not proof.rounded or proof.best is None or proof.bound <= before
                or proof.best.objective_ms - proof.bound <= GROWN_GAP * proof.best.objective_ms
                or front >= MAX_FRONT_GROWTH * max_front
                or time.perf_counter() > proof.deadline(deadline)):
            break
        front, spans = 2 * front, spans[-1:]
    if proof.final:
        return proof.best
    if proof.best is not None:
        return _answer(problem, lay, proof.best, proof.bound, proof.nested, budget_bytes, t0)
    mfb = memory_lower_bound(problem)
    found_none = Solution(solver="dp", status=Status.INFEASIBLE, schedule=None,
                          budget_bytes=budget_bytes, objective_ms=None,
                          solve_time_s=time.perf_counter() - t0,
                          min_feasible_budget_bytes=mfb, min_feasible_budget_exact=False,
                          space=proof.infeasible_over)
    stopped = proof.infeasible_over is None and time.perf_counter() > proof.deadline(deadline)
    return found_none.timed_out() if stopped else found_none
