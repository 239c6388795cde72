"""Solver scaling on synthetic graphs (numpy only, no torch).

Transformer-like chains (embedding, N blocks of ~40 nodes, head + loss) and random DAGs of
about 100, 1,000, 5,000 and 20,000 nodes. For each graph the budget is halfway between the
lowest peak of every-block / Chen checkpointing and the no-checkpoint peak. Prints per
solver: solve time, status, gap, recompute time and the ratio of each baseline's recompute
time to the optimum.

    python benchmarks/solver_scaling.py            # full run (minutes)
    python benchmarks/solver_scaling.py --quick    # smoke run (< 30 s)
    python benchmarks/solver_scaling.py --real     # the profiled GPT-2-medium and Llama-7B
    python benchmarks/solver_scaling.py --dags     # the random DAGs only (about 6 min)

`--real` loads `benchmarks/data/*.problem.json` and solves each at static memory plus 30 %,
50 % and 80 % of the unplanned activations with `auto`, printing per budget: solver, status,
solve time, gap, recompute ms, peak GiB, and each baseline's recompute time over auto's.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solvers import SOLVERS, Problem, Schedule, Solution, simulate
from solvers.dp import search as dp
from solvers.testing import random_dag, transformer

MiB = 2**20


BASELINE_NAMES = ["none", "every_block", "every_2", "every_4", "chen_sqrt", "chen_greedy",
                  "save_matmuls"]


def _fmt(sol: Solution, opt: Solution | None) -> str:
    obj = f"{sol.objective_ms:10.2f}" if sol.objective_ms is not None else f"{'-':>10}"
    gap = f"{100 * sol.gap:6.2f}%" if sol.gap is not None else f"{'-':>7}"
    ratio = "-"
    if opt is not None and opt.objective_ms is not None and sol.objective_ms is not None:
        ratio = "inf" if opt.objective_ms == 0 and sol.objective_ms > 0 else (
            f"{sol.objective_ms / opt.objective_ms:.3f}" if opt.objective_ms else "1.000")
    peak = f"{sol.peak_bytes / MiB:9.0f}" if sol.peak_bytes is not None else f"{'-':>9}"
    return (f"  {sol.solver:<16} {sol.solve_time_s:8.2f}s {sol.status.value:<10} {gap} "
            f"{obj} {peak} {ratio:>7}")


def run_case(problem: Problem, exact: list[str], time_limit_s: float) -> None:
    """Solve one graph at a mid budget with the exact solvers and every baseline."""
    store = simulate(problem, Schedule.store_all(problem.n_nodes)).peak_bytes
    # the lowest peak a baseline reaches (every block on chains, Chen's segments on DAGs)
    low = min((SOLVERS[name](problem, 10**18, 1.0).peak_bytes or store)
              for name in ("every_block", "chen_sqrt", "chen_greedy"))
    budget = (min(low, store) + store) // 2
    chain = dp.applies(problem)
    print(f"\n{problem.name}: {problem.n_nodes} nodes, {len(problem.blocks())} blocks, "
          f"chain={chain}, budget {budget / MiB:.0f} MiB (no-ckpt peak {store / MiB:.0f} MiB)")
    print(f"  {'solver':<16} {'time':>9} {'status':<10} {'gap':>7} {'recomp_ms':>10} "
          f"{'peak_MiB':>9} {'ratio':>7}")
    opt = None
    for name in exact:
        t0 = time.perf_counter()
        sol = SOLVERS[name](problem, budget, time_limit_s)
        sol = sol.model_copy(update={"solve_time_s": time.perf_counter() - t0})
        if sol.feasible and (opt is None or sol.objective_ms < opt.objective_ms):
            opt = sol
        print(_fmt(sol, None))
    for name in BASELINE_NAMES:
        print(_fmt(SOLVERS[name](problem, budget, 10.0), opt))


REAL = ["gpt2-medium-b8.problem.json", "llama-7b-b1-s2048.problem.json"]
GiB = 2**30


def run_real(time_limit_s: float, fractions: tuple[float, ...] = (0.3, 0.5, 0.8)) -> None:
    """Solve the saved real problems at static + f * unplanned activations."""
    data = Path(__file__).resolve().parent / "data"
    for fname in REAL:
        path = data / fname
        if not path.exists():
            print(f"\n{fname}: missing, skipped")
            continue
        p = Problem.model_validate_json(path.read_text())
        unplanned = simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes
        print(f"\n{p.name} ({fname}): {p.n_nodes} nodes, {len(p.blocks())} blocks, static "
              f"{p.static_bytes / GiB:.2f} GiB, unplanned peak {unplanned / GiB:.2f} GiB, "
              f"pinned storages {len(dp.pinned_storages(p))}")
        for f in fractions:
            budget = int(p.static_bytes + f * (unplanned - p.static_bytes))
            t0 = time.perf_counter()
            sol = SOLVERS["auto"](p, budget, time_limit_s)
            wall = time.perf_counter() - t0
            gap = f"{100 * sol.gap:.2f}%" if sol.gap is not None else "-"
            obj = f"{sol.objective_ms:.2f}" if sol.objective_ms is not None else "-"
            peak = f"{sol.peak_bytes / GiB:.2f}" if sol.peak_bytes is not None else "-"
            extra = ""
            if not sol.feasible and sol.min_feasible_budget_bytes:
                extra = f" (min feasible >= {sol.min_feasible_budget_bytes / GiB:.2f} GiB)"
            print(f"  f={f:.1f} budget {budget / GiB:.2f} GiB: {sol.solver} {sol.status.value} "
                  f"{wall:.2f}s gap {gap} recompute {obj} ms peak {peak} GiB{extra}")
            ratios = []
            for name in BASELINE_NAMES:
                b = SOLVERS[name](p, budget, 10.0)
                if not b.feasible:
                    r = "infeasible"
                elif not sol.feasible:
                    r = "auto infeasible"
                elif sol.objective_ms == 0:
                    r = "1.000" if b.objective_ms == 0 else "inf"
                else:
                    r = f"{b.objective_ms / sol.objective_ms:.3f}"
                ratios.append(f"{name}={r}")
            print("    baseline/auto: " + ", ".join(ratios))


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small graphs only (< 30 s)")
    ap.add_argument("--real", action="store_true", help="the saved real problems only")
    ap.add_argument("--dags", action="store_true", help="the random DAGs only")
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.real:
        run_real(args.time_limit)
        return
    if args.quick:
        cases = [(transformer(4, 1), ["auto", "dp", "cpsat"]),
                 (random_dag(100), ["auto", "cpsat"])]
    else:
        cases = [
            (transformer(4, 1), ["auto", "dp", "cpsat"]),          # ~100 nodes
            (transformer(24, 2), ["auto", "dp", "cpsat"]),         # ~1,000 nodes
            (transformer(130, 2), ["auto", "dp"]),                # ~5,000 nodes
            (transformer(525, 2), ["auto", "dp"]),                # ~20,000 nodes
            (random_dag(100), ["auto", "cpsat", "dp"]),
            # CP-SAT's model alone takes minutes to build at 1,000 nodes; auto skips it
            (random_dag(1000), ["auto"]),
            (random_dag(5000), ["auto"]),
            (random_dag(20000), ["auto"]),
        ]
    if args.dags:
        cases = [case for case in cases if case[0].name == "random_dag"]
    limit = min(args.time_limit, 5.0) if args.quick else args.time_limit
    for problem, exact in cases:
        run_case(problem, exact, limit)


if __name__ == "__main__":
    main()
