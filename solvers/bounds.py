"""Schedule-independent lower bounds on peak memory and recompute time."""

from __future__ import annotations

from solvers.accounting import gradient_bytes
from solvers.problem import Problem

__all__ = ["memory_lower_bound", "recompute_time_lower_bound"]


def memory_lower_bound(problem: Problem) -> int:
    """Largest single-step working set plus static memory; no schedule peaks lower.

    Forward of node i: its outputs, every storage produced earlier and read at or after i,
    and its forward temp. Backward of node j: its saved storages, the gradient bytes every
    schedule has in that event (activation gradients alive then, its fresh ones, parameter
    gradients of nodes >= j; `accounting.gradient_bytes`), the loss outputs the caller
    holds (all but those the loss's backward saves), and its backward temp; once j released
    its saves, the gradients it sums into buffers then (`GradientEvents.released`) and the
    loss outputs. Recomputation only adds to these.
    """
    p = problem
    n = p.n_nodes
    loss = p.caller_held
    # the caller's storages live to the end of the forward; unread ones at their producer
    last_read = [n - 1 if s in loss else r if r >= 0 else p.storage_producer[s]
                 for s, r in enumerate(p.last_read)]
    loss_bytes = sum(p.storage_bytes[s] for s in loss)
    g_event, _ = gradient_bytes(p)
    best = 0
    diff = [0] * (n + 1)  # storage s is live at the forward of nodes producer..last_read
    for s, b in enumerate(p.storage_bytes):
        if p.storage_producer[s] <= last_read[s]:
            diff[p.storage_producer[s]] += b
            diff[last_read[s] + 1] -= b
    act = 0
    for i in range(n):
        act += diff[i]
        best = max(best, act + p.fwd_event_bytes[i])
    released = p.gradient_events.released or [0] * n
    for j in range(n - 1, -1, -1):
        saved = sum(p.storage_bytes[s] for s in set(p.saved[j]) - loss)
        best = max(best, saved + g_event[j] + loss_bytes + p.bwd_temp_bytes[j],
                   released[j] + loss_bytes)
    return p.static_bytes + best


def recompute_time_lower_bound(problem: Problem) -> float:
    """No-recompute time: 0 ms of recomputation (the step itself is fwd + bwd time)."""
    del problem
    return 0.0
