"""Schedule-independent lower bounds on peak memory and recompute time."""

from __future__ import annotations

from solvers.problem import Problem

__all__ = ["memory_lower_bound", "recompute_time_lower_bound"]


def memory_lower_bound(problem: Problem) -> int:
    """Largest single-step working set plus static memory; no schedule peaks lower.

    Forward of node i: its inputs and outputs, every storage produced earlier and read later,
    and its forward temp. Backward of node j: its saved storages, every activation gradient
    alive then (producer <= j <= last reader), parameter gradients of nodes >= j, the loss,
    and its backward temp. Recomputation only adds to these.
    """
    p = problem
    n = p.n_nodes
    last_read = [c[-1] if c else p.storage_producer[s] for s, c in enumerate(p.consumers)]
    loss_bytes = sum(p.storage_bytes[s] for s in p.outputs[n - 1])
    best = 0
    for i in range(n):
        act = sum(b for s, b in enumerate(p.storage_bytes)
                  if p.storage_producer[s] <= i <= last_read[s])
        best = max(best, act + p.fwd_temp_bytes[i])
    param_grads = 0
    for j in range(n - 1, -1, -1):
        param_grads += p.param_grad_bytes[j]
        grads = sum(
            g for s, g in enumerate(p.storage_grad_bytes)
            if g > 0 and p.storage_producer[s] <= j <= last_read[s]
            and (p.consumers[s] or p.storage_producer[s] == n - 1)
        )
        saved = sum(p.storage_bytes[s] for s in set(p.saved[j]) - set(p.outputs[n - 1]))
        best = max(best, saved + grads + param_grads + loss_bytes + p.bwd_temp_bytes[j])
    return p.static_bytes + best


def recompute_time_lower_bound(problem: Problem) -> float:
    """No-recompute time: 0 ms of recomputation (the step itself is fwd + bwd time)."""
    del problem
    return 0.0
