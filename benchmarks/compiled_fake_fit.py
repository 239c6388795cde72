"""Compiled plans made without running the model (``execution='fake'``), then run.

    python benchmarks/compiled_fake_fit.py           # 3 models x whole / per block x 3 budgets
    python benchmarks/compiled_fake_fit.py --quick   # GPT tiny, whole, one budget

``optimize(..., compiled=mode, execution='fake')`` profiles the eager step on fake tensors
and counts each schedule's compiled step on fake tensors (`planner.compiled_fake`): nothing
runs, so a model whose unplanned step does not fit the device can be planned. Each plan is
then run, compiled as it was counted (`planner.compiled_step.CompiledStep`, the CPU
allocator's events, as the measured fit measures): its measured peak against its budget and
against the count its plan records, its step time against the one its plan predicts (from
its kernels, `profiles.compiled_time`: the fit picks the fastest predicted), and the seconds
planning took. GPT tiny, the zoo's HF
Llama and its ResNet (dropout 0: inductor draws its own masks), compiled whole and per
block, at 0.9 / 0.75 / 0.6 of the eager step's peak; GPT tiny again under
``torch.autocast(bfloat16)``, a setting nothing here was tuned for.

Writes benchmarks/results/compiled-fake-fit-cpu.{json,md} (``--quick``: ...-quick.*).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import profiles
from planner import InfeasibleBudgetError, optimize, profile_model, zoo
from planner.compiled_step import CompiledStep
from profiles.inputs import normalize_inputs

MIB = 2**20
RESULTS = Path(__file__).resolve().parent / "results"
MODELS: dict[str, tuple[Callable[[], zoo.ZooModel], torch.dtype | None]] = {
    "gpt-tiny": (lambda: zoo.get("gpt", size="tiny", dropout=0.0), None),
    "hf-llama-tiny": (lambda: zoo.get("hf-llama"), None),
    "resnet": (lambda: zoo.get("resnet"), None),
    "gpt-tiny bf16 autocast": (lambda: zoo.get("gpt", size="tiny", dropout=0.0), torch.bfloat16),
}
FRACTIONS = (0.9, 0.75, 0.6)


def _row(name: str, make: Callable[[], zoo.ZooModel], autocast: torch.dtype | None, mode: str,
         fraction: float) -> dict[str, Any]:
    zm = make()
    loss_fn = zm.loss_fn or profiles.default_loss
    eager = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, autocast=autocast,
                          timing="estimate", progress=False).unplanned_peak_bytes
    budget = int(fraction * eager)
    began = time.perf_counter()
    try:
        plan = optimize(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, autocast=autocast,
                        budget_gb=budget / 2**30, compiled=mode, execution="fake",
                        deterministic=True, progress=False)
        fits = True
    except InfeasibleBudgetError as error:
        plan, fits = error.plan, False
    planning_s = time.perf_counter() - began
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    measured, measured_ms, _ = CompiledStep(zm.model, args, kwargs, loss_fn, mode,
                                            plan.compiled.blocks,
                                            autocast_dtype=plan.autocast_dtype).run(plan)
    counted = plan.compiled.peak_bytes
    return {"model": name, "mode": mode, "fraction": fraction, "budget": budget,
            "eager_unplanned": eager, "fits": fits, "counted": counted, "measured": measured,
            "within_budget": measured <= budget, "error": (counted - measured) / measured,
            "source": plan.compiled.source, "compiles": plan.compiled.compiles,
            "planning_s": planning_s, "predicted_ms": plan.compiled.step_ms,
            "measured_ms": measured_ms}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    held = sum(r["within_budget"] for r in rows if r["fits"])
    close = sum(abs(r["error"]) <= 0.01 for r in rows)
    out = ["# Compiled plans counted on fake tensors, then run", "",
           f"{result['when']}, {result['machine']}; torch {result['torch']}. "
           "`optimize(..., compiled=mode, execution='fake')`: every schedule counted, none "
           "run; then the plan run compiled, measured by the CPU allocator's events.", "",
           f"**{held} of {sum(r['fits'] for r in rows)} plans measured within their budget; "
           f"{close} of {len(rows)} counts within 1 % of the measured peak.**", "",
           "| model | compiled | budget (of eager peak) | plan | counted | measured | "
           "count - measure | within budget | schedule | step predicted | step measured | "
           "compiles | planning |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['mode']} | {r['budget'] / MIB:.3f} MiB "
                   f"({r['fraction']:.2f}) | {'fits' if r['fits'] else 'least (error.plan)'} | "
                   f"{r['counted'] / MIB:.3f} MiB | {r['measured'] / MIB:.3f} MiB | "
                   f"{r['error']:+.3%} | {'yes' if r['within_budget'] else 'no'} | "
                   f"{r['source']} | {_ms(r.get('predicted_ms'))} | "
                   f"{_ms(r.get('measured_ms'))} | {r['compiles']} | {r['planning_s']:.0f} s |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="GPT tiny, whole, one budget")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    cases = ([("gpt-tiny", "model", 0.75)] if args.quick else
             [(name, mode, f) for name in MODELS for mode in ("model", "blocks")
              for f in FRACTIONS if "autocast" not in name or (mode, f) == ("model", 0.75)])
    rows = []
    for name, mode, fraction in cases:
        row = _row(name, *MODELS[name], mode, fraction)
        rows.append(row)
        print(f"{name} {mode} at {fraction:.2f}: counted {row['counted'] / MIB:.3f} MiB, "
              f"measured {row['measured'] / MIB:.3f} ({row['error']:+.3%}), budget "
              f"{row['budget'] / MIB:.3f}{'' if row['fits'] else ' (no fit)'}, "
              f"{row['planning_s']:.0f} s", flush=True)
    result = {"when": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("compiled-fake-fit-cpu" + ("-quick" if args.quick else ""))
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {stem}.json, .md")
    return result


if __name__ == "__main__":
    main()
