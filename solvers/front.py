"""Pareto fronts of (cost, loss) points, both to be small: one definition of dominance and of
thinning for every solver and plot (`dp`'s chained fronts, `keep`'s and `inner`'s subset
fronts, `planner.viz`'s frontier).

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
    """Pareto front of (held bytes, recompute ms) with back-pointers, as numpy arrays."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, Any]] = []
        self.held = np.zeros(0, dtype=np.int64)
        self.time = np.zeros(0)
        self.src = np.zeros(0, dtype=np.int64)  # chunk index of each entry
        self.idx = np.zeros(0, dtype=np.int64)  # entry index in the chunk's source front
        self.info: list[Any] = []  # per chunk; None: the chain's start

    def add(self, held: np.ndarray, tms: np.ndarray, info: Any,
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
        first, last = bucket_ends(held, buckets)
        slot = np.repeat(np.arange(len(first)), last - first + 1)

        def prefix(cnt: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            k = int(slot[cnt - 1]) + 1
            idx = last[:k].copy()
            idx[-1] = cnt - 1  # the prefix may end inside its last bucket
            return held[first[:k]], tms[idx], idx

        return prefix

    def prune(self, max_front: int, optimistic: bool) -> bool:
        held = np.concatenate([c[0] for c in self.chunks])
        tms = np.concatenate([c[1] for c in self.chunks])
        keep = pareto_indices(held, tms, tol=1e-12)
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
            corner = held[first] if optimistic else held[last]
            held, tms, src, idx = corner, tms[last], src[last], idx[last]
        self.held, self.time, self.src, self.idx = held, tms, src, idx
        self.info = [c[3] for c in self.chunks]
        self.chunks = []
        return rounded
