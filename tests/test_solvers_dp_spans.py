"""The DP on long chains (capped spans bracket the optimum) and its nested options."""

from __future__ import annotations

import logging
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_solvers_nested_accounting import graphs
from test_solvers_properties import check_reported_numbers

from solvers import SOLVERS, Schedule, Status, baselines, memory_lower_bound, simulate
from solvers.accounting import Context
from solvers.dp import search as dp
from solvers.dp import space as dp_space
from solvers.testing import transformer


def _passes(p, budget: int, span: int, splittable_at: int, monkeypatch: pytest.MonkeyPatch,
            keep_front: bool = False) -> tuple[float, float]:
    monkeypatch.setattr(dp, "SPLIT_RELAXED_STAGES", splittable_at)
    ctx = Context(p)
    lay = dp._layout(ctx, keep_front)
    limit = budget - p.static_bytes
    deadline = math.inf  # no time limit: the passes run to the end
    upper = dp._run(ctx, lay, limit, 2000, False, deadline, {}, span).found
    lower = dp._run(ctx, lay, limit, 2000, True, deadline, {}, span).found
    assert lower is not None
    return (upper[0] if upper is not None else float("inf")), lower[0]


@pytest.mark.parametrize("frac", [0.2, 0.7])
@pytest.mark.parametrize("splittable_at", [0, 10**6], ids=["split-safe", "every-length"])
def test_capped_spans_bracket_the_optimum(frac: float, splittable_at: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    p = transformer(10, 1)
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    low_peak = SOLVERS["every_block"](p, 10**18, 1.0).peak_bytes
    budget = low_peak + int(frac * (store - low_peak))
    # 15 stages: the full space in one pass (blocks keep nothing or their matmuls); no time
    # limit, so the proof is the DP's whatever the machine's speed
    opt = dp.solve(p, budget, math.inf, keep_front=False)
    assert opt.status == Status.OPTIMAL
    any_keep = dp.solve(p, budget, math.inf)  # blocks keep any subset: its gap is proven
    assert any_keep.bound_ms <= any_keep.objective_ms <= opt.objective_ms
    tightest = None
    for span in (1, 2, 3):
        upper, lower = _passes(p, budget, span, splittable_at, monkeypatch)
        assert lower <= opt.objective_ms + 1e-6 <= upper + 2e-6, (span, lower, upper)
        tightest = lower if tightest is None else max(tightest, lower)
        _, lower = _passes(p, budget, span, splittable_at, monkeypatch, keep_front=True)
        assert lower <= any_keep.objective_ms + 1e-6, (span, lower)
    # relaxing every length (every kept output in the residue) is the tight bound; the
    # split-safe one leaves unsaved kept outputs out and is much looser (see dp docstring)
    assert tightest > (0.5 if splittable_at else 0.2) * opt.objective_ms or opt.objective_ms == 0


def test_solve_on_a_long_chain_reports_a_proven_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    p = transformer(10, 1)
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    budget = int(0.6 * store)
    # the reference: the optimum over flat schedules whose blocks keep any subset (its 15
    # stages in one pass, nesting off). No time limits: every verdict here is the DP's own,
    # whatever the machine's speed
    monkeypatch.setattr(dp, "NEST_MAX_STAGES", 0)
    flat = dp.solve(p, budget, math.inf)
    assert flat.status == Status.OPTIMAL
    assert not any(r.children for r in flat.schedule.regions)
    monkeypatch.undo()
    monkeypatch.setattr(dp, "FULL_SPAN_STAGES", 4)
    monkeypatch.setattr(dp, "FIRST_SPAN", 2)
    sol = dp.solve(p, budget, math.inf)  # segments capped at 2, 4, 8 stages, then 15
    assert sol.feasible and sol.bound_ms is not None
    assert sol.bound_ms <= sol.objective_ms + 1e-9
    # a bound over the flat space (or one holding it) is below that space's optimum
    assert sol.bound_ms <= flat.objective_ms + 1e-6
    if not any(r.children for r in sol.schedule.regions):  # and a flat answer not below it
        assert flat.objective_ms <= sol.objective_ms + 1e-6


def test_nested_options_reach_below_flat_schedules(caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotor's two-level checkpoints: below every flat schedule's minimum the dp still finds
    a nested one; its own time model agrees with simulate (no error logged)."""
    p = transformer(12, 1)
    every_block = SOLVERS["every_block"](p, 10**18, 1.0).peak_bytes
    budget = every_block - 64 * 2**20
    monkeypatch.setattr(dp, "NEST_MAX_STAGES", 0)
    # no time limit: infeasible because no flat schedule fits, not because time ran out
    flat = dp.solve(p, budget, math.inf)
    assert not flat.feasible
    monkeypatch.undo()
    with caplog.at_level("ERROR", logger="solvers.dp.search"):
        sol = dp.solve(p, budget, math.inf)
    assert not caplog.records
    assert sol.status == Status.OPTIMAL and sol.peak_bytes <= budget
    assert any(r.children for r in sol.schedule.regions)
    check_reported_numbers(p, sol)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(graphs(), st.floats(0.0, 1.0))
def test_dp_model_agrees_with_simulate_nested_included(p, frac: float) -> None:
    """On random chains (node-level stages, so windows of 2..8 nodes get nested options;
    checkpoint overheads, static saves, nodes that pack before running) the dp's internal
    time and memory model equals simulate for the schedule it returns."""
    p = p.model_copy(update={"block_of_node": None})
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    lower = memory_lower_bound(p)
    budget = lower + int((store - lower) * frac)
    logger = logging.getLogger("solvers.dp.search")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        sol = dp.solve(p, budget, math.inf)  # no time limit: never vacuous for want of time
    finally:
        logger.removeHandler(handler)
    assert not records, records[0].getMessage()
    check_reported_numbers(p, sol)
    _held_baselines_beaten(p, sol, budget)


def _held_baselines_beaten(p, sol, budget: int) -> int:
    """Asserts the DP's answer is no slower than each baseline that meets the budget with a
    schedule of the DP's space (it is exact over that space); returns how many there were."""
    held = 0
    for name, baseline in baselines.BASELINES.items():
        base = baseline(p, budget, 1.0)
        if base.feasible and dp_space.holds_regions(p, [(r.start, r.stop, frozenset(r.keep))
                                                  for r in base.schedule.recompute_regions()]):
            held += 1
            assert sol.feasible, f"the DP found nothing where {name} fits"
            assert sol.objective_ms <= base.objective_ms + 1e-6, (name, sol.objective_ms,
                                                                  base.objective_ms)
    return held


def test_models_agree_where_reruns_stop_before_running_with_overheads(
        caplog: pytest.LogCaptureFixture) -> None:
    """A transformer whose matmuls pack their inputs before running (so most reruns stop
    short of their last node) with every checkpoint overhead on: dp's and cpsat's models of
    time and memory equal simulate at several budgets."""
    p = transformer(4, 1).model_copy(update={
        "checkpoint_region_ms": 0.4, "checkpoint_pack_ms": 0.04, "checkpoint_sac_op_ms": 0.1})
    assert any(p.stops_before_running)
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    lower = memory_lower_bound(p)
    for frac in (0.2, 0.5, 0.8):
        budget = lower + int((store - lower) * frac)
        for name in ("dp", "cpsat"):  # the DP without a limit: its answer is its optimum
            with caplog.at_level("ERROR"):
                sol = SOLVERS[name](p, budget, math.inf if name == "dp" else 30.0)
            assert not caplog.records, caplog.records[0].getMessage()
            check_reported_numbers(p, sol)
            if name == "dp":
                _held_baselines_beaten(p, sol, budget)
