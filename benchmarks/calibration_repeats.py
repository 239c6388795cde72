"""The CPU region calibration, repeated: how far its fitted costs, and the overheads they
predict, move from one calibration of the same model to the next.

    python benchmarks/calibration_repeats.py --models gpt hf-gpt2 --repeats 5

Each repeat profiles the frontier's CPU model afresh (`planner.profile_model`, which
calibrates on the model: `planner.region_calibration`). From the plans the calibration
measured, the costs are fitted twice: without the plans' standard errors (every cost the
three plain plans tell apart, a step's cost included) and with them (a step cost below
`RESOLVED` standard errors is not charged), and each fit predicts the overhead of the
first block, the first two and every block recomputed. Prints one JSON line per repeat
and, per model, the range of each prediction over the repeats (the narrower, the steadier).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from frontier_measure import CPU_THREADS  # benchmarks/, the script's folder
from kept_memory import add_allocator_flag, chosen_allocator

from planner import region_calibration, zoo
from planner.profiling import profile_model
from profiles.schema import CheckpointCosts
from solvers import Problem, Schedule, simulate
from solvers.from_profile import problem_from_profile

MODELS = {"gpt": dict(size="small", batch=4),
          "hf-llama": dict(size="tiny", batch=4, seq_len=128, num_hidden_layers=4),
          "resnet": dict(batch=16), "hf-gpt2": dict(n_layer=4, batch=4, seq_len=128)}


def _predicted(problem: Problem, costs: CheckpointCosts, step_ms: float) -> list[float]:
    """Overhead (%) of the first block, the first two and every block recomputed."""
    charged = problem.model_copy(update={
        "checkpoint_region_ms": costs.region_ms, "checkpoint_pack_ms": costs.pack_ms,
        "checkpoint_sac_op_ms": costs.sac_op_ms, "checkpoint_range_ms": costs.range_ms,
        "checkpoint_step_ms": costs.step_ms})
    blocks = problem.blocks()
    return [round(100 * simulate(charged, Schedule.from_segments(problem.n_nodes, blocks[:k])
                                 ).recompute_time_ms / step_ms, 1)
            for k in (1, 2, len(blocks))]


def repeat(name: str) -> dict[str, Any]:
    """One calibration of ``name``: both fits, their predictions, the plans' ms and errors."""
    fits: list[tuple] = []
    fitted = region_calibration.fitted_costs

    def both(costs: CheckpointCosts, measured: list, errors: list | None = None
             ) -> CheckpointCosts:
        fits.append((fitted(costs, measured), fitted(costs, measured, errors), measured,
                     errors))
        return fits[-1][1]

    zm = zoo.get(name, **MODELS[name])
    region_calibration.fitted_costs = both
    try:
        step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, progress=False)
    finally:
        region_calibration.fitted_costs = fitted
    unresolved, resolved, measured, errors = fits[-1]
    problem = problem_from_profile(step.profile)
    step_ms = step.profile.step.fwd_ms + step.profile.step.bwd_ms
    row: dict[str, Any] = {"model": name}
    for tag, costs in (("every cost", unresolved), ("resolved step cost", resolved)):
        row[tag] = {"step_ms": round(costs.step_ms, 3), "region_ms": round(costs.region_ms, 3),
                    "range_ms": round(costs.range_ms, 3), "pack_ms": round(costs.pack_ms, 4),
                    "predicted": _predicted(problem, costs, step_ms)}
    row["plans_ms"] = [round(m[0], 2) for m in measured]
    row["plans_error_ms"] = [round(e, 2) for e in errors]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    add_allocator_flag(parser)
    args = parser.parse_args(argv)
    print(chosen_allocator(args))
    os.environ.setdefault("CHECKPOINT_PLANNER_CACHE", "off")
    torch.set_num_threads(CPU_THREADS)  # as the frontier times its rows
    for name in args.models:
        rows = [repeat(name) for _ in range(args.repeats)]
        for row in rows:
            print(json.dumps(row), flush=True)
        for tag in ("every cost", "resolved step cost"):
            spans = [(min(r[tag]["predicted"][k] for r in rows),
                      max(r[tag]["predicted"][k] for r in rows)) for k in range(3)]
            print(f"{name}, {tag}: predicted 1 / 2 / every block " + ", ".join(
                f"{lo:.1f}-{hi:.1f} %" for lo, hi in spans), flush=True)


if __name__ == "__main__":
    main()
