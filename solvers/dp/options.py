"""What one window of the DP's chain may do: its options (STORE, one RECOMPUTE region per
recomputable run keeping nothing, its matmuls or, on tiny problems, any subset; with module
spans the window's call and the calls inside it; two-level nested options), each option's
reruns and regions relative to the window start, and the translation-invariant signature
under which identical windows share their profiles (`solvers.dp.search`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from solvers.accounting import Context, RegionInfo
from solvers.dp.chain import checkpoint_runs, is_empty
from solvers.frame import dead_steps, worth_checkpointing
from solvers.problem import Problem
from solvers.schedule import RECOMPUTE, Region

__all__ = ["RerunRel", "Spec", "flat_options", "flat_rerun_rel", "keep_sets", "nested_options",
           "regions_at", "reruns_rel", "span_options", "top_regions", "window_signature",
           "window_spec"]


def flat_options(ctx: Context, a: int, b: int, single: bool,
             subsets: bool) -> list[tuple[RegionInfo, ...]]:
    p = ctx.p
    opts: list[tuple[RegionInfo, ...]] = [()] if single else []
    runs = checkpoint_runs(p, a, b)
    if not runs:
        return opts
    opts.append(tuple(ctx.region(x, y) for x, y in runs))
    mm = tuple(ctx.region(x, y, p.matmul_keep(x, y)) for x, y in runs)
    if mm != opts[-1]:
        opts.append(mm)
    if subsets and len(runs) == 1:
        x, y = runs[0]
        keepable = [i for i in range(x, y) if p.can_keep(i)]
        for r in range(1, len(keepable) + 1):
            for keep in itertools.combinations(keepable, r):
                opts.append((ctx.region(x, y, keep),))
    return opts


def keep_sets(ctx: Context, a: int, b: int, subsets: bool) -> list[frozenset[int]]:
    """Kept sets tried for a region: none, its keepable matmul-like nodes, or (tiny
    problems) every subset of its keepable nodes."""
    p = ctx.p
    keepable = [i for i in range(a, b) if p.can_keep(i)]
    if subsets:
        return [frozenset(c) for r in range(len(keepable) + 1)
                for c in itertools.combinations(keepable, r)]
    mm = p.matmul_keep(a, b)
    return [frozenset(), mm] if mm else [frozenset()]


def top_regions(p: Problem, a: int, b: int, single: bool) -> list[tuple[int, int]]:
    """The single top-level regions window `[a, b)` may recompute: with module spans the
    window itself when it is one, else (one stage) each of its largest inner spans; without,
    its recomputable run when it has one."""
    if p.module_spans is None:
        runs = checkpoint_runs(p, a, b)
        return runs if len(runs) == 1 else []
    if p.emittable(a, b) and worth_checkpointing(p, a, b):
        return [(a, b)]
    return [(sp.start, sp.stop) for sp in p.spans_within(a, b)
            if worth_checkpointing(p, sp.start, sp.stop)] if single else []


def span_options(ctx: Context, a: int, b: int, single: bool,
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
    tops = top_regions(p, a, b, single)
    for x, y in tops:
        flat += [(ctx.region(x, y, keep),) for keep in keep_sets(ctx, x, y, subsets)]
        kids = [(sp.start, sp.stop) for sp in p.spans_within(x, y)
                if worth_checkpointing(p, sp.start, sp.stop)]
        for keep_matmuls in (False, True):
            spec = [(cx, cy, p.matmul_keep(cx, cy) if keep_matmuls else frozenset())
                    for cx, cy in kids]
            if kids and (not keep_matmuls or any(k for _, _, k in spec)):
                nested.append((ctx.region(x, y, (), children=spec),))
    groups = ([inner] + [[piece] for piece in inner]) if single and whole else (
        [inner] if single and len(inner) > 1 else [])
    for group in groups:
        for keep_matmuls in (False, True):
            regions = tuple(ctx.region(x, y, p.matmul_keep(x, y) if keep_matmuls else ())
                            for x, y in group)
            if keep_matmuls and all(not r.keep for r in regions):
                continue
            flat.append(regions)
    return flat, nested


def nested_options(ctx: Context, stages: list[tuple[int, int]]) -> list[tuple]:
    """Two-level options of a multi-stage window (Rotor's persistent checkpoints).

    One parent region over the window's recomputable run, one child per stage that packs:
    the parent's rerun (at the window's last backward) holds only the children's inputs,
    then each child reruns when the backward reaches it. Children keep nothing or their
    keepable matmul-like nodes; the parent keeps nothing (its SAC policy would also see the
    children's ops). Returns nothing unless the window is one run over >= 2 such stages.
    """
    p = ctx.p
    a, b = stages[0][0], stages[-1][1]
    runs = checkpoint_runs(p, a, b)
    if len(runs) != 1:
        return []
    x, y = runs[0]
    pieces = []
    for sa, sb in stages:
        cx, cy = max(x, sa), min(y, sb)
        while cx < cy and is_empty(p, cx):
            cx += 1
        if cx < cy and any(p.packs[cx:cy]):
            pieces.append((cx, cy))
    if len(pieces) < 2:
        return []
    out: list[tuple] = []
    for keep_matmuls in (False, True):
        kids = tuple((cx, cy, p.matmul_keep(cx, cy) if keep_matmuls else frozenset())
                     for cx, cy in pieces)
        if keep_matmuls and not any(k for _, _, k in kids):
            continue
        out.append((ctx.region(x, y, (), children=kids),))
    return out


class RerunRel(NamedTuple):
    """One rerun of a window option, relative to the window start: its `start` and early
    `stop`, the `idle` steps that do no work, the `kept` nodes the SAC cache serves
    (`Rerun.idle`, `Rerun.cached`) and its region's `end`; `dp._rerun_ms` prices it
    wherever the window lies."""

    start: int
    stop: int
    idle: np.ndarray
    kept: np.ndarray
    end: int


def _rel(nodes: Iterable[int], a: int) -> np.ndarray:
    return np.asarray(sorted(k - a for k in nodes), dtype=np.int64)


def reruns_rel(regions: tuple, a: int) -> list[RerunRel]:
    """Each rerun of a window option, relative to the window start `a`."""
    return [RerunRel(q.start - a, q.stop - a, _rel(q.idle, a), _rel(q.cached, a), q.end - a)
            for r in regions for q in r.reruns]


def flat_rerun_rel(p: Problem, r: RegionInfo, keep: frozenset[int], a: int) -> RerunRel:
    """`reruns_rel`'s entry for region `r` without children (which reruns) had it kept
    `keep` (its frame's rules do not depend on what it keeps; the steps it skips do, F9)."""
    kept = keep & frozenset(r.steps())
    idle = r.rules.idle_steps(kept) | dead_steps(p, r.rules, r.a, kept)
    return RerunRel(r.a - a, r.stop - a, _rel(idle, a), _rel(kept, a), r.b - a)


Spec = tuple[tuple[int, int, tuple[int, ...], tuple], ...]  # regions relative to a window


def window_spec(regions: tuple, a: int) -> Spec:
    """An option's regions relative to its window start `a` (`regions_at` rebuilds them)."""
    return tuple((r.a - a, r.b - a, tuple(sorted(k - a for k in r.keep)),
                  tuple((ca - a, cb - a, tuple(sorted(k - a for k in ck)))
                        for ca, cb, ck in getattr(r, "children", ())))
                 for r in regions)


def regions_at(spec: Spec, a: int) -> list[Region]:
    """The RECOMPUTE regions of an option's `spec`, placed at window start `a`."""
    return [Region(a + x, a + y, RECOMPUTE, keep=[a + k for k in keep],
                   children=[Region(a + cx, a + cy, RECOMPUTE, keep=[a + k for k in ck])
                             for cx, cy, ck in kids])
            for x, y, keep, kids in spec]


def window_signature(ctx: Context, a: int, b: int,
                     spans_at: dict[int, list[tuple[int, tuple[int, ...]]]],
                     outside: frozenset[int] = frozenset()) -> tuple:
    """Translation-invariant description of nodes [a, b) for caching window profiles.

    Gradient and loss bytes and forward times are left out: `WindowParts` adds the first by
    position and `_run` the recompute time, so identical blocks share one signature although
    parameter gradients pile up along the chain and measured times differ from block to block.
    Module spans starting in the window (`spans_at`: node -> (stop, inputs)) are part of it.
    A storage in `outside` made before the window (a rotary table or mask every layer reads)
    is named by its order of first use and its size: the window's profile leaves it out
    (`profile_parts`' `skip`), so where it was made and who else reads it cannot matter.
    """
    p = ctx.p
    shared: dict[int, int] = {}

    def rel(s: int) -> tuple:
        prod = p.storage_producer[s]
        if s in outside and prod < a:
            return ("outside", shared.setdefault(s, len(shared)), p.storage_bytes[s])
        lr = ctx.last_read[s]
        return (prod - a, p.outputs[prod].index(s), p.storage_bytes[s],
                p.storage_grad_bytes[s], lr - a if lr >= 0 else None, s in ctx.loss,
                tuple(k - a for k in ctx.savers[s]))

    releases = ctx.releasing
    return tuple((p.fwd_event_bytes[i], p.bwd_temp_bytes[i], releases[i],
                  p.recomputable[i], p.packs[i], p.stops_before_running[i], p.is_matmul(i),
                  p.can_keep(i), p.skippable(i),
                  tuple(rel(s) for s in p.uses[i]), tuple(rel(s) for s in p.outputs[i]),
                  tuple(rel(s) for s in p.saved[i]),
                  tuple((stop - a, tuple(rel(s) for s in inputs))
                        for stop, inputs in spans_at.get(i, ()))) for i in range(a, b))
