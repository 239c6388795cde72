"""Plans of one or a few whole blocks on the CPU: the clock's prediction against the step.

    python benchmarks/few_regions.py          # about 5 minutes on 2 cores

The frontier's rows outside max(3 points, 15 %) are all predicted low, and all on plans of
few, small regions (issue 62). Here each repeated block is recomputed alone, then every
other block and each half of them, on a model profiled as `planner.optimize` profiles it
(op times measured, region costs calibrated on the model). Each plan, applied once to a
copy of the model as training applies it (`frontier_measure.Runner.applied`), is timed
against the plain step in interleaved pairs (`Runner.paired_ms`), ``REPEATS`` times: the
spread of the repeats is the noise a row's error is read against.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import warnings

import torch
from frontier_measure import CPU_THREADS, Runner  # benchmarks/, the script's folder
from kept_memory import DEFAULT_MALLOC, add_allocator_flag, chosen_allocator
from results_files import write_results

from planner import profile_model, zoo
from planner.api import plan_for_schedule
from solvers import Schedule

CASES = [("resnet", {}), ("gpt", {"size": "small"}), ("hf-llama", {"batch": 4})]
STEPS, REPEATS = 30, 3


def _groups(blocks: list[tuple[int, int]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """Each block alone, every other block, and each half."""
    half = len(blocks) // 2
    return [(f"block {k}", [b]) for k, b in enumerate(blocks)] + [
        ("even blocks", blocks[::2]), ("odd blocks", blocks[1::2]),
        ("first half", blocks[:half]), ("second half", blocks[half:])]


def case(name: str, options: dict) -> dict:
    zm = zoo.get(name, **options)
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, progress=False)
    costs = step.profile.checkpoint_costs
    runner = Runner(zm, "cpu", steps=STEPS)
    runner.warm_up(zm.model)
    n = len(step.profile.nodes)
    rows = []
    for label, group in _groups(step.problem().blocks()):
        plan = plan_for_schedule(step.profile, Schedule.from_segments(n, group), step.inputs,
                                 step.structure)
        module = runner.applied(plan)  # applied once, as training applies it
        runner.warm_up(module)  # the plan's first step checks its op stream
        measured = []
        for _ in range(REPEATS):
            ms, base = runner.paired_ms(module, contextlib.nullcontext)
            measured.append(100 * (ms / base - 1))
        predicted = 100 * plan.predicted_overhead
        rows.append({"plan": label, "regions": len(group), "predicted_pct": predicted,
                     "measured_pct": statistics.median(measured), "repeats_pct": measured,
                     "error_points": predicted - statistics.median(measured),
                     "rerun_ms": plan.recompute_ms, "step_ms": base})
        print(f"{name:9s} {label:12s} predicted {predicted:6.2f} %  measured "
              f"{statistics.median(measured):6.2f} % ({min(measured):.1f}..{max(measured):.1f})",
              flush=True)
    return {"model": name, "options": options, "rows": rows,
            "costs": {k: getattr(costs, k) for k in
                      ("region_ms", "pack_ms", "range_ms", "step_ms", "sac_op_ms")}}


def render(result: dict) -> str:
    lines = ["# Plans of few whole blocks on the CPU: predicted against measured",
             "", f"{result['date']}, torch {result['torch']}, {result['threads']} threads, "
             f"{STEPS} paired steps x {REPEATS} repeats a plan (`benchmarks/few_regions.py`); "
             f"memory: {result.get('allocator', DEFAULT_MALLOC)}.",
             "Error: predicted minus measured overhead (negative: predicted low)."]
    for c in result["cases"]:
        costs = ", ".join(f"{k} {v:.3f}" for k, v in c["costs"].items())
        lines += ["", f"## {c['model']} {c['options'] or ''}", "", f"Calibrated: {costs}.",
                  "", "| plan | regions | predicted % | measured % | repeats % | error, points |",
                  "|---|---:|---:|---:|---|---:|"]
        lines += [f"| {r['plan']} | {r['regions']} | {r['predicted_pct']:.2f} | "
                  f"{r['measured_pct']:.2f} | "
                  f"{' / '.join(f'{m:.1f}' for m in r['repeats_pct'])} | "
                  f"{r['error_points']:+.2f} |" for r in c["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[n for n, _ in CASES],
                        choices=[n for n, _ in CASES])
    add_allocator_flag(parser)
    parser.add_argument("--stem", default="few-regions-cpu", help="results file name")
    args = parser.parse_args(argv)
    allocator = chosen_allocator(args)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(CPU_THREADS)  # as the frontier times its rows
    result = {"date": datetime.datetime.now().isoformat(timespec="minutes"),
              "torch": torch.__version__, "machine": platform.machine(),
              "threads": torch.get_num_threads(), "allocator": allocator,
              "cases": [case(name, options) for name, options in CASES
                        if name in args.models]}
    write_results(args.stem, result, render)


if __name__ == "__main__":
    main()
