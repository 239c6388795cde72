"""One call for 🤗 accelerate: ``planned(accelerator, model, batch, budget_gb=...)`` plans
and installs checkpointing before ``accelerator.prepare``, with the accelerator's mixed
precision, gradient accumulation and processes.

It must run before ``prepare``: ``prepare`` wraps ``model.forward`` in autocast (mixed
precision) and, over several processes, the model itself. Over several processes each rank's
step is planned: under DDP the single process's step plus DDP's gradient buckets; under FSDP2
the step accelerate's own ``fsdp2_prepare_model`` makes (its wrapping, mixed-precision policy
and resharding), run over a fake process group of the accelerator's size. Rank 0 plans and
sends the plan to the others, so every rank recomputes the same blocks (under FSDP2 a
recompute gathers parameters: ranks that checkpoint differently would wait on each other).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from planner.api import apply, optimize
from planner.config import PlanConfig
from planner.plan import Plan

__all__ = ["plan_for_processes", "planned"]

_AUTOCAST = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_DECIDED = ("autocast", "grad_accumulation", "world_size", "sharding", "parallelize",
            "mesh_shape", "mesh_dim_names")


def planned(accelerator: Any, model: nn.Module, batch: Any, *, budget_gb: float,
            config: PlanConfig | None = None, **options: Any) -> Plan:
    """Plan ``model``'s training step on ``batch`` at ``budget_gb`` GiB (per rank) as
    ``accelerator`` will run it (its ``mixed_precision``, ``gradient_accumulation_steps``,
    processes and DDP or FSDP2; ``optimizer`` counted when given), install the plan and
    return it. Call it before ``accelerator.prepare(model, ...)``, on every rank; other
    options (keywords or ``config=``) are :class:`~planner.config.PlanConfig`'s."""
    made = PlanConfig.for_switch(config, options, "planned()", _DECIDED, "the Accelerator "
                                 "(mixed_precision, gradient_accumulation_steps, its "
                                 "processes and plugins)")
    if getattr(model, "_original_forward", None) is not None:
        raise ValueError("planned() must run before accelerator.prepare(model): prepare "
                         "has already wrapped this model's forward")
    return plan_for_processes(
        accelerator.state, model, batch, budget_gb=budget_gb,
        grad_accumulation=accelerator.gradient_accumulation_steps > 1,
        mesh=getattr(accelerator, "torch_device_mesh", None), config=made)


def plan_for_processes(state: Any, model: nn.Module, batch: Any, *, budget_gb: float,
                       grad_accumulation: bool, mesh: Any = None,
                       config: PlanConfig | None = None, **options: Any) -> Plan:
    """Plan and install ``model``'s step as accelerate's ``state`` (an
    ``AcceleratorState``) runs it on each rank: rank 0 plans, every rank installs its
    plan. ``mesh``: the accelerator's device mesh, where it has one; ``config`` and
    ``options`` what the switch was given (the processes' options override them)."""
    precision = str(state.mixed_precision)
    if precision not in _AUTOCAST:
        raise ValueError(f"planned() plans mixed precision 'no', 'bf16' or 'fp16', not "
                         f"{precision!r}")
    options = {"autocast": _AUTOCAST[precision], "grad_accumulation": grad_accumulation,
               **options, **_processes(state, mesh)}
    plan, failure = None, None
    if state.process_index == 0:
        try:
            plan = optimize(model, batch, budget_gb=budget_gb, config=config, **options)
        except Exception as error:  # the other ranks must hear of it, not wait
            failure = error
    if state.num_processes > 1:
        plan = _from_rank_zero(plan, failure)
    if failure is not None:
        raise failure
    apply(model, plan)
    return plan


def _processes(state: Any, mesh: Any) -> dict[str, Any]:
    """The options of :func:`planner.optimize` for accelerate's processes."""
    ranks = state.num_processes
    kind = getattr(state.distributed_type, "value", str(state.distributed_type))
    if state.is_fsdp2:
        if state.fsdp_plugin.activation_checkpointing:
            raise ValueError("the FSDP plugin's activation_checkpointing=True checkpoints "
                             "every wrapped layer; turn it off to install a plan")
        if mesh is not None and mesh.ndim > 1:
            raise ValueError(f"planned() plans accelerate's FSDP2 over one mesh dimension; "
                             f"this accelerator's mesh is {tuple(mesh.shape)}. Plan with "
                             "optimize(..., parallelize=..., mesh_shape=...) and apply")
        # under FSDP2 accelerate casts with the policy, not autocast
        return {"parallelize": _accelerates_fsdp2(state), "mesh_shape": (ranks,),
                "mesh_dim_names": ("dp_shard",), "autocast": None}
    if ranks == 1:
        return {}
    if kind.startswith("MULTI_"):  # DDP over CPUs, GPUs or other devices
        return {"world_size": ranks, "sharding": "ddp"}
    raise ValueError(f"planned() plans one process, DDP or FSDP2, not accelerate's {kind} "
                     "(FSDP1 and DeepSpeed wrap the model their own way)")


def _accelerates_fsdp2(state: Any) -> Callable[[nn.Module, Any], None]:
    """accelerate's own FSDP2 wrapping as a parallelize function over the planner's mesh."""
    from accelerate.utils import fsdp2_prepare_model

    def parallelize(model: nn.Module, mesh: Any) -> None:
        view = SimpleNamespace(  # the parts of an Accelerator fsdp2_prepare_model reads
            state=state, torch_device_mesh=mesh,
            parallelism_config=SimpleNamespace(fsdp_dim_names=mesh.mesh_dim_names),
            mixed_precision=state.mixed_precision, is_main_process=False,
            device=torch.device(mesh.device_type))
        fsdp2_prepare_model(view, model)

    return parallelize


def _from_rank_zero(plan: Plan | None, failure: Exception | None) -> Plan | None:
    """Rank 0's plan on every rank; where rank 0 failed, the others raise its message."""
    import torch.distributed as dist

    box = [(plan, None if failure is None else f"{type(failure).__name__}: {failure}")]
    dist.broadcast_object_list(box, src=0)
    plan, message = box[0]
    if message is not None and failure is None:
        raise RuntimeError(f"rank 0 could not plan this step, so no rank installs a plan: "
                           f"{message}")
    return plan
