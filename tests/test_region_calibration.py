"""planner.region_calibration: a checkpoint region's cost measured on the model itself."""

from __future__ import annotations

import pytest
import torch

import profiles
from planner import profile_model, solve, zoo
from planner.region_calibration import (
    Timed,
    calibrated_profile,
    calibration_schedules,
    fitted_costs,
)
from planner.runtime.emit import checkpointed_modules
from profiles.inputs import normalize_inputs
from profiles.schema import CheckpointCosts
from solvers.from_profile import problem_from_profile

COSTS = CheckpointCosts(region_ms=0.1, pack_ms=0.01, sac_op_ms=0.02, source="tiny ops")


def test_fitted_costs_charge_what_each_plan_measured_beyond_its_reruns():
    # large regions (4, packing 100 tensors) and small ones (4, packing 8): 0.5 ms a
    # region, 0.02 a tensor, with noise
    fitted = fitted_costs(COSTS, [(4.05, 4, 100, 0, 0), (2.15, 4, 8, 0, 0)])
    assert fitted.region_ms == pytest.approx(0.5, abs=0.02)
    assert fitted.pack_ms == pytest.approx(0.02, abs=0.002)
    assert fitted.sac_op_ms == COSTS.sac_op_ms  # no plan under a policy: the tiny ops' one
    assert fitted.range_ms == 0.0  # no op range measured: none charged more
    assert "4 regions (0 op ranges, 0 ops under a policy), 100 packs: 4.05 ms" in fitted.source
    # one plan alone: the fit keeps the ratio it cannot tell apart at its least squares
    alone = fitted_costs(COSTS, [(4.0, 4, 100, 0, 0)])
    assert 4 * alone.region_ms + 100 * alone.pack_ms == pytest.approx(4.0)
    # never below the tiny ops': small regions that measured dearer than large ones cost
    # per region, their tensors what the tiny ops' did
    skewed = fitted_costs(COSTS, [(2.0, 4, 100, 0, 0), (3.0, 4, 8, 0, 0)])
    assert skewed.pack_ms == COSTS.pack_ms and skewed.region_ms > COSTS.region_ms
    # a plan no slower than its reruns (noise: checkpoint's own frame and packs take the
    # tiny ops' time in any region): the tiny ops' costs stay
    free = fitted_costs(COSTS, [(-1.0, 4, 100, 0, 0), (-0.5, 4, 8, 0, 0)])
    assert (free.region_ms, free.pack_ms) == (COSTS.region_ms, COSTS.pack_ms)


def test_fitted_costs_charge_once_per_step_what_one_region_measured_more():
    """ResNet b16 (2 cores): one small region measured 0.9-1.2 ms beyond its rerun, two
    1.3-1.5, six 2.1-2.3: 0.5-0.75 ms once per step, then per region. A fit without a
    step's cost charged six regions' mean to one and predicted small plans 4 points low."""
    def plan(n: int, packs: int) -> tuple[float, int, int, int, int]:
        return (0.7 + 0.25 * n + 0.01 * packs, n, packs, 0, 0)

    fitted = fitted_costs(COSTS, [plan(6, 124), plan(6, 6), plan(1, 1)])
    assert fitted.step_ms == pytest.approx(0.7)
    assert (fitted.region_ms, fitted.pack_ms) == pytest.approx((0.25, 0.01))
    # plans of one region count only: no step's cost told apart
    assert fitted_costs(COSTS, [plan(6, 124), plan(6, 6)]).step_ms == 0.0


def test_a_step_cost_within_the_noise_of_its_plans_is_not_charged():
    """HF GPT-2 in a frontier run fitted 6.19 ms a step, read off its one-region plan: that
    plan was predicted 12.0 % and measured 3.5. Given each plan's standard error, a step
    cost below two of its own is left out and its ms go to the regions; one the rounds
    resolve is charged as before."""
    def plan(n: int, packs: int) -> tuple[float, int, int, int, int]:
        return (0.7 + 0.25 * n + 0.01 * packs, n, packs, 0, 0)

    plans = [plan(6, 124), plan(6, 6), plan(1, 1)]
    quiet = fitted_costs(COSTS, plans, [0.05, 0.05, 0.05])
    assert quiet.step_ms == pytest.approx(0.7)
    noisy = fitted_costs(COSTS, plans, [0.6, 0.6, 0.6])
    assert noisy.step_ms == 0.0
    # what the step cost was is charged per region now (least squares over the three), and
    # the one-region plan no longer carries a whole step's cost
    assert noisy.region_ms > 0.25
    assert noisy.region_ms + noisy.pack_ms < plans[2][0]


def test_fitted_costs_charge_a_policy_per_op_what_its_plan_measured_beyond_its_regions():
    """The blocks recomputed keeping their matmuls (ResNet b16: +51.3 % measured where
    the tiny-op chains' 0.018 ms an op predicted +39.1 %): what that plan measured beyond
    its regions and packs, per op the policy sees; not counted in the regions' fit."""
    plans = [(4 * 0.5 + 100 * 0.02, 4, 100, 0, 0), (4 * 0.5 + 8 * 0.02, 4, 8, 0, 0),
             (4 * 0.5 + 90 * 0.02 + 200 * 0.07, 4, 90, 0, 200)]
    fitted = fitted_costs(COSTS, plans)
    assert (fitted.region_ms, fitted.pack_ms) == pytest.approx((0.5, 0.02))
    assert fitted.sac_op_ms == pytest.approx(0.07)
    # a policy that cost less than its regions charges what the tiny ops' policy did
    cheap = fitted_costs(COSTS, [*plans[:2], (1.0, 4, 90, 0, 200)])
    assert cheap.sac_op_ms == COSTS.sac_op_ms


def test_fitted_costs_tell_an_op_range_from_a_module_call():
    """Blocks as module calls and small op ranges (GPT small measured 0.59 ms for four
    blocks beyond their reruns, 3.30 ms for four ranges): each kind gets its own cost; the
    tensors keep the tiny ops' cost, which two plans cannot tell apart from a region's."""
    fitted = fitted_costs(COSTS, [(4 * 0.2 + 100 * 0.01, 4, 100, 0, 0),
                                  (4 * 0.9 + 4 * 0.01, 4, 4, 4, 0)])
    assert fitted.region_ms == pytest.approx(0.2)
    assert fitted.range_ms == pytest.approx(0.7)
    assert fitted.pack_ms == COSTS.pack_ms
    # ranges that measure cheaper than calls cost nothing more, never less
    cheaper = fitted_costs(COSTS, [(4 * 0.9, 4, 100, 0, 0), (4 * 0.2, 4, 4, 4, 0)])
    assert cheaper.range_ms == 0.0 and cheaper.region_ms > 0


def test_calibration_schedules_are_whole_blocks_and_a_small_span_in_each():
    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.0)
    prof = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                            progress=False)
    problem = problem_from_profile(prof)
    blocks, small, kept, one = calibration_schedules(prof, problem)
    assert [(r.start, r.stop) for r in blocks.recompute_regions()] == problem.blocks()
    assert [r.target.path for r in blocks.recompute_regions()] == ["blocks.0", "blocks.1"]
    inner = small.recompute_regions()
    assert len(inner) == 2 and all(
        a <= r.start and r.stop <= b and (r.start, r.stop) != (a, b)
        for r, (a, b) in zip(inner, problem.blocks(), strict=True))
    assert not any(r.keep for r in [*blocks.recompute_regions(), *inner])
    # and the blocks again, each keeping its matmuls (a selective policy's cost)
    assert [(r.start, r.stop) for r in kept.recompute_regions()] == problem.blocks()
    assert [r.keep for r in kept.recompute_regions()] == [problem.matmul_keep(*b)
                                                          for b in problem.blocks()]
    # and the first small span alone: what a step pays once for rerunning any region
    assert one.recompute_regions() == inner[:1]


def test_without_blocks_plain_steps_scale_the_profile_and_the_costs_stay():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.LayerNorm(16))
    x = torch.randn(4, 8)
    prof = profiles.profile(model, (x,), loss_fn=lambda out: out.sum(), timing="measure",
                            progress=False, whole_step=False)
    assert prof.step is None  # the ops as timed alone
    assert calibration_schedules(prof, problem_from_profile(prof)) == []
    calibrated = calibrated_profile(model, (x,), {}, lambda out: out.sum(), None, prof,
                                    budget_s=0.0)
    assert calibrated.checkpoint_costs == prof.checkpoint_costs
    assert calibrated.step is not None
    assert calibrated.fwd_time_ms == pytest.approx(calibrated.step.fwd_ms)
    assert calibrated.bwd_time_ms == pytest.approx(calibrated.step.bwd_ms)


def test_where_a_checkpointed_step_fails_plain_steps_still_scale_the_profile(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from planner import region_calibration

    def refused(*_: object) -> None:
        raise RuntimeError("no checkpoint here")

    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.0)
    prof = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="measure",
                            progress=False, whole_step=False)
    monkeypatch.setattr(region_calibration, "prepare_checkpoints", refused)
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    calibrated = calibrated_profile(zm.model, args, kwargs, zm.loss_fn, None, prof,
                                    budget_s=0.0)
    assert "could not time GPT with its blocks checkpointed" in caplog.text
    assert calibrated.checkpoint_costs == prof.checkpoint_costs  # the tiny-op constants
    assert calibrated.step is not None
    assert calibrated.fwd_time_ms == pytest.approx(calibrated.step.fwd_ms)


def test_planning_on_the_cpu_times_the_whole_step_only_in_the_calibration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile's own whole-step timing (about 9 steps) is skipped where the calibration
    times plain steps and sets the node times to them anyway (HF GPT-2, 4 layers: its
    profile less the calibration 2.1-2.3 s before, 1.4-1.7 s after); a profile alone still
    times it."""
    from profiles import timing

    whole: list[int] = []
    measure_step = timing._measure_step
    monkeypatch.setattr(timing, "_measure_step",
                        lambda *a: whole.append(1) or measure_step(*a))
    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.0)
    planned = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="measure",
                            progress=False).profile
    assert whole == []
    assert "fitted to this model's" in planned.checkpoint_costs.source
    assert planned.step is not None
    assert planned.fwd_time_ms == pytest.approx(planned.step.fwd_ms)
    assert planned.bwd_time_ms == pytest.approx(planned.step.bwd_ms)
    alone = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                             timing="measure", progress=False)
    assert whole == [1] and alone.step is not None


def _state(model: torch.nn.Module) -> dict:
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "grads": {k: None if v.grad is None else v.grad.clone()
                      for k, v in model.named_parameters()},
            "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
            "rng": torch.get_rng_state()}


def _same(a: dict, b: dict) -> bool:
    tensors = [(a[k][n], b[k][n]) for k in ("params", "buffers") for n in a[k]]
    grads = [(a["grads"][n], b["grads"][n]) for n in a["grads"]]
    return all(torch.equal(x, y) for x, y in tensors) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in grads) and torch.equal(a["rng"], b["rng"])


def test_calibration_leaves_the_model_as_it_was():
    zm = zoo.get("resnet", batch=2)  # BatchNorm: buffers the steps would move
    model = zm.model
    model.head.weight.grad = torch.ones_like(model.head.weight)  # a step half done
    prof = profiles.profile(model, zm.example_inputs, loss_fn=zm.loss_fn, timing="measure",
                            progress=False)
    before, objects = _state(model), [*model.parameters(), *model.buffers()]
    args, kwargs = normalize_inputs(model, zm.example_inputs)
    calibrated = calibrated_profile(model, args, kwargs, zm.loss_fn or profiles.default_loss,
                                    None, prof, budget_s=0.0)
    assert calibrated is not None
    assert "fitted to this model's" in calibrated.checkpoint_costs.source
    assert _same(before, _state(model))
    assert all(a is b for a, b in zip(objects, [*model.parameters(), *model.buffers()],
                                      strict=True))
    assert not checkpointed_modules(model)


def test_profile_model_on_the_cpu_charges_the_measured_region_cost():
    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.0)
    measured = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="measure",
                             progress=False)
    estimated = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                              timing="estimate", progress=False)
    assert "fitted to this model's" in measured.profile.checkpoint_costs.source
    assert "fitted" not in estimated.profile.checkpoint_costs.source
    # the clock charges the calibrated constants
    costs = measured.profile.checkpoint_costs
    problem = measured.problem()
    assert (problem.checkpoint_region_ms, problem.checkpoint_pack_ms,
            problem.checkpoint_range_ms, problem.checkpoint_step_ms) == (
        costs.region_ms, costs.pack_ms, costs.range_ms, costs.step_ms)
    # the guard's checks were timed in the steps, and a plan's overhead counts them
    assert costs.guard_ms > 0 and estimated.profile.checkpoint_costs.guard_ms == 0
    plan = solve(measured, budget_gb=1e6)
    assert plan.guard_ms == costs.guard_ms
    assert plan.predicted_overhead == pytest.approx(
        (plan.recompute_ms + plan.stall_ms + costs.guard_ms) / plan.baseline_step_ms)


def test_calibration_sets_the_profile_to_the_steps_it_times(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A host whose forward runs 3 times the profile's and whose backward as long: the
    profile's forward node times triple and its backward's stay, the region cost is
    measured in them, and every calibration plan's prediction is what it measured. (Scaled
    by the whole step instead, the reruns, which are forwards, kept the profile's share of
    the step: ResNet b16's forward read 6.8-9.4 ms in three profiles, 7.0 ms timed so.)"""
    from planner import region_calibration
    from solvers import simulate

    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.0)
    prof = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                            device="cpu", progress=False)
    prof = prof.model_copy(update={"checkpoint_costs": CheckpointCosts(
        region_ms=0.1, pack_ms=0.0, sac_op_ms=0.0, source="tiny ops")})
    problem = problem_from_profile(prof)
    forward, backward = 3 * sum(problem.fwd_time_ms), sum(problem.bwd_time_ms)
    host = problem.model_copy(update={"fwd_time_ms": [3 * t for t in problem.fwd_time_ms],
                                      "checkpoint_region_ms": 0.5, "checkpoint_pack_ms": 0.0,
                                      "checkpoint_sac_op_ms": 0.0})
    plans = calibration_schedules(prof, problem)

    def host_steps(*_: object) -> Timed:
        step = forward + backward
        return Timed([step] * 4, [[step + simulate(host, s).recompute_time_ms] * 4
                                  for s in plans], [forward] * 4)

    monkeypatch.setattr(region_calibration, "_timed_steps", host_steps)
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    calibrated = calibrated_profile(zm.model, args, kwargs, zm.loss_fn, None, prof)
    assert calibrated is not None
    assert calibrated.fwd_time_ms == pytest.approx(forward)
    assert calibrated.bwd_time_ms == pytest.approx(backward)
    assert calibrated.checkpoint_costs.region_ms == pytest.approx(0.5)
    planned = problem_from_profile(calibrated)
    for s in plans:
        assert simulate(planned, s).recompute_time_ms == pytest.approx(
            simulate(host, s).recompute_time_ms)


def test_no_plan_pays_for_its_place_in_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host where the second step of each round costs 1 ms more (it pays what the first
    left): plans that cost nothing measure nothing, whichever place they would always have
    had in a fixed order."""
    from planner import region_calibration

    class Installation:
        def __init__(self, k: int) -> None:
            self.k = k

    place: list[int] = []

    def installed_step(step, model, installation):
        place.append(0 if installation is None else installation.k)
        return 10.0 + (1.0 if len(place) % 3 == 2 else 0.0)  # three steps a round

    monkeypatch.setattr(region_calibration, "prepare_checkpoints",
                        lambda model, spec: Installation(spec))
    monkeypatch.setattr(region_calibration, "_installed_step", installed_step)
    model = torch.nn.Linear(2, 2)
    plain, planned, *_ = region_calibration._timed_steps(model, (), {}, None, None, [1, 2],
                                                      budget_s=0.0)
    assert len(plain) == region_calibration.MIN_ROUNDS
    # over every 3 rounds each step had each place once: the same time in total
    assert sum(plain[:3]) == sum(planned[0][:3]) == sum(planned[1][:3]) == 31.0
