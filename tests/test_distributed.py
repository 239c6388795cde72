"""Plans for data-parallel training: two CPU processes over gloo, FSDP2 and DDP.

The recipe is torchtitan's: apply the plan to the model, then ``fully_shard`` each block and
the root (or wrap in DDP). Each rank's measured peak (``PeakTracker``, following FSDP2's
storage resizes) stays within the per-rank budget, and the planned model's losses and
gradients equal those of the same wrapping of the unplanned model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import free_port, spawn_ranks

from planner import InfeasibleBudgetError, Plan, PlanMismatchError, apply, optimize, replan, zoo
from planner.measure import least_peak_over_gloo

WORLD = 2


def _wrap(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # the plan's units (checked in the test)
            fully_shard(block)
        fully_shard(model)
        return model  # gloo's reduce-scatter as it is: the plans are for gloo
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _step(model: torch.nn.Module, zm: zoo.ZooModel) -> tuple[int, float, list[torch.Tensor]]:
    from planner.measure import PeakTracker
    from profiles import default_loss
    from profiles.inputs import normalize_inputs

    args, kwargs = normalize_inputs(model, zm.example_inputs)
    static = [*(_local(p) for p in model.parameters()), *model.buffers()]
    torch.manual_seed(0)
    with PeakTracker(static, follow_resizes=True) as tracker:
        loss = (zm.loss_fn or default_loss)(model(*args, **kwargs))
        loss.backward()
    grads = [_local(p.grad).clone() for p in model.parameters()]
    # the step's own peak: not the device mesh and what else the process held before it
    return tracker.own_peak_bytes, loss.item(), grads


def _rank(rank: int, kind: str, plan_path: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        plan = Plan.load(plan_path)
        zm = zoo.get("gpt", size="small", dropout=0.0)
        single = Plan.load(plan_path)
        single = single.model_copy(update={"sharding": None, "profile": single.profile.model_copy(
            update={"parallel": None})})
        try:
            apply(zm.model, single)
            refused = ""
        except PlanMismatchError as error:
            refused = str(error)
        del zm
        results = []

        def step() -> int:
            zm = zoo.get("gpt", size="small", dropout=0.0)
            results.append(_step(_wrap(apply(zm.model, plan), kind), zm))
            return results[-1][0]

        # the program's peak, not gloo's worker thread's lag (least_peak_over_gloo: FSDP2
        # with offload once measured +1.5 % on one rank of a CI run, exact on the other)
        peak = least_peak_over_gloo(step)
        _, loss, grads = results[0]
        zm = zoo.get("gpt", size="small", dropout=0.0)
        _, base_loss, base_grads = _step(_wrap(zm.model, kind), zm)
        torch.save({"peak": peak, "loss": loss, "base_loss": base_loss, "refused": refused,
                    "grads_equal": all(torch.equal(a, b) for a, b in zip(
                        grads, base_grads, strict=True))}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("kind", "offload"), [("fsdp2", False), ("ddp", False),
                                               ("fsdp2", True)])  # DDP's offload: one process's
def test_per_rank_plans_hold_under_fsdp2_and_ddp(kind: str, offload: bool,
                                                 tmp_path: Path) -> None:
    """With ``offload``, the plan also moves blocks' saved activations to the host (never
    FSDP2's all-gathered weights)."""
    zm = zoo.get("gpt", size="small", dropout=0.0)
    first = optimize(zm.model, zm.example_inputs, budget_gb=1e3, loss_fn=zm.loss_fn,
                     timing="estimate", world_size=WORLD, sharding=kind, progress=False)
    if kind == "fsdp2":  # torchtitan's recipe, run over a fake process group of 2
        assert first.sharding is None
        assert first.profile.parallel.fsdp_units == ["", *(f"blocks.{i}" for i in range(4))]
        assert first.profile.parallel.world_size == WORLD
    else:
        assert first.sharding is not None and first.sharding.world_size == WORLD
    static = first.problem().static_bytes
    try:
        plan = replan(first, budget_bytes=static + (first.unplanned_peak_bytes - static) // 2,
                      offload=offload, time_limit_s=10)  # what holds, not how fast it is
    except InfeasibleBudgetError as error:
        plan = error.plan
    assert (plan.checkpointing or offload) and plan.sharding == first.sharding
    assert bool(plan.offloads) == offload
    assert "per rank of 2" in plan.summary() or "per rank of a 2-rank mesh" in plan.summary()
    for result in _ranks_held(plan, kind, tmp_path):
        assert "is for one process, but this process group has 2 ranks" in result["refused"]
        if kind == "fsdp2":  # the rank's real step was profiled: the prediction is exact
            assert abs(result["peak"] - plan.predicted_peak_bytes) <= \
                0.01 * plan.predicted_peak_bytes, (result["peak"], plan.predicted_peak_bytes)


def _ranks_held(plan: Plan, kind: str, tmp_path: Path) -> list[dict]:
    """Each rank's step with ``plan`` applied and the model wrapped: within the budget,
    losses and gradients equal to the unplanned wrapping's. Returns the ranks' results."""
    plan_path = str(tmp_path / "plan.json")
    plan.save(plan_path)
    out = str(tmp_path / "result")
    spawn_ranks(_rank, (kind, plan_path, free_port(), out), WORLD)
    results = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    for rank, result in enumerate(results):
        assert result["peak"] <= plan.budget_bytes, (rank, result["peak"], plan.budget_bytes)
        assert result["loss"] == result["base_loss"] and result["grads_equal"], rank
    return results


@pytest.mark.parametrize("kind", ["fsdp2"])  # DDP runs one process's step: test_traced.py
def test_traced_op_ranges_inside_blocks_hold_under_fsdp2_and_ddp(kind: str,
                                                                 tmp_path: Path) -> None:
    """Each block checkpoints an op range of its own traced forward (a generated forward on
    the block FSDP2 shards), not the block's call."""
    from planner.api import plan_for_schedule
    from solvers import OpRange, Schedule

    zm = zoo.get("gpt", size="small", dropout=0.0)
    first = optimize(zm.model, zm.example_inputs, budget_gb=1e3, loss_fn=zm.loss_fn,
                     timing="estimate", world_size=WORLD, sharding=kind, progress=False)
    problem = first.problem()
    ranges = [max((s for s in problem.module_spans if s.kind == "ops"
                   and s.name.startswith(f"blocks.{i}[")), key=lambda s: s.stop - s.start)
              for i in range(4)]
    plan = plan_for_schedule(first.profile, Schedule.from_segments(
        problem.n_nodes, [(s.start, s.stop) for s in ranges]), first.inputs,
        first.structure_fingerprint, sharding=first.sharding)
    assert all(isinstance(r.target, OpRange) and r.target.path.startswith("blocks.")
               for r in plan.schedule.recompute_regions())
    assert plan.predicted_peak_bytes < first.unplanned_peak_bytes
    _ranks_held(plan, kind, tmp_path)


def test_sharding_needs_a_kind_and_valid_units() -> None:
    zm = zoo.get("gpt", size="tiny")
    with pytest.raises(ValueError, match="needs sharding='ddp' or 'fsdp2', or parallelize="):
        optimize(zm.model, zm.example_inputs, budget_gb=1, loss_fn=zm.loss_fn,
                 world_size=2, progress=False)
    with pytest.raises(ValueError, match="not submodules"):
        optimize(zm.model, zm.example_inputs, budget_gb=1, loss_fn=zm.loss_fn,
                 world_size=2, sharding="fsdp2", shard_modules=["layers.0"], progress=False)
    with pytest.raises(ValueError, match="mesh_shape"):
        optimize(zm.model, zm.example_inputs, budget_gb=1, loss_fn=zm.loss_fn,
                 parallelize=lambda model, mesh: None, progress=False)
    with pytest.raises(ValueError, match="not both"):
        optimize(zm.model, zm.example_inputs, budget_gb=1, loss_fn=zm.loss_fn,
                 parallelize=lambda model, mesh: None, sharding="fsdp2", world_size=2,
                 progress=False)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def _mesh_names(shape: tuple[int, ...]) -> tuple[str, ...]:
    return ("dp", "tp")[-len(shape):]


def _tp_rank(rank: int, shape: tuple[int, ...], plan_path: str, port: int, out: str) -> None:
    from test_parallel import tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=int(torch.tensor(shape).prod()))
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=_mesh_names(shape))
        results = []

        def step(plan: Plan | None) -> int:
            zm = zoo.get("hf-llama")
            if plan is not None:
                apply(zm.model, plan, strict=True)
            tensor_parallel(zm.model, mesh)
            results.append(_step(zm.model, zm))
            return results[-1][0]

        # the program's peak, not gloo's worker thread's lag (least_peak_over_gloo)
        peak = least_peak_over_gloo(lambda: step(Plan.load(plan_path)))
        step(None)
        (_, loss, grads), (_, base_loss, base_grads) = results[0], results[-1]
        torch.save({"peak": peak, "equal": loss == base_loss and all(
            torch.equal(a, b) for a, b in zip(grads, base_grads, strict=True))},
            f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shape", [(2, 2)], ids=["dp2xtp2"])
def test_tensor_parallel_plans_hold_over_gloo(shape: tuple[int, ...], tmp_path: Path) -> None:
    """HF Llama's TP plan with FSDP2 over ``dp`` on a 2 x 2 mesh over real gloo ranks:
    each rank within 1 % of the prediction and within budget, losses and gradients those
    of the same parallel model unplanned. (TP alone over 2 ranks runs on the fake process
    group in test_parallel.py; over gloo it repeated this case's TP half, 10 s.)"""
    from test_parallel import tensor_parallel

    zm = zoo.get("hf-llama")
    first = optimize(zm.model, zm.example_inputs, budget_gb=1e3, loss_fn=zm.loss_fn,
                     parallelize=tensor_parallel, mesh_shape=shape,
                     mesh_dim_names=_mesh_names(shape), progress=False)
    static = first.problem().static_bytes
    try:
        plan = replan(first, budget_bytes=static + (first.unplanned_peak_bytes - static) // 2,
                      time_limit_s=10)  # what holds, not how fast it is
    except InfeasibleBudgetError as error:
        plan = error.plan
    assert plan.checkpointing
    plan_path = str(tmp_path / "plan.json")
    plan.save(plan_path)
    out = str(tmp_path / "result")
    world = int(torch.tensor(shape).prod())
    spawn_ranks(_tp_rank, (shape, plan_path, free_port(), out), world)
    for rank in range(world):
        result = torch.load(f"{out}.{rank}")
        assert result["equal"], rank
        assert result["peak"] <= plan.budget_bytes, (rank, result["peak"], plan.budget_bytes)
        assert abs(result["peak"] - plan.predicted_peak_bytes) <= 0.01 * result["peak"], \
            (rank, result["peak"], plan.predicted_peak_bytes)
