"""Activation-checkpointing planner: profile a model's training step, solve exactly, and
checkpoint the model's own modules.

>>> from planner import optimize, apply, verify, Plan  # doctest: +SKIP
>>> step = profile_model(model, example_inputs)  # profile once  # doctest: +SKIP
>>> plans = [solve(step, budget_gb=b) for b in (4, 8)]  # plan many  # doctest: +SKIP
>>> plan = optimize(model, example_inputs, budget_gb=8)  # doctest: +SKIP
>>> model = apply(model, plan)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.api import (
        ProfiledStep,
        VerifyReport,
        apply,
        measure_step,
        optimize,
        profile_model,
        remove,
        replan,
        solve,
        verify,
    )
    from planner.config import PlanConfig
    from planner.envelope import Envelope
    from planner.pipeline.rank import plan_rank
    from planner.plan import (
        FileFormatError,
        InfeasibleBudgetError,
        InfeasibleRankBudgetError,
        Plan,
        PlanMismatchError,
        PlanMismatchWarning,
    )
    from planner.plan_table import PlanTable
    from planner.runtime.compile_garbage import collect_compile_garbage
    from planner.runtime.table_install import cover
    from profiles.errors import ProfileError
    from profiles.inputs import ToyBatchWarning

_LAZY = {
    "PlanMismatchWarning": "planner.plan",
    "FileFormatError": "planner.plan",
    "ToyBatchWarning": "profiles.inputs",
    "ProfiledStep": "planner.api",
    "profile_model": "planner.api",
    "solve": "planner.api",
    "VerifyReport": "planner.api",
    "apply": "planner.api",
    "measure_step": "planner.api",
    "optimize": "planner.api",
    "plan_rank": "planner.pipeline.rank",
    "remove": "planner.api",
    "replan": "planner.api",
    "verify": "planner.api",
    "InfeasibleBudgetError": "planner.plan",
    "InfeasibleRankBudgetError": "planner.plan",
    "Plan": "planner.plan",
    "PlanMismatchError": "planner.plan",
    "ProfileError": "profiles.errors",
    "Envelope": "planner.envelope",
    "PlanTable": "planner.plan_table",
    "PlanConfig": "planner.config",
    "cover": "planner.runtime.table_install",
    "collect_compile_garbage": "planner.runtime.compile_garbage",
}

__all__ = ["Envelope", "FileFormatError", "InfeasibleBudgetError",
           "InfeasibleRankBudgetError", "Plan", "PlanConfig", "PlanMismatchError",
           "PlanMismatchWarning",
           "PlanTable", "ProfileError", "ProfiledStep", "ToyBatchWarning", "VerifyReport",
           "apply", "collect_compile_garbage", "cover", "measure_step", "optimize",
           "plan_rank", "profile_model", "remove", "replan", "solve", "verify"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
