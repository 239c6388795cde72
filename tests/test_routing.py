"""Routing that depends on the data: a plan of an MoE model whose experts loop over the
experts its tokens went to holds for every routing (profiles.routing, solvers.routing,
planner.routing_bound), with gradients bit-identical to the unplanned model's."""

from __future__ import annotations

import pytest
import torch
from model_snapshot import ModelSnapshot

from planner import (
    InfeasibleBudgetError,
    Plan,
    apply,
    optimize,
    profile_model,
    remove,
    replan,
    solve,
)
from planner.api import plan_for_schedule
from planner.verification import measure_step
from profiles import default_loss
from profiles.routing import balanced_counts, routed_experts, routing_forced
from solvers import Schedule, simulate
from solvers.routing import worst_routing

transformers = pytest.importorskip("transformers")


def _mixtral(experts: str | None = "eager") -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False,
        **({"experts_implementation": experts} if experts else {}))
    ids = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    return transformers.MixtralForCausalLM(config), {"input_ids": ids, "labels": ids}


def _step(model: torch.nn.Module, batch: dict, counts: tuple[int, ...] | None = None):
    """Peak and gradients of one step, its experts run on ``counts`` (None: as routed)."""
    if counts is None:
        peak, _, grads = measure_step(model, (), batch, default_loss)
        return peak, grads
    with routing_forced(routed_experts(model), lambda t, k, e: counts):
        peak, _, grads = measure_step(model, (), batch, default_loss)
    return peak, grads


def _all_hit(counts: tuple[int, ...]) -> tuple[int, ...]:
    """The bound's worst counts with every expert on one token at least: the op stream
    the plan was profiled with (the bound counts an idle expert as one of no tokens)."""
    hit = [max(1, c) for c in counts]
    hit[hit.index(max(hit))] -= sum(hit) - sum(counts)
    return tuple(hit)


def test_forced_routing_sends_each_token_to_distinct_experts_in_the_counts_asked() -> None:
    from profiles.routing import _routing_of

    index = _routing_of((64, 62, 1, 1), torch.zeros(64, 2, dtype=torch.long))
    assert index.shape == (64, 2)
    assert torch.bincount(index.flatten(), minlength=4).tolist() == [64, 62, 1, 1]
    assert (index[:, 0] != index[:, 1]).all()
    assert balanced_counts(64, 2, 3) == [43, 43, 42]
    with pytest.raises(ValueError, match="do not route"):
        _routing_of((65, 61, 1, 1), index)
    model, _ = _mixtral()
    experts = model.model.layers[0].mlp.experts
    hidden = torch.randn(64, 32)
    weights = torch.full((64, 2), 0.5)
    routed = torch.randint(0, 4, (64, 2), generator=torch.Generator().manual_seed(1))
    choice = routed.clone()
    with routing_forced(routed_experts(model), lambda t, k, e: (64, 62, 1, 1)):
        forced = experts(hidden, choice, weights)
    assert torch.equal(choice, index)  # the router's own tensor holds the forced choice
    assert torch.equal(forced, experts(hidden, index, weights))
    assert not torch.equal(experts(hidden, routed, weights), forced)  # restored


def test_a_plan_holds_at_the_worst_routing_where_one_for_the_profiled_batch_does_not() -> None:
    """At the same budget the plan of the profiled routing peaks over it when the router
    sends its tokens lopsided (the experts run on forced counts); the bounded plan stays
    within it (its prediction tight at that routing), and on batches as the router routes
    them keeps gradients bit-identical to the unplanned model's."""
    model, batch = _mixtral()
    bounded = profile_model(model, batch, timing="estimate", progress=False)
    profiled = profile_model(model, batch, timing="estimate", progress=False,
                             bound_routing=False)
    assert bounded.routing is not None and profiled.routing is None
    assert "holds for every routing of 64 tokens to 2 of 4 experts" in " ".join(bounded.notes)
    static = profiled.problem().static_bytes + sum(profiled.problem().param_grad_bytes)
    budget = static + (profiled.unplanned_peak_bytes - static) * 45 // 100
    plan = _solved(bounded, budget)
    peer = _solved(profiled, budget)
    worst = worst_routing(plan.problem(), plan.routing, plan.schedule)
    lopsided = _all_hit(worst_routing(peer.problem(), bounded.routing, peer.schedule).counts)
    batches = [batch] + [{"input_ids": ids, "labels": ids} for ids in (
        torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
        for seed in range(1, 4))]
    unplanned = [_step(model, b)[1] for b in batches]
    apply(model, peer)
    assert _step(model, batch, lopsided)[0] > peer.budget_bytes, "the peer holds anyway"
    remove(model)
    apply(model, plan)
    for counts in (lopsided, _all_hit(worst.counts)):
        assert _step(model, batch, counts)[0] <= plan.budget_bytes
    peak, _ = _step(model, batch, _all_hit(worst.counts))
    assert plan.predicted_peak_bytes - peak <= 0.005 * peak  # an idle expert's few bytes
    for b, grads in zip(batches, unplanned, strict=True):  # batches as the router routes
        peak, planned = _step(model, b)
        assert peak <= plan.budget_bytes
        assert grads.keys() == planned.keys()
        assert all(torch.equal(grads[n], planned[n]) for n in grads)
    remove(model)
    assert "worst over every routing" in plan.summary()


def _solved(step, budget: int) -> Plan:
    try:
        return solve(step, budget_bytes=budget, time_limit_s=10)
    except InfeasibleBudgetError as error:
        return error.plan


def test_a_bounded_plan_keeps_its_bound_through_save_load_and_replan(tmp_path) -> None:
    model, batch = _mixtral()
    plan = optimize(model, batch, budget_gb=1.0, timing="estimate", deterministic=True,
                    progress=False)
    assert plan.routing is not None
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.routing == plan.routing
    assert loaded.predicted_peak_bytes == plan.predicted_peak_bytes
    given = plan_for_schedule(plan.profile, plan.schedule, plan.inputs,
                              plan.structure_fingerprint, routing=plan.routing)
    assert given.predicted_peak_bytes == plan.predicted_peak_bytes
    assert plan_for_schedule(plan.profile, plan.schedule, plan.inputs,
                             plan.structure_fingerprint).predicted_peak_bytes \
        <= plan.predicted_peak_bytes
    low = plan.profile.static.total_bytes + 1
    with pytest.raises(InfeasibleBudgetError, match="at every routing of its experts") as error:
        replan(loaded, budget_bytes=low, deterministic=True, time_limit_s=10)
    lowest = error.value.plan
    assert lowest.predicted_peak_bytes == error.value.min_budget_bytes
    again = replan(loaded, budget_bytes=error.value.min_budget_bytes,
                   deterministic=True, time_limit_s=10)
    assert again.predicted_peak_bytes <= error.value.min_budget_bytes


def test_grouped_experts_are_not_bounded_their_memory_does_not_follow_the_routing() -> None:
    model, batch = _mixtral(experts=None)  # transformers' default: grouped matmuls
    step = profile_model(model, batch, timing="estimate", progress=False)
    assert step.routing is None and "Routed experts" not in " ".join(step.notes)


def test_a_rank_on_the_fake_process_group_is_bounded_whatever_its_placeholder_weights() -> None:
    """On the fake process group the gathered weights are placeholders, so the router
    routes otherwise than the real step: the bound does not take the router's choice, so
    a rank's plan holds for the routing the real weights make (benchmarks/moe_routing.py
    measures it over gloo ranks)."""
    model, batch = _mixtral()
    step = profile_model(model, batch, timing="estimate", world_size=2, sharding="fsdp2",
                         progress=False)
    assert step.routing is not None and step.routing.tokens == 64
    assert step.profile.parallel is not None and step.profile.parallel.world_size == 2
    assert step.unplanned_peak_bytes > simulate(step.problem(), Schedule.store_all(
        len(step.profile.nodes))).peak_bytes  # the worst routing peaks above balanced


def test_profiling_at_forced_routings_leaves_the_model_and_the_rng_as_they_were() -> None:
    """The bound profiles the step E more times with the router's choice overwritten and
    the experts class patched: afterwards the same parameter objects and bits, buffers,
    hooks, the experts' own forward and the RNG state."""
    model, batch = _mixtral()
    experts_class = type(model.model.layers[0].mlp.experts)
    forward = experts_class.__dict__["forward"]
    before, rng = ModelSnapshot.of(model), torch.get_rng_state()
    step = profile_model(model, batch, timing="estimate", progress=False)
    assert step.routing is not None
    assert before.differences(model) == []
    assert torch.equal(rng, torch.get_rng_state())
    assert experts_class.__dict__["forward"] is forward
