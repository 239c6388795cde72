"""Pipeline stages (`solvers.pipeline`, `planner.pipeline`): torch's GPipe and 1F1B run
over gloo, one process per stage, each with its own plan; the order each stage runs its
microbatches in is the one the replay assumes, each stage's measured peak is the predicted
one (or up to one stage-boundary activation under it), and losses and gradients are those
of the same pipeline unplanned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("torch.distributed.pipelining")
import pipeline_harness as harness  # benchmarks/, on the path in conftest

from planner import InfeasibleBudgetError
from solvers.pipeline import StageSpec

WORLD, MICROBATCHES = 2, 4
BOUNDARY = harness.MICROBATCH * harness.SEQ * harness.WIDTH * 4  # one activation between stages


def test_each_stage_planned_for_its_schedule_holds_its_budget_and_trains_unchanged(
        tmp_path: Path) -> None:
    """Each stage planned at 70 % of its unplanned peak over a 1F1B step (every
    microbatch it holds): the measured peak is within the budget and at the predicted one;
    losses and gradients are the unplanned pipeline's. (GPipe and 3 stages:
    `benchmarks/results/pipeline-stages-cpu.md`.)"""
    schedule = "1F1B"
    specs = [harness.spec_of(schedule, r, WORLD, MICROBATCHES) for r in range(WORLD)]
    budgets = [int(0.7 * harness.predicted_peak(spec)) for spec in specs]
    planned_stages = [harness.stage_plan(spec, b)
                      for spec, b in zip(specs, budgets, strict=True)]
    plans = [plan for plan, _ in planned_stages]
    assert all(plan.checkpointing for plan in plans)
    assert [plan.pipeline for plan in plans] == specs  # installed in the 2-rank group
    planned = harness.run_pipeline(schedule, WORLD, MICROBATCHES, tmp_path / "planned", plans)
    unplanned = harness.run_pipeline(schedule, WORLD, MICROBATCHES, tmp_path / "unplanned")
    for spec, budget, (_, predicted), ran, plain in zip(
            specs, budgets, planned_stages, planned, unplanned, strict=True):
        assert [tuple(a) for a in ran["order"]] == spec.order()
        assert ran["peak"] <= budget
        # above the prediction by a loss scalar at most, below by one boundary activation
        assert predicted - BOUNDARY <= ran["peak"] <= predicted + 8, (spec, ran["peak"],
                                                                       predicted)
        assert all(torch.equal(a, b) for a, b in zip(ran["grads"], plain["grads"], strict=True))
    assert planned[-1]["losses"] == unplanned[-1]["losses"]
    assert len(planned[-1]["losses"]) == MICROBATCHES


def test_a_stage_budget_no_plan_meets_names_the_least_stage_peak_found() -> None:
    spec = harness.spec_of("GPipe", 0, WORLD, MICROBATCHES)
    with pytest.raises(InfeasibleBudgetError, match="least stage peak found") as caught:
        harness.stage_plan(spec, 2**20)
    assert caught.value.plan is not None and caught.value.min_budget_bytes > 2**20
    _, peak = harness.stage_plan(spec, caught.value.min_budget_bytes)  # and it holds
    assert peak <= caught.value.min_budget_bytes


def test_in_flight_microbatches_are_torchs() -> None:
    """GPipe holds every microbatch; 1F1B stage r of p holds min(m, p - r)."""
    assert [StageSpec(schedule="1F1B", stage_index=r, num_stages=4, n_microbatches=8)
            .in_flight() for r in range(4)] == [4, 3, 2, 1]
    assert StageSpec(schedule="GPipe", stage_index=2, num_stages=4,
                     n_microbatches=8).in_flight() == 8
    with pytest.raises(ValueError, match="not below num_stages"):
        StageSpec(schedule="1F1B", stage_index=4, num_stages=4, n_microbatches=8)
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        StageSpec(schedule="1F1B", stage_index=0, num_stages=4, n_microbatches=2)


def test_a_stage_plan_installs_in_its_pipelines_group_and_nowhere_else() -> None:
    """A stage's plan is installed on its rank after the process group exists (one stage
    per rank); in a group whose size is no multiple of the stages it is refused."""
    import torch.distributed as dist

    from planner import PlanMismatchError, apply, optimize, zoo

    zm = zoo.get("gpt", size="tiny")
    plan = optimize(zm.model, zm.example_inputs, budget_gb=1e3, loss_fn=zm.loss_fn,
                    timing="estimate", progress=False)
    stage = plan.model_copy(update={"pipeline": StageSpec(
        schedule="1F1B", stage_index=0, num_stages=2, n_microbatches=4)})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(PlanMismatchError, match="stage 0 of a 2-stage pipeline, but "
                                                    "this process group has 1 ranks"):
            apply(zm.model, stage)
        apply(zm.model, plan.model_copy(update={"pipeline": StageSpec(
            schedule="GPipe", stage_index=0, num_stages=1, n_microbatches=4)}))
    finally:
        dist.destroy_process_group()
