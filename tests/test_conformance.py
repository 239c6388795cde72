"""One real model per failure class, planned, applied and measured like a user would.

The full set runs in ``benchmarks/conformance.py``; each case here once broke a plan (see
``CASES`` in ``benchmarks/conformance_harness.py``): an in-place ReLU after a checkpoint,
a kept output that squeeze-excite mutates, concatenated skips and BatchNorm, a KV cache in
a submodule's config, value-dependent routing, frozen parameters, two-input modules,
BatchNorm without momentum and a step counter, a loss computed inside forward.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from conformance_harness import CASES, check_case  # benchmarks/, on the path (conftest.py)

import profiles
from planner import InfeasibleBudgetError, profile_model, solve

FAST = {
    "torchvision resnet18": (0.8,),
    "U-Net (BatchNorm, concatenated skips)": (0.3, 0.5),
    "in-place add_/relu_ in blocks": (0.5,),
    "loss inside forward, (loss, logits)": (0.8,),
    "BatchNorm(momentum=None) and a step counter": (0.3,),
    "HF T5ForConditionalGeneration": (0.3,),
    "HF MixtralForCausalLM (MoE)": (0.5,),
    "HF WhisperForConditionalGeneration": (0.5,),
    "HF BertForMaskedLM": (0.3,),
}


@pytest.mark.parametrize("name", list(FAST))
def test_plans_on_real_models_run_and_hold(name: str) -> None:
    case = next(c for c in CASES if c.name == name)
    if case.needs and importlib.util.find_spec(case.needs) is None:
        pytest.skip(f"needs {case.needs}")
    rows = check_case(case, FAST[name], time_limit_s=10.0, enforce_time_limit=False)
    failures = [f"{r.budget}: {'; '.join(r.failures)}" for r in rows if not r.ok]
    assert not failures, failures
    measured = [r for r in rows if r.measured_bytes]
    assert measured and all(r.measured_bytes <= r.budget_bytes for r in measured)
    assert all(r.grads_equal and r.buffers_equal for r in measured)


# ResNet-18 under bf16 (15 s of the suite's 10 minutes) and timm EfficientNet-B0 (17 s once
# op ranges came in) are in benchmarks/conformance.py
@pytest.mark.parametrize("name", ["HF LlamaForCausalLM (GQA)",
                                  "U-Net (BatchNorm, concatenated skips)"])
def test_bf16_autocast_plans_on_real_models_hold(name: str) -> None:
    """Profiled, planned and run under bf16 autocast: within budget, gradients equal to
    the unplanned model's under autocast."""
    case = next(c for c in CASES if c.name == name)
    if case.needs and importlib.util.find_spec(case.needs) is None:
        pytest.skip(f"needs {case.needs}")
    rows = check_case(case, (0.5,), time_limit_s=10.0, autocast=torch.bfloat16,
                      enforce_time_limit=False)
    assert all(r.precision == "bf16" for r in rows)
    failures = [f"{r.budget}: {'; '.join(r.failures)}" for r in rows if not r.ok]
    assert not failures, failures
    measured = [r for r in rows if r.measured_bytes]
    assert measured and all(r.measured_bytes <= r.budget_bytes for r in measured)


def test_measured_timing_survives_in_place_ops_on_stored_inputs() -> None:
    """T5's relative-position buckets are built in place on an integer tensor; timing ops
    alone used to rerun those ops on the stored tensor and index out of range."""
    case = next(c for c in CASES if c.name == "HF T5ForConditionalGeneration")
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    zm = case.build()
    prof = profiles.profile(zm.model, zm.example_inputs, timing="measure", repeats=1, warmup=0,
                            progress=False)
    assert prof.timing == "measure" and prof.step is not None
    assert all(n.fwd_time_ms >= 0 for n in prof.nodes)
    torch.set_num_threads(2)


def _problem(name: str):
    from solvers.from_profile import problem_from_profile

    case = next(c for c in CASES if c.name == name)
    if case.needs and importlib.util.find_spec(case.needs) is None:
        pytest.skip(f"needs {case.needs}")
    zm = case.build()
    prof = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                            timing="estimate", progress=False)
    return problem_from_profile(prof)


def test_graphs_that_are_not_chains_get_cpsat_at_their_least_peak() -> None:
    """Inception-v3 (509 ops, branches): auto ran only the DP beyond 400 nodes and found no
    plan at the least peak CP-SAT proves over module calls; now CP-SAT runs on module calls
    of any size and the plan there is optimal over that space (here without the op ranges
    of its traced forwards, which `auto.solve` tries after module calls)."""
    from solvers import auto, cpsat

    p = _problem("torchvision inception_v3")
    assert p.n_nodes > auto.CPSAT_MAX_NODES and not auto.dp.applies(p)
    calls = auto.calls_only(p)
    least = cpsat.min_peak(calls, 20.0, deterministic=True)
    assert least.optimal_over is not None and least.schedule is not None
    sol = auto.solve(calls, least.bytes, 20.0, deterministic=True)
    assert sol.feasible and sol.peak_bytes <= least.bytes
    assert sol.space is not None and sol.space.contains(calls, sol.schedule)


def test_infeasible_error_names_the_space_its_minimum_is_proven_over() -> None:
    """U-Net: the lowest peak is CP-SAT's proven least peak over module calls; the error
    says so, apart from the all-schedule bound (static + the largest op's working set)."""
    from solvers.auto import lowest_peak

    p = _problem("U-Net (BatchNorm, concatenated skips)")
    lowest = lowest_peak(p, 10.0, deterministic=True)
    assert lowest.least_peak_space is not None
    assert lowest.least_peak_bytes == lowest.peak_bytes
    case = next(c for c in CASES if c.name == "U-Net (BatchNorm, concatenated skips)")
    zm = case.build()
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                         progress=False)
    with pytest.raises(InfeasibleBudgetError, match="proven by CP-SAT") as caught:
        solve(step, budget_bytes=lowest.peak_bytes - 1, time_limit_s=10.0, deterministic=True)
    assert "least peak of non-overlapping module calls" in str(caught.value)
    assert caught.value.min_budget_bytes == lowest.peak_bytes


def test_the_lowest_peak_searches_merged_stages_with_the_dp_too() -> None:
    """The loss-inside model is no chain of its stages, but of merged ones: the DP's
    bisection (its nested schedules) goes below every baseline and CP-SAT's least peak over
    module calls (34.3 % of its activations saved; 45.2 % with the DP)."""
    from solvers import auto, baselines, cpsat
    from solvers.accounting import evaluate
    from solvers.dp import search as dp

    p = _problem("loss inside forward, (loss, logits)")
    assert not dp.applies(p)
    lowest = auto.lowest_peak(p, 10.0, deterministic=True)
    others = [cpsat.min_peak(auto.calls_only(p), 2.0, deterministic=True).bytes]
    others += [fn(p, 0, 1.0).peak_bytes for fn in baselines.BASELINES.values()]
    assert lowest.peak_bytes < min(b for b in others if b)
    # the peak it names is its schedule's, counted apart from `simulate`, which scored it
    assert evaluate(p, lowest.schedule)[0] == lowest.peak_bytes
    assert dp.solve(p, lowest.peak_bytes, math.inf).feasible  # no limit: not for want of time


def test_changes_after_apply_hold_or_warn_on_a_real_model() -> None:
    """The change-after-apply dimension (benchmarks/conformance_after_apply.py) on the U-Net:
    each change either holds (identical to the unplanned model, within budget) or warns."""
    from conformance_after_apply import CHANGES
    from conformance_after_apply import check_case as check_changes

    case = next(c for c in CASES if c.name.startswith("U-Net"))
    rows = check_changes(case, time_limit_s=10.0)
    assert [r.change for r in rows] == list(CHANGES)
    assert all(r.ok for r in rows), [(r.change, r.outcome, r.detail) for r in rows]
    assert {r.outcome for r in rows} - {"n/a"}  # something was changed and judged
