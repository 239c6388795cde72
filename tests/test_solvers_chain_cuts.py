"""The DP's stages when a module call ends in an in-place op: torchvision's BasicConv2d
(conv, BatchNorm, ``relu(inplace=True)``) makes a BatchNorm output that the call's own
``relu_`` and the next call's conv read, two single-node stages apart. Merged to a chain,
the stages can keep the boundaries between calls (`chain.chain_stages` keeps, of the
boundaries a storage spans, the one most calls start or end at), so a region of two whole
calls is in the DP's space: Inception-v3's stem at half its activations recomputes 0.23 ms
there, which CP-SAT found only in some runs, and the DP found nothing. The chain that keeps
each storage's first boundary has schedules this one lacks (timm's ResNet-18d's lowest
peak): where nothing of the calls' chain fits, the DP solves that one too."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import timm
import torch
from torch import nn

from planner import profile_model
from solvers import RECOMPUTE, Region, Schedule, memory_lower_bound, simulate
from solvers.accounting import Context
from solvers.dp import search as dp
from solvers.dp import space as dp_space
from solvers.dp.chain import long_skips, pinned_storages


class BasicConv2d(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu_(self.bn(self.conv(x)))


class Stem(nn.Module):
    """Inception-v3's stem in small: calls named apart, in no container, so that no call
    is a repeated block and the profile's stages are its single nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_1a = BasicConv2d(3, 8)
        self.conv_2a = BasicConv2d(8, 12)
        self.conv_2b = BasicConv2d(12, 16)
        self.pool = nn.MaxPool2d(2)
        self.conv_3b = BasicConv2d(16, 20)
        self.conv_4a = BasicConv2d(20, 24)
        self.head = nn.Linear(24 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.conv_2b(self.conv_2a(self.conv_1a(x))))
        return self.head(self.conv_4a(self.conv_3b(x)).flatten(1))


def _stem_problem():
    torch.manual_seed(0)
    step = profile_model(Stem(), (torch.randn(4, 3, 16, 16),), timing="estimate",
                         loss_fn=lambda out: out.square().mean(), progress=False)
    return step.problem()


def _calls(p) -> list[tuple[int, int]]:
    """The model's own children's calls, in order."""
    return sorted((s.start, s.stop) for s in p.module_spans
                  if s.name and "." not in s.name and "[" not in s.name)


def test_stages_keep_the_boundaries_between_calls() -> None:
    p = _stem_problem()
    _, stages = long_skips(p, pinned_storages(p))
    cuts = {a for a, _ in stages}
    calls = _calls(p)
    assert len(calls) == 7, calls
    # the pooled tensor stays the forward's local variable up to the head: one boundary
    # at most between the pool and the head
    missing = [a for a, _ in calls[1:4] if a not in cuts]
    assert not missing, (missing, stages)


def _no_slower_than(p, a: int, b: int) -> None:
    """Region `[a, b)` is in the DP's space, and the DP, solving with no time limit, is no
    slower than it at its peak."""
    assert dp_space.holds_regions(p, [(a, b, frozenset())])
    scored = simulate(p, Schedule.from_segments(p.n_nodes, [Region(a, b, RECOMPUTE)]))
    sol = dp.solve(p, scored.peak_bytes, math.inf)
    assert sol.feasible and sol.objective_ms <= scored.recompute_time_ms + 1e-9


def test_two_whole_calls_are_one_region_of_the_dp() -> None:
    p = _stem_problem()
    calls = _calls(p)
    _no_slower_than(p, calls[0][0], calls[1][1])


def _least_fitting(p, fits) -> int:
    """The least budget at which `fits(budget)` holds, by bisection."""
    lo = memory_lower_bound(p) - 1
    hi = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def test_where_the_calls_chain_fits_nothing_the_other_chain_is_solved() -> None:
    """timm's ResNet-18d: the chain that keeps each storage's first boundary reaches a
    lower peak than the calls' chain; at that peak `dp.solve` still finds a schedule."""
    torch.manual_seed(0)
    model = timm.create_model("resnet18d", num_classes=10)
    step = profile_model(model, (torch.randn(2, 3, 64, 64),), timing="estimate",
                         loss_fn=lambda out: out.square().mean(), progress=False)
    p = step.problem()
    ctx = Context(p)

    def chain_fits(calls_first: bool) -> Callable[[int], bool]:
        lay = dp._layout(ctx, calls_first=calls_first)
        return lambda budget: dp._solve_layout(ctx, lay, budget, math.inf, 2000, True,
                                               time.perf_counter()).feasible

    calls, other = _least_fitting(p, chain_fits(True)), _least_fitting(p, chain_fits(False))
    assert other < calls  # else this model no longer tells the chains apart
    sol = dp.solve(p, other, math.inf)
    assert sol.feasible and sol.peak_bytes <= other
