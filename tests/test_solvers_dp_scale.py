"""The DP's work follows the model's structure, not its size: identical blocks share their
window profiles, fronts thinned on long chains grow until the gap closes, and fronts are
merged by one rule (`solvers.front.pareto_indices`)."""

from __future__ import annotations

import logging
import math
import unittest.mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_solvers_properties import check_reported_numbers

import solvers.dp.search as dp_module
from solvers import SOLVERS, Schedule, front, simulate
from solvers.accounting import Context
from solvers.dp import search as dp
from solvers.front import pareto_indices
from solvers.testing import transformer


def _halfway(p) -> int:
    """Halfway between every-block checkpointing's peak and the unplanned peak."""
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    every = SOLVERS["every_block"](p, 10**18, 1.0).peak_bytes
    return (store + every) // 2


def _counting_profiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the window profiles the DP computes from now on (`[count]`)."""
    calls = [0]
    profile = dp_module.profile_parts

    def counting(*args, **kwargs):
        calls[0] += 1
        return profile(*args, **kwargs)

    monkeypatch.setattr(dp_module, "profile_parts", counting)
    return calls


def _window_profiles(p, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many window profiles one DP solve computes (no time limit)."""
    calls = _counting_profiles(monkeypatch)
    assert dp.solve(p, _halfway(p), math.inf).feasible
    monkeypatch.undo()
    return calls[0]


def test_blocks_reading_one_table_share_their_signature() -> None:
    # Llama's rotary tables are made once and read by every layer: where they were made and
    # who else reads them differ per layer, but the window profiles leave them out
    p = transformer(8, rotary=True)
    ctx = Context(p)
    lay = dp._layout(ctx)
    assert lay.outside, "the table should be left out of the windows"
    signatures = dp._stage_signatures(ctx, lay.stages, lay.outside)
    blocks = [signatures[t] for t, (a, _) in enumerate(lay.stages)
              if p.block_of_node[a] in range(1, 7)]
    assert len(blocks) == 6 and len(set(blocks)) == 1, signatures


def test_a_table_every_block_reads_adds_no_work_per_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    growth = {}
    for rotary in (False, True):
        short, long = (_window_profiles(transformer(n, rotary=rotary), monkeypatch)
                       for n in (6, 12))
        growth[rotary] = long - short
    # six more blocks cost about as many new windows with the table as without (without
    # the shared signature: 232 against 78)
    assert growth[True] < 2 * growth[False], growth


@pytest.mark.parametrize("frac", [0.1, 0.5, 0.9])
def test_shared_windows_score_as_simulate_does(frac: float,
                                               caplog: pytest.LogCaptureFixture) -> None:
    # the windows profiled once and placed at every block still add up to simulate's
    # numbers (the DP logs an error when its own model disagrees)
    p = transformer(10, rotary=True)
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    every = SOLVERS["every_block"](p, 10**18, 1.0).peak_bytes
    budget = every + int(frac * (store - every))
    with caplog.at_level(logging.ERROR, logger="solvers.dp.search"):
        sol = dp.solve(p, budget, math.inf, max_front=64)
    assert not caplog.records, caplog.records[0].getMessage()
    assert sol.feasible and sol.peak_bytes <= budget
    check_reported_numbers(p, sol)


def test_solves_of_one_problem_share_their_profiles_and_answer_as_fresh_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`dp.solve(shared=...)`, as the lowest-peak bisection asks at budget after budget:
    the window profiles do not depend on the budget, so the later solves profile a fraction
    of what fresh ones do, and every answer (schedule, bound, proof) is the fresh one's,
    first fits and infeasible budgets included."""
    p = transformer(6, rotary=True)
    every = SOLVERS["every_block"](p, 10**18, 1.0).peak_bytes
    budgets = [_halfway(p), every, _halfway(p) + 1, every - 1, p.static_bytes + 1]
    calls = _counting_profiles(monkeypatch)
    shared: dict = {}
    fresh_calls = shared_calls = 0
    for budget in budgets:
        for first_fit in (False, True):
            calls[0] = 0
            fresh = dp.solve(p, budget, math.inf, first_fit=first_fit)
            fresh_calls += calls[0]
            calls[0] = 0
            again = dp.solve(p, budget, math.inf, first_fit=first_fit, shared=shared)
            shared_calls += calls[0]
            assert (again.status, again.objective_ms, again.bound_ms, again.peak_bytes) == (
                fresh.status, fresh.objective_ms, fresh.bound_ms, fresh.peak_bytes), budget
            assert (again.schedule is None) == (fresh.schedule is None)
            if fresh.schedule is not None:
                assert again.schedule.describe() == fresh.schedule.describe()
    assert shared_calls < fresh_calls / 3, (shared_calls, fresh_calls)


def test_thinned_fronts_grow_until_the_gap_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    p = transformer(8, rotary=True)
    budget = _halfway(p)
    grown = dp.solve(p, budget, math.inf, max_front=8)
    monkeypatch.setattr(dp_module, "MAX_FRONT_GROWTH", 1)
    fixed = dp.solve(p, budget, math.inf, max_front=8)
    assert fixed.gap is not None and grown.gap is not None
    assert grown.objective_ms <= fixed.objective_ms + 1e-9
    assert grown.bound_ms > fixed.bound_ms
    assert grown.gap < fixed.gap
    # the grown bound is still a bound: no schedule of the full-front DP beats it
    exact = dp.solve(p, budget, math.inf)
    assert grown.bound_ms <= exact.objective_ms + 1e-9


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 5)), max_size=30),
       st.sampled_from([0.0, 1e-12, 1.0]))
def test_pareto_indices_keep_exactly_the_undominated_points(points, tol: float) -> None:
    _assert_front(points, tol)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60_000), st.integers(0, 40)), max_size=60),
       st.sampled_from([0.0, 1e-12, 3.0]))
def test_long_fronts_prefiltered_by_cells_lose_no_point(points, tol: float) -> None:
    """The prefilter of long inputs (`front._undominated`, forced here on short ones, over
    cells of several costs) keeps every front point and breaks ties alike."""
    with unittest.mock.patch.object(front, "PREFILTER_MIN", 1), \
            unittest.mock.patch.object(front, "PREFILTER_CELLS", 16):
        _assert_front(points, tol)


def _assert_front(points: list[tuple[int, int]], tol: float) -> None:
    cost = np.asarray([c for c, _ in points], dtype=np.int64)
    loss = np.asarray([float(v) for _, v in points])
    kept = pareto_indices(cost, loss, tol)
    assert list(cost[kept]) == sorted(cost[kept])  # by ascending cost
    for i in range(len(points)):
        # a point is on the front when every cheaper point loses more than `tol` more;
        # of equal costs, the least loss, then the earliest point
        cheaper = [j for j in range(len(points)) if cost[j] < cost[i]]
        same = [j for j in range(len(points)) if cost[j] == cost[i]]
        first_best = min(same, key=lambda j: (loss[j], j))
        on_front = i == first_best and all(loss[i] < loss[j] - tol for j in cheaper)
        assert (i in kept) == on_front, (points, tol, i, kept)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 8)),
                         min_size=1, max_size=20), min_size=1, max_size=4),
       st.sampled_from([(10_000, 10**9), (10_000, 0), (3, 10**9)]))
def test_lower_fronts_with_forward_bytes_drop_only_what_they_dominate(chunks, limits) -> None:
    """Where an entry's bytes at later forwards (`fwd`) differ from its held bytes, a
    lower-bound front keeps every entry that no kept one dominates in all three (held,
    fwd, time), each a real entry with its back-pointer; where too many to check
    (`DOMINANCE_CELLS` 0) or thinned (`max_front` 3), it keeps optimistic corners that
    still dominate every entry. Before, a two-way front lowered an entry's `fwd` to that
    of one it dominated only in held bytes and time: a corner, though none was needed."""
    max_front, cells = limits
    f = front.Front()
    entries = []
    for c, chunk in enumerate(chunks):
        held = np.asarray([h + d for h, d, _ in chunk], dtype=np.int64)
        f.add(held, np.asarray([float(t) for _, _, t in chunk]), c,
              fwd=np.asarray([h for h, _, _ in chunk], dtype=np.int64))
        entries += [(h + d, h, float(t), c, i) for i, (h, d, t) in enumerate(chunk)]
    with unittest.mock.patch.object(front, "DOMINANCE_CELLS", cells):
        f.prune(max_front, optimistic=True)
    kept = list(zip(f.held.tolist(), f.fwd.tolist(), f.time.tolist(),
                    [f.info[s] for s in f.src], f.idx.tolist(), strict=True))
    assert list(f.held) == sorted(f.held)
    for held, fwd, tms, _, _ in entries:
        assert any(k[0] <= held and k[1] <= fwd and k[2] <= tms for k in kept), (held, fwd, tms)
    if max_front > len(entries) and cells:
        assert all(k in entries for k in kept)
