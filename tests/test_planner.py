"""optimize / apply / verify on the zoo: budgets honoured, predictions measured, errors clear."""

from __future__ import annotations

import json

import pydantic
import pytest
import torch
from torch import nn

import profiles
from planner import (
    CaptureError,
    InfeasibleBudgetError,
    Plan,
    PlanMismatchError,
    apply,
    optimize,
    verify,
    zoo,
)
from planner.api import _input_specs, plan_for_profile
from profiles.tracing import normalize_inputs

GIB = 2**30


def _profile(model: zoo.ZooModel) -> tuple[profiles.GraphProfile, list]:
    gm = profiles.capture(model.model, model.example_inputs, model.loss_fn)
    prof = profiles.profile(gm, model.example_inputs, timing="estimate", progress=False)
    return prof, _input_specs(*normalize_inputs(model.model, model.example_inputs))


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.8])
def test_plans_honour_budgets_measured_on_cpu(zoo_model: zoo.ZooModel, fraction: float
                                              ) -> None:
    prof, inputs = _profile(zoo_model)
    unplanned = plan_for_profile(prof, 2**62, inputs).unplanned_peak_bytes
    static = prof.static.total_bytes
    budget = int(static + fraction * (unplanned - static))
    try:
        plan = plan_for_profile(prof, budget, inputs, time_limit_s=20)
    except InfeasibleBudgetError as error:  # the min is what the solvers could prove
        assert error.min_budget_bytes > budget
        pytest.skip(f"{zoo_model.name}: {fraction:.0%} of activations is below the minimum")
    report = verify(zoo_model.model, plan, zoo_model.example_inputs, zoo_model.loss_fn,
                    repeats=1)
    assert report.within_budget, report.summary()
    assert abs(report.peak_error) <= 0.03, report.summary()
    assert report.losses_equal and report.grads_equal, report.summary()
    assert plan.predicted_peak_bytes <= budget < unplanned


def test_optimize_apply_round_trip_and_batchnorm_state(tmp_path: object) -> None:
    model = zoo.get("resnet", batch=16)
    first = optimize(model.model, model.example_inputs, budget_gb=1e3, loss_fn=model.loss_fn,
                     progress=False)
    assert not first.checkpointing and "No checkpointing needed" in first.note
    static = first.profile.static.total_bytes
    budget = static + 0.7 * (first.unplanned_peak_bytes - static)
    plan = optimize(model.model, model.example_inputs, budget_gb=budget / GIB,
                    loss_fn=model.loss_fn, timing="estimate", progress=False)
    assert plan.checkpointing and plan.predicted_peak_bytes <= plan.budget_bytes
    path = f"{tmp_path}/plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    planned = apply(model.model, again)
    assert list(planned.state_dict()) == list(model.model.state_dict())
    assert all(a is b for a, b in zip(planned.parameters(), model.model.parameters(),
                                      strict=True))
    # one step of each from the same state: BatchNorm statistics end up identical
    state = {k: v.clone() for k, v in model.model.state_dict().items()}
    x, = model.example_inputs
    model.loss_fn(model.model(x)).backward()
    after_plain = {k: v.clone() for k, v in model.model.state_dict().items()}
    model.model.load_state_dict(state)
    model.loss_fn(planned(x)).backward()
    assert all(torch.equal(after_plain[k], v) for k, v in model.model.state_dict().items())
    assert "recompute" in again.summary() and "<table>" in again._repr_html_()


def test_budget_below_minimum_names_it() -> None:
    model = zoo.get("gpt", size="tiny")
    with pytest.raises(InfeasibleBudgetError, match=r"minimum is.* GiB") as info:
        optimize(model.model, model.example_inputs, budget_gb=1e-4, loss_fn=model.loss_fn,
                 progress=False)
    assert info.value.min_budget_bytes > 1e-4 * GIB


def test_untraceable_model_raises_capture_error() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) if x.sum() > 0 else x

    with pytest.raises(CaptureError, match="What to do"):
        optimize(Branchy(), torch.randn(2, 4), budget_gb=1, progress=False)


def test_plan_for_another_model_or_shape_is_refused() -> None:
    model = zoo.get("mlp", batch=8)
    plan = optimize(model.model, model.example_inputs, budget_gb=1, loss_fn=model.loss_fn,
                    progress=False)
    with pytest.raises(PlanMismatchError, match="optimize"):
        apply(zoo.get("mlp", batch=8, width=128).model, plan)
    wider_batch = plan.model_copy(update={"inputs": [
        spec.model_copy(update={"shape": [16, 64]}) for spec in plan.inputs]})
    with pytest.raises(PlanMismatchError):
        apply(model.model, wider_batch)


def test_corrupt_plan_files_name_the_field(tmp_path: object) -> None:
    model = zoo.get("mlp", depth=1)
    plan = optimize(model.model, model.example_inputs, budget_gb=1, loss_fn=model.loss_fn,
                    progress=False)
    path = f"{tmp_path}/plan.json"
    plan.save(path)
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 2])
    with pytest.raises(pydantic.ValidationError):
        Plan.load(path)
    data = json.loads(text)
    data["budget_bytes"] = "lots"
    open(path, "w").write(json.dumps(data))
    with pytest.raises(pydantic.ValidationError, match="budget_bytes"):
        Plan.load(path)
    data = json.loads(text)
    data["regions"][0]["mode"] = "sometimes"
    open(path, "w").write(json.dumps(data))
    with pytest.raises(pydantic.ValidationError, match="mode"):
        Plan.load(path)


def test_missing_loss_is_a_clear_error() -> None:
    model = zoo.get("mlp")
    with pytest.raises(ValueError, match="loss_fn"):
        optimize(model.model, model.example_inputs, budget_gb=1, progress=False)
