"""Zero-bubble pipelines (`solvers.pipeline_orders`, `planner.pipeline.split_backward`): torch's
InterleavedZeroBubble, ZBVZeroBubble and DualPipeV split a stage's backward into the
input's gradient and, later, the weights'. Their orders are torch's; over gloo each rank
peaks where the replay says and within its budget, the pipeline's first stage planned (its
backward runs whole) and the stages after it run as profiled; losses and gradients are
those of the same pipeline unplanned."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch.distributed.pipelining")
import pipeline_harness as harness  # benchmarks/, on the path in conftest

from planner import InfeasibleBudgetError, optimize
from planner.pipeline.split_backward import measure_split_backward
from solvers.pipeline import StageSpec
from solvers.schedule import RECOMPUTE, Region, Schedule

RANKS, MICROBATCHES = 2, 4


def _torchs_order(schedule: str, ranks: int, chunks: int, microbatches: int,
                  rank: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s passes as torch's schedule computes them (no stages needed), each
    on the rank's chunk, overlapped pairs in the order torch runs them."""
    from torch.distributed.pipelining.schedules import _ComputationType, get_schedule_class

    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B",
             _ComputationType.BACKWARD_INPUT: "I", _ComputationType.BACKWARD_WEIGHT: "W"}
    torchs = get_schedule_class(schedule).__new__(get_schedule_class(schedule))
    torchs.pp_group_size, torchs._n_microbatches = ranks, microbatches
    torchs.n_local_stages, torchs.num_stages = chunks, ranks * chunks
    torchs.number_of_rounds = max(1, microbatches // ranks)
    torchs.microbatches_per_round = microbatches // torchs.number_of_rounds
    spec = StageSpec(schedule=schedule, stage_index=rank, num_stages=ranks,
                     n_microbatches=microbatches, num_chunks=chunks)
    chunk_of = {spec.chunk_stage(c): c for c in range(chunks)}

    def flat(actions: list[Any]) -> Iterator[Any]:
        for a in actions:
            if a is not None:
                yield from a.sub_actions or (a,)

    return [(kinds[a.computation_type], chunk_of[a.stage_index], a.microbatch_index)
            for a in flat(torchs._calculate_single_rank_operations(rank))]


def test_zero_bubble_orders_are_torchs_on_every_rank() -> None:
    """InterleavedZeroBubble (1-3 chunks), ZBVZeroBubble and DualPipeV (two chunks, a V) on
    every rank of 2-4 ranks, 1-13 microbatches where torch takes them: each rank's passes
    as the replay orders them are torch's."""
    cases = 0
    for schedule, ranks, chunks, m in itertools.product(
            ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"), (2, 3, 4), (1, 2, 3),
            range(1, 14)):
        if (chunks != 2) == (schedule != "InterleavedZeroBubble") or \
                (schedule == "DualPipeV" and m < 2 * ranks) or \
                (schedule == "InterleavedZeroBubble" and m % max(1, m // ranks)):
            continue
        for rank in range(ranks):
            assert StageSpec(schedule=schedule, stage_index=rank, num_stages=ranks,
                             n_microbatches=m, num_chunks=chunks).actions() == \
                _torchs_order(schedule, ranks, chunks, m, rank), (schedule, ranks, m, rank)
            cases += 1
    assert cases > 300


def test_v_schedules_hold_two_stages_per_rank_in_a_v() -> None:
    spec = StageSpec(schedule="ZBVZeroBubble", stage_index=1, num_stages=4, n_microbatches=8,
                     num_chunks=2)
    assert [spec.chunk_stage(c) for c in range(2)] == [1, 6]
    assert StageSpec(schedule="DualPipeV", stage_index=0, num_stages=2, n_microbatches=4,
                     num_chunks=2).last  # rank 0 holds the first stage and the last
    with pytest.raises(ValueError, match="exactly two stages per rank"):
        StageSpec(schedule="ZBVZeroBubble", stage_index=0, num_stages=2, n_microbatches=4)
    with pytest.raises(ValueError, match="DualPipeV needs at least as many microbatches as "
                                         "stages"):
        StageSpec(schedule="DualPipeV", stage_index=0, num_stages=2, n_microbatches=3,
                  num_chunks=2)


# InterleavedZeroBubble's ranks: benchmarks/results/pipeline-stages-cpu.md (108 peaks, the
# same split-backward replay; its order is checked above); here the V's two schedules
@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_zero_bubble_ranks_peak_as_replayed_and_train_unchanged(schedule: str,
                                                               tmp_path: Path) -> None:
    """Two ranks of two chunks. Rank 0 holds the pipeline's first stage, whose backward
    runs whole: planned together with its other chunk at 90 % of the rank's unplanned
    peak, it checkpoints. Rank 1 holds no first stage: that budget names its unplanned
    peak as the least, which holds. Each rank runs torch's order, peaks within its budget
    and at the predicted peak (within a kilobyte), and trains as unplanned."""
    specs = [harness.spec_of(schedule, r, RANKS, MICROBATCHES, 2) for r in range(RANKS)]
    ranks = [harness.rank_steps(spec) for spec in specs]
    planned, budgets = [], []
    for rank in ranks:
        budget = int(0.9 * rank.peak())
        try:
            planned.append(rank.plan(budget, time_limit_s=16, solver="dp"))
        except InfeasibleBudgetError as error:
            assert "not checkpointed" in str(error) and rank is ranks[1]
            assert error.min_budget_bytes == rank.peak()  # unplanned
            budget = error.min_budget_bytes
            planned.append(rank.plan(budget, time_limit_s=16, solver="dp"))
        budgets.append(budget)
    assert [[plan.checkpointing for plan in plans] for plans, _ in planned] == \
        [[True, False], [False, False]]
    by_stage = {spec.chunk_stage(c): plans[c]
                for spec, (plans, _) in zip(specs, planned, strict=True) for c in range(2)}
    ran, plain = harness.run_pipeline(schedule, RANKS, MICROBATCHES, tmp_path,
                                      [by_stage[g] for g in range(2 * RANKS)],
                                      unplanned_too=True, chunks=2)
    harness.check_ranks(specs, budgets, [peak for _, peak in planned], ran, plain)
    assert ran[0]["losses"] == plain[0]["losses"]  # rank 0 holds the last stage in a V
    assert len(ran[0]["losses"]) == MICROBATCHES


def test_a_stage_after_the_first_runs_as_profiled_under_a_split_backward() -> None:
    """``optimize(..., pipeline=...)`` of InterleavedZeroBubble's stage 1 names its
    unplanned peak as the least budget (torch would rerun a checkpoint once per parameter
    group), and at that budget its plan checkpoints nothing; its replay refuses a schedule
    that recomputes. Stage 0 checkpoints to meet a budget below its unplanned peak."""
    spec = dict(schedule="InterleavedZeroBubble", num_stages=RANKS,
                n_microbatches=MICROBATCHES)
    module = harness.build_stage(1, RANKS)
    inputs, target = harness.microbatch(1)
    options: dict[str, Any] = dict(loss_fn=lambda logits: harness.next_token_loss(
        logits, target), timing="estimate", time_limit_s=8, solver="dp")
    pipeline = {**spec, "stage_index": 1, "target_bytes": target.nbytes}
    with pytest.raises(InfeasibleBudgetError, match="a stage after the first is not "
                                                    "checkpointed") as caught:
        optimize(module, (inputs,), budget_gb=2**-10, pipeline=pipeline, **options)
    least = caught.value.min_budget_bytes
    steps = harness.chunk_steps(StageSpec(**spec, stage_index=1), 0)  # the same stage
    plan, peak = steps.plan(least, time_limit_s=8, solver="dp")
    assert not plan.checkpointing and peak == least == steps.peak()
    recompute_all = Schedule(regions=(Region(0, steps.problems[1].n_nodes, RECOMPUTE),))
    with pytest.raises(ValueError, match="splits the backward of stage 1"):
        steps.replay(recompute_all)
    first = harness.build_stage(0, RANKS)
    tokens, _ = harness.microbatch(0)
    unplanned = harness.chunk_steps(StageSpec(**spec, stage_index=0), 0).peak()
    planned = optimize(first, (tokens,), budget_gb=0.8 * unplanned / 2**30, solver="dp",
                       timing="estimate", time_limit_s=16, pipeline={**spec, "stage_index": 0})
    assert planned.checkpointing and planned.pipeline.peak_bytes <= 0.8 * unplanned


def test_measuring_the_split_backward_leaves_the_stage_as_it_was() -> None:
    """The measurement runs the stage's step three times: the parameters' and the input's
    gradients, and the random state, are as they were (gradients set or not); a module in
    eval() stays in it, its BatchNorm statistics untouched. On the meta device it measures
    the same, without memory."""
    module = harness.build_stage(1, 3)
    inputs, _ = harness.microbatch(1)
    with torch.no_grad():
        received = torch.zeros_like(module(inputs))  # the next stage's gradient
    for grads in (False, True):
        for p in module.parameters():
            p.grad = torch.full_like(p, 3.0) if grads else None
        inputs.grad = torch.ones_like(inputs) if grads else None
        state = torch.get_rng_state()
        split = measure_split_backward(module, (inputs,), {}, received=received)
        assert split.held > 0 and split.input_rise[1] > 0
        assert torch.equal(torch.get_rng_state(), state)
        for p in module.parameters():
            assert (p.grad is not None and bool((p.grad == 3.0).all())) if grads \
                else p.grad is None
        assert (inputs.grad is not None and bool((inputs.grad == 1).all())) if grads \
            else inputs.grad is None
    stage = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.BatchNorm1d(64),
                                torch.nn.Dropout(0.5), torch.nn.Linear(128, 128),
                                torch.nn.ReLU())
    statistics = [b.clone() for b in stage.buffers()]
    stage_received = torch.zeros(4, 64, 128)
    trained = measure_split_backward(stage, (inputs,), {}, received=stage_received)
    assert all(torch.equal(a, b) for a, b in zip(statistics, stage.buffers(), strict=True))
    # planned in eval() as in train(): the training step, its dropout masks included
    assert measure_split_backward(stage.eval(), (inputs,), {},
                                  received=stage_received) == trained
    assert not any(m.training for m in stage.modules())  # eval() as it was
    meta = copy.deepcopy(module).to("meta")
    assert measure_split_backward(meta, (inputs.detach().to("meta").requires_grad_(),), {},
                                  received=received.to("meta"), device="H100") == split


def test_on_the_meta_device_the_split_backward_runs_the_targets_attention() -> None:
    """A stage of attention on the meta device, measured for an H100, runs the fused
    attention the profile runs (the meta device's own is the math decomposition, which
    holds the attention matrix in its backward): the input pass rises less."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(512, 3 * 512, dtype=torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(1, 1024, 3, 8, 64).permute(2, 0, 3, 1, 4)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + out.transpose(1, 2).reshape(1, 1024, 512)

    module = Attention().to("meta")
    x = torch.empty(1, 1024, 512, dtype=torch.bfloat16, device="meta", requires_grad=True)
    received = torch.empty(1, 1024, 512, dtype=torch.bfloat16, device="meta")
    fused = measure_split_backward(module, (x,), {}, received=received, device="H100")
    math = measure_split_backward(module, (x,), {}, received=received)
    attention_matrix = 8 * 1024 * 1024 * 2
    assert math.input_rise[1] - fused.input_rise[1] >= attention_matrix
    module.forward = lambda x: x[0]  # a view: torch's input pass cannot detach it
    with pytest.raises(ValueError, match="returns a view"):
        measure_split_backward(module, (x,), {}, received=received[0], device="H100")
