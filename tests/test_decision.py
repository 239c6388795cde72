"""One model of a decision: `solvers.decision`'s rules, a region's and a schedule's decisions,
the problem's cost table, torch's policy from the rule, and the table people read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from planner import zoo
from planner.profiling import profile_model
from planner.reports.decisions import decision_table, format_decisions
from planner.runtime.emit import checkpoint_policy
from planner.solving import plan_for_schedule
from solvers import Decision, Problem, Region, Schedule
from solvers.decision import RULES
from solvers.problem import HostLink
from solvers.schedule import Offload

ROOT = Path(__file__).resolve().parents[1]
K, R, H = Decision.KEEP, Decision.RECOMPUTE, Decision.OFFLOAD  # H: host


def test_every_decision_has_a_rule_and_the_policy_torch_needs() -> None:
    assert set(RULES) == set(Decision)
    assert checkpoint_policy(K) is CheckpointPolicy.MUST_SAVE
    assert checkpoint_policy(R) is CheckpointPolicy.PREFER_RECOMPUTE
    # an offloaded output is saved by the checkpoint, then moved by the offload hooks
    assert checkpoint_policy(H) is CheckpointPolicy.MUST_SAVE


def test_a_region_names_what_it_does_not_recompute() -> None:
    plain = Region(0, 3, "recompute")
    said = Region(0, 3, "recompute", saves={1: "recompute"})
    assert said == plain and hash(said) == hash(plain) and said.saves == {}
    assert Region(0, 3, "recompute", saves={2: "keep", 1: "recompute"}).decision(2) is K
    assert plain.decision(1) is R
    moved = Region(0, 3, "recompute", saves={1: "offload", 2: "keep"})
    assert moved.keep == {1, 2} and moved.offloaded() == {1}  # both saved; one moved


def test_only_a_checkpoint_in_an_offloaded_call_offloads_per_node() -> None:
    """OFFLOAD stands where an offloaded call's hooks move it (a top-level checkpoint inside
    the call), and is refused elsewhere, saying what to do; `with_offloads` moves a call's
    keeps, or leaves the choice per node, and puts back on the device what no call moves."""
    chosen = Region(1, 4, "recompute", saves={2: "offload", 3: "keep"})
    regions = (Region(0, 1), chosen, Region(4, 6))
    with pytest.raises(ValueError, match="offload the call around it"):
        Schedule(regions=regions)
    with pytest.raises(ValueError, match="offload the call around it"):
        Schedule(regions=regions, offloads=[Offload(start=0, stop=3)])  # not around it
    nested = Region(0, 5, "recompute", children=[chosen])
    with pytest.raises(ValueError, match="only a top-level checkpoint"):
        Schedule(regions=(nested, Region(5, 6)), offloads=[Offload(start=0, stop=6)])
    per_node = Schedule(regions=regions, offloads=[Offload(start=0, stop=5)])
    assert per_node.decisions() == [H, R, H, K, H, K]
    assert per_node.with_offloads(per_node.offloads, move_keeps=False) == per_node
    assert per_node.with_offloads(per_node.offloads).decisions() == [H, R, H, H, H, K]
    assert per_node.with_offloads(()).decisions() == [K, R, K, K, K, K]


def test_a_schedule_says_every_nodes_decision() -> None:
    inner = Region(3, 5, "recompute", keep=[4])
    regions = (Region(0, 1), Region(1, 6, "recompute", keep=[2], children=[inner]),
               Region(6, 8))
    plain = Schedule(regions=regions)
    assert plain.decisions() == [K, R, K, R, K, R, K, K]
    # a call offloaded around the checkpoint moves what it stores and (`with_offloads`) the
    # checkpoint's own keeps; the nested checkpoint's keep lives inside the rerun and stays
    around = plain.with_offloads([(0, 7)])
    assert around.decisions() == [H, R, H, R, K, R, H, K]
    assert around.regions[1].saves == {2: H}
    # the choice per node: the checkpoint keeps node 2 on the device inside the call
    assert plain.with_offloads([(0, 7)], move_keeps=False).decisions() == [
        H, R, K, R, K, R, H, K]
    # a call inside the checkpoint is recomputed: nothing of it is moved
    inside = plain.with_offloads([(0, 1), (2, 3)])
    assert inside.decisions() == [H, R, K, R, K, R, K, K]


def test_the_problems_cost_table_prices_each_decision() -> None:
    chain = Problem.chain([8 * 2**20, 4 * 2**20, 1], [1.0, 2.0, 0.5])
    link = HostLink(d2h_gbps=2.0, h2d_gbps=4.0)
    p = chain.model_copy(update={"host_link": link, "recomputable": [True, True, False]})
    costs = p.decision_costs(1)
    assert costs[K].device_bytes == 4 * 2**20 and costs[K].backward_ms == 0.0
    assert costs[R].device_bytes == 0 and costs[R].backward_ms == 2.0
    assert costs[H].device_bytes == 0 and costs[H].host_bytes == 4 * 2**20
    assert costs[H].forward_ms == pytest.approx(4 * 2**20 / 2e9 * 1e3)
    assert costs[H].backward_ms == pytest.approx(4 * 2**20 / 4e9 * 1e3)
    assert R not in p.decision_costs(2)  # not recomputable
    assert H not in chain.decision_costs(1)  # no host link known: nothing to price


@pytest.fixture(scope="module")
def step():
    model = zoo.get("gpt", size="tiny")
    return profile_model(model.model, model.example_inputs, loss_fn=model.loss_fn,
                         timing="estimate", progress=False)


def test_the_decision_table_reads_the_plans_schedule_and_costs(step) -> None:
    block = next(c for c in step.profile.module_calls if c.path == "blocks.1")
    problem = plan_for_schedule(step.profile, Schedule.store_all(len(step.profile.nodes)),
                                step.inputs, step.structure).problem()
    a, b = block.start, block.stop
    kept = next(i for i in range(a, b) if problem.is_matmul(i) and problem.can_keep(i))
    schedule = Schedule.from_segments(problem.n_nodes, [(a, b)], keep=[kept])
    plan = plan_for_schedule(step.profile, schedule, step.inputs, step.structure)
    rows = {r.node: r for r in decision_table(plan)}
    assert rows[kept].decision is K and rows[kept].cost.device_bytes == rows[kept].nbytes > 0
    recomputed = [r for r in rows.values() if a <= r.node < b and r.node != kept]
    assert recomputed and all(r.decision is R for r in recomputed)
    assert all(r.cost.backward_ms == problem.fwd_time_ms[r.node] for r in recomputed)
    assert all(r.decision is K for r in rows.values() if not a <= r.node < b)
    text = format_decisions(plan, rows=200)
    assert "recomputed" in text and "kept" in text
    assert len(text.splitlines()) == 1 + min(200, len(rows))


# The files that name a decision kind: a new kind's rule, its cost, its torch policy and its
# name in reports follow from `solvers.decision.RULES`; a file added here is one more place
# a new kind must be taught (issue 63's count).
NAMES_DECISIONS = {"solvers/decision.py", "solvers/schedule.py", "planner/reports/viz.py"}


def test_decision_kinds_are_named_in_few_files() -> None:
    pattern = re.compile(r"Decision\.(KEEP|RECOMPUTE|OFFLOAD)\b")
    naming = {str(f.relative_to(ROOT)) for folder in ("solvers", "planner", "profiles")
              for f in (ROOT / folder).rglob("*.py") if pattern.search(f.read_text())}
    assert naming <= NAMES_DECISIONS, (
        f"{sorted(naming - NAMES_DECISIONS)} name a decision kind: read it from "
        "solvers.decision.RULES instead, or add the file to NAMES_DECISIONS")
