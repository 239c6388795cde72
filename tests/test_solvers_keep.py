"""The keep space (`solvers.keep`): per-node terms that add up to what `accounting` and
`simulate` say, exact Pareto fronts, and a DP bound that holds over every kept subset."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_solvers_nested_accounting import graphs

from solvers import Problem, Schedule, keep, simulate
from solvers.accounting import Context, evaluate, profile_parts
from solvers.dp import search as dp
from solvers.keep import KeepSpace, choices, pareto_front
from solvers.problem import ModuleSpan
from solvers.schedule import RECOMPUTE, Region


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(graphs(), st.data())
def test_keeping_a_set_adds_up_its_nodes_terms(p: Problem, data: st.DataObject) -> None:
    n = p.n_nodes
    x = data.draw(st.integers(0, n - 2))
    y = data.draw(st.integers(x + 1, n - 1))  # never the loss
    assume(all(p.recomputable[x:y]))
    ctx = Context(p)
    space = KeepSpace.analyse(ctx, 0, n, x, y)
    assume(space is not None)
    chosen = sorted(data.draw(st.sets(st.sampled_from(range(len(space.nodes))))
                              if space.nodes else st.just(set())))
    keep = [space.nodes[i] for i in chosen]
    want = profile_parts(ctx, 0, n, [ctx.region(x, y, keep)])
    got = space.parts(chosen)
    assert got.local.tolist() == want.local.tolist()
    assert (got.residue_bytes, got.held_out) == (want.residue_bytes, want.held_out)
    assert (space.floor <= got.local).all()
    held = sum(space.residue[i] for i in chosen)  # a floor for every set holding as much
    assert (space.floor_for(held) <= got.local).all()
    assert (space.floor_for(held // 2) <= space.floor_for(held)).all()
    stop = ctx.region(x, y).stop  # the SAC term counts the ops the rerun runs
    sac = p.checkpoint_overhead_ms(x, stop, [x]) - p.checkpoint_overhead_ms(x, stop)
    saved = space.saved_for(chosen)  # what each kept node saves, its skipped chain's too
    rerun = space.base.time_ms + (sac if keep else 0) - saved
    if space.exact:
        assert want.time_ms == pytest.approx(rerun, abs=1e-9)
    else:  # a group too large to price whole: its savings never fall short
        assert want.time_ms >= rerun - 1e-9
    schedule = Schedule.from_segments(n, [Region(x, y, RECOMPUTE, keep=keep)])
    assert p.static_bytes + got.peak(ctx, 0) == evaluate(p, schedule)[0] == simulate(
        p, schedule).peak_bytes


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(graphs(), st.data())
def test_nodes_left_out_of_the_keep_space_never_help(p: Problem, data: st.DataObject) -> None:
    """Keepable nodes that are not candidates (the rerun never runs them) only hold
    memory: no slot lower, nothing fewer held past the forward, no time saved."""
    n = p.n_nodes
    x = data.draw(st.integers(0, n - 2))
    y = data.draw(st.integers(x + 1, n - 1))
    assume(all(p.recomputable[x:y]))
    ctx = Context(p)
    space = KeepSpace.analyse(ctx, 0, n, x, y)
    assume(space is not None)
    others = [k for k in range(x, y) if p.can_keep(k) and k not in space.nodes]
    assume(others)
    base = profile_parts(ctx, 0, n, [ctx.region(x, y, space.nodes)])
    more = profile_parts(ctx, 0, n, [ctx.region(x, y, [*space.nodes, *others])])
    assert (more.local >= base.local).all() and more.residue_bytes >= base.residue_bytes
    assert more.time_ms >= base.time_ms - 1e-9


def _brute_front(residue: list[int], saved: list[float]) -> list[tuple[int, float]]:
    subsets = [c for r in range(len(residue) + 1)
               for c in itertools.combinations(range(len(residue)), r)]
    sums = [(sum(residue[i] for i in c), sum(saved[i] for i in c)) for c in subsets]
    return sorted({(r, s) for r, s in sums
                   if not any(r2 <= r and s2 >= s and (r2, s2) != (r, s) for r2, s2 in sums)})


@pytest.mark.parametrize("seed", range(6))
def test_pareto_front_is_the_brute_force_front(seed: int) -> None:
    rng = random.Random(seed)
    k = rng.randint(3, 9)
    residue = [rng.choice([0, 1, 2, 4, 4, 8, 16]) for _ in range(k)]
    saved = [rng.choice([0.0, 0.5, 1.0, 1.5, 3.0]) for _ in range(k)]
    front, thinned = pareto_front(residue, saved)
    assert not thinned
    assert [(r, s) for r, s, _ in front] == [(r, pytest.approx(s)) for r, s in
                                             _brute_front(residue, saved)]
    for r, s, items in front:  # each point is a real subset
        assert r == sum(residue[i] for i in items)
        assert s == pytest.approx(sum(saved[i] for i in items))


@pytest.mark.parametrize("seed", range(4))
def test_thinned_fronts_keep_real_points_or_optimistic_corners(seed: int) -> None:
    rng = random.Random(seed)
    residue = [rng.randint(1, 50) for _ in range(10)]
    saved = [rng.uniform(0.1, 5.0) for _ in range(10)]
    exact = _brute_front(residue, saved)
    real, thinned = pareto_front(residue, saved, max_points=4)
    corners, _ = pareto_front(residue, saved, max_points=4, optimistic=True)
    assert thinned and len(real) < len(exact)
    for r, _, items in real:
        assert r == sum(residue[i] for i in items)
    for r, s in exact:  # every subset is matched or beaten by a corner
        assert any(cr <= r and cs >= s - 1e-9 for cr, cs, _ in corners)


def _two_blocks(seed: int) -> Problem:
    """A chain with two module calls of four nodes, some with large forward temporaries:
    where a rerun peaks decides which kept outputs fit, not only their bytes and time."""
    rng = random.Random(seed)
    size, n = 4, 10
    p = Problem.chain([rng.choice([2, 4, 8, 16, 32]) for _ in range(n)],
                      [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(n)],
                      fwd_temp_bytes=[rng.choice([0, 0, 0, 40, 80]) for _ in range(n)],
                      block_of_node=[-1] + [i // size for i in range(2 * size)] + [-1])
    return p.model_copy(update={"module_spans": [
        ModuleSpan(start=1 + b * size, stop=1 + (b + 1) * size, name=f"b{b}", inputs=(b * size,))
        for b in range(2)]})


def _every_call_keeping_any_subset(p: Problem) -> list[Schedule]:
    calls = [(span.start, span.stop) for span in p.module_spans]
    per_call = [[None] + [list(c) for r in range(b - a + 1)
                          for c in itertools.combinations(range(a, b), r)] for a, b in calls]
    return [Schedule.from_segments(p.n_nodes, [Region(a, b, RECOMPUTE, keep=k) for (a, b), k
                                               in zip(calls, choice, strict=True) if k is not None])
            for choice in itertools.product(*per_call)]


@pytest.mark.parametrize(("seed", "front_points"), [(12, 256), (3, 256), (12, 1), (3, 2)])
def test_dp_bound_holds_over_every_kept_subset(seed: int, front_points: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """At every budget where the answer changes, the lower-bound pass is at most the best
    schedule of all (each call checkpointed or not, keeping any subset); with seed 12 that
    best keeps a set off the (bytes, time) front, which only the floor covers. With fronts
    thinned to 1 or 2 points, the lower pass runs on their optimistic corners."""
    monkeypatch.setattr(keep, "FRONT_POINTS", front_points)
    p = _two_blocks(seed)
    sims = [simulate(p, s) for s in _every_call_keeping_any_subset(p)]
    ctx = Context(p)
    lay = dp._layout(ctx)
    for budget in sorted({tl.peak_bytes for tl in sims}):
        best = min(tl.recompute_time_ms for tl in sims if tl.peak_bytes <= budget)
        lower = dp._run(ctx, lay, budget - p.static_bytes, 2000, True,
                        math.inf, {}, len(lay.stages)).found
        assert lower is not None and lower[0] <= best + 1e-9, budget  # before any claim
        sol = dp.solve(p, budget, math.inf)
        assert sol.feasible and sol.peak_bytes <= budget
        assert sol.bound_ms <= best + 1e-9 <= sol.objective_ms + 2e-9
        coarse = dp.solve(p, budget, math.inf, keep_front=False)  # nothing or the matmuls
        assert not coarse.feasible or sol.objective_ms <= coarse.objective_ms
        assert sol.space.keep == "stage-any"


def test_choices_offer_each_export_subset_and_the_hand_policies() -> None:
    p = _two_blocks(0)
    ctx = Context(p)
    a, b = p.blocks()[0]
    space = KeepSpace.analyse(ctx, a, b, a, b)
    assert space is not None and space.nodes
    options, _ = choices(space, also=[[0]])
    assert all(c.real and c.chosen for c in options)
    assert (0,) in {c.chosen for c in options}
    lower, _ = choices(space, optimistic=True, also=[[0]])
    assert len(lower) <= len(options)


def test_a_larger_residue_never_lowers_the_floor() -> None:
    """Found by the property above: a lowering term split as taken * cost + (1 - taken) *
    cost rounded the floor for 15 residue bytes one byte below the floor for 7."""
    p = Problem(
        name="rounding", node_names=[f"v{i}" for i in range(7)], fwd_time_ms=[0.1] * 7,
        bwd_time_ms=[1.0] * 7, fwd_temp_bytes=[0, 0, 30, 0, 0, 0, 0], bwd_temp_bytes=[0] * 7,
        recomputable=[False, True, True, True, True, False, False],
        node_inputs=[[], [0], [1], [2], [3], [4], [6]],
        node_outputs=[[0], [1], [2], [3], [4, 5], [6], [7]], node_saved=[[]] * 7,
        storage_bytes=[1, 1, 43, 1, 1, 14, 1, 1], storage_producer=[0, 1, 2, 3, 4, 4, 5, 6],
        storage_grad_bytes=[1, 1, 43, 1, 1, 0, 1, 1], static_bytes=0,
        param_grad_bytes=[0] * 7, optimizer_step_bytes=0, block_of_node=[0] * 7,
        node_saves_static=[True] * 7, node_packs_before_running=[False] * 7,
        node_grad_inputs=[[]] * 7, keepable=[False, False, True, False, True, False, False],
        checkpoint_region_ms=0.0, checkpoint_pack_ms=0.0, checkpoint_sac_op_ms=0.0,
        node_ops=[0] * 7)
    space = KeepSpace.analyse(Context(p), 0, 7, 1, 5)
    floors = [space.floor_for(r) for r in range(0, 40)]
    assert all((a <= b).all() for a, b in itertools.pairwise(floors))


def _identical_blocks_timed_apart(blocks: int = 4, size: int = 4) -> Problem:
    """A chain of identical module calls whose forward times differ (as measured ones do):
    the DP shares a call's keep analysis between identical windows, not its times."""
    pattern, temps = [16, 4, 32, 8], [0, 40, 0, 0]
    sizes = [8] + pattern * blocks + [8]
    times = [1.0] + [t * (1 + 0.25 * b) for b in range(blocks) for t in (1.0, 2.0, 0.5, 3.0)]
    p = Problem.chain(sizes, [*times, 1.0], fwd_temp_bytes=[0] + temps * blocks + [0],
                      block_of_node=[-1] + [i // size for i in range(blocks * size)] + [-1])
    return p.model_copy(update={"module_spans": [
        ModuleSpan(start=1 + b * size, stop=1 + (b + 1) * size, name=f"b{b}",
                   inputs=(b * size,)) for b in range(blocks)]})


def test_a_keep_analysis_shared_by_identical_blocks_keeps_each_blocks_own_nodes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared by window signature, the keep analysis of one block was used with its own
    block's nodes at another block's position: kept nodes outside the region (a 6-layer
    BERT crashed: "saved node 87 is outside region [127, 166)"). Every keep option the DP
    builds lies in its window, at every budget, and every answer's keeps in their regions."""
    p = _identical_blocks_timed_apart()
    options: list[tuple[int, tuple]] = []
    offers = dp._Pass._keep_options

    def recorded(self, a, b, x, y, held_in, key):
        made = offers(self, a, b, x, y, held_in, key)
        options.extend((a, option.spec) for option in made)
        return made

    monkeypatch.setattr(dp._Pass, "_keep_options", recorded)
    unplanned = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    for budget in range(p.static_bytes + 40, unplanned + 1, 4):
        sol = dp.solve(p, budget, math.inf)
        for region in sol.schedule.recompute_regions() if sol.schedule else ():
            assert all(region.start <= k < region.stop for k in region.keep), region
    assert {a for a, _ in options} - {1}, "no block other than the first offered keeps"
    for a, spec in options:
        for x, y, kept, _ in spec:
            assert all(x <= k < y for k in kept), (a, spec)
