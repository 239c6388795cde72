"""Is an offload plan's peak the same on every run? Offloaded plans measured twice each.

    python benchmarks/offload_release_check.py    # a GPU: GPT-2-medium (about 2 minutes);
                                                  # no GPU: the tiny GPT (seconds)

The hooks used to free a copy's device bytes when the host, polling, saw its copy end, so
the peak followed how far the host ran ahead of the GPU (an H100 measured one plan at
6.99 GiB, then 8.83 GiB over an 8.37 GiB budget; `offload-h100*.md`). Now a copy's device
bytes go at the end of the call its offload's `release` names, after waiting for the copy.
Measured here: every block offloaded and prefetched at the next block, released at its own
end (lag 0) and at the next block's (lag 1), and ours (`replan(..., offload=True)`) at the
H100 anchors; each twice, with the peak of a first and of a warm second step against the
prediction. Writes benchmarks/results/offload-release-<device>.{json,md} (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from frontier_measure import Runner
from offload_measured import ANCHORS_GIB, GIB, _measure
from record_profiles import gpu_slug

from planner import zoo
from planner.api import optimize, plan_for_schedule, replan
from planner.plan import Plan
from solvers import Schedule, joint

RESULTS = Path(__file__).resolve().parent / "results"


def _every_block(probe: Plan, lag: int) -> Plan:
    problem = probe.problem()
    blocks = [b for b in problem.blocks() if problem.is_call(*b)]
    schedule = Schedule.store_all(problem.n_nodes).with_offloads(
        joint.offloads(problem, blocks, blocks, 1, lag))
    return plan_for_schedule(probe.profile, schedule, probe.inputs,
                             probe.structure_fingerprint)


def bench(solve_time_limit_s: float) -> dict[str, Any]:
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    zm = zoo.get("gpt", size="gpt2-medium" if gpu else "tiny", batch=8 if gpu else 4,
                 dropout=0.0, device=device)
    runner = Runner(zm, device, 1, deadline=time.perf_counter() + 600, warmup=0)
    _, _, _, reference = runner.run(zm.model)
    probe = optimize(zm.model, zm.example_inputs, budget_gb=1e6, loss_fn=zm.loss_fn,
                     timing="estimate", device="H100" if gpu else "cpu", progress=False)
    static = probe.profile.static.total_bytes
    budgets = ([int(g * GIB) for g in ANCHORS_GIB[:2]] if gpu else
               [int(static + 0.4 * (probe.unplanned_peak_bytes - static))])
    plans = [(f"every block, release lag {lag}", _every_block(probe, lag)) for lag in (0, 1)]
    plans += [(f"ours at {b / GIB:.4g} GiB", replan(probe, budget_bytes=b, offload=True,
                                                    time_limit_s=solve_time_limit_s))
              for b in budgets]
    rows = [_measure(runner, zm, f"{label}, run {run}", plan, contextlib.nullcontext,
                     reference) for label, plan in plans for run in (1, 2)]
    name = torch.cuda.get_device_name() if gpu else "CPU"
    return dict(device_name=name, torch=torch.__version__,
                when=time.strftime("%Y-%m-%d %H:%M"), rows=rows)


def markdown(result: dict[str, Any]) -> str:
    out = ["# Offload: the same peak on every run", "",
           f"{result['when']}, {result['device_name']}, torch {result['torch']}. Plans timed "
           "by `estimate` (a GPU: the H100 roofline).", "",
           "| plan | moved GiB | peak GiB, first step | second step | predicted GiB | "
           "step vs unplanned | predicted overhead | grads |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        out.append(f"| {r['label']} | {r['offloaded_bytes'] / GIB:.3g} | "
                   f"{r['peak_bytes'] / GIB:.4f} | {r['warm_peak_bytes'] / GIB:.4f} | "
                   f"{r['predicted_peak_bytes'] / GIB:.4f} | "
                   f"{r['step_ms'] / r['base_step_ms'] - 1:+.1%} | "
                   f"{r['predicted_overhead']:.1%} | "
                   f"{'=' if r['grads_equal'] else 'DIFFER'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--solve-time-limit", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    opts = parser.parse_args(argv)
    result = bench(opts.solve_time_limit)
    gpu = result["device_name"] != "CPU"
    stem = "offload-release-" + (gpu_slug(result["device_name"]) if gpu else "cpu")
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (opts.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
