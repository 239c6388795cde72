"""Pipelines over gloo on the CPU: a small GPT cut into stages, run by torch's schedules in
one process per stage, each rank's measured peak, the order it ran its microbatches in,
its gradients and (last stage) its losses; and the planner's prediction of each peak.

Used by `benchmarks/pipeline_stages.py` and `tests/test_pipeline.py`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_ranks import free_port, spawn_ranks
from torch import nn

from planner import InfeasibleBudgetError, Plan, apply, optimize, replan
from planner.measure import PeakTracker
from planner.pipeline.rank import RankSteps
from planner.pipeline.stage import StageSteps, stage_loss, stage_peak_bytes
from planner.plan import PipelineStage
from planner.zoo import GPTBlock
from solvers.pipeline import RUNTIME_SCHEDULES, StageSpec

VOCAB, SEQ, WIDTH, HEADS, MICROBATCH, BLOCKS_PER_STAGE = 512, 64, 128, 4, 4, 2


class Stage(nn.Module):
    """Blocks of a GPT; the first stage embeds the tokens, the last projects to logits."""

    def __init__(self, first: bool, last: bool, blocks: int = BLOCKS_PER_STAGE) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH) if first else None
        self.blocks = nn.ModuleList(GPTBlock(WIDTH, HEADS, 0.0) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, VOCAB) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def build_stage(rank: int, world: int, blocks: int = BLOCKS_PER_STAGE) -> Stage:
    torch.manual_seed(100 + rank)
    return Stage(rank == 0, rank == world - 1, blocks)


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batch(n_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's tokens and targets, every microbatch of them."""
    generator = torch.Generator().manual_seed(0)
    shape = (MICROBATCH * n_microbatches, SEQ)
    return (torch.randint(VOCAB, shape, generator=generator),
            torch.randint(VOCAB, shape, generator=generator))


def microbatch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One microbatch of the stage's input (tokens, or a received activation, which
    requires grad) and of the targets."""
    generator = torch.Generator().manual_seed(1)
    target = torch.randint(VOCAB, (MICROBATCH, SEQ), generator=generator)
    if rank == 0:
        return torch.randint(VOCAB, (MICROBATCH, SEQ), generator=generator), target
    return torch.randn(MICROBATCH, SEQ, WIDTH, generator=generator).requires_grad_(), target


def _loss_of(spec: StageSpec, target: torch.Tensor) -> Any:
    return (lambda logits: next_token_loss(logits, target)) if spec.last else None


def predicted_peak(spec: StageSpec, plan: Plan | None = None) -> int:
    """The planner's prediction of the stage's peak over one step."""
    module = build_stage(spec.stage_index, spec.num_stages)
    inputs, target = microbatch(spec.stage_index)
    return stage_peak_bytes(module, (inputs,), spec, loss_fn=_loss_of(spec, target),
                            target_bytes=target.nbytes if spec.last else 0,
                            schedule=plan.schedule if plan else None, timing="estimate")


def halfway_plan(spec: StageSpec) -> Plan:
    """A plan of one microbatch's step of the stage, halfway between its static memory and
    its unplanned peak (or at the least peak a plan reaches), gradients allocated when it
    starts, as they are from the stage's first backward on."""
    module = build_stage(spec.stage_index, spec.num_stages)
    inputs, target = microbatch(spec.stage_index)
    loss = stage_loss(module, (inputs,), spec, _loss_of(spec, target))
    first = optimize(module, (inputs,), budget_gb=1e3, loss_fn=loss, timing="estimate",
                     grad_accumulation=True, progress=False, time_limit_s=10)
    static = first.profile.static.total_bytes
    try:
        plan = replan(first, budget_bytes=(static + first.unplanned_peak_bytes) // 2,
                      time_limit_s=10)
    except InfeasibleBudgetError as error:
        plan = error.plan
    return plan.model_copy(update={"pipeline": PipelineStage(
        spec=spec, budget_bytes=plan.budget_bytes, peak_bytes=predicted_peak(spec, plan))})


def stage_plan(spec: StageSpec, budget_bytes: int) -> tuple[Plan, int]:
    """``optimize(..., pipeline=...)`` for the stage at ``budget_bytes``: the plan, and the
    stage's predicted peak."""
    module = build_stage(spec.stage_index, spec.num_stages)
    inputs, target = microbatch(spec.stage_index)
    plan = optimize(module, (inputs,), budget_gb=budget_bytes / 2**30,
                    loss_fn=_loss_of(spec, target), timing="estimate", time_limit_s=16,
                    deterministic=True,
                    pipeline={**spec.model_dump(),
                              "target_bytes": target.nbytes if spec.last else 0})
    return plan, plan.pipeline.peak_bytes


def _record_order(stage: Any, local: int, order: list[list[Any]]) -> None:
    """Record each pass of the rank's chunk ``local``: [pass, chunk, microbatch] ("I" and
    "W" where the schedule splits the backward)."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
    weight = stage.backward_weight_one_chunk

    def forward_one(chunk: int, *args: Any, **kwargs: Any) -> Any:
        order.append(["F", local, chunk])
        return forward(chunk, *args, **kwargs)

    def backward_one(chunk: int, *args: Any, **kwargs: Any) -> Any:
        order.append(["B" if kwargs.get("full_backward", True) else "I", local, chunk])
        return backward(chunk, *args, **kwargs)

    def weight_one(chunk: int, *args: Any, **kwargs: Any) -> Any:
        order.append(["W", local, chunk])
        return weight(chunk, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one, backward_one
    stage.backward_weight_one_chunk = weight_one


def _rank(rank: int, world: int, port: int, schedule: str, n_microbatches: int,
          plan_dir: str | None, out: str, unplanned_too: bool, chunks: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runs = [plan_dir] + ([None] if plan_dir and unplanned_too else [])
        for run, plans in enumerate(runs):  # the planned one first, nothing else alive
            result = _one_step(rank, world, schedule, n_microbatches, plans, chunks)
            torch.save(result, Path(out) / f"rank{rank}.{run}.pt")
            del result
    finally:
        dist.destroy_process_group()


def _one_step(rank: int, world: int, schedule: str, n_microbatches: int,
              plan_dir: str | None, chunks: int = 1) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    stages_total = world * chunks
    spec = spec_of(schedule, rank, world, n_microbatches, chunks)
    indices = [spec.chunk_stage(c) for c in range(chunks)]  # the rank's stages, by chunk
    modules = [build_stage(g, stages_total) for g in indices]
    for g, module in zip(indices, modules, strict=True):
        if plan_dir:  # a stage's plan, installed on its rank of the pipeline's group
            apply(module, Plan.load(Path(plan_dir) / f"stage{g}.json"))
    stages = [PipelineStage(module, g, stages_total, torch.device("cpu"))
              for g, module in zip(indices, modules, strict=True)]
    runner = get_schedule_class(schedule)(stages if schedule in RUNTIME_SCHEDULES else stages[0],
                                          n_microbatches=n_microbatches, loss_fn=next_token_loss)
    tokens, targets = batch(n_microbatches)
    holds_first, holds_last = 0 in indices, stages_total - 1 in indices
    if not holds_first:
        del tokens
    if not holds_last:
        del targets
    order: list[list[Any]] = []
    for local, stage in enumerate(stages):
        _record_order(stage, local, order)
    losses: list[torch.Tensor] = []
    with PeakTracker([], follow_resizes=True) as tracker:  # all the process holds
        if holds_first:
            runner.step(tokens, **(dict(target=targets, losses=losses) if holds_last else {}))
        elif holds_last:
            runner.step(target=targets, losses=losses)
        else:
            runner.step()
    return {"peak": tracker.peak_bytes, "order": order,
            "losses": [loss.item() for loss in losses],
            "grads": [p.grad.clone() for module in modules for p in module.parameters()]}


def run_pipeline(schedule: str, world: int, n_microbatches: int, out: Path,
                 plans: list[Plan] | None = None, unplanned_too: bool = False,
                 chunks: int = 1
                 ) -> list[dict[str, Any]] | tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One step of the pipeline, one gloo process per rank (each running ``chunks``
    stages); per rank: its measured peak (everything the process holds, as a GPU allocator
    counts), its passes in order, its losses and gradients. ``plans[g]`` is stage ``g``'s.
    With ``plans`` and ``unplanned_too``, each process then runs the step unplanned too
    (its peak is not the step's alone): returns both runs' results."""
    out.mkdir(parents=True, exist_ok=True)
    plan_dir = None
    if plans:
        plan_dir = out / "plans"
        plan_dir.mkdir(exist_ok=True)
        for stage, plan in enumerate(plans):
            plan.save(plan_dir / f"stage{stage}.json")
    spawn_ranks(_rank, (world, free_port(), schedule, n_microbatches,
                        str(plan_dir) if plan_dir else None, str(out), unplanned_too, chunks),
                world)
    runs = [[torch.load(out / f"rank{rank}.{run}.pt") for rank in range(world)]
            for run in range(2 if plans and unplanned_too else 1)]
    return tuple(runs) if len(runs) == 2 else runs[0]


# a planned last stage measures up to 524 bytes under its replay (results/pipeline-stages-
# cpu.md), where one boundary activation is 131,072; a loss scalar may be above it
BELOW, ABOVE = 1024, 8


def check_ranks(specs: list[StageSpec], budgets: list[int], predicted: list[int],
                ran: list[dict[str, Any]], unplanned: list[dict[str, Any]]) -> None:
    """Each rank ran its passes in the replayed order, peaked within its budget and at its
    predicted peak, and computed the unplanned pipeline's gradients."""
    for spec, budget, peak, measured, plain in zip(specs, budgets, predicted, ran, unplanned,
                                                  strict=True):
        assert [tuple(a) for a in measured["order"]] == spec.actions()
        assert measured["peak"] <= budget, (spec.stage_index, measured["peak"], budget)
        assert peak - BELOW <= measured["peak"] <= peak + ABOVE, \
            (spec.stage_index, measured["peak"], peak)
        assert all(torch.equal(a, b) for a, b in zip(measured["grads"], plain["grads"],
                                                     strict=True))


def spec_of(schedule: str, rank: int, world: int, n_microbatches: int,
            chunks: int = 1) -> StageSpec:
    return StageSpec(schedule=schedule, stage_index=rank, num_stages=world,
                     n_microbatches=n_microbatches, num_chunks=chunks)


def chunk_steps(spec: StageSpec, chunk: int, blocks: int = BLOCKS_PER_STAGE) -> StageSteps:
    """The rank's ``chunk`` (stage ``spec.chunk_stage(chunk)``) of the harness's model with
    ``blocks`` blocks, profiled. Stages of the same size between the first and the last
    profile alike (the same shapes and inputs; times are estimated): each such size is
    profiled once, and its split backward measured once where a schedule splits it."""
    g, last = spec.chunk_stage(chunk), spec.chunk_last(chunk)
    key = (g == 0, last, blocks, spec.splits_backward)
    if key not in _PROFILED:
        module = build_stage(g, spec.num_chunks * spec.num_stages, blocks)
        inputs, target = microbatch(g)
        _PROFILED[key] = StageSteps(
            module, (inputs,), spec,
            (lambda logits: next_token_loss(logits, target)) if last else None,
            target.nbytes if last else 0, chunk=chunk, timing="estimate")
    steps = copy.copy(_PROFILED[key])
    steps.spec, steps.chunk = spec, chunk
    return steps


_PROFILED: dict[tuple[bool, bool, int, bool], StageSteps] = {}


def rank_steps(spec: StageSpec) -> RankSteps:
    """The rank's chunks, each stage ``c·p + r`` of the harness's model, profiled."""
    return RankSteps([chunk_steps(spec, c) for c in range(spec.num_chunks)])


def halfway_rank_plans(steps: RankSteps) -> list[Plan]:
    """The rank's chunk plans at the budget halfway between the rank's static memory (its
    chunks' parameters and gradients) and its unplanned peak, or at the least rank peak
    its chunks' plans reach."""
    static = sum(chunk.problems[1].static_bytes for chunk in steps.chunks)
    try:
        return steps.plan((static + steps.peak()) // 2, time_limit_s=16)[0]
    except InfeasibleBudgetError as error:
        return steps.plan(error.min_budget_bytes, time_limit_s=16)[0]

