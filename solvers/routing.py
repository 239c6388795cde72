"""The worst routing: a bound on a schedule's peak over every way a router can send tokens.

An MoE layer that loops over its experts (Hugging Face's ``experts_implementation="eager"``)
runs, for expert ``e``, ops on the ``c_e`` tokens routed to it. With every expert hit, the
op stream is the same for every routing and each tensor's size is affine in one expert's
count, so under a fixed schedule each event's peak is affine in the counts::

    peak_t(c) = peak_t(c0) + sum_e g_te * (c_e - c0_e)

A router sends each of ``T`` tokens to ``k`` distinct experts of ``E``: ``sum_e c_e = k T``
and ``0 <= c_e <= T``. The maximum of a linear function over that set puts ``T`` tokens on
the ``k`` experts of largest ``g_te``: the bound per event, and the schedule's worst peak
is the largest. The marginals ``g`` come from replaying the schedule on profiles of forced
routings that move ``step`` tokens from expert 0 to each other expert (`RoutingSpread`).

Every layer's router chooses on its own. The directions move the same tokens in every MoE
layer at once; that is exact where at each event at most one layer's loop is partly done:
the other layers hold all of their experts' saved tensors or none, and experts of equal
shapes save the same bytes per token, so moving tokens between them changes nothing there.
A routing that leaves an expert without tokens skips that expert's ops: it allocates the
same or less (the bound takes ``c_e = 0`` as an expert run on no tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from solvers.problem import Problem
from solvers.schedule import Schedule
from solvers.simulate import Timeline, simulate

__all__ = ["BYTE_FIELDS", "ProblemShift", "RoutingError", "RoutingSpread", "WorstRouting",
           "problem_shift", "routed_problem", "shifted", "worst_routing"]

# the problem's fields in bytes: what a routing changes (times are left as profiled)
BYTE_FIELDS = ("fwd_temp_bytes", "bwd_temp_bytes", "storage_bytes", "storage_grad_bytes",
               "param_grad_bytes", "fwd_runtime_bytes")
_OBSERVED = ("before", "peak", "after", "unpack", "held")
_TIMES = ("fwd_time_ms", "bwd_time_ms")


class RoutingError(ValueError):
    """Two forced routings ran other steps: no affine bound (an expert left without tokens,
    or ops that change with the counts in other ways)."""


class ProblemShift(BaseModel):
    """What moving tokens between experts changes in a problem: per byte field, the entries
    that change and by how much (``observed_backward.peak`` for that nested field)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    changes: dict[str, dict[int, int]] = Field(default_factory=dict)


class RoutingSpread(BaseModel):
    """How a step's memory follows its routing: the counts it was profiled at (every MoE
    layer alike) and, for each expert ``d >= 1``, the problem's change when ``step`` tokens
    go to ``d`` instead of expert 0."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tokens: int = Field(gt=0, description="tokens each routed layer sends (T)")
    top_k: int = Field(gt=0, description="experts each token goes to (k)")
    experts: int = Field(gt=1, description="experts of a layer (E)")
    base_counts: list[int] = Field(description="tokens per expert in the profiled step")
    step: int = Field(gt=0, description="tokens each direction moves")
    shifts: list[ProblemShift] = Field(description="one per expert 1..E-1")
    layers: int = Field(1, ge=1, description="routed layers in the step")


def _byte_lists(problem: Problem) -> dict[str, list[int]]:
    lists = {name: getattr(problem, name) for name in BYTE_FIELDS
             if getattr(problem, name) is not None}
    observed = problem.observed_backward
    if observed is not None:
        lists.update({f"observed_backward.{name}": getattr(observed, name)
                      for name in _OBSERVED if getattr(observed, name) is not None})
    return lists


def _structure(problem: Problem) -> dict:
    excluded = {*BYTE_FIELDS, *_TIMES, "observed_backward", "static_bytes", "name"}
    return problem.model_dump(exclude=excluded)


def problem_shift(base: Problem, moved: Problem) -> ProblemShift:
    """``moved`` less ``base`` in bytes; both must be the same step otherwise.

    Raises:
        RoutingError: the two are not the same step (another op stream, other statics).
    """
    if _structure(base) != _structure(moved) or base.static_bytes != moved.static_bytes:
        raise RoutingError(f"{base.name}: the step at another routing runs other ops or "
                           "holds other static memory")
    changes: dict[str, dict[int, int]] = {}
    before, after = _byte_lists(base), _byte_lists(moved)
    if before.keys() != after.keys():
        raise RoutingError(f"{base.name}: the step at another routing records other fields")
    for name, values in before.items():
        diff = np.asarray(after[name], dtype=np.int64) - np.asarray(values, dtype=np.int64)
        where = np.flatnonzero(diff)
        if where.size:
            changes[name] = {int(i): int(diff[i]) for i in where}
    return ProblemShift(changes=changes)


def shifted(problem: Problem, *shifts: tuple[ProblemShift, float]) -> Problem:
    """``problem`` with each ``(shift, times)``'s changes, ``times`` over, added to its byte
    fields (rounded to bytes, never below zero)."""
    totals: dict[str, dict[int, float]] = {}
    for shift, times in shifts:
        for name, changes in shift.changes.items():
            into = totals.setdefault(name, {})
            for i, delta in changes.items():
                into[i] = into.get(i, 0.0) + times * delta
    update: dict[str, object] = {}
    observed: dict[str, list[int]] = {}
    for name, changes in totals.items():
        owner, _, field = name.partition(".")
        values = list(getattr(problem.observed_backward, field) if field
                      else getattr(problem, owner))
        for i, delta in changes.items():
            values[i] = max(0, values[i] + round(delta))
        if field:
            observed[field] = values
        else:
            update[name] = values
    if observed:
        update["observed_backward"] = problem.observed_backward.model_copy(update=observed)
    return problem.model_copy(update=update)


def routed_problem(problem: Problem, spread: RoutingSpread, counts: list[int]) -> Problem:
    """``problem`` (profiled at ``spread.base_counts``) as every routed layer runs at
    ``counts`` tokens per expert: the affine model of the module docstring."""
    return shifted(problem, *[(shift, (counts[d] - spread.base_counts[d]) / spread.step)
                              for d, shift in enumerate(spread.shifts, start=1)])


@dataclass(frozen=True)
class WorstRouting:
    """A schedule's peak at the worst routing, where it happens, and the routing: the
    experts that take all ``T`` tokens at that event (the others none)."""

    peak_bytes: int
    profiled_peak_bytes: int  # at the profiled counts
    event: int
    label: str
    counts: tuple[int, ...]


def worst_routing(problem: Problem, spread: RoutingSpread, schedule: Schedule,
                  base: Timeline | None = None) -> WorstRouting:
    """The bound of the module docstring for ``schedule`` on ``problem`` (at the profiled
    counts; ``base``: its replay, when made already); the directions replay the same
    schedule, event for event.

    Raises:
        RoutingError: a direction's replay has other events (not the same step).
    """
    base = base or simulate(problem, schedule)
    peaks = np.array([e.peak_bytes for e in base.events], dtype=np.float64)
    gains = np.zeros((len(peaks), spread.experts))
    for d, shift in enumerate(spread.shifts, start=1):
        moved = simulate(shifted(problem, (shift, 1)), schedule)
        if len(moved.events) != len(base.events):
            raise RoutingError(f"{problem.name}: another routing replays other events")
        gains[:, d] = (np.array([e.peak_bytes for e in moved.events]) - peaks) / spread.step
    top = np.argsort(-gains, axis=1, kind="stable")[:, :spread.top_k]
    extra = (np.take_along_axis(gains, top, axis=1).sum(axis=1) * spread.tokens
             - gains @ np.asarray(spread.base_counts, dtype=np.float64))
    worst = peaks + np.maximum(extra, 0.0)  # the profiled routing is one of them
    event = int(np.argmax(worst))
    counts = [0] * spread.experts
    for e in top[event]:
        counts[int(e)] = spread.tokens
    if extra[event] <= 0:
        counts = list(spread.base_counts)
    peak = max(int(np.ceil(worst[event] - 1e-6)), base.peak_bytes)
    return WorstRouting(peak, base.peak_bytes, event, base.events[event].label, tuple(counts))
