"""planner.region_calibration: a checkpoint region's cost measured on the model itself."""

from __future__ import annotations

import pytest
import torch

import profiles
from planner import profile_model, zoo
from planner.emit import checkpointed_modules
from planner.region_calibration import calibrated_costs, calibration_schedules, fitted_costs
from profiles.inputs import normalize_inputs
from profiles.schema import CheckpointCosts
from solvers.from_profile import problem_from_profile

COSTS = CheckpointCosts(region_ms=0.1, pack_ms=0.01, sac_op_ms=0.02, source="tiny ops")


def test_fitted_costs_charge_what_each_plan_measured_beyond_its_reruns():
    # large regions (4, packing 100 tensors) and small ones (4, packing 8): 0.5 ms a
    # region, 0.02 a tensor, with noise
    fitted = fitted_costs(COSTS, [(4.05, 4, 100, 0), (2.15, 4, 8, 0)])
    assert fitted.region_ms == pytest.approx(0.5, abs=0.02)
    assert fitted.pack_ms == pytest.approx(0.02, abs=0.002)
    assert fitted.sac_op_ms == COSTS.sac_op_ms  # measured by the tiny ops' SAC chains
    assert fitted.range_ms == 0.0  # no op range measured: none charged more
    assert "4 regions (0 op ranges), 100 packs: 4.05 ms" in fitted.source
    # one plan alone: the fit keeps the ratio it cannot tell apart at its least squares
    alone = fitted_costs(COSTS, [(4.0, 4, 100, 0)])
    assert 4 * alone.region_ms + 100 * alone.pack_ms == pytest.approx(4.0)
    # never negative: small regions that measured dearer than large ones cost per region
    skewed = fitted_costs(COSTS, [(2.0, 4, 100, 0), (3.0, 4, 8, 0)])
    assert skewed.pack_ms == 0.0 and skewed.region_ms > 0
    # a plan no slower than its reruns: the regions cost nothing beyond them
    free = fitted_costs(COSTS, [(-1.0, 4, 100, 0), (-0.5, 4, 8, 0)])
    assert (free.region_ms, free.pack_ms) == (0.0, 0.0)


def test_fitted_costs_tell_an_op_range_from_a_module_call():
    """Blocks as module calls and small op ranges (GPT small measured 0.59 ms for four
    blocks beyond their reruns, 3.30 ms for four ranges): each kind gets its own cost; the
    tensors keep the tiny ops' cost, which two plans cannot tell apart from a region's."""
    fitted = fitted_costs(COSTS, [(4 * 0.2 + 100 * 0.01, 4, 100, 0),
                                  (4 * 0.9 + 4 * 0.01, 4, 4, 4)])
    assert fitted.region_ms == pytest.approx(0.2)
    assert fitted.range_ms == pytest.approx(0.7)
    assert fitted.pack_ms == COSTS.pack_ms
    # ranges that measure cheaper than calls cost nothing more, never less
    cheaper = fitted_costs(COSTS, [(4 * 0.9, 4, 100, 0), (4 * 0.2, 4, 4, 4)])
    assert cheaper.range_ms == 0.0 and cheaper.region_ms > 0


def test_calibration_schedules_are_whole_blocks_and_a_small_span_in_each():
    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.0)
    prof = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                            progress=False)
    problem = problem_from_profile(prof)
    blocks, small = calibration_schedules(prof, problem)
    assert [(r.start, r.stop) for r in blocks.recompute_regions()] == problem.blocks()
    assert [r.target.path for r in blocks.recompute_regions()] == ["blocks.0", "blocks.1"]
    inner = small.recompute_regions()
    assert len(inner) == 2 and all(
        a <= r.start and r.stop <= b and (r.start, r.stop) != (a, b)
        for r, (a, b) in zip(inner, problem.blocks(), strict=True))
    assert not any(r.keep for r in [*blocks.recompute_regions(), *inner])


def test_no_blocks_no_calibration():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.LayerNorm(16))
    x = torch.randn(4, 8)
    prof = profiles.profile(model, (x,), loss_fn=lambda out: out.sum(), timing="measure",
                            progress=False)
    assert calibration_schedules(prof, problem_from_profile(prof)) == []
    assert calibrated_costs(model, (x,), {}, lambda out: out.sum(), None, prof,
                            budget_s=0.0) is None


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
    costs = calibrated_costs(model, args, kwargs, zm.loss_fn or profiles.default_loss, None,
                             prof, budget_s=0.0)
    assert costs is not None and "fitted to this model's" in costs.source
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
            problem.checkpoint_range_ms) == (costs.region_ms, costs.pack_ms, costs.range_ms)


def test_calibration_measures_in_the_profile_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host twice as slow as the profile (or a profile timed fast): every plan measures
    twice its prediction, and the region cost stays in the profile's own ms, where the
    reruns it is added to are counted (unscaled, the reruns' error would be charged to the
    regions: GPT small's blocks measured 0.59 and 7.16 ms beyond their reruns so)."""
    from planner import region_calibration
    from solvers import simulate

    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.0)
    prof = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                            device="cpu", progress=False)
    problem = problem_from_profile(prof)
    step_ms = sum(problem.fwd_time_ms) + sum(problem.bwd_time_ms)
    costs = CheckpointCosts(region_ms=0.5, pack_ms=0.0, sac_op_ms=0.0, source="tiny ops")
    prof = prof.model_copy(update={"checkpoint_costs": costs})
    charged = problem.model_copy(update={"checkpoint_region_ms": 0.5,
                                         "checkpoint_pack_ms": 0.0})
    plans = calibration_schedules(prof, problem)

    def slow_host(*_: object) -> tuple[list[float], list[list[float]]]:
        plain = [2 * step_ms] * 4
        return plain, [[2 * (step_ms + simulate(charged, s).recompute_time_ms)] * 4
                       for s in plans]

    monkeypatch.setattr(region_calibration, "_timed_steps", slow_host)
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    fitted = calibrated_costs(zm.model, args, kwargs, zm.loss_fn, None, prof)
    assert fitted is not None
    assert fitted.region_ms == pytest.approx(0.5, rel=1e-6)


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
    plain, planned = region_calibration._timed_steps(model, (), {}, None, None, [1, 2],
                                                     budget_s=0.0)
    assert len(plain) == region_calibration.MIN_ROUNDS
    # over every 3 rounds each step had each place once: the same time in total
    assert sum(plain[:3]) == sum(planned[0][:3]) == sum(planned[1][:3]) == 31.0
