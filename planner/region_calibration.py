"""What a checkpoint region costs on this model, measured on the model itself (CPU).

The clock (`solvers.clock`) charges each recomputed region ``checkpoint_region_ms +
checkpoint_pack_ms * P`` beyond its nodes (P: the tensors it saves). ``profiles.calibrate``
measures those constants on chains of tiny ops under raw ``torch.utils.checkpoint``; at a
real model's sizes and through the wrapper a plan installs (`planner.emit`), a region costs
several times that: GPT small with its 4 blocks checkpointed measured about 1.7 ms per
region on 2 CPU cores where the tiny-op constants charge 0.29 ms (issue 62), and plans of
many small regions then measured 10-20 points slower than predicted.

So where every cost is host cost (a step profiled and timed on the CPU), the profile is
calibrated once more, on the model: its repeated blocks, each one call checkpointed by the
planner's own wrapper, against the plain step, in interleaved rounds (lower quartiles). The
step time that checkpointing adds beyond the blocks' reruns (as the clock times them) is
what the regions cost; the tiny-op constants are scaled to add up to it, so regions that
save more still cost more. The model, its gradients, buffers and RNG are left as they were.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from planner.emit import ANY_PRECISION, RegionSpec, install_checkpoints, remove_checkpoints
from profiles.schema import CheckpointCosts, GraphProfile
from solvers import Problem, Schedule, simulate
from solvers.from_profile import problem_from_profile

log = logging.getLogger(__name__)

__all__ = ["CALIBRATION_S", "block_specs", "calibrated_costs", "scaled_costs"]

CALIBRATION_S = 0.6  # seconds of interleaved steps (at least MIN_ROUNDS rounds)
MIN_ROUNDS, MAX_ROUNDS, WARMUP_ROUNDS = 4, 16, 1


def block_specs(profile: GraphProfile, problem: Problem
                ) -> tuple[list[RegionSpec], Schedule] | None:
    """The model's repeated blocks as checkpoints of one module call each, and the schedule
    that recomputes them; None where a block is not one call of its module whose nodes all
    recompute (its checkpoint would not be the region the clock times)."""
    blocks = problem.blocks()
    if len(blocks) < 2:
        return None
    calls = {(c.start, c.stop): c for c in profile.module_calls if c.calls == 1}
    specs = []
    for start, stop in blocks:
        call = calls.get((start, stop))
        if call is None or problem.recomputable_runs(start, stop) != [(start, stop)]:
            return None
        prefix = f"{call.path}." if call.path else ""
        specs.append(RegionSpec(call.path, frozenset(), tuple(
            b.removeprefix(prefix) for b in call.mutated_buffers),
            autocast_dtype=ANY_PRECISION))
    return specs, Schedule.from_segments(problem.n_nodes, blocks)


def scaled_costs(costs: CheckpointCosts, plain_ms: list[float], planned_ms: list[float],
                 nodes_ms: float, charged_ms: float, regions: int) -> CheckpointCosts:
    """``costs`` with ``region_ms`` and ``pack_ms`` scaled so that the regions' charge,
    ``charged_ms`` under ``costs`` (the clock's rerun ``nodes_ms`` apart), becomes what the
    planned steps measured beyond the plain ones (lower quartiles) less ``nodes_ms``.

    >>> c = CheckpointCosts(region_ms=0.1, pack_ms=0.01, sac_op_ms=0.02)
    >>> s = scaled_costs(c, [10.0] * 4, [17.0] * 4, nodes_ms=5.0, charged_ms=0.5, regions=2)
    >>> round(s.region_ms, 6), round(s.pack_ms, 6), s.sac_op_ms
    (0.4, 0.04, 0.02)
    """
    added = _lower_quartile(planned_ms) - _lower_quartile(plain_ms)
    scale = max(0.0, (added - nodes_ms) / charged_ms) if charged_ms > 0 else 1.0
    return costs.model_copy(update={
        "region_ms": costs.region_ms * scale, "pack_ms": costs.pack_ms * scale,
        "source": f"{costs.source}; scaled x{scale:.2f} to this model's blocks checkpointed "
                  f"({regions} regions, {len(planned_ms)} interleaved rounds: "
                  f"{(added - nodes_ms) / regions:.3f} ms per region beyond its rerun)"})


def _lower_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4)[0] if len(values) > 1 else values[0]


def calibrated_costs(model: nn.Module, args: tuple, kwargs: dict,
                     loss_fn: Callable[[Any], torch.Tensor], autocast: torch.dtype | None,
                     profile: GraphProfile, budget_s: float = CALIBRATION_S
                     ) -> CheckpointCosts | None:
    """The profile's checkpoint costs scaled to what its blocks cost checkpointed on
    ``model`` (module doc); None where the model has no blocks to checkpoint whole, the
    profile has no costs, or the checkpointed step fails (logged)."""
    costs = profile.checkpoint_costs
    problem = problem_from_profile(profile)
    found = block_specs(profile, problem) if costs is not None else None
    if found is None:
        return None
    specs, schedule = found
    free = problem.model_copy(update={"checkpoint_region_ms": 0.0, "checkpoint_pack_ms": 0.0})
    nodes_ms = simulate(free, schedule).recompute_time_ms
    charged_ms = simulate(problem, schedule).recompute_time_ms - nodes_ms
    try:
        plain, planned = _timed_steps(model, args, kwargs, loss_fn, autocast, specs, budget_s)
    except Exception as error:  # the model as it was; the tiny-op constants stay
        log.warning("could not time %s with its blocks checkpointed (%s: %s); a region's "
                    "cost stays the tiny-op calibration's", type(model).__name__,
                    type(error).__name__, error)
        return None
    scaled = scaled_costs(costs, plain, planned, nodes_ms, charged_ms, len(specs))
    log.info("checkpoint costs calibrated on the model: %s", scaled.source)
    return scaled


def _timed_steps(model: nn.Module, args: tuple, kwargs: dict,
                 loss_fn: Callable[[Any], torch.Tensor], autocast: torch.dtype | None,
                 specs: list[RegionSpec], budget_s: float) -> tuple[list[float], list[float]]:
    """Step times (ms) without and with ``specs`` installed, interleaved round by round."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    cast = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast is not None \
        else contextlib.nullcontext

    def step() -> float:
        begin = clock()
        with cast():
            loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        elapsed = (clock() - begin) * 1e3
        for p in model.parameters():
            p.grad = None
        return elapsed

    plain: list[float] = []
    planned: list[float] = []
    started = time.perf_counter()
    with _state_kept(model):
        for round_ in range(WARMUP_ROUNDS + MAX_ROUNDS):
            times = [step()]
            install_checkpoints(model, specs)
            try:
                times.append(step())
            finally:
                remove_checkpoints(model)
            if round_ >= WARMUP_ROUNDS:
                plain.append(times[0])
                planned.append(times[1])
            if len(plain) >= MIN_ROUNDS and time.perf_counter() - started > budget_s:
                break
    return plain, planned


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """The model's gradients, buffers and the RNG as they were, whatever runs inside."""
    grads = [(p, p.grad) for p in model.parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=[]):
        for p, _ in grads:
            p.grad = None
        try:
            yield
        finally:
            for p, grad in grads:
                p.grad = grad
            with torch.no_grad():
                for b, value in buffers:
                    b.copy_(value)
