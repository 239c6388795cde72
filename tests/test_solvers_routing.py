"""solvers.routing: the worst routing's peak, from the profiled counts and one shift per
expert, equals the largest peak of the step replayed at every routing."""

from __future__ import annotations

import itertools

import pytest

from solvers import Schedule, simulate
from solvers.problem import Problem
from solvers.routing import (
    RoutingError,
    RoutingSpread,
    problem_shift,
    routed_problem,
    worst_routing,
)

BYTES_PER_TOKEN = (3, 5, 7)  # what each expert's tensor holds per token routed to it
TOKENS, TOP_K = 4, 2


def _step(counts: tuple[int, ...]) -> Problem:
    """A chain whose nodes 1-3 are the experts' tensors, sized by their counts."""
    sizes = [16, *(b * c for b, c in zip(BYTES_PER_TOKEN, counts, strict=True)), 12, 1]
    return Problem.chain(sizes, [1.0] * len(sizes))


def _spread(base: tuple[int, ...], step: int = 1) -> RoutingSpread:
    moved = [tuple(c - step * (e == 0) + step * (e == d) for e, c in enumerate(base))
             for d in range(1, len(base))]
    return RoutingSpread(tokens=TOKENS, top_k=TOP_K, experts=len(base), base_counts=list(base),
                         step=step, shifts=[problem_shift(_step(base), _step(m)) for m in moved])


def _routings() -> list[tuple[int, ...]]:
    return [c for c in itertools.product(range(TOKENS + 1), repeat=3)
            if sum(c) == TOP_K * TOKENS]


@pytest.mark.parametrize("schedule", ["store all", "recompute the experts"])
def test_the_worst_routing_is_the_largest_peak_over_every_routing(schedule: str) -> None:
    base = (3, 3, 2)
    spread = _spread(base)
    plan = Schedule.store_all(6) if schedule == "store all" else \
        Schedule.from_segments(6, [(1, 4)])
    peaks = {c: simulate(_step(c), plan).peak_bytes for c in _routings()}
    worst = worst_routing(_step(base), spread, plan)
    assert worst.peak_bytes == max(peaks.values())
    assert peaks[worst.counts] == worst.peak_bytes
    assert worst.profiled_peak_bytes == peaks[base]
    assert worst.counts == (0, 4, 4)  # the two experts of most bytes per token, full


def test_a_routed_problem_is_the_step_at_those_counts() -> None:
    spread = _spread((3, 3, 2))
    assert routed_problem(_step((3, 3, 2)), spread, [1, 4, 3]) == _step((1, 4, 3))


def test_a_step_that_runs_other_ops_at_another_routing_has_no_bound() -> None:
    longer = Problem.chain([16, 9, 15, 14, 12, 1, 1], [1.0] * 7)
    with pytest.raises(RoutingError, match="runs other ops"):
        problem_shift(_step((3, 3, 2)), longer)
