"""What happens to one activation between its forward and its backward: a `Decision`.

Every node's output the backward needs is, until then, kept on the device, recomputed by a
checkpoint's rerun, or moved to host memory and back. `RULES` is the one place each
decision's meaning is written, as data the rest reads:

- ``reruns``: its node runs again in the backward (a checkpoint's rerun);
- ``device_share`` / ``host_share``: the share of its output's bytes held on the device /
  in host memory from its forward to its backward;
- ``copies``: its bytes cross the host link twice (out in the forward, back before its
  backward);
- ``policy``: the `torch.utils.checkpoint.CheckpointPolicy` member a selective checkpoint
  returns for its op (by name: the solvers do not import torch; `planner.runtime.emit` maps
  it, in one place);
- ``label``: how reports name it.

`DecisionCost` prices a decision for one node from these fields (`cost`), and
`Problem.decision_costs` is the table of every node's. A schedule says each node's
decision (`Schedule.decisions`): the nodes of a RECOMPUTE region are RECOMPUTE unless the
region saves them (`Region.saves`: KEEP, or OFFLOAD in a top-level checkpoint inside an
offloaded call, chosen per node); every other node is KEEP, or OFFLOAD where an offloaded
module call stores it (`Schedule.offloads`).

A new kind of decision is a member here with its rule; where its meaning fits the fields
above, its cost, its torch policy and its name in reports follow from the rule, and two
other files name kinds: `solvers.schedule` (where each may stand) and
`planner.reports.viz` (each one's colour; `tests/test_decision.py` keeps the list). The
simulator and the runtime replay OFFLOAD per node where an offloaded call's hooks can move
it (`solvers.offload`); the solvers' searches choose KEEP and RECOMPUTE inside regions and
OFFLOAD per module call, moving a call's keeps with it (`Schedule.with_offloads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import NamedTuple

__all__ = ["CHECKPOINT_DEFAULT", "RULES", "Decision", "DecisionCost", "DecisionRule", "cost"]


class Decision(str, Enum):
    """What happens to one node's output between its forward and its backward."""

    KEEP = "keep"  # held on the device (a checkpoint's SAC MUST_SAVE, or no checkpoint)
    RECOMPUTE = "recompute"  # run again by the checkpoint's rerun in the backward
    OFFLOAD = "offload"  # copied to host memory in the forward, back before the backward


@dataclass(frozen=True)
class DecisionRule:
    """A decision's meaning, as the module docstring says."""

    reruns: bool
    device_share: float
    host_share: float
    copies: bool
    policy: str
    label: str


RULES: MappingProxyType[Decision, DecisionRule] = MappingProxyType({
    Decision.KEEP: DecisionRule(reruns=False, device_share=1.0, host_share=0.0, copies=False,
                                policy="MUST_SAVE", label="kept"),
    Decision.RECOMPUTE: DecisionRule(reruns=True, device_share=0.0, host_share=0.0,
                                     copies=False, policy="PREFER_RECOMPUTE",
                                     label="recomputed"),
    # a checkpoint saves it (MUST_SAVE), then the offload hooks move what it packed
    Decision.OFFLOAD: DecisionRule(reruns=False, device_share=0.0, host_share=1.0,
                                   copies=True, policy="MUST_SAVE", label="offloaded"),
})

# What a checkpoint does with a node its plan does not name: reruns it (the schedule's
# `Region.decision` and the runtime's selective policy both read it here).
CHECKPOINT_DEFAULT = Decision.RECOMPUTE


class DecisionCost(NamedTuple):
    """What one decision costs for one node: bytes held from its forward to its backward on
    the device and on the host, and time added to the forward and to the backward (the
    rerun's step, or the copies: on the copy stream, which may hide them)."""

    device_bytes: int
    host_bytes: int
    forward_ms: float
    backward_ms: float


def cost(decision: Decision, nbytes: int, rerun_ms: float,
         copy_out_ms: float, copy_back_ms: float) -> DecisionCost:
    """``decision``'s cost for a node whose output is ``nbytes``, whose rerun step takes
    ``rerun_ms`` and whose output's copies take ``copy_out_ms`` / ``copy_back_ms``.

    >>> cost(Decision.RECOMPUTE, 1024, 2.0, 0.5, 0.5)
    DecisionCost(device_bytes=0, host_bytes=0, forward_ms=0.0, backward_ms=2.0)
    >>> cost(Decision.OFFLOAD, 1024, 2.0, 0.5, 0.25)
    DecisionCost(device_bytes=0, host_bytes=1024, forward_ms=0.5, backward_ms=0.25)
    """
    rule = RULES[decision]
    return DecisionCost(
        device_bytes=round(rule.device_share * nbytes),
        host_bytes=round(rule.host_share * nbytes),
        forward_ms=copy_out_ms if rule.copies else 0.0,
        backward_ms=(rerun_ms if rule.reruns else 0.0) + (copy_back_ms if rule.copies else 0.0))
