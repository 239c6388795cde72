"""A compiled step counted on fake tensors (`planner.compiled_fake`,
`profiles.compiled_memory`): the peak the allocator measures when the step runs, without
running it, and the model left as it was."""

from __future__ import annotations

import pytest
import torch

import profiles
from planner import Plan, apply, optimize, profile_model, zoo
from planner.compiled_fake import FakeCompiledStep
from planner.compiled_step import CompiledStep
from planner.runtime.emit import checkpointed_modules
from profiles.inputs import normalize_inputs

# a count and a measure of the same generated code agree to the byte within each compiled
# graph; what kernels allocate inside themselves (an eager embedding backward between blocks
# compiled one by one, a CPU convolution's scratch) fake tensors do not have: GPT tiny per
# block measured 0.3 % above its count
TOLERANCE = 5e-3


def _blocks(zm: zoo.ZooModel) -> list[str]:
    return [f"{zm.block_prefix}.{i}" for i, _ in
            enumerate(zm.model.get_submodule(zm.block_prefix))]


def _plan(zm: zoo.ZooModel, fraction: float) -> Plan:
    profiled = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                             timing="estimate", progress=False)
    return optimize(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                    budget_gb=fraction * profiled.unplanned_peak_bytes / 2**30,
                    solver="dp", progress=False)


@pytest.mark.parametrize("mode", ["model", "blocks"])
def test_a_compiled_step_counted_on_fake_tensors_peaks_as_the_allocator_measures_it(
        mode: str) -> None:
    """GPT tiny with a plan that recomputes, compiled whole and per block by inductor: the
    count on fake tensors is the peak the CPU allocator's events measure when the step runs
    (before the count kept only the outermost op's outputs, fake mode's ``addmm.out`` made
    a temporary the C++ kernel does not, +14 % on GPT small). The plan goes on the model's
    fake twin only: the model keeps the plan it has (per block: applied; whole: none)."""
    zm = zoo.get("gpt", size="tiny", dropout=0.0)
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    plan = _plan(zm, 0.6)
    assert plan.schedule.recompute_regions()
    if mode == "blocks":  # a model with its plan applied keeps it through the count
        apply(zm.model, plan)
    planned = set(checkpointed_modules(zm.model))
    blocks = _blocks(zm)
    measured = CompiledStep(zm.model, args, kwargs, zm.loss_fn, mode, blocks).peak_bytes(plan)
    counted = FakeCompiledStep(zm.model, args, kwargs, zm.loss_fn, mode, blocks).peak_bytes(plan)
    assert abs(counted - measured) <= TOLERANCE * measured, (counted, measured)
    assert set(checkpointed_modules(zm.model)) == planned  # the count's plan: on its twin
    assert all(isinstance(p, torch.nn.Parameter) and not p.is_meta
               for p in zm.model.parameters())


def test_what_autograd_makes_outside_the_graphs_is_counted() -> None:
    """HF Llama compiled whole, its loss inside the graph: its backward is handed the
    logits' unused gradient as real zeros autograd makes (0.5 MiB of a 6.2 MiB step; only
    stubbed kernels read them, so fake mode never sees them): the count has them, as the
    measure does. The model's parameters, gradients, plan and compile are as they were."""
    zm = zoo.get("hf-llama")
    loss_fn = zm.loss_fn or profiles.default_loss
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    before = {k: v.clone() for k, v in zm.model.state_dict().items()}
    parameters = list(zm.model.parameters())
    measured = CompiledStep(zm.model, args, kwargs, loss_fn, "model", []).peak_bytes(None)
    counted = FakeCompiledStep(zm.model, args, kwargs, loss_fn, "model", []).peak_bytes(None)
    assert abs(counted - measured) <= TOLERANCE * measured, (counted, measured)
    assert all(zm.model.state_dict()[k].equal(v) for k, v in before.items())
    assert all(p is q for p, q in zip(zm.model.parameters(), parameters, strict=True))
    assert all(p.grad is None for p in zm.model.parameters())
    assert zm.model._compiled_call_impl is None and not checkpointed_modules(zm.model)


def test_a_step_in_lightnings_order_is_counted_with_the_gradients_it_holds() -> None:
    """Lightning's order (``zero_grad`` after the forward): the counted step starts with the
    gradients the step before it left and frees them after its forward, as the measure's
    does. HF Llama compiled whole peaks in its forward then, 1.5 MiB above the other order;
    before, the count allocated those gradients outside fake mode (real zeros it never saw)
    and counted the other order's peak."""
    zm = zoo.get("hf-llama")
    loss_fn = zm.loss_fn or profiles.default_loss
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    steps = {order: (CompiledStep(zm.model, args, kwargs, loss_fn, "model", [],
                                  grads_in_forward=order).peak_bytes(None),
                     FakeCompiledStep(zm.model, args, kwargs, loss_fn, "model", [],
                                      grads_in_forward=order).peak_bytes(None))
             for order in (False, True)}
    for measured, counted in steps.values():
        assert abs(counted - measured) <= TOLERANCE * measured, (counted, measured)
    grads = sum(p.numel() * p.element_size() for p in zm.model.parameters())
    assert steps[True][1] - steps[False][1] >= 0.5 * grads
    assert all(p.grad is None for p in zm.model.parameters())


def test_a_step_counted_again_reuses_inductors_generated_code_and_counts_the_same() -> None:
    """A schedule counted twice (a search's probes, a fit's recount) is generated once: the
    second count takes each graph's code from inductor's graph cache (before: inductor ran
    again, 2-4 s a count of GPT tiny) and its stubbed kernels count the same peak, and time
    the same on a roofline."""
    from torch._dynamo.utils import counters

    from profiles.devices import device_spec

    zm = zoo.get("mlp", batch=64, width=32, depth=3)
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    step = FakeCompiledStep(zm.model, args, kwargs, zm.loss_fn, "model", [],
                            spec=device_spec("H100"))
    first = step.run(None)
    hits, misses = (counters["inductor"][k] for k in ("fxgraph_cache_hit",
                                                      "fxgraph_cache_miss"))
    again = step.run(None)
    assert counters["inductor"]["fxgraph_cache_hit"] - hits >= 2  # forward and backward
    assert counters["inductor"]["fxgraph_cache_miss"] == misses
    assert (again.peak_bytes, again.step_ms) == (first.peak_bytes, first.step_ms)
