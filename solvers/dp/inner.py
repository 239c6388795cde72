"""Options of one stage made of pieces of it: disjoint regions strictly inside a layer.

A layer checkpointed whole reruns every op it does not keep, and torch's rerun has no dead
code elimination: to free an attention's dropout output it also reruns the scores, their
mask and softmax, unless it keeps them all (2 GiB of a GPT-2-medium layer). A region that
starts at the softmax output (an op range of the attention's traced forward: the dropout and
the matmul that reads it, the matmul's output kept) frees the same bytes for the dropout's
time alone. So a stage may also recompute a set of disjoint regions inside it, module calls
or op ranges at any depth, each keeping nothing or its matmul-like nodes.

Which sets are offered: each candidate region alone is profiled over the stage
(`profile_parts`), giving the bytes it frees past the forward and its rerun time; an interval
DP over the stage's nodes combines disjoint candidates, adding those two terms, and keeps the
Pareto front of (bytes freed, rerun time), thinned to `INNER_POINTS` sets (a stage with no
more sets than that offers every one, `every_set`). Each set is then
an ordinary option of the stage, which the DP profiles exactly like any other: the sum only
chooses which sets are offered, it never enters a reported number or a bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from solvers.accounting import Context, RegionInfo, profile_parts
from solvers.frame import worth_checkpointing
from solvers.front import pareto

__all__ = ["INNER_POINTS", "Piece", "every_set", "inner_front", "inner_options"]

INNER_POINTS = 24  # sets offered per stage (the front of bytes freed against rerun time)
_FRONT = 64  # points kept per position of the interval DP

Piece = tuple[int, float, tuple[RegionInfo, ...]]  # bytes freed, rerun ms, regions


def _candidates(ctx: Context, a: int, b: int) -> list[RegionInfo]:
    """Every region strictly inside stage `[a, b)` that may be a checkpoint, keeping
    nothing and, where it has any, its matmul-like nodes."""
    p = ctx.p
    out = []
    for span in p.module_spans or ():
        x, y = span.start, span.stop
        if not (a <= x and y <= b and (x, y) != (a, b)) or not p.emittable(x, y):
            continue
        if not worth_checkpointing(p, x, y):
            continue
        matmuls = p.matmul_keep(x, y)
        out += [ctx.region(x, y, keep) for keep in {frozenset(), matmuls}]
    return out


def _front(points: Sequence[Piece], size: int) -> list[Piece]:
    """The Pareto front of `points` (more bytes freed, less time), thinned to `size`
    points spread over its length (both ends kept)."""
    front = pareto(points, cost=lambda pt: pt[1], loss=lambda pt: -pt[0])
    if len(front) <= size:
        return front
    step = (len(front) - 1) / (size - 1)
    return [front[round(k * step)] for k in range(size)]


def inner_options(ctx: Context, a: int, b: int,
                  outside: frozenset[int] = frozenset()) -> list[tuple[RegionInfo, ...]]:
    """Sets of disjoint regions inside stage `[a, b)` (module doc), each sorted, none empty;
    `outside`: storages the caller accounts for by position (left out of the profiles).
    A stage with at most `INNER_POINTS` such sets offers all of them (`every_set`)."""
    every = every_set(ctx, a, b)
    if every is not None:
        return every
    return [regions for _, _, regions in inner_front(ctx, a, b, outside)]


def every_set(ctx: Context, a: int, b: int) -> list[tuple[RegionInfo, ...]] | None:
    """Every non-empty set of disjoint candidate regions inside stage `[a, b)`, or None
    where there are more than `INNER_POINTS` (then a front of them is offered): a small
    stage's options then hold every flat choice of regions inside it, CP-SAT's included."""
    by_stop: dict[int, list[RegionInfo]] = {}
    for info in _candidates(ctx, a, b):
        by_stop.setdefault(info.b, []).append(info)
    sets: list[list[tuple[RegionInfo, ...]]] = [[()]]  # per position: the sets ending by it
    for pos in range(a + 1, b + 1):
        here = list(sets[-1])
        for info in by_stop.get(pos, ()):
            here += [(*regions, info) for regions in sets[info.a - a]]
        if len(here) > INNER_POINTS + 1:
            return None
        sets.append(here)
    return [regions for regions in sets[-1] if regions]


def inner_front(ctx: Context, a: int, b: int, outside: frozenset[int] = frozenset(),
                keeps: bool = True) -> list[Piece]:
    """`inner_options` with the bytes each set frees past the forward and its rerun time
    (both summed over its regions), fewest bytes first; `keeps=False`: regions keep
    nothing."""
    base = profile_parts(ctx, a, b, (), frozenset(), outside).residue_bytes
    by_stop: dict[int, list[Piece]] = {}
    for info in _candidates(ctx, a, b):
        if info.keep and not keeps:
            continue
        freed = base - profile_parts(ctx, a, b, (info,), frozenset(), outside).residue_bytes
        if freed > 0:
            by_stop.setdefault(info.b, []).append((freed, info.time_ms, (info,)))
    if not by_stop:
        return []
    fronts: list[list[Piece]] = [[(0, 0.0, ())]]
    for pos in range(a + 1, b + 1):
        points = list(fronts[-1])
        for freed, ms, (info,) in by_stop.get(pos, ()):
            points += [(f + freed, t + ms, (*regions, info))
                       for f, t, regions in fronts[info.a - a]]
        fronts.append(_front(points, _FRONT))
    return [piece for piece in _front(fronts[-1], INNER_POINTS) if piece[2]]
