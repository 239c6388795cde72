"""Plans for compiled steps (`planner.compile_fit`, `planner.compiled_step`): the budget
holds for the step torch.compile runs, measured; the search, the error, the record."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from planner import (
    InfeasibleBudgetError,
    Plan,
    PlanMismatchError,
    PlanMismatchWarning,
    apply,
    optimize,
    profile_model,
    remove,
    replan,
    zoo,
)
from planner.arguments import SolveOptions
from planner.compile_fit import MAX_COMPILES, TIME_NOISE, fit_compiled, training_batches
from planner.compiled_step import Batch, CompiledMeasure, CompiledStep, compiled
from planner.envelope import Envelope
from planner.runtime.emit import checkpointed_modules
from planner.runtime.install import _plan_suspended
from planner.solving import plan_for_schedule, solve_profiled
from planner.verification import measure_step, measure_training_step
from solvers.baselines import policy_schedule
from solvers.schedule import Schedule


class RuledStep:
    """A compiled step whose peak and time rules of the test give (no compiler, no clock):
    the search's behaviour alone. Untold, a schedule's time is the eager clock's overhead,
    and the partitioner's budget changes nothing (``partitioner``: the peak and time of
    the unplanned step compiled under a fraction below 1)."""

    mode, measure, blocks = "model", "rules of the test", []

    def __init__(self, rule: Callable[[Plan], int],
                 time_rule: Callable[[Plan], float] = lambda plan: plan.predicted_overhead,
                 partitioner: Callable[[float], tuple[int, float]] | None = None) -> None:
        self.rule, self.time_rule, self.partitioner = rule, time_rule, partitioner
        self.measured: list[tuple[Schedule, float | None]] = []

    def run(self, plan: Plan, partitioner_budget: float | None = None) -> CompiledMeasure:
        self.measured.append((plan.schedule, partitioner_budget))
        if self.partitioner is not None and partitioner_budget not in (None, 1.0):
            return CompiledMeasure(*self.partitioner(partitioner_budget))
        return CompiledMeasure(self.rule(plan), self.time_rule(plan))


@pytest.fixture(scope="module")
def mlp_step():
    zm = zoo.get("mlp", batch=512, width=64, depth=6)
    return profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                         progress=False)


def _options(budget: int) -> SolveOptions:
    return SolveOptions(budget, deterministic=True)


def test_where_compile_keeps_less_the_plan_recomputes_less_than_the_eager_one(
        mlp_step) -> None:
    """Compiled, each schedule keeps three quarters of its eager peak: at a budget of 60 %
    of the eager step, the fit's schedule peaks above the budget eager (it recomputes less
    than the eager plan at the budget) and within it compiled; no schedule is compiled
    twice, and at most MAX_PROBES are."""
    budget = int(0.6 * mlp_step.unplanned_peak_bytes)
    step = RuledStep(lambda plan: plan.predicted_peak_bytes * 3 // 4)
    plan = fit_compiled(mlp_step, _options(budget), step)
    eager = solve_profiled(mlp_step, _options(budget))
    assert plan.budget_bytes == budget
    assert plan.compiled.peak_bytes == plan.predicted_peak_bytes * 3 // 4 <= budget
    assert plan.predicted_peak_bytes > budget and plan.recompute_ms < eager.recompute_ms
    assert len(step.measured) == len(set(step.measured)) <= MAX_COMPILES
    assert plan.compiled.probes[0][0] == mlp_step.unplanned_peak_bytes  # no checkpoint first
    fitting = [eager for eager, peak in plan.compiled.probes if peak <= budget]
    assert len(fitting) > 1 and plan.compiled.eager_budget_bytes == max(fitting)
    assert "compiled (model): measured peak" in plan.summary()


def test_where_nothing_compiled_fits_the_error_names_a_budget_that_holds(mlp_step) -> None:
    """Compiled, every schedule keeps more than eager (the ResNet of compile-cpu.md): the
    error names the least compiled peak measured and carries its plan, and a fit at that
    budget returns a plan within it."""
    extra = mlp_step.unplanned_peak_bytes // 4

    def rule(plan: Plan) -> int:
        return plan.predicted_peak_bytes + extra

    budget = int(0.6 * mlp_step.unplanned_peak_bytes)
    with pytest.raises(InfeasibleBudgetError, match="least measured") as caught:
        fit_compiled(mlp_step, _options(budget), RuledStep(rule))
    error = caught.value
    assert error.min_budget_bytes > budget
    assert error.plan.compiled.peak_bytes == error.min_budget_bytes == \
        rule(error.plan)
    again = fit_compiled(mlp_step, _options(error.min_budget_bytes), RuledStep(rule))
    assert again.compiled.peak_bytes <= error.min_budget_bytes


def test_where_only_every_block_checkpointed_fits_compiled_the_fit_finds_it(mlp_step) -> None:
    """Every block checkpointed, the hand policy users try first, is no eager optimum; the
    fit tries it compiled before it gives up, and where only it fits, finds it."""
    def spans(schedule: Schedule) -> list[tuple[int, int]]:
        return [(r.start, r.stop) for r in schedule.recompute_regions()]

    every_layer = spans(policy_schedule("every-layer", mlp_step.problem()))
    budget = int(0.6 * mlp_step.unplanned_peak_bytes)

    def rule(plan: Plan) -> int:
        return budget if spans(plan.schedule) == every_layer else \
            2 * plan.predicted_peak_bytes

    plan = fit_compiled(mlp_step, _options(budget), RuledStep(rule))
    assert spans(plan.schedule) == every_layer and plan.compiled.peak_bytes == budget


def test_a_compiled_plan_is_not_replanned_from_its_profile(mlp_step) -> None:
    """replan() replays the profile, which knows the eager step only: refused with what
    to do, not an eager plan in its place."""
    budget = int(0.9 * mlp_step.unplanned_peak_bytes)
    plan = fit_compiled(mlp_step, _options(budget), RuledStep(
        lambda plan: plan.predicted_peak_bytes * 3 // 4))
    with pytest.raises(ValueError, match=r"compiled='model'\)"):
        replan(plan, budget_bytes=budget // 2)


def test_a_compiled_plan_edited_over_its_budget_is_refused(mlp_step, tmp_path: Path) -> None:
    """The record travels with the plan file; a compiled peak edited above the budget is
    caught as any edited plan is."""
    budget = int(0.9 * mlp_step.unplanned_peak_bytes)
    plan = fit_compiled(mlp_step, _options(budget), RuledStep(
        lambda plan: plan.predicted_peak_bytes * 3 // 4))
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").compiled == plan.compiled
    edited = plan.model_copy(update={"compiled": plan.compiled.model_copy(
        update={"peak_bytes": budget + 1})})
    with pytest.raises(ValueError, match="compiled"):
        edited.check()
    text = (tmp_path / "plan.json").read_text().replace('"mode": "model"', '"mode": "whole"')
    (tmp_path / "edited.json").write_text(text)
    with pytest.raises(ValueError, match="mode"):
        Plan.load(tmp_path / "edited.json")


@pytest.mark.parametrize(("option", "said"), [
    (dict(offload=True), "not planned yet"),
    (dict(envelope=dict(max_length=64, buckets="pow2")), "buckets='one'")])
def test_what_a_compiled_plan_does_not_cover_is_refused_before_profiling(option, said) -> None:
    zm = zoo.get("mlp", batch=4, width=32, depth=2)
    with pytest.raises(ValueError, match=said):
        optimize(zm.model, zm.example_inputs, budget_gb=1, compiled="model", **option)


def test_a_wrong_compile_mode_is_refused_naming_the_choices() -> None:
    zm = zoo.get("mlp", batch=4, width=32, depth=2)
    with pytest.raises(ValueError, match="compiled must be one of"):
        optimize(zm.model, zm.example_inputs, budget_gb=1, compiled="whole")


def test_collected_compile_garbage_without_a_compiled_step_is_refused() -> None:
    zm = zoo.get("mlp", batch=4, width=32, depth=2)
    with pytest.raises(ValueError, match="give compiled='model' or 'blocks' with it"):
        optimize(zm.model, zm.example_inputs, budget_gb=1, compile_garbage_collected=True)


def test_a_compiled_plan_holds_its_budget_compiled_and_leaves_the_model_as_it_was() -> None:
    """inductor for real, on an MLP: the fit's plan, applied and compiled, measures its
    recorded peak, within the budget, with the unplanned compiled step's gradients (within
    compile's tolerance); the model keeps its state, gradients, plan (none) and compile
    (none) through the fit."""
    zm = zoo.get("mlp", batch=512, width=64, depth=6)
    model, (x,) = zm.model, zm.example_inputs
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profiled = profile_model(model, x, loss_fn=zm.loss_fn, timing="estimate", progress=False)
    budget = int(0.7 * profiled.unplanned_peak_bytes)
    plan = optimize(model, x, budget_gb=budget / 2**30, loss_fn=zm.loss_fn, compiled="model",
                    timing="estimate", deterministic=True, progress=False)
    assert plan.compiled.peak_bytes <= plan.budget_bytes == budget
    assert plan.compiled.step_ms > 0  # timed, its timed steps leave the model as it was
    assert len(plan.compiled.probe_step_ms) == len(plan.compiled.probes)
    assert all(model.state_dict()[k].equal(v) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())
    assert not checkpointed_modules(model) and model._compiled_call_impl is None
    assert torch._functorch.config.activation_memory_budget == 1.0  # the process's, again
    step = CompiledStep(model, (x,), {}, zm.loss_fn, "model", [])
    assert step.peak_bytes(plan) == plan.compiled.peak_bytes  # measured again: the same

    def grads() -> list[torch.Tensor]:
        compiled = torch.compile(model)
        zm.loss_fn(compiled(x)).backward()
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        return out

    reference = grads()
    apply(model, plan)
    try:
        for got, want in zip(grads(), reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    finally:
        remove(model)


def test_a_compiled_plan_with_its_optimizer_holds_the_training_step_it_runs() -> None:
    """inductor for real, with AdamW: the plan's peak counts the optimizer's state through
    the compiled forward and backward and the optimizer's own step after them, and a
    compiled training step from its second step on measures that peak, within the budget;
    planning leaves the optimizer without state."""
    zm = zoo.get("mlp", batch=512, width=64, depth=6)
    model, (x,) = zm.model, zm.example_inputs
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profiled = profile_model(model, x, loss_fn=zm.loss_fn, timing="estimate", progress=False,
                             optimizer=optimizer)
    budget = int(0.8 * profiled.unplanned_peak_bytes)
    plan = optimize(model, x, budget_gb=budget / 2**30, loss_fn=zm.loss_fn, compiled="model",
                    optimizer=optimizer, timing="estimate", deterministic=True,
                    progress=False)
    assert not optimizer.state
    state_bytes = profiled.profile.static.optimizer_state_bytes
    assert plan.compiled.optimizer_state_bytes == state_bytes > 0
    assert plan.compiled.peak_bytes <= plan.budget_bytes == budget
    apply(model, plan)
    try:
        with compiled(model, "model", []):
            measured = measure_training_step(model, (x,), {}, zm.loss_fn, optimizer)
    finally:
        remove(model)
    assert measured == plan.compiled.peak_bytes


class _Widening(torch.nn.Module):
    """Blocks of one type whose input widths all differ: compiled one by one, each is a new
    shape for dynamo's one `forward` code object."""

    class Block(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(width, width + 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.inner(x))

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[self.Block(16 + 8 * i) for i in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.mark.parametrize("limit", [1, 8])
def test_a_block_past_dynamos_recompile_limit_is_said_and_recorded(
        limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three blocks of three shapes compiled one by one (dynamo's eager backend: the limit is
    dynamo's, not inductor's): under a recompile limit of 1 the blocks past it run eager,
    and the plan says so, in a warning with what to do and in its record; under 8 it is
    silent."""
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self: compile_module(self, backend="eager"))
    torch.manual_seed(0)
    model, x = _Widening(), torch.randn(256, 16)
    with warnings.catch_warnings(record=True) as caught, \
            torch._dynamo.config.patch(recompile_limit=limit):
        warnings.simplefilter("always")
        plan = optimize(model, x, budget_gb=1.0, loss_fn=lambda out: out.square().mean(),
                        compiled="blocks", timing="estimate", deterministic=True,
                        progress=False)
    said = [w for w in caught if "recompile limit" in str(w.message)]
    assert plan.compiled.blocks == ["blocks.0", "blocks.1", "blocks.2"]
    if limit == 1:
        assert plan.compiled.recompile_limit_hit == 1
        assert len(said) == 1 and said[0].filename == __file__  # the caller's line
        assert "torch._dynamo.config.recompile_limit = 1" in str(said[0].message)
        assert "recompile limit (1) was reached" in plan.summary()
        assert Plan.model_validate_json(plan.model_dump_json()).compiled == plan.compiled
    else:
        assert plan.compiled.recompile_limit_hit is None and not said


def test_where_a_hand_policy_compiled_fits_and_runs_faster_the_fit_chooses_it() -> None:
    """Compiled, a selective policy's recompute fuses into the backward: the eager clock
    ranks saving the linears of every block far behind the eager optimum, yet compiled it
    can fit and run faster. The fit measures it and, faster, chooses it; the search's
    other schedules are still measured, and what it chose is recorded."""
    zm = zoo.get("gpt", size="tiny")
    profiled = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                             timing="estimate", progress=False)
    sac_linear = plan_for_schedule(profiled.profile,
                                   policy_schedule("sac-linear", profiled.problem()),
                                   profiled.inputs, profiled.structure)
    budget = sac_linear.predicted_peak_bytes * 3 // 4 + 1
    step = RuledStep(lambda plan: plan.predicted_peak_bytes * 3 // 4,
                     lambda plan: 1.0 if plan.schedule == sac_linear.schedule else 2.0)
    plan = fit_compiled(profiled, _options(budget), step)
    assert plan.schedule == sac_linear.schedule and len(step.measured) > 2
    assert plan.compiled.peak_bytes <= budget and plan.compiled.step_ms == 1.0
    assert plan.compiled.source == "hand policy 'sac-linear'"
    assert 2.0 in plan.compiled.probe_step_ms
    assert "hand policy 'sac-linear', the fastest that fit" in plan.summary()
    assert plan.compiled.unplanned_step_ms == 2.0  # nothing checkpointed, timed as probed
    assert "1.0 ms a step compiled (-50.0% against 2.0 ms with nothing checkpointed)" in \
        plan.summary()


class DeviceStep(RuledStep):
    """A `RuledStep` on a device of ``capacity`` bytes: a schedule that peaks above it raises
    the device's out-of-memory error, as a GPU's allocator does."""

    def __init__(self, rule: Callable[[Plan], int], capacity: int) -> None:
        super().__init__(rule)
        self.capacity = capacity

    def run(self, plan: Plan, partitioner_budget: float | None = None) -> CompiledMeasure:
        if self.rule(plan) > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().run(plan, partitioner_budget)


def test_a_schedule_that_runs_the_device_out_of_memory_is_counted_and_the_fit_goes_on(
        mlp_step) -> None:
    """A model whose unplanned step does not fit the device (the users who need a plan):
    the first probe, nothing checkpointed, runs out of memory; the fit counts it on fake
    tensors instead, scales the next probe by that count, and ends on a measured plan
    within the budget. Without a counter the error is the device's, raised."""
    def rule(plan: Plan) -> int:
        return plan.predicted_peak_bytes * 3 // 4

    budget = int(0.6 * mlp_step.unplanned_peak_bytes)
    capacity = int(0.7 * mlp_step.unplanned_peak_bytes)
    counters: list[RuledStep] = []

    def counter() -> RuledStep:
        counters.append(RuledStep(rule, time_rule=lambda plan: None))
        return counters[-1]

    step = DeviceStep(rule, capacity)
    lines: list[str] = []
    plan = fit_compiled(mlp_step, _options(budget), step, lines.append, counter=counter)
    assert plan.compiled.peak_bytes <= budget and plan.compiled.step_ms is not None
    unplanned = plan.compiled.probes[0]
    assert unplanned == (mlp_step.unplanned_peak_bytes, _rule_of_unplanned(mlp_step, rule))
    assert unplanned[1] > capacity and plan.compiled.probe_step_ms[0] is None
    assert [s for c in counters for s, _ in c.measured] and \
        all(_rule_of_schedule(mlp_step, s, rule) > capacity
            for c in counters for s, _ in c.measured)
    assert "counted on fake tensors: it ran the device out of memory" in lines[0]
    with pytest.raises(torch.OutOfMemoryError):
        fit_compiled(mlp_step, _options(budget), DeviceStep(rule, capacity))
    # a budget above what the device holds: a schedule that ran it out of memory is not a
    # plan, whatever its count says (here none runs)
    with pytest.raises(InfeasibleBudgetError):
        fit_compiled(mlp_step, _options(budget), DeviceStep(rule, capacity=0),
                     counter=counter)


def _rule_of_unplanned(profiled: Any, rule: Callable[[Plan], int]) -> int:
    return _rule_of_schedule(profiled, policy_schedule("none", profiled.problem()), rule)


def _rule_of_schedule(profiled: Any, schedule: Schedule, rule: Callable[[Plan], int]) -> int:
    return rule(plan_for_schedule(profiled.profile, schedule, profiled.inputs,
                                  profiled.structure))


def test_counted_on_fake_tensors_the_fit_keeps_the_fitting_schedule_that_keeps_most(
        mlp_step) -> None:
    """Untimed (every schedule counted on fake tensors, nothing run), the plan is the one
    of the largest compiled peak that fits: the least recompute, ours or the partitioner's
    (before: the largest eager budget, which put the partitioner's probes, made at the
    unplanned step's budget, first whatever they kept)."""
    budget = int(0.6 * mlp_step.unplanned_peak_bytes)
    unplanned_compiled = mlp_step.unplanned_peak_bytes * 3 // 4
    step = RuledStep(lambda plan: plan.predicted_peak_bytes * 3 // 4,
                     time_rule=lambda plan: None,
                     partitioner=lambda fraction: (int(unplanned_compiled * (0.5 + fraction
                                                                              / 4)), None))
    plan = fit_compiled(mlp_step, _options(budget), step)
    fitting = [peak for _, peak in plan.compiled.probes if peak <= budget]
    assert plan.compiled.peak_bytes == max(fitting) and plan.compiled.step_ms is None
    assert any(fraction not in (None, 1.0) for _, fraction in step.measured)


def test_execution_fake_counts_every_compiled_schedule_on_fake_tensors(monkeypatch) -> None:
    """``optimize(..., compiled=, execution='fake')`` plans the compiled step without
    running it: the eager step profiled on fake tensors, every schedule counted
    (`FakeCompiledStep`); with real execution each runs, and the count is only for one
    that runs the device out of memory."""
    from planner import compile_fit
    from planner.compiled_fake import FakeCompiledStep

    seen: dict[str, Any] = {}

    def fit(profiled, options, step, report=None, *, counter=None):
        seen.update(step=step, counter=counter, execution=profiled.profile.execution)
        raise RuntimeError("stop here")

    monkeypatch.setattr(compile_fit, "fit_compiled", fit)
    zm = zoo.get("mlp", batch=4, width=32, depth=2)
    for execution, kind in (("fake", FakeCompiledStep), ("real", CompiledStep)):
        with pytest.raises(RuntimeError, match="stop here"):
            optimize(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, budget_gb=1,
                     compiled="model", execution=execution, progress=False)
        assert type(seen["step"]) is kind and seen["execution"] == execution
        assert (seen["counter"] is None) == (execution == "fake")
    assert isinstance(seen["counter"](), FakeCompiledStep)
    assert seen["counter"]().spec is None  # a schedule that ran out of memory never fits
    # counted, each schedule's time is predicted on the profile's device: this CPU's own
    # roofline, measured, for a model on it; a named device's, estimated for it
    optimize_fake = dict(loss_fn=zm.loss_fn, budget_gb=1, compiled="model", progress=False)
    for device, timing, name in ((None, "auto", "cpu (measured)"),
                                 ("H100", "estimate", "H100")):
        with pytest.raises(RuntimeError, match="stop here"):
            optimize(zm.model, zm.example_inputs, execution="fake", device=device,
                     timing=timing, **optimize_fake)
        assert seen["step"].spec.name == name
    # counted, a convolution's workspace is not seen: said where the step has one
    resnet = zoo.get("resnet")
    with pytest.warns(PlanMismatchWarning, match="convolution's workspace"), \
            pytest.raises(RuntimeError, match="stop here"):
        optimize(resnet.model, resnet.example_inputs, loss_fn=resnet.loss_fn, budget_gb=1,
                 compiled="model", execution="fake", progress=False)


def test_among_schedules_timed_within_noise_the_fit_keeps_the_one_that_recomputes_least(
        mlp_step) -> None:
    """Schedules timed one after another differ by noise: where every schedule that fits
    times within `TIME_NOISE` of the fastest, the plan is the one of the largest compiled
    peak (the least recompute), not the one the noise made fastest."""
    budget = int(0.6 * mlp_step.unplanned_peak_bytes)
    # the least peak times fastest, by less than the noise
    step = RuledStep(lambda plan: plan.predicted_peak_bytes * 3 // 4,
                     lambda plan: 1.0 + 1e-9 * plan.predicted_peak_bytes * TIME_NOISE / 10)
    plan = fit_compiled(mlp_step, _options(budget), step)
    fitting = [peak for _, peak in plan.compiled.probes if peak <= budget]
    assert len(set(fitting)) > 1 and plan.compiled.peak_bytes == max(fitting)


def test_where_the_partitioners_own_budget_fits_and_runs_fastest_the_plan_carries_it(
        mlp_step) -> None:
    """Compiled, the partitioner recomputes fused pointwise ops that no region of whole ops
    can: where, nothing checkpointed, its own budget (a fraction) fits and runs
    fastest, the plan is that, says so and records the fraction; the fractions tried run
    from the least toward the budget, each measured once."""
    unplanned = mlp_step.unplanned_peak_bytes
    budget = int(0.6 * unplanned)

    def partitioner(fraction: float) -> tuple[int, float]:
        return int(unplanned * (0.4 + 0.4 * fraction)), 1e-3  # fits up to 0.5

    step = RuledStep(lambda plan: plan.predicted_peak_bytes, partitioner=partitioner)
    plan = fit_compiled(mlp_step, _options(budget), step)
    fractions = [f for _, f in step.measured if f not in (None, 1.0)]
    assert fractions[0] == 0.0 and len(fractions) == len(set(fractions)) > 2
    fitting = [f for f in fractions if partitioner(f)[0] <= budget]
    assert plan.compiled.partitioner_budget == max(fitting) and 0 < max(fitting) <= 0.5
    assert not plan.schedule.recompute_regions() and plan.compiled.peak_bytes <= budget
    assert plan.compiled.source.startswith("torch's partitioner at activation_memory_budget=")
    assert "torch's partitioner" in plan.summary()
    assert "No checkpointing needed" not in plan.summary()  # the eager step does not fit
    assert "torch's partitioner recomputes" in plan.note


def test_apply_sets_the_partitioners_budget_its_plan_was_measured_under_and_remove_restores(
        mlp_step) -> None:
    """A compiled plan holds under the partitioner's budget it was measured under: apply
    sets it (compile partitions after apply), a plan applied in its place restores the
    value found first, profiling the planned model sees the process's own, and remove
    puts it back."""
    budget = int(0.9 * mlp_step.unplanned_peak_bytes)
    plan = fit_compiled(mlp_step, _options(budget), RuledStep(
        lambda plan: plan.predicted_peak_bytes * 3 // 4))
    assert plan.compiled.partitioner_budget == 1.0  # the process's, recorded
    partitioned = plan.model_copy(update={"compiled": plan.compiled.model_copy(
        update={"partitioner_budget": 0.25})})
    zm = zoo.get("mlp", batch=512, width=64, depth=6)
    config = torch._functorch.config
    with config.patch(activation_memory_budget=0.75):
        apply(zm.model, partitioned)
        assert config.activation_memory_budget == 0.25
        with _plan_suspended(zm.model):
            assert config.activation_memory_budget == 0.75
        assert config.activation_memory_budget == 0.25
        apply(zm.model, plan)
        assert config.activation_memory_budget == 1.0
        apply(zm.model, partitioned)
        remove(zm.model)
        assert config.activation_memory_budget == 0.75


def test_a_partitioner_budget_changed_after_apply_is_said_at_the_next_step(mlp_step) -> None:
    """The guard says, once, with what to do, that the partitioner's budget moved away from
    the one the compiled plan was measured under; strict, it refuses the step."""
    budget = int(0.9 * mlp_step.unplanned_peak_bytes)
    plan = fit_compiled(mlp_step, _options(budget), RuledStep(
        lambda plan: plan.predicted_peak_bytes * 3 // 4))
    zm = zoo.get("mlp", batch=512, width=64, depth=6)
    config = torch._functorch.config
    with config.patch(activation_memory_budget=1.0):
        apply(zm.model, plan)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", PlanMismatchWarning)
                zm.loss_fn(zm.model(*zm.example_inputs)).backward()  # as planned: silent
            zm.model.zero_grad(set_to_none=True)
            config.activation_memory_budget = 0.3
            with pytest.warns(PlanMismatchWarning, match=r"measured compiled under 1\.0"):
                zm.loss_fn(zm.model(*zm.example_inputs)).backward()
            zm.model.zero_grad(set_to_none=True)
            apply(zm.model, plan, strict=True)
            config.activation_memory_budget = 0.3
            with pytest.raises(PlanMismatchError, match=r"activation_memory_budget is 0\.3"):
                zm.model(*zm.example_inputs)
        finally:
            remove(zm.model)


def test_where_the_partitioners_least_fraction_does_not_fit_a_larger_one_is_still_tried(
        mlp_step) -> None:
    """The partitioner's peak is not monotone in its fraction (the zoo Llama per block:
    5.36 MiB at 0, 5.26 at 0.5): where 0 does not fit, the fit goes on to larger
    fractions and finds one that does."""
    unplanned = mlp_step.unplanned_peak_bytes
    budget = int(0.6 * unplanned)

    def partitioner(fraction: float) -> tuple[int, float]:
        return int(unplanned * (0.7 if fraction < 0.25 else 0.3 + 0.5 * fraction)), 1e-3

    step = RuledStep(lambda plan: plan.predicted_peak_bytes, partitioner=partitioner)
    plan = fit_compiled(mlp_step, _options(budget), step)
    assert 0.25 <= plan.compiled.partitioner_budget <= 0.6
    assert plan.compiled.peak_bytes == partitioner(plan.compiled.partitioner_budget)[0]


class _Tokens(torch.nn.Module):
    """A small language model of token ids (no masks): an embedding, two MLP blocks, a
    head; its memory grows with the batch's length."""

    class Block(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width,
                                                                                   width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.Sequential(*[self.Block(width) for _ in range(2)])
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def _token_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def test_a_compiled_plan_of_an_envelope_is_measured_on_a_shorter_batch_then_each_branch() -> None:
    """The batches a compiled plan of an envelope is measured on, in training's order: one
    shorter (dynamo's next compile makes the length dynamic; never of 1 token, a shape dynamo
    compiles on its own), then the longest padded, profiled, then unpadded; one length
    alone where the envelope has one; the example alone without an envelope."""
    ids = torch.randint(2, 64, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    envelope = Envelope(max_length=64, min_length=1)
    got, profiled = training_batches((), batch, envelope)
    assert [b.label for b in got] == [
        "of 2 tokens, padded", "of 64 tokens, padded", "of 64 tokens, unpadded",
        "of 64 tokens, padded (rows of 1 to all tokens)"]
    assert profiled is got[1]
    assert got[3].kwargs["attention_mask"].sum(1).tolist() == [32, 64]
    assert [tuple(b.kwargs["input_ids"].shape) for b in got] == [(2, 2), *[(2, 64)] * 3]
    assert not got[1].kwargs["attention_mask"].all() and got[2].kwargs["attention_mask"].all()
    one, _ = training_batches((ids,), {}, Envelope(max_length=32, min_length=32, batch_size=3))
    assert [(b.label, b.args[0].shape) for b in one] == [("of 32 tokens", (3, 32))]
    assert training_batches((ids,), {}, None)[1].args[0] is ids


def test_a_compiled_plan_of_an_envelope_records_each_batchs_peak_and_holds_the_largest(
        mlp_step) -> None:
    """Each probe is measured on every batch of the envelope (the rule here: the shorter
    batch at 40 % of the schedule's eager peak, the unpadded one at 110 %, the profiled one
    at 100 %): the plan's peak is the largest, within the budget, and its record and
    summary list each batch's."""
    budget = int(0.7 * mlp_step.unplanned_peak_bytes)
    shares = (0.4, 1.0, 1.1)

    class Batched(RuledStep):
        batches: ClassVar = [Batch(label, (), {}) for label in ("short", "longest",
                                                               "unpadded")]

        def run(self, plan: Plan, partitioner_budget: float | None = None) -> CompiledMeasure:
            peaks = tuple(int(share * plan.predicted_peak_bytes) for share in shares)
            return CompiledMeasure(max(peaks), plan.predicted_overhead, peaks)

    plan = fit_compiled(mlp_step, _options(budget), Batched(lambda plan: 0))
    eager = plan.predicted_peak_bytes
    assert plan.compiled.peak_bytes == int(1.1 * eager) <= budget
    assert plan.compiled.batches == [(label, int(share * eager)) for label, share in
                                     zip(("short", "longest", "unpadded"), shares,
                                         strict=True)]
    assert "then unpadded" in plan.compiled.describe(budget)


def test_a_compiled_plan_of_an_envelope_holds_every_length_training_gives_it() -> None:
    """inductor for real: planned for batches of 8 to 64 tokens, the plan applied and the
    model compiled as training compiles it, a stream of lengths (the first compiles a graph
    of its shape, the second one with the length dynamic, which the rest run) stays within
    the budget at every step, and the longest measures the peak the plan records for it."""
    torch.manual_seed(0)
    model = _Tokens()
    longest = torch.randint(0, 64, (4, 64))
    unplanned = profile_model(model, (longest,), loss_fn=_token_loss, timing="estimate",
                              progress=False).unplanned_peak_bytes
    budget = int(0.8 * unplanned)
    plan = optimize(model, (longest[:, :16],), budget_gb=budget / 2**30, loss_fn=_token_loss,
                    compiled="model", envelope=Envelope(max_length=64, min_length=8),
                    timing="estimate", solver="dp", progress=False)  # exact, and quick here
    assert [label for label, _ in plan.compiled.batches] == ["of 8 tokens", "of 64 tokens"]
    apply(model, plan)
    try:
        with compiled(model, "model", []):
            peaks = {}
            for length in (8, 64, 24, 64, 40):
                _token_loss(model(longest[:, :length])).backward()  # compiles where new
                model.zero_grad(set_to_none=True)
                peaks[length] = measure_step(model, (longest[:, :length],), {}, _token_loss,
                                             compiled=True)[0]
    finally:
        remove(model)
    assert max(peaks.values()) <= budget
    assert peaks[64] == plan.compiled.batches[1][1] == plan.compiled.peak_bytes


def test_a_compiling_steps_own_peak_and_what_it_leaves_alive_are_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a compile keeps alive after its step is held through every step training runs
    after, from every compile: a backend here keeps 1 MiB per graph it compiles (beside
    dynamo's eager run of the graph), so after the short and the long batch compiled, each
    batch's step holds 2 MiB more, whether or not the loop collects garbage (the MiB is not
    garbage); and the compiling step's own peak (a backward compiled during it) counts where
    it is the larger."""
    kept: list[torch.Tensor] = []

    def keeping(graph: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        kept.append(torch.ones(2**18))  # 1 MiB, alive after the compiling step
        return graph.forward

    compile_module = torch.nn.Module.compile
    torch.manual_seed(0)
    model, ids = _Tokens(), torch.randint(0, 64, (4, 64))
    batches = [Batch("short", (ids[:, :16],), {}), Batch("long", (ids,), {})]

    def peaks(backend: Any, garbage_collected: bool = False) -> tuple[int, ...]:
        monkeypatch.setattr(torch.nn.Module, "compile",
                            lambda self: compile_module(self, backend=backend))
        step = CompiledStep(model, (ids,), {}, _token_loss, "model", [], batches=batches,
                            garbage_collected=garbage_collected)
        return step.run(None, timed_steps=0).batch_peaks

    def passing(graph: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        torch.ones(2**20).sum()  # 4 MiB while compiling, in the compiling step only
        return graph.forward

    plain = peaks("eager")
    for collected in (False, True):
        kept.clear()
        keeping_peaks = peaks(keeping, collected)
        assert len(kept) == 2  # compiled: each new shape's step kept its MiB
        assert [k - p for k, p in zip(keeping_peaks, plain, strict=True)] == [2**21, 2**21]
    # the compiling step is a step of training: its peak is the batch's where it is larger
    assert max(plain) < 2**21 and min(peaks(passing)) >= 2**22


def test_a_tensor_only_a_reference_cycle_holds_is_counted_whenever_the_collector_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HF GPT-2's compiling step leaves its logits in a reference cycle: freed whenever
    Python's collector next runs, which a cold compile's many objects made happen before the
    step ended (the measure then read 0.5 MiB less than with the graph from inductor's
    cache), and in the Trainer at no step in particular (its later steps held one or both
    compiles' logits). Here a backend's first call leaves 1 MiB in a cycle and makes objects
    enough for the collector to run. Stepped on a short batch, then the long one: every
    later step may hold both compiles' MiB, and the peak counts them; where the loop
    collects garbage after a step that compiled (``garbage_collected``), only the compiling
    step holds its own."""
    import gc

    def cycling(graph: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        first = [True]

        def run(*args: Any) -> Any:
            if first[0]:
                first[0] = False
                cycle: list[Any] = [torch.ones(2**18)]  # 1 MiB only the cycle holds
                cycle.append(cycle)
                del cycle
                _ = [[] for _ in range(10_000)]  # objects enough to run the collector
            return graph.forward(*args)

        return run

    compile_module = torch.nn.Module.compile
    torch.manual_seed(0)
    model, ids = _Tokens(), torch.randint(0, 64, (4, 64))

    batches = [Batch("short", (ids[:, :16],), {}), Batch("long", (ids,), {})]

    def peak(backend: Any, garbage_collected: bool = False) -> int:
        monkeypatch.setattr(torch.nn.Module, "compile",
                            lambda self: compile_module(self, backend=backend))
        return CompiledStep(model, (ids,), {}, _token_loss, "model", [], batches=batches,
                            garbage_collected=garbage_collected).peak_bytes(None)

    assert gc.isenabled()
    plain = peak("eager")
    assert peak(cycling) - plain == 2**21
    assert peak(cycling, garbage_collected=True) - plain == 2**20
