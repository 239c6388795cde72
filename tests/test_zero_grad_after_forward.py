"""Steps in Lightning's order: ``training_step`` (forward and loss), ``zero_grad()``, then
``backward()``. The last step's gradients are alive through the forward and gone before the
backward: ``zero_grad_after_forward=True`` counts them there, and only there."""

from __future__ import annotations

import warnings

import pytest
import torch

from planner import PlanMismatchWarning, apply, measure_step, optimize, profile_model, zoo
from planner.measure import PeakTracker

GIB = 2**30


def _gpt() -> zoo.ZooModel:
    return zoo.get("gpt", size="tiny", batch=4, dropout=0.0)


def _lightning_order_peak(zm: zoo.ZooModel) -> int:
    """Peak bytes of one step as Lightning runs it, after a step that left its gradients:
    written out here, apart from ``measure_step``."""
    model, args = zm.model, zm.example_inputs
    zm.loss_fn(model(*args)).backward()
    static = [*model.parameters(), *model.buffers(), *args]
    with PeakTracker(static, held=[p.grad for p in model.parameters()]) as tracker:
        loss = zm.loss_fn(model(*args))
        model.zero_grad(set_to_none=True)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def _plan(zm: zoo.ZooModel, fraction: float, **options):
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                         progress=False, **options)
    static = step.profile.static.total_bytes
    budget = int(static + fraction * (step.unplanned_peak_bytes - static))
    return optimize(zm.model, zm.example_inputs, budget_gb=budget / GIB, loss_fn=zm.loss_fn,
                    timing="estimate", progress=False, op_ranges=False, time_limit_s=20,
                    **options)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_lightning_order_plan_is_predicted_to_the_byte_and_holds(fraction: float) -> None:
    zm = _gpt()
    plan = _plan(zm, fraction, zero_grad_after_forward=True)
    assert plan.profile.static.grads_in_forward and not plan.profile.static.grads_at_start
    assert "free them before the backward" in plan.summary()
    apply(zm.model, plan)
    with warnings.catch_warnings():
        # the plan counts the gradients a step starts with: no warning that it does not
        warnings.simplefilter("error", PlanMismatchWarning)
        for _ in range(2):
            measured = _lightning_order_peak(zm)
            assert measured == plan.predicted_peak_bytes <= plan.budget_bytes


def test_gradients_count_in_the_forward_not_in_the_backward() -> None:
    zm = _gpt()
    lightning = _plan(zm, 1.0, zero_grad_after_forward=True)
    fresh = _plan(zm, 1.0)
    accumulating = _plan(zm, 1.0, grad_accumulation=True)
    grads = lightning.profile.static.grad_bytes
    # the unplanned step peaks at the loss: all activations, and the last step's gradients
    assert lightning.unplanned_peak_bytes > fresh.unplanned_peak_bytes
    assert lightning.unplanned_peak_bytes <= fresh.unplanned_peak_bytes + grads
    # accumulation holds them through the backward as well
    assert lightning.unplanned_peak_bytes < accumulating.unplanned_peak_bytes
    assert len({lightning.fingerprint, fresh.fingerprint, accumulating.fingerprint}) == 3


def test_measure_step_runs_lightnings_order() -> None:
    zm = _gpt()
    loop = _lightning_order_peak(zm)
    peak, _, grads = measure_step(zm.model, zm.example_inputs, {}, zm.loss_fn,
                                  grads_in_forward=True)
    fresh, _, fresh_grads = measure_step(zm.model, zm.example_inputs, {}, zm.loss_fn)
    assert peak == loop > fresh
    assert all(torch.equal(grads[k], fresh_grads[k]) for k in fresh_grads)
    assert all(p.grad is None for p in zm.model.parameters())


def test_both_gradient_orders_at_once_are_refused() -> None:
    zm = _gpt()
    with pytest.raises(ValueError, match=r"either adds into the \.grad"):
        profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                      progress=False, grad_accumulation=True, zero_grad_after_forward=True)
    with pytest.raises(ValueError, match="not both"):
        measure_step(zm.model, zm.example_inputs, {}, zm.loss_fn, grads_at_start=True,
                     grads_in_forward=True)
