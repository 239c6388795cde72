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

from solvers.pipeline import StageSpec

WORLD, MICROBATCHES = 2, 4
BOUNDARY = harness.MICROBATCH * harness.SEQ * harness.WIDTH * 4  # one activation between stages


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_each_planned_stage_peaks_as_predicted_and_trains_like_the_unplanned_pipeline(
        schedule: str, tmp_path: Path) -> None:
    specs = [harness.spec_of(schedule, r, WORLD, MICROBATCHES) for r in range(WORLD)]
    plans = [harness.halfway_plan(spec) for spec in specs]
    assert all(plan.checkpointing for plan in plans)
    planned = harness.run_pipeline(schedule, WORLD, MICROBATCHES, tmp_path / "planned", plans)
    unplanned = harness.run_pipeline(schedule, WORLD, MICROBATCHES, tmp_path / "unplanned")
    for spec, plan, ran, plain in zip(specs, plans, planned, unplanned, strict=True):
        assert [tuple(a) for a in ran["order"]] == spec.order()
        predicted = harness.predicted_peak(spec, plan)
        # above the prediction by a loss scalar at most, below by one boundary activation
        assert predicted - BOUNDARY <= ran["peak"] <= predicted + 8, (spec, ran["peak"],
                                                                       predicted)
        assert all(torch.equal(a, b) for a, b in zip(ran["grads"], plain["grads"], strict=True))
    assert planned[-1]["losses"] == unplanned[-1]["losses"]
    assert len(planned[-1]["losses"]) == MICROBATCHES


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
