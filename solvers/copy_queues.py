"""The offload copies of one `simulate` replay on the step's clock: one queue per direction
beside compute (or, over a synchronous link, compute stalls for each copy), each copy in
issue order; when a storage's copy to the host ends, when a call's copies are back, and
what compute waited (`solvers.offload` says which storages move and when they are needed).
"""

from __future__ import annotations

from collections import defaultdict

from solvers.offload import OffloadGroup
from solvers.problem import Problem

__all__ = ["CopyQueues"]


class CopyQueues:
    """The offload copies of one replay on the step's clock (compute time and stalls): one
    queue per direction, each copy in issue order."""

    def __init__(self, p: Problem, groups: list[OffloadGroup]) -> None:
        self.p, self.link = p, p.host_link
        self.clock = 0.0
        self.free = {True: 0.0, False: 0.0}  # when the queue to the host (True) is idle
        self.stall_ms = self.transfer_ms = 0.0
        self.moved_bytes = sum(g.nbytes(p) for g in groups)
        self.out_of: dict[int, int] = {}  # storage -> the node whose save copies it out
        self.out_at: dict[int, list[int]] = defaultdict(list)
        self.entry_out_at: dict[int, list[int]] = defaultdict(list)  # at a checkpoint's entry
        self.to_host: dict[int, set[int]] = defaultdict(set)  # node -> its saves on the host
        self.frame_inputs: dict[int, set[int]] = defaultdict(set)  # checkpoint start -> same
        self.frame_keeps: dict[int, set[int]] = defaultdict(set)  # its kept outputs, same
        self.rerun_need: dict[int, list[OffloadGroup]] = defaultdict(list)
        self.need_at: dict[int, list[OffloadGroup]] = defaultdict(list)
        self.fetch_at: dict[int, list[OffloadGroup]] = defaultdict(list)
        self.out_end: dict[int, float] = {}
        self.drains: dict[int, list[OffloadGroup]] = defaultdict(list)  # node -> after it
        for g in groups:
            self.drains[g.last].append(g)
        self.ready: dict[int, float] = {}
        for g in sorted((g for g in groups if g.moved), key=lambda g: (-g.need, g.index)):
            for s, i in g.moved.items():
                self.out_of[s] = i
                (self.entry_out_at if s in g.at_entry else self.out_at)[i].append(s)
            for s, savers in g.savers.items():
                for k in savers:
                    self.to_host[k].add(s)
            for s, starts in g.frames.items():
                for start in starts:
                    self.frame_inputs[start].add(s)
            for s, starts in g.cached.items():
                for start in starts:
                    self.frame_keeps[start].add(s)
            for start in {start for held in (g.frames, g.cached)
                          for starts in held.values() for start in starts}:
                self.rerun_need[start].append(g)
            self.need_at[g.need].append(g)
            if g.fetch != g.need:
                self.fetch_at[g.fetch].append(g)

    def _copy_ms(self, s: int, to_host: bool) -> float:
        ms = self.link.copy_ms(self.p.storage_bytes[s], to_host)
        self.transfer_ms += ms
        return ms

    def start_out(self, s: int, node_ms: float) -> bool:
        """Copy s to the host after the running node's `node_ms`; True if already done (a
        synchronous link: compute stalls for the copy)."""
        ms = self._copy_ms(s, True)
        if self.link.synchronous:
            self.clock += ms
            self.stall_ms += ms
            self.out_end[s] = self.clock + node_ms
            return True
        start = max(self.clock + node_ms, self.free[True])
        self.out_end[s] = self.free[True] = start + ms
        return False

    def drain(self, g: OffloadGroup) -> list[int]:
        """At `g`'s release: compute waits until its copies to the host have ended (a
        stall); the storages whose device side is let go."""
        moved = [s for s in g.moved if s in self.out_end]
        end = max((self.out_end[s] for s in moved), default=self.clock)
        if end > self.clock:
            self.stall_ms += end - self.clock
            self.clock = end
        return moved

    def start_in(self, g: OffloadGroup) -> bool:
        """Issue the copies of `g` back to the device; False if they were issued already."""
        if g.index in self.ready:
            return False
        end = self.clock
        for s in g.moved:
            ms = self._copy_ms(s, False)
            if self.link.synchronous:
                self.clock += ms
                self.stall_ms += ms
                end = self.clock
            else:
                end = self.free[False] = max(self.clock, self.free[False], self.out_end[s]) + ms
        self.ready[g.index] = end
        return True

    def wait_for(self, g: OffloadGroup) -> None:
        """Compute waits until `g`'s copies are back."""
        wait = self.ready[g.index] - self.clock
        if wait > 0:
            self.clock += wait
            self.stall_ms += wait
