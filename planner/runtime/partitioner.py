"""The min-cut partitioner's budget a compiled plan was measured under, set while it is applied.

torch.compile's partitioner decides what the untagged ops of a compiled graph keep, under
``torch._functorch.config.activation_memory_budget`` (a 0-1 fraction, 1.0 by default), read
when a graph is partitioned: at the first call of a compiled function, after ``apply``. A
plan for the compiled step (`planner.compile_fit`) measured its peak under one value of it,
and its budget holds under that value only, so ``apply`` sets it, process-wide (the
partitioner has no per-model setting: its per-region annotation,
``torch.autograd.graph.region_activation_memory_budget``, must cover every op of a graph,
and a BatchNorm's running-statistics updates fall outside any forward it wraps), and
``remove`` puts the value found back. Compile after ``apply``: a graph partitioned before
keeps the budget it was partitioned under.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch._functorch.config  # torch does not import it with torch

__all__ = ["partitioner_budget", "partitioner_budget_set", "set_partitioner_budget"]


def partitioner_budget() -> float:
    """The process's ``activation_memory_budget`` now."""
    return float(torch._functorch.config.activation_memory_budget)


def set_partitioner_budget(fraction: float) -> float:
    """Set the process's ``activation_memory_budget``; returns the value it replaced."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"activation_memory_budget is a fraction in [0, 1], got {fraction}")
    previous = partitioner_budget()
    torch._functorch.config.activation_memory_budget = fraction
    return previous


@contextlib.contextmanager
def partitioner_budget_set(fraction: float | None) -> Iterator[None]:
    """``activation_memory_budget = fraction`` while inside (None: left as it is)."""
    if fraction is None:
        yield
        return
    previous = set_partitioner_budget(fraction)
    try:
        yield
    finally:
        set_partitioner_budget(previous)
