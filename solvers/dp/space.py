"""Which schedules the DP's space holds: `holds_regions`, the one rule, used by the DP
(its segments stop where `stop_limits` says), by `spaces` (whether a solver's schedule lies
in the DP's space, so that the DP's bound holds for it) and by `auto` (whether the DP's space
holds all of CP-SAT's)."""

from __future__ import annotations

from solvers.accounting import Context
from solvers.dp.chain import long_skips, pinned_storages, stage_index
from solvers.dp.inner import every_set
from solvers.problem import Problem

__all__ = ["holds_regions", "stop_limits"]


def stop_limits(problem: Problem, st: list[tuple[int, int]], skips: dict[int, list[int]]
                ) -> list[int]:
    """Per stage t: segments starting there stop at stage u <= this (exclusive), so that none
    holds a long skip's producer and a far reader (two stages on: single stages never do)."""
    m = len(st)
    stage_of = stage_index(problem, st)
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




def holds_regions(problem: Problem, regions: list[tuple[int, int, frozenset[int]]]) -> bool:
    """Whether every set of these non-overlapping regions, each keeping as given, is a
    schedule of the DP's space: each starts and stops at stages of the DP's chain (the
    calls' one, over which it proves the answers it finds) and keeps nothing or its
    matmul-like nodes (a segment of those stages recomputed), or lies inside a stage that
    offers every set of its inner regions (`inner.every_set`); no segment holds a long
    skip's producer and one of its far readers (`stop_limits`)."""
    ctx = Context(problem)
    skips, stages = long_skips(problem, pinned_storages(problem))  # `_layout`'s stages
    stage_at = {a: t for t, (a, _) in enumerate(stages)} | {problem.n_nodes: len(stages)}
    stop_limit = stop_limits(problem, stages, skips)
    inner_sets: dict[tuple[int, int], set | None] = {}

    def inside(a: int, b: int, keep: frozenset[int]) -> bool:
        x, y = next(((x, y) for x, y in stages if x <= a and b <= y), (a, a))
        if (x, y) not in inner_sets:
            every = every_set(ctx, x, y) if problem.module_spans is not None else None
            inner_sets[x, y] = None if every is None else {
                (r.a, r.b, frozenset(r.keep)) for regions in every for r in regions}
        return inner_sets[x, y] is not None and (a, b, keep) in inner_sets[x, y]

    def segment(a: int, b: int, keep: frozenset[int]) -> bool:
        return (a in stage_at and b in stage_at and stage_at[b] <= stop_limit[stage_at[a]]
                and (not keep or keep == problem.matmul_keep(a, b)))

    return all(segment(a, b, keep) or inside(a, b, keep) for a, b, keep in regions)
