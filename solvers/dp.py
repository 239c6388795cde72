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
(`_nested_options`: Rotor's two-level persistent checkpoints, for budgets below every flat
schedule; children keep nothing or their matmuls). Recompute times include
`Problem.checkpoint_overhead_ms` per rerun, as `simulate` charges it. Fronts
larger than `max_front` are thinned to one entry per memory bucket (`_Front.prune`): the
upper-bound pass keeps each bucket's fastest real entry, a second, lower-bound pass pairs
that time with the bucket's least held bytes; the difference is reported as the gap.

Keep fronts (`keep_front`, the default beyond `SUBSET_MAX_NODES` nodes): a stage's outermost
region (a layer's call; each call inside a layer that is no call; a stage's recomputable run
without module spans, `_tops`) may keep any subset of its ops. The upper pass
offers each point of its Pareto front of (bytes held past the forward, rerun time saved),
the hand-written policies (linear outputs, matmuls) and sets that stay under a few caps on the
window's peak (`solvers.keep`), each with its exact window profile; the lower-bound pass
pairs each front point with the floor no keep set goes below, so its optimum bounds every
subset. With keep fronts the answer is proven by that second pass (gap reported), not by the
upper pass alone.

Regions inside a layer (`solvers.inner`, with module spans): a single stage may also
recompute a set of disjoint regions strictly inside it, module calls or op ranges of traced
forwards at any depth, each keeping nothing or its matmuls (an attention's dropout and the
matmul reading it, an MLP's activation and the projection reading it). The sets offered are
a front of (bytes freed, rerun time) built from each region's own profile; each is then
profiled exactly like any other option, in both passes, so the bound holds over the space
with those sets in it.

Long chains (more than `FULL_SPAN_STAGES` stages): segments are capped at a span of 16 (8
beyond `SPLIT_RELAXED_STAGES`) stages, doubled while time is left. Each span's upper-bound
pass is a real schedule; its lower-bound pass also admits longer segments, relaxed to
prefix-sum bounds on their peak, residue and time (`_SpanBounds`), so it bounds the full
flat space (nested options are left out on long chains: the bounds do not cover them).
Measured on the synthetic chains of `solvers.testing` (`benchmarks/solver_scaling.py`, dp
alone, 2 cores): 4,945 nodes gap 0.7 % in 56 s, 19,955 nodes gap 38 % at span 16 in 61 s.

Not a chain (a storage read two or more stages later): a storage whose skip spans a block
(an attention mask or rotary table read by every block) is pinned (`pinned_storages`): left
out of the window accounting and counted by position over the longest life any schedule can
give it (conservative: the schedule stays safe; a second pass counting only its sure life,
producer to last reader, gives a valid lower bound and the gap; when both agree the result is
OPTIMAL). Short skips across single nodes (a position id read two nodes later, logits read by
the loss after an `output` node) merge the stages they skip (exact over a slightly coarser
space; logged). Parameters, tied ones included, are static memory and their gradients are
schedule-independent constants, so a tied embedding read by the LM head is exact as is.
Without module spans (op-range regions: synthetic DAGs), a storage read more than
`LONG_SKIP_NODES` nodes later is detached instead of merged (`long_skips`): no segment may
then hold its producer and its far readers, so each far reader that saves it holds it under
every schedule, and its sure life reaches into the backward. That restriction is part of the
space the bound is proven over (`solvers.spaces.chain_segments` names it). Only when
merging would leave fewer than `FUSED_STAGES` stages: a chain whose short skips merge a few
stages keeps its unrestricted space. Measured (`benchmarks/solver_scaling.py --dags`, 2
cores): 1,000-node random DAGs, gap 2.4-5.2 % in <= 58 s, recompute about half of Chen's
greedy (merged, they used to fuse into 3 stages: baselines only).

Speed on real graphs: stages of only `_empty` nodes (parameter placeholders) join the next
stage (`compact_stages`); window profiles are cached by a translation-invariant signature
without gradient bytes or forward times (`accounting.WindowParts` adds gradients by position,
`_run` the recompute time), so identical blocks are profiled once per window length; a
segment from stage t stops growing once the saved bytes of its largest recomputed run exceed
the room left. `simulate` is called once, on the final schedule, whose numbers are reported.

OPTIMAL means optimal over this schedule space (flat segments, plus two-level nesting with
one child per stage), with the memory and time model exactly `simulate`'s; deeper nesting
and other child splits are not searched.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from solvers.accounting import (
    BACKWARD,
    FORWARD,
    RERUN,
    Context,
    NestedRegionInfo,
    RegionInfo,
    WindowParts,
    profile_parts,
    table_slice,
)
from solvers.bounds import memory_lower_bound
from solvers.frame import FlatStops, worth_checkpointing
from solvers.inner import inner_options
from solvers.keep import KeepSpace, under_caps
from solvers.keep import choices as keep_choices
from solvers.problem import Problem
from solvers.result import Solution, Status
from solvers.schedule import RECOMPUTE, Region, Schedule
from solvers.spaces import SearchSpace, chain_segments, matmul_keep

logger = logging.getLogger(__name__)

__all__ = ["applies", "chain_stages", "compact_stages", "pinned_storages", "solve"]

SUBSET_MAX_NODES = 8  # problems this small try every kept subset per segment
# chains of up to this many stages get the full segment space in one pass; longer ones grow
# the longest segment from FIRST_SPAN stages, doubling, each step with a proven lower bound
FULL_SPAN_STAGES = 64
FIRST_SPAN = 16
NEST_MAX_STAGES = 8  # longest window given a two-level (nested) option
SPLIT_RELAXED_STAGES = 160
RELAXED_FRONT = 128  # lower-bound entries a relaxed window hands on (optimistic corners)
TIGHT_SPANS = 3  # beyond SPLIT_RELAXED_STAGES: relaxed windows up to 3 spans long are tight
LONG_SKIP_NODES = 8  # without module spans, storages read further on are detached (long_skips)
FUSED_STAGES = 16  # ... when merging would leave fewer stages than this


def _stage_of(problem: Problem, st: list[tuple[int, int]]) -> list[int]:
    """Per node, the index of the stage holding it."""
    out = [0] * problem.n_nodes
    for t, (a, b) in enumerate(st):
        out[a:b] = [t] * (b - a)
    return out


def pinned_storages(problem: Problem) -> frozenset[int]:
    """Storages read across a multi-node stage (a block) after the one that makes them.

    Merging the stages such a storage spans (an attention mask or rotary table read by every
    block) would fuse the whole chain, so the DP pins it instead: it is left out of the
    window accounting and counted by position, live from its producer to the end of the
    forward and through the backward down to its producer's backward (conservative: no
    schedule holds it longer). Short skips across single nodes are merged (exact).
    """
    st = problem.stages()
    stage_of = _stage_of(problem, st)
    loss = set(problem.outputs[-1]) | problem.caller_held
    out = set()
    for s, cons in enumerate(problem.readers):
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
    st = problem.stages()
    merged = False
    while True:
        stage_of = _stage_of(problem, st)
        cut = [True] * len(st)  # cut[t]: boundary before stage t kept
        bad = False
        for s, cons in enumerate(problem.readers):
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
        logger.debug("dp: %s is not a chain of its stages; merged %d stages into %d",
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
        if not worth_checkpointing(problem, x, y):
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
    mm = tuple(ctx.region(x, y, matmul_keep(p, x, y)) for x, y in runs)
    if mm != opts[-1]:
        opts.append(mm)
    if subsets and len(runs) == 1:
        x, y = runs[0]
        keepable = [i for i in range(x, y) if p.can_keep(i)]
        for r in range(1, len(keepable) + 1):
            for keep in itertools.combinations(keepable, r):
                opts.append((ctx.region(x, y, keep),))
    return opts


def _keeps(ctx: Context, a: int, b: int, subsets: bool) -> list[frozenset[int]]:
    """Kept sets tried for a region: none, its keepable matmul-like nodes, or (tiny
    problems) every subset of its keepable nodes."""
    p = ctx.p
    keepable = [i for i in range(a, b) if p.can_keep(i)]
    if subsets:
        return [frozenset(c) for r in range(len(keepable) + 1)
                for c in itertools.combinations(keepable, r)]
    mm = matmul_keep(p, a, b)
    return [frozenset(), mm] if mm else [frozenset()]


def _tops(p: Problem, a: int, b: int, single: bool) -> list[tuple[int, int]]:
    """The single top-level regions window `[a, b)` may recompute: with module spans the
    window itself when it is one, else (one stage) each of its largest inner spans; without,
    its recomputable run when it has one."""
    if p.module_spans is None:
        runs = _runs(p, a, b)
        return runs if len(runs) == 1 else []
    if p.emittable(a, b) and worth_checkpointing(p, a, b):
        return [(a, b)]
    return [(sp.start, sp.stop) for sp in p.spans_within(a, b)
            if worth_checkpointing(p, sp.start, sp.stop)] if single else []


def _span_options(ctx: Context, a: int, b: int, single: bool,
                  subsets: bool) -> tuple[list[tuple], list[tuple]]:
    """(flat, nested) options of window `[a, b)` when regions must be module spans.

    The window itself when it is a span (each kept set; nested: with its largest inner spans
    as children, which keep nothing or their matmuls); for a single stage also its inner
    spans: each alone and all together, so a block can checkpoint only its MLP, say.
    """
    p = ctx.p
    flat: list[tuple] = [()] if single else []
    nested: list[tuple] = []
    whole = p.emittable(a, b) and worth_checkpointing(p, a, b)
    inner = [(sp.start, sp.stop) for sp in p.spans_within(a, b)
             if worth_checkpointing(p, sp.start, sp.stop)]
    tops = _tops(p, a, b, single)
    for x, y in tops:
        flat += [(ctx.region(x, y, keep),) for keep in _keeps(ctx, x, y, subsets)]
        kids = [(sp.start, sp.stop) for sp in p.spans_within(x, y)
                if worth_checkpointing(p, sp.start, sp.stop)]
        for keep_matmuls in (False, True):
            spec = [(cx, cy, matmul_keep(p, cx, cy) if keep_matmuls else frozenset())
                    for cx, cy in kids]
            if kids and (not keep_matmuls or any(k for _, _, k in spec)):
                nested.append((ctx.region(x, y, (), children=spec),))
    groups = ([inner] + [[piece] for piece in inner]) if single and whole else (
        [inner] if single and len(inner) > 1 else [])
    for group in groups:
        for keep_matmuls in (False, True):
            regions = tuple(ctx.region(x, y, matmul_keep(p, x, y) if keep_matmuls else ())
                            for x, y in group)
            if keep_matmuls and all(not r.keep for r in regions):
                continue
            flat.append(regions)
    return flat, nested


def _nested_options(ctx: Context, stages: list[tuple[int, int]]) -> list[tuple]:
    """Two-level options of a multi-stage window (Rotor's persistent checkpoints).

    One parent region over the window's recomputable run, one child per stage that packs:
    the parent's rerun (at the window's last backward) holds only the children's inputs,
    then each child reruns when the backward reaches it. Children keep nothing or their
    keepable matmul-like nodes; the parent keeps nothing (its SAC policy would also see the
    children's ops). Returns nothing unless the window is one run over >= 2 such stages.
    """
    p = ctx.p
    a, b = stages[0][0], stages[-1][1]
    runs = _runs(p, a, b)
    if len(runs) != 1:
        return []
    x, y = runs[0]
    pieces = []
    for sa, sb in stages:
        cx, cy = max(x, sa), min(y, sb)
        while cx < cy and _empty(p, cx):
            cx += 1
        if cx < cy and any(p.packs[cx:cy]):
            pieces.append((cx, cy))
    if len(pieces) < 2:
        return []
    out: list[tuple] = []
    for keep_matmuls in (False, True):
        kids = tuple((cx, cy, matmul_keep(p, cx, cy) if keep_matmuls else frozenset())
                     for cx, cy in pieces)
        if keep_matmuls and not any(k for _, _, k in kids):
            continue
        out.append((ctx.region(x, y, (), children=kids),))
    return out


def _reruns_rel(regions: tuple, a: int) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """Each rerun of a window option, relative to the window start: (start, stop, idle
    steps, kept nodes) (`Rerun.idle`, `Rerun.cached`)."""
    def rel(nodes: frozenset[int]) -> np.ndarray:
        return np.asarray(sorted(k - a for k in nodes), dtype=np.int64)

    out = []
    for r in regions:
        if isinstance(r, NestedRegionInfo):
            out.extend((q.start - a, q.stop - a, rel(q.idle), rel(q.cached)) for q in r.reruns)
        elif r.packs:
            out.append(_flat_rerun_rel(r, r.keep, a))
    return out


def _flat_rerun_rel(r: RegionInfo, keep: frozenset[int], a: int
                    ) -> tuple[int, int, np.ndarray, np.ndarray]:
    """`_reruns_rel`'s entry for flat region `r` (which reruns) keeping `keep`."""
    kept = keep & frozenset(r.steps())
    idle = r.rules.idle_steps(kept)
    return (r.a - a, r.stop - a, np.asarray(sorted(k - a for k in idle), dtype=np.int64),
            np.asarray(sorted(k - a for k in kept), dtype=np.int64))


Spec = tuple[tuple[int, int, tuple[int, ...], tuple], ...]  # regions relative to a window


def _spec(regions: tuple, a: int) -> Spec:
    """An option's regions relative to its window start `a` (`_regions_at` rebuilds them)."""
    return tuple((r.a - a, r.b - a, tuple(sorted(k - a for k in r.keep)),
                  tuple((ca - a, cb - a, tuple(sorted(k - a for k in ck)))
                        for ca, cb, ck in getattr(r, "children", ())))
                 for r in regions)


def _regions_at(spec: Spec, a: int) -> list[Region]:
    """The RECOMPUTE regions of an option's `spec`, placed at window start `a`."""
    return [Region(a + x, a + y, RECOMPUTE, keep=[a + k for k in keep],
                   children=[Region(a + cx, a + cy, RECOMPUTE, keep=[a + k for k in ck])
                             for cx, cy, ck in kids])
            for x, y, keep, kids in spec]


class _Option(NamedTuple):
    """One option of a window, placeable at any window with its signature: its parts, the
    outputs it holds on (relative), its reruns (`_reruns_rel`), its regions (`_spec`) and
    the rerun time it saves beyond what `reruns` says (an optimistic keep corner's)."""

    parts: WindowParts
    out_rel: tuple
    reruns: list
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


class _Front:
    """Pareto front of (held bytes, recompute ms) with back-pointers, as numpy arrays."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, _Step | None]] = []
        self.held = np.zeros(0, dtype=np.int64)
        self.time = np.zeros(0)
        self.src = np.zeros(0, dtype=np.int64)  # chunk index of each entry
        self.idx = np.zeros(0, dtype=np.int64)  # entry index in the chunk's source front
        self.info: list[_Step | None] = []  # per chunk; None: the chain's start

    def add(self, held: np.ndarray, tms: np.ndarray, info: _Step | None,
            idx: np.ndarray | None = None) -> None:
        self.chunks.append((held, tms, np.arange(len(held)) if idx is None else idx, info))

    def corners(self, buckets: int) -> Callable[[int], tuple[np.ndarray, np.ndarray,
                                                             np.ndarray]]:
        """Lower-bound thinning of any prefix of this (pruned) front to <= `buckets` entries.

        Returns `prefix(cnt) -> (held, time, idx)`: per memory bucket the least held bytes
        with the least time (the bucket's last entry; `idx` points to it), an optimistic
        corner that no entry of the bucket beats. For the relaxed windows of the lower-bound
        pass, which add a prefix of one front to up to a whole chain of later fronts.
        """
        held, tms = self.held, self.time
        if len(held) <= buckets:
            return lambda cnt: (held[:cnt], tms[:cnt], np.arange(cnt))
        lo, hi = int(held[0]), int(held[-1])
        width = max(1, -(-(hi - lo) // buckets))
        bucket = (held - lo) // width
        new = np.concatenate([[True], bucket[1:] != bucket[:-1]])
        first = np.nonzero(new)[0]
        last = np.concatenate([first[1:] - 1, [len(held) - 1]])
        slot = np.cumsum(new) - 1

        def prefix(cnt: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            k = int(slot[cnt - 1]) + 1
            idx = last[:k].copy()
            idx[-1] = cnt - 1  # the prefix may end inside its last bucket
            return held[first[:k]], tms[idx], idx

        return prefix

    def prune(self, max_front: int, optimistic: bool) -> bool:
        held = np.concatenate([c[0] for c in self.chunks])
        tms = np.concatenate([c[1] for c in self.chunks])
        src = np.repeat(np.arange(len(self.chunks)), [len(c[0]) for c in self.chunks])
        idx = np.concatenate([c[2] for c in self.chunks])
        order = np.lexsort((tms, held))
        held, tms, src, idx = held[order], tms[order], src[order], idx[order]
        prev_min = np.minimum.accumulate(np.concatenate([[np.inf], tms[:-1]]))
        keep = tms < prev_min - 1e-12
        held, tms, src, idx = held[keep], tms[keep], src[keep], idx[keep]
        rounded = False
        if len(held) > max_front:
            # thin to one entry per memory bucket: the bucket's fastest entry (the last: times
            # decrease along the front), a real schedule, so the upper-bound pass stays exact
            # for what it keeps; the lower-bound pass pairs that time with the bucket's least
            # held bytes (no real schedule is better than this corner). Neither moves held
            # bytes to a grid edge, which compounded the error stage after stage.
            rounded = True
            lo, hi = int(held[0]), int(held[-1])
            width = max(1, -(-(hi - lo) // max_front))
            bucket = (held - lo) // width
            first = np.nonzero(np.concatenate([[True], bucket[1:] != bucket[:-1]]))[0]
            last = np.nonzero(np.concatenate([bucket[1:] != bucket[:-1], [True]]))[0]
            corner = held[first] if optimistic else held[last]
            held, tms, src, idx = corner, tms[last], src[last], idx[last]
        self.held, self.time, self.src, self.idx = held, tms, src, idx
        self.info = [c[3] for c in self.chunks]
        self.chunks = []
        return rounded


class _Made:
    """Bytes of the storages (of one set) made in `[x, y)` and first saved before `y`."""

    def __init__(self, prod: np.ndarray, first_saver: np.ndarray, nbytes: np.ndarray,
                 n: int) -> None:
        self.prod, self.first_saver, self.nbytes = prod, first_saver, nbytes
        per_node = np.bincount(first_saver, weights=nbytes, minlength=n + 1)
        self.saved_upto = np.concatenate([[0], np.cumsum(per_node[:n])]).astype(np.int64)
        self._crossing: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, x: int, y: int) -> int:
        cross = self._crossing.get(x)
        if cross is None:  # produced before x, first saved at or after x
            sel = (self.prod < x) & (self.first_saver >= x)
            order = np.argsort(self.first_saver[sel], kind="stable")
            cross = self._crossing[x] = (self.first_saver[sel][order],
                                         np.concatenate([[0], np.cumsum(self.nbytes[sel][order])]))
        fs, cum = cross
        return int(self.saved_upto[y] - self.saved_upto[x]) - int(cum[np.searchsorted(fs, y)])


class _SpanBounds:
    """Cheap bounds on a multi-stage window `[a, b)`'s two options (plain, keep matmuls).

    Per recomputable run of the window, `made`: bytes of storages produced and saved in it,
    all alive at the backward of the run's trigger after its rerun, whatever is kept (the
    cut-off of segment growth: it only grows with b); `kept`: the outputs of its keepable
    matmul-like nodes that are saved in it (kept, the SAC cache holds them through the
    forward and they are still alive when a later run reruns). `relaxed(a, b)` gives, per
    option, (local peak, residue, recompute time) no greater than the option's true ones:
    plain (max made, 0, rerun time); keep matmuls (max over runs of made + kept of the
    earlier runs, total kept, rerun time less the kept nodes). Split a window in two: the
    first part's residue plus the second's peak is still within the whole window's true
    peak, residues and times add up to at most the whole's. So a relaxed window longer than
    `2 * span + 1` stages is never needed (split it into relaxed pieces of `span + 1 ..
    2 * span + 1` stages), and `_run`'s lower-bound pass relaxes only those lengths. That
    needs the kept outputs the run does not save left out of the residue (they die during
    the rerun); on chains of up to `SPLIT_RELAXED_STAGES` stages every length is relaxed
    instead, with every kept output in the residue: a tighter bound at more cost.
    """

    def __init__(self, ctx: Context, pinned: frozenset[int]) -> None:
        p = ctx.p
        n = p.n_nodes
        self.runs = p.recomputable_runs(0, n)
        self.run_starts = [x for x, _ in self.runs]
        keepable = np.asarray([p.is_matmul(i) and p.can_keep(i) for i in range(n)], dtype=bool)
        prod = np.asarray(p.storage_producer, dtype=np.int64)
        first_saver = np.full(p.n_storages, n, dtype=np.int64)
        for s, savers in enumerate(ctx.savers):
            if savers and s not in ctx.loss and s not in pinned:
                first_saver[s] = savers[0]
        nbytes = np.asarray(p.storage_bytes, dtype=np.int64)
        counted = first_saver < n
        kept = counted & keepable[prod]
        self.made = _Made(prod[counted], first_saver[counted], nbytes[counted], n)
        self.kept = _Made(prod[kept], first_saver[kept], nbytes[kept], n)
        kept_all = [sum(p.storage_bytes[s] for s in p.outputs[i]
                        if s not in ctx.loss and s not in pinned) if keepable[i] else 0
                    for i in range(n)]
        self.kept_all_upto = np.concatenate([[0], np.cumsum(kept_all)]).astype(np.int64)
        self.stops = FlatStops(p)
        nxt = np.where([not _empty(p, i) for i in range(n)], np.arange(n), n)
        self.next_real = np.minimum.accumulate(nxt[::-1])[::-1]  # first non-empty node >= i
        fwd = self.fwd_ms = np.asarray(p.fwd_time_ms, dtype=float)
        self.fwd_upto = np.concatenate([[0.0], np.cumsum(fwd)])
        self.rerun_upto = np.concatenate([[0.0], np.cumsum(np.where(keepable, 0.0, fwd))])
        self.keepable = keepable

    def _pieces(self, a: int, b: int) -> list[tuple[int, int]]:
        k = max(0, bisect.bisect_right(self.run_starts, a) - 1)
        out = []
        while k < len(self.runs) and self.runs[k][0] < b:
            x, y = max(a, self.runs[k][0]), min(b, self.runs[k][1])
            if x < y:
                out.append((x, y))
            k += 1
        return out

    def memory(self, a: int, b: int) -> int:
        """Lower bound on the local peak of every option recomputing the window's runs."""
        return max((self.made(x, y) for x, y in self._pieces(a, b)), default=0)

    def relaxed(self, a: int, b: int, splittable: bool) -> list[tuple[int, int, float]]:
        """(local peak, residue, recompute time) bounding each option of the window.

        `splittable=False` counts every kept output in the residue (tighter, but then no
        window length may be left out of the relaxation).
        """
        plain_peak = mm_peak = kept = 0
        plain_ms = mm_ms = 0.0
        for x, y in self._pieces(a, b):
            made = self.made(x, y)
            plain_peak = max(plain_peak, made)
            mm_peak = max(mm_peak, made + kept)
            if splittable:
                kept += self.kept(x, y)
            x, stop = int(self.next_real[x]), self.stops.rerun_stop(x, y)
            if stop > x:  # a run that reruns: its frame (and SAC cache) outlives the forward
                unrun = float(self.fwd_ms[stop - 1]) if self.stops.last_not_run(stop) else 0.0
                plain_ms += float(self.fwd_upto[stop] - self.fwd_upto[x]) - unrun
                mm_ms += float(self.rerun_upto[stop] - self.rerun_upto[x]) - (
                    0.0 if self.keepable[stop - 1] else unrun)
                if not splittable:
                    kept += int(self.kept_all_upto[stop] - self.kept_all_upto[x])
        out = [(plain_peak, 0, plain_ms)]
        if mm_ms < plain_ms:
            out.append((mm_peak, kept, mm_ms))
        return out


def _signature(ctx: Context, a: int, b: int,
               spans_at: dict[int, list[tuple[int, tuple[int, ...]]]]) -> tuple:
    """Translation-invariant description of nodes [a, b) for caching window profiles.

    Gradient and loss bytes and forward times are left out: `WindowParts` adds the first by
    position and `_run` the recompute time, so identical blocks share one signature although
    parameter gradients pile up along the chain and measured times differ from block to block.
    Module spans starting in the window (`spans_at`: node -> (stop, inputs)) are part of it.
    """
    p = ctx.p

    def rel(s: int) -> tuple:
        prod = p.storage_producer[s]
        lr = ctx.last_read[s]
        return (prod - a, p.outputs[prod].index(s), p.storage_bytes[s],
                p.storage_grad_bytes[s], lr - a if lr >= 0 else None, s in ctx.loss,
                tuple(k - a for k in ctx.savers[s]))

    return tuple((p.fwd_event_bytes[i], p.bwd_temp_bytes[i],
                  p.recomputable[i], p.packs[i], p.stops_before_running[i], p.is_matmul(i),
                  p.can_keep(i),
                  tuple(rel(s) for s in p.uses[i]), tuple(rel(s) for s in p.outputs[i]),
                  tuple(rel(s) for s in p.saved[i]),
                  tuple((stop - a, tuple(rel(s) for s in inputs))
                        for stop, inputs in spans_at.get(i, ()))) for i in range(a, b))


def long_skips(problem: Problem, pinned: frozenset[int]
               ) -> tuple[dict[int, list[int]], list[tuple[int, int]]]:
    """Storages detached as long skips with their far readers, and the DP's stages.

    Only without module spans (regions are op ranges: synthetic DAGs, profiles made with
    `module_spans=False`) and only when merging leaves fewer than `FUSED_STAGES` stages (a
    few random skips fuse a whole DAG; a chain of blocks whose short skips merge a few
    stages keeps its larger, unrestricted space): a storage read more than `LONG_SKIP_NODES`
    nodes after it is made would merge every stage it skips into one. Such a storage is
    detached instead: its readers two or more stages after its producer's are
    its far readers, and no segment holds the producer and a far reader
    (`_Layout.stop_limit`), so each far reader that saves it holds it under every schedule
    (`_pin_tables`). With module spans, CP-SAT over module calls handles such graphs.
    """
    merged = compact_stages(problem, chain_stages(problem, pinned)[0])
    if problem.module_spans is not None or len(merged) >= FUSED_STAGES:
        return {}, merged
    outside = set(problem.caller_held) | set(pinned)
    long = frozenset(s for s, cons in enumerate(problem.readers) if cons and s not in outside
                     and cons[-1] - problem.storage_producer[s] > LONG_SKIP_NODES)
    st = compact_stages(problem, chain_stages(problem, pinned | long)[0])
    stage_of = _stage_of(problem, st)
    skips = {}
    for s in long:
        t = stage_of[problem.storage_producer[s]]
        far = [r for r in problem.readers[s] if stage_of[r] >= t + 2]
        if far:  # else all its readers sit in the next two stages: a chain link
            skips[s] = far
    return skips, st


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
    bounds: _SpanBounds
    stop_limit: list[int]
    keep_front: bool = True

    @property
    def outside(self) -> frozenset[int]:
        return self.pinned | frozenset(self.skips)


def _layout(ctx: Context, keep_front: bool = True) -> _Layout:
    problem = ctx.p
    pinned = pinned_storages(problem)
    skips, st = long_skips(problem, pinned)
    up, low = _pin_tables(ctx, pinned, skips)
    return _Layout(st, pinned, skips, up, low, _SpanBounds(ctx, pinned | frozenset(skips)),
                   _stop_limits(problem, st, skips), keep_front)


def _stop_limits(problem: Problem, st: list[tuple[int, int]], skips: dict[int, list[int]]
                 ) -> list[int]:
    """Per stage t: segments starting there stop at stage u <= this (exclusive), so that none
    holds a long skip's producer and a far reader (two stages on: single stages never do)."""
    m = len(st)
    stage_of = _stage_of(problem, st)
    first_far = [m] * m  # by the producer's stage
    for s, far in skips.items():
        t = stage_of[problem.storage_producer[s]]
        first_far[t] = min(first_far[t], stage_of[far[0]])
    out = [m] * m
    low = m
    for t in range(m - 1, -1, -1):  # least over the skips made at stage t or later
        low = min(low, first_far[t])
        out[t] = low
    return out


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
        up[table_slice(n, FORWARD, prod + 1, n)] += nbytes
        up[table_slice(n, RERUN, prod, n)] += nbytes
        up[table_slice(n, BACKWARD, prod, n)] += nbytes
        holders = [r for r in skips.get(s, ()) if s in ctx.p.saved[r]]
        if holders:
            low[table_slice(n, FORWARD, prod + 1, n)] += nbytes
            low[table_slice(n, RERUN, holders[0], n)] += nbytes
            low[table_slice(n, BACKWARD, holders[0], n)] += nbytes
        else:
            low[table_slice(n, FORWARD, prod + 1, last + 1)] += nbytes
    return up, low


def _rerun_ms(p: Problem, a: int, fwd_sum: np.ndarray, fwd: np.ndarray,
              reruns: list[tuple[int, int, np.ndarray, np.ndarray]]) -> float:
    """Recompute time of a window option placed at `a`: the forward time of each rerun's
    nodes less the idle ones, plus its `Problem.checkpoint_overhead_ms`."""
    total = 0.0
    for x, y, idle, kept in reruns:
        total += float(fwd_sum[a + y] - fwd_sum[a + x] - fwd[idle + a].sum())
        total += p.checkpoint_overhead_ms(a + x, a + y, (kept + a).tolist())
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
         deadline: float, cache: dict, max_span: int, *, sure_lives: bool = False
         ) -> _PassResult:
    """One DP pass (`_PassResult`).

    Segments span at most `max_span` stages. `sure_lives`: count the storages left out of
    the windows by their sure lives (an upper pass whose answer `simulate` must check).
    With `optimistic` (the lower-bound pass), longer segments are relaxed
    (`_SpanBounds.relaxed`; every output read later counts as held by them, so the next
    window leaves it out): each costs no more than any option of that window, so the pass's
    optimum is a lower bound of the full space. On long chains windows up to
    `TIGHT_SPANS * max_span` stages are relaxed tightly, and split-safe ones up to twice
    that (longer windows split into those).
    """
    return _Pass(ctx, lay, limit, max_front, optimistic, deadline, cache, max_span,
                 sure_lives).run()


def _stage_signatures(ctx: Context, st: list[tuple[int, int]]) -> list[int]:
    """Per stage, an id shared by stages with equal `_signature`s (window cache keys)."""
    spans_at: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for span in ctx.p.module_spans or ():
        spans_at.setdefault(span.start, []).append((span.stop, span.inputs))
    sig_ids: dict[tuple, int] = {}
    return [sig_ids.setdefault(_signature(ctx, a, b, spans_at), len(sig_ids)) for a, b in st]


class _Pass:
    """The state of one `_run`: per stage, Pareto fronts keyed by the held-inputs state."""

    def __init__(self, ctx: Context, lay: _Layout, limit: int, max_front: int,
                 optimistic: bool, deadline: float, cache: dict, max_span: int,
                 sure_lives: bool) -> None:
        p = self.p = ctx.p
        self.ctx, self.lay, self.limit, self.max_front = ctx, lay, limit, max_front
        self.optimistic, self.deadline, self.cache, self.max_span = (optimistic, deadline,
                                                                     cache, max_span)
        self.st, self.outside, self.bounds = lay.stages, lay.outside, lay.bounds
        self.table = lay.lower_table if optimistic or sure_lives else lay.upper_table
        m = self.m = len(self.st)
        # relaxed windows up to `tight` stages count every kept output in their residue;
        # longer ones, up to 2 * tight + 1 stages, leave the unsaved ones out so that any
        # longer window splits into them (`_SpanBounds`); short chains relax every length
        # tightly
        self.tight = m if m <= SPLIT_RELAXED_STAGES else TIGHT_SPANS * max_span
        self.subsets = p.n_nodes <= SUBSET_MAX_NODES
        self.stage_sig = _stage_signatures(ctx, self.st)
        self.fronts: list[dict[tuple, _Front]] = [dict() for _ in range(m + 1)]
        start = _Front()
        start.add(np.zeros(1, dtype=np.int64), np.zeros(1), None)
        self.fronts[0][()] = start
        self.rounded = False
        self.relaxed_state: dict[int, tuple] = {}
        self.fwd = np.asarray(p.fwd_time_ms, dtype=float)
        self.fwd_sum = np.concatenate([[0.0], np.cumsum(self.fwd)])
        # `_SpanBounds` does not bound nested options: full-span passes only
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
        """The window `t..u-1`'s options: tuples of regions (`()`: STORE)."""
        ctx, st = self.ctx, self.st
        a, b = st[t][0], st[u - 1][1]
        if self.p.module_spans is not None:
            span_flat, span_nested = _span_options(ctx, a, b, u == t + 1, self.subsets)
            pieces = self._inner(a, b) if flat and u == t + 1 else []
            return (span_flat + pieces if flat else []) + (span_nested if nested else [])
        out = _options(ctx, a, b, u == t + 1, self.subsets) if flat else []
        return out + (_nested_options(ctx, st[t:u]) if nested else [])

    def _inner(self, a: int, b: int) -> list[tuple]:
        """Stage `[a, b)`'s sets of inner regions (`solvers.inner`), once per solve."""
        key = ("inner", a, b)
        if key not in self.cache:
            self.cache[key] = inner_options(self.ctx, a, b, self.outside)
        return self.cache[key]

    def _rel(self, s: int, a: int) -> tuple[int, int]:
        prod = self.p.storage_producer[s]
        return prod - a, self.p.outputs[prod].index(s)

    def _front(self, u: int, state: tuple) -> _Front:
        dst = self.fronts[u].get(state)
        if dst is None:
            dst = self.fronts[u][state] = _Front()
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

    def _extend_from(self, t: int, held_rel: tuple, front: _Front) -> None:
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
            if u - t <= self.max_span:
                self._add_window(t, u, held_rel, front, flat, nested)
            elif not self.optimistic or u - t > 2 * self.tight + 1:
                break
            else:
                self._add_relaxed(t, u, held_rel, front, thinned)

    def _add_relaxed(self, t: int, u: int, held_rel: tuple, front: _Front,
                     thinned: Callable) -> None:
        """A window longer than the span, relaxed (`_SpanBounds.relaxed`): lower pass only."""
        a, b = self.st[t][0], self.st[u - 1][1]
        options = self.bounds.relaxed(a, b, u - t > self.tight)
        for oi, (peak, residue, tms) in enumerate(options):
            if oi == 0 and u - t > 2 * self.max_span + 1:
                continue  # plain (no residue): split-dominated, see _SpanBounds
            cnt = int(np.searchsorted(front.held, self.limit - peak, side="right"))
            if cnt:
                held, times, idx = thinned(cnt)
                self._front(u, self._read_after(u)).add(
                    held + residue, times + tms, _Step(t, held_rel, u, -1, True, False), idx)

    def _spec_of(self, step: _Step) -> Spec:
        return self._profiles(step.start, step.stop, step.held_rel, step.flat,
                              step.nested)[step.option].spec

    def _profiles(self, t: int, u: int, held_rel: tuple, flat: bool, nested: bool
                  ) -> list[_Option]:
        """Every `_Option` of window t..u-1, cached by the window's signature (identical
        blocks share them); a single stage's keep options also by its forward times."""
        key = (tuple(self.stage_sig[t:u]), u == t + 1, held_rel, flat, nested)
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
                parts = profile_parts(self.ctx, a, b, regions, held_in, self.outside)
                profs.append(_Option(parts, self._out_rel(parts, a), _reruns_rel(regions, a),
                                     _spec(regions, a)))
            self.cache[key] = profs
        if not (self.keep_front and flat and u == t + 1):
            return profs
        keyed = (key, tuple(self.p.fwd_time_ms[a:b]), self.optimistic)
        kept = self.cache.get(keyed)
        if kept is None:
            kept = self.cache[keyed] = [
                opt for x, y in _tops(self.p, a, b, True)
                for opt in self._keep_options(a, b, x, y, held_in, key)]
        self.loose |= bool(kept)
        return profs + kept

    def _out_rel(self, parts: WindowParts, a: int) -> tuple:
        return tuple(sorted(self._rel(s, a) for s in parts.held_out))

    def _keep_options(self, a: int, b: int, x: int, y: int, held_in: frozenset[int],
                      key: tuple) -> list[_Option]:
        """Region `[x, y)` of window `[a, b)` keeping each point of its keep front
        (`solvers.keep`); the lower-bound pass gets each point's floor, or the corners of
        a thinned front. The per-node terms are cached by `key` (no times in them)."""
        self._check_deadline()
        space = self.cache.get((key, x - a, y - a, "keep"))
        if space is None:
            space = self.cache[(key, x - a, y - a, "keep")] = KeepSpace.analyse(
                self.ctx, a, b, x, y, held_in, self.outside) or False
        if space is False:
            return []
        info = self.ctx.region(x, y)
        p = self.p
        by_hand = [[i for i, k in enumerate(space.nodes) if wanted(k)]
                   for wanted in (p.is_linear, p.is_matmul)]
        also = [] if self.optimistic else by_hand + under_caps(
            space, self.table[space.base.g_index + a])
        out = []
        for choice in keep_choices(space, optimistic=self.optimistic, also=also)[0]:
            keep = frozenset(space.nodes[i] for i in choice.chosen)
            parts = (space.floor_parts(choice.residue_bytes, choice.exported)
                     if self.optimistic else space.parts(choice.chosen))
            spec = ((x - a, y - a, tuple(sorted(k - a for k in keep)), ()),)
            if choice.real:
                out.append(_Option(parts, self._out_rel(parts, a),
                                   [_flat_rerun_rel(info, keep, a)], spec))
            else:  # a corner: keeping nothing's rerun with the SAC overhead, less its saving
                start, stop, idle, _ = _flat_rerun_rel(info, frozenset(), a)
                sac = (start, stop, idle, np.asarray([x - a], dtype=np.int64))
                out.append(_Option(parts, self._out_rel(parts, a), [sac], spec,
                                   choice.saved_ms))
        return out

    def _add_window(self, t: int, u: int, held_rel: tuple, front: _Front, flat: bool,
                    nested: bool) -> None:
        """Each option of window t..u-1, placed after the entries of `front` it fits."""
        a = self.st[t][0]
        shift = self.st[u][0] - a if u < self.m else 0
        for oi, (parts, out_rel, reruns, _, saved_ms) in enumerate(
                self._profiles(t, u, held_rel, flat, nested)):
            peak = parts.peak(self.ctx, a, self.table)
            # recompute time by position (the window's structure is shared)
            tms = _rerun_ms(self.p, a, self.fwd_sum, self.fwd, reruns) - saved_ms
            cnt = int(np.searchsorted(front.held, self.limit - peak, side="right"))
            if cnt:
                state = tuple((r - shift, k) for r, k in out_rel)
                self._front(u, state).add(front.held[:cnt] + parts.residue_bytes,
                                          front.time[:cnt] + tms,
                                          _Step(t, held_rel, u, oi, flat, nested))


def _backtrack(f: _Front, fronts: list[dict[tuple, _Front]], st: list[tuple[int, int]],
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
            regions.extend(_regions_at(spec_of(step), st[step.start][0]))
        pos, f = int(f.idx[pos]), fronts[step.start][step.held_rel]
    return sorted(regions, key=lambda r: r.start), relaxed


def _space(problem: Problem, lay: _Layout, *, nested: bool) -> SearchSpace:
    return chain_segments(problem, nested=nested, any_keep=problem.n_nodes <= SUBSET_MAX_NODES,
                          long_skips=len(lay.skips), long_skip_nodes=LONG_SKIP_NODES,
                          stage_keep=lay.keep_front)


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
                sure_lives: bool = False) -> Solution | None:
    """The best real schedule with segments of at most `span` stages, scored by `simulate`
    (OPTIMAL when the pass was exact over the whole space); None if none fits. Should
    `simulate` find it over the budget, the pass is repeated with the limit tightened.

    The storages left out of the windows count by their conservative lives, or with
    `sure_lives` by their sure ones: then the answer may exceed the budget, and the
    tightened retries are what find one that fits (often faster than the conservative)."""
    problem = ctx.p
    limit = budget_bytes - problem.static_bytes
    for attempt in range(4):
        try:
            found, rounded, _, loose = _run(ctx, lay, limit, max_front, False, deadline,
                                            cache, span, sure_lives=sure_lives)
        except TimeoutError:
            logger.info("dp hit its %.1f s limit (segments of <= %d of %d stages)",
                           deadline - t0, span, len(lay.stages))
            return None
        if found is None:
            return None
        sched = Schedule.from_segments(problem.n_nodes, found[1])
        exact = not rounded and not loose and not lay.outside and span >= len(lay.stages)
        sol = Solution.scored(problem, sched, budget_bytes, solver="dp", started_s=t0,
                              proven_optimal=exact, bound_ms=found[0] if exact else None,
                              space=_space(problem, lay, nested=True) if exact else None)
        if sol.feasible and not rounded and not _same_ms(found[0], sol.objective_ms):
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
    segmentations only (no claim for a nested answer), a full-span pass nested ones too."""
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


def solve(problem: Problem, budget_bytes: int, time_limit_s: float = 60.0,
          *, max_front: int = 2000, keep_front: bool = True) -> Solution:
    """Least recompute time within the budget over chain segmentations (see module doc);
    `keep_front=False` lets regions keep only nothing or their matmuls."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    ctx = Context(problem)
    lay = _layout(ctx, keep_front)
    cache: dict = {}
    best: Solution | None = None
    bound = 0.0
    nested_bound = None  # a full-span lower pass bounds nested schedules too
    for span in _spans(len(lay.stages)):
        sol = _upper_pass(ctx, lay, budget_bytes, max_front, deadline, cache, span, t0)
        if sol is not None and sol.status == Status.OPTIMAL:
            return sol
        best = _faster(best, sol)
        if time.perf_counter() > deadline:
            break
        try:
            lower, _, relaxed, _ = _run(ctx, lay, budget_bytes - problem.static_bytes, max_front,
                                     True, deadline, cache, span)
        except TimeoutError:
            break
        if lower is None:  # even the relaxed space has no schedule: infeasible
            break
        bound = max(bound, lower[0])
        if span >= len(lay.stages):
            nested_bound = lower[0]
        if lay.outside and not _proven(best, bound):
            # the left-out storages counted by their sure lives may fit a faster schedule
            # (the conservative lives hold them longest); simulate checks it
            best = _faster(best, _upper_pass(ctx, lay, budget_bytes, max_front, deadline, cache,
                                             span, t0, sure_lives=True))
        if best is not None:
            logger.debug("dp: segments of <= %d stages: %.3f ms, lower bound %.3f ms%s", span,
                         best.objective_ms, bound, " (relaxed windows)" if relaxed else "")
            if _proven(best, bound):
                break
        if span >= len(lay.stages):
            break
    if best is not None:
        return _answer(problem, lay, best, bound, nested_bound, budget_bytes, t0)
    mfb = memory_lower_bound(problem)
    return Solution(solver="dp", status=Status.INFEASIBLE, schedule=None,
                    budget_bytes=budget_bytes, objective_ms=None,
                    solve_time_s=time.perf_counter() - t0,
                    min_feasible_budget_bytes=mfb, min_feasible_budget_exact=False)
