"""Property tests on random small graphs (chains and DAGs with skips), no torch."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import (
    ModuleSpan,
    Problem,
    Region,
    Schedule,
    SimulationError,
    Solution,
    Status,
    baselines,
    bruteforce,
    memory_lower_bound,
    simulate,
)
from solvers.accounting import evaluate

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# brute force runs without a time limit (math.inf): it stops when its enumeration does, so
# its verdicts never depend on the machine's speed


def check_reported_numbers(p: Problem, sol: Solution) -> tuple[int, float] | None:
    """`sol`'s peak, status and objective against `accounting.evaluate`'s count of its
    schedule (None: no schedule to check); returns that (peak, recompute ms).

    `Solution.scored` filled those fields from `simulate`, so comparing them with `simulate`
    again cannot fail; `evaluate` counts the same schedule in closed form without replaying
    it (the model the DP, CP-SAT and chen_greedy decide with), so a slip in either side, or
    a solver reporting numbers of another schedule, shows here. Schedules nest at most one
    level (`evaluate` raises on deeper ones) and offload nothing.
    """
    if sol.schedule is None:
        return None
    peak, recompute_ms = evaluate(p, sol.schedule)
    assert sol.peak_bytes == peak, (sol.solver, sol.peak_bytes, peak)
    assert sol.feasible == (peak <= sol.budget_bytes), (sol.solver, peak, sol.budget_bytes)
    if sol.feasible:
        assert sol.objective_ms == pytest.approx(recompute_ms, rel=1e-9, abs=1e-9), sol.solver
    return peak, recompute_ms


@st.composite
def problems(draw: st.DrawFn, min_nodes: int = 2, max_nodes: int = 7,
             unkeepable: bool | None = None, spans: bool = False,
             skippable: bool | None = None) -> Problem:
    """Random small problem; `unkeepable` True: some recomputable node is not keepable,
    False: `keepable` is None, None (default): either; `skippable` likewise for nodes a
    rerun may skip (F9, `node_skippable`). Storages may be held by the program
    past their last reader (`storage_release`, as a local variable is), some by the caller
    all step; `spans` adds module spans (the only regions a schedule may recompute)."""
    n = draw(st.integers(min_nodes, max_nodes))
    skips = draw(st.booleans())
    partial_grads = draw(st.booleans())  # some reads send no gradient (node_grad_inputs)
    inputs: list[list[int]] = []
    outputs: list[list[int]] = []
    saved: list[list[int]] = []
    grad_inputs: list[list[int]] = []
    producer: list[int] = []
    sizes: list[int] = []
    grads: list[int] = []
    main: list[int] = []  # main output storage of each node

    def new_storage(node: int, nbytes: int, grad: bool) -> int:
        producer.append(node)
        sizes.append(nbytes)
        grads.append(nbytes if grad else 0)
        return len(sizes) - 1

    for i in range(n):
        ins: list[int] = []
        if i > 0:
            ins.append(main[i - 1])
            if skips and i > 1 and draw(st.booleans()):
                ins.append(main[draw(st.integers(0, i - 2))])
        last = i == n - 1
        out = [new_storage(i, 1 if last else draw(st.integers(1, 50)), True)]
        if not last and draw(st.integers(0, 4)) == 0:  # dropout-like mask saved by itself
            out.append(new_storage(i, draw(st.integers(1, 20)), False))
        main.append(out[0])
        candidates = ins + out
        sv = [s for s in candidates if draw(st.booleans())]
        inputs.append(ins)
        grad_inputs.append([s for s in ins if not partial_grads or draw(st.integers(0, 2)) > 0])
        outputs.append(out)
        saved.append(sv)
    recomputable = [draw(st.integers(0, 9)) > 0 for _ in range(n)]
    keepable: list[bool] | None = None
    if unkeepable or (unkeepable is None and draw(st.booleans())):
        # e.g. a dropout whose mask an in-place op finishes: selective checkpointing can't save it
        keepable = [draw(st.integers(0, 2)) > 0 for _ in range(n)]
        rec = [i for i in range(n) if recomputable[i]]
        if unkeepable and rec:
            keepable[draw(st.sampled_from(rec))] = False
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
    block = []
    b = 0
    for i in range(n):
        if i in cuts:
            b += 1
        block.append(b)
    packs_before = None
    if draw(st.booleans()):  # matmul-like nodes: pack their inputs before they run
        packs_before = [draw(st.booleans()) and not set(saved[i]) & set(outputs[i])
                        for i in range(n)]
    fwd_temp = [draw(st.sampled_from([0, 0, 5, 30])) for _ in range(n)]
    skip_flags = None
    if skippable or (skippable is None and draw(st.booleans())):  # F9
        skip_flags = [i < n - 1 and fwd_temp[i] == 0 and not set(saved[i]) & set(outputs[i])
                     and draw(st.integers(0, 2)) > 0 for i in range(n)]
    release = None
    if draw(st.booleans()):
        release = [draw(st.sampled_from([producer[s], producer[s],
                                         draw(st.integers(producer[s], n - 1)), n]))
                   for s in range(len(sizes))]
    return Problem(
        name="random",
        node_names=[f"v{i}" for i in range(n)],
        fwd_time_ms=[float(draw(st.integers(1, 9))) for _ in range(n)],
        bwd_time_ms=[float(draw(st.integers(1, 9))) for _ in range(n)],
        fwd_temp_bytes=fwd_temp,
        bwd_temp_bytes=[draw(st.sampled_from([0, 0, 5, 30])) for _ in range(n)],
        recomputable=recomputable,
        node_inputs=inputs,
        node_outputs=outputs,
        node_saved=saved,
        storage_bytes=sizes,
        storage_producer=producer,
        storage_grad_bytes=grads,
        static_bytes=draw(st.integers(0, 100)),
        param_grad_bytes=[draw(st.sampled_from([0, 0, 3, 10])) for _ in range(n)],
        block_of_node=block,
        node_grad_inputs=grad_inputs if partial_grads else None,
        keepable=keepable,
        node_skippable=skip_flags,
        node_packs_before_running=packs_before,
        storage_release=release,
        module_spans=draw(module_spans(n, producer)) if spans else None,
    )


@st.composite
def module_spans(draw: st.DrawFn, n: int, producer: list[int]) -> list[ModuleSpan]:
    """A random laminar family of spans (calls and their subcalls) with passed inputs: some
    of the storages made before each span, read in it or not."""
    out: list[ModuleSpan] = []

    def add(a: int, b: int, depth: int) -> None:
        bounds = sorted(draw(st.sets(st.integers(a, b), max_size=4)) | {a, b})
        for x, y in itertools.pairwise(bounds):
            if draw(st.integers(0, 3)) == 0:
                continue
            before = [s for s in range(len(producer)) if producer[s] < x]
            passed = draw(st.sets(st.sampled_from(before), max_size=2)) if before else set()
            out.append(ModuleSpan(start=x, stop=y, name=f"m{len(out)}", inputs=tuple(sorted(
                passed))))
            if depth < 2 and y - x >= 2:
                add(x, y, depth + 1)

    add(0, n, 0)
    return out


def _region(draw: st.DrawFn, p: Problem, a: int, b: int, depth: int) -> Region:
    if not all(p.recomputable[a:b]) or not draw(st.booleans()):
        return Region(a, b, "store") if depth == 0 else Region(a, b, "recompute")
    children: list[Region] = []
    if depth < 2 and b - a >= 2 and draw(st.booleans()):
        ca = draw(st.integers(a, b - 1))
        cb = draw(st.integers(ca + 1, b))
        if (ca, cb) != (a, b):
            children.append(_region(draw, p, ca, cb, depth + 1))
    inside = {k for c in children for k in range(c.start, c.stop)}
    own = [k for k in range(a, b) if k not in inside]
    keep = {k for k in own if p.can_keep(k) and draw(st.integers(0, 3)) == 0}
    return Region(a, b, "recompute", keep=keep, children=children)


@st.composite
def problem_and_schedule(draw: st.DrawFn) -> tuple[Problem, Schedule]:
    p = draw(problems())
    n = p.n_nodes
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    regions = tuple(_region(draw, p, a, b, 0) for a, b in itertools.pairwise(bounds))
    return p, Schedule(regions=regions)


@FAST
@given(problem_and_schedule())
def test_simulate_invariants(case: tuple[Problem, Schedule]) -> None:
    p, sched = case
    tl = simulate(p, sched)
    # the caller still holds the loss outputs (except those the loss's backward saved) and,
    # in backward(), the gradient seed
    n = p.n_nodes
    seeds = {s for s in p.grad_inputs[n - 1] if s in p.caller_held}
    seeds |= {s for s in p.outputs[n - 1] if not p.consumers[s]}
    final = p.static_bytes + sum(p.param_grad_bytes) + sum(
        p.storage_bytes[s] for s in p.caller_held) + sum(p.storage_grad_bytes[s] for s in seeds)
    assert tl.events[-1].live_bytes == final
    assert tl.peak_bytes == max(e.peak_bytes for e in tl.events)
    assert all(e.peak_bytes >= e.live_bytes for e in tl.events)
    assert tl.breakdown.total_bytes == tl.peak_bytes
    assert tl.peak_bytes >= memory_lower_bound(p)
    recomputed = sched.recomputed_nodes()
    assert tl.recompute_time_ms <= sum(p.fwd_time_ms[i] for i in recomputed) * 2 + 1e-9
    assert tl.forward_time_ms == sum(p.fwd_time_ms)
    assert sum(1 for e in tl.events if e.phase == "backward") == p.n_nodes
    assert simulate(p, sched) == tl  # deterministic and pure


@FAST
@given(st.booleans().flatmap(lambda spans: problems(spans=spans)), st.floats(0.0, 1.5))
def test_baselines_report_counted_numbers(p: Problem, frac: float) -> None:
    store_peak = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    budget = int(store_peak * frac)
    for solve in baselines.BASELINES.values():
        sol = solve(p, budget, 1.0)
        if sol.schedule is None:  # its regions are not module spans: not applicable
            assert p.module_spans is not None and not sol.feasible
            continue
        peak, recompute_ms = check_reported_numbers(p, sol)
        assert sol.total_time_ms == pytest.approx(
            sum(p.fwd_time_ms) + recompute_ms + sum(p.bwd_time_ms), rel=1e-9)
        if not sol.feasible:
            assert sol.min_feasible_budget_bytes is not None
            assert sol.min_feasible_budget_bytes <= peak


@SLOW
@given(problems(max_nodes=5), st.floats(0.0, 1.2))
def test_bruteforce_no_worse_than_baselines(p: Problem, frac: float) -> None:
    store_peak = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    lower = memory_lower_bound(p)
    budget = lower + int((store_peak - lower) * frac)
    best = bruteforce.solve(p, budget, math.inf)
    check_reported_numbers(p, best)
    if best.status == Status.INFEASIBLE:
        assert best.min_feasible_budget_exact
        assert lower <= best.min_feasible_budget_bytes
        assert best.min_feasible_budget_bytes > budget
    else:
        assert best.status == Status.OPTIMAL and best.gap == 0.0
    for solve in baselines.BASELINES.values():
        sol = solve(p, budget, 1.0)
        if sol.feasible:
            assert best.feasible
            assert best.objective_ms <= sol.objective_ms + 1e-9


def kept_nodes(schedule: Schedule) -> set[int]:
    """Every node some RECOMPUTE region (nested ones included) keeps."""
    return {k for r in schedule.walk() for k in r.keep}


def keeps_only_keepable(p: Problem, schedule: Schedule) -> bool:
    return all(p.can_keep(k) for k in kept_nodes(schedule))


@SLOW
@given(problems(max_nodes=5, unkeepable=True), st.floats(0.0, 1.2))
def test_bruteforce_respects_keepable(p: Problem, frac: float) -> None:
    free = p.model_copy(update={"keepable": None})
    unrestricted = list(bruteforce.enumerate_schedules(free))
    rejected = [s for s in unrestricted if not keeps_only_keepable(p, s)]
    # some recomputable node is unkeepable: keeping it is in the free space
    assert rejected or not any(p.recomputable)
    # the enumeration is exactly the unrestricted space minus schedules keeping unkeepables
    assert [s.describe() for s in bruteforce.enumerate_schedules(p)] == [
        s.describe() for s in unrestricted if keeps_only_keepable(p, s)]
    for sched in rejected[:3]:
        with pytest.raises(SimulationError, match="keepable"):
            simulate(p, sched)
    store_peak = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    lower = memory_lower_bound(p)
    budget = lower + int((store_peak - lower) * frac)
    best = bruteforce.solve(p, budget, math.inf)
    assert best.schedule is not None and keeps_only_keepable(p, best.schedule)
    relaxed = bruteforce.solve(free, budget, math.inf)
    if best.feasible:
        assert best.status == Status.OPTIMAL
        assert relaxed.feasible and relaxed.objective_ms <= best.objective_ms + 1e-9
        if keeps_only_keepable(p, relaxed.schedule):  # the relaxed optimum is allowed too
            assert best.objective_ms == relaxed.objective_ms
    else:
        assert best.min_feasible_budget_exact
        assert best.min_feasible_budget_bytes >= (relaxed.min_feasible_budget_bytes or 0)


@st.composite
def span_problem_and_schedule(draw: st.DrawFn) -> tuple[Problem, Schedule]:
    p = draw(problems(spans=True))
    free = p.model_copy(update={"module_spans": None})
    first = itertools.islice(bruteforce.enumerate_schedules(free), 200)  # not all of them
    return p, draw(st.sampled_from(list(first)))


@FAST
@given(span_problem_and_schedule())
def test_only_module_spans_are_recomputed(case: tuple[Problem, Schedule]) -> None:
    p, sched = case
    emittable = all(p.emittable(r.start, r.stop) for r in sched.recompute_regions())
    if emittable:
        simulate(p, sched)
    else:
        with pytest.raises(SimulationError, match="module span"):
            simulate(p, sched)
    spans = {(sp.start, sp.stop) for sp in p.module_spans or ()}
    for schedule in itertools.islice(bruteforce.enumerate_schedules(p), 200):
        assert {(r.start, r.stop) for r in schedule.recompute_regions()} <= spans


def test_a_checkpoint_holds_what_is_passed_to_it_even_unread() -> None:
    """A module span's declared inputs (its call's arguments) are held by its checkpoint
    until its frame dies, read or not; a program-held storage lives to its release."""
    # n0 -> s0 (100, saved by nobody); n1 reads s0 -> s1; n2, n3 read and save their input
    base = Problem.chain([100, 10, 10, 10, 1], [1.0] * 5).model_copy(
        update={"node_saved": [[], [], [1], [2], [3]]})
    sched = Schedule.from_segments(5, [(2, 4)])
    passed = base.model_copy(update={"module_spans": [
        ModuleSpan(start=2, stop=4, name="block", inputs=(0, 1))]})
    unread = base.model_copy(update={"module_spans": [
        ModuleSpan(start=2, stop=4, name="block", inputs=(1,))]})
    with_s0, without = simulate(passed, sched), simulate(unread, sched)
    # s0 is freed after n1 unless passed to the call: the caller holds it while the call
    # runs (n2, n3), then its checkpoint until its frame dies (n2's backward)
    assert [e.label for e in with_s0.events][1:9] == [
        "fwd:n1", "fwd:n2", "fwd:n3", "fwd:n4", "bwd:n4", "recompute:n2", "recompute:n3",
        "bwd:n3"]
    assert [e.live_bytes - f.live_bytes for e, f in zip(with_s0.events, without.events,
                                                        strict=True)] == \
        [0] + [100] * 8 + [0] * 3
    released = base.model_copy(update={"storage_release": [3, 1, 2, 3, 4]})
    late = simulate(released, Schedule.store_all(5))
    free = simulate(base, Schedule.store_all(5))
    # held to node 3 (freed after it), instead of after n1, its last reader
    assert [e.live_bytes - f.live_bytes for e, f in zip(late.events, free.events,
                                                        strict=True)] == [0, 100, 100] + [0] * 7
