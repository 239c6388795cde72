"""One call for 🤗 accelerate: ``planned(accelerator, model, batch, budget_gb=...)`` plans
and installs checkpointing before ``accelerator.prepare``, with the accelerator's mixed
precision and gradient accumulation.

It must run before ``prepare``: ``prepare`` wraps ``model.forward`` in autocast (mixed
precision) and, over several processes, the model itself (DDP, FSDP). One process is
planned here; over several, plan with ``optimize(..., world_size=..., sharding=...)``
(`docs/recipes.md`) and ``apply`` before ``prepare``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from planner.api import apply, optimize
from planner.plan import Plan

__all__ = ["planned"]

_AUTOCAST = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def planned(accelerator: Any, model: nn.Module, batch: Any, *, budget_gb: float,
            optimizer: torch.optim.Optimizer | None = None,
            loss_fn: Callable[[Any], torch.Tensor] | None = None,
            **optimize_options: Any) -> Plan:
    """Plan ``model``'s training step on ``batch`` at ``budget_gb`` GiB as ``accelerator``
    will run it (its ``mixed_precision``, ``gradient_accumulation_steps``; ``optimizer``
    counted when given), install the plan and return it. Call it before
    ``accelerator.prepare(model, ...)``; other keyword arguments go to
    :func:`planner.optimize`."""
    decided = {"autocast", "grad_accumulation"} & set(optimize_options)
    if decided:
        raise TypeError(f"planned() takes {sorted(decided)} from the Accelerator "
                        "(mixed_precision, gradient_accumulation_steps); set them there")
    if accelerator.num_processes > 1:
        raise ValueError(
            f"planned() plans one process; this Accelerator runs {accelerator.num_processes}. "
            "Plan each rank's step with optimize(model, batch, budget_gb=..., world_size=..., "
            "sharding=...), apply(model, plan), then accelerator.prepare (docs/recipes.md)")
    if getattr(model, "_original_forward", None) is not None:
        raise ValueError("planned() must run before accelerator.prepare(model): prepare "
                         "has already wrapped this model's forward")
    precision = str(accelerator.mixed_precision)
    if precision not in _AUTOCAST:
        raise ValueError(f"planned() plans mixed precision 'no', 'bf16' or 'fp16', not "
                         f"{precision!r}")
    plan = optimize(model, batch, budget_gb=budget_gb, optimizer=optimizer, loss_fn=loss_fn,
                    autocast=_AUTOCAST[precision],
                    grad_accumulation=accelerator.gradient_accumulation_steps > 1,
                    **{"progress": False, **optimize_options})
    apply(model, plan)
    return plan
