"""Activation-checkpointing planner: profile a model's graph, solve exactly, rewrite.

>>> from planner import optimize, apply, verify, Plan  # doctest: +SKIP
>>> plan = optimize(model, example_inputs, budget_gb=8)  # doctest: +SKIP
>>> fast = apply(model, plan)  # doctest: +SKIP
"""

from __future__ import annotations

from planner.api import VerifyReport, apply, measure_step, optimize, verify
from planner.plan import InfeasibleBudgetError, Plan, PlanMismatchError
from profiles.errors import CaptureError

__all__ = [
    "CaptureError",
    "InfeasibleBudgetError",
    "Plan",
    "PlanMismatchError",
    "VerifyReport",
    "apply",
    "measure_step",
    "optimize",
    "verify",
]
