"""``optimize(..., envelope=...)``: a plan per bucket of an envelope's batches (a
:class:`~planner.plan_table.PlanTable`), each profiled at its bucket's longest batch, and
checked at its shortest.

Every profile counts the batches a trainer keeps on the device beside the step's own
(``Envelope.resident_batches``): the other ones at the envelope's longest, whatever the
step's bucket, since a loader may give them in any order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch
from torch import nn

from planner.arguments import SolveOptions
from planner.envelope import (
    Envelope,
    batch_at,
    bucket_batches,
    mask_inputs,
    other_batches_bytes,
)
from planner.plan import InfeasibleBudgetError, Plan, format_bytes
from planner.plan_table import EdgeCheck, PlanTable, TableEntry, entries_in_order
from planner.profiling import ProfiledStep, profile_model
from planner.solving import solve_profiled
from profiles.errors import LossNotFoundError, ProfileError
from profiles.inputs import normalize_inputs

log = logging.getLogger(__name__)

__all__ = ["BucketPlanner", "bucket_label", "plan_envelope"]


@dataclasses.dataclass
class BucketPlanner:
    """Plans one batch of a table as the table was planned: the same model, options and
    resident batches (what ``planner.cover`` uses for a batch outside the envelope)."""

    model: nn.Module
    options: SolveOptions
    profile_options: dict[str, Any]
    resident_extra: int  # bytes of the other resident batches
    seconds_per_bucket: float = 0.0

    def profiled(self, args: tuple, kwargs: dict, **overrides: Any) -> ProfiledStep:
        inputs = kwargs if kwargs else args
        try:
            profiled = profile_model(self.model, inputs,
                                     **{**self.profile_options, **overrides})
        except (ProfileError, RuntimeError, ValueError) as error:
            if isinstance(error, InfeasibleBudgetError | LossNotFoundError):
                raise  # not the batch's shape: said as it is
            shapes = ", ".join(f"{list(t.shape)}" for t in (*args, *kwargs.values())
                               if isinstance(t, torch.Tensor))
            raise ProfileError(
                f"the envelope's batch of {shapes} (the example tiled to a bucket's length "
                f"and rows) could not run: {type(error).__name__}: "
                f"{str(error).rstrip('.')}. An envelope plans "
                "batches made from the example: a loss_fn holding targets of the example's "
                "shape cannot take them, so put the targets in the batch (Hugging Face "
                "labels=), or plan without envelope=.") from error
        if not self.resident_extra:
            return profiled
        static = profiled.profile.static.model_copy(
            update={"resident_input_bytes": self.resident_extra})
        return dataclasses.replace(profiled, profile=profiled.profile.model_copy(
            update={"static": static}))

    def plan(self, label: str, args: tuple, kwargs: dict) -> Plan:
        started = perf_counter()
        try:
            plan = solve_profiled(self.profiled(args, kwargs), self.options)
        except InfeasibleBudgetError as error:
            raise InfeasibleBudgetError(
                f"batches {label}: {error}", error.min_budget_bytes, error.lower_bound_bytes,
                error.plan, shell_message=error.shell_message and
                f"batches {label}: {error.shell_message}") from None
        self.seconds_per_bucket = max(self.seconds_per_bucket, perf_counter() - started)
        return plan


def plan_envelope(model: nn.Module, example_inputs: Any, envelope: Envelope,
                  options: SolveOptions, profile_options: dict[str, Any]) -> PlanTable:
    """The plan table of ``envelope`` (module docstring): the longest bucket first, so a
    budget it cannot meet is said before the others are profiled."""
    if options.offload:
        raise ValueError("optimize(..., envelope=...) plans checkpointing per bucket; offload "
                         "per bucket is not planned yet: plan offload=True for one batch shape")
    args, kwargs = normalize_inputs(model, example_inputs)
    longest = batch_at(args, kwargs, envelope.max_length, envelope.batch_size,
                       True if envelope.padding and mask_inputs(args, kwargs) else None)
    planner = BucketPlanner(model, options, profile_options,
                            other_batches_bytes(envelope, *longest))
    entries = []
    for length, pad, a, k in reversed(bucket_batches(args, kwargs, envelope)):
        label = bucket_label(length, pad)
        log.info("planning the bucket of batches %s", label)
        entries.append(TableEntry(length=length, padded=pad, plan=planner.plan(label, a, k)))
    entries, checks = _checked_edges(entries_in_order(entries), envelope, planner, args,
                                     kwargs)
    table = PlanTable(envelope=envelope, masks=mask_inputs(args, kwargs), entries=entries,
                      checks=checks)
    table.__dict__["_planner"] = planner  # not saved: the model and its options
    return table


def bucket_label(length: int | None, pad: bool | None) -> str:
    tokens = "as given" if length is None else f"of {length} tokens"
    return tokens + ("" if pad is None else ", padded" if pad else ", unpadded")


def _checked_edges(entries: list[TableEntry], envelope: Envelope, planner: BucketPlanner,
                   args: tuple, kwargs: dict) -> tuple[list[TableEntry], list[EdgeCheck]]:
    """Each bucket's shortest batch replayed under its plan; where that does not hold,
    the lengths below the bucket's longest get plans of their own (`_planned_apart`)."""
    checks, extra = [], []
    below: dict[bool | None, int] = {}
    for entry in entries:
        if entry.length is None:  # no lengths: nothing between
            continue
        shortest = below.get(entry.padded, envelope.min_length - 1) + 1
        below[entry.padded] = entry.length
        if shortest >= entry.length:
            continue
        a, k = batch_at(args, kwargs, shortest, envelope.batch_size, entry.padded)
        step = planner.profiled(a, k, timing="estimate")
        peak = _replayed_peak(step, entry.plan)
        covered_by = None
        if peak is None or peak > entry.plan.budget_bytes:
            log.info("batches of %d tokens %s under the plan for %d tokens: planned apart",
                     shortest, "run other ops" if peak is None else
                     f"peak at {format_bytes(peak)}", entry.length)
            apart = _planned_apart(planner, entry, shortest, step, args, kwargs, envelope)
            extra += apart
            covered_by = apart[0].length
        checks.append(EdgeCheck(length=shortest, padded=entry.padded, bucket=entry.length,
                                peak_bytes=peak, planned_apart=covered_by is not None,
                                covered_by=covered_by))
    return entries_in_order([*entries, *extra]), checks


def _planned_apart(planner: BucketPlanner, entry: TableEntry, shortest: int,
                   step: ProfiledStep, args: tuple, kwargs: dict,
                   envelope: Envelope) -> list[TableEntry]:
    """Plans for the lengths of ``entry``'s bucket below its longest, where the bucket's
    plan does not hold at the shortest. Where the shortest runs other ops, the length just
    below the longest is planned, and where the shortest runs its ops within its plan,
    that plan covers the bucket up to there (the longest alone was the odd one out: a
    buffer as long as the envelope, sliced whole); else the shortest gets a plan too."""
    pad, longest = entry.padded, entry.length - 1
    found = []
    if longest > shortest:
        a, k = batch_at(args, kwargs, longest, envelope.batch_size, pad)
        plan = planner.plan(bucket_label(longest, pad), a, k)
        found.append(TableEntry(length=longest, padded=pad, plan=plan))
        replay = _replayed_peak(step, plan)
        if replay is not None and replay <= plan.budget_bytes:
            return found
    a, k = batch_at(args, kwargs, shortest, envelope.batch_size, pad)
    return [TableEntry(length=shortest, padded=pad,
                       plan=planner.plan(bucket_label(shortest, pad), a, k)), *found]


def _replayed_peak(step: ProfiledStep, plan: Plan) -> int | None:
    """The peak of ``plan``'s schedule on another batch's step (None: the step runs other
    ops, so the schedule does not apply to it)."""
    ops = [n.target for n in step.profile.nodes]
    if ops != [n.target for n in plan.profile.nodes] or \
            [(c.start, c.stop, c.path) for c in step.profile.module_calls] != \
            [(c.start, c.stop, c.path) for c in plan.profile.module_calls]:
        return None
    return step.peak_of(plan.schedule)


def covering(table: PlanTable, model: nn.Module, example_inputs: Any,
             progress: Callable[[str], None] | None = None) -> PlanTable:
    """``table`` with a plan for ``example_inputs``' batch as it is (its own length and
    mask branch), planned as the table's were."""
    planner: BucketPlanner | None = table.__dict__.get("_planner")
    if planner is None or planner.model is not model:
        raise ValueError("this plan table was not planned in this process for this model "
                         "(a loaded file keeps no model or options): plan the envelope again "
                         "with optimize(..., envelope=Envelope(max_length=...)) covering "
                         "this batch")
    args, kwargs = normalize_inputs(model, example_inputs)
    from planner.envelope import padded, sequence_length

    length = sequence_length(args, kwargs) if table.envelope.max_length else None
    pad = padded(table.masks, args, kwargs) if table.masks else None
    label = bucket_label(length, pad)
    if progress:
        progress(label)
    entry = TableEntry(length=length, padded=pad, plan=planner.plan(label, args, kwargs))
    update = {"entries": entries_in_order([*table.entries, entry])}
    covered = table.model_copy(update=update)
    covered.__dict__["_planner"] = planner
    return covered
