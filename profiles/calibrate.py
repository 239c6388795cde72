"""Measure the fixed costs of ``torch.utils.checkpoint`` on a device, with tiny ops.

A planned model (``planner.runtime.emit``) runs each checkpointed module call as
``checkpoint(region, *inputs, use_reentrant=False)``, with a selective-checkpoint (SAC)
policy when the region keeps nodes. Beyond re-running its nodes, that costs host time the
node timings do not see (``CheckpointCosts`` says what each constant covers). Here they are
measured on chains of tiny element-wise ops, so the overhead dominates: a step of ``regions``
checkpointed regions against the same chain without checkpointing and against its plain
forward (what the rerun re-executes), in interleaved rounds (on CPU in process CPU time,
so other processes on a shared host do not count); per chain and mode the lower quartile of
the step times is taken:

* chain A, each region ``neg * (m - 1), sin``: 1 saved tensor, m ops, the rerun runs all m;
* chain B, each region ``sin * m``: m saved tensors, m ops.

``overhead(A) = k (region + pack)``, ``overhead(B) = k (region + m pack)`` give ``region_ms``
and ``pack_ms``; the same chains with a SAC policy (shaped like the planned model's: it counts op
occurrences) minus plain checkpointing give ``sac_op_ms`` per op. ``benchmarks/
checkpoint_overhead.py`` checks the model on more shapes and on real zoo blocks.

On a GPU the same code runs on the device (wall time, synchronised): tiny kernels leave the
GPU idle, so this is the host cost in full, an upper bound of what a step whose kernels keep
the GPU busy pays (host work then overlaps them).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from profiles.schema import CheckpointCosts

__all__ = ["CPU_MEASURED", "MODES", "Chain", "calibrate_checkpoint_costs", "calibration_chains",
           "chain_runs", "chain_step", "costs_from_samples", "interleaved_ms", "lower_quartile",
           "measured_source", "step_clock", "tiny_chain"]

MODES = ("plain", "checkpoint", "sac", "forward")
REGIONS, OPS = 8, 4  # calibration chains: regions per step, tiny ops per region

Chain = list[tuple[str, ...]]  # per region, the tiny ops it runs ("sin" saves, "neg" not)
_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sin": torch.sin, "neg": torch.neg,
}


def tiny_chain(regions: int, ops: int, packs: int) -> Chain:
    """``regions`` regions of ``ops`` tiny ops, the last ``packs`` of which save a tensor."""
    return [("neg",) * (ops - packs) + ("sin",) * packs] * regions


def _run(ops: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
    for op in ops:
        x = _OPS[op](x)
    return x


def _sac_context() -> Any:
    """A policy as costly as the planned model's: count occurrences per op, keep none."""
    counters: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}
    keep: frozenset[tuple[str, int]] = frozenset()

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        counter = counters[ctx.is_recompute]
        name = str(func)
        occurrence = counter[name]
        counter[name] += 1
        if (name, occurrence) in keep:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def chain_step(chain: Chain, x: torch.Tensor, mode: str) -> None:
    """One step of ``chain`` on leaf ``x``: mode ``plain``, ``checkpoint``, ``sac`` or
    ``forward`` (no backward: the time a rerun re-executes)."""
    h = x
    for ops in chain:
        if mode in ("plain", "forward"):
            h = _run(ops, h)
        elif mode == "checkpoint":
            h = checkpoint(functools.partial(_run, ops), h, use_reentrant=False)
        else:
            h = checkpoint(functools.partial(_run, ops), h, use_reentrant=False,
                           context_fn=_sac_context)
    if mode != "forward":
        h.sum().backward()
        x.grad = None


def step_clock(device: torch.device) -> Callable[[], float]:
    """CPU: the process's CPU time (a step runs on this thread, backward included), so time
    the host gives other processes does not count; other devices: wall time."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def interleaved_ms(runs: dict[Any, Callable[[], Any]], device: torch.device,
                   rounds: int | None = None, budget_s: float = 0.5, warmup: int = 2,
                   clock: Callable[[], float] | None = None) -> dict[Any, list[float]]:
    """Times (ms, ``clock``, default `step_clock`) of every callable, called in turn round
    by round.

    Runs ``rounds`` rounds after ``warmup``, or as many as fit in ``budget_s`` (at least 5).
    """
    clock = clock or step_clock(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out: dict[Any, list[float]] = {key: [] for key in runs}
    began = time.perf_counter()
    r = 0
    while True:
        for key, run in runs.items():
            sync()
            t0 = clock()
            run()
            sync()
            if r >= warmup:
                out[key].append((clock() - t0) * 1e3)
        r += 1
        done = r - warmup
        if rounds is not None and done >= rounds:
            break
        if rounds is None and done >= 5 and time.perf_counter() - began > budget_s:
            break
    return out


def chain_runs(chains: dict[str, Chain], device: torch.device
               ) -> dict[tuple[str, str], Callable[[], None]]:
    """Per (chain, mode), a step of that chain (for `interleaved_ms`)."""
    x = torch.randn(16, device=device, requires_grad=True)
    return {(name, mode): functools.partial(chain_step, chain, x, mode)
            for name, chain in chains.items() for mode in MODES}


def lower_quartile(values: list[float]) -> float:
    """The 25th percentile: robust to the slow outliers (interrupts, full garbage
    collections) of a shared host, and less noisy than the median over few rounds."""
    return statistics.quantiles(values, n=4)[0] if len(values) > 1 else values[0]


def _diff(samples: dict[Any, list[float]], chain: str, mode: str,
          minus: tuple[str, ...]) -> float:
    """Lower quartile of ``mode`` minus those of the ``minus`` modes, on the same chain."""
    return lower_quartile(samples[(chain, mode)]) - sum(
        lower_quartile(samples[(chain, m)]) for m in minus)


def costs_from_samples(samples: dict[Any, list[float]], regions: int, ops: int,
                       source: str) -> CheckpointCosts:
    """The constants from `calibration_chains` timed in every mode (see the module doc);
    negative estimates (noise) are clamped to 0."""
    over = {c: _diff(samples, c, "checkpoint", ("plain", "forward")) for c in ("A", "B")}
    sac = [_diff(samples, c, "sac", ("checkpoint",)) for c in ("A", "B")]
    pack = max(0.0, (over["B"] - over["A"]) / (regions * (ops - 1)))
    region = max(0.0, over["A"] / regions - pack)
    sac_op = max(0.0, statistics.fmean(sac) / (regions * ops))
    return CheckpointCosts(region_ms=region, pack_ms=pack, sac_op_ms=sac_op, source=source)


def calibration_chains(regions: int = REGIONS, ops: int = OPS) -> dict[str, Chain]:
    """Chains A (one saved tensor per region) and B (``ops`` per region)."""
    return {"A": tiny_chain(regions, ops, 1), "B": tiny_chain(regions, ops, ops)}


def calibrate_checkpoint_costs(device: torch.device | str = "cpu", *, budget_s: float = 0.5
                               ) -> CheckpointCosts:
    """Measure ``CheckpointCosts`` on ``device`` in about ``budget_s`` seconds (tiny ops)."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        samples = interleaved_ms(chain_runs(calibration_chains(), device), device,
                                 budget_s=budget_s)
    return costs_from_samples(samples, REGIONS, OPS, measured_source(device.type))


def measured_source(device_type: str) -> str:
    """`CheckpointCosts.source` of constants measured here on ``device_type``."""
    return f"measured on {device_type} with tiny ops"


CPU_MEASURED = measured_source("cpu")  # what `planner.region_calibration` calibrates further
