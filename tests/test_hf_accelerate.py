"""`planner.switches.hf_accelerate.planned`: plan and install before ``accelerator.prepare``, with
the accelerator's precision and accumulation; training is accelerate's own."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch

from planner import InfeasibleBudgetError, PlanMismatchWarning, apply, optimize, replan, zoo
from planner.measure import PeakTracker

accelerate = pytest.importorskip("accelerate")
from planner.switches.hf_accelerate import planned  # noqa: E402  (needs accelerate)

GIB = 2**30


@pytest.fixture(autouse=True)
def _fresh_accelerator_state() -> Any:
    """Each test's Accelerator sets its own precision (accelerate keeps one per process)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _budget_gb(model: torch.nn.Module, batch: dict, optimizer: Any, **options: Any) -> float:
    """Static memory plus half the activations, or 2 % over the least a plan meets."""
    first = optimize(model, batch, budget_gb=1e3, optimizer=optimizer, timing="estimate",
                     progress=False, **options)
    static = first.profile.static.total_bytes
    try:
        return replan(first, budget_bytes=static + (first.unplanned_peak_bytes - static) // 2,
                      time_limit_s=10).budget_bytes / GIB
    except InfeasibleBudgetError as error:
        return 1.02 * error.min_budget_gb


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _train(accelerator: Any, model: torch.nn.Module, optimizer: Any, batches: list[dict],
           ranks: bool = False) -> tuple[list[float], list[int]]:
    """Steps as accelerate's examples write them; each step's measured peak (over ranks,
    everything the process holds, FSDP2's resized storages and DDP's buckets included, less
    what the step never touches)."""
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, peaks = [], []
    for batch in batches:
        state = [_local(t) for s in optimizer.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        with PeakTracker([*map(_local, model.parameters()), *model.buffers(), *state,
                          *batch.values()], follow_resizes=ranks) as tracker:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        peaks.append(tracker.own_peak_bytes if ranks else tracker.peak_bytes)
    return losses, peaks


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_planned_before_prepare_trains_like_accelerate_within_the_budget(
        precision: str) -> None:
    base = zoo.get("hf-llama", batch=4)
    model, ids = base.model, base.example_inputs["input_ids"]
    unplanned = copy.deepcopy(model)
    batches = [{"input_ids": ids, "labels": ids}, {"input_ids": ids.flip(0),
                                                    "labels": ids.flip(0)}]
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    budget_gb = _budget_gb(model, batches[0], optimizer,
                           autocast=torch.bfloat16 if precision == "bf16" else None)
    torch.manual_seed(0)
    plan = planned(accelerator, model, batches[0], budget_gb=budget_gb, optimizer=optimizer,
                   timing="estimate")
    assert plan.checkpointing
    assert plan.autocast_dtype == ("bfloat16" if precision == "bf16" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)  # the step is the one planned
        losses, peaks = _train(accelerator, model, optimizer, batches)
    torch.manual_seed(0)
    expected, _ = _train(accelerator, unplanned,
                         torch.optim.AdamW(unplanned.parameters(), lr=1e-2), batches)
    assert losses == expected
    for (name, a), (_, b) in zip(model.named_parameters(), unplanned.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert max(peaks) <= plan.budget_bytes, (peaks, plan.budget_bytes,
                                             plan.predicted_peak_bytes)


def test_what_planned_cannot_plan_is_refused_clearly() -> None:
    base = zoo.get("hf-llama", batch=2)
    accelerator = accelerate.Accelerator(cpu=True)
    batch = base.example_inputs
    with pytest.raises(TypeError, match="from the Accelerator"):
        planned(accelerator, base.model, batch, budget_gb=1.0, autocast=torch.bfloat16)
    prepared = accelerator.prepare(copy.deepcopy(base.model))
    prepared._original_forward = prepared.forward  # as prepare leaves it under bf16
    with pytest.raises(ValueError, match=r"before accelerator\.prepare"):
        planned(accelerator, prepared, batch, budget_gb=1.0)
    fsdp = _accelerator("fsdp2", "no")
    fsdp.state.fsdp_plugin.activation_checkpointing = True
    with pytest.raises(ValueError, match="activation_checkpointing=True checkpoints every"):
        planned(fsdp, base.model, batch, budget_gb=1.0)



def _accelerator(kind: str, precision: str) -> Any:
    """An Accelerator over this process's gloo group: DDP, or FSDP2 (accelerate selects
    FSDP for GPUs only; its wrapping code is the same on the CPU)."""
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(False)
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if kind == "fsdp2" else None
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=precision,
                                         fsdp_plugin=plugin)
    if plugin is not None:
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        plugin.set_mixed_precision(precision if precision != "no" else "fp32")
    return accelerator


def _rank_steps(rank: int, kind: str, precision: str, port: int, out: str) -> None:
    """One rank of two: the unplanned model's two steps, then the planned one's, each
    prepared by accelerate (DDP, or its FSDP2). Saves losses, peaks, weights and the plan."""
    import os

    from tests.budgets import halfway_budget_gb

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    ids = zoo.get("hf-llama", batch=4).example_inputs["input_ids"].roll(rank, 0)
    batches = [{"input_ids": ids, "labels": ids}, {"input_ids": ids.flip(0),
                                                    "labels": ids.flip(0)}]
    results: dict[str, dict] = {}
    plan = None
    # the planned one first, measured with nothing else alive; then again, installed from
    # its plan: a step's peak is the least of the two (gloo's worker thread drops a
    # collective's buffer late at times: planner.measure.least_peak_over_gloo)
    for run in ("planned", "again", "unplanned"):
        accelerator = _accelerator(kind, precision)  # a fresh one: it prepares one model
        model = zoo.get("hf-llama", batch=4).model  # the same weights on every rank
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if run == "planned":
            probe = copy.deepcopy(model)
            first = planned(accelerator, probe, batches[0], budget_gb=1e3,
                            optimizer=torch.optim.AdamW(probe.parameters()), timing="estimate")
            budget_gb = halfway_budget_gb(first)
            del probe, first
            plan = planned(accelerator, model, batches[0], budget_gb=budget_gb,
                           optimizer=optimizer, timing="estimate")
        elif run == "again":
            apply(model, plan)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PlanMismatchWarning)
            losses, peaks = _train(accelerator, model, optimizer, batches, ranks=True)
        weights = [_local(p).detach().clone() for p in model.parameters()]
        results[run] = {"losses": losses, "peaks": peaks, "weights": weights}
    torch.save({True: {**results["planned"], "plan": plan.model_dump_json(), "peaks": [
        min(a, b) for a, b in zip(results["planned"]["peaks"], results["again"]["peaks"],
                                  strict=True)]}, False: results["unplanned"]},
        f"{out}.{rank}")


@pytest.mark.parametrize(("kind", "precision"), [("fsdp2", "bf16")])  # DDP: test_hf_trainer
def test_planned_over_two_processes_holds_each_ranks_budget_and_trains_alike(
        kind: str, precision: str, tmp_path: Any) -> None:
    """Two gloo processes, accelerate's DDP or FSDP2 (its ``fsdp2_prepare_model``, run on
    the CPU with the state set to FSDP: accelerate selects FSDP only for GPUs), in bf16:
    accelerate's policy casts the root's outputs to bf16 (``output_dtype``), a cast the
    profile once took for FSDP2's own and counted 2.3 % below the step."""
    from gloo_ranks import free_port, spawn_ranks

    from planner import Plan

    out = str(tmp_path / "rank")
    spawn_ranks(_rank_steps, (kind, precision, free_port(), out), 2)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    plans = [Plan.model_validate_json(r[True]["plan"]) for r in ranks]
    assert plans[0].model_dump_json() == plans[1].model_dump_json()  # rank 0's, everywhere
    plan = plans[0]
    assert plan.checkpointing and (plan.sharding is not None) == (kind == "ddp")
    # planned in gloo's processes: for gloo's reduce-scatter, which copies its input
    assert re.search(r"per rank of (2 \(DDP\)|a 2-rank \(dp_shard\) mesh over gloo \(FSDP2)",
                     plan.summary())
    for rank, result in enumerate(ranks):
        assert result[True]["losses"] == result[False]["losses"], rank
        assert all(torch.equal(a, b) for a, b in zip(result[True]["weights"],
                                                     result[False]["weights"], strict=True))
        assert max(result[True]["peaks"]) <= plan.budget_bytes, (
            rank, result[True]["peaks"], plan.budget_bytes, plan.predicted_peak_bytes)
        if kind == "fsdp2":  # the rank's own step was profiled: its peak is the prediction
            assert abs(max(result[True]["peaks"]) - plan.predicted_peak_bytes) <= \
                0.01 * plan.predicted_peak_bytes, (rank, result[True]["peaks"])
