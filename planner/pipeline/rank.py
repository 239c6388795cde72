"""A rank of a pipeline that runs several stages per rank (``Interleaved1F1B``,
``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``): the plans of its model
chunks, chosen together so that the rank's peak over one step is within its budget and the
time it spends on its chunks' microbatches is least. Under a zero-bubble schedule a chunk
after the pipeline's first stage runs as profiled (its ladder is its unplanned step).

Every chunk is a stage of its own (:mod:`planner.pipeline.stage` profiles it for one microbatch);
the rank's peak replays the schedule's passes over all of its chunks
(:func:`solvers.pipeline.rank_peak`). Each chunk offers a ladder of plans: unplanned, its
lowest-peak plan, and plans at evenly spaced one-microbatch budgets between the two; every
combination of rungs is replayed, in order of their time, and the first that fits is the
answer. The combination is optimal over those ladders; each rung is optimal for its
one-microbatch budget as the solver says.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from planner.arguments import MAX_BUDGET_BYTES, MIN_BUDGET_BYTES
from planner.pipeline.stage import StageSteps, stage_spec
from planner.plan import (
    GIB,
    InfeasibleBudgetError,
    InfeasibleRankBudgetError,
    PipelineStage,
    Plan,
    format_bytes,
)
from planner.solving import solve
from solvers.pipeline import ChunkReplay, StageSpec, rank_peak

__all__ = ["RankSteps", "plan_rank"]

RUNGS = 6  # one-microbatch budgets per chunk, from its lowest peak to its unplanned peak


class _Rung(NamedTuple):
    plan: Plan
    replay: ChunkReplay
    time_ms: float  # one microbatch's forward, backward, recompute and copy stalls


class RankSteps:
    """The rank's chunks, each a :class:`StageSteps` (chunk ``c`` at index ``c``)."""

    def __init__(self, chunks: Sequence[StageSteps]) -> None:
        if not chunks:
            raise ValueError("a rank runs at least one chunk")
        self.spec = chunks[0].spec
        if [c.chunk for c in chunks] != list(range(self.spec.num_chunks)) or any(
                c.spec != self.spec for c in chunks):
            raise ValueError(f"give the rank's {self.spec.num_chunks} chunks in order, each "
                             "profiled with the rank's StageSpec")
        self.chunks = list(chunks)

    def peak(self, plans: Sequence[Plan | None] | None = None) -> int:
        """The rank's peak over one step, each chunk with its plan (None: unplanned)."""
        plans = plans or [None] * len(self.chunks)
        return rank_peak(self.spec, [steps.replay(plan.schedule if plan else None)
                                     for steps, plan in zip(self.chunks, plans, strict=True)])

    def plan(self, budget_bytes: int, time_limit_s: float = 60.0,
             solver: str = "auto") -> tuple[list[Plan], int]:
        """:func:`plan_rank` on these chunks (profiled once, planned at many budgets)."""
        per_solve = time_limit_s / (len(self.chunks) * (RUNGS + 1))
        ladders = [_ladder(steps, per_solve, solver) for steps in self.chunks]
        least: tuple[int, tuple[_Rung, ...]] | None = None
        for combination in sorted(itertools.product(*ladders),
                                  key=lambda rungs: sum(r.time_ms for r in rungs)):
            peak = rank_peak(self.spec, [rung.replay for rung in combination])
            if peak <= budget_bytes:
                return self._stamped(combination, budget_bytes, peak), peak
            if least is None or peak < least[0]:
                least = (peak, combination)
        spec = self.spec
        unplannable = [c for c, steps in enumerate(self.chunks) if not steps.plannable]
        why = (f" Under {spec.schedule}'s split backward, chunks {unplannable} (stages after "
               "the first) are not checkpointed: torch reruns a checkpointed region once more "
               "per parameter group in the weights' pass.") if unplannable else ""
        raise InfeasibleRankBudgetError(
            f"No plans of the {spec.num_chunks} chunks of pipeline rank {spec.stage_index} of "
            f"{spec.num_stages} ({spec.schedule}, {spec.n_microbatches} microbatches) fit "
            f"{format_bytes(budget_bytes)}; the least rank peak found is "
            f"{format_bytes(least[0])} (error.plans: each chunk's plan of it).{why}", least[0],
            self._stamped(least[1], budget_bytes, least[0]))

    def _stamped(self, rungs: Sequence[_Rung], budget: int, peak: int) -> list[Plan]:
        return [rung.plan.model_copy(update={"pipeline": PipelineStage(
            spec=self.spec, budget_bytes=budget, peak_bytes=peak, chunk=c)})
            for c, rung in enumerate(rungs)]


# each chunk's ladders, by (seconds per solve, solver): the same at every budget and in
# every rank candidate that holds the chunk
_LADDERS: weakref.WeakKeyDictionary[StageSteps, dict[tuple[float, str], list[_Rung]]] = \
    weakref.WeakKeyDictionary()


def _ladder(steps: StageSteps, per_solve: float, solver: str) -> list[_Rung]:
    """The chunk's rungs: unplanned, its lowest-peak plan, and plans between (distinct
    schedules only), made once per chunk."""
    made = _LADDERS.setdefault(steps, {})
    if (per_solve, solver) not in made:
        made[per_solve, solver] = _new_ladder(steps, per_solve, solver)
    return made[per_solve, solver]


def _new_ladder(steps: StageSteps, per_solve: float, solver: str) -> list[_Rung]:
    profiled = steps.steps[1]  # the steps after the first backward, gradients allocated
    unplanned = solve(profiled, budget_bytes=MAX_BUDGET_BYTES,
                      time_limit_s=per_solve, solver=solver)
    if not steps.plannable:  # a split backward: the chunk runs unplanned
        return [_Rung(unplanned, steps.replay(),
                      unplanned.baseline_step_ms * (1 + unplanned.predicted_overhead))]
    try:
        lowest = solve(profiled, budget_bytes=MIN_BUDGET_BYTES,
                       time_limit_s=per_solve, solver=solver)
    except InfeasibleBudgetError as error:
        lowest = error.plan or solve(profiled, budget_bytes=error.min_budget_bytes,
                                     time_limit_s=per_solve, solver=solver)
    low, high = lowest.predicted_peak_bytes, unplanned.predicted_peak_bytes
    plans = [unplanned, lowest]
    for k in range(1, RUNGS - 1):
        try:
            plans.append(solve(profiled, budget_bytes=low + (high - low) * k // (RUNGS - 1),
                               time_limit_s=per_solve, solver=solver))
        except InfeasibleBudgetError:
            continue
    rungs, seen = [], set()
    for plan in plans:
        key = plan.schedule.model_dump_json()
        if key not in seen:
            seen.add(key)
            rungs.append(_Rung(plan, steps.replay(plan.schedule if plan.checkpointing else None),
                               plan.baseline_step_ms * (1 + plan.predicted_overhead)))
    return rungs


def plan_rank(chunks: Sequence[nn.Module], microbatches: Sequence[Any], *,
              pipeline: StageSpec | dict[str, Any], budget_gb: float,
              loss_fn: Callable[[Any], torch.Tensor] | None = None,
              time_limit_s: float = 60.0, **profile_options: Any) -> list[Plan]:
    """The plans of one pipeline rank's model chunks under a schedule of several stages per
    rank, whose peak over one step of ``pipeline`` (torch's names, with ``num_chunks``; its
    ``stage_index`` is the rank; chunk ``c`` is stage ``StageSpec.chunk_stage(c)``) is
    within ``budget_gb``: one plan per chunk, to ``apply`` to it;
    ``plans[c].pipeline.peak_bytes`` is the rank's predicted peak.
    ``microbatches[c]`` is one microbatch of chunk ``c``'s input (a tensor that requires
    grad where a chunk receives it); ``loss_fn(output)`` is the loss of the pipeline's last
    stage, where this rank holds it.

    Raises:
        InfeasibleRankBudgetError: no combination of the chunks' plans fits; it names the
            least rank peak found, and ``plans`` holds each chunk's plan of it.
    """
    spec, target_bytes = stage_spec(pipeline)
    if len(chunks) != spec.num_chunks or len(microbatches) != spec.num_chunks:
        raise ValueError(f"pipeline rank of {spec.num_chunks} chunks: give as many modules "
                         f"and microbatches (got {len(chunks)} and {len(microbatches)})")
    if loss_fn is not None and not spec.chunk_last(spec.num_chunks - 1):
        raise ValueError(f"rank {spec.stage_index} holds no last stage: give loss_fn to the "
                         "rank that holds it")
    steps = [StageSteps(module, microbatch, spec, loss_fn if spec.chunk_last(c) else None,
                        target_bytes, chunk=c, **profile_options)
             for c, (module, microbatch) in enumerate(zip(chunks, microbatches, strict=True))]
    return RankSteps(steps).plan(int(budget_gb * GIB), time_limit_s)[0]
