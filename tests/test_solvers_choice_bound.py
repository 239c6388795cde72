"""`solvers.choice_bound`: no schedule, recompute or offload, beats the per-tensor LP bound."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_solvers_nested_accounting import nested_schedules

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
    assert bound.recompute_ms <= timeline.recompute_time_ms + 1e-6


@MANY
@given(nested_schedules(), st.data())
def test_no_offloading_schedule_beats_the_bound(case: tuple[Problem, Schedule],
                                                data: st.DataObject) -> None:
    """Offloading calls too (a slow and a fast copy queue): the bound with offload stays
    below, and it never exceeds the recompute-only bound where that one fits."""
    p, schedule = case
    gbps = data.draw(st.sampled_from([1e-6, 1e-3, 1.0]))
    p = p.model_copy(update={"host_link": HostLink(d2h_gbps=gbps, h2d_gbps=gbps)})
    cuts = sorted(data.draw(st.sets(st.integers(1, p.n_nodes - 1), max_size=4)))
    spans = list(itertools.pairwise([0, *cuts, p.n_nodes]))
    moved = [sp for sp in spans if data.draw(st.booleans())]
    timeline = simulate(p, schedule.with_offloads(moved))
    bound = choice_bound(p, timeline.peak_bytes)
    assert bound.feasible
    assert bound.recompute_ms <= timeline.recompute_time_ms + 1e-6
    plain = choice_bound(p, timeline.peak_bytes, offload=False)
    assert not plain.feasible or bound.recompute_ms <= plain.recompute_ms + 1e-6


def test_the_bound_is_close_to_the_plans_and_says_when_nothing_fits() -> None:
    """On a transformer the bound is a real bound (not zero) below the planner's answers, and
    below every schedule's lowest peak no choice fits."""
    p = transformer(6)
    lowest = simulate(p, auto.lowest_peak(p, 10).schedule).peak_bytes
    unplanned = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    budget = (lowest + unplanned) // 2
    answer = auto.solve(p, budget, 10).objective_ms
    bound = choice_bound(p, budget, offload=False).recompute_ms
    assert 0.25 * answer < bound <= answer
    assert choice_bound(p, unplanned, offload=False).recompute_ms == pytest.approx(0.0, abs=1e-9)
    assert not choice_bound(p, int(0.8 * lowest), offload=False).feasible
