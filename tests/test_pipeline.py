"""Pipeline stages (`solvers.pipeline`, `planner.pipeline.stage`): torch's GPipe and 1F1B run
over gloo, one process per stage, each with its own plan; the order each stage runs its
microbatches in is the one the replay assumes, each stage's measured peak is the predicted
one (within a kilobyte), and losses and gradients are those of the same pipeline
unplanned."""

from __future__ import annotations

import functools
import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch.distributed.pipelining")
import pipeline_harness as harness  # benchmarks/, on the path in conftest

from planner import InfeasibleBudgetError
from solvers.pipeline import StageSpec

WORLD, MICROBATCHES = 2, 4


def test_each_stage_planned_for_its_schedule_holds_its_budget_and_trains_unchanged(
        tmp_path: Path) -> None:
    """Each stage planned at 70 % of its unplanned peak over a 1F1B step (every
    microbatch it holds): the measured peak is within the budget and at the predicted one;
    losses and gradients are the unplanned pipeline's. (GPipe and 3 stages:
    `benchmarks/results/pipeline-stages-cpu.md`.)"""
    schedule = "1F1B"
    specs = [harness.spec_of(schedule, r, WORLD, MICROBATCHES) for r in range(WORLD)]
    budgets = [int(0.7 * harness.predicted_peak(spec)) for spec in specs]
    planned_stages = [harness.stage_plan(spec, b)
                      for spec, b in zip(specs, budgets, strict=True)]
    plans = [plan for plan, _ in planned_stages]
    assert all(plan.checkpointing for plan in plans)
    assert [plan.pipeline.spec for plan in plans] == specs  # installed in the 2-rank group
    assert [plan.pipeline.peak_bytes for plan, _ in planned_stages] == \
        [peak for _, peak in planned_stages]
    assert "pipeline stage 0 of 2 (1F1B, 2 of 4 microbatches in flight)" in plans[0].summary()
    planned, unplanned = harness.run_pipeline(schedule, WORLD, MICROBATCHES, tmp_path, plans,
                                              unplanned_too=True)
    harness.check_ranks(specs, budgets, [peak for _, peak in planned_stages], planned,
                        unplanned)
    assert planned[-1]["losses"] == unplanned[-1]["losses"]
    assert len(planned[-1]["losses"]) == MICROBATCHES


def test_a_stage_budget_no_plan_meets_names_the_least_stage_peak_found() -> None:
    spec = harness.spec_of("GPipe", 0, WORLD, MICROBATCHES)
    with pytest.raises(InfeasibleBudgetError, match="least stage peak found") as caught:
        harness.stage_plan(spec, 2**20)
    assert caught.value.plan is not None and caught.value.min_budget_bytes > 2**20
    _, peak = harness.stage_plan(spec, caught.value.min_budget_bytes)  # and it holds
    assert peak <= caught.value.min_budget_bytes


def test_a_deterministic_stage_plan_is_the_same_on_a_loaded_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's bisection hands each solve a share of its limit; deterministic=True
    counts the shares instead of timing them, so a machine so loaded that a second passes at
    every read of the clock plans the stage as a quiet one does."""
    import time

    import planner.solving as solving
    from planner.solution_memo import ANSWERS

    spec = harness.spec_of("1F1B", 0, WORLD, MICROBATCHES)
    budget = int(0.7 * harness.predicted_peak(spec))
    quiet = harness.stage_plan(spec, budget)
    ANSWERS.clear()
    seconds = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(seconds)))
    monkeypatch.setattr(solving, "perf_counter", time.perf_counter)
    loaded = harness.stage_plan(spec, budget)
    assert (loaded[0].schedule, loaded[1]) == (quiet[0].schedule, quiet[1])
    assert loaded[0].checkpointing and loaded[1] <= budget


def test_in_flight_microbatches_are_torchs() -> None:
    """GPipe holds every microbatch; 1F1B stage r of p holds min(m, p - r)."""
    assert [StageSpec(schedule="1F1B", stage_index=r, num_stages=4, n_microbatches=8)
            .in_flight() for r in range(4)] == [4, 3, 2, 1]
    assert StageSpec(schedule="GPipe", stage_index=2, num_stages=4,
                     n_microbatches=8).in_flight() == 8
    with pytest.raises(ValueError, match="not below num_stages"):
        StageSpec(schedule="1F1B", stage_index=4, num_stages=4, n_microbatches=8)
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        StageSpec(schedule="1F1B", stage_index=0, num_stages=4, n_microbatches=2)
    # in a V every rank holds 2p chunk microbatches (ZBV) or 2p + 1 (DualPipeV), each until
    # its weights' pass: p of the pipeline's, in microbatches of a rank's share of layers
    for schedule, held in (("ZBVZeroBubble", 8), ("DualPipeV", 9)):
        assert [StageSpec(schedule=schedule, stage_index=r, num_stages=4, n_microbatches=8,
                          num_chunks=2).in_flight() for r in range(4)] == [held] * 4


def test_a_stage_plan_installs_in_its_pipelines_group_and_nowhere_else() -> None:
    """A stage's plan is installed on its rank after the process group exists (one stage
    per rank); in a group whose size is no multiple of the stages it is refused."""
    import torch.distributed as dist

    from planner import PlanMismatchError, apply, optimize, zoo
    from planner.plan import PipelineStage

    zm = zoo.get("gpt", size="tiny")
    plan = optimize(zm.model, zm.example_inputs, budget_gb=1e3, loss_fn=zm.loss_fn,
                    timing="estimate", progress=False)
    stage = plan.model_copy(update={"pipeline": PipelineStage(spec=StageSpec(
        schedule="1F1B", stage_index=0, num_stages=2, n_microbatches=4),
        budget_bytes=plan.budget_bytes, peak_bytes=None)})
    replayed = stage.model_copy(update={"pipeline": stage.pipeline.model_copy(
        update={"peak_bytes": 12345})})
    edited = replayed.model_copy(update={"schedule": plan.schedule})
    assert edited.pipeline.peak_bytes is None  # its replay was of another schedule
    assert "not replayed for this schedule" in edited.summary()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(PlanMismatchError, match="stage 0 of a 2-stage pipeline, but "
                                                    "this process group has 1 ranks"):
            apply(zm.model, stage)
        apply(zm.model, plan.model_copy(update={"pipeline": PipelineStage(spec=StageSpec(
            schedule="GPipe", stage_index=0, num_stages=1, n_microbatches=4),
            budget_bytes=plan.budget_bytes, peak_bytes=None)}))
    finally:
        dist.destroy_process_group()


def _small_stage_steps(num_stages: int, n_microbatches: int) -> Any:
    """Stage r of the harness's GPT holding k blocks, profiled once per (r, k)."""
    from planner.pipeline.stage import StageSteps

    @functools.cache
    def steps(rank: int, blocks: int) -> StageSteps:
        spec = harness.spec_of("1F1B", rank, num_stages, n_microbatches)
        torch.manual_seed(0)
        module = harness.Stage(spec.first, spec.last, blocks)
        inputs, target = harness.microbatch(rank)
        return StageSteps(module, (inputs,), spec, loss_fn=harness._loss_of(spec, target),
                          target_bytes=target.nbytes if spec.last else 0, timing="estimate")

    return steps


def test_the_split_makes_the_slowest_stage_fastest_within_the_budget() -> None:
    """Four blocks over two 1F1B stages (stage 0 holds two microbatches, stage 1 one and
    the head) at a budget below the even split's unplanned stage 0: every stage of the
    split found within the budget, planned as its stage; a budget no split meets names
    a split and the least budget it was found to fit."""
    from planner.pipeline.split import plan_pipeline

    steps = _small_stage_steps(2, MICROBATCHES)
    budget = int(0.9 * steps(0, 2).peak())
    found = plan_pipeline(steps, 4, 2, budget_gb=budget / 2**30, least=1, most=3,
                          solver="dp")
    assert sum(found.split) == 4 and all(s.peak_bytes <= budget for s in found.stages)
    assert found.layer_ranges() == [range(0, found.split[0]), range(found.split[0], 4)]
    assert found.module_fqns(first=("embed",), last=("head",))[0][0] == "embed"
    assert [s.plan.pipeline.spec.stage_index for s in found.stages] == [0, 1]
    assert found.step_ms(MICROBATCHES) == 5 * found.slowest_ms
    with pytest.raises(InfeasibleBudgetError, match="fits") as caught:
        plan_pipeline(steps, 4, 2, budget_gb=2**20 / 2**30, least=1, most=3, solver="dp",
                      time_limit_s=4)
    # a split's least is its stages' least peaks (each held: the test above), at most the
    # even split's unplanned peaks
    assert 2**20 < caught.value.min_budget_bytes <= max(steps(r, 2).peak() for r in range(2))


def test_the_split_search_is_the_best_of_every_split() -> None:
    """The min-max search against every split, on random stage costs (inf: no plan)."""
    import itertools
    import math
    import random

    from planner.pipeline.split import _min_max_split

    rng = random.Random(0)
    for _ in range(200):
        stages, layers = rng.randint(1, 4), rng.randint(4, 10)
        least, most = rng.randint(1, 2), rng.randint(2, 5)
        table = {(r, k): math.inf if rng.random() < 0.2 else float(rng.randint(1, 9))
                 for r in range(stages) for k in range(least, most + 1)}
        splits = [s for s in itertools.product(range(least, most + 1), repeat=stages)
                  if sum(s) == layers]
        best = min(((max(table[r, k] for r, k in enumerate(s)),
                     sum(table[r, k] for r, k in enumerate(s))) for s in splits),
                   default=(math.inf, math.inf))
        found = _min_max_split(lambda r, k, t=table: t[r, k], layers, stages, least, most)
        if best[0] == math.inf:
            assert found is None
            continue
        assert sum(found) == layers and all(least <= k <= most for k in found)
        assert (max(table[r, k] for r, k in enumerate(found)),
                sum(table[r, k] for r, k in enumerate(found))) == best


def test_optimize_refuses_what_it_does_not_plan_for_a_stage() -> None:
    from planner import optimize

    spec = {"schedule": "1F1B", "stage_index": 0, "num_stages": 2, "n_microbatches": 4}
    module, (inputs, target) = harness.build_stage(0, 2), harness.microbatch(0)
    with pytest.raises(ValueError, match="is not the last"):
        optimize(module, (inputs,), budget_gb=1, pipeline=spec,
                 loss_fn=lambda out: harness.next_token_loss(out, target))
    with pytest.raises(ValueError, match=r"\['offload=True', 'op_ranges=False'\] with it is not"):
        optimize(module, (inputs,), budget_gb=1, pipeline=spec, offload=True,
                 op_ranges=False)
    with pytest.raises(ValueError, match="not below num_stages"):
        optimize(module, (inputs,), budget_gb=1, pipeline={**spec, "stage_index": 2})
    with pytest.raises(ValueError, match="stage_index"):  # True is no stage's index
        optimize(module, (inputs,), budget_gb=1, pipeline={**spec, "stage_index": True})
    last = {**spec, "stage_index": 1}
    module, (inputs, target) = harness.build_stage(1, 2), harness.microbatch(1)
    for wrong in (-10**9, 1.5, True):  # -10**9 made a 21.5 MiB stage "fit" 1 MiB
        with pytest.raises(ValueError, match=f"target_bytes .* not {wrong!r}"):
            optimize(module, (inputs,), budget_gb=1, pipeline={**last, "target_bytes": wrong},
                     loss_fn=lambda out: harness.next_token_loss(out, target))


def test_profile_options_pass_through_to_a_stages_steps() -> None:
    """``progress=`` went to the profile twice (``plan_rank(..., progress=False)`` raised
    TypeError); a stage plan applied where no process group runs says what it is for."""
    import warnings

    from planner import PlanMismatchWarning, apply, remove
    from planner.pipeline.stage import StageSteps

    spec = harness.spec_of("1F1B", 0, 2, 4)
    module, (inputs, _) = harness.build_stage(0, 2), harness.microbatch(0)
    steps = StageSteps(module, (inputs,), spec, timing="estimate", progress=False)
    plan, _ = steps.plan(steps.peak())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply(module, plan)
    remove(module)
    assert any(issubclass(w.category, PlanMismatchWarning)
               and "stage 0 of a 2-stage pipeline" in str(w.message) for w in caught)


def test_interleaved_order_is_torchs_on_every_rank() -> None:
    """Each rank's passes under Interleaved1F1B, as the replay orders them, are those torch's
    schedule computes (its own ``_calculate_single_rank_operations``, no-ops left out)."""
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleaved1F1B,
        _ComputationType,
    )

    cases = 0
    for ranks, chunks, microbatches in itertools.product((2, 3, 4), (1, 2, 3), range(1, 13)):
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            continue
        torchs = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)  # no stages needed
        torchs.n_local_stages, torchs.pp_group_size = chunks, ranks
        torchs._n_microbatches, torchs.number_of_rounds = microbatches, rounds
        torchs.microbatches_per_round = microbatches // rounds
        for rank in range(ranks):
            expected = [("F" if a.computation_type == _ComputationType.FORWARD else "B",
                         a.stage_index // ranks, a.microbatch_index)
                        for a in torchs._calculate_single_rank_operations(rank) if a]
            assert StageSpec(schedule="Interleaved1F1B", stage_index=rank, num_stages=ranks,
                             n_microbatches=microbatches, num_chunks=chunks
                             ).actions() == expected, (ranks, chunks, microbatches, rank)
            cases += 1
    assert cases > 200
    with pytest.raises(ValueError, match="needs schedule='Interleaved1F1B'"):
        StageSpec(schedule="1F1B", stage_index=0, num_stages=2, n_microbatches=4, num_chunks=2)


def test_an_interleaved_rank_planned_as_a_whole_holds_its_budget_and_trains_unchanged(
        tmp_path: Path) -> None:
    """Interleaved1F1B over 2 gloo ranks of 2 chunks each (stages c·2 + r of 4): each rank's
    chunks planned together at 75 % of the rank's unplanned peak. Each rank runs its passes
    in the replayed order, peaks within its budget and at the predicted peak (above it by a
    loss scalar at most, below by under a kilobyte), and trains as unplanned: every
    send is kept until the step ends, which the replay counts."""
    chunks, schedule = 2, "Interleaved1F1B"
    specs = [harness.spec_of(schedule, r, WORLD, MICROBATCHES, chunks) for r in range(WORLD)]
    ranks = [harness.rank_steps(spec) for spec in specs]
    budgets = [int(0.75 * rank.peak()) for rank in ranks]
    planned = [rank.plan(budget, time_limit_s=16) for rank, budget in zip(ranks, budgets,
                                                                          strict=True)]
    assert all(any(plan.checkpointing for plan in plans) for plans, _ in planned)
    assert [plans[1].pipeline.chunk for plans, _ in planned] == [1, 1]
    assert "pipeline rank 0 of 2, chunk 1 of 2 (stage 2 of 4" in planned[0][0][1].summary()
    by_stage = [planned[g % WORLD][0][g // WORLD] for g in range(WORLD * chunks)]
    ran, plain = harness.run_pipeline(schedule, WORLD, MICROBATCHES, tmp_path, by_stage,
                                      unplanned_too=True, chunks=chunks)
    harness.check_ranks(specs, budgets, [peak for _, peak in planned], ran, plain)
    assert ran[-1]["losses"] == plain[-1]["losses"] and len(ran[-1]["losses"]) == MICROBATCHES
    # a rank budget no plans meet names the least rank peak found, and that budget holds
    with pytest.raises(InfeasibleBudgetError, match="least rank peak found") as caught:
        ranks[0].plan(2**20, time_limit_s=16)
    least = caught.value.min_budget_bytes
    assert least > 2**20 and caught.value.plan.pipeline.chunk == 0
    assert [p.pipeline.chunk for p in caught.value.plans] == [0, 1]
    assert ranks[0].peak(caught.value.plans) == least  # the chunks' plans, together
    assert ranks[0].plan(least, time_limit_s=16)[1] <= least


def test_a_rank_of_several_chunks_is_planned_by_plan_rank_with_one_module_per_chunk() -> None:
    from planner import optimize, plan_rank

    spec = dict(schedule="Interleaved1F1B", stage_index=0, num_stages=2, n_microbatches=4,
                num_chunks=2)
    module = harness.build_stage(0, 4)
    inputs, _ = harness.microbatch(0)
    with pytest.raises(ValueError, match=r"planner.plan_rank\(\[chunk modules\]"):
        optimize(module, (inputs,), budget_gb=1, pipeline=spec)
    with pytest.raises(ValueError, match="give as many modules and microbatches"):
        plan_rank([module], [(inputs,)], pipeline=spec, budget_gb=1)


def test_an_interleaved_split_makes_the_slowest_rank_fastest_within_the_budget() -> None:
    """Eight blocks over 2 ranks of 2 interleaved chunks, at 90 % of the even split's
    heaviest rank: every rank of the split found within the budget, its time the least
    over every split of chunk layers (enumerated apart on the same rank plans); a budget
    no split meets names one and the least budget it was found to fit."""
    from planner.pipeline.rank import RankSteps
    from planner.pipeline.split import plan_interleaved
    from planner.pipeline.stage import StageSteps

    ranks, chunks, blocks = 2, 2, 8
    spec = [harness.spec_of("Interleaved1F1B", r, ranks, MICROBATCHES, chunks)
            for r in range(ranks)]

    @functools.cache
    def chunk_steps(rank: int, chunk: int, layers: int) -> StageSteps:
        return harness.chunk_steps(spec[rank], chunk, layers)

    @functools.cache
    def rank_steps(rank: int, layers: tuple[int, ...]) -> RankSteps:
        return RankSteps([chunk_steps(rank, c, k) for c, k in enumerate(layers)])

    budget = int(0.9 * max(rank_steps(r, (2, 2)).peak() for r in range(ranks)))
    found = plan_interleaved(rank_steps, blocks, ranks, chunks, budget_gb=budget / 2**30,
                             least=1, most=3, solver="dp", time_limit_s=8)
    assert sum(sum(rank.layers) for rank in found) == blocks
    assert all(rank.peak_bytes <= budget for rank in found)
    assert [p.pipeline.chunk for p in found[0].plans] == [0, 1]

    @functools.cache
    def rank_ms(r: int, layers: tuple[int, ...]) -> float:
        try:
            plans, _ = rank_steps(r, layers).plan(budget, 8, "dp")
        except InfeasibleBudgetError:
            return math.inf
        return sum(p.baseline_step_ms * (1 + p.predicted_overhead) for p in plans)

    def slowest(split: tuple[tuple[int, ...], ...]) -> float:
        return max(rank_ms(r, layers) for r, layers in enumerate(split))

    options = list(itertools.product(range(1, 4), repeat=chunks))
    best = min(slowest(split) for split in itertools.product(options, repeat=ranks)
               if sum(map(sum, split)) == blocks)
    assert max(rank.time_ms for rank in found) == pytest.approx(best)
    with pytest.raises(InfeasibleBudgetError, match="per rank fit"):  # on the same ladders
        plan_interleaved(rank_steps, blocks, ranks, chunks, budget_gb=2**20 / 2**30,
                         least=1, most=3, solver="dp", time_limit_s=8)
