"""What the DP's lower bound may count of a pinned storage beyond its forward readers.

A pinned storage (`chain.pinned_storages`: a container's argument held while it runs,
DenseNet's concatenated features, autocast's cast weights) is left out of the DP's windows
and counted by position. The lower-bound pass counted it only up to its last forward
reader, as if every schedule dropped it there; on CNNs that looseness made most of the
proven gaps (timm MobileNetV3 at 80 %: a bound of 0.068 ms under a 0.130 ms answer that is
optimal).

A node `j` that reads and saves the storage `s` holds it under every schedule in which no
region holds both `j` and the producer of `s`: stored, `j` keeps `s` until its backward;
recomputed in a region starting after the producer, the region keeps `s` as an input until
its own backward. Then `s` lives from its producer through the end of the forward and every
rerun and backward event down to `j`'s. A region holding both spans two stages or more (`j`
is taken in a later stage than the producer), so it keeps nothing or its matmuls, and its
rerun costs at least the forward time of its other nodes from its start up to its last
packing node; the least of that over the regions that hold both is `cover_ms` (a
container's call or its op ranges: most of the model). So every schedule either holds `s`
that long or recomputes at least `cover_ms`: for any `floor_ms`, the lower-bound pass with
the longer life counted for every storage whose `cover_ms` is at least `floor_ms`
(`held_table`) bounds every schedule below `floor_ms`, and the optimum is at least the
smaller of that pass's bound and `floor_ms`. Where the first such `j` is cheap to cover
(RegNet's stem: its ReLU saves the batch norm's output, both in a 0.01 ms call), a later
saver whose cover is not still holds `s` to its own backward (`sure_holds`): covers only
grow with the saver, so the first saver at or above `floor_ms` is the one counted.

Where `cover_ms` is below the answer (BERT's attention mask: rerunning the whole encoder
keeping its matmuls costs 0.26 ms of a 0.80 ms answer), the schedules are split instead
(`split_bound`): those with no region holding a producer and its holder hold every such
storage, and those with one are bounded by a pass over them alone (`Cover`: no segment
ends between the two stages, and the one holding both has such a region); with many such
storages, a branch and bound over them (`branch_bound`).

Two more counts, each true under every schedule: a window's own savers and regions hold
a pinned storage after its forward (the windows count that part, `profile_parts`'
`after_forward`); and a storage that only one stage can hold after the forward
(`one_stage_holders`: autocast's cast weights, which its cache keeps to the end of the
forward, saved by the one layer that reads them) is held on through every later window
exactly when that stage's window holds it, so the lower-bound pass may count it in that
window's residue instead of by position (`cut_table`). That count loses the forward events
after the stage when the window does not hold it, so `solvers.dp.search` takes it only where it
bounds higher (conformance: autocast's MobileNetV3 and EfficientNet proven, T5 not). A
cast read to the end of the forward lives through every later forward event whether held
or not: that pass counts it there by position, and held in the residue only at the
reruns and backward events (`solvers.front.Front`'s `fwd`: what an entry holds at later
forwards beyond the table). Under bf16 that proved RegNet-Y, ConvNeXt-T, Swin-T, ViT-B
and ConvNeXt-atto at half their activations.

A pinned storage no later node saves but later stages' recomputable nodes read (DenseNet's
features, which every later concatenation of the block reads) is held after the forward
only where a region starting after its producer holds such a reader: the region keeps it
as its input until its own backward, so at least through the reruns and backward events
of every node after the last such reader (`ReaderHold`). No window knows whether an
earlier one holds it, so the lower-bound pass counted it to its last forward reader only.
`reader_split_bound` branches instead: per storage in turn, the schedules with such a
region (counted held) and those without (their windows' options holding one are left out),
a pass per branch, until a branch bounds at or above the answer.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from solvers.accounting import BACKWARD, FORWARD, RELEASED, RERUN, Context, table_slice
from solvers.dp.chain import stage_index
from solvers.dp.options import Spec
from solvers.frame import may_skip
from solvers.problem import Problem

__all__ = ["Cover", "PinnedHold", "ReaderHold", "bound_over_holds", "cut_table", "held_table",
           "one_stage_holders", "pinned_holds", "reader_holds", "reader_split_bound",
           "split_bound", "sure_holds"]


class PinnedHold(NamedTuple):
    """A pinned storage held from its producer to `holder`'s backward unless a region
    holding both reruns at least `cover_ms`."""

    storage: int
    holder: int
    nbytes: int
    cover_ms: float
    later: tuple[tuple[int, float], ...] = ()  # the savers after `holder`, each with its cover


def pinned_holds(problem: Problem, stages: list[tuple[int, int]],
                 pinned: frozenset[int]) -> list[PinnedHold]:
    """The pinned storages read and saved by a node in a later stage than their producer's,
    each with the first such node and the least rerun time of a region holding both."""
    stage_of = stage_index(problem, stages)
    out = []
    cover = _CoverCost(problem)
    for s in sorted(pinned):
        prod = problem.storage_producer[s]
        savers = [j for j in problem.consumers[s] if stage_of[j] > stage_of[prod]
                  and s in problem.saved[j]]
        if savers:
            out.append(PinnedHold(s, savers[0], problem.storage_bytes[s],
                                  cover(prod, savers[0]),
                                  tuple((j, cover(prod, j)) for j in savers[1:])))
    return out


class _CoverCost:
    """The least rerun time of a region holding nodes `x` and `y > x`: of each such module
    span (any range without spans) whose nodes are all recomputable, the forward time of
    its nodes up to its last packing one, less the matmuls it could keep."""

    def __init__(self, problem: Problem) -> None:
        n = problem.n_nodes
        fwd = np.asarray(problem.fwd_time_ms, dtype=float)
        keeps = np.asarray([problem.is_matmul(i) and problem.can_keep(i) for i in range(n)],
                           dtype=bool)
        rerun = np.where(keeps | may_skip(problem), 0.0, fwd)  # F9 may skip those too
        self.rerun_upto = np.concatenate([[0.0], np.cumsum(rerun)])
        self.fixed_upto = np.concatenate([[0], np.cumsum([not r for r in problem.recomputable])])
        last = -1
        self.last_pack = []  # per node i: the last node <= i that packs (-1: none)
        for i, packs in enumerate(problem.packs):
            last = i if packs else last
            self.last_pack.append(last)
        spans = problem.module_spans
        self.spans = None if spans is None else sorted({(sp.start, sp.stop) for sp in spans})

    def __call__(self, x: int, y: int) -> float:
        if self.spans is None:
            return self._rerun(x, y + 1, y)
        return min((self._rerun(a, b, max(y, self.last_pack[b - 1]))
                    for a, b in self.spans if a <= x and b > y), default=math.inf)

    def _rerun(self, a: int, b: int, stop: int) -> float:
        if self.fixed_upto[b] != self.fixed_upto[a]:  # a node that is never recomputed
            return math.inf
        return float(self.rerun_upto[stop] - self.rerun_upto[a])


def sure_holds(holds: Sequence[PinnedHold], floor_ms: float) -> list[PinnedHold]:
    """The holds that bound every schedule faster than `floor_ms`: only a region rerunning
    at least that long could free their storages early. Where a region rerunning less could
    free a storage from its first holder, a later saver that no such region holds still
    holds it to its own backward (covers grow with the saver)."""
    out = []
    for h in holds:
        if h.cover_ms >= floor_ms:
            out.append(h)
            continue
        saver = next(((j, c) for j, c in h.later if c >= floor_ms), None)
        if saver is not None:
            out.append(PinnedHold(h.storage, saver[0], h.nbytes, saver[1]))
    return out


class Cover(NamedTuple):
    """Schedules with a region that holds nodes `x` and `y` (stages `first` < `last`): no
    segment ends between those stages, and the one holding both has such a region (`x`
    negative: any segment holding those stages)."""

    first: int
    last: int
    x: int
    y: int

    def by(self, spec: Spec, a: int) -> bool:
        """Whether an option of the window starting at node `a` has such a region."""
        return self.x < 0 or any(a + rx <= self.x and a + ry > self.y for rx, ry, _, _ in spec)


# a lower-bound pass counting these holds as held, over the schedules with regions that
# cover these (none: all schedules): its bound (inf: nothing fits), whether it thinned a
# front, and whether a relaxed window is on its path
HeldRun = Callable[[list[PinnedHold], tuple[Cover, ...]], tuple[float, bool, bool]]
EVERY_SPLIT_GROUPS = 3  # up to this many groups, a pass per set of them covered


def bound_over_holds(run: HeldRun, problem: Problem, stages: list[tuple[int, int]],
                     holds: Sequence[PinnedHold], floor_ms: float
                     ) -> tuple[float, bool, bool]:
    """A lower bound over every schedule faster than `floor_ms` (so the optimum is at least
    the smaller of it and `floor_ms` when a hold counted): `run` with the holds sure below
    the floor, then, while a gap is left, `split_bound` over the others."""
    sure = sure_holds(holds, floor_ms)
    lower, rounded, relaxed = run(sure, ())
    cheap = [h for h in holds if h.cover_ms < floor_ms]
    levels = [level for h in cheap for level in _cheap_levels(h, floor_ms)]
    if len(_groups(problem, stages, levels)) <= EVERY_SPLIT_GROUPS:
        cheap = levels
    if cheap and lower < floor_ms:
        try:
            split = split_bound(run, problem, stages, sure, cheap, lower, floor_ms)
        except TimeoutError:
            split = None
        if split is not None and split[0] > lower:
            lower, rounded, relaxed = split
    return (min(lower, floor_ms) if sure else lower), rounded, relaxed


def _cheap_levels(hold: PinnedHold, floor_ms: float) -> list[PinnedHold]:
    """`hold` and each later saver of its storage whose cover is dearer than the one
    before and still below `floor_ms`: covering one saver leaves the later ones holding."""
    out = [hold]
    for saver, cover_ms in hold.later:
        if out[-1].cover_ms < cover_ms < floor_ms:
            out.append(PinnedHold(hold.storage, saver, hold.nbytes, cover_ms))
    return out


def _groups(problem: Problem, stages: list[tuple[int, int]], cheap: Sequence[PinnedHold]
            ) -> list[tuple[tuple[int, int], list[PinnedHold]]]:
    """`cheap` grouped by the stages of their producer and holder, costliest cover first."""
    stage_of = stage_index(problem, stages)
    by_stages: dict[tuple[int, int], list[PinnedHold]] = {}
    for h in cheap:
        key = (stage_of[problem.storage_producer[h.storage]], stage_of[h.holder])
        by_stages.setdefault(key, []).append(h)
    return sorted(by_stages.items(), key=lambda g: -max(h.cover_ms for h in g[1]))


def split_bound(run: HeldRun, problem: Problem, stages: list[tuple[int, int]],
                sure: list[PinnedHold], cheap: list[PinnedHold], beat: float,
                floor_ms: float = math.inf) -> tuple[float, bool, bool]:
    """A bound from splitting the schedules by the `cheap` holds (whose storages a region
    rerunning less than the answer could free). The holds are grouped by the stages their
    producer and holder are in (`Cover`: a region holding the group's latest producer and
    earliest holder); a schedule has such a region for each group of a set and holds the
    storages of the others. Up to `EVERY_SPLIT_GROUPS` groups, a pass per set, stopping
    once they cannot beat `beat` (the unsplit bound); beyond, `branch_bound` over the
    groups, costliest cover first, whose leaves are the branches bounding at or above
    `floor_ms`. `cheap` may hold a storage more than once, from each of its savers
    (`_cheap_levels`): a pass counts it from the first of them its schedules leave holding.

    BERT at 30 %: the attention mask every layer saves, freed early only by rerunning the
    whole encoder with its matmuls kept (0.26 ms, under the 0.80 ms answer), bounded the
    answer at 0.69 ms counted to its last forward reader; no schedule that fits reruns it.
    DeepLabV3 under bf16 has ten such holds in eight groups.
    """
    groups = _groups(problem, stages, cheap)
    covers = [Cover(first, last, max(problem.storage_producer[h.storage] for h in hs),
                    min(h.holder for h in hs)) for (first, last), hs in groups]
    flags = [False, False]  # a pass thinned a front; the least one's path is relaxed
    lower = math.inf

    def covered(case: frozenset[int], held: frozenset[int]) -> float:
        nonlocal lower
        first: dict[int, PinnedHold] = {}  # per storage, its first holder left holding it
        for h in (h for i in sorted(held) for h in groups[i][1]):
            if h.storage not in first or h.holder < first[h.storage].holder:
                first[h.storage] = h
        holds = [h for h in sure if h.storage not in first] + list(first.values())
        found, thinned, through = run(holds, tuple(covers[i] for i in sorted(case)))
        flags[0] |= thinned
        if found < lower:
            lower, flags[1] = found, through
        return found

    every = frozenset(range(len(groups)))
    if len(groups) > EVERY_SPLIT_GROUPS:
        ones = [frozenset({i}) for i in range(len(groups))]
        return branch_bound(covered, len(groups), floor_ms, ones, ones), flags[0], flags[1]
    for k in range(len(groups) + 1):
        for case in map(frozenset, itertools.combinations(range(len(groups)), k)):
            if lower <= beat:
                break
            covered(case, every - case)
    return lower, flags[0], flags[1]


def held_table(problem: Problem, table: np.ndarray, last_read: tuple[int, ...],
               holds: Sequence[PinnedHold]) -> np.ndarray | None:
    """`table` (pinned storages live up to their last forward reader) with the longer life
    of each of `holds` (`table` itself when there are none)."""
    n = problem.n_nodes
    if not holds:
        return table
    out = table.copy()
    for h in holds:
        out[table_slice(n, FORWARD, last_read[h.storage] + 1, n)] += h.nbytes
        out[table_slice(n, RERUN, h.holder, n)] += h.nbytes
        out[table_slice(n, BACKWARD, h.holder, n)] += h.nbytes
        out[table_slice(n, RELEASED, h.holder + 1, n)] += h.nbytes
    return out


def one_stage_holders(ctx: Context, stages: list[tuple[int, int]],
                      pinned: frozenset[int]) -> dict[int, int]:
    """The pinned storages that only one stage can hold after the forward, each with that
    stage: their savers, their recomputable readers (a region reading one holds it as its
    input) and, where it may be kept, their producer, all in one stage (autocast's cast
    weights, which its cache holds to the end of the forward). The window holding that
    stage is then the only one that may hold them on, so the lower-bound pass counts them
    in its residue."""
    p = ctx.p
    stage_of = stage_index(p, stages)
    out = {}
    for s in pinned:
        holders = {*ctx.savers[s], *(r for r in p.consumers[s] if p.recomputable[r])}
        prod = p.storage_producer[s]
        if p.recomputable[prod]:
            holders.add(prod)
        held_in = {stage_of[h] for h in holders}
        if len(held_in) == 1:
            out[s] = held_in.pop()
    return out


def cut_table(ctx: Context, table: np.ndarray, stages: list[tuple[int, int]],
              one_stage: dict[int, int]) -> np.ndarray:
    """`table` without the forward events after the holding stage of each `one_stage`
    storage (storage -> stage; the residue of the window holding that stage counts it
    there); `table` itself where there are none."""
    if not one_stage:
        return table
    p, n = ctx.p, ctx.n
    out = table.copy()
    for s, stage in one_stage.items():
        stop, last = stages[stage][1], ctx.last_read[s]
        if last >= stop:
            out[table_slice(n, FORWARD, stop, last + 1)] -= p.storage_bytes[s]
    return out


class ReaderHold(NamedTuple):
    """A pinned storage that no later stage saves, and its recomputable readers in later
    stages than its producer's: held after the forward exactly where a region starting
    after `producer` holds one of them (module docstring)."""

    storage: int
    producer: int
    readers: tuple[int, ...]
    nbytes: int

    def held_by(self, spec: Spec, a: int) -> bool:
        """Whether an option of the window starting at node `a` has such a region (only
        outermost regions hold their inputs past the forward)."""
        return any(a + rx > self.producer and any(a + rx <= r < a + ry for r in self.readers)
                   for rx, ry, _, _ in spec)

    def as_hold(self) -> PinnedHold:
        """Where a region holds it: live as `held_table` counts a hold, through the end of
        the forward and at the reruns and backward events of every node after its last
        reader (the region's backward comes after those)."""
        return PinnedHold(self.storage, max(self.readers) + 1, self.nbytes, math.inf)


def reader_holds(problem: Problem, stages: list[tuple[int, int]], pinned: frozenset[int],
                 exclude: frozenset[int]) -> list[ReaderHold]:
    """The pinned storages outside `exclude` (those with later savers, those one stage
    holds) that recomputable nodes of later stages than their producer's read, in the
    order of their producers."""
    stage_of = stage_index(problem, stages)
    out = []
    for s in sorted(pinned - exclude, key=lambda s: (problem.storage_producer[s], s)):
        prod = problem.storage_producer[s]
        readers = tuple(r for r in problem.consumers[s]
                        if problem.recomputable[r] and stage_of[r] > stage_of[prod])
        if readers and problem.storage_bytes[s]:
            out.append(ReaderHold(s, prod, readers, problem.storage_bytes[s]))
    return out


# a lower-bound pass over the schedules that hold the first storages (a region holds a
# reader) and none of the second: its bound (inf: nothing fits)
ReaderRun = Callable[[tuple[ReaderHold, ...], tuple[ReaderHold, ...]], float]
BRANCH_PASSES = 64  # passes per branch and bound; past them, open branches keep their parent's


def reader_split_bound(run: ReaderRun, readers: Sequence[ReaderHold], beat: float) -> float:
    """A lower bound over every schedule (`branch_bound`): per storage of `readers` in
    order, the schedules holding it and those leaving out every option that would. A region
    that holds a storage holds every earlier one whose readers include all of its own
    (`_implied`: DenseNet's concatenations read every earlier feature of the block), so
    each branch decides those too.
    DenseNet-121 at 50 %: 0.432 ms counted to the last forward reader; schedules that hold
    none of the first block's input bound 0.558 ms, those that hold it and not the next
    feature 0.440 ms, under a 0.442 ms answer."""
    held_too, out_too = _implied(readers)
    return branch_bound(lambda held, out: run(tuple(readers[i] for i in sorted(held)),
                                              tuple(readers[i] for i in sorted(out))),
                        len(readers), beat, held_too, out_too)


def branch_bound(run: Callable[[frozenset[int], frozenset[int]], float], n: int,
                 beat: float, yes_too: Sequence[frozenset[int]],
                 no_too: Sequence[frozenset[int]]) -> float:
    """A lower bound over every schedule from `n` yes/no questions about it: `run(yes,
    no)` bounds the schedules answering yes to those in `yes` and no to those in `no`.
    Best-first: the branch with the lowest bound so far is passed next, then split on its
    first open question (a yes to i also answers `yes_too[i]`, a no `no_too[i]`); a branch
    whose pass bounds at or above `beat` (or with every question answered) is a leaf. The
    least bound of the leaves and of the branches still open after `BRANCH_PASSES` passes
    or at the deadline (each at its parent's)."""
    Branch = tuple[float, int, frozenset[int], frozenset[int]]
    open_: list[Branch] = [(-math.inf, 0, frozenset(), frozenset())]
    lower, made = math.inf, 1
    for _ in range(BRANCH_PASSES):
        if not open_ or open_[0][0] >= lower:
            break
        parent, order, yes, no = heapq.heappop(open_)
        try:
            found = run(yes, no)
        except TimeoutError:  # the branches passed so far still bound
            heapq.heappush(open_, (parent, order, yes, no))
            break
        nxt = next((i for i in range(n) if i not in yes | no), None)
        if found >= beat * (1 - 1e-12) or nxt is None:
            lower = min(lower, found)
            continue
        for child in ((yes | yes_too[nxt], no), (yes, no | no_too[nxt])):
            if not child[0] & child[1]:  # else no schedule is in both
                heapq.heappush(open_, (found, made, *child))
                made += 1
    return min(lower, open_[0][0]) if open_ else lower


def _implied(readers: Sequence[ReaderHold]) -> tuple[list[frozenset[int]], list[frozenset[int]]]:
    """Per storage i: the storages a schedule holds where it holds i (i and each earlier
    one whose readers include i's: the region holding i reads them after their
    producers), and those it holds none of where it holds not i (the converse)."""
    reads = [set(h.readers) for h in readers]
    held_too = [frozenset(j for j, t in enumerate(readers)
                          if j == i or (t.producer < h.producer and reads[i] <= reads[j]))
                for i, h in enumerate(readers)]
    out_too = [frozenset(j for j in range(len(readers)) if i in held_too[j])
               for i in range(len(readers))]
    return held_too, out_too
