"""Graphs that are not chains of blocks: how close do plans get, and what is proven?

    python benchmarks/dag_models.py               # U-Net, DenseNet-121, Inception-v3
    python benchmarks/dag_models.py --time-limit 20

For each model (random init, profiled on this CPU with estimated H100 times): the
unplanned peak, the all-schedule lower bound (`memory_lower_bound`: static memory plus the
largest working set of one op), CP-SAT's least peak over module calls and the space it is
proven over, then `auto` at that least peak and 10 % above it: status, recompute time, gap
and the space the claim holds over. Writes `benchmarks/results/dag-models.md`. Every number
is measured in the run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import time
from pathlib import Path

import torch
from conformance_harness import CASES

import profiles
from solvers import Schedule, auto, cpsat, memory_lower_bound, simulate
from solvers.from_profile import problem_from_profile

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ["U-Net (BatchNorm, concatenated skips)", "torchvision densenet121",
          "torchvision inception_v3"]
MiB = 2**20


def _row(name: str, time_limit_s: float) -> list[str]:
    case = next(c for c in CASES if c.name == name)
    zm = case.build()
    prof = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                            timing="estimate", progress=False)
    p = problem_from_profile(prof)
    store = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
    started = time.perf_counter()
    least = cpsat.min_peak(p, time_limit_s)
    least_s = time.perf_counter() - started
    lines = []
    for factor in (1.0, 1.1):
        budget = int(least.bytes * factor)
        started = time.perf_counter()
        sol = auto.solve(p, budget, time_limit_s)
        spent = time.perf_counter() - started
        claim = ("-" if not sol.feasible else
                 f"{sol.status.value} over {sol.space}" if sol.space else
                 f"{sol.status.value}, no proven bound")
        lines.append(
            f"| {name} | {p.n_nodes} | {len(p.module_spans or ())} | {store / MiB:.2f} | "
            f"{memory_lower_bound(p) / MiB:.2f} | {least.bytes / MiB:.2f} "
            f"({'proven' if least.optimal_over else 'best found'}, {least_s:.1f} s) | "
            f"x{factor:.1f} | {sol.status.value} | "
            f"{'-' if sol.objective_ms is None else f'{sol.objective_ms:.3f}'} | "
            f"{'-' if sol.gap is None else f'{100 * sol.gap:.1f} %'} | {claim} | "
            f"{spent:.1f} |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    header = ["| model | ops | module calls | unplanned MiB | all-schedule bound MiB | "
              "CP-SAT least peak MiB | budget | status | recompute ms | gap | claim | "
              "solve s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(header))
    rows = []
    for name in MODELS:
        case = next(c for c in CASES if c.name == name)
        if case.needs and importlib.util.find_spec(case.needs) is None:
            print(f"{name}: skipped, needs {case.needs}")
            continue
        rows += _row(name, args.time_limit)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dag-models.md").write_text(
        f"# Graphs that are not chains (CPU profile, estimated H100 times)\n\n"
        f"{datetime.date.today()}, torch {torch.__version__}, {args.time_limit:.0f} s per "
        f"solve, 2 threads. Budgets: CP-SAT's least peak over module calls, and 10 % "
        f"above.\n\n" + "\n".join(header + rows) + "\n")


if __name__ == "__main__":
    main()
