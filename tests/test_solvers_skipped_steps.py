"""F9 (`solvers.frame.dead_steps`): a rerun skips the steps whose values nothing it runs
needs, and every solver prices that as `simulate` replays it."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_solvers_exact import _budget, _matches_bruteforce
from test_solvers_properties import check_reported_numbers, problems

from solvers import (
    Problem,
    Region,
    Schedule,
    Status,
    bruteforce,
    cpsat,
    keep,
    memory_lower_bound,
    simulate,
)
from solvers.accounting import Context, evaluate
from solvers.dp import search as dp
from solvers.frame import dead_steps, may_skip, region_rules, region_skips, skip_covers
from solvers.keep import KeepSpace
from solvers.testing import transformer

MANY = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def attention(skippable: bool = True) -> Problem:
    """q -> scores (saves q) -> scale (saves nothing) -> softmax (saves its output) -> ctx
    (saves the softmax) -> loss; scores and scale skippable."""
    saved = [[], [0], [], [3], [3], [4]]
    return Problem(
        name="attention", node_names=["q", "scores", "scale", "softmax", "ctx", "loss"],
        fwd_time_ms=[1.0, 2.0, 3.0, 4.0, 5.0, 1.0], bwd_time_ms=[1.0] * 6,
        fwd_temp_bytes=[0] * 6, bwd_temp_bytes=[0] * 6, recomputable=[True] * 5 + [False],
        node_inputs=[[], [0], [1], [2], [3], [4]], node_outputs=[[i] for i in range(6)],
        node_saved=saved, storage_bytes=[8, 32, 32, 32, 8, 1], storage_producer=list(range(6)),
        storage_grad_bytes=[8, 32, 32, 32, 8, 1], static_bytes=0, param_grad_bytes=[0] * 6,
        node_skippable=[False, True, True, False, False, False] if skippable else None)


def test_keeping_the_softmax_skips_the_steps_that_only_feed_it() -> None:
    p = attention()
    rules = region_rules(p, Region(0, 5, "recompute"))
    assert dead_steps(p, rules, 0, {3}) == {1, 2}  # q runs: scores' pack saves it
    assert dead_steps(p, rules, 0, set()) == frozenset()  # nothing cached: nothing skipped
    assert dead_steps(p, rules, 0, {2}) == {1}
    keep_softmax = Schedule.from_segments(6, [Region(0, 5, "recompute", keep=[3])])
    timeline = simulate(p, keep_softmax)
    assert timeline.recompute_time_ms == 1.0 + 5.0  # q and ctx: not scores, scale, softmax
    assert [e.label for e in timeline.events if "skipped" in e.label] == [
        f"recompute:{name} (skipped: nothing needs it)" for name in ("scores", "scale")]
    # skipped, a step still makes its outputs (uninitialized): the memory is the same
    plain = attention(skippable=False)
    assert timeline.peak_bytes == simulate(plain, keep_softmax).peak_bytes
    assert simulate(plain, keep_softmax).recompute_time_ms == 1.0 + 2.0 + 3.0 + 5.0
    assert evaluate(p, keep_softmax) == (timeline.peak_bytes, 6.0)


def test_a_kept_node_in_anothers_chain_is_priced_with_it() -> None:
    """scale lies in softmax's chain: keeping both saves what keeping softmax saves, plus
    nothing for scale (it was skipped anyway); the keep space prices the pair as a whole."""
    p = attention()
    space = KeepSpace.analyse(Context(p), 0, 6, 0, 5)
    index = {k: i for i, k in enumerate(space.nodes)}
    scale, softmax = index[2], index[3]
    assert any({scale, softmax} <= set(g) for g in space.groups)
    assert space.saved_for([softmax]) == 2.0 + 3.0 + 4.0
    assert space.saved_for([scale, softmax]) == 2.0 + 3.0 + 4.0  # not 2 + 3 + (2 + 3 + 4)
    alone = p.model_copy(update={"keepable": [True, False, False, True, True, False]})
    space_alone = KeepSpace.analyse(Context(alone), 0, 6, 0, 5)  # its chain holds no candidate
    assert space_alone.groups == () and space_alone.nodes == (0, 3, 4)
    assert space_alone.saved_ms[1] == space_alone.saved_for([1]) == 2.0 + 3.0 + 4.0
    for chosen in ([scale], [softmax], [scale, softmax]):
        keep = [space.nodes[i] for i in chosen]
        schedule = Schedule.from_segments(6, [Region(0, 5, "recompute", keep=keep)])
        rerun = simulate(attention(skippable=False), schedule).recompute_time_ms
        assert simulate(p, schedule).recompute_time_ms == rerun - (
            space.saved_for(chosen) - sum(p.fwd_time_ms[k] for k in keep))


def test_a_group_too_large_to_price_whole_never_prices_below_its_savings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keep, "GROUP_MAX", 1)
    p = attention()
    space = KeepSpace.analyse(Context(p), 0, 6, 0, 5)
    assert not space.exact and space.groups == ()
    index = {k: i for i, k in enumerate(space.nodes)}
    both = [index[2], index[3]]  # scale (in softmax's chain) and softmax
    assert space.saved_for(both) == (3.0 + 2.0) + (4.0 + 3.0 + 2.0) > 4.0 + 3.0 + 2.0


def projection() -> Problem:
    """proj -> q, k and v copies of its output -> scores (saves q and k) -> ctx (saves
    scores and v) -> head (saves ctx, makes much) -> loss; proj and the copies skippable:
    proj's output is read by three copies, so only keeping all three skips it."""
    names = ["proj", "q", "k", "v", "scores", "ctx", "head", "loss"]
    sizes = [24, 8, 8, 8, 16, 8, 64, 1]
    return Problem(
        name="projection", node_names=names,
        fwd_time_ms=[8.0, 1.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0], bwd_time_ms=[1.0] * 8,
        fwd_temp_bytes=[0] * 8, bwd_temp_bytes=[0] * 8, recomputable=[True] * 7 + [False],
        node_inputs=[[], [0], [0], [0], [1, 2], [4, 3], [5], [6]],
        node_outputs=[[i] for i in range(8)],
        node_saved=[[], [], [], [], [1, 2], [4, 3], [5], [6]],
        storage_bytes=sizes, storage_producer=list(range(8)), storage_grad_bytes=sizes,
        static_bytes=0, param_grad_bytes=[0] * 8,
        node_skippable=[True, True, True, True, False, False, False, False])


def test_a_step_read_by_several_is_skipped_when_every_reader_is_kept() -> None:
    """proj's output feeds three copies: a rerun keeping all three skips proj, one keeping
    two runs it (the third needs it); the keep space prices the three as one group, each
    subset as `simulate` replays it, and the DP keeps the three where it pays."""
    p = projection()
    rules = region_rules(p, Region(0, 6, "recompute"))
    assert dead_steps(p, rules, 0, {1, 2, 3}) == {0}
    assert dead_steps(p, rules, 0, {1, 2}) == frozenset()
    assert skip_covers(p, rules, 0, {1, 2, 3}, 8) == {0: [frozenset({1, 2, 3})]}
    space = KeepSpace.analyse(Context(p), 0, 8, 0, 6)
    index = {k: i for i, k in enumerate(space.nodes)}
    copies = sorted(index[k] for k in (1, 2, 3))
    assert any(set(copies) <= set(g) for g in space.groups) and space.exact
    plain = p.model_copy(update={"node_skippable": None})
    for chosen in itertools.chain.from_iterable(
            itertools.combinations(copies, n) for n in range(1, 4)):
        keep = [space.nodes[i] for i in chosen]
        schedule = Schedule.from_segments(8, [Region(0, 6, "recompute", keep=keep)])
        rerun = simulate(plain, schedule).recompute_time_ms
        assert simulate(p, schedule).recompute_time_ms == rerun - (
            space.saved_for(chosen) - sum(p.fwd_time_ms[k] for k in keep))
    assert space.saved_for(copies) == 3.0 + 8.0
    # room to keep the copies, not the projection: the DP's stages (the fan-out merges the
    # block into one) reach the exact optimum only by skipping the projection
    budget = _budget(p, 0.7)
    sol, without = dp.solve(p, budget, math.inf), dp.solve(plain, budget, math.inf)
    exact = cpsat.solve(p, budget, 20.0, deterministic=True)
    assert sol.status == exact.status == Status.OPTIMAL
    check_reported_numbers(p, sol)
    assert sol.objective_ms == pytest.approx(exact.objective_ms)
    assert sol.objective_ms < without.objective_ms
    assert any(region_skips(p, r) == {0} for r in sol.schedule.recompute_regions())


def test_the_dp_plans_reruns_that_skip_and_runs_faster_for_it() -> None:
    """A GPT-like chain whose score matmuls are skippable: at budgets where blocks keep their
    softmax, the DP's plan reruns less than it can without F9, as `simulate` replays it."""
    plain = transformer(2, width=1)
    skippable = [plain.op_kind[i] == "bmm" and not set(plain.saved[i]) & set(plain.outputs[i])
                 for i in range(plain.n_nodes)]
    p = plain.model_copy(update={"node_skippable": skippable})
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    low = memory_lower_bound(p)
    budget = low + int((store - low) * 0.6)
    sol, without = dp.solve(p, budget, math.inf), dp.solve(plain, budget, math.inf)
    assert sol.status == without.status == Status.OPTIMAL
    timeline = simulate(p, sol.schedule)
    assert sol.objective_ms == pytest.approx(timeline.recompute_time_ms)
    assert any("skipped" in e.label for e in timeline.events)
    assert sol.objective_ms < without.objective_ms - 0.1


def test_bounds_leave_out_what_a_rerun_may_skip() -> None:
    assert may_skip(attention()).tolist() == [False, True, True, False, False, False]
    assert not may_skip(attention(skippable=False)).any()


@MANY
@given(problems(max_nodes=6, skippable=True), st.floats(0.0, 1.2))
def test_dp_and_cpsat_reach_the_bruteforce_optimum_where_reruns_skip(p: Problem,
                                                                     frac: float) -> None:
    p = p.model_copy(update={"block_of_node": None})  # node-level stages
    budget = _budget(p, frac)
    best = bruteforce.solve(p, budget, math.inf)
    sol = dp.solve(p, budget, math.inf)
    check_reported_numbers(p, sol)
    if dp.applies(p):
        _matches_bruteforce(sol, best, "dp")
        assert not sol.feasible or sol.status == Status.OPTIMAL
    exact = cpsat.solve(p, budget, 20.0, deterministic=True)
    assert exact.feasible == best.feasible
    if best.feasible:
        assert exact.objective_ms == pytest.approx(best.objective_ms, abs=1e-6)
        check_reported_numbers(p, exact)
