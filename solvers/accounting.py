"""Closed-form memory accounting of schedules with at most one nesting level, equal to `simulate`.

For such schedules `simulate`'s live bytes at every event decompose into (a)
schedule-independent constants (static memory, gradients and their accumulation transients,
the loss outputs the caller holds, a node's new outputs and temporaries) plus (b) the bytes of
each activation storage instance over the interval in which something holds it. This module
computes those intervals; `evaluate` sums them and equals `simulate(...)`'s peak and recompute
time (tests hold it to that). The exact solvers (`cpsat`, `dp`) are built on the same pieces,
so their memory model is `simulate`'s, not an approximation.

Holders of an original (forward) instance: a later reader in the forward, a STORE node that
saves it (until that node's backward; this includes the loss outputs the loss's own backward
saves), a top-level RECOMPUTE region's frame when it is the region's input (until the frame
dies, `solvers.frame` F7), the SAC cache for kept outputs (F6). A rerun regenerates new
instances, held by later readers in the rerun and by the backward of the rerun nodes that
save them. Where each rerun starts, stops and what it runs come from `solvers.frame`.

What one region does, flat or with one level of children, is `solvers.region_analysis`.

Recompute time: per rerun, `solvers.clock`'s time of each step; `profile_parts` adds them
step by step in event order, so over the whole graph it equals `simulate`'s float sum
exactly.

`profile` evaluates a window of nodes `[a, b)` only, counting the storages produced in the
window plus those read in it from before `a` that the previous window does not hold
(`external`): for chains this splits the peak into per-segment parts (see `solvers.dp.search`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from solvers.clock import rerun_step_ms
from solvers.problem import Problem
from solvers.region_analysis import (
    BWD,
    FWD,
    ChildSpec,
    Regen,
    RegionInfo,
    Rerun,
)
from solvers.schedule import Region, Schedule

logger = logging.getLogger(__name__)

__all__ = ["Context", "Regen", "RegionInfo", "Rerun", "SegmentProfile",
           "WindowParts", "evaluate", "gradient_bytes", "profile", "profile_parts"]


def gradient_bytes(problem: Problem) -> tuple[list[int], list[int]]:
    """Per backward event j: gradient bytes in its peak, and those a checkpoint's rerun
    that j's backward starts runs on top of (`GradientEvents.at_rerun`; both
    schedule-independent)."""
    g = problem.gradient_events
    return [g.event(j) for j in range(problem.n_nodes)], list(g.at_rerun)


# the sections of `Context.g_table`; RELEASED: a node's moment after it released its saved
# tensors (`GradientEvents.releases`), a slot of its own after its backward event's
RERUN, BACKWARD, FORWARD, RELEASED = 0, 1, 2, 3


def table_index(n: int, section: int, j: int) -> int:
    """Index of node `j`'s entry in `section` of an `n`-node problem's `Context.g_table`."""
    return section * n + j


def table_slice(n: int, section: int, start: int, stop: int) -> slice:
    """Nodes `start..stop-1` of `section` of `Context.g_table`."""
    return slice(section * n + start, section * n + stop)


@dataclass(frozen=True)
class WindowStorages:
    """The storages a window `[a0, b0)` counts (made in it, or read in it from before and
    not `external`; neither the caller's nor `skip`), with what bounds their lives before
    any region is placed: the same for every set of regions, so `Context` keeps one per
    window and `profile_parts` adds the regions' holders to it."""

    storages: np.ndarray  # int64 storage ids
    row: dict[int, int]  # storage id -> its index in `storages`
    start: np.ndarray  # first slot (after its producer's forward; 0 if made before a0)
    end: np.ndarray  # last slot its forward readers hold it (-1: none in the window)
    nbytes: np.ndarray
    read_after: np.ndarray  # bool: read after the window (a candidate for `held_out`)
    saver_row: np.ndarray  # per saver in the window: the row of what it saves
    saver_node: np.ndarray  # and the saver, relative to a0

    @classmethod
    def build(cls, ctx: Context, a0: int, b0: int, external: frozenset[int],
              skip: frozenset[int]) -> WindowStorages:
        p, n_fw = ctx.p, b0 - a0
        loss = ctx.loss | skip
        local = [s for i in range(a0, b0) for s in p.outputs[i] if s not in loss]
        local += [s for s in sorted({s for i in range(a0, b0) for s in p.uses[i]
                                     if p.storage_producer[s] < a0})
                  if s not in external and s not in loss]
        start, end, read_after, saver_row, saver_node = [], [], [], [], []
        for row, s in enumerate(local):
            prod, lr = p.storage_producer[s], ctx.last_read[s]
            start.append(prod - a0 + 1 if prod >= a0 else 0)
            end.append(n_fw - 1 if lr >= b0 else lr - a0 if lr > prod else -1)
            read_after.append(lr >= b0)
            for k in ctx.savers[s]:
                if a0 <= k < b0:
                    saver_row.append(row)
                    saver_node.append(k - a0)
        ints = functools.partial(np.asarray, dtype=np.int64)
        return cls(ints(local), {s: row for row, s in enumerate(local)}, ints(start),
                   ints(end), ctx.nbytes_array[ints(local)], np.asarray(read_after, dtype=bool),
                   ints(saver_row), ints(saver_node))


class Context:
    """Schedule-independent data of a problem, computed once per solve; it also keeps
    what the solve's schedules share: each region's rerun analysis (`region`), each flat
    region's keep-independent part and each window's storages (`window_storages`)."""

    def __init__(self, problem: Problem) -> None:
        p = problem
        self.p = p
        n, m = p.n_nodes, p.n_storages
        self.n = n
        self.last_read = p.last_read
        savers: list[list[int]] = [[] for _ in range(m)]
        for k in range(n):
            for s in p.saved[k]:
                savers[s].append(k)
        self.savers = savers
        # the caller holds the loss outputs all step, except those the loss's backward saves
        self.loss = p.caller_held
        self.loss_bytes = sum(p.storage_bytes[s] for s in self.loss)
        # in forward, a caller-held storage counts from the node after its producer on
        held_fwd = np.zeros(n, dtype=np.int64)
        for s in self.loss:
            held_fwd[p.storage_producer[s] + 1:] += p.storage_bytes[s]
        self.alloc = [p.output_bytes(i) for i in range(n)]
        # gradient bytes in backward event j's peak / live just before it (reruns see this)
        self.g_event, self.g_rest = gradient_bytes(p)
        grads = p.gradient_events
        self.releasing = [grads.releases(j) for j in range(n)]
        self.held_fwd = held_fwd
        # bytes outside any window at node j, per kind of event: sections of n entries,
        # indexed by `table_index` (RERUN, BACKWARD, RELEASED: gradients + loss; FORWARD:
        # caller-held storages made before j)
        released = np.asarray(grads.released or [0] * n, dtype=np.int64)
        sections = {RERUN: np.asarray(self.g_rest, dtype=np.int64) + self.loss_bytes,
                    BACKWARD: np.asarray(self.g_event, dtype=np.int64) + self.loss_bytes,
                    FORWARD: held_fwd, RELEASED: released + self.loss_bytes}
        self.g_table = np.concatenate([sections[k] for k in sorted(sections)])
        self._regions: dict[tuple[int, int, frozenset[int], tuple[ChildSpec, ...]],
                            RegionInfo] = {}
        self.nbytes_array = np.asarray(p.storage_bytes, dtype=np.int64)
        self.flat_frames: dict = {}  # `region_analysis._flat_frame`'s, per region
        # each node's forward and backward event constants (`_Slots`)
        self.fwd_const = [self.alloc[i] + p.fwd_event_bytes[i] for i in range(n)]
        self.bwd_temp = list(p.bwd_temp_bytes)
        self._windows: dict[tuple[int, int, frozenset[int], frozenset[int]],
                            WindowStorages] = {}

    def region(self, a: int, b: int, keep: Iterable[int] = (),
               children: Iterable[tuple[int, int, Iterable[int]]] = ()) -> RegionInfo:
        """The (cached) rerun analysis of a top-level RECOMPUTE region `[a, b)`.

        `children` lists its nested RECOMPUTE regions as `(start, stop, keep)`, sorted and
        disjoint, without children of their own.
        """
        key = (a, b, frozenset(keep), tuple((ca, cb, frozenset(ck)) for ca, cb, ck in children))
        info = self._regions.get(key)
        if info is None:
            info = self._regions[key] = RegionInfo.build(self, *key)
        return info

    def window_storages(self, a0: int, b0: int, external: frozenset[int],
                        skip: frozenset[int]) -> WindowStorages:
        """The (cached) storages window `[a0, b0)` counts (`WindowStorages`)."""
        key = (a0, b0, external, skip)
        found = self._windows.get(key)
        if found is None:
            found = self._windows[key] = WindowStorages.build(self, a0, b0, external, skip)
        return found


@dataclass(frozen=True)
class SegmentProfile:
    """Result of `profile` on a window: local peak, retained bytes, held outputs, time."""

    peak_bytes: int  # max over the window's events of constants + local live bytes
    residue_bytes: int  # local bytes still held at the end of the forward
    held_out: frozenset[int]  # storages read after the window that the window holds
    time_ms: float  # recompute time


def _top_regions(schedule: Schedule) -> list[Region]:
    for r in schedule.regions:
        for c in r.children:
            if c.children:
                raise ValueError(
                    f"accounting handles one level of nested checkpoints, but {r.describe()} "
                    f"nests {c.describe()} deeper; use simulate().")
    return [r for r in schedule.regions if r.is_recompute]


@dataclass(frozen=True)
class WindowParts:
    """`profile` split into what depends on the window's position and what does not.

    The live bytes at slot t are `local[t] + ctx.g_table[g_index[t] + a0]`: `local` holds the
    storage intervals and the per-node constants (allocations, temporaries); the gradient and
    loss bytes, which differ between otherwise identical blocks (parameter gradients pile up),
    come from the position-dependent table. So identical windows at different positions share
    one `WindowParts` (see `solvers.dp.search`).
    """

    local: np.ndarray  # int64 per slot
    g_index: np.ndarray  # int64 per slot, relative to the window start
    residue_bytes: int
    held_out: frozenset[int]
    time_ms: float
    by_position_bytes: int = 0  # of `residue_bytes`: `profile_parts`' `by_position` storages

    def peak(self, ctx: Context, a0: int, table: np.ndarray | None = None) -> int:
        """Local peak of the window placed at `a0` (what `profile` reports).

        `table` replaces `ctx.g_table` (same layout), e.g. with bytes of storages left out
        of the window (`skip`) added by position.
        """
        if not len(self.local):
            return 0
        g = ctx.g_table if table is None else table
        return max(0, int((self.local + g[self.g_index + a0]).max()))

    def peaks(self, a0: int, table: np.ndarray, n_forward: int) -> tuple[int, int]:
        """`peak` split: over the window's first `n_forward` slots (its forward) and over
        the rest (its reruns and backward)."""
        live = self.local + table[self.g_index + a0]
        return (max(0, int(live[:n_forward].max(initial=0))),
                max(0, int(live[n_forward:].max(initial=0))))


def profile_parts(ctx: Context, a0: int, b0: int,
                  regions: Sequence[RegionInfo],
                  external: frozenset[int] = frozenset(),
                  skip: frozenset[int] = frozenset(),
                  after_forward: frozenset[int] = frozenset(),
                  held_on: frozenset[int] = frozenset(),
                  by_position: frozenset[int] = frozenset(),
                  until: Mapping[int, int] | None = None) -> WindowParts:
    """`profile`'s computation, returned as position-independent parts (`WindowParts`).

    Storages in `skip` are left out (their original instance; copies a rerun regenerates
    still count): the caller accounts for them by position (`WindowParts.peak`'s table).
    Storages in `after_forward` count only where this window's own savers and regions hold
    them after its forward, and in its residue only those in `held_on` (a lower bound's
    use: the caller counts their forward by position, and another window may hold them
    too, except those in `held_on`). Neither is ever part of `held_out`. Of those in its
    residue, the bytes of the ones in `by_position` (which the caller also counts by position
    at the later windows' forward events) are reported apart (`by_position_bytes`). Of
    `after_forward`, those in `until` count only at the reruns and backward events of
    nodes up to `until[s]` (the caller's table counts them at the later nodes').
    Slots are `simulate`'s events in order: the forward of the window's nodes, then per
    backward node j (descending) the steps of the reruns it triggers (a parent's before its
    child's), j's own event and, where it has one, its moment after release (`_Slots`).
    """
    n_fw = b0 - a0
    plans = list(regions)
    slots = _Slots.lay_out(ctx, a0, b0, plans)
    w = ctx.window_storages(a0, b0, external, skip)
    bwd = np.asarray(slots.bwd_slot, dtype=np.int64)
    end = w.end.copy()
    if len(w.saver_row):  # saved outside the window's regions: held to the saver's backward
        outside = ~np.asarray(slots.in_region, dtype=bool)[w.saver_node]
        np.maximum.at(end, w.saver_row[outside], bwd[w.saver_node[outside]])
    for pi, r in enumerate(plans):  # frame inputs, SAC caches, child inputs
        for s, (kind, node, ri) in r.held.items():
            row = w.row.get(s)
            if row is not None:
                end[row] = max(end[row], slots.bwd_slot[node - a0] if kind == BWD else
                               node - a0 if kind == FWD else slots.off[pi][ri] + node)
    start, counted = w.start, end >= n_fw  # counted: held through the end of the forward
    late = [w.row[s] for s in after_forward if s in w.row]
    if late:
        start = start.copy()
        for row in late:
            start[row] = _after_forward_start(ctx, w, row, n_fw, b0, a0, until, slots)
            counted[row] &= int(w.storages[row]) in held_on
    lives = (end >= start) & (w.nbytes > 0)
    diff = np.zeros(len(slots.const) + 1, dtype=np.int64)
    np.add.at(diff, start[lives], w.nbytes[lives])
    np.add.at(diff, end[lives] + 1, -w.nbytes[lives])
    _add_regenerated(diff, plans, slots, a0, ctx.nbytes_array)
    residue = int(w.nbytes[counted].sum())
    by_position_bytes = sum(int(w.nbytes[w.row[s]]) for s in by_position
                            if s in w.row and counted[w.row[s]])
    out = counted & w.read_after
    if late:
        out[late] = False
    live = np.cumsum(diff[:-1])
    return WindowParts(np.asarray(slots.const, dtype=np.int64) + live,
                       np.asarray(slots.gidx, dtype=np.int64), residue,
                       frozenset(w.storages[out].tolist()), slots.time_ms, by_position_bytes)


def _after_forward_start(ctx: Context, w: WindowStorages, row: int, n_fw: int, b0: int,
                         a0: int, until: Mapping[int, int] | None, slots: _Slots) -> int:
    """Where an `after_forward` storage starts to count: after the window's forward, and
    with a cap in `until`, after the backward of the node past it."""
    start = max(int(w.start[row]), n_fw)
    cap = until.get(int(w.storages[row])) if until else None
    if cap is not None and cap + 1 < b0:  # the slots after node cap + 1's backward
        start = max(start, slots.bwd_slot[cap + 1 - a0] + 1 if cap + 1 >= a0
                    else len(slots.const))
    return start


@dataclass
class _Slots:
    """The events of a window in `simulate`'s order, with what each adds by itself.

    `const`: bytes allocated or temporary at each slot; `gidx`: its `Context.g_table` entry
    relative to the window start; `bwd_slot[k]`: slot of node a0 + k's backward (its moment
    after release, where it has one, is the next slot); `off[pi][r] + x`: slot of node x's
    step in rerun r of plan pi; `time_ms`: the reruns' time, added step by step in event
    order as `simulate` does (equal to the bit).
    """

    const: list[int]
    gidx: list[int]
    bwd_slot: list[int]
    off: list[list[int]]
    in_region: list[bool]
    time_ms: float

    @classmethod
    def lay_out(cls, ctx: Context, a0: int, b0: int,
                plans: Sequence[RegionInfo]) -> _Slots:
        p, n, n_fw = ctx.p, ctx.n, b0 - a0
        in_region = [False] * n_fw
        at_trigger: dict[int, list[tuple[int, int]]] = {}
        for pi, r in enumerate(plans):
            in_region[r.a - a0:r.b - a0] = [True] * (r.b - r.a)
            for ri, rr in enumerate(r.reruns):
                at_trigger.setdefault(rr.trigger, []).append((pi, ri))
        const: list[int] = ctx.fwd_const[a0:b0]
        gidx: list[int] = list(range(table_index(n, FORWARD, 0), table_index(n, FORWARD, n_fw)))
        bwd_slot = [0] * n_fw
        off: list[list[int]] = [[0] * len(r.reruns) for r in plans]
        time_ms = 0.0
        top = b0  # the backward of nodes [j + 1, top) is laid out next, none triggering
        for j in [*sorted((t for t in at_trigger if a0 <= t < b0), reverse=True), a0 - 1]:
            _backward_slots(ctx, a0, j + 1, top, const, gidx, bwd_slot)
            if j < a0:
                break
            for pi, ri in at_trigger[j]:
                rr = plans[pi].reruns[ri]
                off[pi][ri] = len(const) - rr.start
                const.extend(rr.step_const)
                gidx.extend([table_index(n, RERUN, j - a0)] * len(rr.step_const))
                idle = rr.idle
                for i in range(rr.start, rr.stop):  # summed as `simulate` sums its events
                    time_ms += rerun_step_ms(p, i, i in idle,
                                             rr.overhead_ms if i == rr.start else 0.0)
            _backward_slots(ctx, a0, j, j + 1, const, gidx, bwd_slot)
            top = j
        return cls(const, gidx, bwd_slot, off, in_region, time_ms)


def _backward_slots(ctx: Context, a0: int, lo: int, hi: int, const: list[int],
                    gidx: list[int], bwd_slot: list[int]) -> None:
    """Lay out the backward events of nodes hi - 1 down to lo, none triggering a rerun,
    each followed by its moment after release where it has one (`Context.releasing`)."""
    n = ctx.n
    if not any(ctx.releasing[lo:hi]):
        first = len(const)
        bwd_slot[lo - a0:hi - a0] = range(first + hi - lo - 1, first - 1, -1)
        const.extend(reversed(ctx.bwd_temp[lo:hi]))
        gidx.extend(range(table_index(n, BACKWARD, hi - 1 - a0),
                          table_index(n, BACKWARD, lo - 1 - a0), -1))
        return
    for j in range(hi - 1, lo - 1, -1):
        bwd_slot[j - a0] = len(const)
        const.append(ctx.bwd_temp[j])
        gidx.append(table_index(n, BACKWARD, j - a0))
        if ctx.releasing[j]:
            const.append(0)
            gidx.append(table_index(n, RELEASED, j - a0))


def _add_regenerated(diff: np.ndarray, plans: Sequence[RegionInfo], slots: _Slots,
                     a0: int, nbytes_of: np.ndarray) -> None:
    """Add each rerun-regenerated instance's bytes to `diff` from its step to its end."""
    bwd = np.asarray(slots.bwd_slot, dtype=np.int64)
    for pi, r in enumerate(plans):
        storage, rerun, step, kind, node, end_rerun = r.regen_cols
        if not len(storage):
            continue
        o = np.asarray(slots.off[pi], dtype=np.int64)
        first = o[rerun] + step + 1
        last = np.where(kind == BWD, bwd[np.where(kind == BWD, node - a0, 0)],
                        o[end_rerun] + node) + 1
        ok = last > first
        sz = nbytes_of[storage[ok]]
        np.add.at(diff, first[ok], sz)
        np.add.at(diff, last[ok], -sz)


def profile(ctx: Context, a0: int, b0: int, regions: Sequence[RegionInfo],
            external: frozenset[int] = frozenset()) -> SegmentProfile:
    """Exact local memory of the events of nodes `[a0, b0)` under top-level `regions`.

    `regions` lie inside the window and do not overlap; the other nodes of the window are
    STORE. Constants (gradients, loss, temporaries) are global; static bytes are not added.
    """
    parts = profile_parts(ctx, a0, b0, regions, external)
    return SegmentProfile(parts.peak(ctx, a0), parts.residue_bytes, parts.held_out,
                          parts.time_ms)


def evaluate(problem: Problem, schedule: Schedule, ctx: Context | None = None) -> tuple[int, float]:
    """Peak bytes and recompute time of a schedule nesting at most one level, no replay."""
    ctx = ctx or Context(problem)
    regions = [ctx.region(r.start, r.stop, r.keep,
                          children=[(c.start, c.stop, c.keep) for c in r.children])
               for r in _top_regions(schedule)]
    prof = profile(ctx, 0, problem.n_nodes, regions)
    return problem.static_bytes + prof.peak_bytes, prof.time_ms
