"""Solve the zoo's real graphs: solve time, proven gap, and each baseline against the optimum.

For each model (GPT-2-medium shapes on the meta device, estimated H100 timings; the small
zoo models on CPU) and budgets of static + {30, 50, 80} % of the unplanned activations,
runs the `auto` solver and every baseline at the same budget, all scored by simulate().

    python benchmarks/zoo_solvers.py            # GPT-2-medium + small zoo models
    python benchmarks/zoo_solvers.py --quick    # small models only
"""

from __future__ import annotations

import argparse
import time

import profiles
from planner import zoo
from solvers import SOLVERS, Schedule, simulate
from solvers.baselines import BASELINES
from solvers.from_profile import problem_from_profile

GIB = 2**30


def cases(quick: bool) -> list[tuple[str, dict]]:
    small = [("gpt", dict(size="small", batch=4)), ("resnet", dict(batch=16)),
             ("mlp", dict(batch=1024, width=128, depth=4))]
    if "hf-gpt2" in zoo.names():
        small.append(("hf-gpt2", dict(batch=4)))
    if quick:
        return small
    return [("gpt", dict(size="gpt2-medium", batch=8, device="meta")), *small]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--time-limit", type=float, default=30.0)
    args = parser.parse_args()
    for name, kwargs in cases(args.quick):
        model = zoo.get(name, **kwargs)
        started = time.perf_counter()
        prof = profiles.profile(model.model, model.example_inputs, loss_fn=model.loss_fn,
                                timing="estimate", device="H100", progress=False)
        problem = problem_from_profile(prof)
        unplanned = simulate(problem, Schedule.store_all(problem.n_nodes))
        static = prof.static.total_bytes
        print(f"\n== {model.name} {kwargs}: {problem.n_nodes} nodes, profiled in "
              f"{time.perf_counter() - started:.1f} s; unplanned peak "
              f"{unplanned.peak_bytes / GIB:.3f} GiB, step {unplanned.total_time_ms:.1f} ms")
        print(f"{'budget':>22} {'solver':<14} {'status':<10} {'solve s':>8} {'gap':>7} "
              f"{'recompute ms':>13} {'peak GiB':>9} {'vs opt':>7}")
        for fraction in (0.3, 0.5, 0.8):
            budget = int(static + fraction * (unplanned.peak_bytes - static))
            label = f"static+{fraction:.0%} {budget / GIB:.3f}"
            best = SOLVERS["auto"](problem, budget, args.time_limit)
            rows = [("auto", best)] + [(n, s(problem, budget, args.time_limit))
                                       for n, s in BASELINES.items()]
            for solver_name, sol in rows:
                if sol.feasible:
                    check = simulate(problem, sol.schedule)
                    assert check.peak_bytes == sol.peak_bytes <= budget
                ratio = (f"{sol.objective_ms / best.objective_ms:.2f}"
                         if sol.feasible and best.feasible and best.objective_ms else
                         ("=" if sol.feasible and best.feasible else "-"))
                gap = "-" if sol.gap is None else f"{100 * sol.gap:.1f}%"
                objective = "-" if not sol.feasible else f"{sol.objective_ms:.3f}"
                peak = "-" if sol.peak_bytes is None else f"{sol.peak_bytes / GIB:.3f}"
                print(f"{label:>22} {solver_name:<14} {sol.status.value:<10} "
                      f"{sol.solve_time_s:>8.2f} {gap:>7} {objective:>13} {peak:>9} "
                      f"{ratio:>7}")
                if sol.feasible and best.feasible:
                    assert best.objective_ms <= sol.objective_ms + 1e-9, (solver_name, label)
                label = ""


if __name__ == "__main__":
    main()
