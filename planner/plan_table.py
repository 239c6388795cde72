"""A table of plans over an envelope of batches (:class:`PlanTable`): one plan per bucket of
lengths and mask branch, each made at its bucket's longest batch, and the one a step takes.

A step takes the first entry, in ascending length, whose planned input shapes bound the
step's (every dim at most the planned one) and whose mask branch is the step's (a mask
holding a zero is the padded branch). Memory is checked where a bucket's plan meets other
lengths than its own: each bucket's shortest batch is profiled and replayed under the
bucket's plan (:class:`EdgeCheck`); where it does not hold (memory that grows as the
length shrinks, a kernel chosen by size) that length got a plan of its own.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from planner.envelope import Envelope, InputKey, padded
from planner.plan import (
    PLAN_SCHEMA_VERSION,
    Plan,
    format_bytes,
    log_summary,
    read_checked,
)
from profiles.schema import Bytes, write_atomic

__all__ = ["EdgeCheck", "PlanTable", "TableEntry"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TableEntry(_Strict):
    """The plan of one bucket: batches of up to ``length`` tokens per row, in the mask
    branch ``padded`` (None: the batch has no mask)."""

    length: PositiveInt | None = Field(description="None: the envelope has no lengths")
    padded: bool | None
    plan: Plan

    @property
    def label(self) -> str:
        branch = "" if self.padded is None else ", padded" if self.padded else ", unpadded"
        tokens = "every batch" if self.length is None else f"<= {self.length} tokens"
        return f"{tokens}{branch}"


class EdgeCheck(_Strict):
    """A bucket's shortest batch replayed under the bucket's plan: its peak (None where it
    runs other ops than the plan's batch), and what was done about it."""

    length: PositiveInt
    padded: bool | None
    bucket: PositiveInt
    peak_bytes: Bytes | None
    planned_apart: bool = Field(False, description="the bucket's plan did not hold there: "
                                "other plans cover the lengths below its longest")
    covered_by: PositiveInt | None = Field(None, description="the length of the plan that "
                                           "covers it now (with planned_apart)")


class PlanTable(_Strict):
    """Plans for every batch ``envelope`` covers (module docstring). ``apply(model, table)``
    installs them together; ``entries[k].plan`` is an ordinary :class:`Plan`."""

    schema_version: int = PLAN_SCHEMA_VERSION
    envelope: Envelope
    masks: list[InputKey] = Field(description="the attention masks whose zeros choose the "
                                  "padded branch")
    entries: list[TableEntry]
    checks: list[EdgeCheck] = []

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> PlanTable:
        """A copy; the shapes it derives from its entries are derived again."""
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("_shapes_by_names", None)
        return copied

    @property
    def model_name(self) -> str:
        return self.entries[-1].plan.model_name

    @property
    def budget_bytes(self) -> int:
        return self.entries[-1].plan.budget_bytes

    @property
    def plans(self) -> list[Plan]:
        return [entry.plan for entry in self.entries]

    def check(self) -> None:
        """Every entry's plan holds together and is made for the same model and budget."""
        if not self.entries:
            raise ValueError("a plan table needs at least one entry")
        for entry in self.entries:
            entry.plan.check()
        fingerprints = {e.plan.structure_fingerprint for e in self.entries}
        budgets = {e.plan.budget_bytes for e in self.entries}
        if len(fingerprints) > 1 or len(budgets) > 1:
            raise ValueError("the table's plans are for other models or budgets "
                             f"({sorted(fingerprints)}, {sorted(budgets)}): an edited table")

    def select(self, args: tuple, kwargs: dict, names: list[str]) -> int | None:
        """The entry a step with these inputs takes (None: outside the envelope).
        ``names``: the forward's positional argument names, to match inputs planned by
        keyword and given by position or the other way round."""
        given = [(name, tuple(value.shape)) for name, value in
                 _by_name(args, kwargs, names).items() if isinstance(value, torch.Tensor)]
        branch = self.select_branch(args, kwargs)
        for index, (entry, planned) in enumerate(zip(self.entries, self._shapes(names),
                                                     strict=True)):
            if entry.padded is not None and entry.padded != branch:
                continue
            if all(_within(shape, planned.get(name)) for name, shape in given):
                return index
        return None

    def _shapes(self, names: list[str]) -> list[dict[str, tuple[int, ...]]]:
        """Each entry's planned tensor shapes by argument name (made once per ``names``)."""
        cache = self.__dict__.setdefault("_shapes_by_names", {})
        key = tuple(names)
        if key not in cache:
            cache[key] = [{_name(s.name, s.keyword, names): tuple(s.shape)
                           for s in entry.plan.inputs if s.shape is not None}
                          for entry in self.entries]
        return cache[key]

    def describe(self) -> str:
        """The batches the table covers, in words."""
        return self.envelope.describe(masks=bool(self.masks))

    def select_branch(self, args: tuple, kwargs: dict) -> bool | None:
        """The step's mask branch: whether a mask holds a zero (None: no masks)."""
        return padded(self.masks, args, kwargs) if self.masks else None

    def describe_inputs(self, args: tuple, kwargs: dict, names: list[str]) -> str:
        given = _by_name(args, kwargs, names)
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in given.items()
                           if isinstance(v, torch.Tensor))
        branch = " (padded)" if self.masks and padded(self.masks, args, kwargs) else ""
        return shapes + branch

    def summary(self) -> str:
        lines = [f"Plans for {self.model_name} over {self.describe()}: "
                 f"{len(self.entries)} plans, budget {format_bytes(self.budget_bytes)}",
                 f"  {'bucket':<28} {'predicted peak':>15} {'recompute':>11} {'regions':>8}"]
        for entry in self.entries:
            plan = entry.plan
            regions = len(plan.schedule.recompute_regions())
            lines.append(f"  {entry.label:<28} {format_bytes(plan.predicted_peak_bytes):>15} "
                         f"{plan.recompute_ms:>8.2f} ms {regions:>8}")
        lines.extend(f"  {line}" for line in self._check_lines())
        resident = self.entries[-1].plan.profile.static.resident_input_bytes
        if resident:
            lines.append(f"  every plan counts {format_bytes(resident)} of the other "
                         f"{self.envelope.resident_batches - 1} resident batches (at the "
                         "longest)")
        lines.append("  a step outside the envelope warns (strict: raises); "
                     "planner.cover(model, batch) plans its bucket")
        return "\n".join(lines)

    def _check_lines(self) -> list[str]:
        if not self.checks:
            return []
        apart = [c for c in self.checks if c.planned_apart]
        held = len(self.checks) - len(apart)
        lines = [f"checked at each bucket's shortest batch: {held} of {len(self.checks)} "
                 "within the bucket's plan"]
        lines += [f"  {c.length} tokens ({_replayed(c)} under the <= {c.bucket} plan): "
                  + (f"covered by a plan at {c.covered_by}" if c.covered_by != c.length
                     else "planned apart") for c in apart]
        return lines

    def log_summary(self, logger: logging.Logger) -> None:
        """:meth:`summary` at INFO, never an error (as :meth:`Plan.log_summary`)."""
        log_summary(self, logger)

    def __getstate__(self) -> dict[Any, Any]:
        """Pickled (sent to other ranks) without the model it was planned on."""
        state = super().__getstate__()
        state["__dict__"] = {k: v for k, v in state["__dict__"].items()
                             if k not in ("_planner", "_shapes_by_names")}
        return state

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(e.label)}</td>"
            f"<td>{format_bytes(e.plan.predicted_peak_bytes)}</td>"
            f"<td>{e.plan.recompute_ms:.2f} ms</td>"
            f"<td>{len(e.plan.schedule.recompute_regions())}</td></tr>" for e in self.entries)
        return (f"<div><b>Plans for {html.escape(self.model_name)}</b> over "
                f"{html.escape(self.describe())}, budget "
                f"{format_bytes(self.budget_bytes)}<table><tr><th>bucket</th>"
                "<th>predicted peak</th><th>recompute</th><th>regions</th></tr>"
                f"{rows}</table></div>")

    def save(self, path: str | Path) -> None:
        write_atomic(path, self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> PlanTable:
        """Read a plan table, checked as ``Plan.load`` checks a plan."""
        return read_checked(cls, path, "plan table")


def _replayed(check: EdgeCheck) -> str:
    return "other ops" if check.peak_bytes is None else format_bytes(check.peak_bytes)


def _by_name(args: tuple, kwargs: dict, names: list[str]) -> dict[str, Any]:
    """The inputs by argument name (a position where the forward has no name for it)."""
    named = {(names[k] if k < len(names) else str(k)): v for k, v in enumerate(args)}
    named.update(kwargs)
    return named


def _name(name: str, keyword: bool, names: list[str]) -> str:
    return names[int(name)] if not keyword and int(name) < len(names) else name


def _within(shape: tuple[int, ...], planned: tuple[int, ...] | None) -> bool:
    """A tensor of ``shape`` is no larger, in any dim, than the ``planned`` one (an input
    the plan never saw is for the plan's guard to say)."""
    return planned is None or (len(shape) == len(planned) and
                               all(a <= b for a, b in zip(shape, planned, strict=True)))


def entries_in_order(entries: Iterable[TableEntry]) -> list[TableEntry]:
    """Ascending length, the unpadded branch first."""
    return sorted(entries, key=lambda e: (e.length or 0, e.padded is True))
