"""The checkpoint frame: what one `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`
call does, as numbered rules written once. `simulate` (the replay), `accounting` (hence the
DP and CP-SAT) and the solvers' candidate lists cite them; nothing else derives them.

Read in torch/utils/checkpoint.py (`_checkpoint_hook`, `_recomputation_hook`,
`_CheckpointFrame`, `_StopRecomputationError`):

1. Packs. A node inside the frame packs into it when its backward saves anything
   (`Problem.packs`, static tensors included); a checkpoint nested inside packs its inputs
   into its parent when it is entered.
2. Early stop. The rerun stops right after the frame's last pack: after its last own
   packing node, or at the entry of its last child with inputs (`FrameRules.rerun_stop`,
   exclusive; 0 when nothing packs: no rerun).
3. Stops before running. The stop raises inside that last pack; when it is a node's that
   packs its inputs before it runs (`Problem.stops_before_running`: a matmul), the rerun
   ends without running that node (`FrameRules.last_not_run`): it makes and costs nothing,
   and if kept its cached output is never consumed.
4. Frame death. The frame lives while a tensor it packed lives: until the backward of its
   earliest own packing node, or the death of a child with inputs, whichever comes first
   (`FrameRules.death`); a frame that packs nothing frees its inputs after its forward
   (None).
5. Worth checkpointing. A region is a candidate only when all its nodes can be rerun and
   one of them packs (`worth_checkpointing`): one that packs nothing never reruns and only
   holds its inputs, which storing does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from solvers.problem import Problem

__all__ = ["FrameRules", "frame_rules", "own_packs", "worth_checkpointing"]


class FrameRules(NamedTuple):
    """Where a frame's rerun stops (rule 2), whether it stops before running its last node
    (rule 3), and the node whose backward frees the frame (rule 4; None: its forward's end)."""

    rerun_stop: int
    last_not_run: bool
    death: int | None


def own_packs(problem: Problem, start: int, stop: int,
              children: Sequence[tuple[int, int]] = ()) -> list[int]:
    """The nodes of `[start, stop)` that pack into its own frame (rule 1): those that pack
    and lie in none of `children` (sorted, disjoint `(start, stop)` ranges), ascending."""
    inside = {i for a, b in children for i in range(a, b)}
    return [i for i in range(start, stop) if problem.packs[i] and i not in inside]


def frame_rules(problem: Problem, own: Sequence[int],
                children: Sequence[tuple[int, int | None]] = ()) -> FrameRules:
    """Rules 2-4 for a frame whose own packing nodes are `own` (ascending, `own_packs`) and
    whose children with inputs enter at `children[k][0]` and die at `children[k][1]`.

    >>> p = Problem.chain([4, 4, 4, 1], [1.0] * 4)  # node i saves node i-1's output
    >>> frame_rules(p, [1, 2])
    FrameRules(rerun_stop=3, last_not_run=False, death=1)
    >>> frame_rules(p, [])
    FrameRules(rerun_stop=0, last_not_run=False, death=None)
    """
    entries = [entry for entry, _ in children]
    rerun_stop = max([i + 1 for i in own] + entries, default=0)
    last_not_run = (bool(own) and rerun_stop == own[-1] + 1 and rerun_stop not in entries
                    and problem.stops_before_running[own[-1]])
    death = min([*own, *(d for _, d in children if d is not None)], default=None)
    return FrameRules(rerun_stop, last_not_run, death)


def worth_checkpointing(problem: Problem, start: int, stop: int) -> bool:
    """Rule 5: `[start, stop)` can be rerun and something in it packs."""
    return all(problem.recomputable[start:stop]) and any(problem.packs[start:stop])
