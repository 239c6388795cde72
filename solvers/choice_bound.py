"""A lower bound on the time a schedule adds (reruns and copy stalls) over every per-tensor
choice: each saved activation kept, recomputed or offloaded, with no restriction to module
calls, nesting or whole-call offload (an LP relaxation, GLOP). What no schedule of any
planner can beat, so a benchmark can print the distance from an answer to the limit, and
say whether a target is reachable.

Variables per storage s not held by the caller that is saved or read by a recomputable
node: kept `x_s` (held past its last forward read: a STORE save, a checkpoint's input, a
selective keep), offloaded `o_s`; per recomputable node i: rerun `y_i`; the stall `w` (all
the time compute waits for copies). A saved storage is kept, offloaded or recomputed:
`x_s + o_s + y_producer(s) >= 1`; a node reruns only from inputs that are there:
`y_i <= x_in + o_in + y_producer(in)` for each of its inputs. The objective is the time a
schedule adds: the forward time of the nodes rerun, plus `w`. Constraints, each true of
every schedule `simulate` replays (so the LP is a relaxation):

- forward event t: what the forward itself needs (static, caller-held, the node's outputs
  and temporaries, storages read at t or later), plus the storages past their last read
  that are kept, plus those offloaded whose copy out cannot have ended: one device-to-host
  queue copies at most `d2h` bandwidth x (the forward's time so far + `w`);
- backward event j: static, gradients, loss, temporaries, every storage node j saved (it
  is back by then, regenerated or fetched), plus the kept storages an earlier node saves,
  plus the offloaded ones still copying out (the queue has had the forward, the backward's
  events before j, every rerun and `w`), plus those back from the host ahead of need;
- copies back: an offloaded storage a node saves is back by the start of that node's
  backward (the first of its savers the backward reaches); one host-to-device queue copies
  at most `h2d` bandwidth x that same time, and what came back before the backward began
  (no more than either queue moves in the forward and `w`) the device holds until needed;
- a synchronous link (a CPU: copies hold up compute): `w` is at least every copy out and
  every copy back of a storage a node saves;
- ``copies_end_in_forward`` (our runtime's rule: an offload is released, its copies out
  waited for, at the end of a call of the forward, `solvers.schedule.Offload.release`):
  every copy out ends before the backward begins, so the device-to-host queue moves all
  of them in the forward's time and `w`. Without it the bound covers runtimes that let
  copies out run on into the backward (torchtune's activation offloading frees a tensor
  whenever its copy has landed).

Regenerated copies, frames, the order of a storage's copy out and back and every overhead
are optimistic omissions: they only make real schedules cost more. Without `w` (before
2026-12-01) a schedule that waits for its copies to fit was outside the LP: at its peak
the bound said nothing fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from solvers.accounting import Context
from solvers.problem import HostLink, Problem

__all__ = ["ChoiceBound", "choice_bound"]

_MIB = float(2**20)  # the LP works in MiB: byte counts up to 1e11 upset its tolerances


@dataclass(frozen=True)
class ChoiceBound:
    """`added_ms`: no per-tensor choice fitting `budget_bytes` adds less time to the step,
    reruns and stalls on copies (None: none fits at all: the budget is below every
    schedule's peak); `recompute_ms` and `stall_ms` its two parts at the LP's optimum.
    `offload`: whether offloading was among the choices; `copies_end_in_forward`: whether
    the bound holds the copies out to the forward (the module docstring). The fractional
    split of the saved bytes at the optimum says where the bound comes from."""

    budget_bytes: int
    offload: bool
    added_ms: float | None
    copies_end_in_forward: bool = False
    recompute_ms: float = 0.0
    stall_ms: float = 0.0
    kept_bytes: float = 0.0
    offloaded_bytes: float = 0.0
    recomputed_bytes: float = 0.0

    @property
    def feasible(self) -> bool:
        return self.added_ms is not None


class _Terms:
    """The schedule-independent pieces of the LP's constraints."""

    def __init__(self, problem: Problem) -> None:
        ctx = Context(problem)
        p, n = problem, problem.n_nodes
        self.saved = [s for s in range(p.n_storages) if ctx.savers[s] and s not in ctx.loss]
        rerun_reads = {s for i in range(p.n_nodes) if p.recomputable[i] for s in p.inputs[i]}
        self.held = sorted((set(self.saved) | rerun_reads) - ctx.loss)  # those with x and o
        self.free_after = {s: max(p.storage_producer[s], ctx.last_read[s]) for s in self.held}
        self.first_saver = {s: ctx.savers[s][0] for s in self.saved}
        needed = np.zeros(n + 1, dtype=np.int64)  # read at t or later, made before t
        for s in range(p.n_storages):
            prod, last = p.storage_producer[s], ctx.last_read[s]
            if s not in ctx.loss and last > prod:
                needed[prod + 1] += p.storage_bytes[s]
                needed[last + 1] -= p.storage_bytes[s]
        needed = np.cumsum(needed)[:n]
        self.forward = [p.static_bytes + int(ctx.held_fwd[t]) + ctx.alloc[t]
                        + p.fwd_event_bytes[t] + int(needed[t]) for t in range(n)]
        self.backward = [p.static_bytes + ctx.g_event[j] + ctx.loss_bytes + p.bwd_temp_bytes[j]
                         + sum(p.storage_bytes[s] for s in p.saved[j] if s not in ctx.loss)
                         for j in range(n)]
        self.elapsed_ms = np.concatenate([[0.0], np.cumsum(p.fwd_time_ms)])[:n]
        # backward time before event j (events n-1 .. j+1 run first)
        self.bwd_elapsed_ms = np.concatenate([np.cumsum(p.bwd_time_ms[::-1])[::-1][1:], [0.0]])
        self.forward_ms = float(sum(p.fwd_time_ms))
        self.first_need = {s: max(ctx.savers[s]) for s in self.saved}


def choice_bound(problem: Problem, budget_bytes: int, *, offload: bool = True,
                 copies_end_in_forward: bool = False) -> ChoiceBound:
    """The least time any per-tensor keep / recompute (/ offload) choice fitting
    `budget_bytes` adds to the step, reruns and copy stalls (see the module docstring);
    offload only where the problem has a `host_link`; ``copies_end_in_forward``: only
    choices whose copies out all end in the forward, as every schedule `simulate` replays."""
    p = problem
    offload = offload and p.host_link is not None
    terms = _Terms(p)
    lp = pywraplp.Solver.CreateSolver("GLOP")
    x = {s: lp.NumVar(0.0, 1.0, f"x{s}") for s in terms.held}
    o = {s: lp.NumVar(0.0, 1.0 if offload else 0.0, f"o{s}") for s in terms.held}
    y = {i: lp.NumVar(0.0, 1.0, f"y{i}") for i in range(p.n_nodes) if p.recomputable[i]}

    def there(s: int) -> object:  # kept, offloaded or rerun itself
        rerun = y.get(p.storage_producer[s])
        return x[s] + o[s] + (rerun if rerun is not None else 0.0)

    for s in terms.saved:
        lp.Add(there(s) >= 1.0)
    for i, rerun in y.items():
        for s in p.inputs[i]:
            if s in x:
                lp.Add(rerun <= there(s))
    budget = budget_bytes / _MIB
    rerun = sum(p.fwd_time_ms[i] * v for i, v in y.items())
    stall = _stall(lp, p, terms, o) if offload else 0.0
    _forward_rows(lp, p, terms, x, o, budget, stall)
    queued = offload and not p.host_link.synchronous
    ahead = _copy_rows(lp, p, terms, o, rerun, stall, copies_end_in_forward) if queued else {}
    _backward_rows(lp, p, terms, x, budget, ahead)
    lp.Minimize(rerun + stall)
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return ChoiceBound(budget_bytes, offload, None, copies_end_in_forward)
    nbytes = p.storage_bytes
    kept = sum(x[s].solution_value() * nbytes[s] for s in terms.saved)
    moved = sum(o[s].solution_value() * nbytes[s] for s in terms.saved)
    total = sum(nbytes[s] for s in terms.saved)
    rerun_ms = sum(p.fwd_time_ms[i] * v.solution_value() for i, v in y.items())
    stall_ms = 0.0 if isinstance(stall, float) else stall.solution_value()
    return ChoiceBound(budget_bytes, offload, max(0.0, lp.Objective().Value()),
                       copies_end_in_forward, max(0.0, rerun_ms), max(0.0, stall_ms), kept,
                       moved, max(0.0, total - kept - moved))


def _running_sums(lp: pywraplp.Solver, n: int, adds: dict[int, list], name: str) -> list:
    """Per position t, a variable equal to the sum of `adds[u]` over u < t."""
    out: list = [0.0]
    for t in range(1, n):
        terms = adds.get(t - 1, [])
        if not terms:
            out.append(out[-1])
            continue
        v = lp.NumVar(0.0, lp.infinity(), f"{name}{t}")
        lp.Add(v == out[-1] + sum(terms))
        out.append(v)
    return out


def _mib_per_ms(link: HostLink, to_host: bool) -> float:
    """What one copy queue moves, in the LP's units."""
    return 1.0 / link.copy_ms(_MIB, to_host)


def _forward_rows(lp: pywraplp.Solver, p: Problem, terms: _Terms, x: dict, o: dict,
                  budget: float, stall: object) -> None:
    """Every forward event fits: kept storages past their last read, and the offloaded ones
    whose copy the device-to-host queue cannot have finished (in the forward's time so far
    and every stall; `stall` is 0.0 where nothing is offloaded)."""
    n = p.n_nodes
    kept_adds: dict[int, list] = {}
    moved_adds: dict[int, list] = {}
    for s in terms.held:
        at = terms.free_after[s]
        kept_adds.setdefault(at, []).append(p.storage_bytes[s] / _MIB * x[s])
        moved_adds.setdefault(at, []).append(p.storage_bytes[s] / _MIB * o[s])
    kept = _running_sums(lp, n, kept_adds, "k")
    link = p.host_link
    queued = not isinstance(stall, float) and not link.synchronous
    moved = _running_sums(lp, n, moved_adds, "m") if queued else [0.0] * n
    d2h = _mib_per_ms(link, to_host=True) if queued else 0.0
    for t in range(n):
        in_flight: object = 0.0
        if queued and not isinstance(moved[t], float):
            in_flight = lp.NumVar(0.0, lp.infinity(), f"f{t}")
            lp.Add(in_flight >= moved[t] - d2h * (float(terms.elapsed_ms[t]) + stall))
        lp.Add(terms.forward[t] / _MIB + kept[t] + in_flight <= budget)


def _stall(lp: pywraplp.Solver, p: Problem, terms: _Terms, o: dict) -> object:
    """The time compute waits for copies; over a synchronous link, at least every copy out
    and every copy back of a storage a node saves."""
    stall = lp.NumVar(0.0, lp.infinity(), "stall")
    link = p.host_link
    assert link is not None
    if link.synchronous:
        out_ms, in_ms = (link.copy_ms(_MIB, to_host) for to_host in (True, False))
        lp.Add(stall >= sum(p.storage_bytes[s] / _MIB * o[s] * (
            out_ms + (in_ms if s in terms.first_need else 0.0)) for s in terms.held))
    return stall


def _copy_rows(lp: pywraplp.Solver, p: Problem, terms: _Terms, o: dict, rerun: object,
               stall: object, end_in_forward: bool) -> dict[int, object]:
    """The copies at each backward event j (module docstring): the MiB whose copy out cannot
    have ended, and those come back ahead of their need; what the device holds of both.
    ``end_in_forward``: every copy out has ended when the backward begins."""
    link = p.host_link
    assert link is not None and not link.synchronous
    d2h, h2d = (_mib_per_ms(link, to_host) for to_host in (True, False))
    moved = lp.NumVar(0.0, lp.infinity(), "moved")
    lp.Add(moved == sum(p.storage_bytes[s] / _MIB * o[s] for s in terms.held))
    if end_in_forward:
        lp.Add(moved <= d2h * (terms.forward_ms + stall))
    early = lp.NumVar(0.0, lp.infinity(), "early")  # back before the backward began: out
    lp.Add(early <= min(d2h, h2d) * (terms.forward_ms + stall))  # and back in that time
    by_need: dict[int, list] = {}
    for s, j in terms.first_need.items():
        by_need.setdefault(j, []).append(p.storage_bytes[s] / _MIB * o[s])
    needed: object = 0.0  # MiB needed at events >= j
    held: dict[int, object] = {}
    for j in range(p.n_nodes - 1, -1, -1):
        since = float(terms.bwd_elapsed_ms[j]) + rerun + stall  # the backward's time so far
        if j in by_need:
            total = lp.NumVar(0.0, lp.infinity(), f"n{j}")
            lp.Add(total == needed + sum(by_need[j]))
            needed = total
            lp.Add(needed <= early + h2d * since)
            lp.Add(needed <= h2d * (terms.forward_ms + since))  # one queue, one clock
        waiting = lp.NumVar(0.0, lp.infinity(), f"a{j}")
        lp.Add(waiting >= early - needed)
        out = lp.NumVar(0.0, lp.infinity(), f"w{j}")
        lp.Add(out >= moved - d2h * (terms.forward_ms + since))
        held[j] = waiting + out
    return held


def _backward_rows(lp: pywraplp.Solver, p: Problem, terms: _Terms, x: dict,
                   budget: float, ahead: dict[int, object]) -> None:
    """Every backward event fits: what node j saved is back, what earlier nodes save is
    still held where it is kept, and `ahead[j]`: the copies the device still holds there
    (`_copy_rows`; none without offload)."""
    n = p.n_nodes
    adds: dict[int, list] = {}
    for s in terms.saved:  # held at j when an earlier node still saves it: first saver < j
        adds.setdefault(terms.first_saver[s], []).append(p.storage_bytes[s] / _MIB * x[s])
    held = _running_sums(lp, n, adds, "h")
    for j in range(n):
        counted = [p.storage_bytes[s] / _MIB * x[s] for s in p.saved[j]
                   if s in x and terms.first_saver[s] < j]
        lp.Add(terms.backward[j] / _MIB + held[j] - sum(counted) + ahead.get(j, 0.0)
               <= budget)
