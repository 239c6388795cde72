"""Every workflow keeps the promise: re-planning a planned model, planning after a backward,
gradient accumulation, eval mode, the optimizer's step. Each plan must equal the plan of a
fresh object where the step is the same, and hold its budget measured as the user trains."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from planner import (
    PlanMismatchWarning,
    apply,
    optimize,
    profile_model,
    remove,
    solve,
    verify,
    zoo,
)
from planner.measure import PeakTracker
from planner.runtime.emit import checkpointed_modules

GIB = 2**30


def _gpt() -> zoo.ZooModel:
    return zoo.get("gpt", size="tiny", batch=4)


def _budget(zm: zoo.ZooModel, fraction: float = 0.5, **options) -> int:
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                         progress=False, **options)
    static = step.profile.static.total_bytes
    return int(static + fraction * (step.unplanned_peak_bytes - static))


def _plan(zm: zoo.ZooModel, budget: int, **options):
    # module calls only: these tests are about the object's state, not the regions, and
    # op ranges multiply CP-SAT's work (benchmarks/conformance_workflows.py runs every
    # workflow with op ranges in play)
    return optimize(zm.model, zm.example_inputs, budget_gb=budget / GIB, loss_fn=zm.loss_fn,
                    timing="estimate", progress=False, time_limit_s=20,
                    **{"op_ranges": False, **options})


def _micro_batches(zm: zoo.ZooModel, count: int, *, optimizer=None) -> int:
    """Peak bytes of ``count`` forward + backward passes (and optimizer steps) from
    ``.grad`` cleared, as a training loop runs them."""
    model = zm.model
    args = zm.example_inputs if isinstance(zm.example_inputs, tuple) else (zm.example_inputs,)
    model.zero_grad(set_to_none=True)
    static = [*model.parameters(), *model.buffers(),
              *[t for t in args if isinstance(t, torch.Tensor)]]
    if optimizer is not None:
        static += [t for state in optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor)]
    torch.manual_seed(0)
    with PeakTracker(static) as tracker:
        for _ in range(count):
            zm.loss_fn(model(*args)).backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def _same_plan(a, b) -> None:
    assert a.schedule == b.schedule
    assert (a.predicted_peak_bytes, a.recompute_ms, a.fingerprint) == (
        b.predicted_peak_bytes, b.recompute_ms, b.fingerprint)


def test_replanning_a_planned_model_gives_the_fresh_plan_and_holds() -> None:
    zm = _gpt()
    budget = _budget(zm, 0.7)
    fresh = _plan(zm, budget)
    apply(zm.model, fresh)
    installed = checkpointed_modules(zm.model)
    lower = _budget(zm, 0.5)
    again = _plan(zm, budget)
    _same_plan(again, fresh)
    cheaper = _plan(zm, lower)
    # the old plan stays installed until apply replaces it
    assert checkpointed_modules(zm.model) == installed
    apply(zm.model, cheaper)
    assert _micro_batches(zm, 1) <= cheaper.budget_bytes
    remove(zm.model)
    _same_plan(cheaper, _plan(zm, lower))


def test_a_plan_without_checkpoints_made_on_a_planned_model_is_the_unplanned_peak() -> None:
    zm = _gpt()
    apply(zm.model, _plan(zm, _budget(zm, 0.5)))
    roomy = _plan(zm, 2 * _budget(zm, 1.0))
    assert not roomy.checkpointing
    assert roomy.predicted_peak_bytes == _budget(zm, 1.0)


def test_planning_after_a_backward_ignores_the_gradients_it_left() -> None:
    zm = zoo.get("resnet", batch=16)
    budget = _budget(zm, 0.8)
    fresh = _plan(zm, budget)
    zm.loss_fn(zm.model(*zm.example_inputs)).backward()
    grads = {n: p.grad.clone() for n, p in zm.model.named_parameters()}
    after = _plan(zm, budget)
    _same_plan(after, fresh)
    assert all(torch.equal(p.grad, grads[n]) for n, p in zm.model.named_parameters())
    apply(zm.model, after)
    assert _micro_batches(zm, 1) <= budget


def test_gradient_accumulation_is_planned_and_holds_over_micro_batches() -> None:
    zm = _gpt()
    budget = _budget(zm, 0.5, grad_accumulation=True)
    plan = _plan(zm, budget, grad_accumulation=True)
    assert plan.profile.static.grads_at_start
    assert "every .grad allocated" in plan.summary()
    assert plan.fingerprint != _plan(zm, budget).fingerprint
    apply(zm.model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)
        assert _micro_batches(zm, 2) <= budget


def test_a_fresh_start_plan_warns_when_a_step_starts_with_gradients() -> None:
    zm = _gpt()
    plan = _plan(zm, _budget(zm, 0.5))
    apply(zm.model, plan)
    zm.loss_fn(zm.model(*zm.example_inputs)).backward()
    with pytest.warns(PlanMismatchWarning, match="grad_accumulation=True"):
        zm.loss_fn(zm.model(*zm.example_inputs)).backward()


def test_eval_mode_plans_the_training_step_and_restores_modes() -> None:
    zm = _gpt()
    budget = _budget(zm, 0.5)
    trained = _plan(zm, budget)
    zm.model.eval()
    zm.model.blocks[0].train()  # a module's own mode is put back too
    planned = _plan(zm, budget)
    _same_plan(planned, trained)
    assert "eval mode" in planned.note and "model.train()" in planned.note
    assert not zm.model.training and zm.model.blocks[0].training
    assert not zm.model.blocks[1].training


class _Wide(nn.Module):
    """Parameters dominate: the optimizer's step is the peak of a training step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_the_budget_covers_the_optimizer_step() -> None:
    torch.manual_seed(0)
    model = _Wide()
    x = torch.randn(8, 512)
    zm = zoo.ZooModel("wide", model, (x,), lambda out: out.square().mean())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = _plan(zm, 2**30, optimizer=optimizer)
    assert plan.peak_at == "optimizer.step()"
    assert "optimizer state and step included" in plan.summary()
    tight = _plan(zm, plan.predicted_peak_bytes, optimizer=optimizer)
    apply(model, tight)
    measured = _micro_batches(zm, 3, optimizer=optimizer)
    assert measured <= tight.budget_bytes
    assert 0 <= tight.predicted_peak_bytes - measured < 1024  # a scalar or two of the step


def test_verify_leaves_the_users_gradients_as_they_were() -> None:
    zm = _gpt()
    plan = _plan(zm, _budget(zm, 0.5))
    zm.loss_fn(zm.model(*zm.example_inputs)).backward()
    grads = {n: p.grad.clone() for n, p in zm.model.named_parameters()}
    report = verify(zm.model, plan, zm.example_inputs, zm.loss_fn, repeats=1)
    assert report.grads_equal and report.losses_equal, report.summary()
    assert all(torch.equal(p.grad, grads[n]) for n, p in zm.model.named_parameters())


def test_profile_once_solve_many() -> None:
    zm = _gpt()
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                         progress=False)
    budgets = [_budget(zm, f) for f in (0.4, 0.7)]
    plans = [solve(step, budget_bytes=b, time_limit_s=20, op_ranges=False) for b in budgets]
    for plan, budget in zip(plans, budgets, strict=True):
        assert plan.predicted_peak_bytes <= budget
        _same_plan(plan, _plan(zm, budget))
    with pytest.raises(TypeError, match="replan"):
        solve(plans[0], budget_gb=1)


@pytest.mark.parametrize("budget_gb", [1e-30, 2**-31])
def test_budgets_too_small_to_mean_anything_are_refused(budget_gb: float) -> None:
    zm = _gpt()
    with pytest.raises(ValueError, match="less than 1 KiB"):
        optimize(zm.model, zm.example_inputs, budget_gb=budget_gb, loss_fn=zm.loss_fn,
                 timing="estimate", progress=False)


def test_profiling_inside_a_memory_tool_names_the_tool() -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    from planner import ProfileError

    zm = zoo.get("mlp", batch=64, width=32, depth=2)
    with MemTracker(), pytest.raises(ProfileError, match="inside MemTracker"):
        _plan(zm, 2**30)


def test_a_budget_below_the_optimizer_step_names_it() -> None:
    from planner import InfeasibleBudgetError

    torch.manual_seed(0)
    model = _Wide()
    zm = zoo.ZooModel("wide", model, (torch.randn(8, 512),), lambda out: out.square().mean())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_peak = _plan(zm, 2**30, optimizer=optimizer).predicted_peak_bytes
    with pytest.raises(InfeasibleBudgetError, match="optimizer's step") as caught:
        _plan(zm, step_peak - 4096, optimizer=optimizer)
    assert caught.value.min_budget_bytes == step_peak
    assert caught.value.lower_bound_bytes == step_peak


def test_progress_bars_stay_out_of_logs(capfd: pytest.CaptureFixture[str]) -> None:
    """Not on a terminal (a log, CI): no bar, no carriage returns."""
    import profiles

    zm = zoo.get("mlp", batch=64, width=32, depth=2)
    profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                     progress=True)
    assert "\r" not in capfd.readouterr().err
