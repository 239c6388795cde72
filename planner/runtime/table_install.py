"""A plan table on the model: every entry's checkpoints prepared (traced forwards traced
once per entry and kept), one entry installed at a time, and a forward pre-hook
(:class:`TableGuard`) that takes each training step's entry from its inputs' shapes and
mask branch, swaps the installed checkpoints when the entry changes, and runs that entry's
guard. A step outside the envelope warns (``strict``: raises) naming its shape and the
envelope, and runs under the longest entry of its branch."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from planner.model_state import _model_device
from planner.plan import PlanMismatchError, PlanMismatchWarning, format_bytes
from planner.plan_table import PlanTable
from planner.runtime.emit import Installation, checkpointed_modules, remove_checkpoints
from planner.runtime.guard import PlanGuard, _argument_names
from planner.runtime.install import prepared, remove, use_cache_off

__all__ = ["TableGuard", "apply_table", "cover"]


class TableGuard(PlanGuard):
    """The plan table's forward pre-hook (module docstring). A :class:`PlanGuard` to
    ``remove`` and ``apply``: taken off and put back like one."""

    def __init__(self, table: PlanTable, model: nn.Module,
                 entries: list[tuple[Installation, PlanGuard]], strict: bool,
                 restore_use_cache: list[Any]) -> None:
        self.table = table
        self.entries = entries
        self.current = len(entries) - 1  # installed by apply_table
        self.strict = strict
        self.restore_use_cache = restore_use_cache
        self.names = _argument_names(model)
        self.model_name = table.model_name
        self.budget = format_bytes(table.budget_bytes)
        self.switches = 0  # how often a step took another entry than the step before
        self._told: set[str] = set()

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        index = self.table.select(args, kwargs, self.names)
        outside = index is None
        if outside:
            self._outside(args, kwargs)
            index = self._longest(args, kwargs)
        if index != self.current:
            self._switch(module, index)
        # outside, the shapes were said above; the entry's other checks still run
        self.entries[index][1].check(module, args, kwargs, inputs=not outside)

    def _switch(self, module: nn.Module, index: int) -> None:
        """Take the installed entry's checkpoints off, and put ``index``'s on."""
        remove_checkpoints(module)
        self.entries[index][0].install()
        self.current = index
        self.switches += 1

    def _longest(self, args: tuple, kwargs: dict) -> int:
        """The longest entry of the step's mask branch (the longest entry without one)."""
        branch = self.table.select_branch(args, kwargs)
        same = [k for k, e in enumerate(self.table.entries)
                if e.padded is None or e.padded == branch]
        return same[-1] if same else len(self.table.entries) - 1

    def _outside(self, args: tuple, kwargs: dict) -> None:
        message = (f"{self.model_name} runs a batch outside its plans' envelope: "
                   f"{self.table.describe_inputs(args, kwargs, self.names)}, planned for "
                   f"{self.table.describe()}. It runs under the plan for the longest "
                   f"batches, whose {self.budget} budget does not hold for it. Plan this "
                   "batch's bucket with planner.cover(model, batch)"
                   + self._cost() + ", or plan a wider envelope.")
        if self.strict:
            raise PlanMismatchError(message)
        if "outside" not in self._told:
            self._told.add("outside")
            warnings.warn(message, PlanMismatchWarning, stacklevel=6)

    def _cost(self) -> str:
        planner = self.table.__dict__.get("_planner")
        seconds = getattr(planner, "seconds_per_bucket", 0.0)
        return f" (about {seconds:.2g} s: a bucket took that long to plan here)" if seconds \
            else ""


def apply_table(model: nn.Module, table: PlanTable, *, strict: bool = False) -> nn.Module:
    """Install ``table``'s plans on ``model`` (module docstring); the longest entry's
    checkpoints stand until the first step chooses. Refused, changing nothing, as
    ``apply`` refuses any of its plans."""
    try:
        table.check()
    except ValueError as error:
        raise PlanMismatchError(f"this plan table of {table.model_name} does not hold "
                                f"together: {error}") from None
    if any(entry.plan.schedule.offloads for entry in table.entries):
        raise PlanMismatchError("a plan table installs checkpoints only; an entry offloads "
                                "(an edited table?). Plan it with optimize(..., envelope=...)")
    installations = [prepared(model, entry.plan, strict) for entry in table.entries]
    remove(model)
    device = _model_device(model).type
    configs = use_cache_off(model)
    entries = []
    for entry, installation in zip(table.entries, installations, strict=True):
        installation.install()
        entries.append((installation, PlanGuard(entry.plan, model, device, strict, configs,
                                                checkpointed_modules(model))))
        remove_checkpoints(model)
    installations[-1].install()
    guard = TableGuard(table, model, entries, strict, configs)
    model.register_forward_pre_hook(guard, with_kwargs=True, prepend=True)
    return model


def installed_table(model: nn.Module) -> TableGuard | None:
    return next((hook for hook in model._forward_pre_hooks.values()
                 if isinstance(hook, TableGuard)), None)


def cover(model: nn.Module, batch: Any) -> PlanTable:
    """Plan the bucket of ``batch`` (its length and mask branch, as it is) with the options
    the installed table was planned with, install the table with it, and return it."""
    from planner.bucket_planning import covering

    guard = installed_table(model)
    if guard is None:
        raise ValueError("cover() extends the plan table installed on this model; it has "
                         "none: apply(model, optimize(..., envelope=...)) first")
    table = covering(guard.table, model, batch)
    apply_table(model, table, strict=guard.strict)
    return table
