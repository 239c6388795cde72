"""Checks of the planning functions' arguments: the budget (GiB or bytes), the host
budget for offload, the solver options (together: `SolveOptions`), the example inputs, and
the parallelism options that say how each rank runs the model."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from planner.plan import GIB, InputSpec
from planner.sharding import SHARDINGS, Sharding, fsdp2_recipe, repeated_blocks, sharding_for
from profiles.parallel import Parallelism
from solvers import SOLVERS

MIN_BUDGET_BYTES = 2**10
MAX_BUDGET_BYTES = 2**60


def _budget_bytes(budget_gb: Any) -> int:
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, numbers.Real):
        raise TypeError(f"budget_gb must be a number of GiB (2**30 bytes), got "
                        f"{type(budget_gb).__name__} {budget_gb!r}")
    if not math.isfinite(budget_gb) or budget_gb <= 0:
        raise ValueError(f"budget_gb must be a positive, finite number of GiB, got "
                         f"{budget_gb!r}")
    return _checked_budget(int(budget_gb * GIB), f"budget_gb={budget_gb!r} GiB")


def _checked_budget(nbytes: int, given: str) -> int:
    """A budget in bytes that can mean something: at least a KiB (no training step fits
    in less), at most an EiB."""
    if nbytes < MIN_BUDGET_BYTES:
        raise ValueError(f"{given} is {nbytes} bytes, less than 1 KiB: no training step fits. "
                         "budget_gb is in GiB (2**30 bytes), e.g. budget_gb=8")
    if nbytes > MAX_BUDGET_BYTES:
        raise ValueError(f"{given} is more than 2**60 bytes (1 EiB); give a budget a device "
                         "could have")
    return nbytes


def _budget_arg(budget_gb: float | None, budget_bytes: int | None) -> int:
    """Exactly one of ``budget_gb`` and ``budget_bytes``, checked, as bytes."""
    if (budget_gb is None) == (budget_bytes is None):
        raise TypeError("give budget_gb or budget_bytes")
    if budget_bytes is None:
        return _budget_bytes(budget_gb)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
    return _checked_budget(int(budget_bytes), f"budget_bytes={budget_bytes!r}")


def default_host_budget_bytes() -> int:
    """Host memory offload may take by default: half the machine's physical memory (pinned
    pages cannot be swapped out; the rest stays for the OS, data loading and the host-side
    optimizer)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * GIB
    return total // 2


@dataclass(frozen=True)
class SolveOptions:
    """How a profiled step is planned, checked once and passed whole from the API to the
    solvers: the budget, the solver and its time limit, whether saved activations may go to
    host memory and how much of it they may take (`host_budget_bytes`, bytes, used only
    with `offload`), whether op ranges of traced forwards may be checkpointed, whether
    the search is `deterministic` (the same plan on a loaded machine as on a quiet one), and
    whether a long search shows its `progress` on a terminal (not part of what is asked:
    equal options with and without it get the same remembered answer)."""

    budget_bytes: int
    solver: str = "auto"
    time_limit_s: float = 60.0
    offload: bool = False
    host_budget_bytes: int = 0
    op_ranges: bool = True
    deterministic: bool = False
    progress: bool = field(default=False, compare=False)

    def at(self, budget_bytes: int) -> SolveOptions:
        """The same options at another budget."""
        return replace(self, budget_bytes=budget_bytes)


def host_budget_arg(offload: bool, host_budget_gb: float | None) -> int | None:
    """The host budget in bytes when offloading (None: no offload), checked."""
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be True or False, got {offload!r}")
    if host_budget_gb is not None and not offload:
        raise ValueError("host_budget_gb is given but offload is False; pass offload=True to "
                         "let the plan use host memory")
    if not offload:
        return None
    if host_budget_gb is None:
        return default_host_budget_bytes()
    if isinstance(host_budget_gb, bool) or not isinstance(host_budget_gb, numbers.Real) or \
            not math.isfinite(host_budget_gb) or host_budget_gb < 0:
        raise ValueError(f"host_budget_gb must be a number of GiB (2**30 bytes), 0 or more, "
                         f"got {host_budget_gb!r}")
    if host_budget_gb * GIB > MAX_BUDGET_BYTES:
        raise ValueError(f"host_budget_gb={host_budget_gb!r} is more than 2**60 bytes (1 EiB); "
                         "give a budget a host could have")
    return int(host_budget_gb * GIB)


def _check_solver_options(solver: str, time_limit_s: float) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    if isinstance(time_limit_s, bool) or not (isinstance(time_limit_s, numbers.Real)
                                              and math.isfinite(time_limit_s)
                                              and time_limit_s > 0):
        raise ValueError(f"time_limit_s must be a positive number, got {time_limit_s!r}")


def _input_specs(args: tuple, kwargs: dict) -> list[InputSpec]:
    from planner.envelope import mask_inputs, padded

    specs: list[InputSpec] = []
    seen: dict[int, str] = {}
    masks = set(mask_inputs(args, kwargs))
    for keyword, items in ((False, enumerate(args)), (True, kwargs.items())):
        for name, value in items:
            if isinstance(value, torch.Tensor):
                key = (keyword, str(name))
                specs.append(InputSpec(name=str(name), keyword=keyword, shape=list(value.shape),
                                       dtype=str(value.dtype).removeprefix("torch."),
                                       same_as=seen.get(id(value)),
                                       padded=padded([key], args, kwargs) if key in masks
                                       else None))
                seen.setdefault(id(value), str(name))
            else:
                specs.append(InputSpec(name=str(name), keyword=keyword,
                                       value=value if _plain(value) else repr(value)))
    return specs


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _as_inputs(args: tuple, kwargs: dict) -> Any:
    if kwargs and args:
        raise ValueError("example_inputs mixes positional and keyword inputs; pass a tuple or "
                         "a dict")
    return kwargs if kwargs else args


def _parallelism(model: nn.Module, world_size: int, sharding: str | None,
                 shard_modules: list[str] | None,
                 parallelize: Callable[[nn.Module, Any], Any] | None,
                 mesh_shape: tuple[int, ...] | None, mesh_dim_names: tuple[str, ...] | None
                 ) -> tuple[Parallelism | None, Sharding | None]:
    """How each rank runs the model, from ``optimize``'s arguments: the user's parallelize
    function over its mesh (``sharding="fsdp2"`` is torchtitan's recipe as one), or DDP's
    constant, or one process."""
    if sharding is not None and sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if parallelize is not None:
        if sharding is not None:
            raise ValueError("give parallelize= or sharding=, not both: parallelize is the "
                             "wrapping itself (sharding='fsdp2' is a shorthand for one)")
        if mesh_shape is None:
            if world_size == 1:
                raise ValueError("parallelize= needs mesh_shape=(dp,) or (dp, tp): the mesh "
                                 "each rank's step runs on")
            mesh_shape = (world_size,)
        parallel = Parallelism(parallelize, mesh_shape, mesh_dim_names)
        if world_size not in (1, parallel.world_size):
            raise ValueError(f"world_size={world_size} but mesh_shape {parallel.mesh_shape} "
                             f"has {parallel.world_size} ranks")
        return parallel, None
    if mesh_shape is not None or mesh_dim_names is not None:
        raise ValueError("mesh_shape= and mesh_dim_names= go with parallelize=(model, mesh), "
                         "the function that parallelizes the model on that mesh")
    if sharding is not None and world_size == 1:
        raise ValueError(f"sharding={sharding!r} shards over world_size ranks, and world_size "
                         "is 1 (the default: one process, nothing to shard). Give world_size="
                         "the number of ranks, or leave sharding out to plan one process.")
    if world_size != 1 and sharding is None:
        raise ValueError(f"world_size={world_size!r} needs sharding='ddp' or 'fsdp2', or "
                         "parallelize=: how each rank holds the model decides its memory")
    if sharding == "fsdp2":
        units = repeated_blocks(model, shard_modules)
        return Parallelism(fsdp2_recipe(units), (world_size,)), None
    if sharding == "ddp":
        return None, sharding_for(model, world_size)
    return None, None
