"""What offloading a module call moves, and when it comes back: the one rule that both
`simulate` and the planner's saved-tensor hooks (`planner.runtime.offload`) follow.

While an offloaded call runs, every tensor an op saves for backward outside a checkpoint
goes through the offload hooks, and so does the input save of a top-level checkpoint that
starts in it (its call's tensor arguments, `ModuleSpan.inputs`, saved before its first node
runs: "offloaded checkpointing"), and so do the outputs that checkpoint saves as OFFLOAD
(the SAC cache packs them through the hooks around the checkpoint: offloaded keeps, chosen
per node; what it saves as KEEP stays on the device); a checkpoint's own hooks take what
else is saved inside it, and a nested checkpoint's keeps stay on the device. The first such
save of a storage copies it to host memory (one copy per storage, whatever views or ops
save it); later saves of that storage inside any offloaded call reuse the copy. A save
outside every offloaded call is a plain save: it keeps the device storage alive as without
offload. Which nodes' saves move is what the schedule decides (`Schedule.decisions`:
OFFLOAD, whose rule copies, `solvers.decision`).
Backward: an offloaded call is *needed* at the first backward node that unpacks any of its
copies (for a checkpoint's inputs and keeps: the node whose backward first reruns it). All
of a call's copies come back at once: when the backward reaches the output of the call its
`prefetch` names (the start of the backward of that call's last node, where a hook on the
output's gradient runs), or when needed if that comes first or it names none.
A copy to the host frees its device storage at the end of the call its offload's
`release` names (that call's forward hook waits for the copies; by default the offloaded
call itself): never earlier, so the device's memory is the same however fast the copies
run or far the host runs ahead of the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from solvers.decision import RULES
from solvers.frame import region_rules
from solvers.problem import Problem
from solvers.schedule import Region, Schedule

__all__ = ["OffloadGroup", "offload_groups"]


@dataclass
class OffloadGroup:
    """One offloaded call's copies: `moved[s]` is the node whose save copies storage s (at
    its checkpoint's entry, before it runs, when s is in `at_entry`); `savers[s]` the nodes
    whose saves of s read the host copy back (their backward holds the returned storage),
    `frames[s]` the first nodes of the checkpoints that saved s as an input (held until the
    frame dies), `cached[s]` those whose SAC cache keeps s (held until its rerun consumes it
    or the frame dies); `need` and `fetch` the backward nodes at whose start the call is needed
    and its prefetch is issued."""

    index: int
    moved: dict[int, int] = field(default_factory=dict)
    savers: dict[int, list[int]] = field(default_factory=dict)
    frames: dict[int, list[int]] = field(default_factory=dict)
    cached: dict[int, list[int]] = field(default_factory=dict)
    at_entry: set[int] = field(default_factory=set)
    need: int = -1
    fetch: int = -1
    last: int = -1  # after this node its copies out end and free the device (`release`)

    def nbytes(self, problem: Problem) -> int:
        """Bytes this call moves each way."""
        return sum(problem.storage_bytes[s] for s in self.moved)


def _offloaded_checkpoint(problem: Problem, region: Region, inputs: list[int],
                          g: OffloadGroup, save: Callable[[int, OffloadGroup, int],
                                                          OffloadGroup],
                          moves: Callable[[int], bool]) -> None:
    """A top-level checkpoint inside offloaded call `g`: its input save (before its first
    node) and the outputs it keeps that `moves` (after each such node) go to the host; all
    come back by its rerun (the backward of its last node that packs)."""
    start = region.start
    rerun = region_rules(problem, region).trigger  # F4, its children included
    for s in inputs:
        owner = save(s, g, start)
        if owner.moved[s] == start:
            owner.at_entry.add(s)
        owner.frames.setdefault(s, []).append(start)
        owner.need = max(owner.need, rerun)
    for k in filter(moves, sorted(region.saves)):
        for s in problem.outputs[k]:
            owner = save(s, g, k)
            owner.cached.setdefault(s, []).append(start)
            owner.need = max(owner.need, rerun)


def offload_groups(problem: Problem, schedule: Schedule) -> list[OffloadGroup]:
    """The copies of each of `schedule.offloads`, in their order (see the module docstring).

    >>> p = Problem.chain([10, 10, 10, 1], [1.0] * 4)
    >>> [g.moved for g in offload_groups(p, Schedule.store_all(4).with_offloads([(1, 2)]))]
    [{0: 1}]
    """
    groups = [OffloadGroup(k) for k in range(len(schedule.offloads))]
    if not groups:
        return groups
    # what moves is what the schedule decides to move (`Schedule.decisions`): the saves of
    # the offloaded calls' stored nodes and the outputs their top-level checkpoints keep
    decided = schedule.decisions()
    recomputed = schedule.recomputed_nodes()

    def moves(i: int) -> bool:
        return RULES[decided[i]].copies

    group_of = {i: g for o, g in zip(schedule.offloads, groups, strict=True)
                for i in range(o.start, o.stop)}
    entries = {r.start: r for r in schedule.regions if r.is_recompute}
    mover: dict[int, OffloadGroup] = {}

    def save(s: int, g: OffloadGroup, i: int) -> OffloadGroup:
        owner = mover.setdefault(s, g)
        if s not in owner.moved:
            owner.moved[s] = i
        return owner

    for i in range(problem.n_nodes):
        g = group_of.get(i)
        if g is None:
            continue
        region = entries.get(i)
        span = problem.span(i, region.stop) if region is not None else None
        if span is not None and group_of.get(region.stop - 1) is g:
            _offloaded_checkpoint(problem, region, span.inputs, g, save, moves)
        if i in recomputed or not moves(i):  # a checkpoint's own hooks take its saves
            continue
        for s in problem.saved[i]:
            owner = save(s, g, i)
            owner.savers.setdefault(s, []).append(i)
            owner.need = max(owner.need, i)
    for o, g in zip(schedule.offloads, groups, strict=True):
        g.fetch = max(g.need, -1 if o.prefetch is None else o.prefetch[1] - 1)
        g.last = (o.stop if o.release is None else o.release[1]) - 1
    return groups
