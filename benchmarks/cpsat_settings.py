"""CP-SAT as `solvers.cpsat._solver` sets it for each model, against CP-SAT's defaults.

Deterministic searches (one worker, CP-SAT's own units of work, the same verdict on any
load), so the two are compared in work, and in seconds on this machine beside it:

* the least recompute time at static + {30, 40, 50} % of the activations, warm-started
  from the DP's answer as `auto` does: ours with the fullest linearization
  (``cpsat.FULL_LP_LEVEL``), the default at level 1;
* the least peak (`cpsat.min_peak`): by binary search on the peak
  (``cpsat.PEAK_PROBE_CONFLICTS`` conflicts a probe), the default without.

    python benchmarks/cpsat_settings.py          # zoo GPT tiny and small, ResNet, HF GPT-2
    python benchmarks/cpsat_settings.py --dag    # also DeepLabV3-MobileNetV3, Inception-v3

Writes benchmarks/results/cpsat-settings.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import platform
import time
from collections.abc import Iterator
from typing import Any

from conformance_harness import CASES
from results_files import write_results

from planner import profile_model, zoo
from solvers import Problem, Schedule, cpsat, simulate
from solvers.dp import search as dp

FRACTIONS = (0.3, 0.4, 0.5)
DAG_CASES = ("torchvision deeplabv3_mobilenet_v3_large", "torchvision inception_v3")


@contextlib.contextmanager
def settings(ours: bool) -> Iterator[list]:
    """Ours, or CP-SAT's defaults (linearization level 1, no binary search); yields the list
    of solvers made in it, to read their work."""
    made: list = []
    saved = cpsat._solver, cpsat.FULL_LP_LEVEL, cpsat.PEAK_PROBE_CONFLICTS
    if not ours:
        cpsat.FULL_LP_LEVEL, cpsat.PEAK_PROBE_CONFLICTS = 1, -1

    def recorded(*args: Any, **kwargs: Any) -> Any:
        made.append(saved[0](*args, **kwargs))
        return made[-1]

    cpsat._solver = recorded
    try:
        yield made
    finally:
        cpsat._solver, cpsat.FULL_LP_LEVEL, cpsat.PEAK_PROBE_CONFLICTS = saved


def _problems(dag: bool) -> Iterator[tuple[str, Problem, int, int]]:
    """(name, problem, static bytes, unplanned peak) of each model."""
    models = [("gpt-tiny", zoo.get("gpt", size="tiny")), ("gpt-small", zoo.get("gpt")),
              ("resnet", zoo.get("resnet"))]
    if "hf-gpt2" in zoo.names():
        models.append(("hf-gpt2", zoo.get("hf-gpt2")))
    if dag:
        models += [(case.name, case.build()) for case in CASES if case.name in DAG_CASES]
    for name, zm in models:
        step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                             timing="estimate", progress=False)
        p = step.problem()
        yield (name, p, step.profile.static.total_bytes,
               simulate(p, Schedule.store_all(p.n_nodes)).peak_bytes)


def _least_time(p: Problem, budget: int, limit: float, ours: bool) -> dict[str, Any]:
    start = dp.solve(p, budget, math.inf)
    with settings(ours) as made:
        t0 = time.perf_counter()
        sol = cpsat.solve(p, budget, limit, hint=start.schedule if start.feasible else None,
                          deterministic=True)
        seconds = time.perf_counter() - t0
    return {"status": sol.status.value, "objective_ms": sol.objective_ms, "gap": sol.gap,
            "work": sum(s.deterministic_time for s in made), "seconds": seconds}


def _least_peak(p: Problem, limit: float, ours: bool) -> dict[str, Any]:
    with settings(ours) as made:
        t0 = time.perf_counter()
        least = cpsat.min_peak(p, limit, deterministic=True)
        seconds = time.perf_counter() - t0
    return {"peak_bytes": least.bytes or None, "proven": least.optimal_over is not None,
            "work": sum(s.deterministic_time for s in made), "seconds": seconds}


def run(dag: bool, limit: float) -> dict[str, Any]:
    rows = []
    for name, p, static, unplanned in _problems(dag):
        for frac in FRACTIONS:
            budget = static + int(frac * (unplanned - static))
            rows.append({"model": name, "nodes": p.n_nodes, "search": f"time @ {frac:.0%}",
                         **{side: _least_time(p, budget, limit, side == "ours")
                            for side in ("default", "ours")}})
            print(_line(rows[-1]), flush=True)
        rows.append({"model": name, "nodes": p.n_nodes, "search": "least peak",
                     **{side: _least_peak(p, limit, side == "ours")
                        for side in ("default", "ours")}})
        print(_line(rows[-1]), flush=True)
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.node(),
            "limit_units": limit, "rows": rows}


def _verdict(side: dict[str, Any]) -> str:
    if "proven" in side:
        found = f"{side['peak_bytes'] / 2**20:.3f} MiB" if side["peak_bytes"] else "none"
        return f"{found} {'proven' if side['proven'] else 'unproven'}"
    found = "none" if side["objective_ms"] is None else f"{side['objective_ms']:.4f} ms"
    return f"{found} {side['status']}"


def _line(row: dict[str, Any]) -> str:
    cells = [f"{_verdict(row[s])} | {row[s]['work']:.2f} | {row[s]['seconds']:.1f}"
             for s in ("default", "ours")]
    return f"| {row['model']} | {row['nodes']} | {row['search']} | {' | '.join(cells)} |"


def render(result: dict[str, Any]) -> str:
    head = ("| model | nodes | search | default: answer | work | s | ours: answer | work | s |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [_line(row) for row in result["rows"]]
    default = sum(r["default"]["work"] for r in result["rows"])
    ours = sum(r["ours"]["work"] for r in result["rows"])
    return (f"# CP-SAT settings, deterministic ({result['date']}, {result['machine']}, "
            f"{result['limit_units']} units a search)\n\n{head}\n" + "\n".join(lines)
            + f"\n\nWork in all: default {default:.2f} units, ours {ours:.2f}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dag", action="store_true", help="also two torchvision DAGs")
    parser.add_argument("--limit", type=float, default=10.0, help="units of work a search")
    args = parser.parse_args()
    write_results("cpsat-settings", run(args.dag, args.limit), render)


if __name__ == "__main__":
    main()
