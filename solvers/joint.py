"""Keep, recompute or offload, chosen jointly under one device budget and one host budget.

Space: the saved activations of some calls of the offload chain (`offload_chain`: the
outermost calls before the model's repeated blocks, then the blocks) go to host memory: the
first c of every m-th call (m in `STRIDES`: spread out, each copy to the host can end before
the next starts), each prefetched at the output of the chain's call d places later (past its
end, the model's output; d in `DISTANCES`, 0: fetched when first needed) and released (its
copies out waited for, their device side let go) at the end of its own call (compute waits
for its last copies), of the chain's next call (they run beside it), or of the first call
that ends after they would have ended unhindered (`landed_releases`; past the chain's end,
the model's): `RELEASES`. Each of those
calls runs stored, every activation it saves moved, or checkpointed, keeping the outputs that
cost the most time per byte to recompute (`offload_keeps`), which move with the checkpoint's
inputs ("offloaded keeps": a fraction of the bytes for most of the time): the first share s
of the set stored, the rest checkpointed (s in `STORED_SHARES`; the earliest calls have the
longest forward to copy in). A stored one may also recompute its pieces
(`offload_pieces`: the regions inside it, module calls or op ranges, that free the most
bytes per ms of rerun, `solvers.dp.inner`), so it moves only what is dear to recompute.
Or each call of the set runs as a split checkpoint (`split_checkpoint`, `SPLITS`): it
reruns its cheap leaves (a dropout, a GELU) and holds every other output its backward
needs, moving the dear ones and keeping the rest on the device, or moving all, its rerun
skipping what those make unneeded (F9): the copies move a fraction of the call's bytes,
so more calls fit the link's time.
Every other decision is the base solver's (the DP by default: keep or recompute per
activation over module calls), planned on `ideal(calls)`, the problem where those calls hold
nothing for the backward but what split checkpoints keep on the device (re-planned for less
when the real copies run over the budget). Split checkpoints are tried where copies run
beside compute (`_beside_compute`).
The objective is what the schedule adds to the step: recompute time plus the time compute
waits for copies.

Bound (`Solution.bound_ms`): for each offload set and mode, the larger of the base solver's
bound on `ideal` (real offload holds at least as much at every event and never runs faster),
plus the reruns of checkpointed calls, and the copies' floor (`copy_back_floor`: the copies
back start no earlier than the backward of the model's output, and the first call waits for
all of them). The least over every set and mode bounds every schedule of the space, with any
prefetch point. A set whose every mode's reruns or floor alone reach the best found is
bounded by the least of these (neither solved nor replayed: none of its schedules can be
kept); sets past one whose floor is above the best found are bounded by that floor (it
grows with c). When the time limit cuts the search short, no bound is claimed.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import NamedTuple

from solvers.accounting import Context
from solvers.dp import search as dp
from solvers.dp.inner import inner_front
from solvers.frame import worth_checkpointing
from solvers.offload import offload_groups
from solvers.problem import Problem
from solvers.result import Solution, Status
from solvers.schedule import RECOMPUTE, STORE, Offload, Region, Schedule
from solvers.simulate import simulate
from solvers.spaces import SearchSpace

logger = logging.getLogger(__name__)

__all__ = ["DISTANCES", "RELEASES", "SPLITS", "STORED_SHARES", "checkpointed",
           "copy_back_floor", "ideal", "landed_releases", "layout", "moved_bytes",
           "offload_chain", "offload_keeps", "offload_pieces", "offloads", "solve",
           "split_checkpoint"]

DISTANCES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
RELEASES = ("own", "next", "landed")
STORED_SHARES = (1.0, 0.0)  # of an offload set, run stored (module doc)
SPLITS = (False, True)  # split checkpoints moving only their dear outputs, or all they hold
STRIDES = (1, 4, 2, 3, 6)  # in the order searched (good answers early under a time limit)
PIECE_RATIO = 2.0  # `offload_pieces`' heavier level: its bytes per ms over the call's
SHORT_OF_ALL = 3  # `_probes`: sets of all the chain but its last 1..3 calls, tried early
RETRIES = 3  # re-plans of one k at a lower budget when the real offload runs over it
# of the time limit, kept for what runs after the search's last look at the clock (a base
# solve's 0.05 s floor, distances scored until one fits, the answer): without it a busy
# search ran 0.3 s past a 20 s limit (swin_t, bf16, benchmarks/conformance.py --offload)
PAST_THE_LAST_CHECK = 0.05

Base = Callable[[Problem, int, float], Solution]


def offload_chain(problem: Problem) -> list[tuple[int, int]]:
    """The calls that may be offloaded, in forward order: the outermost module calls (the
    root's children, their children where no single call spans them) before the first
    repeated block, then the blocks."""
    blocks = [b for b in problem.blocks() if problem.is_call(*b)]
    first = blocks[0][0] if blocks else problem.n_nodes
    spans = sorted(((s.start, s.stop) for s in problem.module_spans or ()
                    if s.name and s.kind == "call" and s.stop <= first),
                   key=lambda ab: (ab[0], -ab[1]))
    lead: list[tuple[int, int]] = []
    for a, b in spans:
        if not lead or a >= lead[-1][1]:
            lead.append((a, b))
    return lead + blocks


def _root(problem: Problem) -> tuple[int, int] | None:
    roots = [(s.start, s.stop) for s in problem.module_spans or () if s.name == ""]
    return max(roots, key=lambda ab: ab[1]) if roots else None


def offloads(problem: Problem, calls: list[tuple[int, int]], chain: list[tuple[int, int]],
             distance: int, lag: int = 0) -> list[Offload]:
    """`calls` (of `chain`), each prefetched at the output of the chain's call `distance`
    places later and released at the end of the one `lag` places later (past the chain's
    end, the model's; 0: when first needed, at its own end)."""
    root, position = _root(problem), {call: k for k, call in enumerate(chain)}

    def later(k: int, by: int) -> tuple[int, int] | None:
        return None if by == 0 else chain[k + by] if k + by < len(chain) else root

    return [Offload(start=a, stop=b, prefetch=later(k := position[(a, b)], distance),
                    release=later(k, lag)) for a, b in calls]


def landed_releases(problem: Problem, schedule: Schedule, chain: list[tuple[int, int]]
                    ) -> Schedule:
    """`schedule` with each offload released at the end of the first call of `chain` (or
    of the model) that ends once its copies out have ended, were nothing to wait: the copies
    run beside the forward as long as they need, in issue order on one queue (forward
    times only; checkpoints' host time left out)."""
    link = problem.host_link
    if link is None or link.synchronous or not schedule.offloads:
        return schedule
    ends = list(itertools.accumulate(problem.fwd_time_ms))
    root = _root(problem)
    calls = sorted(chain + ([root] if root else []), key=lambda c: c[1])
    free, out = 0.0, []
    for o, g in zip(schedule.offloads, offload_groups(problem, schedule), strict=True):
        for s, i in sorted(g.moved.items(), key=lambda si: si[1]):
            issued = ends[i] - (problem.fwd_time_ms[i] if s in g.at_entry else 0.0)
            free = max(issued, free) + link.copy_ms(problem.storage_bytes[s], True)
        after = [c for c in calls if c[1] >= o.stop]
        release = next((c for c in after if ends[c[1] - 1] >= free), after[-1] if after else None)
        out.append(o.model_copy(update={
            "release": None if release in (None, (o.start, o.stop)) else release}))
    return Schedule(regions=schedule.regions, offloads=tuple(out))


def ideal(problem: Problem, calls: list[tuple[int, int]],
          held: Collection[int] = frozenset()) -> Problem:
    """`problem` with `calls` stored and holding nothing for the backward but the outputs
    of `held` (kept on the device by split checkpoints): what offloading them would be
    with copies that take no time."""
    inside = {i for a, b in calls for i in range(a, b)}
    if not inside:
        return problem
    kept = {s for k in held for s in problem.outputs[k]}
    return problem.model_copy(update={
        "node_saved": [[s for s in saved if s in kept] if i in inside else list(saved)
                       for i, saved in enumerate(problem.node_saved)],
        "recomputable": [r and i not in inside for i, r in enumerate(problem.recomputable)]})


def offload_keeps(problem: Problem, call: tuple[int, int]) -> frozenset[int] | None:
    """What `call` keeps when checkpointed with its keeps offloaded: the outputs whose
    forward time per byte is at least the call's own (forward time over bytes saved), the
    matmuls of a transformer block; None where the call cannot be a checkpoint."""
    a, b = call
    if not problem.emittable(a, b) or not worth_checkpointing(problem, a, b):
        return None
    saved = {s for i in range(a, b) for s in problem.saved[i]}
    per_byte = sum(problem.fwd_time_ms[a:b]) / max(1, sum(problem.storage_bytes[s]
                                                          for s in saved))
    keep = set()
    for i in range(a, b):
        nbytes = problem.output_bytes(i)
        if nbytes and problem.can_keep(i) and problem.fwd_time_ms[i] >= per_byte * nbytes:
            keep.add(i)
    return frozenset(keep)


def checkpointed(schedule: Schedule, regions: Iterable[Region],
                 move_keeps: bool | Collection[int] = True) -> Schedule:
    """`schedule` with each of `regions` (RECOMPUTE, disjoint) that lies in a stored stretch
    put there (one inside a recompute region is left out), those inside an offloaded call
    moving what they keep (``move_keeps``, `Schedule.with_offloads`)."""
    merged: list[Region] = []
    for r in schedule.regions:  # stored stretches merged: a call may straddle two
        if merged and merged[-1].mode == STORE and r.mode == STORE:
            merged[-1] = Region(merged[-1].start, r.stop, STORE)
        else:
            merged.append(r)
    wanted = sorted(regions, key=lambda q: q.start)
    out: list[Region] = []
    for r in merged:
        inside = [q for q in wanted if r.mode == STORE and r.start <= q.start
                  and q.stop <= r.stop]
        pos = r.start
        for q in inside:
            if pos < q.start:
                out.append(Region(pos, q.start, STORE))
            out.append(q)
            pos = q.stop
        if not inside:
            out.append(r)
        elif pos < r.stop:
            out.append(Region(pos, r.stop, STORE))
    return Schedule(regions=tuple(out), offloads=schedule.offloads).with_offloads(
        schedule.offloads, move_keeps=move_keeps)


def offload_pieces(problem: Problem, calls: Iterable[tuple[int, int]], keeps: bool = True
                   ) -> list[dict[tuple[int, int], tuple[Region, ...]]]:
    """Two levels of regions inside each call to recompute while the rest of it is offloaded
    (`solvers.dp.inner`: an attention's dropout and the matmul reading it, say): the set that
    frees the most bytes per ms of rerun, and the one freeing the most bytes at no less than
    `PIECE_RATIO` times the call's own bytes per ms (it moves less and reruns more). Calls
    with no such regions are left out. `keeps=False`: regions that keep nothing."""
    ctx = Context(problem)
    light: dict[tuple[int, int], tuple[Region, ...]] = {}
    heavy: dict[tuple[int, int], tuple[Region, ...]] = {}
    for a, b in calls:
        front = inner_front(ctx, a, b, keeps=keeps)
        if not front:
            continue
        saved = sum(problem.storage_bytes[s] for s in {s for i in range(a, b)
                                                       for s in problem.saved[i]})
        dense = PIECE_RATIO * saved / max(sum(problem.fwd_time_ms[a:b]), 1e-9)
        best = max(front, key=lambda pt: pt[0] / max(pt[1], 1e-9))
        most = max((pt for pt in front if pt[0] >= dense * pt[1]), key=lambda pt: pt[0],
                   default=best)
        light[(a, b)], heavy[(a, b)] = (tuple(Region(r.a, r.b, RECOMPUTE, keep=r.keep)
                                              for r in pt[2]) for pt in (best, most))
    return [light, heavy] if heavy != light else [light]


def split_checkpoint(problem: Problem, call: tuple[int, int], moves_all: bool
                     ) -> tuple[Region, frozenset[int]] | None:
    """`call` as one checkpoint that reruns its leaves (needed outputs not dear per byte whose
    inputs it holds: an attention's dropout, a GELU, a layer norm, a copy) and holds every
    other output its backward needs, and what it moves: the dear outputs
    (`offload_keeps`), while the rest stay on the device (per-tensor offload: the bytes
    cheap to hold but dear to rerun, a softmax after its scores, are not copied), or with
    ``moves_all`` all it holds. The rerun skips what nothing it runs needs (F9). None where
    the call cannot be a checkpoint."""
    dear = offload_keeps(problem, call)
    if dear is None:
        return None
    a, b = call
    needed = {s for i in range(a, b) for s in problem.saved[i]}
    held, rerun = set(dear), set()
    for i in range(a, b):
        if i in dear or not problem.can_keep(i) or needed.isdisjoint(problem.outputs[i]):
            continue
        made = {m for s in problem.inputs[i] if a <= (m := problem.storage_producer[s]) < b}
        (rerun if made <= held else held).add(i)
    read = {s for i in rerun for s in problem.inputs[i]}
    moved = frozenset(i for i in dear if not (needed | read).isdisjoint(problem.outputs[i]))
    keep = (held - dear) | moved
    return Region(a, b, RECOMPUTE, keep=keep), keep if moves_all else moved


def layout(problem: Problem, calls: list[tuple[int, int]], stored: float = 1.0,
           pieces: Mapping[tuple[int, int], tuple[Region, ...]] | None = None,
           split: bool | None = None) -> Schedule:
    """`calls` offloaded (fetched when needed), the first share `stored` of them stored
    (recomputing their `pieces`, where given), or each a `split_checkpoint` (``split``:
    moving all it holds or not; stored where it cannot be one), and the rest checkpointed
    keeping `offload_keeps` (where they can be), every keep moved but a split checkpoint's;
    nothing else planned."""
    schedule = Schedule.store_all(problem.n_nodes).with_offloads(calls)
    cut = round(stored * len(calls))
    if split is None:
        regions = [q for c in calls[:cut] for q in (pieces or {}).get(c, ())]
        moving: set[int] = {k for q in regions for k in q.keep}
    else:
        splits = [x for c in calls[:cut] if (x := split_checkpoint(problem, c, split))]
        regions = [region for region, _ in splits]
        moving = {k for _, moved in splits for k in moved}
    for c in calls[cut:]:
        if (keep := offload_keeps(problem, c)) is not None:
            regions.append(Region(*c, RECOMPUTE, keep=keep))
            moving |= keep
    return checkpointed(schedule, regions, moving) if regions else schedule


def copy_back_floor(problem: Problem, schedule: Schedule) -> float:
    """A floor under recompute plus stall time of `schedule`'s offloads (module doc)."""
    if not schedule.offloads:
        return 0.0
    groups = [g for g in offload_groups(problem, schedule) if g.moved]
    link = problem.host_link
    if not groups or link is None or link.synchronous:  # every copy, both ways, stalls
        return sum(link.copy_ms(g.nbytes(problem), False) + link.copy_ms(g.nbytes(problem), True)
                   for g in groups) if link else 0.0
    root = _root(problem)
    start = (root[1] - 1) if root else problem.n_nodes - 1
    last = min(g.need for g in groups)
    between = sum(problem.bwd_time_ms[last + 1:start + 1])
    copies = sum(problem.host_link.copy_ms(g.nbytes(problem), False) for g in groups)
    return max(0.0, copies - between)


def moved_bytes(problem: Problem, calls: list[tuple[int, int]], stored: float = 1.0) -> int:
    """Bytes `calls` move each way, the first share `stored` of them stored (`layout`)."""
    return sum(g.nbytes(problem) for g in offload_groups(problem, layout(problem, calls, stored)))


def solve(problem: Problem, budget_bytes: int, time_limit_s: float = 60.0, *,
          host_budget_bytes: float = math.inf, base: Base = dp.solve,
          keeps_offloaded: bool = True, deterministic: bool = False,
          on_set: Callable[[int, int], None] | None = None) -> Solution:
    """The fastest schedule of the space (module doc) within both budgets
    (`host_budget_bytes`: host memory the offloaded activations may take; unlimited by
    default);
    `keeps_offloaded=False` where torch cannot move what a checkpoint keeps (SAC's cache)
    through saved-tensor hooks: offloaded calls are then stored, and their pieces keep
    nothing. ``deterministic``: the whole search, each base solve run to its end (the
    same answer on a loaded machine as on a quiet one; it may take long). ``on_set``:
    called after each offload set is weighed with how many have been and how many at most
    will be (a progress bar's)."""
    t0 = time.perf_counter()
    deadline = math.inf if deterministic else t0 + time_limit_s * (1 - PAST_THE_LAST_CHECK)
    chain = [call for call in offload_chain(problem) if moved_bytes(problem, [call])
             ] if problem.host_link is not None else []  # calls that move something
    shapes = _Shapes(STORED_SHARES if keeps_offloaded else (1.0,),
                     offload_pieces(problem, chain, keeps=keeps_offloaded),
                     SPLITS if keeps_offloaded and _beside_compute(problem) else ())
    probes = _probes(problem, chain, shapes)
    search = _Search(problem, budget_bytes, chain, deadline, base, on_set,
                     1 + len(probes) + sum(len(chain[::stride]) for stride in STRIDES))
    complete = search.run([], [])
    for count in probes:  # likely good sets first (time limits)
        search.run(chain[:count], _layouts(problem, chain[:count], shapes, host_budget_bytes))
    for stride in STRIDES if chain else ():
        picks = chain[::stride]
        for count in range(1, len(picks) + 1):
            calls = picks[:count]
            layouts = _layouts(problem, calls, shapes, host_budget_bytes)
            if not layouts:
                break
            complete = search.run(calls, layouts)
            if not complete or search.pruned:
                break
        if not complete:
            break
    found = _answer(problem, budget_bytes, search.best, search.bounds if complete else None,
                    chain, shapes, t0)
    return found if complete else found.timed_out()


def _beside_compute(problem: Problem) -> bool:
    """Whether copies run beside compute (a GPU's link): where split checkpoints are tried.
    They win there by moving fewer bytes in the link's time (a 4-layer GPT-2 at H100
    estimates: 25 % less added time at 60 % of its activations). Over a synchronous link (a
    CPU), where every copy stalls compute, they are not tried: no win there was measured,
    and their base solve per set left two bf16 searches of the offload conformance
    unproven at 20 s."""
    return problem.host_link is not None and not problem.host_link.synchronous


class _Search:
    """The best schedule so far and the bound of every offload set tried."""

    def __init__(self, problem: Problem, budget: int, chain: list[tuple[int, int]],
                 deadline: float, base: Base, on_set: Callable[[int, int], None] | None,
                 at_most: int) -> None:
        self.problem, self.budget, self.chain = problem, budget, chain
        self.deadline, self.base = deadline, base
        self.on_set, self.at_most = on_set, at_most  # told after each set: tried, at most
        self.best: Solution | None = None
        self.bounds: list[float] = []
        self.pruned = False
        self.tried: set[tuple[tuple[int, int], ...]] = set()

    def run(self, calls: list[tuple[int, int]], layouts: list[Schedule]) -> bool:
        """Try one offload set (once) in each of its `layouts`; False when the time is up.
        A set with no layout (none fits the host budget) is not tried."""
        self.pruned = False
        if tuple(calls) in self.tried or (calls and not layouts):
            return True
        if calls and time.perf_counter() > self.deadline:
            return False
        self.tried.add(tuple(calls))
        try:
            return self._weigh(calls, layouts)
        finally:
            if self.on_set is not None:
                self.on_set(len(self.tried), self.at_most)

    def _weigh(self, calls: list[tuple[int, int]], layouts: list[Schedule]) -> bool:
        """`run` of a set not tried before: its bound, and its best schedule if it can win."""
        floors = [copy_back_floor(self.problem, sch) for sch in layouts]
        reruns = [simulate(self.problem, sch.with_offloads(())).recompute_time_ms
                  for sch in layouts]
        # each layout adds at least its own reruns, and its copies' floor
        least = min((max(rerun, floor) for rerun, floor in zip(reruns, floors, strict=True)),
                    default=0.0)
        self.pruned = self.best is not None and min(floors, default=0.0) >= self.best.objective_ms
        if self.best is not None and least >= self.best.objective_ms:
            # this set cannot do better (nor, `pruned`, the larger ones of its stride, whose
            # copies only grow): no base solve, no replay
            self.bounds.append(least)
            return True
        beat = self.best.objective_ms if self.best is not None else math.inf
        found, bound = _best_for(self.problem, self.budget, calls, self.chain, self.deadline,
                                 self.base, layouts, beat)
        self.bounds.append(min((max(bound + rerun, floor) for rerun, floor
                                in zip(reruns, floors, strict=True)), default=bound))
        if found is not None and (self.best is None
                                  or found.objective_ms < self.best.objective_ms):
            self.best = found
        return time.perf_counter() <= self.deadline


class _Shapes(NamedTuple):
    """How offloaded calls may run: the shares of them stored (`layout`), per call the
    levels of pieces a stored one may recompute (`offload_pieces`), and the levels of split
    checkpoints (`split_checkpoint`) they may run as."""

    shares: tuple[float, ...]
    pieces: list[dict[tuple[int, int], tuple[Region, ...]]]
    splits: tuple[bool, ...] = ()


def _probes(problem: Problem, chain: list[tuple[int, int]], shapes: _Shapes) -> list[int]:
    """Counts of the chain's first calls tried before the full search (cheap to plan, and
    good at tight budgets and loose ones): the whole chain and the `SHORT_OF_ALL` sets just
    short of it (checkpoints or heavy pieces move little; the last calls, backward first,
    left to the base solver to use the room that leaves), and per level of pieces the most
    stored calls whose copies fit in the forward's time, and one more."""
    link = problem.host_link
    if not chain or link is None or link.synchronous:
        return []
    forward_ms = sum(problem.fwd_time_ms)
    counts = [len(chain) - k for k in range(SHORT_OF_ALL + 1)]
    for pieces in shapes.pieces:
        fits = 0
        for count in range(1, len(chain) + 1):
            moved = sum(g.nbytes(problem) for g in offload_groups(
                problem, layout(problem, chain[:count], 1.0, pieces)))
            if link.copy_ms(moved, True) > forward_ms:
                break
            fits = count
        counts += [fits, fits + 1]
    return list(dict.fromkeys(c for c in counts if 0 < c <= len(chain)))


def _layouts(problem: Problem, calls: list[tuple[int, int]], shapes: _Shapes,
             host_budget_bytes: float) -> list[Schedule]:
    """The distinct layouts of `calls` (`layout`: each share, stored ones with and without
    their pieces, and each level of split checkpoints) within the host budget."""
    shapes_of = [(share, pieces, None) for share in shapes.shares
                 for pieces in ((None, *shapes.pieces) if share else (None,))]
    out: list[Schedule] = []
    for share, pieces, split in shapes_of + [(1.0, None, split) for split in shapes.splits]:
        schedule = layout(problem, calls, share, pieces, split)
        moved = sum(g.nbytes(problem) for g in offload_groups(problem, schedule))
        if schedule not in out and 0 < moved <= host_budget_bytes:
            out.append(schedule)
    return out


def _best_for(problem: Problem, budget: int, calls: list[tuple[int, int]],
              chain: list[tuple[int, int]], deadline: float, base: Base,
              layouts: list[Schedule], beat: float = math.inf
              ) -> tuple[Solution | None, float]:
    """The best schedule offloading `calls` (any distance, as any of `layouts` runs them)
    and the bound of `ideal`. The rest is planned on `ideal` of what each layout holds on
    the device (`_on_device`: what its split checkpoints keep there), and the layouts whose
    real copies run over the budget at every distance share a re-plan of the rest for less
    (by the least of their overruns), up to `RETRIES` times. `beat`: the added time of the
    best schedule of other sets (what is not below it is not kept)."""
    plain = base(ideal(problem, calls), budget, max(0.05, deadline - time.perf_counter()))
    bound = (plain.bound_ms or 0.0) if plain.feasible else math.inf
    by_held: dict[frozenset[int], list[list[Region]]] = {}
    for shape in layouts or [Schedule.store_all(problem.n_nodes)]:
        by_held.setdefault(_on_device(shape), []).append(
            [r for r in shape.regions if r.is_recompute])
    best = None
    for held, pending in by_held.items():
        planned = ideal(problem, calls, held)
        sol = plain if not held else base(planned, budget,
                                          max(0.05, deadline - time.perf_counter()))
        found = _replanned(problem, budget, calls, chain, deadline, base, planned, sol,
                           pending, beat if best is None else min(beat, best.objective_ms))
        if found is not None and (best is None or found.objective_ms < best.objective_ms):
            best = found
        if best is not None and time.perf_counter() > deadline:
            break
    return best, bound


def _on_device(schedule: Schedule) -> frozenset[int]:
    """The nodes whose outputs `schedule`'s checkpoints keep on the device inside its
    offloaded calls (a split checkpoint's)."""
    return frozenset(k for r in schedule.regions for k in r.keep - r.offloaded()
                     if any(o.start <= k < o.stop for o in schedule.offloads))


def _replanned(problem: Problem, budget: int, calls: list[tuple[int, int]],
               chain: list[tuple[int, int]], deadline: float, base: Base, planned: Problem,
               sol: Solution, pending: list[list[Region]], beat: float) -> Solution | None:
    """The best of `pending` (layouts' regions) over base plan `sol` of `planned`, each
    distance scored (`_score`), re-planning `planned` for less while all run over."""
    best, target = None, budget
    for attempt in range(RETRIES + 1):
        if not sol.feasible or sol.schedule is None:
            break
        over_by: list[tuple[list[Region], int]] = []
        for regions in pending:
            if best is not None and time.perf_counter() > deadline:
                return best
            found, over = _score(problem, budget, calls, chain, sol, regions, deadline,
                                 beat if best is None else min(beat, best.objective_ms))
            if found is not None and (best is None or found.objective_ms < best.objective_ms):
                best = found
            if found is None and over < math.inf:
                over_by.append((regions, over))
        pending = [regions for regions, _ in over_by]
        if not pending or attempt == RETRIES or time.perf_counter() > deadline:
            break
        target -= min(over for _, over in over_by)  # plan the rest for less
        sol = base(planned, target, max(0.05, deadline - time.perf_counter()))
    return best


def _candidates(problem: Problem, calls: list[tuple[int, int]], chain: list[tuple[int, int]],
                sol: Solution, planned: list[Region]) -> Iterator[Schedule]:
    """The base plan `sol` with `calls` offloaded (the layout's `planned` regions in them:
    checkpoints of whole calls, or their pieces), at each distance and release lag, each
    distinct schedule once, in the order `_score` replays them."""
    distances = sorted({min(d, len(chain)) for d in DISTANCES}) if calls else [0]
    # over a synchronous link a copy frees the device at once: where it is released is moot
    link = problem.host_link
    releases = RELEASES if calls and link is not None and not link.synchronous else ["own"]
    seen: set[Schedule] = set()
    for distance, release in itertools.product(distances, releases):
        schedule = Schedule(regions=sol.schedule.regions).with_offloads(
            offloads(problem, calls, chain, distance, int(release == "next")))
        if planned:  # as the layout decided what its checkpoints move
            schedule = checkpointed(schedule, planned, move_keeps=False)
        if release == "landed":
            schedule = landed_releases(problem, schedule, chain)
        if schedule not in seen:  # not a distance past the chain's end, or releases that agree
            seen.add(schedule)
            yield schedule


def _score(problem: Problem, budget: int, calls: list[tuple[int, int]],
           chain: list[tuple[int, int]], sol: Solution,
           planned: list[Region], deadline: float, beat: float = math.inf
           ) -> tuple[Solution | None, int]:
    """The best of `_candidates` (distance and release lag), and by how little the others
    ran over the budget; past the deadline, those scored so far.

    Every candidate reruns the same regions (copies add stalls, never rerun time), so each
    adds that rerun time plus a stall of at least 0: once one fits without a stall, or fits
    where the rerun alone reaches `beat` (the best of the other layouts and sets), no later
    one can be kept (a tie keeps the first), and the rest are not replayed."""
    best, over = None, math.inf
    for schedule in _candidates(problem, calls, chain, sol, planned):
        if best is not None and time.perf_counter() > deadline:
            break
        timeline = simulate(problem, schedule)
        scored = Solution.scored(problem, schedule, budget, solver=f"joint+{sol.solver}",
                                 started_s=0.0, timeline=timeline)
        if not scored.feasible:
            over = min(over, scored.peak_bytes - budget)
        elif best is None or scored.objective_ms < best.objective_ms:
            best = scored
        if best is not None and min(best.objective_ms, beat) <= timeline.recompute_time_ms:
            break  # none left can be kept
    return best, over


def _answer(problem: Problem, budget: int, best: Solution | None, bounds: list[float] | None,
            chain: list[tuple[int, int]], shapes: _Shapes, t0: float
            ) -> Solution:
    space = SearchSpace(
        text=(f"offload the saved activations of the first c of every m-th of {len(chain)} "
              f"module calls (m in {list(STRIDES)}; the outermost calls before the repeated "
              "blocks, then the blocks), prefetched d calls ahead (d in "
              f"{list(DISTANCES)}; 0: when needed), released at the end of its own call, "
              "the next, or the first after its copies end, the first share s of them stored (with "
              "or without the pieces inside each that free the most bytes per ms of rerun "
              "recomputed) and the rest checkpointed with their costliest outputs per byte "
              f"kept and offloaded (s in {list(shapes.shares)})"
              + (", or each call one checkpoint rerunning its cheap leaves and holding every "
                 "other output its backward needs, the costliest per byte offloaded and the "
                 "rest on the device, or all offloaded" if shapes.splits else "")
              + "; the rest: the DP's space "
              "(keep or recompute per activation over module calls, and regions inside a "
              "layer: module calls or op ranges)"),
        cuts="solver", keep="stage-any")
    if best is None:
        return Solution(solver="joint", status=Status.INFEASIBLE, schedule=None,
                        budget_bytes=budget, objective_ms=None,
                        solve_time_s=time.perf_counter() - t0, space=space)
    bound = min(bounds) if bounds else None
    proven = bound is not None and best.objective_ms <= bound + 1e-9
    gap = None if bound is None else (
        0.0 if best.objective_ms <= 0 else max(0.0, (best.objective_ms - bound)
                                               / best.objective_ms))
    logger.info("joint: %d offloaded calls, %.1f ms added (bound %s)", len(best.schedule.offloads),
                best.objective_ms, bound)
    return best.model_copy(update={
        "status": Status.OPTIMAL if proven else Status.FEASIBLE, "bound_ms": bound, "gap": gap,
        "solve_time_s": time.perf_counter() - t0, "space": space})
