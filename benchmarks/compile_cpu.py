"""Compiled training steps on the CPU, measured: what inductor keeps, the 0-1 fraction peer,
hand policies compiled, our eager plans compiled, and our plans for the compiled step
(``optimize(..., compiled=)``, `planner.compile_fit`).

    python benchmarks/compile_cpu.py           # GPT small, HF Llama tiny, ResNet (~25 min)
    python benchmarks/compile_cpu.py --quick   # GPT tiny, whole model only
    python benchmarks/compile_cpu.py --models torchvision-mobilenet-v2 --modes whole

Each model is compiled whole (``torch.compile(model)``) and per block (each repeated block's
``module.compile()``, after its checkpoints, in torchtitan's order), with inductor's C++
backend, afresh for every row (``torch._dynamo.reset()``). Rows: the eager step; compiled
with nothing checkpointed; ``torch._functorch.config.activation_memory_budget`` at
``FRACTIONS`` (the min-cut partitioner's 0-1 budget, the peer users pick); hand policies
(`benchmarks/frontier_peers.py`: every layer, torchtitan's selective sac-matmuls); and
ours: the eager plan (`planner.optimize`, deterministic) at each fraction's measured peak,
applied, then compiled, its eager prediction beside what the compiled step measured; and
ours compiled: ``optimize(..., compiled="model" | "blocks")`` at each fraction's measured
peak (the compiled step's peak the plan records, measured while planning, beside what
this run measures again), with its planning time and compiled schedules tried.

Peak: the step's parameters, buffers, inputs and loss target plus the most the CPU allocator
held above its level when the step began (``planner.verification.measure_step`` with
``compiled=True``, the measure the planner's fit uses: `planner.measure.allocator_peak`;
inductor's generated code
allocates below the dispatcher, where `PeakTracker` sees nothing; on eager steps the two
agree, `tests/test_measure.py`). Time: the median of ``STEPS`` steps after the one that
compiles. Gradients: the relative error against the eager step's, over all parameters and
at the worst one (``frontier_measure.grads_global_rel_error``, ``grads_rel_error``;
compiling reorders floating point); models run with
dropout 0 (inductor draws its own masks).

Writes benchmarks/results/compile-cpu.{json,md} (``--models``: compile-cpu-<models>.*, and
``-<mode>`` after it with one ``--modes``; ``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from frontier_measure import grads_global_rel_error, grads_rel_error
from frontier_peers import peer_context

import profiles
from planner import InfeasibleBudgetError, apply, optimize, remove, replan, zoo
from planner.compiled_step import compiled as compiled_as_planned
from planner.runtime.partitioner import partitioner_budget_set
from planner.verification import measure_step
from profiles.inputs import normalize_inputs

GIB, MIB = 2**30, 2**20
RESULTS = Path(__file__).resolve().parent / "results"
FRACTIONS = (1.0, 0.5, 0.2, 0.05)  # 1.0: the partitioner's default (nothing recomputed)
PEERS = ("every-layer", "sac-matmuls")
STEPS = 7
MODELS: dict[str, Callable[[], zoo.ZooModel]] = {
    "gpt-small": lambda: zoo.get("gpt", size="small", dropout=0.0),
    "hf-llama-tiny": lambda: zoo.get("hf-llama"),
    "resnet": lambda: zoo.get("resnet"),
}
QUICK = {"gpt-tiny": lambda: zoo.get("gpt", size="tiny", dropout=0.0)}


def mobilenet_v2() -> zoo.ZooModel:
    """torchvision's MobileNetV2 (random init, 10 classes, dropout 0) on 8 images of 32 x 32; its
    blocks are ``features``' 19 modules."""
    import torch.nn.functional as F
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(num_classes=10, dropout=0.0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (8,), generator=generator)
    return zoo.ZooModel("torchvision mobilenet_v2", model, (x,),
                        lambda out: F.cross_entropy(out, y), "features")


MORE = {"torchvision-mobilenet-v2": mobilenet_v2}


class Step:
    """One model's training step on fixed inputs: measured peak, time and gradients."""

    def __init__(self, zm: zoo.ZooModel) -> None:
        self.zm, self.loss_fn = zm, zm.loss_fn or profiles.default_loss
        self.args, self.kwargs = normalize_inputs(zm.model, zm.example_inputs)

    def once(self) -> None:
        self.loss_fn(self.zm.model(*self.args, **self.kwargs)).backward()

    def measure(self) -> dict[str, Any]:
        """The step run once to warm up (compiling, where compiled), once measured
        (`planner.verification.measure_step`, as a compiled step: the allocator's count),
        then timed; gradients are the measured step's."""
        began = time.perf_counter()
        self.once()
        warm_s = time.perf_counter() - began
        self.zm.model.zero_grad(set_to_none=True)
        peak, _, grads = measure_step(self.zm.model, self.args, self.kwargs, self.loss_fn,
                                      compiled=True)
        times = []
        for _ in range(STEPS):
            began = time.perf_counter()
            self.once()
            times.append((time.perf_counter() - began) * 1e3)
            self.zm.model.zero_grad(set_to_none=True)
        return {"peak_bytes": peak, "step_ms": statistics.median(times), "warm_s": warm_s,
                "grads": grads}


@contextlib.contextmanager
def compiled(zm: zoo.ZooModel, mode: str, fraction: float | None = None) -> Iterator[None]:
    """The model's forward compiled whole or per block while inside, as the planner's fit
    compiles it (`planner.compiled_step.compiled`), the partition made at the warm-up step
    under ``activation_memory_budget=fraction`` (None: the one a plan applied set, else
    torch's default, 1.0)."""
    blocks = [f"{zm.block_prefix}.{name}" for name, _ in
              zm.model.get_submodule(zm.block_prefix).named_children()]
    with partitioner_budget_set(fraction), \
            compiled_as_planned(zm.model, "model" if mode == "whole" else mode, blocks):
        yield


def _row(rows: list[dict[str, Any]], reference: dict[str, torch.Tensor] | None,
         **fields: Any) -> dict[str, Any]:
    grads = fields.pop("grads", None)
    if grads is not None and reference is not None:
        fields["grad_rel_error"] = grads_rel_error(reference, grads)
        fields["grad_global_rel_error"] = grads_global_rel_error(reference, grads)
    rows.append(fields)
    shown = {k: v for k, v in fields.items() if k in ("model", "mode", "row", "status")}
    peak = fields.get("peak_bytes")
    print(f"  {shown} peak {peak / MIB:.3f} MiB" if peak else f"  {shown}", file=sys.stderr,
          flush=True)
    return fields


def _attempt(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return {"status": "ok", **measure()}
    except Exception as error:  # a row failing is a result to record
        return {"status": f"failed: {type(error).__name__}: {error}"[:300]}


def _planned_step(zm: zoo.ZooModel, step: Step, mode: str, plan: Any) -> dict[str, Any]:
    """``plan`` applied, the model compiled ``mode``, the step measured; the plan taken off."""
    apply(zm.model, plan)
    try:
        with compiled(zm, mode):
            return _attempt(step.measure)
    finally:
        remove(zm.model)


def _ours(zm: zoo.ZooModel, step: Step, mode: str, budget: int, plan: Any) -> dict[str, Any]:
    """Our eager plan at ``budget`` (or, where none fits, at its least peak), applied, then
    compiled ``mode``: its eager prediction and what the compiled step measured."""
    try:
        planned = replan(plan, budget_bytes=budget, deterministic=True)
    except InfeasibleBudgetError as error:
        planned = error.plan
    result = _planned_step(zm, step, mode, planned)
    return {**result, "budget_bytes": budget, "predicted_bytes": planned.predicted_peak_bytes,
            "eager_budget_bytes": planned.budget_bytes}


def _ours_compiled(zm: zoo.ZooModel, step: Step, mode: str, budget: int) -> dict[str, Any]:
    """Our plan for the compiled step at ``budget`` (or, where none fits, the least peak
    measured), applied, compiled as planned, measured again."""
    began = time.perf_counter()
    try:
        plan = optimize(zm.model, zm.example_inputs, budget_gb=budget / GIB,
                        loss_fn=zm.loss_fn, compiled="model" if mode == "whole" else mode,
                        timing="estimate", deterministic=True, progress=False)
    except InfeasibleBudgetError as error:
        plan = error.plan
    planning_s = time.perf_counter() - began
    result = _planned_step(zm, step, mode, plan)
    return {**result, "budget_bytes": budget, "predicted_bytes": plan.compiled.peak_bytes,
            "eager_budget_bytes": plan.compiled.eager_budget_bytes,
            "planning_s": planning_s, "compiles": plan.compiled.compiles,
            "recompile_limit_hit": plan.compiled.recompile_limit_hit}


def run_model(name: str, zm: zoo.ZooModel, modes: tuple[str, ...]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    step = Step(zm)
    eager = step.measure()
    reference = eager["grads"]
    plan = optimize(zm.model, zm.example_inputs, budget_gb=1e3, loss_fn=zm.loss_fn,
                    timing="estimate", deterministic=True, progress=False)
    _row(rows, reference, model=name, mode="eager", row="no checkpoint", status="ok",
         predicted_bytes=plan.unplanned_peak_bytes, **eager)
    for mode in modes:
        fraction_peaks = []
        for fraction in FRACTIONS:
            with compiled(zm, mode, fraction):
                result = _attempt(step.measure)
            _row(rows, reference, model=name, mode=mode, row=f"fraction {fraction:g}",
                 fraction=fraction, **result)
            if fraction < 1.0 and result.get("peak_bytes"):
                fraction_peaks.append((fraction, result["peak_bytes"]))
        for peer in PEERS:
            with peer_context(peer, zm), compiled(zm, mode):
                result = _attempt(step.measure)
            _row(rows, reference, model=name, mode=mode, row=peer, **result)
        for fraction, peak in fraction_peaks:
            _row(rows, reference, model=name, mode=mode, row=f"ours at fraction {fraction:g}",
                 **_ours(zm, step, mode, peak, plan))
        for fraction, peak in fraction_peaks:
            _row(rows, reference, model=name, mode=mode,
                 row=f"ours compiled at fraction {fraction:g}",
                 **_ours_compiled(zm, step, mode, peak))
    return rows


def report(rows: list[dict[str, Any]], meta: str) -> str:
    lines = ["# Compiled steps on the CPU, measured", "", meta, "",
             "Peak: parameters, buffers and inputs plus the CPU allocator's most above the "
             "step's start. `ours`: the eager plan at the fraction's measured peak, applied, "
             "then compiled; predicted is its eager prediction. `ours compiled`: "
             "`optimize(..., compiled=)` at that peak; predicted is the compiled peak the plan "
             "records (measured while planning); planning s (schedules compiled; where a "
             "measured step went past dynamo's recompile limit, its calls past it ran "
             "eager: `plan.compiled.recompile_limit_hit`).", "",
             "| model | compiled | row | peak MiB | predicted MiB | pred. error | budget MiB | "
             "within | step ms | planning s | grad rel. error (all / worst parameter) | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def mib(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key] / MIB:.3f}" if r.get(key) else "-"

        within = "-" if not (r.get("budget_bytes") and r.get("peak_bytes")) else \
            "yes" if r["peak_bytes"] <= r["budget_bytes"] else \
            f"no, +{100 * (r['peak_bytes'] / r['budget_bytes'] - 1):.1f} %"
        error = f"{r['grad_global_rel_error']:.1e} / {r['grad_rel_error']:.1e}" \
            if "grad_global_rel_error" in r else "-"
        ms = f"{r['step_ms']:.1f}" if r.get("step_ms") else "-"
        off = f"{100 * (r['peak_bytes'] / r['predicted_bytes'] - 1):+.2f} %" if \
            r.get("peak_bytes") and r.get("predicted_bytes") else "-"
        planning = f"{r['planning_s']:.0f} ({r['compiles']})" if "planning_s" in r else "-"
        if r.get("recompile_limit_hit") is not None:
            planning += f"; past dynamo's recompile limit ({r['recompile_limit_hit']})"
        lines.append(f"| {r['model']} | {r['mode']} | {r['row']} | {mib('peak_bytes')} | "
                     f"{mib('predicted_bytes')} | {off} | {mib('budget_bytes')} | {within} | "
                     f"{ms} | {planning} | {error} | {r['status'][:80]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT tiny, whole model only")
    parser.add_argument("--models", nargs="+", choices=sorted({**MODELS, **MORE}),
                        help="these models only (default: " + ", ".join(MODELS) + ")")
    parser.add_argument("--modes", nargs="+", choices=("whole", "blocks"),
                        default=("whole", "blocks"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    chosen = {name: {**MODELS, **MORE}[name] for name in args.models or MODELS}
    models, modes = (QUICK, ("whole",)) if args.quick else (chosen, tuple(args.modes))
    began = time.perf_counter()
    rows = [r for name, build in models.items() for r in run_model(name, build(), modes)]
    meta = (f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}, inductor C++; "
            f"{time.perf_counter() - began:.0f} s.")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "compile-cpu-quick" if args.quick else "compile-cpu" if not args.models else \
        "compile-cpu-" + "-".join(args.models)
    if not args.quick and len(args.modes) == 1:
        stem += f"-{args.modes[0]}"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / f"{stem}.md").write_text(report(rows, meta))
    print(report(rows, meta))


if __name__ == "__main__":
    main()
