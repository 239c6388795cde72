"""`solvers.choice_bound`: no schedule, recompute or offload, beats the per-tensor LP bound."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_solvers_nested_accounting import nested_schedules, offloaded

from solvers import Problem, Schedule, auto, simulate
from solvers.choice_bound import choice_bound
from solvers.problem import HostLink
from solvers.testing import transformer

MANY = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))


@MANY
@given(nested_schedules())
def test_no_schedule_beats_the_bound(case: tuple[Problem, Schedule]) -> None:
    """At any schedule's own peak, the bound fits and reruns no more than it does."""
    p, schedule = case
    timeline = simulate(p, schedule)
    bound = choice_bound(p, timeline.peak_bytes, offload=False)
    assert bound.feasible
    assert bound.added_ms <= timeline.recompute_time_ms + 1e-6


@MANY
@given(nested_schedules(), st.data())
def test_no_offloading_schedule_beats_the_bound(case: tuple[Problem, Schedule],
                                                data: st.DataObject) -> None:
    """Offloading calls too (slow and fast copy queues, or a synchronous link; fetched when
    needed or prefetched, released at their own end or a later call's): the bound with
    offload stays below the time the schedule adds, and it never exceeds the recompute-only
    bound where that one fits."""
    p, schedule = case
    p, moved = offloaded(p, data)
    timeline = simulate(p, schedule.with_offloads(moved))
    bound = choice_bound(p, timeline.peak_bytes)
    assert bound.feasible
    assert bound.added_ms <= timeline.added_time_ms + 1e-6
    plain = choice_bound(p, timeline.peak_bytes, offload=False)
    assert not plain.feasible or bound.added_ms <= plain.added_ms + 1e-6
    # every copy out of a schedule simulate replays ends in the forward (its releases are
    # forward calls), so the runtime's bound holds it too, and is no looser
    ours = choice_bound(p, timeline.peak_bytes, copies_end_in_forward=True)
    assert ours.feasible and ours.copies_end_in_forward
    assert bound.added_ms - 1e-6 <= ours.added_ms <= timeline.added_time_ms + 1e-6


def test_a_schedule_that_waits_for_its_copies_is_above_the_bound() -> None:
    """A slow copy queue and a large temporary late in the forward: offloading the first
    activation fits only because compute waits for its copy out (a stall, 100 ms) and back
    (100 ms). The bound counts that wait as time (it was infeasible at that peak when it
    ignored stalls) and stays below it."""
    mib = 2**20
    p = Problem.chain([100 * mib, 100 * mib, mib, mib, mib], [1.0] * 5,
                      fwd_temp_bytes=[0, 0, 0, 150 * mib, 0], recomputable=[False] * 5)
    p = p.model_copy(update={"host_link": HostLink(d2h_gbps=mib / 1e6, h2d_gbps=mib / 1e6)})
    unplanned = simulate(p, Schedule.store_all(5))
    waits = simulate(p, Schedule.store_all(5).with_offloads([(1, 2)]))
    assert waits.peak_bytes < unplanned.peak_bytes and waits.stall_time_ms == 200.0
    bound = choice_bound(p, waits.peak_bytes)
    assert bound.feasible and 0.0 < bound.stall_ms == bound.added_ms <= waits.added_time_ms
    assert not choice_bound(p, waits.peak_bytes, offload=False).feasible


def test_the_bound_is_close_to_the_plans_and_says_when_nothing_fits() -> None:
    """On a transformer the bound is a real bound (not zero) below the planner's answers, and
    below every schedule's lowest peak no choice fits."""
    p = transformer(6)
    lowest = simulate(p, auto.lowest_peak(p, 10).schedule).peak_bytes
    unplanned = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    budget = (lowest + unplanned) // 2
    answer = auto.solve(p, budget, 10).objective_ms
    bound = choice_bound(p, budget, offload=False).added_ms
    assert 0.25 * answer < bound <= answer
    assert choice_bound(p, unplanned, offload=False).added_ms == pytest.approx(0.0, abs=1e-9)
    assert not choice_bound(p, int(0.8 * lowest), offload=False).feasible


def test_copies_held_to_the_forward_bound_more() -> None:
    """On a transformer whose copies out could run on into the backward, holding them to the
    forward (our runtime's rule) raises the bound: the link moves less in the forward than
    the relaxed bound sends."""
    p = transformer(6)
    p = p.model_copy(update={"host_link": HostLink(d2h_gbps=1.0, h2d_gbps=1.0)})
    lowest = simulate(p, auto.lowest_peak(p, 10).schedule).peak_bytes
    unplanned = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    budget = int(lowest + 0.3 * (unplanned - lowest))
    relaxed = choice_bound(p, budget)
    ours = choice_bound(p, budget, copies_end_in_forward=True)
    plain = choice_bound(p, budget, offload=False)
    assert relaxed.added_ms < ours.added_ms - 0.05 < plain.added_ms
