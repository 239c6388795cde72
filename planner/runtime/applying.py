"""`apply`: a plan, or a table of plans, installed on the model's own modules. Above both
installers (`planner.runtime.install` for one plan, `planner.runtime.table_install` for a
table, which is built on the first), so that neither imports the other back."""

from __future__ import annotations

from torch import nn

from planner.plan import Plan
from planner.plan_table import PlanTable
from planner.runtime.install import apply_plan
from planner.runtime.table_install import apply_table

__all__ = ["apply"]


def apply(model: nn.Module, plan: Plan | PlanTable, *, strict: bool = False) -> nn.Module:
    """Checkpoint ``model``'s own modules as ``plan`` says, and return ``model``.

    The model keeps its class, module tree, parameters and ``state_dict``; compose it with
    autocast, FSDP2 (``fully_shard`` its blocks after this), DDP and ``torch.compile`` as
    usual. A guard (:class:`planner.runtime.guard.PlanGuard`) warns (``strict``: raises
    ``PlanMismatchError``) when a training step is not the one planned: larger inputs,
    other input dtypes or values, another autocast dtype, a changed model.
    :func:`remove` undoes it. A :class:`~planner.plan_table.PlanTable` installs its plans
    together; each step takes its bucket's (:mod:`planner.runtime.table_install`).

    A refused plan changes nothing: every check runs, and every traced forward is traced,
    before the plan already on the model (if any) is taken off.

    Raises:
        PlanMismatchError: the model's module tree or parameter shapes differ from the
            planned model's, or the plan names modules or ranges the model lacks.
    """
    if isinstance(plan, PlanTable):
        return apply_table(model, plan, strict=strict)
    return apply_plan(model, plan, strict=strict)
