"""A checkpoint's rerun skips what its kept outputs make useless (`solvers.frame` F9,
`planner.runtime.skipping`): the profile says which ops may be skipped, the plan names
those its reruns skip, and the step then runs as predicted and trains alike."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import planner
from planner import zoo
from planner.reports.decisions import decision_table
from planner.runtime import skipping
from planner.runtime.install import region_specs
from planner.solving import plan_for_schedule
from solvers import Region, Schedule, simulate

SKIPPED = {("aten.bmm.default", 0), ("aten.mul.Tensor", 0), ("aten.masked_fill.Scalar", 0)}


@pytest.fixture(scope="module")
def gpt() -> tuple[zoo.ZooModel, planner.Plan]:
    torch.manual_seed(0)
    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.1)
    plan = planner.optimize(zm.model, zm.example_inputs, budget_gb=1e6, loss_fn=zm.loss_fn,
                            progress=False, deterministic=True)
    return zm, plan


@pytest.fixture
def modes(monkeypatch: pytest.MonkeyPatch) -> list[skipping.SkipOps]:
    """Every skipping mode a rerun enters during the test."""
    made: list[skipping.SkipOps] = []
    counting = skipping.SkipOps.__init__

    def init(self: skipping.SkipOps, *args, **kwargs) -> None:
        counting(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(skipping.SkipOps, "__init__", init)
    return made


def _keeping_softmax(plan: planner.Plan) -> planner.Plan:
    """Every attention call checkpointed, keeping its softmax's output."""
    p = plan.problem()
    regions = [Region(s.start, s.stop, "recompute", keep=[
        i for i in range(s.start, s.stop) if p.node_names[i].endswith("/_softmax")])
        for s in p.module_spans or () if s.kind == "call" and s.name.endswith(".attn")]
    schedule = Schedule.from_segments(p.n_nodes, regions)
    return plan_for_schedule(plan.profile, schedule, plan.inputs, plan.structure_fingerprint)


def test_the_profile_says_which_ops_a_rerun_may_skip(gpt) -> None:
    _, plan = gpt
    kinds = {n.target: n.skippable for n in plan.profile.nodes if n.op == "aten"}
    assert kinds["aten.bmm.default"] and kinds["aten.masked_fill.Scalar"]
    assert kinds["aten.addmm.default"]  # functional; whether it is skipped is the rerun's
    assert not kinds["aten._softmax.default"]  # saves its own output
    assert not kinds["aten.bernoulli_.float"]  # dropout's mask: random, in place
    assert not kinds["aten.empty_like.default"]  # the mask's storage: finished in place
    assert not kinds["aten.native_layer_norm.default"]  # saves its own statistics
    assert not kinds["aten.view.default"]  # a view: nothing to skip


def test_a_rerun_skips_what_the_kept_softmax_makes_useless_and_trains_alike(
        gpt, modes: list[skipping.SkipOps]) -> None:
    zm, full = gpt
    plan = _keeping_softmax(full)
    specs = region_specs(plan)
    assert len(specs) == 2 and all(set(s.skipped_ops) == SKIPPED for s in specs)
    timeline = simulate(plan.problem(), plan.schedule)
    assert sum("skipped" in e.label for e in timeline.events) == 2 * len(SKIPPED)
    rows = [r for r in decision_table(plan) if r.skipped]  # the notebook's table says so
    assert sorted({r.op for r in rows}) == sorted(op for op, _ in SKIPPED)
    assert all(r.label == "skipped" and r.cost.backward_ms == 0.0 for r in rows)
    report = planner.verify(zm.model, plan, zm.example_inputs, zm.loss_fn, repeats=1)
    assert report.grads_equal and report.losses_equal  # dropout 0.1: the RNG replays alike
    assert report.measured_peak_bytes == report.predicted_peak_bytes
    assert modes and all(m.skipped_count == len(SKIPPED) for m in modes)


def test_a_projection_whose_three_copies_are_kept_is_skipped_and_trains_alike(
        gpt, modes: list[skipping.SkipOps]) -> None:
    """The fused q/k/v projection feeds three copies (q, k and v made contiguous for their
    matmuls): keeping the three (and the softmax) skips the projection as well, though no
    one of them alone would; the step peaks as predicted and trains alike."""
    zm, full = gpt
    p = full.problem()
    copies = ("/clone", "/clone_1", "/clone_2", "/_softmax")
    regions = [Region(s.start, s.stop, "recompute", keep=[
        i for i in range(s.start, s.stop) if p.node_names[i].endswith(copies)])
        for s in p.module_spans or () if s.kind == "call" and s.name.endswith(".attn")]
    schedule = Schedule.from_segments(p.n_nodes, regions)
    plan = plan_for_schedule(full.profile, schedule, full.inputs, full.structure_fingerprint)
    specs = region_specs(plan)
    assert len(specs) == 2
    assert all({("aten.addmm.default", 0), *SKIPPED} <= set(s.skipped_ops) for s in specs)
    report = planner.verify(zm.model, plan, zm.example_inputs, zm.loss_fn, repeats=1)
    assert report.grads_equal and report.losses_equal
    assert report.measured_peak_bytes == report.predicted_peak_bytes
    assert modes and all(m.skipped_count == len(specs[0].skipped_ops) for m in modes)


def test_a_region_whose_rerun_needs_everything_skips_nothing(gpt) -> None:
    """Keeping only the matmul that reads the dropout's output leaves every step needed."""
    _, full = gpt
    p = full.problem()
    regions = [Region(s.start, s.stop, "recompute", keep=[
        i for i in range(s.start, s.stop) if p.node_names[i].endswith("/bmm_1")])
        for s in p.module_spans or () if s.kind == "call" and s.name.endswith(".attn")]
    schedule = Schedule.from_segments(p.n_nodes, regions)
    plan = plan_for_schedule(full.profile, schedule, full.inputs, full.structure_fingerprint)
    assert all(not s.skipped_ops for s in region_specs(plan))


def test_a_call_that_runs_other_ops_than_planned_skips_nothing(
        gpt, modes: list[skipping.SkipOps]) -> None:
    """Under autocast (planned without) the forward runs casts the plan never counted: the
    occurrences it names would be other ops, so the rerun runs everything, and trains
    alike."""
    zm, full = gpt
    plan = _keeping_softmax(full)
    grads = []
    for planned in (False, True):
        model = copy.deepcopy(zm.model)
        if planned:
            planner.apply(model, plan)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the guard says the precision is not planned
            zm.loss_fn(model(*zm.example_inputs)).backward()
        grads.append([p.grad for p in model.parameters()])
    assert modes and all(m.skipped_count == 0 for m in modes)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
