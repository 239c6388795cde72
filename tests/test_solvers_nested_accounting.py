"""`accounting` on schedules with one level of nested checkpoints equals `simulate`."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_solvers_properties import problems

from solvers import Offload, Problem, Region, Schedule, simulate
from solvers.accounting import (
    RELEASED,
    Context,
    RegionInfo,
    evaluate,
    profile_parts,
    table_index,
)
from solvers.frame import region_rules
from solvers.problem import HostLink
from solvers.region_analysis import _NestedAnalysis

MANY = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def graphs(draw: st.DrawFn) -> Problem:
    """A chain or DAG like `test_solvers_properties.problems`, plus what those lack: a
    storage read by many later nodes (an attention mask, pinned by `dp`), nodes saving only
    static tensors, a loss that saves its own output, checkpoint overheads, and forward
    times whose float sums depend on the order (evaluate must add them as simulate does)."""
    p = draw(problems(max_nodes=9))
    n = p.n_nodes
    if draw(st.booleans()):
        p = p.model_copy(update={
            "fwd_time_ms": [draw(st.sampled_from([0.1, 0.3, 1.7, 2.9])) for _ in range(n)],
            "checkpoint_region_ms": draw(st.sampled_from([0.0, 0.7])),
            "checkpoint_pack_ms": draw(st.sampled_from([0.0, 0.11])),
            "checkpoint_sac_op_ms": draw(st.sampled_from([0.0, 0.13])),
            "node_ops": draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))})
    if n < 3 or not draw(st.booleans()):
        return p
    inputs = [list(x) for x in p.node_inputs]
    saved = [list(x) for x in p.node_saved]
    grads = [list(x) for x in p.grad_inputs]
    mask = p.outputs[draw(st.integers(0, n - 3))][0]
    for i in range(p.storage_producer[mask] + 1, n):
        if mask not in inputs[i] and draw(st.integers(0, 2)) > 0:
            inputs[i].append(mask)
            grads[i].append(mask)
            if draw(st.booleans()):
                saved[i].append(mask)
    if draw(st.booleans()):
        saved[-1] = list(dict.fromkeys([*saved[-1], *p.outputs[-1]]))
    static = [draw(st.integers(0, 5)) == 0 for _ in range(n)]
    before = p.node_packs_before_running and [
        b and not set(saved[i]) & set(p.outputs[i])
        for i, b in enumerate(p.node_packs_before_running)]
    return p.model_copy(update={"node_inputs": inputs, "node_saved": saved,
                                "node_grad_inputs": grads, "node_saves_static": static,
                                "node_packs_before_running": before})


def _keep(draw: st.DrawFn, p: Problem, nodes: list[int]) -> frozenset[int]:
    return frozenset(k for k in nodes if p.can_keep(k) and draw(st.integers(0, 2)) == 0)


def _nested(draw: st.DrawFn, p: Problem, a: int, b: int) -> Region:
    """A RECOMPUTE region [a, b) with random disjoint children (one may span all of it)."""
    bounds = sorted(draw(st.sets(st.integers(a, b), max_size=6)) | {a, b})
    children = []
    for ca, cb in itertools.pairwise(bounds):
        if draw(st.integers(0, 2)) > 0:
            children.append(Region(ca, cb, "recompute", keep=_keep(draw, p, list(range(ca, cb)))))
    inside = {k for c in children for k in range(c.start, c.stop)}
    keep = _keep(draw, p, [k for k in range(a, b) if k not in inside])
    return Region(a, b, "recompute", keep=keep, children=children)


def offloaded(p: Problem, data: st.DataObject) -> tuple[Problem, list[Offload]]:
    """``p`` with a drawn host link (slow or fast copy queues, or a synchronous link) and
    some of a drawn cut of its nodes offloaded, each prefetched at a later span's output or
    when needed, released at its own end or a later span's."""
    gbps = data.draw(st.sampled_from([1e-6, 1e-3, 1.0]))
    synchronous = data.draw(st.booleans())
    p = p.model_copy(update={"host_link": HostLink(d2h_gbps=gbps, h2d_gbps=gbps,
                                                   synchronous=synchronous)})
    cuts = sorted(data.draw(st.sets(st.integers(1, p.n_nodes - 1), max_size=4)))
    spans = list(itertools.pairwise([0, *cuts, p.n_nodes]))
    moved = []
    for k, (a, b) in enumerate(spans):
        if data.draw(st.booleans()):
            later = [None, *spans[k + 1:]]
            moved.append(Offload(start=a, stop=b, prefetch=data.draw(st.sampled_from(later)),
                                 release=data.draw(st.sampled_from(later))))
    return p, moved


@st.composite
def nested_schedules(draw: st.DrawFn) -> tuple[Problem, Schedule]:
    """A random problem and a schedule whose RECOMPUTE regions (inside recomputable runs)
    nest one level, with random kept nodes among the keepable ones."""
    p = draw(graphs())
    n = p.n_nodes
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    regions = []
    for a, b in itertools.pairwise([0, *cuts, n]):
        if all(p.recomputable[a:b]) and draw(st.integers(0, 3)) > 0:
            regions.append(_nested(draw, p, a, b))
        else:
            regions.append(Region(a, b))
    return p, Schedule(regions=tuple(regions))


def _regions(ctx: Context, sched: Schedule) -> list[RegionInfo]:
    return [ctx.region(r.start, r.stop, r.keep, [(c.start, c.stop, c.keep) for c in r.children])
            for r in sched.regions if r.is_recompute]


def check(p: Problem, sched: Schedule) -> None:
    """evaluate and the whole-graph window equal simulate: peak, recompute time, every
    event's peak (the window's slots are simulate's events, in order), and the bytes still
    held when the forward ends (`residue_bytes` + the loss the caller holds)."""
    tl = simulate(p, sched)
    assert evaluate(p, sched) == (tl.peak_bytes, tl.recompute_time_ms), sched.describe()
    ctx = Context(p)
    parts = profile_parts(ctx, 0, p.n_nodes, _regions(ctx, sched))
    assert p.static_bytes + parts.peak(ctx, 0) == tl.peak_bytes
    slots = (p.static_bytes + parts.local + ctx.g_table[parts.g_index]).tolist()
    # a node's moment after its release is a slot of its own, a part of its backward event
    n = p.n_nodes
    released = parts.g_index >= table_index(n, RELEASED, 0)
    assert released.sum() == sum(p.gradient_events.releases(j) for j in range(n))
    events: list[int] = []
    for slot, after_release in zip(slots, released, strict=True):
        if after_release:
            events[-1] = max(events[-1], slot)
        else:
            events.append(slot)
    assert events == [e.peak_bytes for e in tl.events], sched.describe()
    end_of_forward = tl.events[p.n_nodes - 1].live_bytes
    assert p.static_bytes + ctx.loss_bytes + parts.residue_bytes == end_of_forward
    # regions without children take the closed form: the general analysis must agree
    for r in sched.regions:
        if r.is_recompute and not r.children:
            assert_same_analysis(ctx.region(r.start, r.stop, r.keep),
                                 _NestedAnalysis(ctx, r.start, r.stop, r.keep, ()).result(), ctx)


def assert_same_analysis(fast: RegionInfo, general: RegionInfo, ctx: Context) -> None:
    """Two analyses of one region say the same, field by field (the loss's storages, which
    the caller holds throughout, left out of what they hold)."""
    assert (fast.a, fast.b, fast.keep, fast.children, fast.inputs, fast.rules) == (
        general.a, general.b, general.keep, general.children, general.inputs, general.rules)
    assert fast.reruns == general.reruns
    assert fast.time_ms == general.time_ms
    assert sorted(fast.regen, key=repr) == sorted(general.regen, key=repr)

    def held(info: RegionInfo) -> dict:
        return {s: pt for s, pt in info.held.items() if s not in ctx.loss}

    assert held(fast) == held(general)


@MANY
@given(nested_schedules())
def test_nested_accounting_equals_simulate(case: tuple[Problem, Schedule]) -> None:
    check(*case)


# ------------------------------------------------------------------ hand-written cases

def R(a: int, b: int, keep: set[int] | None = None, children: list[Region] | None = None
      ) -> Region:
    return Region(a, b, "recompute", keep=keep or set(), children=children or [])


def blocks(n_blocks: int, **kw) -> Problem:
    """Chain of 3-node blocks (each node reads and saves the previous output) + a loss."""
    n = 3 * n_blocks + 1
    sizes = [10 + 3 * (i % 3) for i in range(n - 1)] + [1]
    return Problem.chain(sizes, [float(1 + i % 3) for i in range(n)],
                         block_of_node=[i // 3 for i in range(n)], **kw)


def sched(n: int, *regions: Region) -> Schedule:
    return Schedule.from_segments(n, list(regions))


def _assert_reruns_at_triggers(p: Problem, schedule: Schedule) -> None:
    """Each frame's own rerun (the last recompute of its first own node that runs) comes
    right before the backward of the node `region_rules` names as its trigger (F4-F5)."""
    events = simulate(p, schedule).events
    for r in schedule.recompute_regions():
        rules = region_rules(p, r)
        inside = {i for c in r.children for i in range(c.start, c.stop)}
        own = [i for i in rules.run_steps(r.start) if i not in inside]
        if not own:
            continue
        last = max(k for k, ev in enumerate(events)
                   if ev.phase == "recompute" and ev.node == own[0])
        after = next(ev for ev in events[last:] if ev.phase == "backward")
        assert after.node == rules.trigger, (r.describe(), rules)


@MANY
@given(nested_schedules())
def test_frame_triggers_are_where_simulate_reruns(case: tuple[Problem, Schedule]) -> None:
    _assert_reruns_at_triggers(*case)


def test_child_without_inputs_does_not_delay_its_parents_rerun() -> None:
    """A child that reads nothing from before it packs nothing into its parent (F1), so the
    parent reruns at its own last pack, not at the child's (F4)."""
    p = Problem.chain([4, 4, 4, 4, 4, 1], [1.0] * 6)
    inputs = [list(x) for x in p.node_inputs]
    saved = [list(x) for x in p.node_saved]
    inputs[3], saved[3] = [], []  # node 3 makes its output from nothing (say, an arange)
    p = p.model_copy(update={"node_inputs": inputs, "node_saved": saved})
    child = Region(3, 6, "recompute")
    parent = Region(1, 6, "recompute", children=[child])
    schedule = Schedule(regions=(Region(0, 1, "store"), parent))
    assert (region_rules(p, parent).trigger, region_rules(p, child).trigger) == (2, 5)
    _assert_reruns_at_triggers(p, schedule)


def test_parent_over_two_blocks_each_block_a_child() -> None:
    p = blocks(3)
    for s in (sched(10, R(0, 6, children=[R(0, 3), R(3, 6)])),
              sched(10, R(3, 9, children=[R(3, 6), R(6, 9)])),
              sched(10, R(0, 6, children=[R(0, 3), R(3, 6)]), R(6, 9)),
              sched(10, R(0, 9, children=[R(0, 3), R(3, 6), R(6, 9)]))):
        check(p, s)
    # the parent reruns up to its last child's entry, each child then reruns in full
    s = sched(10, R(3, 9, children=[R(3, 6), R(6, 9)]))
    assert simulate(p, s).recompute_time_ms == 6.0 + 12.0 == evaluate(p, s)[1]


def test_child_at_the_start_or_end_of_the_parent() -> None:
    p = blocks(3)
    for s in (sched(10, R(1, 7, children=[R(1, 3)])), sched(10, R(1, 7, children=[R(5, 7)])),
              sched(10, R(1, 7, children=[R(1, 7)])),  # a child spanning all of its parent
              sched(10, R(2, 8, {2, 7}, children=[R(3, 4), R(6, 7)])),
              sched(10, R(0, 9, children=[R(0, 1)]))):  # a child without inputs
        check(p, s)


def test_child_inputs_from_before_the_parent() -> None:
    # a skip: n5 reads n1's output too, so the child [5, 7) holds an input made before the
    # parent [3, 8), which the parent's frame holds too
    p = blocks(3)
    inputs = [list(x) for x in p.node_inputs]
    inputs[5].append(1)
    saved = [list(x) for x in p.node_saved]
    saved[5].append(1)
    p = p.model_copy(update={"node_inputs": inputs, "node_saved": saved})
    for s in (sched(10, R(3, 8, children=[R(5, 7)])), sched(10, R(3, 8, children=[R(4, 6)])),
              sched(10, R(2, 9, {3}, children=[R(5, 7, {6})]))):
        check(p, s)


def test_kept_nodes_in_parent_and_child() -> None:
    p = blocks(3)
    for keep, ckeep in itertools.product([set(), {1}, {5}, {1, 5, 8}], [set(), {3}, {4}]):
        check(p, sched(10, R(1, 9, keep, children=[R(2, 5, ckeep)])))
    # a kept node is cached by its own frame's rerun, not by the parent's
    s = sched(10, R(1, 9, children=[R(2, 5, {3})]))
    tl = simulate(p, s)
    assert [e.node for e in tl.events if e.cached] == [3]
    info = Context(p).region(1, 9, (), [(2, 5, {3})])
    assert info.children == ((2, 5, frozenset({3})),)
    assert [(rr.start, rr.stop, sorted(rr.cached)) for rr in info.reruns] == [
        (1, 9, []), (2, 5, [3])]
    # the child's rerun keeps s2 (n3 saves it); s3 is the kept original, and s4, read and
    # saved after the child only, is freed right after its step
    assert {g.storage for g in info.regen if g.rerun == 1} == {2}


def test_child_saving_nothing_and_parent_saving_nothing() -> None:
    # n4 saves nothing: the child [4, 5) never reruns and its frame dies with its forward;
    # a parent whose own nodes save nothing reruns only for its children
    p = blocks(3)
    saved = [list(x) for x in p.node_saved]
    saved[4] = []
    saved[2] = []
    p = p.model_copy(update={"node_saved": saved})
    for s in (sched(10, R(3, 6, {3}, children=[R(4, 5)])),
              sched(10, R(2, 5, children=[R(3, 5)])),
              sched(10, R(2, 6, {2}, children=[R(3, 4), R(4, 6, {5})]))):
        check(p, s)


def test_deeper_nesting_is_rejected() -> None:
    p = blocks(2)
    s = sched(7, R(0, 6, children=[R(1, 5, children=[R(2, 3)])]))
    with pytest.raises(ValueError, match="one level of nested"):
        evaluate(p, s)
    simulate(p, s)  # simulate handles it


def test_context_rejects_malformed_children() -> None:
    ctx = Context(blocks(2))
    with pytest.raises(ValueError, match="inside it"):
        ctx.region(1, 4, (), [(0, 2, ())])
    with pytest.raises(ValueError, match="child's keep"):
        ctx.region(1, 4, {2}, [(2, 3, ())])
    info = ctx.region(1, 4, (), [(2, 3, ())])
    assert info.children and ctx.region(1, 4, (), [(2, 3, ())]) is info
    assert ctx.region(1, 4).children == ()


def test_window_parts_of_nested_regions_are_position_independent() -> None:
    # identical blocks: the same nested option on blocks 1 and 2 gives the same local bytes
    # and gradient indices, only the gradient table (by position) differs
    p = Problem.chain([10] * 12 + [1], [1.0] * 13, param_grad_bytes=[5] * 13)
    ctx = Context(p)
    parts = []
    for a in (3, 6):
        r = ctx.region(a, a + 3, {a}, [(a + 1, a + 2, ()), (a + 2, a + 3, ())])
        parts.append(profile_parts(ctx, a, a + 3, [r], frozenset({a - 1})))
    assert np.array_equal(parts[0].local, parts[1].local)
    assert np.array_equal(parts[0].g_index, parts[1].g_index)
    assert parts[0].residue_bytes == parts[1].residue_bytes
    assert parts[0].time_ms == parts[1].time_ms
    assert parts[0].peak(ctx, 3) != parts[1].peak(ctx, 6)  # parameter gradients pile up
