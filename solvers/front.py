"""Pareto fronts of (cost, loss) points, both to be small: one definition of dominance and of
thinning for every solver and plot (`dp`'s chained fronts, `keep`'s and `inner`'s subset
fronts, `planner.reports.viz`'s frontier).

A point is on the front when every cheaper point is worse by more than `tol`; ties on cost
go to the lesser loss, then to the earlier point. A front too long is thinned to one entry
per equal-width bucket of cost (`bucket_ends`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

__all__ = ["Front", "bucket_ends", "pareto", "pareto_indices"]

T = TypeVar("T")


def pareto(points: Iterable[T], cost: Callable[[T], Any], loss: Callable[[T], float],
           tol: float = 0.0) -> list[T]:
    """The front of `points` by ascending `cost`, each with less `loss` (by more than `tol`)
    than the point before it. `cost` may return a tuple (ties broken by its later items).

    >>> pareto([(3, 1.0), (1, 5.0), (2, 5.0), (1, 4.0)], lambda p: p[0], lambda p: p[1])
    [(1, 4.0), (3, 1.0)]
    """
    front: list[T] = []
    for p in sorted(points, key=lambda p: (cost(p), loss(p))):
        if not front or loss(p) < loss(front[-1]) - tol:
            front.append(p)
    return front


DOMINANCE_BLOCK = 512  # entries `_with_fwd_front` checks against the kept ones at once
DOMINANCE_CELLS = 2_000_000  # ... and at most this many pairs in all, else it merges them
PREFILTER_MIN = 16_384  # points from which `pareto_indices` first drops the far-dominated
PREFILTER_CELLS = 8_192  # cells of cost the prefilter compares points across


def pareto_indices(cost: np.ndarray, loss: np.ndarray, tol: float = 0.0) -> np.ndarray:
    """`pareto` over arrays: the indices of the front, by ascending cost (each point's loss
    below that of every cheaper point by more than `tol`; of equal costs, the least loss,
    then the earlier point).

    Sorted by cost alone (stable), not by (cost, loss): a chained front is the union of a few
    sorted runs, which a stable sort merges in about linear time. Long inputs first lose
    the points a cheaper cell of cost dominates (`_undominated`), without a sort.
    """
    if not len(cost):
        return np.zeros(0, dtype=np.int64)
    candidates = (_undominated(cost, loss, tol) if len(cost) >= PREFILTER_MIN
                  and np.issubdtype(cost.dtype, np.integer) else None)
    if candidates is None:
        return _sorted_front(cost, loss, tol)
    return candidates[_sorted_front(cost[candidates], loss[candidates], tol)]


def _sorted_front(cost: np.ndarray, loss: np.ndarray, tol: float) -> np.ndarray:
    """`pareto_indices` by one stable sort of every point."""
    order = np.argsort(cost, kind="stable")
    sorted_cost, sorted_loss = cost[order], loss[order]
    starts = np.concatenate([[True], sorted_cost[1:] != sorted_cost[:-1]])
    group = np.cumsum(starts) - 1
    group_min = np.minimum.reduceat(sorted_loss, np.flatnonzero(starts))
    before = np.minimum.accumulate(np.concatenate([[np.inf], group_min[:-1]]))
    wanted = np.flatnonzero((group_min < before - tol)[group]
                            & (sorted_loss == group_min[group]))
    earliest = np.concatenate([[True], group[wanted][1:] != group[wanted][:-1]])
    return order[wanted[earliest]]


def _undominated(cost: np.ndarray, loss: np.ndarray, tol: float) -> np.ndarray | None:
    """The indices, in order, of the points no point of a cheaper cell of cost dominates
    (None: one cell). Cells split the cost range evenly and a point's cell never precedes a
    cheaper point's, so a point of an earlier cell is cheaper: a point dropped here has a
    cheaper point that loses at most `tol` less, and is off the front. The front of the
    rest, in the same order, is the front of all, ties broken alike.

    Integer costs; `tol` is taken off the few cells' losses, as `_sorted_front` takes it
    off the least loss before a point, not added to every point's.
    """
    lo, hi = int(cost.min()), int(cost.max())
    if hi <= lo:
        return None
    shift = ((hi - lo) // PREFILTER_CELLS).bit_length()  # cells of 2**shift costs
    cell = (cost - lo) >> shift
    least = np.full(((hi - lo) >> shift) + 1, np.inf)
    np.minimum.at(least, cell, loss)
    before = np.empty_like(least)  # the least loss of every earlier cell
    before[0] = np.inf
    np.minimum.accumulate(least[:-1], out=before[1:])
    return np.flatnonzero((before - tol)[cell] > loss)


def bucket_ends(cost: np.ndarray | Sequence[int], buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """For an ascending integer `cost`, split into at most `buckets` equal-width ranges: the
    index of each non-empty bucket's first and last point."""
    cost = np.asarray(cost, dtype=np.int64)
    lo, hi = int(cost[0]), int(cost[-1])
    width = max(1, -(-(hi - lo) // buckets))
    bucket = (cost - lo) // width
    change = bucket[1:] != bucket[:-1]
    first = np.nonzero(np.concatenate([[True], change]))[0]
    last = np.nonzero(np.concatenate([change, [True]]))[0]
    return first, last


class Front:
    """Pareto front of (held bytes, recompute ms) with back-pointers, as numpy arrays.

    Each entry also carries `fwd`, at most its held bytes: what it holds at the later
    windows' forward events beyond what those count by position (`solvers.dp.search`'s passes that
    count pinned storages in the residue; otherwise `held` itself). Where the two differ
    (lower-bound passes only, `optimistic`), the front is three-way: it keeps every entry
    that no kept one dominates in held bytes, `fwd` and time (`_with_fwd_front`), so times
    need not fall along the held bytes (`monotone` False).
    """

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, Any, np.ndarray]] = []
        self.held = np.zeros(0, dtype=np.int64)
        self.fwd = np.zeros(0, dtype=np.int64)
        self.time = np.zeros(0)
        self.src = np.zeros(0, dtype=np.int64)  # chunk index of each entry
        self.idx = np.zeros(0, dtype=np.int64)  # entry index in the chunk's source front
        self.info: list[Any] = []  # per chunk; None: the chain's start
        self.monotone = True  # times fall along the held bytes

    def add(self, held: np.ndarray, tms: np.ndarray, info: Any,
            idx: np.ndarray | None = None, fwd: np.ndarray | None = None) -> None:
        self.chunks.append((held, tms, np.arange(len(held)) if idx is None else idx, info,
                            held if fwd is None else fwd))

    def corners(self, buckets: int) -> Callable[[int], tuple[np.ndarray, np.ndarray,
                                                             np.ndarray, np.ndarray]]:
        """Lower-bound thinning of any prefix of this (pruned) front to <= `buckets` entries.

        Returns `prefix(cnt) -> (held, time, idx, fwd)`: per memory bucket the least held
        bytes, the least time (`idx` points to its entry) and the least `fwd`, an
        optimistic corner that no entry of the bucket beats. For the relaxed windows of the
        lower-bound pass, which add a prefix of one front to up to a whole chain of later
        fronts.
        """
        held, tms, fwd = self.held, self.time, self.fwd
        if len(held) <= buckets:
            return lambda cnt: (held[:cnt], tms[:cnt], np.arange(cnt), fwd[:cnt])
        first, last = bucket_ends(held, buckets)
        slot = np.repeat(np.arange(len(first)), last - first + 1)
        least_fwd = np.minimum.reduceat(fwd, first)
        fastest = last if self.monotone else _least_in_buckets(tms, first)

        def prefix(cnt: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            k = int(slot[cnt - 1]) + 1
            idx = fastest[:k].copy()
            if self.monotone:
                idx[-1] = cnt - 1  # the prefix may end inside its last bucket
            return held[first[:k]], tms[idx], idx, least_fwd[:k]

        return prefix

    def prune(self, max_front: int, optimistic: bool) -> bool:
        held = np.concatenate([c[0] for c in self.chunks])
        tms = np.concatenate([c[1] for c in self.chunks])
        keep = pareto_indices(held, tms, tol=1e-12)
        apart = not all(c[4] is c[0] for c in self.chunks)  # else `fwd` is `held`
        every_fwd = np.concatenate([c[4] for c in self.chunks]) if apart else held
        self.monotone = not (optimistic and apart and bool(np.any(every_fwd != held)))
        if self.monotone:
            fwd = every_fwd[keep] if apart else None
        else:
            keep, fwd = _with_fwd_front(held, tms, every_fwd, keep)
        ends = np.cumsum([len(c[0]) for c in self.chunks])
        src = np.searchsorted(ends, keep, side="right")  # the chunk of each kept entry
        idx = np.concatenate([c[2] for c in self.chunks])[keep]
        held, tms = held[keep], tms[keep]
        rounded = False
        if len(held) > max_front:
            # thin to one entry per memory bucket: the bucket's fastest entry (the last: times
            # decrease along the front), a real schedule, so the upper-bound pass stays exact
            # for what it keeps; the lower-bound pass pairs that time with the bucket's least
            # held bytes (no real schedule is better than this corner). Neither moves held
            # bytes to a grid edge, which compounded the error stage after stage.
            rounded = True
            first, last = bucket_ends(held, max_front)
            fastest = last if self.monotone else _least_in_buckets(tms, first)
            corner = held[first] if optimistic else held[last]
            if fwd is not None:
                fwd = np.minimum.reduceat(fwd, first) if optimistic else fwd[last]
            held, tms, src, idx = corner, tms[fastest], src[fastest], idx[fastest]
        self.held, self.time, self.src, self.idx = held, tms, src, idx
        self.fwd = held if fwd is None else fwd
        self.info = [c[3] for c in self.chunks]
        self.chunks = []
        return rounded


def _with_fwd_front(held: np.ndarray, tms: np.ndarray, fwd: np.ndarray, keep: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """`Front.prune`'s entries where `fwd` differs from `held`, by ascending held bytes, and
    their `fwd`: those of the (held, time) front `keep`, of the (fwd, time) one, and every
    other that none of those dominates in all three. Where the others are too many to
    check (`DOMINANCE_CELLS`), each is dropped and its `fwd` given to the (held, time)
    entry dominating it instead: an optimistic corner, as a thinned front's."""
    by_fwd = pareto_indices(fwd, tms, tol=1e-12)
    union = np.union1d(keep, by_fwd)
    rest = np.setdiff1d(np.arange(len(held)), union)
    # most are dominated by the fastest entry at or below their held bytes on the first
    # front, or at or below their fwd on the second (`_owner`)
    owner = _owner(held, keep, rest)
    open_ = (fwd[owner] > fwd[rest]) & (held[_owner(fwd, by_fwd, rest)] > held[rest])
    rest, owner = rest[open_], owner[open_]
    merged = len(rest) * len(union) > DOMINANCE_CELLS
    if len(rest) and not merged:
        alive = np.ones(len(rest), dtype=bool)
        for lo in range(0, len(rest), DOMINANCE_BLOCK):
            r = rest[lo:lo + DOMINANCE_BLOCK]
            alive[lo:lo + len(r)] = ~((held[union][None, :] <= held[r][:, None])
                                      & (fwd[union][None, :] <= fwd[r][:, None])
                                      & (tms[union][None, :] <= tms[r][:, None] + 1e-12)
                                      ).any(axis=1)
        union = np.concatenate([union, rest[alive]])
    union = union[np.lexsort((tms[union], fwd[union], held[union]))]
    out = fwd[union]
    if merged:
        pos = np.full(len(held), -1, dtype=np.int64)
        pos[union] = np.arange(len(union))
        np.minimum.at(out, pos[owner], fwd[rest])
    return union, out


def _owner(cost: np.ndarray, front: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Per point, the last entry of `front` (indices by ascending cost, falling loss) at or
    below its cost: the front's least loss there."""
    return front[np.searchsorted(cost[front], cost[points], side="right") - 1]


def _least_in_buckets(values: np.ndarray, first: np.ndarray) -> np.ndarray:
    """The index of the least value in each run `first[k]..first[k+1]-1` of `values`."""
    bucket = np.repeat(np.arange(len(first)), np.diff(np.append(first, len(values))))
    return np.lexsort((values, bucket))[first]
