"""`planner.hf_accelerate.planned`: plan and install before ``accelerator.prepare``, with
the accelerator's precision and accumulation; training is accelerate's own."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from planner import InfeasibleBudgetError, PlanMismatchWarning, optimize, replan, zoo
from planner.measure import PeakTracker

accelerate = pytest.importorskip("accelerate")
from planner.hf_accelerate import planned  # noqa: E402  (needs accelerate)

GIB = 2**30


@pytest.fixture(autouse=True)
def _fresh_accelerator_state() -> Any:
    """Each test's Accelerator sets its own precision (accelerate keeps one per process)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _budget_gb(model: torch.nn.Module, batch: dict, optimizer: Any, **options: Any) -> float:
    """Static memory plus half the activations, or 2 % over the least a plan meets."""
    first = optimize(model, batch, budget_gb=1e3, optimizer=optimizer, timing="estimate",
                     progress=False, **options)
    static = first.profile.static.total_bytes
    try:
        return replan(first, budget_bytes=static + (first.unplanned_peak_bytes - static) // 2,
                      time_limit_s=10).budget_bytes / GIB
    except InfeasibleBudgetError as error:
        return 1.02 * error.min_budget_gb


def _train(accelerator: Any, model: torch.nn.Module, optimizer: Any, batches: list[dict]
           ) -> tuple[list[float], list[int]]:
    """Steps as accelerate's examples write them; each step's measured peak."""
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, peaks = [], []
    for batch in batches:
        state = [t for s in optimizer.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        with PeakTracker([*model.parameters(), *model.buffers(), *state,
                          *batch.values()]) as tracker:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        peaks.append(tracker.peak_bytes)
    return losses, peaks


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_planned_before_prepare_trains_like_accelerate_within_the_budget(
        precision: str) -> None:
    base = zoo.get("hf-llama", batch=4)
    model, ids = base.model, base.example_inputs["input_ids"]
    unplanned = copy.deepcopy(model)
    batches = [{"input_ids": ids, "labels": ids}, {"input_ids": ids.flip(0),
                                                    "labels": ids.flip(0)}]
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    budget_gb = _budget_gb(model, batches[0], optimizer,
                           autocast=torch.bfloat16 if precision == "bf16" else None)
    torch.manual_seed(0)
    plan = planned(accelerator, model, batches[0], budget_gb=budget_gb, optimizer=optimizer,
                   timing="estimate")
    assert plan.checkpointing
    assert plan.autocast_dtype == ("bfloat16" if precision == "bf16" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)  # the step is the one planned
        losses, peaks = _train(accelerator, model, optimizer, batches)
    torch.manual_seed(0)
    expected, _ = _train(accelerator, unplanned,
                         torch.optim.AdamW(unplanned.parameters(), lr=1e-2), batches)
    assert losses == expected
    for (name, a), (_, b) in zip(model.named_parameters(), unplanned.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert max(peaks) <= plan.budget_bytes, (peaks, plan.budget_bytes,
                                             plan.predicted_peak_bytes)


def test_what_planned_cannot_plan_is_refused_clearly() -> None:
    base = zoo.get("hf-llama", batch=2)
    accelerator = accelerate.Accelerator(cpu=True)
    batch = base.example_inputs
    with pytest.raises(TypeError, match="from the Accelerator"):
        planned(accelerator, base.model, batch, budget_gb=1.0, autocast=torch.bfloat16)
    prepared = accelerator.prepare(copy.deepcopy(base.model))
    prepared._original_forward = prepared.forward  # as prepare leaves it under bf16
    with pytest.raises(ValueError, match=r"before accelerator\.prepare"):
        planned(accelerator, prepared, batch, budget_gb=1.0)
