"""The DP's stages: the problem's blocks and the single nodes between them, merged until
the step is a chain of them (every storage read only in its stage or the next).

A storage whose skip spans a block (an attention mask or rotary table read by every block)
is pinned (`pinned_storages`): left out of the window accounting and counted by position
over the longest life any schedule can give it (conservative; a second pass counting only
its sure life, producer to last reader, gives a valid lower bound and the gap). Short
skips across single nodes (a position id read two nodes later, logits read by the loss
after an `output` node) merge the stages they skip (`chain_stages`: exact over a slightly
coarser space). Without module spans (op-range regions: synthetic DAGs), a storage read
more than `LONG_SKIP_NODES` nodes later is detached instead of merged (`long_skips`): no
segment may then hold its producer and its far readers, so each far reader that saves it
holds it under every schedule; that restriction is part of the space the bound is proven
over (`solvers.spaces.chain_segments` names it). Only when merging would leave fewer than
`FUSED_STAGES` stages: a chain whose short skips merge a few stages keeps its unrestricted
space. Stages of only `is_empty` nodes (parameter placeholders) join the next stage
(`compact_stages`).
"""

from __future__ import annotations

import logging

from solvers.frame import worth_checkpointing
from solvers.problem import Problem

logger = logging.getLogger(__name__)

__all__ = ["FUSED_STAGES", "LONG_SKIP_NODES", "applies", "chain_stages", "checkpoint_runs",
           "compact_stages", "is_empty", "long_skips", "pinned_storages", "stage_index"]

LONG_SKIP_NODES = 8  # without module spans, storages read further on are detached (long_skips)
FUSED_STAGES = 16  # ... when merging would leave fewer stages than this


def stage_index(problem: Problem, st: list[tuple[int, int]]) -> list[int]:
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
    stage_of = stage_index(problem, st)
    loss = set(problem.outputs[-1]) | problem.caller_held
    out = set()
    for s, cons in enumerate(problem.readers):
        if not cons or s in loss:
            continue
        t, u = stage_of[problem.storage_producer[s]], stage_of[cons[-1]]
        if any(st[v][1] - st[v][0] > 1 for v in range(t + 1, u)):
            out.add(s)
    return frozenset(out)


def chain_stages(problem: Problem, pinned: frozenset[int] = frozenset(),
                 calls_first: bool = True) -> tuple[list[tuple[int, int]], bool]:
    """Stages, merged until the problem is a chain of them; True if nothing was merged.

    Storages in `pinned` (see `pinned_storages`) are ignored when looking for skips. Of the
    boundaries a storage spans one may stay: with `calls_first` the one most module calls
    start or stop at, else the first after its producer's stage (two chains, each with
    schedules the other lacks: Inception-v3's stem keeps whole calls in the first, timm's
    ResNet-18d its lowest peak in the second).
    """
    st = problem.stages()
    merged = False
    score = _cut_scores(problem) if calls_first else [0] * (problem.n_nodes + 1)
    while True:
        stage_of = stage_index(problem, st)
        cut = [True] * len(st)  # cut[t]: boundary before stage t kept
        bad = False
        for s, cons in enumerate(problem.readers):
            if not cons or s in pinned:
                continue
            t, u = stage_of[problem.storage_producer[s]], stage_of[cons[-1]]
            if u > t + 1:
                bad = True
                # one boundary between the producer's stage and the last reader's may stay
                # (the first of equal scores): with calls first, stages stay whole calls
                # where a call ends in an in-place op its argument's storage outlives
                kept = max(range(t + 1, u + 1), key=lambda v: (score[st[v][0]], -v))
                for v in range(t + 1, u + 1):
                    if v != kept:
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
        logger.debug("chain: %s is not a chain of its stages; merged %d stages into %d",
                     problem.name, len(st), len(new))
        st = new


def _cut_scores(problem: Problem) -> list[int]:
    """Per node index: how many module spans start or stop there (0 without spans)."""
    score = [0] * (problem.n_nodes + 1)
    for span in problem.module_spans or ():
        score[span.start] += 1
        score[span.stop] += 1
    return score


def applies(problem: Problem) -> bool:
    """True when the problem is a chain of its stages (no merging needed)."""
    return chain_stages(problem)[1]


def is_empty(problem: Problem, i: int) -> bool:
    """Node i touches no activation memory: no storage read, made or saved, no temporaries.

    Such nodes (parameter placeholders, `size()` calls) change no live bytes wherever they
    sit, in a region or not; only their forward time differs (a rerun pays it).
    """
    p = problem
    return not (p.inputs[i] or p.outputs[i] or p.packs[i] or p.fwd_temp_bytes[i]
                or p.bwd_temp_bytes[i])


def compact_stages(problem: Problem, st: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge every stage made only of `is_empty` nodes into the next stage (the last: previous).

    Exact for the DP's space: a cut next to an empty stage changes no memory, and `checkpoint_runs`
    starts each region at its first non-empty node, so no schedule of the finer stages is
    lost or beaten on time.
    """
    out: list[tuple[int, int]] = []
    pending: int | None = None
    for a, b in st:
        if all(is_empty(problem, i) for i in range(a, b)):
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


def checkpoint_runs(problem: Problem, a: int, b: int) -> list[tuple[int, int]]:
    out = []
    for x, y in problem.recomputable_runs(a, b):
        if not worth_checkpointing(problem, x, y):
            continue
        while is_empty(problem, x):  # leading empty nodes: same memory, rerun time saved
            x += 1
        out.append((x, y))
    return out


def long_skips(problem: Problem, pinned: frozenset[int], calls_first: bool = True
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
    merged = compact_stages(problem, chain_stages(problem, pinned, calls_first)[0])
    if problem.module_spans is not None or len(merged) >= FUSED_STAGES:
        return {}, merged
    outside = set(problem.caller_held) | set(pinned)
    long = frozenset(s for s, cons in enumerate(problem.readers) if cons and s not in outside
                     and cons[-1] - problem.storage_producer[s] > LONG_SKIP_NODES)
    st = compact_stages(problem, chain_stages(problem, pinned | long, calls_first)[0])
    stage_of = stage_index(problem, st)
    skips = {}
    for s in long:
        t = stage_of[problem.storage_producer[s]]
        far = [r for r in problem.readers[s] if stage_of[r] >= t + 2]
        if far:  # else all its readers sit in the next two stages: a chain link
            skips[s] = far
    return skips, st
