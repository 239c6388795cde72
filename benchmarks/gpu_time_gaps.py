"""Where a plan's measured step time and its predicted one differ, op by op: a lease part.

On an H200 on 2026-11-28 (`benchmarks/results/README.md`, GPU, "Fourth lease") our bf16 plan
at sac-linear's peak measured +45.4 % over the unplanned step against +27.3 % predicted; the
other plans were within 2 points. The per-op profile a plan is solved on is not kept by the
lease, so this script keeps what tells the two apart, in about 3 minutes:

- the plan's predicted recompute time (the simulator's), and its split by aten op (the
  forward times of the nodes it reruns);
- the measured step times, the plan's and the unplanned model's interleaved;
- one step of each under ``torch.profiler``: the GPU kernel time per aten op (self time),
  the GPU's busy time and the step's wall time, so that a gap of kernels (an op costing more
  when rerun, or an op the plan did not count) and a gap of the host (launches, hooks, the
  GPU waiting) show apart;
- the profile's own forward time per aten op against the profiler's in the unplanned step.

    python benchmarks/gpu_time_gaps.py                              # the lease's cases
    python benchmarks/gpu_time_gaps.py --device cpu --size tiny --batch 2 --budgets 0.001

Writes gpu-time-gaps-<gpu or cpu>.{json,md} under ``--out``.
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import itertools
import json
import pstats
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from frontier_measure import Runner, autocast_context, planned
from gpu_peak_gaps import gpt_parser
from record_profiles import gpu_slug

import planner
from planner import zoo
from planner.solving import replan

# (autocast, budget GiB): the peaks of the Fourth lease's peers (frontier-h200-*-2026-11-28)
CASES = (("bfloat16", 9.4247), ("bfloat16", 6.0497), ("bfloat16", 18.3441), (None, 13.4856))


def _aten_name(target: str) -> str:
    """``aten.mm.default`` -> ``aten::mm``, the profiler's name of the op."""
    parts = target.split(".")
    return f"{parts[0]}::{parts[1]}" if len(parts) > 1 else target


def predicted_rerun_by_op(plan: planner.Plan) -> dict[str, float]:
    """Forward ms of the nodes the plan reruns (inside a RECOMPUTE region, not kept), by op."""
    kept = {k for r in plan.schedule.recompute_regions() for k in r.saves}
    out: Counter[str] = Counter()
    for k in plan.schedule.recomputed_nodes() - kept:
        node = plan.profile.nodes[k]
        if node.op == "aten":
            out[_aten_name(node.target)] += node.fwd_time_ms
    return dict(out)


def profiled_forward_by_op(plan: planner.Plan) -> dict[str, float]:
    out: Counter[str] = Counter()
    for node in plan.profile.nodes:
        if node.op == "aten":
            out[_aten_name(node.target)] += node.fwd_time_ms
    return dict(out)


def _kernel_time(runner: Runner, context: Any) -> dict[str, Any]:
    """One step under ``context`` and ``torch.profiler``: GPU (or CPU) self time per aten op,
    the total of it, the kernels launched and the step's wall ms."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_gpu = runner.device == "cuda"
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        wall = runner._step_ms(runner.zm.model, context)
    runner._reset()
    by_op: dict[str, float] = {}
    calls: dict[str, int] = {}
    runtime: dict[str, dict[str, float]] = {}  # CUDA runtime calls: syncs, mallocs, copies
    for event in prof.key_averages():
        if event.key.startswith("cuda") and event.key != "cudaLaunchKernel":
            runtime[event.key] = {"calls": event.count, "ms": event.cpu_time_total / 1e3}
        us = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if event.key.startswith("aten::") and us > 0:
            by_op[event.key] = us / 1e3
            calls[event.key] = event.count
    kernels = sorted((e for e in prof.events() if on_gpu and e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    gaps = sorted(((b.time_range.start - a.time_range.end, b.name[:60]) for a, b in
                   itertools.pairwise(kernels)), reverse=True)
    return {"wall_ms": wall, "busy_ms": sum(by_op.values()), "by_op_ms": by_op,
            "calls": calls, "kernels": len(kernels), "runtime": runtime,
            "idle_ms": sum(max(g, 0) for g, _ in gaps) / 1e3,
            "idle_over_50us_ms": sum(g for g, _ in gaps if g > 50) / 1e3,
            "largest_gaps_us_before": [(round(g, 1), name) for g, name in gaps[:12]]}


def _launch_ms(runner: Runner, context: Any, profiler: cProfile.Profile | None = None
               ) -> tuple[float, float]:
    """The host's ms to launch one step's forward (loss included) and the whole step: on a
    GPU, kernels run behind the host, so a step as long as its launch is host-bound."""
    with context():
        if runner.device == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        with autocast_context(runner.device, runner.autocast):
            loss = runner.loss_fn(runner.zm.model(*runner.args, **runner.kwargs))
        forward_ms = (time.perf_counter() - begin) * 1e3
        loss.backward()
        if profiler is not None:
            profiler.disable()
        step_ms = (time.perf_counter() - begin) * 1e3
        if runner.device == "cuda":
            torch.cuda.synchronize()
    runner._reset()
    return forward_ms, step_ms


def host_time(runner: Runner, context: Any, top: int = 30) -> dict[str, Any]:
    """The host's launch times of one step under ``context`` (`_launch_ms`), and of another
    under ``cProfile``: the ``top`` Python functions by own time, with their calls. The
    tracer slows the host, so its times are shares. It profiles the calling thread; on the
    H200 (torch 2.11) it listed the backward's recompute and pack hooks too."""
    forward_ms, step_ms = _launch_ms(runner, context)
    profiler = cProfile.Profile()
    _launch_ms(runner, context, profiler)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, calls, tt, ct, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {"forward_launch_ms": forward_ms, "step_launch_ms": step_ms, "top": [
        {"function": f"{Path(f).name}:{line} {name}", "calls": v[1], "self_ms": v[2] * 1e3,
         "total_ms": v[3] * 1e3} for (f, line, name), v in rows]}


def _case(zm: zoo.ZooModel, first: planner.Plan, runner: Runner, budget_gib: float,
          solve_s: float) -> dict[str, Any]:
    plan = replan(first, budget_gb=budget_gib, time_limit_s=solve_s)
    context = functools.partial(planned, zm.model, plan)
    runner.warm_up(zm.model)
    with context():  # the first planned call checks its op stream: not timed
        runner._step_ms(zm.model, contextlib.nullcontext)
    ms, base = runner.paired_ms(zm.model, context)
    plain = _kernel_time(runner, contextlib.nullcontext)
    ours = _kernel_time(runner, context)
    host = {"plain": host_time(runner, contextlib.nullcontext), "ours": host_time(runner, context)}
    predicted = predicted_rerun_by_op(plan)
    ops = sorted(set(ours["by_op_ms"]) | set(plain["by_op_ms"]) | set(predicted))
    extra = {op: ours["by_op_ms"].get(op, 0.0) - plain["by_op_ms"].get(op, 0.0) for op in ops}
    return {"budget_gib": budget_gib, "schedule": plan.schedule.describe(),
            "solver": plan.solver.name, "solver_status": plan.solver.status,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_recompute_ms": plan.recompute_ms,
            "predicted_overhead": plan.predicted_overhead,
            "profiled_step_ms": sum(n.fwd_time_ms + n.bwd_time_ms for n in plan.profile.nodes),
            "measured_step_ms": ms, "measured_base_ms": base,
            "measured_overhead": ms / base - 1, "plain": plain, "ours": ours,
            "predicted_rerun_by_op_ms": predicted, "measured_extra_by_op_ms": extra,
            "host_top": host}


def run(device: str, size: str, batch: int, cases: list[tuple[str | None, float]],
        steps: int, solve_s: float) -> dict[str, Any]:
    started = time.perf_counter()
    result: dict[str, Any] = {"device": device, "size": size, "batch": batch,
                              "torch": torch.__version__, "cases": [],
                              "device_name": torch.cuda.get_device_name() if device == "cuda"
                              else "cpu"}
    for precision in dict.fromkeys(p for p, _ in cases):
        dtype = getattr(torch, precision) if precision else None
        zm = zoo.get("gpt", device=device, size=size, batch=batch, dropout=0.0)
        runner = Runner(zm, device, steps, autocast=dtype, warmup=2)
        began = time.perf_counter()
        first = planner.optimize(zm.model, zm.example_inputs, budget_gb=1e6,
                                 loss_fn=zm.loss_fn, progress=False, autocast=dtype,
                                 timing="measure" if device == "cuda" else "estimate")
        profiled_s = time.perf_counter() - began
        forward = profiled_forward_by_op(first)
        for p, budget in cases:
            if p != precision:
                continue
            row = _case(zm, first, runner, budget, solve_s)
            row.update(precision=precision or "float32", profiled_s=profiled_s,
                       profiled_forward_by_op_ms=forward)
            result["cases"].append(row)
            print(render_case(row), flush=True)
        del zm, runner, first
        if device == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = time.perf_counter() - started
    return result


def render_case(row: dict[str, Any]) -> str:
    plain, ours = row["plain"], row["ours"]
    lines = [f"## {row['precision']} at {row['budget_gib']} GiB: measured "
             f"{row['measured_overhead']:+.1%}, predicted {row['predicted_overhead']:+.1%}", "",
             f"Schedule `{row['schedule']}` ({row['solver']}, {row['solver_status']}). "
             f"Step {row['measured_step_ms']:.1f} ms against {row['measured_base_ms']:.1f} ms "
             f"unplanned (the profile's step: {row['profiled_step_ms']:.1f} ms); predicted "
             f"recompute {row['predicted_recompute_ms']:.1f} ms. Under the profiler: wall "
             f"{ours['wall_ms']:.1f} / {plain['wall_ms']:.1f} ms, busy {ours['busy_ms']:.1f} / "
             f"{plain['busy_ms']:.1f} ms, kernels {ours['kernels']} / {plain['kernels']} "
             "(ours / unplanned). The host launches the forward in "
             f"{row['host_top']['ours']['forward_launch_ms']:.1f} / "
             f"{row['host_top']['plain']['forward_launch_ms']:.1f} ms and the step in "
             f"{row['host_top']['ours']['step_launch_ms']:.1f} / "
             f"{row['host_top']['plain']['step_launch_ms']:.1f} ms.", "",
             "| op | predicted rerun ms | measured extra ms | profile fwd ms | unplanned ms |",
             "|---|---|---|---|---|"]
    extra, predicted = row["measured_extra_by_op_ms"], row["predicted_rerun_by_op_ms"]
    fwd = row["profiled_forward_by_op_ms"]
    top = sorted(extra, key=lambda op: -max(abs(extra[op]), predicted.get(op, 0.0)))[:15]
    lines += [f"| {op} | {predicted.get(op, 0.0):.2f} | {extra[op]:+.2f} | "
              f"{fwd.get(op, 0.0):.2f} | {plain['by_op_ms'].get(op, 0.0):.2f} |" for op in top]
    return "\n".join(lines) + "\n"


def render(result: dict[str, Any]) -> str:
    head = [f"# Where a plan's measured step time and its prediction differ "
            f"({result['device_name']})", "",
            f"GPT ({result['size']}), batch {result['batch']}, torch {result['torch']}; "
            f"{result['wall_s']:.0f} s. Times of the profiler's step are GPU kernel self "
            "times per aten op (CPU times on the CPU).", ""]
    return "\n".join(head) + "\n" + "\n".join(render_case(r) for r in result["cases"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = gpt_parser(__doc__)
    parser.add_argument("--budgets", type=float, nargs="*", default=None,
                        help="GiB, each under --autocast (default: the lease's cases)")
    parser.add_argument("--autocast", choices=("bfloat16", "float16"), default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--solve-time-limit", type=float, default=15.0)
    opts = parser.parse_args(argv)
    cases = ([(opts.autocast, b) for b in opts.budgets] if opts.budgets is not None
             else list(CASES))
    result = run(opts.device, opts.size, opts.batch, cases, opts.steps, opts.solve_time_limit)
    opts.out.mkdir(parents=True, exist_ok=True)
    where = gpu_slug(torch.cuda.get_device_name()) if opts.device == "cuda" else "cpu"
    stem = opts.out / f"gpu-time-gaps-{where}-{time.strftime('%Y-%m-%d')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(render(result))
    return result


if __name__ == "__main__":
    main()
