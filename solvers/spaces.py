"""The sets of schedules solvers prove their answers over, and membership in them.

A solver's OPTIMAL, bound and gap hold over its own search space only: the DP's chain
segmentations, CP-SAT's candidate regions, brute force's every flat schedule. `auto` may
use a bound proven over a space for an answer only when that answer lies in the space
(`SearchSpace.contains`); then the gap is proven over that space, and says so.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from solvers.dp.space import holds_regions
from solvers.problem import Problem
from solvers.schedule import Schedule

__all__ = ["SearchSpace", "chain_segments", "every_flat", "every_schedule", "flat_regions"]

FULL_KEEP_MAX_LEN = 8  # regions up to this many nodes may keep any subset ("short-any")


class SearchSpace(BaseModel):
    """A set of schedules, described for people (`text`) and testable (`contains`).

    `cuts`: where RECOMPUTE regions may start and stop ("any" node boundary, "stages": the
    boundaries of `blocks()` and the single nodes between them, "dp-chain": the DP's chain
    over module calls, where `dp_space.holds_regions` decides flat schedules and the rest are
    its own answers, "solver": only schedules the solver itself produced). `keep`: what a
    region may keep ("any" keepable subset, "matmuls": nothing or all its keepable
    matmul-like nodes, "short-any": any subset in regions of at most `FULL_KEEP_MAX_LEN`
    nodes, else as "matmuls"; "stage-any": any subset in the outermost region of one of the
    DP's stages, else as "matmuls"). Regions are module calls whenever the problem has
    module spans. `nested`: one level of nesting included.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str
    cuts: Literal["any", "stages", "dp-chain", "solver"]
    keep: Literal["any", "matmuls", "short-any", "stage-any"]
    nested: bool = False

    def __str__(self) -> str:
        return self.text

    def contains(self, problem: Problem, schedule: Schedule) -> bool:
        """Whether `schedule` is one of this space's schedules (False when unknowable)."""
        if self.cuts == "solver":
            return False
        if self.cuts == "dp-chain":
            return _in_dp_chain(problem, schedule)
        cuts = None if self.cuts == "any" else _stage_cuts(problem)
        for region in schedule.regions:
            if region.children:
                return False  # membership of nested schedules is not decided here
            if not region.is_recompute:
                continue
            a, b = region.start, region.stop
            if not problem.emittable(a, b) or (cuts is not None and not {a, b} <= cuts):
                return False
            if not _keep_allowed(problem, a, b, region.keep, self.keep):
                return False
        return True


def _in_dp_chain(problem: Problem, schedule: Schedule) -> bool:
    """Whether a flat `schedule` recomputes only regions every set of which the DP's space
    holds (`dp_space.holds_regions`, the one rule): ViT-tiny under bf16, CP-SAT's 0.5224 ms
    over whole calls, which the DP bounded at 0.5224 ms without finding it. Otherwise not
    decided (False)."""
    regions = [r for r in schedule.regions if r.is_recompute]
    if any(r.children for r in regions) or not all(problem.emittable(r.start, r.stop)
                                                   for r in regions):
        return False
    return holds_regions(problem, [(r.start, r.stop, frozenset(r.keep)) for r in regions])


def _stage_cuts(problem: Problem) -> set[int]:
    return {a for a, _ in problem.stages()} | {problem.n_nodes}


def _keep_allowed(problem: Problem, a: int, b: int, keep: frozenset[int], rule: str) -> bool:
    if not all(problem.can_keep(i) for i in keep):
        return False
    if rule == "any" or (rule == "short-any" and b - a <= FULL_KEEP_MAX_LEN):
        return True
    return not keep or keep == problem.matmul_keep(a, b)


def _regions_word(problem: Problem) -> str:
    if problem.module_spans is None:
        return "regions"
    if any(span.kind == "ops" for span in problem.module_spans):
        return "module calls or op ranges of traced forwards"
    return "module calls"


def every_schedule() -> SearchSpace:
    """Every schedule, nesting included: the space a schedule that recomputes nothing is
    optimal over (no recompute time is less than none)."""
    return SearchSpace(text="every schedule (nothing is recomputed)", cuts="any", keep="any",
                       nested=True)


def every_flat(problem: Problem) -> SearchSpace:
    """Brute force's space: every schedule without nesting."""
    return SearchSpace(text=f"every flat schedule (non-overlapping {_regions_word(problem)}, "
                       "each keeping any subset of its ops)", cuts="any", keep="any")


def flat_regions(problem: Problem, cuts: Literal["any", "stages"],
                 keep: Literal["any", "matmuls", "short-any"]) -> SearchSpace:
    """Non-overlapping regions at `cuts`, keeping per `keep` (CP-SAT's candidates)."""
    if cuts == "any" and keep == "any":
        return every_flat(problem)
    where = "" if cuts == "any" or problem.module_spans is not None else \
        " cut at block boundaries"
    kept = {"any": "any subset of its ops", "matmuls": "nothing or its matmuls",
            "short-any": f"any subset of its ops (up to {FULL_KEEP_MAX_LEN} ops), else "
                         "nothing or its matmuls"}[keep]
    return SearchSpace(text=f"non-overlapping {_regions_word(problem)}{where}, each keeping "
                       f"{kept}", cuts=cuts, keep=keep)


def chain_segments(problem: Problem, *, nested: bool, any_keep: bool, long_skips: int = 0,
                   long_skip_nodes: int = 0, stage_keep: bool = False,
                   calls_chain: bool = False) -> SearchSpace:
    """The DP's space: segmentations of the chain of stages (membership: its own answers,
    and on its chain over module calls, `calls_chain`, what `dp_space.holds_regions` decides);
    with `long_skips`, no segment holds the producer and a far reader of one of them; with
    `stage_keep`, a stage's outermost region keeps any subset of its ops, others nothing or
    their matmuls (`dp_options.top_regions`); with module spans, a stage's sets of inner regions
    (`solvers.dp.inner`)."""
    shape = "flat, or a call with its sub-calls nested one level" if nested else "flat"
    kept = ("any subset of its ops" if any_keep else
            "any subset of its ops when it is a stage's outermost region, else nothing or its "
            "matmuls"
            if stage_keep else "nothing or its matmuls")
    unit = "blocks" if problem.blocks() else "ops"
    apart = (f"; none of the {long_skips} tensors read more than {long_skip_nodes} ops after "
             "they are made is recomputed in one region with its distant readers (two or more "
             "stages on)") if long_skips else ""
    inner = ("; a single stage may instead recompute a set of disjoint regions inside it "
             "(module calls or op ranges of traced forwards, each keeping nothing or its "
             "matmuls), from the sets `solvers.dp.inner` offers"
             if problem.module_spans is not None else "")
    return SearchSpace(text=f"segmentations of the chain of {unit} into "
                       f"{_regions_word(problem)} ({shape}), each keeping {kept}{inner}{apart}",
                       cuts="dp-chain" if calls_chain else "solver",
                       keep="any" if any_keep else "stage-any" if stage_keep
                       else "matmuls", nested=nested)
