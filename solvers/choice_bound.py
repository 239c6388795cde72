"""A lower bound on recompute time over every per-tensor choice: each saved activation kept,
recomputed or offloaded, with no restriction to module calls, nesting or whole-call offload
(an LP relaxation, GLOP). What no schedule of any planner can beat, so a benchmark can
print the distance from an answer to the limit, and say whether a target is reachable.

Variables per storage s not held by the caller that is saved or read by a recomputable
node: kept `x_s` (held past its last forward read: a STORE save, a checkpoint's input, a
selective keep), offloaded `o_s`; per recomputable node i: rerun `y_i`. A saved storage is
kept, offloaded or recomputed: `x_s + o_s + y_producer(s) >= 1`; a node reruns only from
inputs that are there: `y_i <= x_in + o_in + y_producer(in)` for each of its inputs. The
objective is the forward time of the nodes rerun (checkpoint overheads and stalls are left
out). Constraints, each true of every schedule `simulate` replays (so the LP is a
relaxation):

- forward event t: what the forward itself needs (static, caller-held, the node's outputs
  and temporaries, storages read at t or later), plus the storages past their last read
  that are kept, plus those offloaded whose copy cannot have ended: one device-to-host
  queue copies at most `d2h` bandwidth x the forward time elapsed (no such term over a
  synchronous link, where copies hold up compute);
- backward event j: static, gradients, loss, temporaries, every storage node j saved (it
  is back by then, regenerated or fetched), plus the kept storages an earlier node saves.

Regenerated copies, frames, fetches ahead of need and every overhead are optimistic
omissions: they only make real schedules cost more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from solvers.accounting import Context
from solvers.problem import Problem

__all__ = ["ChoiceBound", "choice_bound"]

_MIB = float(2**20)  # the LP works in MiB: byte counts up to 1e11 upset its tolerances


@dataclass(frozen=True)
class ChoiceBound:
    """`recompute_ms`: no per-tensor choice fitting `budget_bytes` reruns less forward time
    (None: none fits at all: the budget is below every schedule's peak). `offload`: whether
    offloading was among the choices. The fractional split of the saved bytes at the LP's
    optimum says where the bound comes from."""

    budget_bytes: int
    offload: bool
    recompute_ms: float | None
    kept_bytes: float = 0.0
    offloaded_bytes: float = 0.0
    recomputed_bytes: float = 0.0

    @property
    def feasible(self) -> bool:
        return self.recompute_ms is not None


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


def choice_bound(problem: Problem, budget_bytes: int, *, offload: bool = True) -> ChoiceBound:
    """The least forward time any per-tensor keep / recompute (/ offload) choice fitting
    `budget_bytes` reruns (see the module docstring); offload only where the problem has a
    `host_link`."""
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
    _forward_rows(lp, p, terms, x, o, budget, offload)
    _backward_rows(lp, p, terms, x, budget)
    lp.Minimize(sum(p.fwd_time_ms[i] * v for i, v in y.items()))
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return ChoiceBound(budget_bytes, offload, None)
    nbytes = p.storage_bytes
    kept = sum(x[s].solution_value() * nbytes[s] for s in terms.saved)
    moved = sum(o[s].solution_value() * nbytes[s] for s in terms.saved)
    total = sum(nbytes[s] for s in terms.saved)
    return ChoiceBound(budget_bytes, offload, max(0.0, lp.Objective().Value()), kept, moved,
                       max(0.0, total - kept - moved))


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


def _forward_rows(lp: pywraplp.Solver, p: Problem, terms: _Terms, x: dict, o: dict,
                  budget: float, offload: bool) -> None:
    """Every forward event fits: kept storages past their last read, and the offloaded ones
    whose copy the device-to-host queue cannot have finished."""
    n = p.n_nodes
    kept_adds: dict[int, list] = {}
    moved_adds: dict[int, list] = {}
    for s in terms.held:
        at = terms.free_after[s]
        kept_adds.setdefault(at, []).append(p.storage_bytes[s] / _MIB * x[s])
        moved_adds.setdefault(at, []).append(p.storage_bytes[s] / _MIB * o[s])
    kept = _running_sums(lp, n, kept_adds, "k")
    link = p.host_link
    queued = offload and link is not None and not link.synchronous
    moved = _running_sums(lp, n, moved_adds, "m") if queued else [0.0] * n
    for t in range(n):
        in_flight: object = 0.0
        if queued and not isinstance(moved[t], float):
            copied = link.d2h_gbps * 1e6 * float(terms.elapsed_ms[t]) / _MIB
            in_flight = lp.NumVar(0.0, lp.infinity(), f"f{t}")
            lp.Add(in_flight >= moved[t] - copied)
        lp.Add(terms.forward[t] / _MIB + kept[t] + in_flight <= budget)


def _backward_rows(lp: pywraplp.Solver, p: Problem, terms: _Terms, x: dict,
                   budget: float) -> None:
    """Every backward event fits: what node j saved is back, and what earlier nodes save is
    still held where it is kept."""
    n = p.n_nodes
    adds: dict[int, list] = {}
    for s in terms.saved:  # held at j when an earlier node still saves it: first saver < j
        adds.setdefault(terms.first_saver[s], []).append(p.storage_bytes[s] / _MIB * x[s])
    held = _running_sums(lp, n, adds, "h")
    for j in range(n):
        counted = [p.storage_bytes[s] / _MIB * x[s] for s in p.saved[j]
                   if s in x and terms.first_saver[s] < j]
        lp.Add(terms.backward[j] / _MIB + held[j] - sum(counted) <= budget)
