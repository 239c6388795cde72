"""The zoo in fp32 and under bf16 autocast: predicted vs measured peak of planned steps.

    python benchmarks/zoo_precision.py

Each zoo model (MLP, ResNet, GPT, HF GPT-2, HF Llama) is profiled in fp32 and under
``torch.autocast(bfloat16)``, planned at static memory + 0, 30 and 60 % of its activations
(the named minimum where that is infeasible), and one step measured with
``planner.verify`` on the CPU (``PeakTracker``) against the unplanned model under the same
precision. Prints one row per plan and writes ``benchmarks/results/zoo-precision.md``.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch

from planner import InfeasibleBudgetError, optimize, replan, verify, zoo
from planner.plan import format_bytes

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ["mlp", "resnet", "gpt", "hf-gpt2", "hf-llama"]
FRACTIONS = (0.0, 0.3, 0.6)


def main() -> None:
    torch.set_num_threads(2)
    started = time.perf_counter()
    lines = ["| model | precision | budget | planned at | predicted | measured | "
             "predicted - measured | within | grads |", "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    worst = []
    for name in MODELS:
        for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            model = zoo.get(name)
            first = optimize(model.model, model.example_inputs, budget_gb=1e3,
                             loss_fn=model.loss_fn, timing="estimate", progress=False,
                             autocast=dtype)
            static = first.profile.static.total_bytes
            for fraction in FRACTIONS:
                budget = int(static + fraction * (first.unplanned_peak_bytes - static))
                try:
                    plan, where = replan(first, budget_bytes=budget), "asked"
                except InfeasibleBudgetError as error:
                    plan, where = error.plan, "named minimum"
                report = verify(model.model, plan, model.example_inputs, model.loss_fn,
                                repeats=1)
                diff = report.predicted_peak_bytes - report.measured_peak_bytes
                worst.append(diff)
                lines.append(
                    f"| {name} | {precision} | +{100 * fraction:.0f} % | {where} | "
                    f"{format_bytes(report.predicted_peak_bytes)} | "
                    f"{format_bytes(report.measured_peak_bytes)} | {diff:+d} B "
                    f"({100 * report.peak_error:+.4f} %) | "
                    f"{'yes' if report.within_budget else 'NO'} | "
                    f"{'=' if report.losses_equal and report.grads_equal else 'DIFF'} |")
                print(lines[-1], flush=True)
    summary = (f"{len(worst)} plans; predicted - measured between {min(worst):+d} and "
               f"{max(worst):+d} bytes.")
    print(summary)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "zoo-precision.md").write_text(
        f"# Zoo plans in fp32 and under bf16 autocast (CPU)\n\n{datetime.date.today()}, torch "
        f"{torch.__version__}, {time.perf_counter() - started:.0f} s. {summary}\n\n"
        + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
