"""Measured offload: our keep / recompute / offload plans against offloading everything.

The ``offload`` part of ``benchmarks/gpu_suite.py`` (a GPU: zoo ``gpt`` at ``gpt2-medium``,
batch 8, fp32; ``--tiny``: the tiny GPT on the CPU, the smoke test). Every strategy runs
through ``frontier_measure.Runner`` (peak of one step: ``torch.cuda.max_memory_allocated``,
on the CPU ``PeakTracker``; median step time interleaved with the unplanned step; gradients
against the unplanned model's):

- every block's saved activations offloaded, the next block prefetched (torchtune's
  ``OffloadActivations`` recipe, run by our hooks: ``plan_for_schedule``);
- ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the step (every saved
  tensor to the host, back when needed);
- ours with ``offload=True`` at DESIGN.md's H100 anchors (on the CPU: at + 50 / 30 % of the
  activations), planned with estimated H100 times (``--timing``), with its predicted peak.
  Each solve is limited (``--solve-time-limit``, 60 s).

On an H100 (2026-11-26): `offload-h100.md` and `offload-h100-run1.md` (two runs, before
the release rule: the same plan held its budget in one and not the other).
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Any

import torch
from frontier_measure import Runner, grads_match

from planner import zoo
from planner.api import optimize, plan_for_schedule, replan
from planner.plan import InfeasibleBudgetError, Plan
from solvers import Schedule, joint

GIB = 2**30
ANCHORS_GIB = (8.37, 17.37, 27.87)


def _torchtune_style(probe: Plan) -> Plan:
    """Every block offloaded, each prefetched at the next block's output (our hooks), on
    the profile of `probe`."""
    problem = probe.problem()
    blocks = [b for b in problem.blocks() if problem.is_call(*b)]
    schedule = Schedule.store_all(problem.n_nodes).with_offloads(
        joint.offloads(problem, blocks, blocks, 1))
    return plan_for_schedule(probe.profile, schedule, probe.inputs,
                             probe.structure_fingerprint)


def bench(device: str, tiny: bool, steps: int, timing: str, deadline: float,
          solve_time_limit_s: float = 60.0) -> dict[str, Any]:
    """Rows of the offload comparison (see the module doc); each solve is limited to
    ``solve_time_limit_s``."""
    zm = zoo.get("gpt", size="tiny" if tiny else "gpt2-medium", batch=4 if tiny else 8,
                 dropout=0.0, device=device)
    runner = Runner(zm, device, steps, deadline=deadline, warmup=0 if tiny else 2)
    rows: list[dict[str, Any]] = []
    peak0, ms0, _, reference = runner.run(zm.model)
    rows.append(dict(label="unplanned", peak_bytes=peak0, step_ms=ms0, base_step_ms=ms0,
                     grads_equal=True))
    est = "cpu" if tiny else "H100"
    # profiled once: a budget above the unplanned peak plans nothing
    probe = optimize(zm.model, zm.example_inputs, budget_gb=1e6, loss_fn=zm.loss_fn,
                     timing=timing, device=est, progress=False)
    static = probe.profile.static.total_bytes
    budgets = ([int(static + f * (probe.unplanned_peak_bytes - static)) for f in (0.5, 0.3)]
               if tiny else [int(g * GIB) for g in ANCHORS_GIB])
    peers = [("offload every block, prefetch the next (torchtune-style, our hooks)",
              _torchtune_style(probe), contextlib.nullcontext),
             ("save_on_cpu (every saved tensor)", None,
              functools.partial(torch.autograd.graph.save_on_cpu,
                                pin_memory=device == "cuda"))]
    for label, plan, context in peers:
        rows.append(_measure(runner, zm, label, plan, context, reference))
    for budget in budgets:
        label = f"ours, offload=True, at {budget / GIB:.4g} GiB"
        if runner.out_of_time():
            rows.append(dict(label=label, status="not run: time is up"))
            continue
        try:
            plan = replan(probe, budget_bytes=budget, offload=True,
                          time_limit_s=solve_time_limit_s)
        except InfeasibleBudgetError as error:
            rows.append(dict(label=label, status=f"infeasible: {error.args[0][:160]}"))
            continue
        rows.append(_measure(runner, zm, label, plan, contextlib.nullcontext, reference))
    return dict(device=device, steps=steps, timing=timing, rows=rows)


def _measure(runner: Runner, zm: zoo.ZooModel, label: str, plan: Plan | None,
             context: Any, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    if runner.out_of_time():
        return dict(label=label, status="not run: time is up")
    module = zm.model if plan is None else runner.applied(plan)  # applied once
    context = context if plan is None else contextlib.nullcontext
    started = time.perf_counter()
    peak, ms, base, grads = runner.run(module, context)
    equal, diff = grads_match(reference, grads)
    row = dict(label=label, status="ok", peak_bytes=peak, step_ms=ms, base_step_ms=base,
               warm_peak_bytes=runner.warm_peak(module, context),
               grads_equal=equal, grad_max_abs_diff=diff,
               seconds=time.perf_counter() - started)
    if plan is not None:
        row.update(budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                   predicted_overhead=plan.predicted_overhead,
                   offloaded_bytes=plan.offloaded_bytes, stall_ms=plan.stall_ms,
                   schedule=plan.schedule.describe()[:400])
    return row


def markdown(result: dict[str, Any]) -> str:
    out = ["# Offload, measured", "",
           f"{result['when']}, {result['device_name']}, {result['steps']} timed steps, plans "
           f"timed by `{result['timing']}`.", "",
           "| strategy | peak GiB (first step) | peak GiB (second) | predicted GiB | "
           "step vs unplanned | predicted overhead | moved GiB | grads |",
           "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("status", "ok") != "ok":
            out.append(f"| {r['label']} | {r['status']} | | | | | | |")
            continue
        over = r["step_ms"] / r["base_step_ms"] - 1
        predicted = r.get("predicted_peak_bytes")
        predicted_text = "-" if predicted is None else f"{predicted / GIB:.4g}"
        overhead = r.get("predicted_overhead")
        overhead_text = "-" if overhead is None else f"{overhead:.1%}"
        warm = r.get("warm_peak_bytes")
        warm_text = "-" if warm is None else f"{warm / GIB:.4g}"
        out.append(f"| {r['label']} | {r['peak_bytes'] / GIB:.4g} | {warm_text} | "
                   f"{predicted_text} | "
                   f"{over:+.1%} | {overhead_text} | {r.get('offloaded_bytes', 0) / GIB:.3g} | "
                   f"{'=' if r['grads_equal'] else 'DIFFER'} |")
    return "\n".join(out) + "\n"


def write(result: dict[str, Any], out: Path, stem: str) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{stem}.md").write_text(markdown(result))
