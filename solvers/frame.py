"""The checkpoint frame: what one `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`
call does, as rules written once, each consequence one function here. `simulate` (the
independent replay) and every solver (`accounting`, `dp`, `cpsat`, `keep`, `inner`, `joint`,
`offload`) call these; none derives them.

Our rules are numbered F1-F9 so they cannot be confused with torch's own "Rule 1-4" in
torch/utils/checkpoint.py (`_checkpoint_hook`, `_recomputation_hook`, `_CheckpointFrame`,
`_StopRecomputationError`), where they were read:

F1. Packs. A node inside the frame packs into it when its backward saves anything
    (`Problem.packs`, static tensors included); a checkpoint nested inside packs its inputs
    into its parent when it is entered (`own_packs`).
F2. Early stop. The rerun stops right after the frame's last pack: after its last own
    packing node, or at the entry of its last child with inputs (`FrameRules.rerun_stop`,
    exclusive; 0 when nothing packs: no rerun). `FrameRules.rerun_steps` are the steps.
F3. Stops before running. The stop raises inside that last pack; when it is a node's that
    packs its inputs before it runs (`Problem.stops_before_running`: a matmul), the rerun
    ends without running that node (`FrameRules.last_not_run`): it makes and costs nothing
    (`FrameRules.run_steps`, `FrameRules.idle_steps`).
F4. Trigger. The rerun happens at the first backward that unpacks from the frame: that of
    its last own packing node, or the trigger of a child with inputs (F5), whichever runs
    first in the backward, i.e. the largest node (`FrameRules.trigger`; for a frame without
    children, `rerun_stop - 1`).
F5. Parent before child. A child with inputs packed them into its parent (F1); its rerun
    unpacks them, so at the child's trigger the parent reruns first, then the child.
F6. Kept until. A kept node's outputs wait in the frame's SAC cache from its forward until
    the rerun step that runs it takes them (`FrameRules.takes_cached`; from then on they are
    held like any rerun value), or, when no rerun step runs it (the frame never reruns, or
    the node lies past the early stop or is the unrun last node of F3), until the frame dies.
F7. Frame death. The frame lives while a tensor it packed lives: until the backward of its
    earliest own packing node, or the death of a child with inputs, whichever comes first
    (`FrameRules.death`); a frame that packs nothing frees its inputs (and its SAC cache) at
    the end of its forward (`frame_end`).
F8. Worth checkpointing. A region is a candidate only when all its nodes can be rerun and
    one of them packs (`worth_checkpointing`): one that packs nothing never reruns and only
    holds its inputs, which storing does not.
F9. Skipped steps. In the rerun of a top-level frame without children, a step the rerun
    runs is skipped when its node is skippable (`Problem.skippable`), nothing the rerun
    runs or packs needs its outputs' values, and some run step reads them: no run step,
    nor the unrun last (F3), saves them, and every run step that reads them and makes
    something is cached (F6) or skipped itself (a view makes nothing and reads no values).
    Skipped, it makes its outputs uninitialized, so the rerun's memory is as if it ran and
    its time is not spent (`dead_steps`). A step read by several may need several kept
    nodes (a fused projection whose q, k and v copies are all kept): the least keep sets
    skipping each step (`skip_covers`) say which kept nodes' savings are priced together.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from solvers.problem import Problem
from solvers.schedule import Region

__all__ = ["ChildFrame", "FlatStops", "FrameEnd", "FrameRules", "dead_steps", "frame_end",
           "frame_rules", "may_skip", "own_packs", "region_rules", "region_skips",
           "skip_covers", "worth_checkpointing"]


class FrameRules(NamedTuple):
    """A frame's rerun: where it stops (F2), whether it stops before running its last step
    (F3), the node whose backward frees the frame (F7; None: its forward's end, no rerun) and
    the node whose backward triggers the rerun (F4; -1: no rerun)."""

    rerun_stop: int
    last_not_run: bool
    death: int | None
    trigger: int = -1

    @property
    def reruns(self) -> bool:
        """Whether the frame reruns at all (something packs into it)."""
        return self.death is not None

    def rerun_steps(self, start: int) -> range:
        """The steps of the rerun of a frame entered at `start` (F2), the unrun last included."""
        return range(start, self.rerun_stop) if self.reruns else range(start, start)

    def run_steps(self, start: int) -> range:
        """The steps the rerun really runs (F3: not a last node it stops before)."""
        steps = self.rerun_steps(start)
        return range(steps.start, steps.stop - self.last_not_run)

    def idle_steps(self, cached: Iterable[int]) -> frozenset[int]:
        """Rerun steps that cost no time: kept nodes (from the SAC cache) and the unrun last."""
        idle = frozenset(cached)
        return idle | {self.rerun_stop - 1} if self.last_not_run else idle

    def takes_cached(self, start: int, node: int) -> bool:
        """F6: whether the rerun takes kept `node`'s outputs from the SAC cache (else they stay
        cached until the frame dies)."""
        return node in self.run_steps(start)


class ChildFrame(NamedTuple):
    """A nested checkpoint with inputs, as its parent's rules see it: it packs its inputs
    into the parent at `entry` (F1) and has its own `rules`."""

    entry: int
    rules: FrameRules


class FrameEnd(NamedTuple):
    """When a frame frees what it holds: after the backward of `node`, or (`backward` False)
    after the forward event of `node`, its region's last."""

    backward: bool
    node: int


def own_packs(problem: Problem, start: int, stop: int,
              children: Sequence[tuple[int, int]] = ()) -> list[int]:
    """The nodes of `[start, stop)` that pack into its own frame (F1): those that pack
    and lie in none of `children` (sorted, disjoint `(start, stop)` ranges), ascending."""
    inside = {i for a, b in children for i in range(a, b)}
    return [i for i in range(start, stop) if problem.packs[i] and i not in inside]


def frame_rules(problem: Problem, own: Sequence[int],
                children: Sequence[ChildFrame] = ()) -> FrameRules:
    """F2-F4 and F7 for a frame whose own packing nodes are `own` (ascending, `own_packs`)
    and whose children with inputs are `children`.

    >>> p = Problem.chain([4, 4, 4, 1], [1.0] * 4)  # node i saves node i-1's output
    >>> frame_rules(p, [1, 2])
    FrameRules(rerun_stop=3, last_not_run=False, death=1, trigger=2)
    >>> frame_rules(p, [])
    FrameRules(rerun_stop=0, last_not_run=False, death=None, trigger=-1)
    """
    entries = [c.entry for c in children]
    rerun_stop = max([i + 1 for i in own] + entries, default=0)
    last_not_run = (bool(own) and rerun_stop == own[-1] + 1 and rerun_stop not in entries
                    and problem.stops_before_running[own[-1]])
    death = min([*own, *(c.rules.death for c in children if c.rules.reruns)], default=None)
    trigger = max([*own, *(c.rules.trigger for c in children if c.rules.reruns)], default=-1)
    return FrameRules(rerun_stop, last_not_run, death, trigger)


def region_rules(problem: Problem, region: Region) -> FrameRules:
    """The rules of a RECOMPUTE `region`'s frame, its nested regions (any depth) included."""
    kids = [ChildFrame(c.start, region_rules(problem, c)) for c in region.children
            if problem.region_inputs(c.start, c.stop)]
    own = own_packs(problem, region.start, region.stop,
                    [(c.start, c.stop) for c in region.children])
    return frame_rules(problem, own, kids)


def frame_end(rules: FrameRules, stop: int) -> FrameEnd:
    """F7: when the frame of a region ending at `stop` frees its inputs and SAC cache."""
    if rules.death is None:
        return FrameEnd(False, stop - 1)
    return FrameEnd(True, rules.death)


def dead_steps(problem: Problem, rules: FrameRules, start: int,
               cached: Collection[int]) -> frozenset[int]:
    """F9: the steps the rerun of a top-level frame without children, entered at `start`
    with `rules`, skips when its SAC cache serves `cached`.

    >>> p = Problem.chain([4, 4, 4, 1], [1.0] * 4)  # node i saves node i-1's output
    >>> q = p.model_copy(update={"node_skippable": [True, False, False, False],
    ...                          "node_saved": [[], [], [1], [2]]})
    >>> sorted(dead_steps(q, frame_rules(q, [2]), 0, {1}))  # node 1 kept: node 0 not needed
    [0]
    """
    needs = _skip_needs(problem, rules, start)
    dead: set[int] = set()
    for i in reversed(rules.run_steps(start)):
        readers = needs.get(i) if i not in cached else None
        if readers and all(j in cached or j in dead for j in readers):
            dead.add(i)
    return frozenset(dead)


def skip_covers(problem: Problem, rules: FrameRules, start: int, candidates: Collection[int],
                most: int) -> dict[int, list[frozenset[int]]] | None:
    """F9 over every keep set of `candidates`: per step some set skips, the least sets that
    skip it (a set skips it when it holds one of them); None where a step has more than
    `most` least sets, or one of them more than `most` candidates (too many to follow)."""
    needs = _skip_needs(problem, rules, start)
    served: dict[int, list[frozenset[int]]] = {}  # step -> least sets caching or skipping it
    covers: dict[int, list[frozenset[int]]] = {}
    for i in reversed(rules.run_steps(start)):
        own = [frozenset({i})] if i in candidates else []
        ways: list[frozenset[int]] = [frozenset()] if needs.get(i) else []
        for j in needs.get(i, ()):
            ways = _least([w | v for w in ways for v in served.get(j, ())])
            if len(ways) > most or any(len(w) > most for w in ways):
                return None
        if ways:
            covers[i] = ways
        served[i] = _least(own + ways)
    return covers


def _least(sets: list[frozenset[int]]) -> list[frozenset[int]]:
    """The sets of `sets` holding no other (each once)."""
    out: list[frozenset[int]] = []
    for s in sorted(set(sets), key=len):
        if not any(t <= s for t in out):
            out.append(s)
    return out


def _skip_needs(problem: Problem, rules: FrameRules, start: int) -> dict[int, frozenset[int]]:
    """F9's static part: per run step a rerun may skip, the run steps reading its outputs'
    values (nonempty; a view reads none, the unrun last runs none). A step is absent where
    it is not skippable, nothing the rerun runs reads it, or a run step (or the unrun last)
    saves its outputs: its pack needs the values. Worked out once per frame and start, and
    shared (read it, never change it): a search prices many keep sets of each frame (about
    4 % of a pipeline split search's time under cProfile)."""
    memo = problem._skip_needs_memo
    needs = memo.get((rules, start))
    if needs is None:
        needs = memo[(rules, start)] = _read_by(problem, rules, start)
    return needs


def _read_by(problem: Problem, rules: FrameRules, start: int) -> dict[int, frozenset[int]]:
    """`_skip_needs`, worked out."""
    run = rules.run_steps(start)
    unrun = rules.rerun_stop - 1 if rules.last_not_run else None
    needs: dict[int, frozenset[int]] = {}
    for i in run:
        if not problem.skippable(i):
            continue
        readers: set[int] | None = set()
        for s in problem.outputs[i]:
            for j in problem.consumers[s]:
                if j not in run and j != unrun:
                    continue
                if s in problem.saved[j]:
                    readers = None
                    break
                if j != unrun and problem.outputs[j]:
                    readers.add(j)
            if readers is None:
                break
        if readers:
            needs[i] = frozenset(readers)
    return needs


def region_skips(problem: Problem, region: Region) -> frozenset[int]:
    """F9 for a top-level RECOMPUTE `region`: the steps its rerun skips (none where it has
    children), as `simulate` replays it and the runtime installs it."""
    if region.children:
        return frozenset()
    return dead_steps(problem, region_rules(problem, region), region.start, region.keep)


def may_skip(problem: Problem) -> np.ndarray:
    """Per node, whether some rerun may skip it (F9): skippable, and no node saves its
    outputs. What bounds on rerun time leave out, wherever the frame and whatever it keeps."""
    saved = {s for i in range(problem.n_nodes) for s in problem.saved[i]}
    return np.asarray([problem.skippable(i) and not saved.intersection(problem.outputs[i])
                       for i in range(problem.n_nodes)], dtype=bool)


def worth_checkpointing(problem: Problem, start: int, stop: int) -> bool:
    """F8: `[start, stop)` can be rerun and something in it packs."""
    return all(problem.recomputable[start:stop]) and any(problem.packs[start:stop])


class FlatStops:
    """F2-F3 for frames without children, vectorised: any window's rerun in O(1) (the DP's
    bounds ask for many)."""

    def __init__(self, problem: Problem) -> None:
        idx = np.where(np.asarray(problem.packs, dtype=bool), np.arange(problem.n_nodes), -1)
        self.last_pack_upto = np.maximum.accumulate(idx) if len(idx) else idx
        self.stops_before_running = np.asarray(problem.stops_before_running, dtype=bool)

    def rerun_stop(self, stop: int) -> int:
        """F2 for a frame ending at `stop`: one past its last packing node (at or before
        the frame's start: no rerun)."""
        return int(self.last_pack_upto[stop - 1]) + 1

    def last_not_run(self, rerun_stop: int) -> bool:
        """F3: whether a rerun stopping at `rerun_stop` never runs its last node."""
        return bool(self.stops_before_running[rerun_stop - 1])
