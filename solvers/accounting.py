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

One nesting level (`NestedRegionInfo`): a parent P with RECOMPUTE children C (no
grandchildren) makes up to 1 + len(children) reruns: P's (F2-F4, its children's inputs
packed into it), in which children run as fresh checkpoints (their saves are not kept,
their kept outputs and inputs live until P's rerun ends), then each child's that packs,
from the inputs P's rerun regenerated (F5), which live until then and the backward of the
child nodes saving them.

Recompute time: per rerun, the forward time of the nodes it runs plus its frame's
`Problem.checkpoint_overhead_ms`; `profile_parts` adds them step by step in event order, so
over the whole graph it equals `simulate`'s float sum exactly.

`profile` evaluates a window of nodes `[a, b)` only, counting the storages produced in the
window plus those read in it from before `a` that the previous window does not hold
(`external`): for chains this splits the peak into per-segment parts (see `solvers.dp`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

from solvers.frame import ChildFrame, FrameRules, frame_end, frame_rules, own_packs
from solvers.problem import Problem
from solvers.schedule import Region, Schedule

logger = logging.getLogger(__name__)

__all__ = ["Context", "NestedRegionInfo", "Regen", "RegionInfo", "Rerun", "SegmentProfile",
           "WindowParts", "evaluate", "gradient_bytes", "profile", "profile_parts"]

ChildSpec = tuple[int, int, frozenset[int]]  # (start, stop, keep) of a child region


def gradient_bytes(problem: Problem) -> tuple[list[int], list[int]]:
    """Per backward event j: gradient bytes in its peak, and gradient bytes live just before
    (`Problem.gradient_events`; both schedule-independent)."""
    g = problem.gradient_events
    return [g.event(j) for j in range(problem.n_nodes)], list(g.before)


RERUN, BACKWARD, FORWARD = 0, 1, 2  # the sections of `Context.g_table`


def table_index(n: int, section: int, j: int) -> int:
    """Index of node `j`'s entry in `section` of an `n`-node problem's `Context.g_table`."""
    return section * n + j


def table_slice(n: int, section: int, start: int, stop: int) -> slice:
    """Nodes `start..stop-1` of `section` of `Context.g_table`."""
    return slice(section * n + start, section * n + stop)


class Context:
    """Schedule-independent data of a problem, computed once per solve."""

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
        self.alloc = [sum(p.storage_bytes[s] for s in p.outputs[i]) for i in range(n)]
        # gradient bytes in backward event j's peak / live just before it (reruns see this)
        self.g_event, self.g_rest = gradient_bytes(p)
        self.held_fwd = held_fwd
        # bytes outside any window at node j, per kind of event: sections of n entries,
        # indexed by `table_index` (RERUN, BACKWARD: gradients + loss; FORWARD: caller-held
        # storages made before j)
        sections = {RERUN: np.asarray(self.g_rest, dtype=np.int64) + self.loss_bytes,
                    BACKWARD: np.asarray(self.g_event, dtype=np.int64) + self.loss_bytes,
                    FORWARD: held_fwd}
        self.g_table = np.concatenate([sections[k] for k in sorted(sections)])
        self._regions: dict[tuple[int, int, frozenset[int]], RegionInfo] = {}
        self._nested: dict[tuple[int, int, frozenset[int], tuple[ChildSpec, ...]],
                           NestedRegionInfo] = {}

    @overload
    def region(self, a: int, b: int, keep: Iterable[int] = ()) -> RegionInfo: ...

    @overload
    def region(self, a: int, b: int, keep: Iterable[int] = (),
               children: Iterable[tuple[int, int, Iterable[int]]] = ()
               ) -> RegionInfo | NestedRegionInfo: ...

    def region(self, a: int, b: int, keep: Iterable[int] = (),
               children: Iterable[tuple[int, int, Iterable[int]]] = ()
               ) -> RegionInfo | NestedRegionInfo:
        """The (cached) rerun analysis of a top-level RECOMPUTE region `[a, b)`.

        `children` lists its nested RECOMPUTE regions as `(start, stop, keep)`, sorted and
        disjoint, without children of their own; with any, the analysis is a
        `NestedRegionInfo`, else the flat `RegionInfo` the solvers use.
        """
        kids = tuple((ca, cb, frozenset(ck)) for ca, cb, ck in children)
        if kids:
            nkey = (a, b, frozenset(keep), kids)
            nested = self._nested.get(nkey)
            if nested is None:
                nested = NestedRegionInfo.build(self, *nkey)
                self._nested[nkey] = nested
            return nested
        key = (a, b, frozenset(keep))
        info = self._regions.get(key)
        if info is None:
            info = RegionInfo.build(self, *key)
            self._regions[key] = info
        return info


@dataclass(frozen=True)
class Instance:
    """A storage instance regenerated by a rerun: bytes, rerun step producing it, ends.

    It lives from the step after `step` until the later of its last rerun reader (`read_end`,
    a node index, -1 if none) and the backward of its savers (`savers`).
    """

    storage: int
    step: int
    read_end: int
    savers: tuple[int, ...]


@dataclass(frozen=True)
class Kept:
    """Where a kept output's cached original is released (`solvers.frame` F6): the rerun
    takes it and needs it up to step `last_step` (its own step or its last reader there),
    then the backward of `savers` may hold it further; `last_step` None: the rerun never
    takes it, and it stays cached until the frame dies."""

    last_step: int | None = None
    savers: tuple[int, ...] = ()

    @property
    def until_death(self) -> bool:
        """Whether the frame's death, not the rerun, releases it."""
        return self.last_step is None


@dataclass
class RegionInfo:
    """What `simulate` does for one top-level RECOMPUTE region without children,
    independent of the rest.

    `rules` are its frame's (`solvers.frame`); `stop`, `trigger`, `death` and `last_not_run`
    repeat them (`stop` 0 when nothing packs and no rerun happens). `packs`: the frame
    reruns. `kept_ends`: per kept output storage, when its cached original is released.
    """

    a: int
    b: int
    keep: frozenset[int]
    rules: FrameRules
    inputs: tuple[int, ...]
    time_ms: float
    step_const: list[int] = field(default_factory=list)  # alloc + temp of each rerun step
    regen: list[Instance] = field(default_factory=list)
    kept_ends: dict[int, Kept] = field(default_factory=dict)
    _general: NestedRegionInfo | None = field(default=None, repr=False, compare=False)

    @property
    def packs(self) -> bool:
        return self.rules.reruns

    @property
    def stop(self) -> int:
        return self.rules.rerun_stop

    @property
    def trigger(self) -> int:
        return self.rules.trigger

    @property
    def death(self) -> int | None:
        return self.rules.death

    @property
    def last_not_run(self) -> bool:
        return self.rules.last_not_run

    def general(self, ctx: Context) -> NestedRegionInfo:
        """The same analysis in `NestedRegionInfo`'s form (no children), which `profile_parts`
        evaluates; built once, on first use, so solvers that only need this class pay nothing."""
        if self._general is None:
            self._general = NestedRegionInfo.from_flat(ctx, self)
        return self._general

    @classmethod
    def build(cls, ctx: Context, a: int, b: int, keep: frozenset[int]) -> RegionInfo:
        """Analyse region `[a, b)` with kept nodes `keep`."""
        p = ctx.p
        rules = frame_rules(p, own_packs(p, a, b))
        run = rules.run_steps(a)
        time_ms = float(sum(p.fwd_time_ms[i] for i in run if i not in keep)
                        + (p.checkpoint_overhead_ms(a, rules.rerun_stop, keep)
                           if rules.reruns else 0.0))
        info = cls(a, b, keep, rules, p.region_inputs(a, b), time_ms)
        for i in rules.rerun_steps(a):
            if i not in run:  # F3: the rerun stops in its pack, nothing made
                info.step_const.append(0)
                continue
            cached = i in keep
            info.step_const.append(0 if cached else ctx.alloc[i] + p.fwd_temp_bytes[i])
            for s in p.outputs[i]:
                read_end = p.rerun_read_end(s, i, rules.rerun_stop)
                savers = tuple(k for k in ctx.savers[s] if k < rules.rerun_stop and p.packs[k])
                if not cached:
                    info.regen.append(Instance(s, i, read_end, savers))
                elif s not in ctx.loss:
                    info.kept_ends[s] = Kept(max(i, read_end), savers)
        for k in keep:  # F6: kept nodes the rerun does not run stay cached until death
            if not rules.takes_cached(a, k):
                info.kept_ends.update((s, Kept()) for s in p.outputs[k] if s not in ctx.loss)
        return info

    def steps(self) -> range:
        """Node indices the rerun runs (kept ones included, at no cost)."""
        return self.rules.rerun_steps(self.a)


# End points of an instance's holders: (kind, node, rerun index in the region). Inside one
# region they are totally ordered whatever window holds it (`_order`), so each instance keeps
# only its latest; `profile_parts` turns that into a slot, after which the instance is freed.
FWD = 0  # the forward event of `node` (a frame that dies in forward: end of its region)
BWD = 1  # the backward event of `node`
STEP = 2  # the step of `node` in rerun `rerun` (its last step: held until the rerun ends)
Point = tuple[int, int, int]


@dataclass(frozen=True)
class Rerun:
    """One rerun pass of a frame with `rules`, entered at `start`: the steps
    `rules.rerun_steps(start)`, at the backward of `rules.trigger`.

    Nodes in `cached` come from the SAC cache (no time, no new memory); `idle` are the steps
    that do no work (F3); `step_const` is each step's allocation + forward temporaries (0 when
    idle). `time_ms` is the forward time of the nodes run plus `overhead_ms`, the frame's
    `Problem.checkpoint_overhead_ms`, which `simulate` charges to the first step.
    """

    start: int
    rules: FrameRules
    cached: frozenset[int]
    step_const: tuple[int, ...]
    overhead_ms: float
    time_ms: float

    @property
    def stop(self) -> int:
        return self.rules.rerun_stop

    @property
    def trigger(self) -> int:
        return self.rules.trigger

    @property
    def idle(self) -> frozenset[int]:
        """The steps that cost no time: kept nodes, and the last one when it is not run."""
        return self.rules.idle_steps(self.cached)


@dataclass(frozen=True)
class Regen:
    """An instance made by rerun `rerun` at its step of node `step`, live until `end`."""

    storage: int
    rerun: int
    step: int
    end: Point


def _order(reruns: Sequence[Rerun]) -> Callable[[Point], tuple[int, int, int, int, int]]:
    """Sort key of a region's points in event order: the forward, then per backward node j
    (descending) the reruns it triggers (in `reruns` order: a parent's before its child's),
    then j's own event."""
    def key(pt: Point) -> tuple[int, int, int, int, int]:
        kind, node, r = pt
        if kind == FWD:
            return (0, node, 0, 0, 0)
        if kind == BWD:
            return (1, -node, 1, 0, 0)
        return (1, -reruns[r].trigger, 0, r, node)
    return key


def _check_children(a: int, b: int, keep: frozenset[int],
                    children: tuple[ChildSpec, ...]) -> None:
    pos = a
    for ca, cb, ckeep in children:
        if not pos <= ca < cb <= b:
            raise ValueError(f"child [{ca}, {cb}) of region [{a}, {b}) must lie inside it, "
                             f"sorted and not overlapping its siblings.")
        if any(not ca <= k < cb for k in ckeep):
            raise ValueError(f"child [{ca}, {cb}) keeps nodes outside it: {sorted(ckeep)}.")
        if any(ca <= k < cb for k in keep):
            raise ValueError(f"region [{a}, {b}) keeps a node of its child [{ca}, {cb}); put it "
                             f"in the child's keep.")
        pos = cb
    if any(not a <= k < b for k in keep):
        raise ValueError(f"region [{a}, {b}) keeps nodes outside it: {sorted(keep)}.")


@dataclass(frozen=True, eq=False)
class NestedRegionInfo:
    """What `simulate` does for one top-level RECOMPUTE region with one level of children.

    Everything is in absolute node indices but says only "event of node x" or "step of node
    x in rerun r", so `profile_parts` places it in any window holding the region (the DP's
    translation-invariant cache stays valid). `packs`, `stop`, `trigger` and `death` describe
    the parent's frame as in `RegionInfo` (`stop` may equal `a`: a rerun that only unpacks
    the inputs of a first child); `reruns` lists the parent's rerun first (when it happens),
    then each saving child's; `regen_cols` the instances they make that outlive their step
    (`regen`'s fields as int64 columns, placed by `profile_parts` in one numpy pass);
    `held` the latest extra holder of original instances (frame inputs, SAC caches, child
    inputs); `time_ms` the recompute time of all reruns, overheads included.
    """

    a: int
    b: int
    keep: frozenset[int]
    children: tuple[ChildSpec, ...]
    inputs: tuple[int, ...]
    rules: FrameRules  # the parent's frame
    reruns: tuple[Rerun, ...]
    regen_cols: tuple[np.ndarray, ...] = field(repr=False)  # storage, rerun, step, *end
    held: Mapping[int, Point]
    time_ms: float

    @property
    def packs(self) -> bool:
        return self.rules.reruns

    @property
    def stop(self) -> int:
        return self.rules.rerun_stop

    @property
    def trigger(self) -> int:
        return self.rules.trigger

    @property
    def death(self) -> int | None:
        return self.rules.death

    @property
    def regen(self) -> tuple[Regen, ...]:
        """The regenerated instances that outlive their step, as objects."""
        storage, rerun, step, kind, node, end_rerun = (c.tolist() for c in self.regen_cols)
        return tuple(Regen(*row[:3], row[3:]) for row in zip(
            storage, rerun, step, zip(kind, node, end_rerun, strict=True), strict=True))

    @classmethod
    def build(cls, ctx: Context, a: int, b: int, keep: frozenset[int],
              children: tuple[ChildSpec, ...]) -> NestedRegionInfo:
        """Analyse `[a, b)` keeping `keep`, with children `(start, stop, keep)` (no deeper).

        Follows `simulate._Replay`: `_build_frame` for stops and deaths, `_pass` with a root
        frame for the reruns, `_enter_children` for the child inputs the parent's rerun saves.
        """
        _check_children(a, b, keep, children)
        return _NestedAnalysis(ctx, a, b, keep, children).result()

    @classmethod
    def from_flat(cls, ctx: Context, r: RegionInfo) -> NestedRegionInfo:
        """`r`'s analysis in this form, from its fields (cheaper than a new `build`)."""
        p = ctx.p
        end_of_frame = _frame_end_point(r.rules, r.b)
        held = dict.fromkeys(r.inputs, end_of_frame)
        for s, kept in r.kept_ends.items():
            # a saver (<= the trigger) frees it after the whole rerun, a last reader inside it
            held[s] = (end_of_frame if kept.last_step is None else
                       (BWD, min(kept.savers), 0) if kept.savers else (STEP, kept.last_step, 0))
        reruns = (Rerun(r.a, r.rules, r.keep & frozenset(r.steps()), tuple(r.step_const),
                        p.checkpoint_overhead_ms(r.a, r.stop, r.keep), r.time_ms),
                  ) if r.packs else ()
        # savers are ascending: the first is the earliest, the last to run backward
        g = np.asarray([(x.storage, x.step, x.read_end, x.savers[0] if x.savers else -1)
                        for x in r.regen], dtype=np.int64).reshape(-1, 4)
        g = g[(g[:, 3] >= 0) | (g[:, 2] >= 0)]
        saved = g[:, 3] >= 0
        zero = np.zeros(len(g), dtype=np.int64)
        cols = (g[:, 0], zero, g[:, 1], np.where(saved, BWD, STEP).astype(np.int64),
                np.where(saved, g[:, 3], g[:, 2]), zero)
        return cls(r.a, r.b, r.keep, (), r.inputs, r.rules, reruns, cols, held, r.time_ms)


def _frame_end_point(rules: FrameRules, stop: int) -> Point:
    """`solvers.frame.frame_end` as a point of a window's events."""
    end = frame_end(rules, stop)
    return (BWD if end.backward else FWD, end.node, 0)


@dataclass(frozen=True)
class SegmentProfile:
    """Result of `profile` on a window: local peak, retained bytes, held outputs, time."""

    peak_bytes: int  # max over the window's events of constants + local live bytes
    residue_bytes: int  # local bytes still held at the end of the forward
    held_out: frozenset[int]  # storages read after the window that the window holds
    time_ms: float  # recompute time



class _NestedAnalysis:
    """`NestedRegionInfo.build`'s work: the frames, then each rerun's steps and instances,
    and who holds what until when (`Point`s, the latest wins)."""

    def __init__(self, ctx: Context, a: int, b: int, keep: frozenset[int],
                 children: tuple[ChildSpec, ...]) -> None:
        p = self.p = ctx.p
        self.ctx, self.a, self.b, self.keep, self.children = ctx, a, b, keep, children
        self.owner: dict[int, int] = {}  # node -> index of the child holding it
        for ci, (ca, cb, _) in enumerate(children):
            for i in range(ca, cb):
                self.owner[i] = ci
        # frames: a child's packs are its own nodes' saves; the parent's also its children's
        # inputs (saved into it at their entry), so its stop, trigger and death depend on them
        self.c_in = [p.region_inputs(ca, cb) for ca, cb, _ in children]
        self.c_rules = [frame_rules(p, own_packs(p, ca, cb)) for ca, cb, _ in children]
        self.inputs = p.region_inputs(a, b)
        own = own_packs(p, a, b, [(ca, cb) for ca, cb, _ in children])
        with_in = [ci for ci in range(len(children)) if self.c_in[ci]]
        self.rules = frame_rules(p, own, [ChildFrame(children[ci][0], self.c_rules[ci])
                                          for ci in with_in])
        # reruns: the parent's first (F5, when it happens), then each saving child's
        self.saving = [ci for ci in range(len(children)) if self.c_rules[ci].reruns]
        self.rerun_of = {ci: int(self.rules.reruns) + t for t, ci in enumerate(self.saving)}
        self.child_args: dict[int, list[int]] = {}
        for ci in with_in:
            for s in self.c_in[ci]:
                self.child_args.setdefault(s, []).append(ci)
        self.held: dict[int, list[Point]] = {}
        self.reruns: list[Rerun] = []
        self.made: list[tuple[int, int, int, list[Point]]] = []

    def _hold(self, s: int, pts: Iterable[Point]) -> None:
        self.held.setdefault(s, []).extend(pts)

    def _hold_outputs(self, k: int, pts: list[Point]) -> None:
        for s in self.p.outputs[k]:
            self._hold(s, pts)

    def _hold_originals(self) -> None:
        """The parent's frame holds its inputs until it dies (its rerun and children hold
        them too, but only until then: nothing to add); SAC caches hold kept outputs that
        no rerun takes until their frame dies (F6)."""
        end_of_frame = _frame_end_point(self.rules, self.b)
        for s in self.inputs:
            self._hold(s, [end_of_frame])
        for k in self.keep:
            if not self.rules.takes_cached(self.a, k):
                self._hold_outputs(k, [end_of_frame])
        for (ca, cb, ckeep), rules in zip(self.children, self.c_rules, strict=True):
            for k in ckeep:
                if not rules.takes_cached(ca, k):
                    self._hold_outputs(k, [_frame_end_point(rules, cb)])

    def _rerun_ends(self, s: int, i: int, r: int, first: int, last: int,
                    parent: bool) -> list[Point]:
        """Holders inside rerun `r` (nodes first..last-1) of storage s made at node i: its
        last reader there, and the nodes there saving it into their frame (for the parent's
        rerun, not those of its children)."""
        pts: list[Point] = []
        read_end = self.p.rerun_read_end(s, i, last)
        if read_end > i:
            pts.append((STEP, read_end, r))
        pts.extend((BWD, k, 0) for k in self.ctx.savers[s]
                   if first <= k < last and not (parent and k in self.owner))
        return pts

    def _child_holds(self, s: int) -> list[Point]:
        """A child input made by the parent's rerun: held by the rerun's fresh checkpoint
        call until the rerun ends, and by a live child frame until the child's rerun ends
        and its nodes saving it have run backward (then the child frame has died)."""
        pts: list[Point] = [(STEP, self.rules.rerun_stop - 1, 0)]
        for ci in self.child_args[s]:
            if ci in self.rerun_of:
                ca, stop = self.children[ci][0], self.c_rules[ci].rerun_stop
                pts.append((STEP, stop - 1, self.rerun_of[ci]))
                pts.extend((BWD, k, 0) for k in self.ctx.savers[s] if ca <= k < stop)
        return pts

    def _run(self, r: int, first: int, rules: FrameRules, frame_keep: frozenset[int],
             parent: bool) -> None:
        """Rerun `r` of the frame entered at `first` with `rules` (of the parent or a child):
        steps, instances."""
        p, ctx = self.p, self.ctx
        steps, run = rules.rerun_steps(first), rules.run_steps(first)
        last = steps.stop
        cached = frame_keep & frozenset(steps)
        consts: list[int] = []
        overhead_ms = p.checkpoint_overhead_ms(first, last, frame_keep)
        time_ms = overhead_ms
        for i in steps:
            if i not in run:  # F3: stops in its pack, nothing made
                consts.append(0)
                continue
            ci = self.owner.get(i) if parent else None
            consts.append(0 if i in cached else ctx.alloc[i] + p.fwd_temp_bytes[i])
            time_ms += 0.0 if i in cached else p.fwd_time_ms[i]
            for s in p.outputs[i]:
                pts = self._rerun_ends(s, i, r, first, last, parent)
                if parent and s in self.child_args:
                    pts += self._child_holds(s)
                if ci is not None and i in self.children[ci][2]:  # the fresh child's SAC cache
                    pts.append((STEP, last - 1, r))
                if i in cached:
                    self._hold(s, [(STEP, i, r), *pts])
                else:
                    self.made.append((s, r, i, pts))
        self.reruns.append(Rerun(first, rules, cached, tuple(consts), overhead_ms, time_ms))

    def result(self) -> NestedRegionInfo:
        self._hold_originals()
        if self.rules.reruns:  # the parent's: every node up to its stop, child nodes fresh
            self._run(0, self.a, self.rules, self.keep, True)
        for ci in self.saving:  # a saving child's own: like a flat region, from its inputs
            ca, _, ckeep = self.children[ci]
            self._run(self.rerun_of[ci], ca, self.c_rules[ci], ckeep, False)
        key = _order(self.reruns)
        rows = [(s, r, i, *max(pts, key=key)) for s, r, i, pts in self.made if pts]
        cols = np.asarray(rows, dtype=np.int64).reshape(-1, 6).T
        return NestedRegionInfo(
            self.a, self.b, self.keep, self.children, self.inputs, self.rules,
            tuple(self.reruns), tuple(cols),
            {s: max(pts, key=key) for s, pts in self.held.items()},
            float(sum(rr.time_ms for rr in self.reruns)))


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
    one `WindowParts` (see `solvers.dp`).
    """

    local: np.ndarray  # int64 per slot
    g_index: np.ndarray  # int64 per slot, relative to the window start
    residue_bytes: int
    held_out: frozenset[int]
    time_ms: float

    def peak(self, ctx: Context, a0: int, table: np.ndarray | None = None) -> int:
        """Local peak of the window placed at `a0` (what `profile` reports).

        `table` replaces `ctx.g_table` (same layout), e.g. with bytes of storages left out
        of the window (`skip`) added by position.
        """
        if not len(self.local):
            return 0
        g = ctx.g_table if table is None else table
        return max(0, int((self.local + g[self.g_index + a0]).max()))


def profile_parts(ctx: Context, a0: int, b0: int,
                  regions: Sequence[RegionInfo | NestedRegionInfo],
                  external: frozenset[int] = frozenset(),
                  skip: frozenset[int] = frozenset()) -> WindowParts:
    """`profile`'s computation, returned as position-independent parts (`WindowParts`).

    Storages in `skip` are left out (their original instance; copies a rerun regenerates
    still count): the caller accounts for them by position (`WindowParts.peak`'s table).
    Slots are `simulate`'s events in order: the forward of the window's nodes, then per
    backward node j (descending) the steps of the reruns it triggers (a parent's before its
    child's) and j's own event.
    """
    p = ctx.p
    n_fw = b0 - a0
    plans = [r if isinstance(r, NestedRegionInfo) else r.general(ctx) for r in regions]
    slots = _Slots.lay_out(ctx, a0, b0, plans)
    const, off, bwd_slot, in_region = slots.const, slots.off, slots.bwd_slot, slots.in_region
    starts: list[int] = []
    ends: list[int] = []
    sizes: list[int] = []
    loss = ctx.loss | skip
    local = [s for i in range(a0, b0) for s in p.outputs[i] if s not in loss]
    local += [s for s in sorted({s for i in range(a0, b0) for s in p.uses[i]
                                 if p.storage_producer[s] < a0})
              if s not in external and s not in loss]
    held_by: dict[int, list[tuple[int, Point]]] = {}
    for pi, r in enumerate(plans):
        for s, pt in r.held.items():
            held_by.setdefault(s, []).append((pi, pt))
    residue = 0
    held_out: set[int] = set()
    last_read, savers_of, producer = ctx.last_read, ctx.savers, p.storage_producer
    for s in local:
        prod = producer[s]
        start = prod - a0 + 1 if prod >= a0 else 0
        end = -1
        lr = last_read[s]
        if lr >= b0:
            end = n_fw - 1
        elif lr > prod:
            end = lr - a0
        for k in savers_of[s]:
            if a0 <= k < b0 and not in_region[k - a0]:
                end = max(end, bwd_slot[k - a0])
        for pi, (kind, node, ri) in held_by.get(s, ()):
            end = max(end, bwd_slot[node - a0] if kind == BWD else
                      node - a0 if kind == FWD else off[pi][ri] + node)
        nbytes = p.storage_bytes[s]
        if end >= start and nbytes:
            starts.append(start)
            ends.append(end + 1)
            sizes.append(nbytes)
        if end >= n_fw:  # held through the end of the forward
            residue += nbytes
            if lr >= b0:
                held_out.add(s)
    diff = np.zeros(len(const) + 1, dtype=np.int64)
    if sizes:
        sz = np.asarray(sizes, dtype=np.int64)
        np.add.at(diff, np.asarray(starts, dtype=np.int64), sz)
        np.add.at(diff, np.asarray(ends, dtype=np.int64), -sz)
    _add_regenerated(diff, plans, slots, a0, np.asarray(p.storage_bytes, dtype=np.int64))
    live = np.cumsum(diff[:-1])
    return WindowParts(np.asarray(const, dtype=np.int64) + live,
                       np.asarray(slots.gidx, dtype=np.int64), residue, frozenset(held_out),
                       slots.time_ms)


@dataclass
class _Slots:
    """The events of a window in `simulate`'s order, with what each adds by itself.

    `const`: bytes allocated or temporary at each slot; `gidx`: its `Context.g_table` entry
    relative to the window start; `bwd_slot[k]`: slot of node a0 + k's backward;
    `off[pi][r] + x`: slot of node x's step in rerun r of plan pi; `time_ms`: the reruns'
    time, added step by step in event order as `simulate` does (equal to the bit).
    """

    const: list[int]
    gidx: list[int]
    bwd_slot: list[int]
    off: list[list[int]]
    in_region: list[bool]
    time_ms: float

    @classmethod
    def lay_out(cls, ctx: Context, a0: int, b0: int,
                plans: Sequence[NestedRegionInfo]) -> _Slots:
        p, n, n_fw = ctx.p, ctx.n, b0 - a0
        in_region = [False] * n_fw
        at_trigger: dict[int, list[tuple[int, int]]] = {}
        for pi, r in enumerate(plans):
            for i in range(r.a, r.b):
                in_region[i - a0] = True
            for ri, rr in enumerate(r.reruns):
                at_trigger.setdefault(rr.trigger, []).append((pi, ri))
        const: list[int] = [ctx.alloc[i] + p.fwd_event_bytes[i] for i in range(a0, b0)]
        gidx: list[int] = [table_index(n, FORWARD, k) for k in range(n_fw)]
        bwd_slot = [0] * n_fw
        off: list[list[int]] = [[0] * len(r.reruns) for r in plans]
        fwd = p.fwd_time_ms
        time_ms = 0.0
        for j in range(b0 - 1, a0 - 1, -1):
            for pi, ri in at_trigger.get(j, ()):
                rr = plans[pi].reruns[ri]
                off[pi][ri] = len(const) - rr.start
                const.extend(rr.step_const)
                gidx.extend([table_index(n, RERUN, j - a0)] * len(rr.step_const))
                idle = rr.idle
                for i in range(rr.start, rr.stop):
                    step_ms = 0.0 if i in idle else fwd[i]
                    time_ms += step_ms + rr.overhead_ms if i == rr.start else step_ms
            bwd_slot[j - a0] = len(const)
            const.append(p.bwd_temp_bytes[j])
            gidx.append(table_index(n, BACKWARD, j - a0))
        return cls(const, gidx, bwd_slot, off, in_region, time_ms)


def _add_regenerated(diff: np.ndarray, plans: Sequence[NestedRegionInfo], slots: _Slots,
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


def profile(ctx: Context, a0: int, b0: int, regions: Sequence[RegionInfo | NestedRegionInfo],
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
