"""What a checkpoint region costs on this model, measured on the model itself (CPU).

The clock (`solvers.clock`) charges each recomputed region ``checkpoint_region_ms +
checkpoint_pack_ms * P`` beyond its nodes (P: the tensors it saves). ``profiles.calibrate``
measures those constants on chains of tiny ops under raw ``torch.utils.checkpoint``; at a
real model's sizes and through what a plan installs (`planner.runtime.emit`), a region costs
several times that: GPT small with its 4 blocks checkpointed measured about 1 ms per
region on 2 CPU cores where the tiny-op constants charge 0.29 ms, and a small op range of
a Llama MLP about 0.5 ms where they charge 0.1 (issue 62).

So where every cost is host cost (a step profiled and timed on the CPU), the constants are
measured on the model: plans, installed as `planner.apply` installs them, are timed
against the plain step in interleaved rounds (the median of each round's difference):
every repeated block recomputed (large regions, module calls), and in each block its
smallest span that saves something, an op range or a module call, with no random op (small
regions, as plans of many regions cut them). What each adds beyond its reruns (the clock's
node times), against its regions and saved tensors, gives ``region_ms`` and ``pack_ms``
(non-negative least squares over the two). Where the small spans are op ranges, the two
plans measure the two kinds of region instead: an op range runs its module's forward
as its traced program (when that ran node by node, GPT small's two calibrations gave
0.12 and 0.35 ms more than a block's module call; ResNet: none); ``pack_ms`` then stays
the tiny-op chains' and ``range_ms`` is what a range costs more
(`Problem.checkpoint_range_ms`). The plain steps of those
rounds also set the profile's time: its forward node times are scaled to their median
forward and its backward node times to their median backward, so the reruns a region's
measured ms are set against, and every plan's overhead, are counted in the step as it runs
here. A third plan, every block recomputed keeping its matmuls, measures ``sac_op_ms``:
what a selective policy costs per op beyond its regions and packs. The model, its
gradients, buffers and the RNG are left as they were.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from planner.runtime.emit import ANY_PRECISION, prepare_checkpoints, remove_checkpoints
from planner.runtime.guard import step_checks
from planner.runtime.install import schedule_specs
from profiles.schema import CheckpointCosts, GraphProfile, StepTiming
from solvers import Problem, Schedule, simulate
from solvers.from_profile import problem_from_profile, span_targets

log = logging.getLogger(__name__)

__all__ = [
    "CALIBRATION_S",
    "Measured",
    "Timed",
    "calibrated_profile",
    "calibration_schedules",
    "fitted_costs",
]

# seconds of interleaved steps (at least MIN_ROUNDS rounds): GPT small's blocks plan
# predicted +54.9 to +57.5 % in five calibrations of 1.3 s, +55.6 to +63.0 % in five of
# 0.8 s (median of 5 rounds), +56.1 to +57.3 % in five of 2.4 s
CALIBRATION_S = 1.5
MIN_ROUNDS, MAX_ROUNDS, WARMUP_ROUNDS = 6, 16, 1

# (ms beyond the reruns, regions that rerun, tensors packed, of the regions the op ranges,
# aten ops under a selective policy)
Measured = tuple[float, int, int, int, int]


def calibration_schedules(profile: GraphProfile, problem: Problem) -> list[Schedule]:
    """Every block recomputed (each one call of its module), and, where every block has
    one, the smallest span inside each block that saves something and draws no random
    numbers (a dropout's rerun measured 0.8 ms over its node times on HF GPT-2: an error
    of its op's time, not a region's cost), and, where every block has matmuls to keep,
    every block recomputed keeping them (a selective policy's cost per op: ResNet b16's
    blocks so measured +51.3 % where the tiny-op chains' 0.018 ms an op predicted
    +39.1 %), and the first of those small spans alone (or the first block): what a step
    pays once for rerunning any region (`clock.step_overhead_ms`, charged where the rounds
    resolve it: `fitted_costs`); [] without two blocks
    that are whole module calls of recomputable nodes."""
    blocks = problem.blocks()
    once = {c.path for c in profile.module_calls if c.calls == 1}  # one checkpoint per call
    targets = {span: t for span, t in span_targets(profile).items() if t.path in once}
    if len(blocks) < 2 or any(b not in targets or problem.recomputable_runs(*b) != [b]
                              for b in blocks):
        return []
    packed = _packed_per_node(problem)
    small = []
    for start, stop in blocks:
        inside = [(sum(packed[a:b]), b - a, (a, b))
                  for a, b in ((s.start, s.stop) for s in problem.module_spans or ())
                  if start <= a and b <= stop and (a, b) != (start, stop)
                  and (a, b) in targets and problem.recomputable_runs(a, b) == [(a, b)]
                  and sum(packed[a:b]) > 0
                  and not any(n.random for n in profile.nodes[a:b])]
        if not inside:
            small = []
            break
        small.append(min(inside)[2])
    out = [Schedule.from_segments(problem.n_nodes, blocks)]
    if small:
        out.append(Schedule.from_segments(problem.n_nodes, small))
    kept = [problem.matmul_keep(*b) for b in blocks]
    if all(kept):
        out.append(Schedule.from_segments(problem.n_nodes, blocks,
                                          keep=[k for ks in kept for k in ks]))
    out.append(Schedule.from_segments(problem.n_nodes, [(small or blocks)[0]]))
    return [s.with_targets(targets) for s in out]


def _packed_per_node(problem: Problem) -> list[int]:
    """Tensors each node packs, as the clock counts them (`Problem.checkpoint_overhead_ms`
    with only ``checkpoint_pack_ms`` 1)."""
    unit = problem.model_copy(update={"checkpoint_region_ms": 0.0, "checkpoint_pack_ms": 1.0,
                                      "checkpoint_sac_op_ms": 0.0, "checkpoint_range_ms": 0.0})
    return [round(unit.checkpoint_overhead_ms(i, i + 1)) for i in range(problem.n_nodes)]


def fitted_costs(costs: CheckpointCosts, measured: list[Measured],
                 errors: list[float] | None = None) -> CheckpointCosts:
    """``costs`` fitted to ``measured``: per plan, the ms its regions added beyond their
    reruns, how many rerun, the tensors they pack, how many of them are op ranges and the
    aten ops a selective policy sees. Over the plans without a policy (least squares, no
    cost below the tiny-op chains' ``costs``): ``step_ms`` where the plans rerun different
    numbers of regions, once per step (`clock.step_overhead_ms`), and where ``errors`` (the
    standard error of each plan's ms) are given, only if it is at least ``RESOLVED`` of its
    own standard errors (else 0, its ms left to the other costs: `_resolved_columns`);
    without op ranges, ``region_ms`` and ``pack_ms``; with them, ``pack_ms`` stays the
    tiny-op chains' and a module call's and an op range's region costs are fitted
    (``range_ms``: what a range costs more). Then ``sac_op_ms``: what the plans with a
    policy cost beyond those, per op (kept where no plan has one).

    The tiny-op chains time checkpoint's own frame, packs and policy, which a region of
    the model pays too, so a plan that measured less is noise. (HF GPT-2 in a full frontier
    run: every plan measured at most its reruns, a fit from 0 charged nothing and its 12
    plans were predicted 5-9 points low; four calibrations of the same model alone fitted
    0.41-0.89 ms a region.)

    >>> c = CheckpointCosts(region_ms=0.1, pack_ms=0.01, sac_op_ms=0.02)
    >>> f = fitted_costs(c, [(4 * 0.5 + 100 * 0.02, 4, 100, 0, 0),
    ...                      (4 * 0.5 + 8 * 0.02, 4, 8, 0, 0)])
    >>> round(f.region_ms, 6), round(f.pack_ms, 6), f.range_ms, f.sac_op_ms, f.step_ms
    (0.5, 0.02, 0.0, 0.02, 0.0)
    >>> f = fitted_costs(c, [(0.7 + 4 * 0.2 + 100 * 0.01, 4, 100, 0, 0),
    ...                      (0.7 + 4 * 0.9 + 4 * 0.01, 4, 4, 4, 0),
    ...                      (0.7 + 0.9 + 0.01, 1, 1, 1, 0),
    ...                      (0.7 + 4 * 0.2 + 90 * 0.01 + 60 * 0.05, 4, 90, 0, 60)])
    >>> [round(v, 6) for v in (f.step_ms, f.region_ms, f.range_ms, f.pack_ms, f.sac_op_ms)]
    [0.7, 0.2, 0.7, 0.01, 0.05]
    """
    plain = [m for m in measured if not m[4]]
    ranges = any(m[3] for m in plain)
    # (name, floor, the column's count in a plan of n regions, p packs, r op ranges)
    columns: list[tuple[str, float, Callable[[int, int, int], float]]] = [
        ("region_ms", costs.region_ms, lambda n, p, r: n - r)]
    if ranges:  # an op range's whole region cost; what it costs more is fitted after
        columns.append(("range_region_ms", costs.region_ms, lambda n, p, r: r))
    else:
        columns.append(("pack_ms", costs.pack_ms, lambda n, p, r: p))
    if len({m[1] for m in plain}) > 1:
        columns.append(("step_ms", 0.0, lambda n, p, r: 1))
    fixed = costs.pack_ms if ranges else 0.0  # the tensors' cost, where not fitted
    rows = [(ms - fixed * p, [count(n, p, r) for _, _, count in columns])
            for ms, n, p, r, _ in plain]
    if errors is not None and columns[-1][0] == "step_ms":
        plain_errors = [e for m, e in zip(measured, errors, strict=True) if not m[4]]
        columns, rows = _resolved_columns(columns, rows, plain_errors)
    fit = dict(zip((c[0] for c in columns), _bounded_fit(
        rows, [floor for _, floor, _ in columns]), strict=True))
    update = {"region_ms": fit["region_ms"], "pack_ms": fit.get("pack_ms", costs.pack_ms),
              "range_ms": max(0.0, fit.get("range_region_ms", 0.0) - fit["region_ms"]),
              "step_ms": fit.get("step_ms", 0.0)}
    policy = [(ms - update["step_ms"] - update["region_ms"] * n - update["range_ms"] * r
               - update["pack_ms"] * p, ops) for ms, n, p, r, ops in measured if ops]
    if policy:
        update["sac_op_ms"] = max(costs.sac_op_ms, sum(ms for ms, _ in policy)
                                  / sum(ops for _, ops in policy))
    plans = "; ".join(f"{n} regions ({r} op ranges, {ops} ops under a policy), {p} packs: "
                      f"{ms:.2f} ms" for ms, n, p, r, ops in measured)
    return costs.model_copy(update={
        **update, "source": f"{costs.source}; region costs fitted to this model's "
                            f"checkpointed blocks ({plans} beyond their reruns)"})


RESOLVED = 2.0  # standard errors a fitted step cost must reach to be charged


def _resolved_columns(columns: list, rows: list[tuple[float, list[float]]],
                      errors: list[float]) -> tuple[list, list[tuple[float, list[float]]]]:
    """``columns`` and ``rows`` without the last column (``step_ms``) where its fitted value
    is below ``RESOLVED`` standard errors, as propagated from each row's ``errors``: it
    rests on the one plan that reruns a single small region, whose few tenths of a ms are
    read off steps hundreds of times longer (HF GPT-2 in a frontier run: 6.19 ms a step,
    where its one-region plan measured 3.5 % against 12.0 % so predicted)."""
    fit = _bounded_fit(rows, [floor for _, floor, _ in columns])
    x = np.array([xs for _, xs in rows], dtype=float)
    weights = np.linalg.pinv(x)[-1]  # the step cost as a combination of the rows' ms
    error = float(np.sqrt(((weights * np.asarray(errors, dtype=float)) ** 2).sum()))
    if fit[-1] >= RESOLVED * error:
        return columns, rows
    log.info("checkpoint calibration: a step cost of %.3f ms is within %.1f standard errors "
             "(%.3f ms) of none; not charged", fit[-1], RESOLVED, error)
    return columns[:-1], [(y, xs[:-1]) for y, xs in rows]


def _bounded_fit(rows: list[tuple[float, list[float]]], floors: list[float]) -> list[float]:
    """The coefficients ``b >= floors`` minimising ``sum (y - x.b)^2`` over ``rows``
    (y, x): exact, over every set of coefficients left at their floor (a handful)."""
    x = np.array([xs for _, xs in rows], dtype=float).reshape(len(rows), len(floors))
    low = np.array(floors, dtype=float)
    y = np.array([y for y, _ in rows], dtype=float) - x @ low
    best, best_residual = np.zeros(len(floors)), float(y @ y)
    for free in itertools.product((False, True), repeat=len(floors)):
        columns = [j for j, f in enumerate(free) if f]
        if not columns:
            continue
        solved = np.linalg.lstsq(x[:, columns], y, rcond=None)[0]
        if (solved < 0).any():
            continue
        extra = np.zeros(len(floors))
        extra[columns] = solved
        residual = float(((y - x @ extra) ** 2).sum())
        if residual < best_residual - 1e-12:
            best, best_residual = extra, residual
    return [float(v) for v in low + best]


def calibrated_profile(model: nn.Module, args: tuple, kwargs: dict,
                       loss_fn: Callable[[Any], torch.Tensor], autocast: torch.dtype | None,
                       profile: GraphProfile, budget_s: float = CALIBRATION_S
                       ) -> GraphProfile:
    """``profile`` with its node times set to the step as the calibration's plain steps
    time it (`_step_scaled`) and, where the model has blocks to checkpoint whole, its
    checkpoint costs fitted to the plans measured on ``model`` (module doc). Without
    blocks, or where a checkpointed step fails (logged), a few plain steps are timed and
    the costs stay the tiny-op calibration's: the profile's own op times are always
    scaled here (`planner.profiling` profiles without timing the whole step)."""
    costs = profile.checkpoint_costs
    problem = problem_from_profile(profile)
    schedules = calibration_schedules(profile, problem) if costs is not None else []
    specs = [schedule_specs(profile, s, ANY_PRECISION) for s in schedules]
    try:
        timed = _timed_steps(model, args, kwargs, loss_fn, autocast, specs,
                             budget_s if specs else 0.0)
    except Exception as error:  # the model as it was; the tiny-op constants stay
        if not specs:
            raise
        log.warning("could not time %s with its blocks checkpointed (%s: %s); a region's "
                    "cost stays the tiny-op calibration's", type(model).__name__,
                    type(error).__name__, error)
        schedules, timed = [], _timed_steps(model, args, kwargs, loss_fn, autocast, [], 0.0)
    profile = _step_scaled(profile, timed)
    if not schedules:
        return profile
    problem = problem_from_profile(profile)
    measured, errors = [], []
    for schedule, ms in zip(schedules, timed.planned, strict=True):
        nodes_ms = _charged(problem, schedule)  # the reruns' node time
        errors.append(_paired_error_ms(ms, timed.plain))
        measured.append((_paired_ms(ms, timed.plain) - nodes_ms,
                         round(_charged(problem, schedule, region_ms=1.0) - nodes_ms),
                         round(_charged(problem, schedule, pack_ms=1.0) - nodes_ms),
                         round(_charged(problem, schedule, range_ms=1.0) - nodes_ms),
                         round(_charged(problem, schedule, sac_op_ms=1.0) - nodes_ms)))
    fitted = fitted_costs(costs, measured, errors).model_copy(update={
        "guard_ms": statistics.median(timed.guard) if timed.guard else 0.0})
    log.info("checkpoint costs calibrated on the model: %s", fitted.source)
    return profile.model_copy(update={"checkpoint_costs": fitted})


def _step_scaled(profile: GraphProfile, timed: Timed) -> GraphProfile:
    """``profile`` with its forward and its backward node times each scaled to the median of
    the calibration's plain steps, and its ``step`` those medians. Scaled to the whole step
    as the profile times it (5 back-to-back runs after timing every op alone), the
    forward's share of the step moved between profiles (ResNet b16 on 2 cores: forward
    6.8, 7.9, 9.4 ms and backward 12.2, 12.0, 10.2 in three profiles, where steps timed as
    the calibration times them read 7.0 and 9.5-9.8), and a plan's overhead, its reruns'
    forward time over the step, with it; so the planner's profiles skip that timing
    (``whole_step=False``) and are scaled here only."""
    forward = statistics.median(timed.plain_forward)
    backward = statistics.median(t - f for t, f in zip(timed.plain, timed.plain_forward,
                                                       strict=True))
    fwd_sum = sum(n.fwd_time_ms for n in profile.nodes)
    bwd_sum = sum(n.bwd_time_ms for n in profile.nodes)
    if min(forward, backward, fwd_sum, bwd_sum) <= 0:
        return profile
    fwd, bwd = forward / fwd_sum, backward / bwd_sum
    nodes = [n.model_copy(update={"fwd_time_ms": n.fwd_time_ms * fwd,
                                  "bwd_time_ms": n.bwd_time_ms * bwd}) for n in profile.nodes]
    before = profile.step or StepTiming(fwd_ms=fwd_sum, bwd_ms=bwd_sum, fwd_scale=1.0,
                                        bwd_scale=1.0)
    step = StepTiming(fwd_ms=forward, bwd_ms=backward, fwd_scale=before.fwd_scale * fwd,
                      bwd_scale=before.bwd_scale * bwd)
    return profile.model_copy(update={"nodes": nodes, "step": step})


def _charged(problem: Problem, schedule: Schedule, region_ms: float = 0.0,
             pack_ms: float = 0.0, range_ms: float = 0.0, sac_op_ms: float = 0.0) -> float:
    """The clock's recompute time of ``schedule`` with these constants (none per step)."""
    return simulate(problem.model_copy(update={
        "checkpoint_region_ms": region_ms, "checkpoint_pack_ms": pack_ms,
        "checkpoint_sac_op_ms": sac_op_ms, "checkpoint_range_ms": range_ms,
        "checkpoint_step_ms": 0.0}), schedule).recompute_time_ms


def _paired_ms(planned: list[float], plain: list[float]) -> float:
    """What a plan adds to the plain step: the median of the rounds' differences. Each
    round times both back to back, so a drift of the host between rounds cancels. GPT small,
    five calibrations of 5 rounds each: the small spans' plan measured 1.9-4.9 ms so, and
    1.5-6.0 ms as the difference of the two lower quartiles."""
    return statistics.median(a - b for a, b in zip(planned, plain, strict=True))


def _paired_error_ms(planned: list[float], plain: list[float]) -> float:
    """The standard error of `_paired_ms`: the median's of the rounds' differences, from
    their median absolute deviation (1.4826 of it estimates a normal spread; the median of
    n draws errs 1.2533 times the mean's)."""
    diffs = [a - b for a, b in zip(planned, plain, strict=True)]
    middle = statistics.median(diffs)
    spread = 1.4826 * statistics.median(abs(d - middle) for d in diffs)
    return 1.2533 * spread / len(diffs) ** 0.5


class Timed(NamedTuple):
    """Step times (ms) of the plain model and under each plan, round by round, the plain
    steps' forward (loss included), and what a planned model's guard took in each step."""

    plain: list[float]
    planned: list[list[float]]
    plain_forward: list[float]
    guard: list[float] = []  # noqa: RUF012 (never appended to: a NamedTuple's default)


def _timed_steps(model: nn.Module, args: tuple, kwargs: dict,
                 loss_fn: Callable[[Any], torch.Tensor], autocast: torch.dtype | None,
                 specs: list[list[Any]], budget_s: float) -> Timed:
    """Steps without a plan and under each of ``specs``, interleaved by round."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    cast = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast is not None \
        else contextlib.nullcontext
    forward = [0.0]  # the last step's
    # every step first runs the checks a plan's guard runs at its start (`guard.step_checks`),
    # timed apart: the steps' times, and so the profile's, leave them out
    checks, guard_ms = step_checks(model), []

    def step() -> float:
        checked = clock()
        checks()
        begin = clock()
        guard_ms.append((begin - checked) * 1e3)
        with cast():
            loss = loss_fn(model(*args, **kwargs))
        forward[0] = (clock() - begin) * 1e3
        loss.backward()
        elapsed = (clock() - begin) * 1e3
        for p in model.parameters():
            p.grad = None
        return elapsed

    # one installation per plan: its op-stream check runs in the warm-up round only
    installations = [prepare_checkpoints(model, s) for s in specs]
    timed = Timed([], [[] for _ in specs], [], guard_ms)
    started = time.perf_counter()
    with _state_kept(model):
        for round_ in range(WARMUP_ROUNDS + MAX_ROUNDS):
            times, plain_forward = [0.0] * (1 + len(installations)), 0.0
            for k in _round_order(round_, len(times)):
                times[k] = _installed_step(step, model, installations[k - 1] if k else None)
                plain_forward = plain_forward if k else forward[0]
            if round_ >= WARMUP_ROUNDS:
                timed.plain.append(times[0])
                timed.plain_forward.append(plain_forward)
                for out, ms in zip(timed.planned, times[1:], strict=True):
                    out.append(ms)
            if len(timed.plain) >= MIN_ROUNDS and time.perf_counter() - started > budget_s:
                break
    return timed


def _round_order(round_: int, n: int) -> list[int]:
    """The order of a round's ``n`` steps (0: the plain one): rotated by one each round,
    so that each step is first, second, ... equally often, as the frontier times its rows:
    a step after another pays part of what that one left, and a fixed order would bill it
    to the same plan every round. (Six calibrations each way on HF GPT-2 gave region costs
    of 0.49-0.92 ms in a fixed order, 0.55-0.91 ms rotated: the noise is the rounds', not
    the order's.)"""
    return [(round_ + i) % n for i in range(n)]


def _installed_step(step: Callable[[], float], model: nn.Module, installation: Any) -> float:
    """``step()``, under ``installation`` (None: the plain model)."""
    if installation is None:
        return step()
    installation.install()
    try:
        return step()
    finally:
        remove_checkpoints(model)


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
