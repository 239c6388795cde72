"""The step's clock: what each step of a training step costs, in one place.

A forward step costs its node's `fwd_time_ms`, a backward step its `bwd_time_ms`. A rerun
(a checkpoint region recomputed in the backward, from its first node up to its early stop)
costs the `fwd_time_ms` of each node it runs, nothing for an idle step (a kept node the
SAC cache serves, or the last one when the rerun stops in its pack before running it,
`solvers.frame` F3), plus the region's host overhead (`Problem.checkpoint_overhead_ms`)
at its first step. `simulate` charges these step by step; `region_analysis` (hence CP-SAT
and `accounting`) and the DP charge the same steps in the same order (`rerun_ms`), the
DP through prefix sums (`dp._rerun_ms`, a fast path tested against `rerun_ms`).

A step that reruns any region also pays `step_overhead_ms` once, with its first rerun:
on ResNet b16 and GPT small (2 CPU cores) a plan of one small region measured 0.9-1.2 ms
beyond its rerun, of two 1.3-1.5, of six 2.1-2.3 (0.5-0.75 ms once, then 0.25-0.5 a
region). Every schedule that reruns pays it alike, so the searches leave it out of the
costs they compare (`simulate` reports it in `recompute_time_ms`, and so every solution's
objective); a schedule without reruns (offload only, or nothing) does not pay it.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from solvers.problem import Problem

__all__ = ["rerun_ms", "rerun_overhead_ms", "rerun_step_ms", "step_overhead_ms",
           "with_step_ms"]


def step_overhead_ms(p: Problem) -> float:
    """What a step that reruns any region pays once, beyond its regions (module doc)."""
    return p.checkpoint_step_ms


def with_step_ms(p: Problem, regions_ms: float) -> float:
    """A schedule's recompute time from what its regions cost, or a bound from a bound: a
    schedule whose regions cost anything reruns and pays `step_overhead_ms` once (every
    rerun costs its region's `checkpoint_region_ms` at least, > 0 where the step is
    priced). The searches compare regions' costs; their answers and bounds say this."""
    return regions_ms + step_overhead_ms(p) if regions_ms > 0 else regions_ms


def rerun_overhead_ms(p: Problem, first: int, stop: int, keep: Iterable[int] = (),
                      end: int | None = None) -> float:
    """The host time a rerun of ``[first, stop)`` costs beyond its nodes; ``end``: the end of
    its region (an op range costs more than a module call: `Problem.checkpoint_range_ms`)."""
    return p.checkpoint_overhead_ms(first, stop, keep, end)


def rerun_step_ms(p: Problem, i: int, idle: bool, overhead_ms: float = 0.0) -> float:
    """Step ``i`` of a pass: its node's forward time (none when ``idle``), plus
    ``overhead_ms`` (a rerun's overhead, on its first step; 0 in the forward)."""
    return (0.0 if idle else p.fwd_time_ms[i]) + overhead_ms


def rerun_ms(p: Problem, first: int, stop: int, idle: Container[int],
             overhead_ms: float) -> float:
    """A rerun of ``[first, stop)``: its steps' times summed in step order, as `simulate`
    adds them (``idle`` steps do no work; ``overhead_ms`` from `rerun_overhead_ms`)."""
    total = 0.0
    for i in range(first, stop):
        total += rerun_step_ms(p, i, i in idle, overhead_ms if i == first else 0.0)
    return total
