"""solvers.clock: one rule for what a rerun costs. `simulate`, the region analysis and the
DP's prefix sums charge the same time for every region, kept set and early stop."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from solvers import Problem, Schedule, simulate
from solvers.accounting import Context
from solvers.clock import rerun_ms, rerun_overhead_ms, rerun_step_ms
from solvers.dp.search import _rerun_ms
from solvers.frame import frame_rules, own_packs
from solvers.problem import ModuleSpan
from solvers.region_analysis import RegionInfo
from solvers.result import Status


def _problem(overlaps: bool) -> Problem:
    p = Problem.chain([8, 6, 4, 6, 2, 1], [0.7, 1.3, 0.1, 2.9, 0.5, 0.3])
    return p.model_copy(update={"checkpoint_region_ms": 0.4, "checkpoint_pack_ms": 0.15,
                                "checkpoint_sac_op_ms": 0.05, "node_ops": [1, 3, 2, 4, 1, 1],
                                "host_overlaps_device": overlaps})


def _regions(p: Problem):
    n = p.n_nodes - 1  # the loss is never recomputed
    for a, b in itertools.combinations(range(n + 1), 2):
        inside = [i for i in range(a, b) if p.can_keep(i)]
        for size in range(len(inside) + 1):
            for keep in itertools.combinations(inside, size):
                yield a, b, frozenset(keep)


def _reruns(p: Problem):
    """Each region of `_regions` that reruns something, with its frame's rules."""
    for a, b, keep in _regions(p):
        rules = frame_rules(p, own_packs(p, a, b))
        if rules.reruns:
            yield a, b, keep, rules


def _forward_prefix(p: Problem) -> tuple[np.ndarray, np.ndarray]:
    """The forward times and their prefix sums, as the DP's `_rerun_ms` takes them."""
    fwd = np.asarray(p.fwd_time_ms)
    return fwd, np.concatenate([[0.0], np.cumsum(fwd)])


@pytest.mark.parametrize("overlaps", [False, True], ids=["cpu", "gpu"])
def test_every_rerun_costs_the_same_in_simulate_region_analysis_and_the_dp(
        overlaps: bool) -> None:
    p = _problem(overlaps)
    ctx = Context(p)
    fwd, fwd_sum = _forward_prefix(p)
    checked = 0
    for a, b, keep, rules in _reruns(p):
        stop, idle = rules.rerun_stop, rules.idle_steps(keep & frozenset(range(a, b)))
        clock = rerun_ms(p, a, stop, idle, rerun_overhead_ms(p, a, stop, keep))
        by_hand = sum(fwd[i] for i in range(a, stop) if i not in idle) + (
            rerun_overhead_ms(p, a, stop, keep))
        assert clock == pytest.approx(by_hand, rel=1e-12)
        replay = simulate(p, Schedule.from_segments(p.n_nodes, [(a, b)], keep=sorted(keep)))
        assert replay.recompute_time_ms == clock  # one rerun: the same sum, to the bit
        assert RegionInfo.build(ctx, a, b, keep).time_ms == clock
        relative = [(0, stop - a, np.asarray(sorted(idle), dtype=np.int64) - a,
                     np.asarray(sorted(keep), dtype=np.int64) - a, b - a)]
        assert _rerun_ms(p, a, fwd_sum, fwd, relative) == pytest.approx(clock, rel=1e-12)
        checked += 1
    assert checked > 20


def test_a_step_of_a_pass_costs_its_node_unless_idle_plus_the_overhead_given() -> None:
    p = _problem(False)
    assert rerun_step_ms(p, 3, False) == 2.9
    assert rerun_step_ms(p, 3, True, 0.25) == 0.25


def _with_op_ranges(p: Problem) -> Problem:
    """``p`` whose every span may be checkpointed, a few of them only as op ranges."""
    n = p.n_nodes - 1
    ranges = {(1, 3), (0, 2), (2, 5)}
    spans = [ModuleSpan(start=a, stop=b, kind="ops" if (a, b) in ranges else "call")
             for a, b in itertools.combinations(range(n + 1), 2)]
    return p.model_copy(update={"module_spans": spans, "checkpoint_range_ms": 0.9})


def test_an_op_range_costs_its_range_cost_more_in_every_place_that_charges_a_rerun() -> None:
    """A checkpointed op range runs its module's forward as its traced program: it costs
    ``checkpoint_range_ms`` more than a module call of the same nodes would, and simulate,
    the region analysis and the DP's prefix sums charge it alike."""
    p = _with_op_ranges(_problem(False))
    calls = p.model_copy(update={"checkpoint_range_ms": 0.0})
    ctx = Context(p)
    fwd, fwd_sum = _forward_prefix(p)
    ranges = 0
    for a, b, keep, rules in _reruns(p):
        sched = Schedule.from_segments(p.n_nodes, [(a, b)], keep=sorted(keep))
        extra = 0.9 if (a, b) in {(1, 3), (0, 2), (2, 5)} else 0.0
        clock = simulate(p, sched).recompute_time_ms
        assert clock == pytest.approx(simulate(calls, sched).recompute_time_ms + extra)
        assert RegionInfo.build(ctx, a, b, keep).time_ms == pytest.approx(clock, rel=1e-12)
        stop, idle = rules.rerun_stop, rules.idle_steps(keep & frozenset(range(a, b)))
        relative = [(0, stop - a, np.asarray(sorted(idle), dtype=np.int64) - a,
                     np.asarray(sorted(keep), dtype=np.int64) - a, b - a)]
        assert _rerun_ms(p, a, fwd_sum, fwd, relative) == pytest.approx(clock, rel=1e-12)
        ranges += extra > 0
    assert ranges >= 3


def test_exact_solvers_price_op_ranges_as_simulate_does() -> None:
    """With op ranges dearer, the DP and CP-SAT still find bruteforce's optimum."""
    from solvers import bruteforce, deterministic_solver

    p = _with_op_ranges(_problem(False)).model_copy(update={"checkpoint_range_ms": 5.0})
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    lowest = bruteforce.min_feasible_budget(p)[0]
    for budget in (lowest, (lowest + store) // 2):
        best = bruteforce.solve(p, budget, math.inf)  # an optimum: searched to the end
        for name in ("cpsat", "dp"):
            found = deterministic_solver(name)(p, budget, 20.0)
            assert found.objective_ms == pytest.approx(best.objective_ms, rel=1e-6, abs=1e-6)


def test_a_step_that_reruns_pays_the_step_cost_once_with_its_first_rerun() -> None:
    """`clock.step_overhead_ms`: a plan of one small region measured 0.9-1.2 ms beyond its
    rerun, of six 2.1-2.3 (ResNet b16, 2 CPU cores): once per step, then per region."""
    p = _problem(False)
    stepped = p.model_copy(update={"checkpoint_step_ms": 0.7})
    one = Schedule.from_segments(p.n_nodes, [(0, 2)])
    two = Schedule.from_segments(p.n_nodes, [(0, 2), (2, 4)])
    for sched in (one, two):
        assert simulate(stepped, sched).recompute_time_ms == pytest.approx(
            simulate(p, sched).recompute_time_ms + 0.7)
    # a schedule that reruns nothing pays nothing
    for sched in (Schedule.store_all(p.n_nodes),):
        assert simulate(stepped, sched).recompute_time_ms == 0.0


def test_exact_solvers_find_the_optimum_with_a_step_cost() -> None:
    from solvers import bruteforce, deterministic_solver

    p = _problem(False).model_copy(update={"checkpoint_step_ms": 3.0})
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    lowest = bruteforce.min_feasible_budget(p)[0]
    for budget in (lowest, (lowest + store) // 2):
        best = bruteforce.solve(p, budget, math.inf)
        for name in ("cpsat", "dp"):
            found = deterministic_solver(name)(p, budget, 20.0)
            assert found.objective_ms == pytest.approx(best.objective_ms, rel=1e-6, abs=1e-6)


def test_the_dp_proves_its_answer_with_the_steps_cost(caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    """On GPT tiny the DP bounds its answer by passes over the regions' costs: proven
    optimal where those bounds count the step's cost too (they did not: FEASIBLE, and an
    error that its model disagreed with simulate by the step's 1 ms)."""
    import profiles
    from planner import zoo
    from solvers import deterministic_solver
    from solvers.from_profile import problem_from_profile

    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.0)
    prof = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                            timing="estimate", progress=False)
    p = problem_from_profile(prof).model_copy(update={"checkpoint_region_ms": 0.1,
                                                      "checkpoint_step_ms": 1.0})
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    with caplog.at_level("ERROR"):
        found = deterministic_solver("dp")(p, int(0.7 * store), 20.0)
    assert found.status == Status.OPTIMAL and found.bound_ms == found.objective_ms
    assert found.objective_ms == simulate(p, found.schedule).recompute_time_ms > 1.0
    assert not caplog.records
