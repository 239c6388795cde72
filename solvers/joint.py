"""Keep, recompute or offload, chosen jointly under one device budget and one host budget.

Space: the saved activations of some calls of the offload chain (`offload_chain`: the
outermost calls before the model's repeated blocks, then the blocks) go to host memory: the
first c of every m-th call (m in `STRIDES`: spread out, each copy to the host can end before
the next starts), each prefetched at the output of the chain's call d places later (past its
end, the model's output; d in `DISTANCES`, 0: fetched when first needed). Each of those
calls runs stored, every activation it saves moved, or checkpointed, keeping the outputs that
cost the most time per byte to recompute (`offload_keeps`), which move with the checkpoint's
inputs ("offloaded keeps": a fraction of the bytes for most of the time): the first share s
of the set stored, the rest checkpointed (s in `STORED_SHARES`; the earliest calls have the
longest forward to copy in).
Every other decision is the base solver's (the DP by default: keep or recompute per
activation over module calls), planned on `ideal(calls)`, the problem where those calls hold
nothing for the backward (re-planned for less when the real copies run over the budget).
The objective is what the schedule adds to the step: recompute time plus the time compute
waits for copies.

Bound (`Solution.bound_ms`): for each offload set and mode, the larger of the base solver's
bound on `ideal` (real offload holds at least as much at every event and never runs faster),
plus the reruns of checkpointed calls, and the copies' floor (`copy_back_floor`: the copies
back start no earlier than the backward of the model's output, and the first call waits for
all of them). The least over every set and mode bounds every schedule of the space, with any
prefetch point; sets past one whose floor is above the best found are bounded by that floor
(it grows with c). When the time limit cuts the search short, no bound is claimed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from solvers import dp
from solvers.offload import offload_groups
from solvers.problem import Problem
from solvers.result import Solution, Status
from solvers.schedule import RECOMPUTE, STORE, Offload, Region, Schedule
from solvers.simulate import simulate
from solvers.spaces import SearchSpace

logger = logging.getLogger(__name__)

__all__ = ["DISTANCES", "STORED_SHARES", "checkpointed", "copy_back_floor", "ideal", "layout",
           "moved_bytes", "offload_chain", "offload_keeps", "offloads", "solve"]

DISTANCES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
STORED_SHARES = (1.0, 0.0)  # of an offload set, run stored (module doc)
STRIDES = (1, 4, 2, 3, 6)  # in the order searched (good answers early under a time limit)
RETRIES = 3  # re-plans of one k at a lower budget when the real offload runs over it

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
             distance: int) -> list[Offload]:
    """`calls` (of `chain`), each prefetched at the output of the chain's call `distance`
    places later (past the chain's end, the model's output; 0: when first needed)."""
    root, position = _root(problem), {call: k for k, call in enumerate(chain)}
    return [Offload(start=a, stop=b, prefetch=None if distance == 0 else
                    chain[k + distance] if (k := position[(a, b)]) + distance < len(chain)
                    else root) for a, b in calls]


def ideal(problem: Problem, calls: list[tuple[int, int]]) -> Problem:
    """`problem` with `calls` stored and holding nothing for the backward: what offloading
    them would be with copies that take no time."""
    inside = {i for a, b in calls for i in range(a, b)}
    if not inside:
        return problem
    return problem.model_copy(update={
        "node_saved": [[] if i in inside else list(s) for i, s in enumerate(problem.node_saved)],
        "recomputable": [r and i not in inside for i, r in enumerate(problem.recomputable)]})


def offload_keeps(problem: Problem, call: tuple[int, int]) -> frozenset[int] | None:
    """What `call` keeps when checkpointed with its keeps offloaded: the outputs whose
    forward time per byte is at least the call's own (forward time over bytes saved), the
    matmuls of a transformer block; None where the call cannot be a checkpoint."""
    a, b = call
    if not problem.emittable(a, b) or not all(problem.recomputable[a:b]):
        return None
    saved = {s for i in range(a, b) for s in problem.saved[i]}
    per_byte = sum(problem.fwd_time_ms[a:b]) / max(1, sum(problem.storage_bytes[s]
                                                          for s in saved))
    keep = set()
    for i in range(a, b):
        nbytes = sum(problem.storage_bytes[s] for s in problem.outputs[i])
        if nbytes and problem.can_keep(i) and problem.fwd_time_ms[i] >= per_byte * nbytes:
            keep.add(i)
    return frozenset(keep)


def checkpointed(schedule: Schedule, keeps: dict[tuple[int, int], frozenset[int]]) -> Schedule:
    """`schedule` with each call of `keeps` that lies in a stored stretch made a checkpoint
    keeping those nodes (a call inside a recompute region is left as it is)."""
    merged: list[Region] = []
    for r in schedule.regions:  # stored stretches merged: a call may straddle two
        if merged and merged[-1].mode == STORE and r.mode == STORE:
            merged[-1] = Region(merged[-1].start, r.stop, STORE)
        else:
            merged.append(r)
    out: list[Region] = []
    for r in merged:
        inside = sorted(c for c in keeps if r.mode == STORE and r.start <= c[0] and c[1] <= r.stop)
        pos = r.start
        for a, b in inside:
            if pos < a:
                out.append(Region(pos, a, STORE))
            out.append(Region(a, b, RECOMPUTE, keep=keeps[(a, b)]))
            pos = b
        if not inside:
            out.append(r)
        elif pos < r.stop:
            out.append(Region(pos, r.stop, STORE))
    return Schedule(regions=tuple(out), offloads=schedule.offloads)


def layout(problem: Problem, calls: list[tuple[int, int]], stored: float = 1.0) -> Schedule:
    """`calls` offloaded (fetched when needed), the first share `stored` of them stored and
    the rest checkpointed keeping `offload_keeps` (where they can be), nothing else planned."""
    schedule = Schedule.store_all(problem.n_nodes).with_offloads(calls)
    keeps = {c: k for c in calls[round(stored * len(calls)):]
             if (k := offload_keeps(problem, c)) is not None}
    return checkpointed(schedule, keeps) if keeps else schedule


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
          host_budget_bytes: int | None = None, base: Base = dp.solve,
          stored_shares: tuple[float, ...] = STORED_SHARES) -> Solution:
    """The fastest schedule of the space (module doc) within both budgets; `stored_shares`:
    (1.0,) where offloaded calls cannot be checkpointed (torch cannot move SAC's keeps)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    chain = [call for call in offload_chain(problem) if moved_bytes(problem, [call])
             ] if problem.host_link is not None else []  # calls that move something
    search = _Search(problem, budget_bytes, chain, deadline, base)
    complete = search.run([], [])
    for stride in STRIDES if chain else ():
        picks = chain[::stride]
        for count in range(1, len(picks) + 1):
            calls = picks[:count]
            layouts = _layouts(problem, calls, stored_shares, host_budget_bytes)
            if not layouts:
                break
            complete = search.run(calls, layouts)
            if not complete or search.pruned:
                break
        if not complete:
            break
    return _answer(problem, budget_bytes, search.best, search.bounds if complete else None,
                   chain, stored_shares, t0)


class _Search:
    """The best schedule so far and the bound of every offload set tried."""

    def __init__(self, problem: Problem, budget: int, chain: list[tuple[int, int]],
                 deadline: float, base: Base) -> None:
        self.problem, self.budget, self.chain = problem, budget, chain
        self.deadline, self.base = deadline, base
        self.best: Solution | None = None
        self.bounds: list[float] = []
        self.pruned = False
        self.tried: set[tuple[tuple[int, int], ...]] = set()

    def run(self, calls: list[tuple[int, int]], layouts: list[Schedule]) -> bool:
        """Try one offload set (once) in each of its `layouts`; False when the time is up."""
        self.pruned = False
        if tuple(calls) in self.tried:
            return True
        if calls and time.perf_counter() > self.deadline:
            return False
        self.tried.add(tuple(calls))
        floors = [copy_back_floor(self.problem, sch) for sch in layouts]
        reruns = [simulate(self.problem, Schedule(regions=sch.regions)).recompute_time_ms
                  for sch in layouts]
        floor = min(floors, default=0.0)
        self.pruned = self.best is not None and floor >= self.best.objective_ms
        if self.pruned:  # this set, and the larger ones of its stride, cannot do better
            self.bounds.append(floor)
            return True
        found, bound = _best_for(self.problem, self.budget, calls, self.chain, self.deadline,
                                 self.base, layouts)
        self.bounds.append(min((max(bound + rerun, floor) for rerun, floor
                                in zip(reruns, floors, strict=True)), default=bound))
        if found is not None and (self.best is None
                                  or found.objective_ms < self.best.objective_ms):
            self.best = found
        return time.perf_counter() <= self.deadline


def _layouts(problem: Problem, calls: list[tuple[int, int]], stored_shares: tuple[float, ...],
             host_budget_bytes: int | None) -> list[Schedule]:
    """The distinct layouts of `calls` (`layout`) within the host budget."""
    out: list[Schedule] = []
    for share in stored_shares:
        schedule = layout(problem, calls, share)
        moved = sum(g.nbytes(problem) for g in offload_groups(problem, schedule))
        if schedule not in out and 0 < moved and (host_budget_bytes is None
                                                  or moved <= host_budget_bytes):
            out.append(schedule)
    return out


def _best_for(problem: Problem, budget: int, calls: list[tuple[int, int]],
              chain: list[tuple[int, int]], deadline: float, base: Base,
              layouts: list[Schedule]) -> tuple[Solution | None, float]:
    """The best schedule offloading `calls` (any distance, as any of `layouts` runs them)
    and the bound of `ideal`. Each layout re-plans the rest for less when its real copies
    run over the budget at every distance (the first plan is shared)."""
    planned = ideal(problem, calls)
    plans: dict[int, Solution] = {}

    def plan_at(target: int) -> Solution:
        if target not in plans:
            plans[target] = base(planned, target, max(0.05, deadline - time.perf_counter()))
        return plans[target]

    first = plan_at(budget)
    bound = (first.bound_ms or 0.0) if first.feasible else math.inf
    best = None
    for shape in layouts or [Schedule.store_all(problem.n_nodes)]:
        if best is not None and time.perf_counter() > deadline:
            break
        keeps = {(r.start, r.stop): r.keep for r in shape.regions if r.is_recompute}
        target = budget
        for _ in range(RETRIES + 1):
            sol = plan_at(target)
            if not sol.feasible or sol.schedule is None:
                break
            found, over = _score(problem, budget, calls, chain, sol, keeps, deadline)
            if found is not None and (best is None or found.objective_ms < best.objective_ms):
                best = found
            if found is not None or time.perf_counter() > deadline:
                break
            target -= over  # every distance ran over: plan the rest for less
    return best, bound


def _score(problem: Problem, budget: int, calls: list[tuple[int, int]],
           chain: list[tuple[int, int]], sol: Solution,
           keeps: dict[tuple[int, int], frozenset[int]], deadline: float
           ) -> tuple[Solution | None, int]:
    """The best distance for the base plan `sol` with `calls` offloaded (checkpointed
    keeping `keeps`, where given), and by how little the others ran over the budget; past
    the deadline, the distances scored so far."""
    best, over = None, math.inf
    for distance in sorted({min(d, len(chain)) for d in DISTANCES}) if calls else [0]:
        if best is not None and time.perf_counter() > deadline:
            break
        schedule = Schedule(regions=sol.schedule.regions).with_offloads(
            offloads(problem, calls, chain, distance))
        if keeps:
            schedule = checkpointed(schedule, keeps)
        scored = Solution.scored(problem, schedule, budget, solver=f"joint+{sol.solver}",
                                 started_s=0.0)
        if not scored.feasible:
            over = min(over, scored.peak_bytes - budget)
        elif best is None or scored.objective_ms < best.objective_ms:
            best = scored
    return best, over


def _answer(problem: Problem, budget: int, best: Solution | None, bounds: list[float] | None,
            chain: list[tuple[int, int]], stored_shares: tuple[float, ...], t0: float
            ) -> Solution:
    space = SearchSpace(
        text=(f"offload the saved activations of the first c of every m-th of {len(chain)} "
              f"module calls (m in {list(STRIDES)}; the outermost calls before the repeated "
              "blocks, then the blocks), prefetched d calls ahead (d in "
              f"{list(DISTANCES)}; 0: when needed), the first share s of them stored and the "
              "rest checkpointed with their costliest outputs per byte kept and offloaded (s in "
              f"{list(stored_shares)}); the rest: the DP's space (keep or recompute per "
              "activation over module calls)"),
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
