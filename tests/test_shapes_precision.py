"""A planned model runs other input shapes and mixed precision as the plan promises."""

from __future__ import annotations

import warnings

import pytest
import torch

from planner import InfeasibleBudgetError, PlanMismatchError, apply, optimize, remove, replan, zoo
from planner import verify as verify_plan
from planner.api import PlanMismatchWarning


def _plan_at(model: zoo.ZooModel, fraction: float, **options: object):
    """A plan at static + `fraction` of the activations (or the lowest feasible budget)."""
    first = optimize(model.model, model.example_inputs, budget_gb=1e3, loss_fn=model.loss_fn,
                     timing="estimate", progress=False, **options)
    static = first.profile.static.total_bytes
    budget = int(static + fraction * (first.unplanned_peak_bytes - static))
    try:
        return replan(first, budget_bytes=budget, op_ranges=False)
    except InfeasibleBudgetError as error:
        return replan(first, budget_bytes=error.min_budget_bytes, op_ranges=False)


def test_gpt2_planned_at_batch_8_seq_128_runs_smaller_and_guards_larger() -> None:
    planned = zoo.get("hf-gpt2", batch=8, seq_len=128, n_layer=3)
    plan = _plan_at(planned, 0.4)
    assert plan.checkpointing
    assert {spec.name: spec.shape for spec in plan.inputs}["input_ids"] == [8, 128]
    for batch, seq in ((4, 128), (8, 64), (4, 64)):
        ids = planned.example_inputs["input_ids"][:batch, :seq]
        with warnings.catch_warnings():
            warnings.simplefilter("error", PlanMismatchWarning)
            report = verify_plan(planned.model, plan, {"input_ids": ids, "labels": ids},
                                 repeats=1)
        assert report.within_budget and report.measured_peak_bytes <= plan.budget_bytes, (
            batch, seq, report.summary())
        assert report.losses_equal and report.grads_equal, (batch, seq, report.summary())
    bigger = torch.cat([planned.example_inputs["input_ids"]] * 2)
    apply(planned.model, plan)
    with pytest.warns(PlanMismatchWarning,
                      match=r"shape \[16, 128\], larger than the planned \[8, 128\]"):
        planned.model(input_ids=bigger)
    apply(planned.model, plan, strict=True)
    with pytest.raises(PlanMismatchError, match="Plan with these inputs"):
        planned.model(input_ids=bigger)
    remove(planned.model)
    assert not planned.model._forward_pre_hooks


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt", "hf-gpt2", "hf-llama"])
def test_bf16_autocast_plans_hold_under_autocast(name: str) -> None:
    """Profiled under autocast (bf16 activations, fp32 weights, the weight-cast cache), the
    plan is measured under autocast: within budget, gradients equal to the unplanned model
    under autocast, and the plan says which precision it is for."""
    model = zoo.get(name)
    plan = _plan_at(model, 0.4, autocast=torch.bfloat16)
    assert plan.autocast_dtype == "bfloat16" and plan.checkpointing
    report = verify_plan(model.model, plan, model.example_inputs, model.loss_fn, repeats=1)
    assert report.within_budget, report.summary()
    assert -0.001 <= report.peak_error <= 0.005, report.summary()
    assert report.losses_equal and report.grads_equal, report.summary()
    apply(model.model, plan)
    with pytest.warns(PlanMismatchWarning, match="planned under autocast bfloat16 but runs "
                      "under no autocast"):
        args = model.example_inputs
        model.model(**args) if isinstance(args, dict) else model.model(*args)
    remove(model.model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_autocast_the_models_own_forward_enters_is_the_one_checked(
        dtype: torch.dtype) -> None:
    """accelerate (and with it HF Trainer's bf16) runs mixed precision by wrapping
    ``model.forward`` on the instance in ``torch.autocast``, inside which the guard's
    pre-hook does not run: the autocast found in that wrapper is the one checked."""
    import functools

    model = zoo.get("mlp")
    plan = _plan_at(model, 0.4, autocast=torch.bfloat16)
    net = model.model
    own = net.forward
    # as accelerate wraps it: an autocast decorator, then a function that forwards to it
    entered = torch.autocast("cpu", dtype=dtype)(own)
    net.forward = functools.wraps(own)(lambda *args, **kwargs: entered(*args, **kwargs))
    apply(net, plan)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.loss_fn(net(*model.example_inputs)).backward()
        told = [str(w.message) for w in caught if w.category is PlanMismatchWarning]
        if dtype == torch.bfloat16:
            assert told == []
        else:
            assert len(told) == 1 and "runs under autocast float16" in told[0], told
    finally:
        remove(net)
        del net.forward
