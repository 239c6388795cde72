"""Our plan for the compiled step against ``activation_memory_budget`` at the fraction's own
peak, timed head to head on the CPU.

    python benchmarks/compile_head_to_head.py            # GPT small, Llama tiny, ResNet
    python benchmarks/compile_head_to_head.py --models hf-llama-tiny --modes blocks

`benchmarks/compile_cpu.py` times every row in its own loop of 7 steps, minutes apart: on
2 cores the fraction's own rows moved 20 % between neighbouring fractions, so its "ours
slower than the fraction" rows say little. Here each pairing is measured in one process
and one loop. A copy of the model is compiled (whole, or each repeated block) under
``torch._functorch.config.activation_memory_budget = fraction`` and its peak measured;
``optimize(..., compiled=mode)`` plans the model at that peak; a second copy takes the
plan and is compiled as planned; then ``ROUNDS`` rounds each run one step of both, in
turns (each goes first in every other round), and the result is the median of the rounds'
differences (ours minus the fraction, as a share of the fraction's median step) with the
order statistics that hold it with 95 % confidence (`frontier_measure.median_interval`).
Our copy's peak is measured again and must equal the one its plan records: a compiled
graph of another copy reused in its place would show there.

Writes benchmarks/results/compile-head-to-head-cpu.{json,md} (``--out`` to change the
folder; ``--models`` or ``--modes``: a stem naming them).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config
from compile_cpu import MODELS
from frontier_measure import median_interval
from torch import nn

import profiles
from planner import InfeasibleBudgetError, apply, optimize, zoo
from planner.verification import measure_step
from profiles.inputs import normalize_inputs

MIB = 2**20
RESULTS = Path(__file__).resolve().parent / "results"
FRACTIONS = (0.5, 0.2, 0.05)
ROUNDS, WARMUP = 31, 2


class Pairing:
    """One model's step on fixed inputs, compiled ``mode`` on copies of the model."""

    def __init__(self, zm: zoo.ZooModel, mode: str) -> None:
        self.zm, self.mode = zm, mode
        self.loss_fn = zm.loss_fn or profiles.default_loss
        self.args, self.kwargs = normalize_inputs(zm.model, zm.example_inputs)

    def compiled_copy(self, plan: Any = None, fraction: float = 1.0) -> nn.Module:
        """A copy of the model, ``plan`` applied, compiled, its first step (which compiles)
        run under ``activation_memory_budget=fraction``."""
        model = copy.deepcopy(self.zm.model)
        if plan is not None:
            apply(model, plan)
        targets = [model] if self.mode == "whole" else list(
            model.get_submodule(self.zm.block_prefix).children())
        for module in targets:
            module.compile()
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            self.step_ms(model)
        return model

    def step_ms(self, model: nn.Module) -> float:
        began = time.perf_counter()
        self.loss_fn(model(*self.args, **self.kwargs)).backward()
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - began) * 1e3

    def peak(self, model: nn.Module) -> int:
        return measure_step(model, self.args, self.kwargs, self.loss_fn, compiled=True)[0]

    def plan(self, budget: int) -> Any:
        """``optimize(..., compiled=)`` at ``budget``; where nothing fits, the least peak."""
        try:
            return optimize(self.zm.model, self.zm.example_inputs, budget_gb=budget / 2**30,
                            loss_fn=self.zm.loss_fn,
                            compiled="model" if self.mode == "whole" else self.mode,
                            timing="estimate", deterministic=True, progress=False)
        except InfeasibleBudgetError as error:
            return error.plan

    def duel(self, ours: nn.Module, theirs: nn.Module) -> dict[str, float]:
        """Rounds of one step each, in turns: the median difference (ours minus theirs) as a
        share of theirs' median step, and its 95 % interval."""
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(ROUNDS + WARMUP):
            order = ((0, ours), (1, theirs))
            for k, model in (order if i % 2 else order[::-1]):
                ms = self.step_ms(model)
                if i >= WARMUP:
                    times[k].append(ms)
        base = statistics.median(times[1])
        interval = median_interval([(a - b) / base for a, b in zip(*times, strict=True)])
        return {"ours_ms": statistics.median(times[0]), "fraction_ms": base, **interval}


def pairing_row(pairing: Pairing, fraction: float) -> dict[str, Any]:
    """One fraction's copy, our plan at its peak, both measured and timed. Dynamo is reset
    first: copies of one block share its code, and past dynamo's recompile limit their
    calls would run eager."""
    torch._dynamo.reset()
    theirs = pairing.compiled_copy(fraction=fraction)
    fraction_peak = pairing.peak(theirs)
    plan = pairing.plan(fraction_peak)
    ours = pairing.compiled_copy(plan)
    row = {"fraction": fraction, "fraction_peak": fraction_peak,
           "ours_peak": pairing.peak(ours), "planned_peak": plan.compiled.peak_bytes,
           "compiles": plan.compiled.compiles, **pairing.duel(ours, theirs)}
    print(f"  {pairing.mode} {fraction:g}: {row['median']:+.1%} "
          f"({row['low']:+.1%} to {row['high']:+.1%})", file=sys.stderr, flush=True)
    return row


def run(models: list[str], modes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in models:
        print(name, file=sys.stderr, flush=True)
        for mode in modes:
            torch.manual_seed(0)
            pairing = Pairing(MODELS[name](), mode)
            for fraction in FRACTIONS:
                rows.append({"model": name, "mode": mode, **pairing_row(pairing, fraction)})
    return rows


def report(rows: list[dict[str, Any]], meta: str) -> str:
    lines = [
        "# Ours compiled against the fraction at its peak, head to head (CPU)", "", meta, "",
        "| model | compiled | fraction | fraction peak MiB | ours peak MiB | as planned "
        "| within | fraction ms | ours ms | ours - fraction (95 % interval) | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = ("slower" if r["low"] > 0.02 else "faster" if r["high"] < -0.02
                   else "no slower (2 %)" if r["median"] <= 0.02 else "slower, within noise")
        off = r["ours_peak"] - r["planned_peak"]
        as_planned = "yes" if off == 0 else f"{off:+,} B"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['fraction']:g} | {r['fraction_peak'] / MIB:.3f} "
            f"| {r['ours_peak'] / MIB:.3f} | {as_planned} "
            f"| {'yes' if r['ours_peak'] <= r['fraction_peak'] else 'NO'} "
            f"| {r['fraction_ms']:.1f} | {r['ours_ms']:.1f} | {r['median']:+.1%} "
            f"({r['low']:+.1%} to {r['high']:+.1%}) | {verdict} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS))
    parser.add_argument("--modes", nargs="+", choices=("whole", "blocks"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    began = time.perf_counter()
    rows = run(args.models or list(MODELS), args.modes or ["whole", "blocks"])
    meta = (f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}, inductor C++; "
            f"{ROUNDS} rounds a pairing; {time.perf_counter() - began:.0f} s.")
    stem = "compile-head-to-head-cpu" + "".join(
        f"-{'-'.join(v)}" for v in (args.models, args.modes) if v)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / f"{stem}.md").write_text(report(rows, meta))
    print(report(rows, meta))


if __name__ == "__main__":
    main()
