"""planner.region_calibration: a checkpoint region's cost measured on the model itself."""

from __future__ import annotations

import pytest
import torch

import profiles
from planner import profile_model, zoo
from planner.emit import checkpointed_modules
from planner.region_calibration import block_specs, calibrated_costs, scaled_costs
from profiles.inputs import normalize_inputs
from profiles.schema import CheckpointCosts
from solvers.from_profile import problem_from_profile

COSTS = CheckpointCosts(region_ms=0.1, pack_ms=0.01, sac_op_ms=0.02, source="tiny ops")


def test_scaled_costs_charge_what_the_regions_measured_beyond_their_reruns():
    # planned steps 12 ms over plain, reruns 8 ms: the regions cost 4 ms, charged 1 ms
    scaled = scaled_costs(COSTS, [20.0, 21.0, 20.0, 22.0], [32.0, 33.0, 32.0, 35.0],
                          nodes_ms=8.0, charged_ms=1.0, regions=4)
    assert (scaled.region_ms, scaled.pack_ms) == pytest.approx((0.4, 0.04))
    assert scaled.sac_op_ms == COSTS.sac_op_ms  # measured by the tiny ops' SAC chains
    assert "x4.00" in scaled.source and "1.000 ms per region" in scaled.source
    # a step no slower than its reruns: the regions cost nothing beyond them
    free = scaled_costs(COSTS, [20.0] * 4, [27.0] * 4, nodes_ms=8.0, charged_ms=1.0,
                        regions=4)
    assert (free.region_ms, free.pack_ms) == (0.0, 0.0)


def test_block_specs_checkpoint_each_block_call_whole():
    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.0)
    prof = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                            progress=False)
    problem = problem_from_profile(prof)
    specs, schedule = block_specs(prof, problem)
    assert [s.path for s in specs] == ["blocks.0", "blocks.1"]
    assert not any(s.keep_ops or s.is_range for s in specs)
    assert [(r.start, r.stop) for r in schedule.recompute_regions()] == problem.blocks()


def test_no_blocks_no_calibration():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.LayerNorm(16))
    x = torch.randn(4, 8)
    prof = profiles.profile(model, (x,), loss_fn=lambda out: out.sum(), timing="measure",
                            progress=False)
    assert block_specs(prof, problem_from_profile(prof)) is None
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
    before = _state(model)
    args, kwargs = normalize_inputs(model, zm.example_inputs)
    costs = calibrated_costs(model, args, kwargs, zm.loss_fn or profiles.default_loss, None,
                             prof, budget_s=0.0)
    assert costs is not None and "scaled x" in costs.source
    assert _same(before, _state(model))
    assert not checkpointed_modules(model)


def test_profile_model_on_the_cpu_charges_the_measured_region_cost():
    zm = zoo.get("gpt", size="tiny", batch=2, dropout=0.0)
    measured = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="measure",
                             progress=False)
    estimated = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                              timing="estimate", progress=False)
    assert "scaled x" in measured.profile.checkpoint_costs.source
    assert "scaled" not in estimated.profile.checkpoint_costs.source
    # the clock charges the calibrated constants
    costs = measured.profile.checkpoint_costs
    problem = measured.problem()
    assert (problem.checkpoint_region_ms, problem.checkpoint_pack_ms) == (costs.region_ms,
                                                                          costs.pack_ms)
