"""Which activations a plan keeps, recomputes or offloads, and what each choice costs.

One row per node whose output the backward saves (a storage some node's backward needs),
and per node a checkpoint reruns or keeps: the plan's decision for it
(`solvers.Schedule.decisions`; a recomputed one its rerun skips, F9, reads "skipped")
and the cost of every decision open to it
(`Problem.decision_costs`: bytes held on the device and the host from its forward to its
backward, time added to the forward and the backward), so a reader sees
why: what keeping a recomputed activation would hold, what recomputing a kept one would
cost. Nothing here is a second model: the costs are the problem's, the decisions the
schedule's.

>>> print(format_decisions(plan, rows=3))  # doctest: +SKIP
activation                       op                   decision    device MiB  host MiB ...
blocks.1/gelu                    gelu                 recomputed       0.000     0.000 ...
...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from solvers.decision import RULES, Decision, DecisionCost
from solvers.frame import region_skips

if TYPE_CHECKING:
    from planner.plan import Plan

__all__ = ["DecisionRow", "decision_table", "format_decisions"]

MIB = 2**20


class DecisionRow(NamedTuple):
    """One saved activation: its node, the plan's decision, and what every decision open
    to it costs (``costs[row.decision]`` is what the plan pays)."""

    node: int
    name: str
    op: str
    module: str
    decision: Decision
    costs: dict[Decision, DecisionCost]
    nbytes: int  # its outputs' bytes: what keeping it holds on the device
    skipped: bool = False  # recomputed, but its rerun skips it: nothing needs it (F9)

    @property
    def cost(self) -> DecisionCost:
        """What the plan pays for it: a skipped rerun step adds no time."""
        paid = self.costs[self.decision]
        return paid._replace(backward_ms=0.0) if self.skipped else paid

    @property
    def label(self) -> str:
        return "skipped" if self.skipped else RULES[self.decision].label


def decision_table(plan: Plan) -> list[DecisionRow]:
    """Every saved activation of ``plan``, in node order (the module docstring)."""
    problem = plan.problem()
    saved = {s for storages in problem.saved for s in storages}
    checkpointed = plan.schedule.recomputed_nodes()
    decided = plan.schedule.decisions()
    skipped = {i for r in plan.schedule.regions if r.is_recompute
               for i in region_skips(problem, r)}
    nodes = plan.profile.nodes
    return [DecisionRow(i, nodes[i].name, nodes[i].target, nodes[i].module, decided[i],
                        problem.decision_costs(i), problem.output_bytes(i), i in skipped)
            for i in range(problem.n_nodes) if problem.outputs[i] and (
                i in checkpointed or any(s in saved for s in problem.outputs[i]))]


def format_decisions(plan: Plan, rows: int = 20) -> str:
    """The ``rows`` largest activations of `decision_table` as text: the decision, what it
    holds on the device and the host and adds to the backward, and the two alternatives
    beside it: what keeping it would hold, what recomputing it would take ('-': it cannot
    be recomputed)."""
    table = sorted(decision_table(plan), key=lambda r: -r.nbytes)[:rows]
    lines = [f"{'activation':<32} {'op':<20} {'decision':<11} {'device MiB':>10} "
             f"{'host MiB':>9} {'backward ms':>11} {'keep MiB':>9} {'rerun ms':>9}"]
    for r in table:
        paid = r.cost
        rerun = next((c.backward_ms for d, c in r.costs.items() if RULES[d].reruns), None)
        op = r.op.removeprefix("aten.").removesuffix(".default")
        lines.append(f"{r.name[:32]:<32} {op[:20]:<20} {r.label:<11} "
                     f"{paid.device_bytes / MIB:>10.3f} {paid.host_bytes / MIB:>9.3f} "
                     f"{paid.backward_ms:>11.3f} {r.nbytes / MIB:>9.3f} "
                     f"{'-' if rerun is None else f'{rerun:.3f}':>9}")
    return "\n".join(lines)
