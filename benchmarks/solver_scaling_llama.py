"""How the planner scales with depth on real shapes: HF Llama profiled on the meta device.

    python benchmarks/solver_scaling_llama.py                      # 7B width, 8-126 layers
    python benchmarks/solver_scaling_llama.py --width 70b 405b --layers 80 126
    python benchmarks/solver_scaling_llama.py --offload            # keep, recompute or offload

Each model is HF ``LlamaForCausalLM`` at a Llama width (``--width``) with ``--layers``
decoder layers, built on the meta device in bf16, profiled for one step of batch 1 x
``--seq-len`` tokens with the H100's estimated timing (nothing is allocated), and planned at
the budget halfway between checkpointing every layer and no checkpointing, with the API's
default time limit. Printed per row: nodes, profile and solve time, the process's peak RSS,
the answer's overhead (recompute and, with ``--offload``, the time compute waits for copies
at the H100's host link), solver, status, proven gap and bytes moved each way. Writes
``benchmarks/results/solver-scaling-llama[-<widths>][-offload].{json,md}`` unless
``--no-write``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import time
from pathlib import Path

import torch

from planner import profile_model, solve, zoo
from planner.plan import format_bytes
from solvers import SOLVERS, Schedule, simulate

RESULTS = Path(__file__).resolve().parent / "results"


def row_of(width: str, layers: int, args: argparse.Namespace) -> dict:
    """Profile one shape and plan it halfway between every-layer checkpointing and none."""
    zm = zoo.get("hf-llama", size=width, batch=1, seq_len=args.seq_len, device="meta",
                 num_hidden_layers=layers)
    zm.model.to(torch.bfloat16)
    started = time.perf_counter()
    step = profile_model(zm.model, zm.example_inputs, device="H100", progress=args.progress)
    profiled = time.perf_counter()
    problem = step.problem()
    unplanned = simulate(problem, Schedule.store_all(problem.n_nodes)).peak_bytes
    every_layer = SOLVERS["every_block"](problem, 10**18, 1.0).peak_bytes
    budget = (unplanned + every_layer) // 2
    solving = time.perf_counter()
    plan = solve(step, budget_bytes=budget, time_limit_s=args.time_limit_s,
                 offload=args.offload)
    solved = time.perf_counter()
    return {"width": width, "layers": layers, "nodes": len(step.profile.nodes),
            "unplanned_bytes": unplanned, "every_layer_bytes": every_layer,
            "budget_bytes": budget, "planned_bytes": plan.predicted_peak_bytes,
            "overhead_pct": 100 * plan.predicted_overhead, "solver": plan.solver.name,
            "status": plan.solver.status, "gap": plan.solver.gap,
            "profile_s": round(profiled - started, 1), "solve_s": round(solved - solving, 1),
            "time_limit_s": args.time_limit_s, "offloaded_bytes": plan.offloaded_bytes,
            "stall_ms": plan.stall_ms,
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                                  2)}


def _gap(row: dict) -> str:
    return "-" if row["gap"] is None else f"{100 * row['gap']:.2f} %"


def _printed(row: dict) -> dict:
    print(f"{row['width']:>5} x {row['layers']:>3} layers, {row['nodes']:>5} nodes: profile "
          f"{row['profile_s']:>5} s, solve {row['solve_s']:>5} s, RSS {row['peak_rss_gib']} GiB; "
          f"budget {format_bytes(row['budget_bytes'])}: +{row['overhead_pct']:.2f} % "
          f"({row['solver']} {row['status']}, gap {_gap(row)}; moved "
          f"{format_bytes(row['offloaded_bytes'])})", flush=True)
    return row


def render(result: dict) -> str:
    """The results as a Markdown table."""
    lines = [f"# Solver scaling on Llama shapes ({result['date']}, torch {result['torch']}, "
             f"{result['machine']})", "",
             f"Batch 1 x {result['seq_len']} tokens, bf16, meta device, H100 estimate; budget "
             "halfway between every-layer checkpointing and none; "
             f"time limit {result['rows'][0]['time_limit_s']:.0f} s"
             + ("; offload=True (H100 host link)." if result.get("offload") else "."), "",
             "| width | layers | nodes | profile s | solve s | peak RSS GiB | budget | "
             "overhead | solver | status | gap | moved |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['width']} | {r['layers']} | {r['nodes']} | {r['profile_s']} | "
                     f"{r['solve_s']} | {r['peak_rss_gib']} | {format_bytes(r['budget_bytes'])}"
                     f" | {r['overhead_pct']:.2f} % | {r['solver']} | {r['status']} | "
                     f"{_gap(r)} | {format_bytes(r.get('offloaded_bytes', 0))} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", nargs="+", default=["7b"], choices=sorted(zoo.LLAMA_SIZES))
    parser.add_argument("--layers", nargs="+", type=int, default=[8, 16, 32, 80, 126])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--time-limit-s", type=float, default=60.0)
    parser.add_argument("--offload", action="store_true",
                        help="plan with offload=True (keep, recompute or offload)")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = [_printed(row_of(width, layers, args)) for width in args.width
            for layers in args.layers]
    if args.no_write:
        return
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "machine": f"{len(os.sched_getaffinity(0))} cores",
              "seq_len": args.seq_len, "offload": args.offload, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "solver-scaling-llama" + ("" if args.width == ["7b"] else "-" + "-".join(args.width))
    name += "-offload" if args.offload else ""
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{name}.md").write_text(render(result))


if __name__ == "__main__":
    main()
