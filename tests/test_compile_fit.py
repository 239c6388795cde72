"""Plans for compiled steps (`planner.compile_fit`, `planner.compiled_step`): the budget
holds for the step torch.compile runs, measured; the search, the error, the record."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

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
from planner.compile_fit import MAX_COMPILES, TIME_NOISE, fit_compiled
from planner.compiled_step import CompiledStep, compiled
from planner.runtime.emit import checkpointed_modules
from planner.runtime.install import _plan_suspended
from planner.solving import plan_for_schedule, solve_profiled
from planner.verification import measure_training_step
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

    def run(self, plan: Plan, partitioner_budget: float | None = None) -> tuple[int, float]:
        self.measured.append((plan.schedule, partitioner_budget))
        if self.partitioner is not None and partitioner_budget not in (None, 1.0):
            return self.partitioner(partitioner_budget)
        return self.rule(plan), self.time_rule(plan)


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


@pytest.mark.parametrize("option", [dict(offload=True), dict(envelope=dict(max_length=64))])
def test_what_a_compiled_plan_does_not_cover_is_refused_before_profiling(option) -> None:
    zm = zoo.get("mlp", batch=4, width=32, depth=2)
    with pytest.raises(ValueError, match="not planned yet"):
        optimize(zm.model, zm.example_inputs, budget_gb=1, compiled="model", **option)


def test_a_wrong_compile_mode_is_refused_naming_the_choices() -> None:
    zm = zoo.get("mlp", batch=4, width=32, depth=2)
    with pytest.raises(ValueError, match="compiled must be one of"):
        optimize(zm.model, zm.example_inputs, budget_gb=1, compiled="whole")


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
