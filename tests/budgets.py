"""Budgets the trainer tests plan at: halfway into a step's activations."""

from __future__ import annotations

from planner import InfeasibleBudgetError, Plan, replan

GIB = 2**30


def halfway_budget_gb(first: Plan) -> float:
    """Static memory plus half the activations of ``first``'s step (a plan made at a
    budget that needs no checkpoint), or 2 % over the least budget a plan meets when that
    is more, in GiB."""
    static = first.profile.static.total_bytes
    half = static + (first.unplanned_peak_bytes - static) // 2
    try:
        return replan(first, budget_bytes=half, time_limit_s=10).budget_bytes / GIB
    except InfeasibleBudgetError as error:
        return 1.02 * error.min_budget_gb
