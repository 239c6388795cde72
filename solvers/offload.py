"""What offloading a module call moves, and when it comes back: the one rule that both
`simulate` and the planner's saved-tensor hooks (`planner.offload`) follow.

While an offloaded call runs, every tensor an op saves for backward outside a checkpoint
goes through the offload hooks (a checkpoint's own hooks take what is saved inside it, and
the checkpoint's input save is not offloaded). The first such save of a storage copies it to
host memory (one copy per storage, whatever views or ops save it); later saves of that
storage inside any offloaded call reuse the copy. A save outside every offloaded call is a
plain save: it keeps the device storage alive as without offload.

Backward: an offloaded call is *needed* at the first backward node that unpacks any of its
copies. All of a call's copies come back at once: when the backward reaches the output of
the call its `prefetch` names (the start of the backward of that call's last node, where a
hook on the output's gradient runs), or when needed if that comes first or it names none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from solvers.problem import Problem
from solvers.schedule import Schedule

__all__ = ["OffloadGroup", "offload_groups"]


@dataclass
class OffloadGroup:
    """One offloaded call's copies: `moved[s]` is the node whose save copies storage s;
    `savers[s]` the nodes whose saves of s read the host copy back (their backward holds
    the returned storage); `need` and `fetch` the backward nodes at whose start the call is
    needed and its prefetch is issued."""

    index: int
    moved: dict[int, int] = field(default_factory=dict)
    savers: dict[int, list[int]] = field(default_factory=dict)
    need: int = -1
    fetch: int = -1

    def nbytes(self, problem: Problem) -> int:
        """Bytes this call moves each way."""
        return sum(problem.storage_bytes[s] for s in self.moved)


def offload_groups(problem: Problem, schedule: Schedule) -> list[OffloadGroup]:
    """The copies of each of `schedule.offloads`, in their order (see the module docstring).

    >>> p = Problem.chain([10, 10, 10, 1], [1.0] * 4)
    >>> [g.moved for g in offload_groups(p, Schedule.store_all(4).with_offloads([(1, 2)]))]
    [{0: 1}]
    """
    groups = [OffloadGroup(k) for k in range(len(schedule.offloads))]
    if not groups:
        return groups
    recomputed = schedule.recomputed_nodes()
    group_of = {i: g for o, g in zip(schedule.offloads, groups, strict=True)
                for i in range(o.start, o.stop)}
    mover: dict[int, OffloadGroup] = {}
    for i in range(problem.n_nodes):
        g = group_of.get(i)
        if g is None or i in recomputed:
            continue
        for s in problem.saved[i]:
            owner = mover.setdefault(s, g)
            if s not in owner.moved:
                owner.moved[s] = i
            owner.savers.setdefault(s, []).append(i)
            owner.need = max(owner.need, i)
    for o, g in zip(schedule.offloads, groups, strict=True):
        g.fetch = max(g.need, -1 if o.prefetch is None else o.prefetch[1] - 1)
    return groups
