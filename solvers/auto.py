"""`auto.solve`: pick exact solvers by graph shape and time limit; exact minimum budgets."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence

from solvers import baselines, bruteforce, cpsat
from solvers.accounting import Context
from solvers.bounds import memory_lower_bound
from solvers.dp import search as dp
from solvers.dp import space as dp_space
from solvers.problem import Problem
from solvers.result import Solution, Status
from solvers.schedule import Schedule
from solvers.simulate import optimizer_step_peak, share_unplanned, simulate
from solvers.spaces import SearchSpace, every_schedule

logger = logging.getLogger(__name__)

__all__ = ["lowest_peak", "min_feasible_budget", "solve"]

CPSAT_MAX_NODES = 400  # CP-SAT over op ranges of larger graphs is slow; chains use the DP
# ... and over op ranges cut at more stages than this: on random DAGs (single-node stages) of
# 150 nodes it builds 22,000 candidates, finds nothing in 30 s and overruns that by 11 s
CPSAT_MAX_STAGES = 120


def cpsat_fits(problem: Problem) -> bool:
    """Whether CP-SAT's model is small enough to help: always over module calls (its
    candidates are the calls); over op ranges up to `CPSAT_MAX_NODES` nodes and
    `CPSAT_MAX_STAGES` stages."""
    return problem.module_spans is not None or (
        problem.n_nodes <= CPSAT_MAX_NODES and len(problem.stages()) <= CPSAT_MAX_STAGES)


NEAR_TIE = 1e-3  # answers this close in recompute time are told apart by their proofs


class _Clock:
    """What `solve` reads of time. Deterministic: no time passes (every share of the limit
    is what it would be at the start), the DP runs to its own end (it stops on its work,
    not on seconds) and CP-SAT counts its own measure of work: the same answer on a loaded
    machine as on a quiet one, in more or fewer seconds than the limit."""

    def __init__(self, started: float, deterministic: bool) -> None:
        self.started, self.deterministic = started, deterministic

    def elapsed(self) -> float:
        return 0.0 if self.deterministic else time.perf_counter() - self.started

    def dp_limit(self, seconds: float) -> float:
        return math.inf if self.deterministic else seconds


def _rank(sol: Solution) -> tuple:
    return (not sol.feasible, sol.objective_ms if sol.feasible else 0.0,
            sol.status != Status.OPTIMAL, sol.peak_bytes or 0)


def solve(problem: Problem, budget_bytes: int, time_limit_s: float = 60.0, *,
          deterministic: bool = False) -> Solution:
    """Best result of the exact solvers that fit the graph and the time limit, and the baselines.

    Chains of blocks: the DP first (fast), then CP-SAT warm-started with its schedule on what
    is left of the time limit (small and mid-size graphs). Other graphs: CP-SAT, with the DP
    over merged stages as warm start; with op ranges, module calls alone first. Graphs of
    more than `LARGE_GRAPH_NODES` nodes: the DP over op ranges with most of the time, CP-SAT
    only where it proved no gap. The cheap baselines (`baselines.BASELINES`) run too, so
    the answer is never worse than any of them. Returns the feasible answer with least
    recompute time (OPTIMAL preferred on ties; within `NEAR_TIE` of it, the one with the
    smallest proven gap); `solver` names which one, prefixed `auto/`.
    Status, `bound_ms`, `gap` and `space` come from the strongest bound an exact solver
    proved over a space that holds the answer (`_proven_over_a_space`); none: FEASIBLE with
    no bound. ``deterministic``: the same answer whatever the machine's load (`_Clock`).
    """
    t0 = time.perf_counter()
    clock = _Clock(t0, deterministic)
    calls = calls_only(problem)
    if calls is problem or dp.applies(problem) or problem.n_nodes > LARGE_GRAPH_NODES:
        return _solve(problem, budget_bytes, time_limit_s, clock=clock)[0]
    # a small graph gets the DP over op ranges first: proven over a space that holds
    # CP-SAT's, its answer is final (the zoo MLP took 5 s in CP-SAT over module calls for
    # a budget only op ranges meet, which the DP proves in 0.03 s; and 8 s to find that
    # nothing fits a budget where the DP proves it)
    proven = _small_graph_dp(problem, budget_bytes, time_limit_s, clock)
    if proven is not None and _dp_holds_cpsat(problem):
        left = max(0.0, time_limit_s - clock.elapsed())
        best, _ = _solve(problem, budget_bytes, left, dp_answer=proven, clock=clock)
        return best.model_copy(update={"solve_time_s": time.perf_counter() - t0})
    # op ranges multiply CP-SAT's candidates: on graphs that are not chains (no DP over
    # every module-call segmentation to start from) module calls alone are solved first
    # (in CALLS_FIRST of the time), and their answer warm-starts the search with op
    # ranges, so that op ranges never answer worse than module calls; large graphs go
    # straight to the DP, whose space holds the module calls' (CP-SAT rarely runs there)
    first, unbounded = _solve(calls, budget_bytes, CALLS_FIRST * time_limit_s, last=False,
                              clock=clock)
    left = max(0.0, time_limit_s - clock.elapsed())
    # CP-SAT after a DP answer with a gap that found no bound at all over module calls,
    # the smaller space, finds none over op ranges in the time either (Llama, 8 layers:
    # 6 s each, no bound); where it bounded something it runs again (conformance: 10 of
    # its proofs come from the op-range pass)
    no_bound = first.feasible and (first.gap is None or first.gap >= 1.0)
    best, _ = _solve(problem, budget_bytes, left, given=[first], after_a_gap=not unbounded,
                     dp_answer=proven, dp_share=NO_BOUND_DP_SHARE if no_bound else None,
                     clock=clock)
    return best.model_copy(update={"solve_time_s": time.perf_counter() - t0})


CALLS_FIRST = 0.4
# where CP-SAT found no bound over module calls, the DP over op ranges gets this share of
# what is left (not 0.3): CP-SAT rarely bounds the larger space then, and the DP needs the
# time (DeepLabV3 under bf16: 0.367 ms where CP-SAT answered 0.56 with no bound; MobileNetV3
# under bf16 proven optimal where CP-SAT's answers had none)
NO_BOUND_DP_SHARE = 0.7
# graphs larger than this go straight to the DP over op ranges, which gets most of the time:
# on a 126-layer Llama (9,372 nodes) solving module calls first took 23 of the 60 s and the
# gap stayed at 3.1 % (0.2 % without); below it, module calls first still answer better on
# some models (fcn_resnet50: CP-SAT over module calls finds 0.40 ms, the DP over op ranges 0.69)
LARGE_GRAPH_NODES = 2000
LARGE_GRAPH_DP_SHARE = 0.8
AFTER_A_GAP = 0.3  # of the limit, for CP-SAT after a DP answer with a gap (mid-size graphs),
AFTER_A_GAP_MAX_S = 6.0  # and at most this: the proofs it finds come in 1 to 5 s, or not at all


def _solve(problem: Problem, budget_bytes: int, time_limit_s: float,
           given: Sequence[Solution] = (), after_a_gap: bool = True,
           dp_answer: Solution | None = None, dp_share: float | None = None,
           last: bool = True, clock: _Clock | None = None) -> tuple[Solution, bool]:
    """`solve` over ``problem``'s own regions; ``given``: answers found otherwise (kept
    with their own proofs), one of which may warm-start CP-SAT; ``after_a_gap``: CP-SAT
    may follow a DP answer with a gap on a mid-size graph; ``dp_answer``: the DP's proven
    answer on this problem, if it ran already; ``dp_share``: at least this share of the
    time for the DP; ``last``: no search follows (what this one leaves goes unused);
    ``clock``: `solve`'s. Also returns whether CP-SAT ran there and found no bound."""
    t0 = time.perf_counter()
    clock = _Clock(t0, clock.deterministic if clock else False)
    exact: list[Solution] = []
    # baselines first: on very large graphs they take seconds, and the exact solvers get
    # what is left of the time limit
    base = [fn(problem, budget_bytes, 1.0) for fn in baselines.BASELINES.values()]
    base += [g.model_copy(update={"solver": g.solver.removeprefix("auto/")}) for g in given]
    # keep a little of the limit for what follows a timed-out DP or CP-SAT (CP-SAT stops
    # up to about half a second late; scoring) and for picking the answer, so that auto
    # itself returns in time
    reserve = min(0.05 * time_limit_s, 3.0)
    left = max(0.0, time_limit_s - reserve - clock.elapsed())
    # over module calls CP-SAT is what proves plans of graphs that are not chains
    use_cpsat = cpsat_fits(problem)
    # on large graphs CP-SAT runs only after a DP that proved no gap (`chain_done`), and
    # rarely finds a schedule there: the DP, whose time grows with the graph, gets most
    share = (0.5 if dp.applies(problem) else 0.3) if use_cpsat else 1.0
    if problem.n_nodes > LARGE_GRAPH_NODES:
        share = max(share, LARGE_GRAPH_DP_SHARE)
    share = max(share, dp_share or 0.0)
    answered = _answered(problem, left, time_limit_s, use_cpsat, after_a_gap) if last else None
    d = dp_answer or dp.solve(problem, budget_bytes, clock.dp_limit(left * share),
                              answered_limit_s=answered)
    exact.append(d)
    left = time_limit_s - reserve - clock.elapsed()
    # a DP answer proven optimal on a graph of over 200 nodes is final (its space holds
    # CP-SAT's); a large graph's with a proven gap leaves CP-SAT little to add (it rarely
    # finds a schedule there); on mid-size graphs CP-SAT, warm-started with it, may find a
    # faster one in its smaller space (nothing or matmuls kept per region) and prove it
    # there: ResNet-50 at 50 %, 0.3617 ms proven in about 1 s where the DP's 0.3644 ms had a
    # 28 % gap; it then gets `AFTER_A_GAP` of the limit (at most `AFTER_A_GAP_MAX_S`): the
    # rest would rarely be used
    bounded = d.feasible and d.gap is not None and problem.n_nodes > 200
    gap_left = bounded and d.gap > 0
    chain_done = bounded and (not gap_left or problem.n_nodes > LARGE_GRAPH_NODES
                              or not after_a_gap)
    # a DP answer proven over a space that holds CP-SAT's is final at any size (the zoo
    # MLP: CP-SAT took 5 s to prove it again)
    chain_done = chain_done or ((d.status == Status.OPTIMAL or _proven_infeasible(d))
                                and use_cpsat and _dp_holds_cpsat(problem))
    nothing_to_beat = d.feasible and d.objective_ms == 0  # no recompute: optimal anywhere
    unbounded = False
    if use_cpsat and left > 0.1 and not chain_done and not nothing_to_beat:
        # warm start from the best schedule so far (the dp's, else a baseline's): CP-SAT
        # then improves a feasible point and proves a bound instead of searching blind
        start = min([d, *base], key=_rank)
        exact.append(cpsat.solve(problem, budget_bytes,
                                 min(left, AFTER_A_GAP * time_limit_s, AFTER_A_GAP_MAX_S)
                                 if gap_left else left,
                                 hint=start.schedule if start.feasible else d.schedule,
                                 deterministic=clock.deterministic))
        unbounded = gap_left and (exact[-1].gap is None or exact[-1].gap >= 1.0)
    best = min(exact + base, key=_rank)
    if not best.feasible:
        best = min(exact, key=_rank)  # the exact solvers' lowest-peak schedule and minimum
    if best.feasible:
        best = _best_proven(problem, best, exact + base, exact + _own_proofs(given))
    if not best.feasible:
        mfb = [r.min_feasible_budget_bytes for r in exact if r.min_feasible_budget_bytes]
        best = best.model_copy(update={"min_feasible_budget_bytes": max(mfb, default=None)})
        # nothing fits, proven by none of them, and one stopped at its limit: not decided
        if not any(map(_proven_infeasible, exact)) and any(
                r.status == Status.TIMED_OUT for r in exact):
            best = best.timed_out()
    return best.model_copy(update={"solver": f"auto/{best.solver}",
                                   "solve_time_s": time.perf_counter() - t0}), unbounded


def _answered(problem: Problem, left: float, time_limit_s: float, use_cpsat: bool,
              after_a_gap: bool) -> float | None:
    """How long `_solve`'s DP may search for a proof once it has a bounded answer: all of
    `left` less what CP-SAT then gets (none on large graphs, or after module calls that
    bounded; `AFTER_A_GAP` of the limit on mid-size graphs), which would otherwise go
    unused (DeepLabV3 at 30 %: module calls fit nothing, the DP got 5.5 s of 19 and CP-SAT
    6, and the DP's split needed 7 s to prove its answer). None on small graphs, where
    CP-SAT gets all of what the DP leaves. Only where no search follows `_solve` (module
    calls first: what they leave goes to op ranges; Inception-v3 under bf16 found nothing
    over op ranges when the calls' DP took the time)."""
    if problem.n_nodes <= 200:
        return None
    if not use_cpsat or problem.n_nodes > LARGE_GRAPH_NODES or not after_a_gap:
        return left
    return left - min(AFTER_A_GAP * time_limit_s, AFTER_A_GAP_MAX_S)


def _own_proofs(given: Sequence[Solution]) -> list[Solution]:
    """Answers found otherwise (module calls alone, first), with their proofs for their own
    schedules only: their spaces are another problem's, not decided over this one. T5 at
    80 %: the DP's answer over module calls, proven there, and CP-SAT's over op ranges
    within 1e-15 ms of it with no bound; the first is the proven one."""
    return [g.model_copy(update={"solver": g.solver.removeprefix("auto/"),
                                 "space": g.space.model_copy(update={"cuts": "solver"})})
            for g in given if g.feasible and g.space is not None and g.bound_ms is not None]


DP_FIRST_MAX_NODES = 200  # small graphs: the DP over op ranges first, final where proven
DP_FIRST_SHARE = 0.1  # of the limit, for that first DP


def _small_graph_dp(problem: Problem, budget_bytes: int, time_limit_s: float, clock: _Clock
                    ) -> Solution | None:
    """On a graph of at most `DP_FIRST_MAX_NODES` nodes, the DP's answer if it proves it
    optimal over its space (or that nothing of it fits) in `DP_FIRST_SHARE` of the limit;
    else None."""
    if problem.n_nodes > DP_FIRST_MAX_NODES:
        return None
    found = dp.solve(problem, budget_bytes, clock.dp_limit(DP_FIRST_SHARE * time_limit_s))
    return found if found.status == Status.OPTIMAL or _proven_infeasible(found) else None


def _proven_infeasible(solution: Solution) -> bool:
    """No schedule of the solution's space fits its budget (the DP proved it)."""
    return not solution.feasible and solution.space is not None


def _dp_holds_cpsat(problem: Problem) -> bool:
    """Whether the DP's space holds every schedule of CP-SAT's candidate regions."""
    regions, _ = cpsat.candidates(Context(problem))
    return dp_space.holds_regions(problem, [(r.a, r.b, frozenset(r.keep)) for r in regions])


def _best_proven(problem: Problem, best: Solution, found: list[Solution],
                 exact: list[Solution]) -> Solution:
    """`best` with its proof, or an answer within `NEAR_TIE` of its recompute time whose
    proven gap is smaller (DenseNet-121: CP-SAT's 2.853 ms within 65 % of its space's
    optimum, the DP's 2.854 ms within 17 % of its own)."""
    limit = best.objective_ms * (1 + NEAR_TIE)
    close = [s for s in found if s.feasible and s.objective_ms <= limit]
    proven = [_proven_over_a_space(problem, s, exact) for s in close]
    return min(proven, key=lambda s: (2.0 if s.gap is None else s.gap, _rank(s)))


def _proven_over_a_space(problem: Problem, best: Solution, exact: list[Solution]
                         ) -> Solution:
    """`best` with the strongest bound proven over a space that holds its schedule.

    A bound over space S bounds the optimum over S; it says how far `best` is from that
    optimum only when `best` lies in S. The answer's own solver's space always holds it, as
    does that of any solver that returned the same schedule; another's only when
    `SearchSpace.contains` decides so. Without one: no bound, no gap.
    """
    obj = best.objective_ms
    if obj <= 0:
        return best.model_copy(update={"status": Status.OPTIMAL, "bound_ms": 0.0, "gap": 0.0,
                                       "space": every_schedule()})
    proven: list[tuple[float, Solution]] = []
    for sol in exact:
        if not sol.feasible or sol.space is None or sol.bound_ms is None:
            continue
        # a solver's own answer lies in its space: also when another solver found it too
        if sol is best or sol.schedule == best.schedule or sol.space.contains(problem,
                                                                              best.schedule):
            if sol.bound_ms > obj + 1e-9 * max(1.0, obj):
                logger.error("%s proved %.6f ms over %s, but %s found %.6f ms in that space; "
                             "please report this", sol.solver, sol.bound_ms, sol.space,
                             best.solver, obj)
                continue
            proven.append((min(sol.bound_ms, obj), sol))
    if not proven:
        return best.model_copy(update={"status": Status.FEASIBLE, "bound_ms": None,
                                       "gap": None, "space": None})
    bound, by = max(proven, key=lambda p: p[0])
    gap = max(0.0, (obj - bound) / obj)
    optimal = gap <= 1e-9
    return best.model_copy(update={"status": Status.OPTIMAL if optimal else Status.FEASIBLE,
                                   "bound_ms": bound, "gap": 0.0 if optimal else gap,
                                   "space": by.space})


def _nested_minimum(problem: Problem, flat: int, time_limit_s: float) -> int:
    """Least budget below `flat` at which the dp (nested schedules included) is feasible."""
    if not dp.applies(problem) or not dp.solve(problem, flat - 1, time_limit_s,
                                               first_fit=True).feasible:
        return flat
    lo, hi = memory_lower_bound(problem) - 1, flat - 1  # lo infeasible, hi feasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if dp.solve(problem, mid, time_limit_s, first_fit=True).feasible:
            hi = mid
        else:
            lo = mid
    return hi


def min_feasible_budget(problem: Problem, exact_max_nodes: int = bruteforce.EXACT_BUDGET_MAX_NODES,
                        *, time_limit_s: float = 30.0) -> tuple[int, bool]:
    """Smallest budget at which the solvers find a schedule, and whether it is proven exact.

    Up to `exact_max_nodes` nodes: brute force (the minimum over all non-nested schedules),
    then bisection with the dp, whose two-level nested schedules may reach lower (then that
    lower budget is returned with False: no search covers every nested schedule).
    Beyond: CP-SAT minimises the simulated peak over its candidate space; when it proves
    that, `cpsat.solve` is feasible at the returned budget and INFEASIBLE one byte below, and
    the flag is True iff that space is the complete one (small graphs). If CP-SAT cannot
    answer in time, or `exact_max_nodes == 0`, the schedule-independent
    `memory_lower_bound` is returned with False.
    """
    if exact_max_nodes <= 0:
        return memory_lower_bound(problem), False
    if problem.n_nodes <= exact_max_nodes:
        flat, exact = bruteforce.min_feasible_budget(problem, exact_max_nodes)
        nested = _nested_minimum(problem, flat, time_limit_s)
        return (nested, False) if nested < flat else (flat, exact)
    if not cpsat_fits(problem):
        return memory_lower_bound(problem), False
    found = cpsat.min_peak(problem, time_limit_s)
    if found.bytes == 0:
        return memory_lower_bound(problem), False
    return found.bytes, found.proven


def calls_only(problem: Problem) -> Problem:
    """``problem`` with module calls as its only regions (itself when it offers no op
    ranges of traced forwards)."""
    spans = problem.module_spans
    if spans is None or all(span.kind == "call" for span in spans):
        return problem
    calls = problem.model_copy(update={"module_spans": [s for s in spans if s.kind == "call"]})
    return share_unplanned(problem, calls)  # op ranges change no unplanned lifetime


def lowest_peak(problem: Problem, time_limit_s: float = 30.0, *,
                deterministic: bool = False) -> Solution:
    """The lowest-peak schedule the solvers find, scored at its own peak (FEASIBLE there).

    Reproducible, so that asking for that peak as a budget finds it again: the baselines,
    brute force on tiny problems, CP-SAT minimising the peak with a deterministic time limit
    (`cpsat_fits`), and a bisection of the budget with the dp (over merged stages where the
    graph is not a chain of its own), whose nested schedules may go lower.
    `min_feasible_budget_bytes` is then the proven schedule-independent lower bound
    (`memory_lower_bound`); when CP-SAT proved its least peak, `least_peak_bytes` and
    `least_peak_space` say over which schedules. Its searches stop at CP-SAT's measure of
    work, or at the seconds of ``time_limit_s`` where that comes first; ``deterministic``:
    at work alone, the DP's steps run to their own end (`_Clock`).
    """
    t0 = time.perf_counter()
    deadline = math.inf if deterministic else t0 + time_limit_s
    found: list[tuple[int, str, Schedule]] = []
    least = cpsat.MinPeak(0, None, None)
    for name, fn in baselines.BASELINES.items():
        base = fn(problem, 0, 1.0)
        if base.schedule is not None and base.peak_bytes is not None:
            found.append((base.peak_bytes, name, base.schedule))
    # the optimizer step (if counted) peaks the same under every schedule
    floor = optimizer_step_peak(problem)
    bound = max(memory_lower_bound(problem), floor)
    # where the DP's space holds CP-SAT's, the DP's bisection below proves the least peak
    # over it (the zoo MLP: 13 s of CP-SAT, for what the DP proves in a fraction of one)
    dp_proves = problem.n_nodes > bruteforce.EXACT_BUDGET_MAX_NODES and cpsat_fits(problem) \
        and _dp_holds_cpsat(problem)
    if problem.n_nodes <= bruteforce.EXACT_BUDGET_MAX_NODES:
        for schedule in bruteforce.enumerate_schedules(problem):
            found.append((simulate(problem, schedule).peak_bytes, "bruteforce", schedule))
    elif cpsat_fits(problem) and not dp_proves:
        # deterministic time is not seconds, but CP-SAT's own measure of work (about 1 s);
        # with op ranges, module calls alone first: their fewer candidates are searched
        # further in the time, so op ranges never answer above module calls
        calls = calls_only(problem)
        share = 0.4 * time_limit_s / (2 if calls is not problem else 1)
        for space in [calls, problem] if calls is not problem else [problem]:
            wall = 0.4 * time_limit_s - (time.perf_counter() - t0)  # the share, in seconds
            minimum = cpsat.min_peak(space, share, deterministic=True,
                                     wall_s=None if deterministic else max(0.1, wall))
            if minimum.schedule is not None:
                found.append((max(minimum.bytes, floor), "cpsat", minimum.schedule))
                least = minimum if minimum.optimal_over is not None else least
    best = min(found, key=lambda f: (f[0], f[1])) if found else None
    if best is not None:  # chains, and graphs whose merged stages make one (ResNets)
        proof = _dp_bisection(problem, bound, best[0], found, time_limit_s, deadline,
                              exact=dp_proves, clock=_Clock(t0, deterministic))
        if proof is not None:
            least = cpsat.MinPeak(min(peak for peak, _, _ in found), None, proof)
        best = min(found, key=lambda f: (f[0], f[1]))
    if best is None:
        return Solution(solver="lowest-peak", status=Status.INFEASIBLE, schedule=None,
                        budget_bytes=0, objective_ms=None,
                        solve_time_s=time.perf_counter() - t0,
                        min_feasible_budget_bytes=bound, min_feasible_budget_exact=False)
    peak, how, schedule = best
    sol = Solution.scored(problem, schedule, peak, solver=f"lowest-peak/{how}", started_s=t0)
    proven = least.optimal_over is not None
    return sol.model_copy(update={"min_feasible_budget_bytes": min(bound, peak),
                                  "min_feasible_budget_exact": False,
                                  "least_peak_bytes": max(least.bytes, floor) if proven
                                  else None,
                                  "least_peak_space": least.optimal_over,
                                  "least_peak_prover": None if not proven else
                                  "the DP" if dp_proves else "CP-SAT"})


BISECTION_CALL_S = 1.0  # the least time a bisection step may take, while time is left


def _dp_bisection(problem: Problem, bound: int, best: int,
                  found: list[tuple[int, str, Schedule]], time_limit_s: float,
                  deadline: float, exact: bool, clock: _Clock | None = None
                  ) -> SearchSpace | None:
    """Budgets bisected between ``bound`` (no schedule peaks below it) and ``best`` (the
    lowest peak found) with the DP, its schedules added to ``found``: 8 steps, or with
    ``exact`` until it proves that no schedule of its space peaks below the lowest found
    (then returns that space; else None). Each step gets an eighth of half the time, or
    up to `BISECTION_CALL_S` where that is more and the time left holds it."""
    clock = clock or _Clock(0.0, deterministic=False)
    lo, hi = bound - 1, best - 1  # lo: infeasible; is anything at or below hi?
    per_call = 0.5 * time_limit_s / 8
    proof: SearchSpace | None = None  # over which lo is proven infeasible (the DP's space)
    shared: dict = {}  # the DP's profiles of this problem, the same at every budget
    for step in itertools.count():
        left = deadline - time.perf_counter() - per_call  # a share for what follows
        if hi <= lo or (step >= 8 and not exact) or left < per_call:
            break
        mid = hi if hi - lo <= 1 else (lo + hi) // 2
        # a call may run past its share while time is left: a DP pass that needs 1 s
        # (Swin-T) finds nothing in a share of 0.3 s, however many such calls run
        sol = dp.solve(problem, mid, clock.dp_limit(min(left, max(per_call, BISECTION_CALL_S))),
                       first_fit=True, shared=shared)
        if sol.feasible and sol.schedule is not None and sol.peak_bytes is not None:
            found.append((sol.peak_bytes, "dp", sol.schedule))
            hi = sol.peak_bytes - 1
        else:
            lo, proof = mid, sol.space if _proven_infeasible(sol) else None
    return proof if exact and hi <= lo else None
