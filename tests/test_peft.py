"""A PEFT LoRA model is planned and trained like any other: frozen base weights get no
gradients (the plan counts only the adapters'), the budget holds, gradients are equal.
It found two bugs: keyword tensors held by nested checkpoints, and node-to-op mapping."""

from __future__ import annotations

import pytest

from planner import InfeasibleBudgetError, Plan, apply, optimize, remove, replan, verify, zoo
from planner.runtime.emit import checkpointed_modules

peft = pytest.importorskip("peft")


def _half_of_the_activations(first: Plan) -> Plan:
    """A checkpointing plan at static memory + half the activations (or the minimum)."""
    static = first.profile.static.total_bytes
    try:
        plan = replan(first, budget_bytes=static + (first.unplanned_peak_bytes - static) // 2)
    except InfeasibleBudgetError as error:
        plan = error.plan
    assert plan.checkpointing
    return plan


def test_lora_model_plans_and_trains_within_budget() -> None:
    base = zoo.get("hf-llama", batch=4)
    model = peft.get_peft_model(base.model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    inputs = base.example_inputs
    first = optimize(model, inputs, budget_gb=1e3, timing="estimate", progress=False)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters()
                    if p.requires_grad)
    assert 0 < first.profile.static.grad_bytes == trainable
    plan = _half_of_the_activations(first)
    report = verify(model, plan, inputs, repeats=1)
    assert report.within_budget and report.losses_equal and report.grads_equal, \
        report.summary()
    # frozen weights make no autograd nodes for their ops: the observed backward maps
    # nodes to ops by autograd's sequence number (was 1.8 % off by name alignment)
    assert report.measured_peak_bytes == report.predicted_peak_bytes, report.summary()
    assert apply(model, plan) is model
    model(**inputs).loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    remove(model)
    assert not checkpointed_modules(model)


@pytest.mark.parametrize("wrapped", [False, True])
def test_hf_gradient_checkpointing_already_on_is_refused(wrapped: bool) -> None:
    """HF's own checkpointing nested under a plan would double the reruns; it is found on
    the model and on the base model inside a PEFT wrapper."""
    base = zoo.get("hf-llama", batch=2)
    new_names = hasattr(base.model, "activation_checkpointing_enable")  # transformers 5
    prefix = "activation" if new_names else "gradient"
    getattr(base.model, f"{prefix}_checkpointing_enable")()
    model = base.model
    if wrapped:
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match=f"{prefix}_checkpointing_disable"):
        optimize(model, base.example_inputs, budget_gb=1e3, timing="estimate",
                 progress=False)
    getattr(base.model, f"{prefix}_checkpointing_disable")()
    assert optimize(model, base.example_inputs, budget_gb=1e3, timing="estimate",
                    progress=False).profile is not None
