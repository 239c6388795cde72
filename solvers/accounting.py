"""Closed-form memory accounting of non-nested schedules, consistent with `simulate`.

For schedules whose RECOMPUTE regions do not nest, `simulate`'s live bytes at every event
decompose into (a) schedule-independent constants (static memory, gradients and their
accumulation transients, the loss outputs the caller holds, a node's new outputs and
temporaries) plus (b) the bytes of each activation storage instance over the interval in
which something holds it. A storage's holders are: a later reader in the same pass, a STORE
node that saves it (until that node's backward; this includes the loss outputs the loss's
own backward saves), a RECOMPUTE region's frame when it is the region's input (until the
frame dies), the SAC cache for kept outputs (until the rerun consumes them or the frame
dies), and, after a rerun, the backward of the rerun node that saved it. This module
computes those intervals; `evaluate` sums them and equals `simulate(...).peak_bytes` (tests
hold it to that). The exact solvers (`milp`, `dp`) are built on the same pieces, so their
memory model is `simulate`'s, not an approximation.

`profile` evaluates a window of nodes `[a, b)` only, counting the storages produced in the
window plus those read in it from before `a` that the previous window does not hold
(`external`): for chains this splits the peak into per-segment parts (see `solvers.dp`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from solvers.problem import Problem
from solvers.schedule import Region, Schedule
from solvers.simulate import ACCUMULATION_COPIES

logger = logging.getLogger(__name__)

__all__ = ["Context", "RegionInfo", "SegmentProfile", "WindowParts", "evaluate", "gradient_bytes",
           "profile", "profile_parts"]


def gradient_bytes(problem: Problem) -> tuple[list[int], list[int]]:
    """Per backward event j: gradient bytes in its peak, and gradient bytes live just before.

    Both are schedule-independent. The first also counts the accumulation transient: a
    backward that sends a gradient to a storage whose buffer already exists (a later
    gradient reader made it) adds a fresh gradient of that size into it.
    """
    p = problem
    n = p.n_nodes
    event = [0] * n
    rest = [0] * n
    live, grads = 0, set()
    for j in range(n - 1, -1, -1):
        new = [s for s in p.grad_inputs[j] if p.storage_grad_bytes[s] > 0
               and p.grad_consumers[s][-1] == j]
        if j == n - 1:
            new += [s for s in p.outputs[j]
                    if p.storage_grad_bytes[s] > 0 and not p.consumers[s]]
        new = [s for s in dict.fromkeys(new) if s not in grads]
        add = sum(p.storage_grad_bytes[s] for s in new) + p.param_grad_bytes[j]
        accumulate = ACCUMULATION_COPIES * sum(p.storage_grad_bytes[s]
                                               for s in set(p.grad_inputs[j])
                                               if s in grads and s not in new)
        rest[j] = live
        event[j] = live + add + accumulate
        grads.update(new)
        live += add
        for s in p.outputs[j]:
            if s in grads:
                grads.discard(s)
                live -= p.storage_grad_bytes[s]
    return event, rest


class Context:
    """Schedule-independent data of a problem, computed once per solve."""

    def __init__(self, problem: Problem) -> None:
        p = problem
        self.p = p
        n, m = p.n_nodes, p.n_storages
        self.n = n
        self.last_read = [c[-1] if c else -1 for c in p.consumers]
        savers: list[list[int]] = [[] for _ in range(m)]
        for k in range(n):
            for s in p.saved[k]:
                savers[s].append(k)
        self.savers = savers
        # the caller holds the loss outputs all step, except those the loss's backward saves
        self.loss = frozenset(p.outputs[n - 1]) - frozenset(p.saved[n - 1])
        self.loss_bytes = sum(p.storage_bytes[s] for s in self.loss)
        self.alloc = [sum(p.storage_bytes[s] for s in p.outputs[i]) for i in range(n)]
        # gradient bytes in backward event j's peak / live just before it (reruns see this)
        self.g_event, self.g_rest = gradient_bytes(p)
        # per slot kind, the gradient + loss bytes at node j: rerun at trigger j (j),
        # backward of j (n + j), forward (2n + j: none)
        self.g_table = np.concatenate([
            np.asarray(self.g_rest, dtype=np.int64) + self.loss_bytes,
            np.asarray(self.g_event, dtype=np.int64) + self.loss_bytes,
            np.zeros(n, dtype=np.int64)])
        self._regions: dict[tuple[int, int, frozenset[int]], RegionInfo] = {}

    def region(self, a: int, b: int, keep: Iterable[int] = ()) -> RegionInfo:
        """The (cached) rerun analysis of a top-level RECOMPUTE region `[a, b)`."""
        key = (a, b, frozenset(keep))
        info = self._regions.get(key)
        if info is None:
            info = RegionInfo.build(self, *key)
            self._regions[key] = info
        return info


@dataclass(frozen=True)
class Instance:
    """A storage instance regenerated by a rerun: bytes, rerun step producing it, ends.

    It lives from the step after `step` until the later of its last rerun reader (`read_end`,
    a node index, -1 if none) and the backward of its savers (`savers`).
    """

    storage: int
    step: int
    read_end: int
    savers: tuple[int, ...]


@dataclass
class RegionInfo:
    """What `simulate` does for one top-level RECOMPUTE region, independent of the rest.

    `stop` is the rerun's early-stop node (exclusive; 0 when nothing packs and no rerun
    happens), `trigger = stop - 1` the node whose backward starts the rerun, `death` the node
    whose backward frees the frame (None: freed at the end of the region's forward).
    """

    a: int
    b: int
    keep: frozenset[int]
    packs: bool
    stop: int
    trigger: int
    death: int | None
    inputs: tuple[int, ...]
    time_ms: float
    step_const: list[int] = field(default_factory=list)  # alloc + temp of each rerun step
    regen: list[Instance] = field(default_factory=list)
    kept_ends: dict[int, tuple[int, int, tuple[int, ...]]] = field(default_factory=dict)

    @classmethod
    def build(cls, ctx: Context, a: int, b: int, keep: frozenset[int]) -> RegionInfo:
        """Analyse region `[a, b)` with kept nodes `keep`."""
        p = ctx.p
        own = [i for i in range(a, b) if p.packs[i]]
        inputs = tuple(sorted({s for i in range(a, b) for s in p.inputs[i]
                               if p.storage_producer[s] < a}))
        if not own:
            info = cls(a, b, keep, False, 0, -1, None, inputs, 0.0)
            info.kept_ends = {s: (-1, -1, ()) for k in keep for s in p.outputs[k]
                              if s not in ctx.loss}
            return info
        stop = max(own) + 1
        time_ms = float(sum(p.fwd_time_ms[i] for i in range(a, stop) if i not in keep))
        info = cls(a, b, keep, True, stop, stop - 1, min(own), inputs, time_ms)
        for i in range(a, stop):
            cached = i in keep
            info.step_const.append(0 if cached else ctx.alloc[i] + p.fwd_temp_bytes[i])
            for s in p.outputs[i]:
                read_end = max((c for c in p.consumers[s] if i < c < stop), default=-1)
                savers = tuple(k for k in ctx.savers[s] if k < stop and p.packs[k])
                if cached:
                    if s not in ctx.loss:
                        info.kept_ends[s] = (i, read_end, savers)
                else:
                    info.regen.append(Instance(s, i, read_end, savers))
        for k in keep:  # kept nodes past the early stop: the SAC cache holds until death
            if k >= stop:
                for s in p.outputs[k]:
                    if s not in ctx.loss:
                        info.kept_ends[s] = (-1, -1, ())
        return info

    def steps(self) -> range:
        """Node indices the rerun runs (kept ones included, at no cost)."""
        return range(self.a, self.stop)


@dataclass(frozen=True)
class SegmentProfile:
    """Result of `profile` on a window: local peak, retained bytes, held outputs, time."""

    peak_bytes: int  # max over the window's events of constants + local live bytes
    residue_bytes: int  # local bytes still held at the end of the forward
    held_out: frozenset[int]  # storages read after the window that the window holds
    time_ms: float  # recompute time


def _top_regions(schedule: Schedule) -> list[Region]:
    if any(r.children for r in schedule.regions):
        raise ValueError("accounting handles non-nested schedules only; use simulate().")
    return [r for r in schedule.regions if r.is_recompute]


@dataclass(frozen=True)
class WindowParts:
    """`profile` split into what depends on the window's position and what does not.

    The live bytes at slot t are `local[t] + ctx.g_table[g_index[t] + a0]`: `local` holds the
    storage intervals and the per-node constants (allocations, temporaries); the gradient and
    loss bytes, which differ between otherwise identical blocks (parameter gradients pile up),
    come from the position-dependent table. So identical windows at different positions share
    one `WindowParts` (see `solvers.dp`).
    """

    local: np.ndarray  # int64 per slot
    g_index: np.ndarray  # int64 per slot, relative to the window start
    residue_bytes: int
    held_out: frozenset[int]
    time_ms: float

    def peak(self, ctx: Context, a0: int, table: np.ndarray | None = None) -> int:
        """Local peak of the window placed at `a0` (what `profile` reports).

        `table` replaces `ctx.g_table` (same layout), e.g. with bytes of storages left out
        of the window (`skip`) added by position.
        """
        if not len(self.local):
            return 0
        g = ctx.g_table if table is None else table
        return max(0, int((self.local + g[self.g_index + a0]).max()))


def profile_parts(ctx: Context, a0: int, b0: int, regions: Sequence[RegionInfo],
                  external: frozenset[int] = frozenset(),
                  skip: frozenset[int] = frozenset()) -> WindowParts:
    """`profile`'s computation, returned as position-independent parts (`WindowParts`).

    Storages in `skip` are left out (their original instance; copies a rerun regenerates
    still count): the caller accounts for them by position (`WindowParts.peak`'s table).
    """
    p = ctx.p
    n = ctx.n
    n_fw = b0 - a0
    in_region: dict[int, RegionInfo] = {}
    by_trigger: dict[int, RegionInfo] = {}
    for r in regions:
        for i in range(r.a, r.b):
            in_region[i] = r
        if r.packs:
            by_trigger[r.trigger] = r
    const: list[int] = [ctx.alloc[i] + p.fwd_temp_bytes[i] for i in range(a0, b0)]
    gidx: list[int] = [2 * n + k for k in range(n_fw)]
    bwd_slot = [0] * n_fw
    rerun_slot: dict[int, int] = {}  # node -> slot of its rerun step (one region per node)
    for j in range(b0 - 1, a0 - 1, -1):
        r = by_trigger.get(j)
        if r is not None:
            for off, i in enumerate(r.steps()):
                rerun_slot[i] = len(const)
                const.append(r.step_const[off])
                gidx.append(j - a0)
        bwd_slot[j - a0] = len(const)
        const.append(p.bwd_temp_bytes[j])
        gidx.append(n + j - a0)
    diff = np.zeros(len(const) + 1, dtype=np.int64)
    starts: list[int] = []
    ends: list[int] = []
    sizes: list[int] = []

    def add(nbytes: int, start: int, end: int) -> None:
        if end >= start and nbytes:
            starts.append(start)
            ends.append(end + 1)
            sizes.append(nbytes)

    loss = ctx.loss | skip
    local = [s for i in range(a0, b0) for s in p.outputs[i] if s not in loss]
    local += [s for s in sorted({s for i in range(a0, b0) for s in p.inputs[i]
                                 if p.storage_producer[s] < a0})
              if s not in external and s not in skip]
    frame_of: dict[int, list[RegionInfo]] = {}
    for r in regions:
        for s in r.inputs:
            frame_of.setdefault(s, []).append(r)
    kept_region: dict[int, RegionInfo] = {s: r for r in regions for s in r.kept_ends
                                          if s not in skip}
    residue = 0
    held_out: set[int] = set()
    last_read, savers_of, producer = ctx.last_read, ctx.savers, p.storage_producer
    for s in local:
        prod = producer[s]
        start = prod - a0 + 1 if prod >= a0 else 0
        end = -1
        through = False  # held through the end of the forward
        lr = last_read[s]
        if lr >= b0:
            end = n_fw - 1
        elif lr > prod:
            end = lr - a0
        for k in savers_of[s]:
            if a0 <= k < b0 and k not in in_region:
                slot = bwd_slot[k - a0]
                if slot > end:
                    end = slot
                through = True
        for r in frame_of.get(s, ()):
            if r.death is None:
                end = max(end, r.b - 1 - a0)
            else:
                end = max(end, bwd_slot[r.death - a0])
                through = True
        r = kept_region.get(s)
        if r is not None:
            k_node, read_end, savers = r.kept_ends[s]
            if r.death is None:
                end = max(end, r.b - 1 - a0)
            elif k_node < 0:
                end = max(end, bwd_slot[r.death - a0])
                through = True
            else:
                end = max(end, rerun_slot[k_node])
                if read_end >= 0:
                    end = max(end, rerun_slot[read_end])
                for k in savers:
                    end = max(end, bwd_slot[k - a0])
                through = True
        add(p.storage_bytes[s], start, end)
        if through:
            residue += p.storage_bytes[s]
            if lr >= b0:
                held_out.add(s)
    for r in regions:
        for inst in r.regen:
            end = -1
            if inst.read_end >= 0:
                end = rerun_slot[inst.read_end]
            for k in inst.savers:
                end = max(end, bwd_slot[k - a0])
            add(p.storage_bytes[inst.storage], rerun_slot[inst.step] + 1, end)
    if sizes:
        sz = np.asarray(sizes, dtype=np.int64)
        np.add.at(diff, np.asarray(starts, dtype=np.int64), sz)
        np.add.at(diff, np.asarray(ends, dtype=np.int64), -sz)
    live = np.cumsum(diff[:-1])
    time_ms = float(sum(r.time_ms for r in regions))
    return WindowParts(np.asarray(const, dtype=np.int64) + live,
                       np.asarray(gidx, dtype=np.int64), residue, frozenset(held_out), time_ms)


def profile(ctx: Context, a0: int, b0: int, regions: Sequence[RegionInfo],
            external: frozenset[int] = frozenset()) -> SegmentProfile:
    """Exact local memory of the events of nodes `[a0, b0)` under top-level `regions`.

    `regions` lie inside the window and do not overlap; the other nodes of the window are
    STORE. Constants (gradients, loss, temporaries) are global; static bytes are not added.
    """
    parts = profile_parts(ctx, a0, b0, regions, external)
    return SegmentProfile(parts.peak(ctx, a0), parts.residue_bytes, parts.held_out,
                          parts.time_ms)


def evaluate(problem: Problem, schedule: Schedule, ctx: Context | None = None) -> tuple[int, float]:
    """Peak bytes and recompute time of a non-nested schedule, without replaying it."""
    ctx = ctx or Context(problem)
    regions = [ctx.region(r.start, r.stop, r.keep) for r in _top_regions(schedule)]
    prof = profile(ctx, 0, problem.n_nodes, regions)
    return problem.static_bytes + prof.peak_bytes, prof.time_ms
