"""Module-span views of a `Problem`: which node ranges are module calls (or op ranges of
traced forwards), hence may be checkpoint regions, and what a checkpoint of a range holds.
`Problem` exposes each as a method of the same name.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from solvers.problem import ModuleSpan, Problem

__all__ = ["calls_in_order", "emittable", "is_call", "region_inputs", "span", "span_table",
           "spans_within"]


def span_table(problem: Problem) -> dict[tuple[int, int], ModuleSpan]:
    """The module spans by `(start, stop)`."""
    return {(span.start, span.stop): span for span in problem.module_spans or ()}


def emittable(problem: Problem, start: int, stop: int) -> bool:
    """Whether `[start, stop)` can be a RECOMPUTE region (any, without module spans)."""
    return problem.module_spans is None or (start, stop) in problem.span_table


def calls_in_order(problem: Problem) -> tuple[list[int], list[ModuleSpan]]:
    """The module-call spans sorted by start, the longest first at each, and their starts
    (`spans_within` bisects them: the DP asks for every window's)."""
    calls = sorted((sp for sp in problem.module_spans or () if sp.kind == "call"),
                   key=lambda sp: (sp.start, -sp.stop))
    return [sp.start for sp in calls], calls


def spans_within(problem: Problem, start: int, stop: int) -> list[ModuleSpan]:
    """The largest module spans strictly inside `[start, stop)`, in order: the module
    calls one level below it (or the top ones of a stretch of nodes)."""
    out: list[ModuleSpan] = []
    starts, calls = problem.calls_in_order
    k, end = bisect.bisect_left(starts, start), bisect.bisect_left(starts, stop)
    while k < end:
        span = calls[k]
        if span.stop <= stop and (span.start, span.stop) != (start, stop):
            out.append(span)  # calls nest: the next one not inside it starts at its stop
            k = bisect.bisect_left(starts, span.stop, k + 1, end)
        else:
            k += 1
    return out


def is_call(problem: Problem, start: int, stop: int) -> bool:
    """Whether `[start, stop)` is one module call (what offload hooks attach to; any
    region without module spans)."""
    if problem.module_spans is None:
        return True
    span = problem.span_table.get((start, stop))
    return span is not None and span.kind == "call"


def span(problem: Problem, start: int, stop: int) -> ModuleSpan | None:
    """The module span `[start, stop)`, if there is one."""
    return problem.span_table.get((start, stop))


def region_inputs(problem: Problem, start: int, stop: int) -> tuple[int, ...]:
    """What a checkpoint of `[start, stop)` holds: the storages made before it that it
    reads, and for a module span the tensors passed to the call."""
    read = {s for i in range(start, stop) for s in problem.inputs[i]
            if problem.storage_producer[s] < start}
    span = problem.span_table.get((start, stop))
    if span is not None:
        read.update(span.inputs)
    return tuple(sorted(read))
