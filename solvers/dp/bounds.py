"""Cheap, proven bounds on DP windows longer than the exact pass's span (`SpanBounds`), from
prefix sums over the recomputable runs: what the DP's lower-bound pass relaxes long
segments to, so its bound covers the full flat space (`solvers.dp.search`).
"""

from __future__ import annotations

import bisect

import numpy as np

from solvers.accounting import Context
from solvers.dp.chain import is_empty
from solvers.frame import FlatStops, may_skip

__all__ = ["MadeBytes", "SpanBounds"]


class MadeBytes:
    """Bytes of the storages (of one set) made in `[x, y)` and first saved before `y`."""

    def __init__(self, prod: np.ndarray, first_saver: np.ndarray, nbytes: np.ndarray,
                 n: int) -> None:
        self.prod, self.first_saver, self.nbytes = prod, first_saver, nbytes
        per_node = np.bincount(first_saver, weights=nbytes, minlength=n + 1)
        self.saved_upto = np.concatenate([[0], np.cumsum(per_node[:n])]).astype(np.int64)
        self._crossing: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, x: int, y: int) -> int:
        cross = self._crossing.get(x)
        if cross is None:  # produced before x, first saved at or after x
            sel = (self.prod < x) & (self.first_saver >= x)
            order = np.argsort(self.first_saver[sel], kind="stable")
            cross = self._crossing[x] = (self.first_saver[sel][order],
                                         np.concatenate([[0], np.cumsum(self.nbytes[sel][order])]))
        fs, cum = cross
        return int(self.saved_upto[y] - self.saved_upto[x]) - int(cum[np.searchsorted(fs, y)])


class SpanBounds:
    """Cheap bounds on a multi-stage window `[a, b)`'s two options (plain, keep matmuls).

    Per recomputable run of the window, `made`: bytes of storages produced and saved in it,
    all alive at the backward of the run's trigger after its rerun, whatever is kept (the
    cut-off of segment growth: it only grows with b); `kept`: the outputs of its keepable
    matmul-like nodes that are saved in it (kept, the SAC cache holds them through the
    forward and they are still alive when a later run reruns). `relaxed(a, b)` gives, per
    option, (local peak, residue, recompute time) no greater than the option's true ones:
    plain (max made, 0, rerun time); keep matmuls (max over runs of made + kept of the
    earlier runs, total kept, rerun time less the kept nodes). Split a window in two: the
    first part's residue plus the second's peak is still within the whole window's true
    peak, residues and times add up to at most the whole's. So a relaxed window longer than
    `2 * span + 1` stages is never needed (split it into relaxed pieces of `span + 1 ..
    2 * span + 1` stages), and `_run`'s lower-bound pass relaxes only those lengths. That
    needs the kept outputs the run does not save left out of the residue (they die during
    the rerun); on chains of up to `SPLIT_RELAXED_STAGES` stages every length is relaxed
    instead, with every kept output in the residue: a tighter bound at more cost.
    """

    def __init__(self, ctx: Context, pinned: frozenset[int]) -> None:
        p = ctx.p
        n = p.n_nodes
        self.runs = p.recomputable_runs(0, n)
        self.run_starts = [x for x, _ in self.runs]
        keepable = np.asarray([p.is_matmul(i) and p.can_keep(i) for i in range(n)], dtype=bool)
        prod = np.asarray(p.storage_producer, dtype=np.int64)
        first_saver = np.full(p.n_storages, n, dtype=np.int64)
        for s, savers in enumerate(ctx.savers):
            if savers and s not in ctx.loss and s not in pinned:
                first_saver[s] = savers[0]
        nbytes = np.asarray(p.storage_bytes, dtype=np.int64)
        counted = first_saver < n
        kept = counted & keepable[prod]
        self.made = MadeBytes(prod[counted], first_saver[counted], nbytes[counted], n)
        self.kept = MadeBytes(prod[kept], first_saver[kept], nbytes[kept], n)
        kept_all = [sum(p.storage_bytes[s] for s in p.outputs[i]
                        if s not in ctx.loss and s not in pinned) if keepable[i] else 0
                    for i in range(n)]
        self.kept_all_upto = np.concatenate([[0], np.cumsum(kept_all)]).astype(np.int64)
        self.stops = FlatStops(p)
        nxt = np.where([not is_empty(p, i) for i in range(n)], np.arange(n), n)
        self.next_real = np.minimum.accumulate(nxt[::-1])[::-1]  # first non-empty node >= i
        fwd = self.fwd_ms = np.asarray(p.fwd_time_ms, dtype=float)
        self.fwd_upto = np.concatenate([[0.0], np.cumsum(fwd)])
        # what keeping matmuls may leave to rerun: the rest, less what F9 may skip
        self.rerun_upto = np.concatenate([[0.0], np.cumsum(
            np.where(keepable | may_skip(p), 0.0, fwd))])
        self.keepable = keepable

    def _pieces(self, a: int, b: int) -> list[tuple[int, int]]:
        k = max(0, bisect.bisect_right(self.run_starts, a) - 1)
        out = []
        while k < len(self.runs) and self.runs[k][0] < b:
            x, y = max(a, self.runs[k][0]), min(b, self.runs[k][1])
            if x < y:
                out.append((x, y))
            k += 1
        return out

    def memory(self, a: int, b: int) -> int:
        """Lower bound on the local peak of every option recomputing the window's runs."""
        return max((self.made(x, y) for x, y in self._pieces(a, b)), default=0)

    def relaxed(self, a: int, b: int, splittable: bool) -> list[tuple[int, int, float]]:
        """(local peak, residue, recompute time) bounding each option of the window.

        `splittable=False` counts every kept output in the residue (tighter, but then no
        window length may be left out of the relaxation).
        """
        plain_peak = mm_peak = kept = 0
        plain_ms = mm_ms = 0.0
        for x, y in self._pieces(a, b):
            made = self.made(x, y)
            plain_peak = max(plain_peak, made)
            mm_peak = max(mm_peak, made + kept)
            if splittable:
                kept += self.kept(x, y)
            x, stop = int(self.next_real[x]), self.stops.rerun_stop(y)
            if stop > x:  # a run that reruns: its frame (and SAC cache) outlives the forward
                unrun = float(self.fwd_ms[stop - 1]) if self.stops.last_not_run(stop) else 0.0
                plain_ms += float(self.fwd_upto[stop] - self.fwd_upto[x]) - unrun
                mm_ms += float(self.rerun_upto[stop] - self.rerun_upto[x]) - (
                    0.0 if self.keepable[stop - 1] else unrun)
                if not splittable:
                    kept += int(self.kept_all_upto[stop] - self.kept_all_upto[x])
        out = [(plain_peak, 0, plain_ms)]
        if mm_ms < plain_ms:
            out.append((mm_peak, kept, mm_ms))
        return out
