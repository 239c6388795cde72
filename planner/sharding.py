"""Per-rank memory of data-parallel training: DDP and FSDP2 (``optimize(world_size=...)``).

A plan for N ranks budgets what one rank holds. The activations, and the parameters'
lives around them, are the single-process step's on the rank's own inputs (each rank
runs the whole model on its batch); what changes is the static part:

* DDP keeps a full replica and, unless ``gradient_as_bucket_view=True``, flat gradient
  buckets as large as the gradients (all step); gradients themselves appear in backward
  as without DDP.
* FSDP2 (``fully_shard`` on each unit, then on the root, torchtitan's recipe) keeps 1/N of
  every parameter, gradient and optimizer state (parameters padded to a multiple of N
  along dim 0). Around that, per rank: the root's parameters all-gathered, and its
  unsharded gradients (lm_head's come first in backward and are reduce-scattered at the
  end); the running unit's parameters plus the one prefetched; a unit's unsharded
  gradients plus their reduce-scatter copy; the all-gather's copy-in buffer. These are
  schedule-independent, so the plan budgets their largest sum as a constant: an upper
  bound (``benchmarks/distributed.py`` measures the slack), not an exact timeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from profiles.schema import Bytes, Count, StaticMemory
from solvers.problem import Problem

if TYPE_CHECKING:
    from torch import nn

__all__ = ["SHARDINGS", "Sharding", "rank_problem", "sharding_for"]

SHARDINGS = ("ddp", "fsdp2")


class Sharding(BaseModel):
    """How each rank holds the model; the numbers are per rank, in bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["ddp", "fsdp2"]
    world_size: Count = Field(ge=1)
    units: list[str] = Field(default_factory=list, description="fsdp2: the modules "
                             "fully_shard is called on before the root, in forward order")
    unit_param_bytes: list[Bytes] = Field(default_factory=list, description="fsdp2: each "
                                        "unit's all-gathered (padded) parameters")
    unit_grad_bytes: list[Bytes] = Field(default_factory=list, description="fsdp2: each "
                                       "unit's unsharded gradients")
    root_param_bytes: Bytes = Field(0, description="fsdp2: parameters in no unit")
    root_grad_bytes: Bytes = 0
    sharded_param_bytes: Bytes = Field(0, description="fsdp2: this rank's shards")
    sharded_grad_bytes: Bytes = 0
    bucket_bytes: Bytes = Field(0, description="ddp: gradient buckets")

    def extra_bytes(self) -> dict[str, int]:
        """What a rank holds beyond its shards (fsdp2) or replica (ddp), by part."""
        if self.kind == "ddp":
            return {"gradient buckets": self.bucket_bytes}
        params = sorted(self.unit_param_bytes, reverse=True)[:2]
        grads = max(self.unit_grad_bytes, default=0)
        return {
            "root parameters, all-gathered": self.root_param_bytes,
            "root gradients, unsharded and their reduce-scatter copy":
                2 * self.root_grad_bytes,
            "running and prefetched unit parameters": sum(params),
            "unit gradients, unsharded and their reduce-scatter copy": 2 * grads,
            "all-gather copy-in": -(-max(self.unit_param_bytes, default=0)
                                    // self.world_size),
        }

    def describe(self) -> str:
        """One line for plan summaries."""
        if self.kind == "ddp":
            return f"per rank of {self.world_size} (DDP)"
        return (f"per rank of {self.world_size} (FSDP2 over {len(self.units)} units and the "
                "root)")


def rank_problem(problem: Problem, static: StaticMemory, sharding: Sharding | None
                 ) -> Problem:
    """``problem`` (one process's step) as one rank of ``sharding`` runs it."""
    if sharding is None:
        return problem
    extra = sum(sharding.extra_bytes().values())
    if sharding.kind == "ddp":
        return problem.model_copy(update={"static_bytes": problem.static_bytes + extra})
    n = sharding.world_size
    optimizer = -(-static.optimizer_state_bytes // n)
    # sharded gradients are counted all step: they appear unit by unit in backward
    rank_static = (static.buffer_bytes + static.input_bytes + sharding.sharded_param_bytes
                   + sharding.sharded_grad_bytes + optimizer + extra)
    # the optimizer steps on this rank's shards: its temporaries shrink with them
    return problem.model_copy(update={"static_bytes": rank_static,
                                      "param_grad_bytes": [0] * problem.n_nodes,
                                      "optimizer_step_bytes": -(-static.optimizer_step_bytes
                                                                // n)})


def sharding_for(model: nn.Module, kind: str, world_size: int,
                 units: list[str] | None = None) -> Sharding:
    """The per-rank sizes of ``model`` under ``kind`` over ``world_size`` ranks; ``units``:
    the module paths FSDP2 shards on their own (each a submodule of the model)."""
    if kind not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {kind!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    params = dict(model.named_parameters())
    if kind == "ddp":
        return Sharding(kind="ddp", world_size=world_size, bucket_bytes=sum(
            _nbytes(p) for p in params.values() if p.requires_grad))
    units = list(units or [])
    modules = dict(model.named_modules())
    missing = [u for u in units if u not in modules or u == ""]
    if missing:
        raise ValueError(f"shard units {missing} are not submodules of "
                         f"{type(model).__name__}; name them as model.named_modules() does")
    owner: dict[str, int] = {}
    for k, unit in enumerate(units):
        for name, _ in modules[unit].named_parameters(prefix=unit):
            owner.setdefault(name, k)
    unit_params, unit_grads = [0] * len(units), [0] * len(units)
    root_params = root_grads = sharded_params = sharded_grads = 0
    for name, p in params.items():
        padded = _padded_bytes(p, world_size)
        sharded_params += padded // world_size
        grad = padded if p.requires_grad else 0
        sharded_grads += grad // world_size
        k = owner.get(name)
        if k is None:
            root_params, root_grads = root_params + padded, root_grads + grad
        else:
            unit_params[k] += padded
            unit_grads[k] += grad
    return Sharding(kind="fsdp2", world_size=world_size, units=units,
                    unit_param_bytes=unit_params, unit_grad_bytes=unit_grads,
                    root_param_bytes=root_params, root_grad_bytes=root_grads,
                    sharded_param_bytes=sharded_params, sharded_grad_bytes=sharded_grads)


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _padded_bytes(param, world_size: int) -> int:
    """FSDP2 shards dim 0 evenly, padding it up to a multiple of the world size."""
    if param.dim() == 0:
        return world_size * param.element_size()
    rows = -(-param.shape[0] // world_size) * world_size
    return rows * (param.numel() // param.shape[0] if param.shape[0] else 0) \
        * param.element_size()
