"""Data-parallel shorthands: ``optimize(world_size=N, sharding="ddp" | "fsdp2")``.

``sharding="fsdp2"`` is torchtitan's recipe as a parallelize function (``fsdp2_recipe``):
``fully_shard`` each repeated block, then the root, over a 1-D mesh of ``world_size``. It
is planned like any other ``parallelize=`` (``profiles.parallel``): the rank's real FSDP2
step runs over a fake process group, and its gathered parameters, buffers and sharded
gradients are measured, not described.

``sharding="ddp"``: a rank runs the whole model on its batch, so its step is the single
process's, plus DDP's flat gradient buckets (as large as the gradients, all step, unless
``gradient_as_bucket_view=True``): a constant. DDP wraps the model in another module, which
a parallelize function cannot do in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from profiles.schema import Bytes, Count
from solvers.problem import Problem

if TYPE_CHECKING:
    from torch import nn

__all__ = ["SHARDINGS", "Sharding", "fsdp2_recipe", "rank_problem", "repeated_blocks",
           "sharding_for"]

SHARDINGS = ("ddp", "fsdp2")


class Sharding(BaseModel):
    """How each DDP rank holds the model beyond the single process; bytes per rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["ddp"]
    world_size: Count = Field(ge=1)
    bucket_bytes: Bytes = Field(0, description="gradient buckets")

    def extra_bytes(self) -> dict[str, int]:
        """What a rank holds beyond its replica, by part."""
        return {"gradient buckets": self.bucket_bytes}

    def describe(self) -> str:
        """One line for plan summaries."""
        return f"per rank of {self.world_size} (DDP)"


def rank_problem(problem: Problem, sharding: Sharding | None) -> Problem:
    """``problem`` (one process's step) as one DDP rank runs it."""
    if sharding is None:
        return problem
    extra = sum(sharding.extra_bytes().values())
    return problem.model_copy(update={"static_bytes": problem.static_bytes + extra})


def sharding_for(model: nn.Module, world_size: int) -> Sharding:
    """The per-rank extra of ``model`` under DDP over ``world_size`` ranks."""
    _check_world_size(world_size)
    return Sharding(kind="ddp", world_size=world_size, bucket_bytes=sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))


def fsdp2_recipe(units: list[str]) -> Callable[[nn.Module, Any], None]:
    """torchtitan's FSDP2 wrapping as a parallelize function: ``fully_shard`` each of
    ``units`` (module paths, in forward order), then the model, on the mesh."""

    def parallelize(model: nn.Module, mesh: Any) -> None:
        from torch.distributed.fsdp import fully_shard

        for unit in units:
            fully_shard(model.get_submodule(unit), mesh=mesh)
        fully_shard(model, mesh=mesh)

    return parallelize


def repeated_blocks(model: nn.Module, units: list[str] | None = None) -> list[str]:
    """The FSDP2 units of ``model``: ``units`` checked, or by default the entries of its
    largest ``ModuleList`` of one module type (the transformer layers)."""
    from torch import nn

    modules = dict(model.named_modules())
    if units is not None:
        missing = [u for u in units if u not in modules or u == ""]
        if missing:
            raise ValueError(f"shard units {missing} are not submodules of "
                             f"{type(model).__name__}; name them as model.named_modules() "
                             "does")
        return list(units)
    best: list[str] = []
    for path, module in modules.items():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) and \
                len({type(m) for m in module}) == 1:
            best = [f"{path}.{k}" if path else str(k) for k in range(len(module))]
    if not best:
        raise ValueError(f"{type(model).__name__} has no ModuleList of repeated blocks to "
                         "shard; pass shard_modules=[...] or your own parallelize=")
    return best


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
