"""What `simulate` does for one top-level RECOMPUTE region, independent of the rest of the
schedule: its frame (`solvers.frame`), the steps of each rerun, the instances they
regenerate and who holds each original or regenerated instance until when, in node
indices only, so `solvers.accounting` places it in any window holding the region.

One analysis, `RegionInfo`, for a region with at most one level of children (a flat region
is one without children): a parent P with RECOMPUTE children C (no grandchildren) makes up
to 1 + len(children) reruns: P's (F2-F4, its children's inputs packed into it), in which
children run as fresh checkpoints (their saves are not kept, their kept outputs and inputs
live until P's rerun ends), then each child's that packs, from the inputs P's rerun
regenerated (F5), which live until then and the backward of the child nodes saving them.
`_NestedAnalysis` derives it in general; a region without children, which the solvers
build by the thousand, takes a closed form (`_flat_analysis`) that the tests hold equal to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from solvers.clock import rerun_ms, rerun_overhead_ms
from solvers.frame import (
    ChildFrame,
    FrameRules,
    dead_steps,
    frame_end,
    frame_rules,
    own_packs,
)

if TYPE_CHECKING:
    from solvers.accounting import Context

__all__ = ["BWD", "FWD", "STEP", "ChildSpec", "Point", "Regen", "RegionInfo", "Rerun",
           "rerun_savers"]

ChildSpec = tuple[int, int, frozenset[int]]  # (start, stop, keep) of a child region


class _Frame:
    """A region analysis's frame, read from its `rules` (`solvers.frame`): whether it
    reruns (`packs`), where its rerun stops, which backward triggers it, when it dies."""

    rules: FrameRules

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


# End points of an instance's holders: (kind, node, rerun index in the region). Inside one
# region they are totally ordered whatever window holds it (`_order`), so each instance keeps
# only its latest; `profile_parts` turns that into a slot, after which the instance is freed.
FWD = 0  # the forward event of `node` (a frame that dies in forward: end of its region)
BWD = 1  # the backward event of `node`
STEP = 2  # the step of `node` in rerun `rerun` (its last step: held until the rerun ends)
Point = tuple[int, int, int]


@dataclass(frozen=True)
class Rerun(_Frame):
    """One rerun pass of a frame with `rules`, entered at `start`: the steps
    `rules.rerun_steps(start)`, at the backward of `rules.trigger`.

    Nodes in `cached` come from the SAC cache (no time, no new memory); `skipped` are made
    uninitialized (F9: no time, the same memory); `idle` are the steps that take no time
    (those, and F3's unrun last); `step_const` is each step's allocation + forward
    temporaries (0 when cached or unrun: a skipped step allocates what it would make).
    `time_ms` is the forward time of the nodes run plus `overhead_ms`, the frame's
    `clock.rerun_overhead_ms`, which `simulate` charges to the first step.
    """

    start: int
    rules: FrameRules
    cached: frozenset[int]
    step_const: tuple[int, ...]
    overhead_ms: float
    time_ms: float
    end: int  # the frame's region's end (its `overhead_ms` depends on it: op ranges)
    skipped: frozenset[int] = frozenset()

    @property
    def idle(self) -> frozenset[int]:
        """The steps that cost no time: kept nodes, skipped ones (F9), and the last one when
        it is not run."""
        return self.rules.idle_steps(self.cached) | self.skipped


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
class RegionInfo(_Frame):
    """What `simulate` does for one top-level RECOMPUTE region, with at most one level of
    children (module doc).

    Everything is in absolute node indices but says only "event of node x" or "step of node
    x in rerun r", so `profile_parts` places it in any window holding the region (the DP's
    translation-invariant cache stays valid). `rules` are the parent's frame's; `packs`,
    `stop`, `trigger`, `death` and `last_not_run` repeat them (`stop` may equal `a`: a
    rerun that only unpacks the inputs of a first child); `reruns` lists the parent's rerun
    first (when it happens), then each saving child's; `regen_cols` the instances they make
    that outlive their step (`regen`'s fields as int64 columns, placed by `profile_parts` in
    one numpy pass); `held` the latest extra holder of original instances (frame inputs, SAC
    caches, child inputs); `time_ms` the recompute time of all reruns, overheads included.
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
    def regen(self) -> tuple[Regen, ...]:
        """The regenerated instances that outlive their step, as objects."""
        storage, rerun, step, kind, node, end_rerun = (c.tolist() for c in self.regen_cols)
        return tuple(Regen(*row[:3], row[3:]) for row in zip(
            storage, rerun, step, zip(kind, node, end_rerun, strict=True), strict=True))

    def steps(self) -> range:
        """Node indices the parent's rerun runs (kept ones included, at no cost)."""
        return self.rules.rerun_steps(self.a)

    @classmethod
    def build(cls, ctx: Context, a: int, b: int, keep: frozenset[int],
              children: tuple[ChildSpec, ...] = ()) -> RegionInfo:
        """Analyse `[a, b)` keeping `keep`, with children `(start, stop, keep)` (no deeper).

        Follows `simulate._Replay`: `_build_frame` for stops and deaths, `_pass` with a root
        frame for the reruns, `_enter_children` for the child inputs the parent's rerun saves.
        """
        _check_children(a, b, keep, children)
        if not children:
            return _flat_analysis(ctx, a, b, keep)
        return _NestedAnalysis(ctx, a, b, keep, children).result()


def rerun_savers(ctx: Context, storage: int, stop: int) -> tuple[int, ...]:
    """The nodes of a rerun stopping at `stop` that save `storage` into their frame
    (ascending: the first runs backward last), which hold what the rerun makes of it."""
    p = ctx.p
    return tuple(k for k in ctx.savers[storage] if k < stop and p.packs[k])


class _FlatFrame(NamedTuple):
    """What a region `[a, b)` without children does whatever it keeps (`_flat_analysis`'s
    part that a keep set does not change, once per region and `Context`): its frame's rules
    and inputs, where the frame dies, and per step of its rerun the bytes it makes when it
    runs and, per output, its last step read in the rerun and its first saver there."""

    rules: FrameRules
    inputs: tuple[int, ...]
    end_of_frame: Point
    steps: tuple[tuple[int, int, tuple[tuple[int, int, int | None], ...]], ...]


def _flat_frame(ctx: Context, a: int, b: int) -> _FlatFrame:
    found = ctx.flat_frames.get((a, b))
    if found is not None:
        return found
    p = ctx.p
    rules = frame_rules(p, own_packs(p, a, b))
    steps = []
    if rules.reruns:
        run, stop = rules.run_steps(a), rules.rerun_stop
        for i in rules.rerun_steps(a):
            runs = i in run
            steps.append((i, ctx.alloc[i] + p.fwd_temp_bytes[i] if runs else 0, tuple(
                (s, p.rerun_read_end(s, i, stop), next(iter(rerun_savers(ctx, s, stop)), None))
                for s in (p.outputs[i] if runs else ()))))
    found = ctx.flat_frames[(a, b)] = _FlatFrame(rules, p.region_inputs(a, b),
                                                 _frame_end_point(rules, b), tuple(steps))
    return found


def _flat_analysis(ctx: Context, a: int, b: int, keep: frozenset[int]) -> RegionInfo:
    """`_NestedAnalysis` of a region without children, in closed form: one rerun at most;
    an instance it makes is held by its first saver's backward (savers run backward in
    descending order) or else its last reader in the rerun; a kept output the rerun takes
    likewise, from its own step on; the inputs, and kept outputs it never takes (F6), until
    the frame dies."""
    p = ctx.p
    rules, inputs, end_of_frame, steps = _flat_frame(ctx, a, b)
    held: dict[int, Point] = dict.fromkeys(inputs, end_of_frame)
    rows: list[tuple[int, int, int, int, int, int]] = []
    reruns: tuple[Rerun, ...] = ()
    if rules.reruns:
        consts = []
        for i, made, outputs in steps:
            cached = i in keep
            consts.append(0 if cached else made)
            for s, read_end, saver in outputs:
                if not cached:
                    if saver is not None:
                        rows.append((s, 0, i, BWD, saver, 0))
                    elif read_end > i:  # else it dies at its own step
                        rows.append((s, 0, i, STEP, read_end, 0))
                elif s not in ctx.loss:
                    held[s] = (BWD, saver, 0) if saver is not None else (STEP, max(i, read_end), 0)
        stop = rules.rerun_stop
        overhead_ms = rerun_overhead_ms(p, a, stop, keep, b)
        cached_steps = keep & frozenset(i for i, *_ in steps)
        skipped = dead_steps(p, rules, a, cached_steps)
        time_ms = rerun_ms(p, a, stop, rules.idle_steps(cached_steps) | skipped, overhead_ms)
        reruns = (Rerun(a, rules, cached_steps, tuple(consts), overhead_ms, time_ms, b,
                        skipped),)
    for k in keep:  # F6: kept nodes the rerun does not run stay cached until the frame dies
        if not rules.takes_cached(a, k):
            held.update((s, end_of_frame) for s in p.outputs[k] if s not in ctx.loss)
    cols = np.asarray(rows, dtype=np.int64).reshape(-1, 6).T
    return RegionInfo(a, b, keep, (), inputs, rules, reruns, tuple(cols), held,
                      float(sum(r.time_ms for r in reruns)))


def _frame_end_point(rules: FrameRules, stop: int) -> Point:
    """`solvers.frame.frame_end` as a point of a window's events."""
    end = frame_end(rules, stop)
    return (BWD if end.backward else FWD, end.node, 0)



class _NestedAnalysis:
    """`RegionInfo.build`'s work (with children): the frames, then each rerun's steps and instances,
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

    def _run(self, r: int, first: int, end: int, rules: FrameRules,
             frame_keep: frozenset[int], parent: bool) -> None:
        """Rerun `r` of the frame entered at `first` with `rules` (of the parent or a child):
        steps, instances."""
        p, ctx = self.p, self.ctx
        steps, run = rules.rerun_steps(first), rules.run_steps(first)
        last = steps.stop
        cached = frame_keep & frozenset(steps)
        consts: list[int] = []
        overhead_ms = rerun_overhead_ms(p, first, last, frame_keep, end)
        skipped = dead_steps(p, rules, first, cached) if parent and not self.children \
            else frozenset()
        time_ms = rerun_ms(p, first, last, rules.idle_steps(cached) | skipped, overhead_ms)
        for i in steps:
            if i not in run:  # F3: stops in its pack, nothing made
                consts.append(0)
                continue
            ci = self.owner.get(i) if parent else None
            consts.append(0 if i in cached else ctx.alloc[i] + p.fwd_temp_bytes[i])
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
        self.reruns.append(Rerun(first, rules, cached, tuple(consts), overhead_ms, time_ms,
                                 end, skipped))

    def result(self) -> RegionInfo:
        self._hold_originals()
        if self.rules.reruns:  # the parent's: every node up to its stop, child nodes fresh
            self._run(0, self.a, self.b, self.rules, self.keep, True)
        for ci in self.saving:  # a saving child's own: like a flat region, from its inputs
            ca, cb, ckeep = self.children[ci]
            self._run(self.rerun_of[ci], ca, cb, self.c_rules[ci], ckeep, False)
        key = _order(self.reruns)
        rows = [(s, r, i, *max(pts, key=key)) for s, r, i, pts in self.made if pts]
        cols = np.asarray(rows, dtype=np.int64).reshape(-1, 6).T
        return RegionInfo(
            self.a, self.b, self.keep, self.children, self.inputs, self.rules,
            tuple(self.reruns), tuple(cols),
            {s: max(pts, key=key) for s, pts in self.held.items()},
            float(sum(rr.time_ms for rr in self.reruns)))
