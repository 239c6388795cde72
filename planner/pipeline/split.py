"""The split of a model's layers into pipeline stages, and a plan per stage, whose slowest
stage is fastest under one per-GPU budget.

In 1F1B (and GPipe) every slot of the pipeline waits for its slowest stage, so the step is
about (m + p - 1) times the slowest stage's time for one microbatch (forward, backward,
recompute). Stages hold different numbers of microbatches (stage r of p holds min(m, p - r)
under 1F1B) and the first and last hold the embedding and the head: a uniform split with
one checkpointing setting makes the stage that holds most recompute most, and sets the
step. Here each candidate (stage, layer count) is profiled once and planned for what it
holds (:meth:`planner.pipeline.stage.StageSteps.plan`); a min-max dynamic program over contiguous
splits picks the split.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from functools import cache
from typing import NamedTuple

from planner.pipeline.rank import RankSteps
from planner.pipeline.stage import StageSteps
from planner.plan import GIB, InfeasibleBudgetError, Plan, format_bytes

__all__ = ["PipelinePlan", "RankPlan", "StagePlan", "plan_interleaved", "plan_pipeline"]


class StagePlan(NamedTuple):
    """One stage of the split: its layers, its plan, its predicted peak over the schedule's
    step and one microbatch's time on it (forward, backward, recompute, copy stalls)."""

    layers: int
    plan: Plan
    peak_bytes: int
    time_ms: float


class PipelinePlan(NamedTuple):
    split: list[int]  # layers per stage, in order
    stages: list[StagePlan]

    @property
    def slowest_ms(self) -> float:
        return max(stage.time_ms for stage in self.stages)

    def step_ms(self, n_microbatches: int) -> float:
        """The step's time as 1F1B's and GPipe's slots make it: (m + p - 1) slowest
        stages."""
        return (n_microbatches + len(self.stages) - 1) * self.slowest_ms

    def layer_ranges(self) -> list[range]:
        """Each stage's layers, as indices into the model's layers."""
        starts = [sum(self.split[:r]) for r in range(len(self.split))]
        return [range(start, start + k) for start, k in zip(starts, self.split, strict=True)]

    def module_fqns(self, layers: str = "layers", first: tuple[str, ...] = ("tok_embeddings",),
                    last: tuple[str, ...] = ("norm", "output")) -> list[list[str]]:
        """The split as torchtitan's ``module_fqns_per_model_part``: the first stage also
        holds ``first`` modules, the last ``last`` (torchtitan's Llama names by default)."""
        parts = [[f"{layers}.{i}" for i in span] for span in self.layer_ranges()]
        parts[0] = [*first, *parts[0]]
        parts[-1] = [*parts[-1], *last]
        return parts


def plan_pipeline(stage_steps: Callable[[int, int], StageSteps], n_layers: int,
                  num_stages: int, *, budget_gb: float, least: int | None = None,
                  most: int | None = None, time_limit_s: float = 60.0,
                  solver: str = "auto") -> PipelinePlan:
    """The split of ``n_layers`` layers into ``num_stages`` contiguous stages, each between
    ``least`` and ``most`` layers (default: two either side of an even split), and each
    stage's plan, that make the slowest stage fastest with every stage within ``budget_gb``
    GiB. ``stage_steps(r, k)`` is stage ``r`` holding ``k`` layers, profiled for one
    microbatch with its :class:`solvers.pipeline.StageSpec`; each (r, k) is profiled and
    planned once. ``time_limit_s`` bounds each stage's planning, with ``solver``
    (:func:`planner.solve`'s).

    Raises:
        InfeasibleBudgetError: no split fits; ``min_budget_bytes`` is the least budget
            some split was found to fit (each stage at its least peak found).
    """
    budget = int(budget_gb * GIB)
    even = n_layers / num_stages
    least = max(1, math.floor(even) - 2) if least is None else least
    most = math.ceil(even) + 2 if most is None else most
    if not 1 <= least <= most or least * num_stages > n_layers or most * num_stages < n_layers:
        raise ValueError(f"{n_layers} layers do not split into {num_stages} stages of "
                         f"{least} to {most} layers")
    outcomes: dict[tuple[int, int], StagePlan | int] = {}

    def outcome(rank: int, layers: int) -> StagePlan | int:
        """The stage's plan, or where none fits, the least stage peak found."""
        if (rank, layers) not in outcomes:
            try:
                plan, peak = stage_steps(rank, layers).plan(budget, time_limit_s, solver)
                outcomes[rank, layers] = StagePlan(
                    layers, plan, peak, plan.baseline_step_ms * (1 + plan.predicted_overhead))
            except InfeasibleBudgetError as error:
                outcomes[rank, layers] = error.min_budget_bytes
        return outcomes[rank, layers]

    def cost(rank: int, layers: int, key: str) -> float:
        found = outcome(rank, layers)
        if key == "time":
            return found.time_ms if isinstance(found, StagePlan) else math.inf
        return found.peak_bytes if isinstance(found, StagePlan) else found

    split = _min_max_split(lambda r, k: cost(r, k, "time"), n_layers, num_stages, least, most)
    if split is None:
        fitting = _min_max_split(lambda r, k: cost(r, k, "peak"), n_layers, num_stages,
                                 least, most)
        need = max(cost(r, k, "peak") for r, k in enumerate(fitting))
        raise InfeasibleBudgetError(
            f"No split of {n_layers} layers into {num_stages} stages of {least}-{most} layers "
            f"fits {format_bytes(budget)} per stage; split {fitting} fits "
            f"{format_bytes(int(need))}.", int(need))
    return PipelinePlan(split, [outcome(r, k) for r, k in enumerate(split)])


class RankPlan(NamedTuple):
    """One rank of an interleaved split: its chunks' layers, their plans, the rank's
    predicted peak over the step and one microbatch's time on all its chunks."""

    layers: tuple[int, ...]
    plans: list[Plan]
    peak_bytes: int
    time_ms: float


def plan_interleaved(rank_steps: Callable[[int, tuple[int, ...]], RankSteps],
                     n_layers: int, num_ranks: int, num_chunks: int, *, budget_gb: float,
                     least: int = 1, most: int | None = None, time_limit_s: float = 60.0,
                     solver: str = "auto") -> list[RankPlan]:
    """The layers of each rank's chunks under a schedule of several stages per rank (chunk
    ``c`` of rank ``r`` is the pipeline's stage ``StageSpec.chunk_stage(c)``: under
    ``Interleaved1F1B`` ``c·num_ranks + r``, so the split in stage order is
    ``[ranks[g % p].layers[g // p] for g in range(v·p)]``), between ``least`` and ``most``
    layers a chunk (default: one either side of an even split), and each rank's chunk
    plans, that make the slowest rank fastest with every rank within ``budget_gb``.
    ``rank_steps(r, layers)`` is rank ``r`` with its chunks holding ``layers`` layers
    (:class:`planner.pipeline.rank.RankSteps`); each is planned once, on ladders of plans
    its chunks share with the other candidates that hold them.

    Raises:
        InfeasibleBudgetError: no split fits; ``min_budget_bytes`` is the least budget
            some split was found to fit (each rank at its least peak found).
    """
    budget = int(budget_gb * GIB)
    stages = num_ranks * num_chunks
    most = n_layers // stages + 1 if most is None else most
    if not 1 <= least <= most or least * stages > n_layers or most * stages < n_layers:
        raise ValueError(f"{n_layers} layers do not split into {stages} chunks of {least} to "
                         f"{most} layers")
    outcomes: dict[tuple[int, tuple[int, ...]], RankPlan | int] = {}

    def outcome(rank: int, layers: tuple[int, ...]) -> RankPlan | int:
        if (rank, layers) not in outcomes:
            try:
                plans, peak = rank_steps(rank, layers).plan(budget, time_limit_s, solver)
                outcomes[rank, layers] = RankPlan(layers, plans, peak, sum(
                    p.baseline_step_ms * (1 + p.predicted_overhead) for p in plans))
            except InfeasibleBudgetError as error:
                outcomes[rank, layers] = error.min_budget_bytes
        return outcomes[rank, layers]

    @cache
    def best_of(rank: int, total: int, key: str) -> tuple[float, tuple[int, ...]]:
        """The rank's least time (or peak) over its chunks' layers adding up to ``total``."""
        found: tuple[float, tuple[int, ...]] = (math.inf, ())
        for layers in itertools.product(range(least, most + 1), repeat=num_chunks):
            if sum(layers) == total:
                got = outcome(rank, layers)
                cost = (got.time_ms if key == "time" else got.peak_bytes) \
                    if isinstance(got, RankPlan) else (math.inf if key == "time" else got)
                found = min(found, (cost, layers))
        return found

    per_rank = (least * num_chunks, most * num_chunks)
    totals = _min_max_split(lambda r, k: best_of(r, k, "time")[0], n_layers, num_ranks,
                            *per_rank)
    if totals is None:
        fitting = _min_max_split(lambda r, k: best_of(r, k, "peak")[0], n_layers,
                                 num_ranks, *per_rank)
        need = int(max(best_of(r, k, "peak")[0] for r, k in enumerate(fitting)))
        raise InfeasibleBudgetError(
            f"No split of {n_layers} layers into {num_ranks} ranks of {num_chunks} chunks "
            f"({least}-{most} layers each) fits {format_bytes(budget)} per rank; layers "
            f"{[best_of(r, k, 'peak')[1] for r, k in enumerate(fitting)]} per rank fit "
            f"{format_bytes(need)}.", need)
    return [outcome(r, best_of(r, k, "time")[1]) for r, k in enumerate(totals)]


def _min_max_split(cost: Callable[[int, int], float], n_layers: int, num_stages: int,
                   least: int, most: int) -> list[int] | None:
    """The split minimising its largest ``cost(stage, layers)``, then, among those, their
    sum (None: every split's is infinite). Two passes: the least largest cost, then the
    least sum over splits whose every cost is within it."""

    def counts(rank: int, left: int) -> range:
        rest = num_stages - rank - 1
        return range(max(least, left - rest * most), min(most, left - rest * least) + 1)

    @cache
    def least_largest(rank: int, left: int) -> float:
        if rank == num_stages:
            return 0.0 if left == 0 else math.inf
        return min((max(cost(rank, k), least_largest(rank + 1, left - k))
                    for k in counts(rank, left)), default=math.inf)

    largest = least_largest(0, n_layers)
    if largest == math.inf:
        return None

    @cache
    def least_sum(rank: int, left: int) -> tuple[float, tuple[int, ...]]:
        if rank == num_stages:
            return (0.0, ()) if left == 0 else (math.inf, ())
        found: tuple[float, tuple[int, ...]] = (math.inf, ())
        for k in counts(rank, left):
            if cost(rank, k) <= largest:
                total, split = least_sum(rank + 1, left - k)
                if cost(rank, k) + total < found[0]:
                    found = (cost(rank, k) + total, (k, *split))
        return found

    return list(least_sum(0, n_layers)[1])
