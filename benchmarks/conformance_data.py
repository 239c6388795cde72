"""The "data" workflow of the workflow conformance: each case trained on batches as a loader
gives them, planned with ``optimize(..., envelope=...)``.

A case with token ids (integer ``[rows, tokens]`` inputs) gets an attention mask where its
forward takes one, and is planned for an envelope of lengths from a quarter of its example's
up to it, in two buckets, padded or not, two batches resident. Its stream: two steps of two
micro-batches each (gradients accumulate), of lengths L, L/2 + 1 (half a row padded),
3L/4 (padded) and L/4, with a string of metadata (``sample_source=...``) where the forward
takes ``**kwargs`` and runs with it. A case without token ids is planned for two resident
batches and trained on two steps of two copies of its batch. Each step's peak is measured
with every batch it holds counted; it holds when within the budget, and losses and
gradients are bit-identical to the unplanned model on the same stream. A step over the
budget with no warning is SILENT.

Budgets: static + 30, 50 and 80 % of the activations of the envelope's worst batch (a
budget found infeasible is replaced by the minimum the error names).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from conformance_harness import Row, cache_off

import profiles
from planner import (
    InfeasibleBudgetError,
    PlanMismatchWarning,
    PlanTable,
    apply,
    optimize,
    remove,
)
from planner.envelope import Envelope, batch_at, mask_inputs, sequence_length
from planner.measure import PeakTracker
from planner.plan import GIB
from planner.runtime.emit import OpStreamWarning

RESIDENT = 2
META = "sample_source"  # metadata a batch carries beside its tensors

Batch = tuple[tuple, dict]


@dataclass
class Stream:
    """What the loader gives: the example optimize plans on, the envelope it covers, and
    each step's micro-batches."""

    example: Batch
    envelope: Envelope
    steps: list[list[Batch]]


def _takes(model: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False
    if name == "**":
        return any(p.kind is p.VAR_KEYWORD for p in params.values())
    return name in params


def _padded(batch: Batch, rows_padded: bool) -> Batch:
    args, kwargs = batch
    masks = mask_inputs(args, kwargs)
    if not rows_padded or not masks:
        return batch
    kwargs = dict(kwargs)
    for _, name in masks:
        mask = kwargs[name].clone()
        mask[0, mask.shape[1] // 2:] = 0  # half the first row is padding
        kwargs[name] = mask
    return args, kwargs


def stream_of(model: torch.nn.Module, args: tuple, kwargs: dict,
              metadata: bool = True) -> Stream:
    """The stream of a case (module docstring); ``metadata``: a string beside the tensors
    where the forward takes ``**kwargs``."""
    length = sequence_length(args, kwargs)
    if length is None or length < 8:
        copies = [(tuple(_copy(a) for a in args), {k: _copy(v) for k, v in kwargs.items()})
                  for _ in range(2 * RESIDENT)]
        return Stream((args, kwargs), Envelope(resident_batches=RESIDENT),
                      [copies[:RESIDENT], copies[RESIDENT:]])
    if kwargs and _takes(model, "attention_mask") and "attention_mask" not in kwargs:
        ids = next(v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.dim() >= 2)
        kwargs = {**kwargs, "attention_mask": torch.ones(ids.shape[:2], dtype=torch.long)}
    envelope = Envelope(max_length=length, min_length=length // 4,
                        buckets=(length // 2, length), resident_batches=RESIDENT)
    shapes = [(length, False), (length // 2 + 1, True), (3 * length // 4, True),
              (length // 4, False)]
    batches = [_padded(batch_at(args, kwargs, n, None, None), pad) for n, pad in shapes]
    if metadata and kwargs and _takes(model, "**"):
        batches = [(a, {**k, META: f"doc{i}"}) for i, (a, k) in enumerate(batches)]
        kwargs = {**kwargs, META: "doc"}
    return Stream((args, kwargs), envelope, [batches[:RESIDENT], batches[RESIDENT:]])


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _tensors(batches: list[Batch]) -> list[torch.Tensor]:
    return [t for args, kwargs in batches for t in (*args, *kwargs.values())
            if isinstance(t, torch.Tensor)]


@dataclass
class StreamRun:
    """One pass over the stream: each step's peak, and what must match the reference."""

    peaks: list[int]
    losses: list[float]
    grads: dict[str, torch.Tensor]
    warned: list[str]


def train_stream(run: Any, stream: Stream, table: PlanTable | None) -> StreamRun:
    """The stream from ``run.state`` (the unplanned model when ``table`` is None)."""
    model, zm = run.zm.model, run.zm
    model.load_state_dict(run.state)
    model.zero_grad(set_to_none=True)
    if table is not None:
        apply(model, table)
    loss_fn = zm.loss_fn or profiles.default_loss
    peaks, losses = [], []
    torch.manual_seed(0)
    try:
        with cache_off(model), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batches in stream.steps:
                static = [*model.parameters(), *model.buffers(), *_tensors(batches)]
                with PeakTracker(static) as tracker:
                    for args, kwargs in batches:
                        loss = loss_fn(model(*args, **kwargs))
                        loss.backward()
                        losses.append(loss.item())
                        del loss
                peaks.append(tracker.peak_bytes)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        warned = [str(w.message)[:160] for w in caught
                  if issubclass(w.category, PlanMismatchWarning | OpStreamWarning)]
        return StreamRun(peaks, losses, grads, warned)
    finally:
        remove(model)
        model.zero_grad(set_to_none=True)
        model.load_state_dict(run.state)


def _planned(run: Any, stream: Stream, budget: int) -> tuple[PlanTable, int]:
    options = dict(loss_fn=run.zm.loss_fn, timing="estimate", progress=False,
                   grad_accumulation=True, time_limit_s=run.time_limit_s,
                   envelope=stream.envelope)
    example = stream.example[1] or stream.example[0]
    try:
        return optimize(run.zm.model, example, budget_gb=budget / GIB, **options), budget
    except InfeasibleBudgetError as error:
        return optimize(run.zm.model, example, budget_gb=error.min_budget_gb,
                        **options), error.min_budget_bytes


def _budgets(run: Any, stream: Stream) -> dict[str, int]:
    """Static + each fraction of the activations of the envelope's worst batch."""
    top, _ = _planned(run, stream, 1000 * GIB)
    worst = max(top.plans, key=lambda p: p.unplanned_peak_bytes)
    static = worst.profile.static.total_bytes
    return {f"{100 * f:.0f} %": int(static + f * (worst.unplanned_peak_bytes - static))
            for f in run.fractions}


def check_data(run: Any) -> list[Row]:
    """The data workflow of one case: a Row per budget."""
    stream = stream_of(run.zm.model, run.args, run.kwargs)
    try:
        reference = train_stream(run, stream, None)
    except TypeError:  # a forward whose **kwargs go where no metadata may (a loss's)
        stream = stream_of(run.zm.model, run.args, run.kwargs, metadata=False)
        reference = train_stream(run, stream, None)
    rows = []
    for label, budget in _budgets(run, stream).items():
        table, planned_at = _planned(run, stream, budget)
        row = Row(run.case.name, run.case.family, label, workflow="data",
                  budget_bytes=planned_at,
                  predicted_bytes=max(p.predicted_peak_bytes for p in table.plans),
                  unplanned_bytes=max(p.unplanned_peak_bytes for p in table.plans),
                  regions=sum(len(p.schedule.recompute_regions()) for p in table.plans),
                  solver=f"{len(table.entries)} plans")
        if planned_at != budget:
            row.note = "infeasible; planned at the named minimum"
        try:
            got = train_stream(run, stream, table)
        except Exception as error:
            row.failures.append(f"training crashed: {type(error).__name__}: {error}")
            row.outcome = "FAILED"
            rows.append(row)
            continue
        _judge(row, got, reference, stream)
        rows.append(row)
    return rows


def _judge(row: Row, got: StreamRun, reference: StreamRun, stream: Stream) -> None:
    """Within the budget at every step (over it without a warning: SILENT), losses and
    gradients as the unplanned model's; the error is the worst step's against the
    table's highest prediction (a bound over the envelope, not one step's exact peak)."""
    row.measured_bytes = max(got.peaks)
    row.error_pct = 100 * (row.predicted_bytes - row.measured_bytes) / row.measured_bytes
    row.losses_equal = got.losses == reference.losses
    row.grads_equal = got.grads.keys() == reference.grads.keys() and all(
        torch.equal(got.grads[k], reference.grads[k]) for k in got.grads)
    row.buffers_equal = True
    over = [p for p in got.peaks if p > row.budget_bytes]
    if over:
        row.failures.append(("SILENT: " if not got.warned else "") +
                            f"{len(over)} of {len(got.peaks)} steps over the budget")
    if not (row.losses_equal and row.grads_equal):
        row.failures.append("losses or gradients differ from the unplanned model's")
    note = f"{len(stream.steps)} steps x {RESIDENT} batches, " + (
        f"lengths {stream.envelope.min_length}-{stream.envelope.max_length}"
        if stream.envelope.max_length else "rows as given")
    row.note = "; ".join(filter(None, [row.note, note, *got.warned[:1]]))
    row.outcome = "ok" if row.ok else "FAILED"
