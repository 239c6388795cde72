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
smaller of that pass's bound and `floor_ms`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from solvers.accounting import BACKWARD, FORWARD, RERUN, table_slice
from solvers.chain import stage_index
from solvers.problem import Problem

__all__ = ["PinnedHold", "held_table", "pinned_holds"]


class PinnedHold(NamedTuple):
    """A pinned storage held from its producer to `holder`'s backward unless a region
    holding both reruns at least `cover_ms`."""

    storage: int
    holder: int
    nbytes: int
    cover_ms: float


def pinned_holds(problem: Problem, stages: list[tuple[int, int]],
                 pinned: frozenset[int]) -> list[PinnedHold]:
    """The pinned storages read and saved by a node in a later stage than their producer's,
    each with the first such node and the least rerun time of a region holding both."""
    stage_of = stage_index(problem, stages)
    out = []
    cover = _CoverCost(problem)
    for s in sorted(pinned):
        prod = problem.storage_producer[s]
        holder = next((j for j in problem.consumers[s] if stage_of[j] > stage_of[prod]
                       and s in problem.saved[j]), None)
        if holder is not None:
            out.append(PinnedHold(s, holder, problem.storage_bytes[s], cover(prod, holder)))
    return out


class _CoverCost:
    """The least rerun time of a region holding nodes `x` and `y > x`: of each such module
    span (any range without spans) whose nodes are all recomputable, the forward time of
    its nodes up to its last packing one, less the matmuls it could keep."""

    def __init__(self, problem: Problem) -> None:
        n = problem.n_nodes
        fwd = np.asarray(problem.fwd_time_ms, dtype=float)
        rerun = np.where([problem.is_matmul(i) and problem.can_keep(i) for i in range(n)],
                         0.0, fwd)
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


def held_table(problem: Problem, table: np.ndarray, last_read: tuple[int, ...],
               holds: Sequence[PinnedHold], floor_ms: float) -> np.ndarray | None:
    """`table` (pinned storages live up to their last forward reader) with the longer life
    of every hold whose `cover_ms` is at least `floor_ms`; None: no hold is."""
    n = problem.n_nodes
    held = [h for h in holds if h.cover_ms >= floor_ms]
    if not held:
        return None
    out = table.copy()
    for h in held:
        out[table_slice(n, FORWARD, last_read[h.storage] + 1, n)] += h.nbytes
        out[table_slice(n, RERUN, h.holder, n)] += h.nbytes
        out[table_slice(n, BACKWARD, h.holder, n)] += h.nbytes
    return out
