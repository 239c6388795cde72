"""Compiled training steps with their optimizer, on the CPU: the budget a plan for the
compiled step states, against the training step measured.

    python benchmarks/compile_optimizer.py            # GPT small, HF Llama tiny, ResNet
    python benchmarks/compile_optimizer.py --models gpt-small --modes whole

Per model (`benchmarks/compile_cpu.py`'s), compiled whole and per block, with AdamW: the
unplanned compiled training step's peak (forward, backward, ``optimizer.step()``, from the
second step on: `planner.verification.measure_training_step`), then at budgets ``SHARES``
of the way down from it to the optimizer's step (a floor under every schedule, and most of
the peak on a small model: Llama tiny's) our plan for the compiled step (``optimize(...,
compiled=, optimizer=)``: its recorded peak, the compiled forward and backward measured
plus the optimizer's state, or the optimizer's eager step) beside the training step
measured with the plan applied and compiled; and, for comparison, the eager plan at the
same budget (``optimize(..., optimizer=)``), applied and compiled, as the switches plan
today. The model's parameters and the optimizer's state are put back after every row.

Writes benchmarks/results/compile-optimizer-cpu.{json,md} (``--out`` another folder).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from compile_cpu import MODELS, compiled

import profiles
from planner import InfeasibleBudgetError, Plan, apply, optimize, remove, zoo
from planner.verification import measure_training_step
from profiles.inputs import normalize_inputs

MIB = 2**20
RESULTS = Path(__file__).resolve().parent / "results"
SHARES = (0.25, 0.5, 0.75)  # of the way from the unplanned step's peak to the floor


class TrainingStep:
    """One model with AdamW: its compiled training step's peak, each from the same
    parameters and an optimizer without state."""

    def __init__(self, zm: zoo.ZooModel) -> None:
        self.zm, self.loss_fn = zm, zm.loss_fn or profiles.default_loss
        self.args, self.kwargs = normalize_inputs(zm.model, zm.example_inputs)
        self.optimizer = torch.optim.AdamW(zm.model.parameters(), lr=1e-4)
        self.start = {k: v.detach().clone() for k, v in zm.model.state_dict().items()}

    def peak(self, mode: str, plan: Plan | None = None) -> int:
        model = self.zm.model
        if plan is not None:
            apply(model, plan)
        try:
            with compiled(self.zm, mode):
                return measure_training_step(model, self.args, self.kwargs, self.loss_fn,
                                             self.optimizer)
        finally:
            if plan is not None:
                remove(model)
            model.load_state_dict(self.start)
            self.optimizer.state.clear()

    def plan(self, budget: int, mode: str | None) -> tuple[Plan, bool, float]:
        """Our plan at ``budget`` (the compiled step's with ``mode``, else the eager one),
        whether it was found within it, and the planning seconds."""
        began = time.perf_counter()
        options: dict[str, Any] = {} if mode is None else \
            {"compiled": "model" if mode == "whole" else mode}
        try:
            plan = optimize(self.zm.model, self.zm.example_inputs, budget_gb=budget / 2**30,
                            loss_fn=self.zm.loss_fn, optimizer=self.optimizer,
                            timing="estimate", deterministic=True, progress=False, **options)
            found = True
        except InfeasibleBudgetError as error:
            plan, found = error.plan, False
        return plan, found, time.perf_counter() - began


def run_model(name: str, zm: zoo.ZooModel, modes: tuple[str, ...]) -> list[dict[str, Any]]:
    step, rows = TrainingStep(zm), []
    for mode in modes:
        unplanned = step.peak(mode)
        floor = step.plan(unplanned, mode)[0].compiled.optimizer_step_peak_bytes
        rows.append(_shown({"model": name, "mode": mode, "row": "no checkpoint",
                            "measured_bytes": unplanned, "floor_bytes": floor}))
        for share in SHARES:
            budget = int(unplanned - share * (unplanned - floor))
            for kind in ("ours compiled", "ours eager"):
                plan, found, planning_s = step.plan(budget, mode if kind == "ours compiled"
                                                    else None)
                predicted = plan.compiled.peak_bytes if plan.compiled else \
                    plan.predicted_peak_bytes
                measured = step.peak(mode, plan)
                rows.append(_shown({
                    "model": name, "mode": mode, "row": f"{kind} {share:g} down",
                    "budget_bytes": budget, "found": found, "predicted_bytes": predicted,
                    "measured_bytes": measured, "error": measured / predicted - 1.0,
                    "within": measured <= budget, "planning_s": planning_s,
                    "compiles": plan.compiled.compiles if plan.compiled else 0,
                    "optimizer_state_bytes": plan.compiled.optimizer_state_bytes
                    if plan.compiled else None}))
    return rows


def _shown(row: dict[str, Any]) -> dict[str, Any]:
    print(f"  {row['model']} {row['mode']} {row['row']}: measured "
          f"{row['measured_bytes'] / MIB:.3f} MiB"
          + (f", predicted {row['predicted_bytes'] / MIB:.3f}, budget "
             f"{row['budget_bytes'] / MIB:.3f}" if "budget_bytes" in row else ""),
          file=sys.stderr, flush=True)
    return row


def report(rows: list[dict[str, Any]], meta: str) -> str:
    lines = [f"# Compiled training steps with AdamW on the CPU, measured\n\n{meta}\n",
             "Measured: the training step (forward, backward, AdamW's step) from its second "
             "step on, the plan applied and the model compiled as planned "
             "(`planner.verification.measure_training_step`: parameters, buffers, inputs, "
             "target and the optimizer's state, plus the CPU allocator's most above them). "
             "Predicted: `plan.compiled.peak_bytes` for ours compiled, the eager simulator's "
             "peak for ours eager (the eager plan, compiled).\n",
             "| model | compiled | row | budget MiB | predicted MiB | measured MiB | error | "
             "within | planning s (compiles) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "budget_bytes" not in r:
            lines.append(f"| {r['model']} | {r['mode']} | {r['row']} (the optimizer's step: "
                         f"{r['floor_bytes'] / MIB:.3f}) | | | {r['measured_bytes'] / MIB:.3f} "
                         "| | | |")
            continue
        within = "yes" if r["within"] else \
            f"no, +{100 * (r['measured_bytes'] / r['budget_bytes'] - 1):.1f} %"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['row']}{'' if r['found'] else ' (none fits)'}"
            f" | {r['budget_bytes'] / MIB:.3f} | {r['predicted_bytes'] / MIB:.3f} | "
            f"{r['measured_bytes'] / MIB:.3f} | {100 * r['error']:+.2f} % | {within} | "
            f"{r['planning_s']:.0f} ({r['compiles']}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--modes", nargs="+", choices=("whole", "blocks"),
                        default=["whole", "blocks"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    began, rows = time.perf_counter(), []
    builders: dict[str, Callable[[], zoo.ZooModel]] = MODELS
    for name in args.models:
        print(name, file=sys.stderr, flush=True)
        rows += run_model(name, builders[name](), tuple(args.modes))
    meta = (f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}, inductor C++; "
            f"{time.perf_counter() - began:.0f} s.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile-optimizer-cpu.json").write_text(json.dumps(
        {"meta": meta, "shares": SHARES, "rows": rows}, indent=1))
    (args.out / "compile-optimizer-cpu.md").write_text(report(rows, meta))
    print(f"wrote {args.out}/compile-optimizer-cpu.{{json,md}}", file=sys.stderr)


if __name__ == "__main__":
    main()
