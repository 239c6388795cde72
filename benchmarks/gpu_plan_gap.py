"""What an installed plan adds to a step's peak that the simulator does not see: a lease part.

On an H200 on 2026-11-29 (`benchmarks/results/README.md`, GPU, "Sixth lease") every bf16
planned step of GPT-2-medium peaked 771,572 B above its prediction, our plan with no region
(`ours @ none`) 1.1-1.8 MB above, where the warm unplanned bf16 step reads at its prediction
(fp32: every row 1,016 B above, the rounding of two scalars). So it comes with the plan
installed under autocast. This script takes, in about a minute:

- a plan of no region for the step (``optimize`` with an unbounded budget, ``timing=
  "estimate"``: the peak does not depend on the timing), applied as the frontier applies it;
- the warm step's peak without the plan and with it, and the plan's prediction;
- on a GPU, the allocations alive at each warm step's measured peak (the CUDA caching
  allocator's trace, with the Python frames that made them), and those held by one step and
  not the other: what the plan's step holds more at its peak.

    python benchmarks/gpu_plan_gap.py --autocast bfloat16   # on a GPU machine
    python benchmarks/gpu_plan_gap.py --device cpu --size tiny --batch 2   # the code path

Writes gpu-plan-gap-<gpu or cpu>[-<autocast>].{json,md} under ``--out``.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
from frontier_measure import planned
from gpu_peak_gaps import _live_at_peak, lead_main

import planner
from planner import zoo
from planner.verification import measure_step
from profiles.inputs import normalize_inputs


def _peak(zm: zoo.ZooModel, args: tuple, kwargs: dict, autocast: str | None,
          plan: planner.Plan | None, traced: bool) -> tuple[int, list[dict[str, Any]]]:
    """A step's measured peak (``plan`` applied around it, if any) and, when ``traced`` on
    a GPU, the allocations alive at the highest point of the allocator's trace."""
    if traced:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        if plan is None:
            peak = measure_step(zm.model, args, kwargs, zm.loss_fn, autocast)[0]
        else:
            with planned(zm.model, plan):
                peak = measure_step(zm.model, args, kwargs, zm.loss_fn, autocast)[0]
        live = _live_at_peak(torch.cuda.memory._snapshot()) if traced else []
    finally:
        if traced:
            torch.cuda.memory._record_memory_history(enabled=None)
    return peak, live


def _only_in(these: list[dict[str, Any]], others: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The allocations of ``these`` with no allocation of the same size and frames in
    ``others`` (as many as they outnumber them), largest first."""
    key = lambda e: (e["size"], tuple(e["frames"]))  # noqa: E731
    left = Counter(key(e) for e in these) - Counter(key(e) for e in others)
    out = [{"size": size, "frames": list(frames), "count": n}
           for (size, frames), n in left.items()]
    return sorted(out, key=lambda e: -e["size"] * e["count"])


def _sizes(live: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``live`` by size alone (hooks add frames to a planned step's allocations)."""
    return [{"size": e["size"], "frames": []} for e in live]


def run(device: str, size: str, batch: int, autocast: str | None) -> dict[str, Any]:
    started = time.perf_counter()
    zm = zoo.get("gpt", device=device, size=size, batch=batch, dropout=0.0)
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    plan = planner.optimize(zm.model, zm.example_inputs, budget_gb=1e6, loss_fn=zm.loss_fn,
                            timing="estimate", progress=False,
                            autocast=getattr(torch, autocast) if autocast else None)
    traced = device == "cuda"
    for _ in range(2):  # warm: library workspaces
        _peak(zm, args, kwargs, autocast, None, False)
    # the plan's first step (its first-call checks run), then warm ones
    first, first_live = _peak(zm, args, kwargs, autocast, plan, traced)
    _peak(zm, args, kwargs, autocast, plan, False)
    plain, plain_live = _peak(zm, args, kwargs, autocast, None, traced)
    with_plan, plan_live = _peak(zm, args, kwargs, autocast, plan, traced)
    return {"device": device, "size": size, "batch": batch, "autocast": autocast,
            "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name() if traced else "cpu",
            "schedule": plan.schedule.describe()[:200],
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "plain_peak_bytes": plain, "planned_peak_bytes": with_plan,
            "first_planned_peak_bytes": first,
            "first_minus_predicted": first - plan.predicted_peak_bytes,
            "only_in_first_step": _only_in(_sizes(first_live), _sizes(plan_live))[:40],
            "first_step_live": [e for e in first_live if e["size"] < 2 ** 22][:60],
            "planned_minus_predicted": with_plan - plan.predicted_peak_bytes,
            "plain_minus_predicted": plain - plan.predicted_peak_bytes,
            "only_with_plan": _only_in(_sizes(plan_live), _sizes(plain_live))[:40],
            "only_without_plan": _only_in(_sizes(plain_live), _sizes(plan_live))[:40],
            "wall_s": time.perf_counter() - started}


def render(result: dict[str, Any]) -> str:
    precision = f"{result['autocast']} autocast" if result.get("autocast") else "fp32"
    lines = [f"# What an installed plan adds to a step's peak ({result['device_name']})", "",
             f"GPT ({result['size']}), batch {result['batch']}, {precision}, torch "
             f"{result['torch']}; plan `{result['schedule'][:60]}`; {result['wall_s']:.0f} s.",
             "", f"Warm step without the plan: {result['plain_peak_bytes']:,} B; with it: "
             f"{result['planned_peak_bytes']:,} B; predicted {result['predicted_peak_bytes']:,}"
             f" B (with the plan minus predicted: {result['planned_minus_predicted']:,} B; "
             f"without: {result['plain_minus_predicted']:,} B). The plan's first step after "
             f"`apply`: {result['first_planned_peak_bytes']:,} B "
             f"({result['first_minus_predicted']:,} B over the prediction).", ""]
    for key, title in (("only_in_first_step", "Alive at the peak of the plan's first step "
                        "only, by size (against its warm step)"),
                       ("only_with_plan", "Alive at the peak with the plan only"),
                       ("only_without_plan", "Alive at the peak without the plan only")):
        lines += [f"{title} (size B x count: the Python frames that allocated):", ""]
        lines += [f"- {e['size']:,} x {e['count']}: {' < '.join(e['frames'][:4])}"
                  for e in result[key][:15]] or ["- none"]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return lead_main(__doc__, "gpu-plan-gap", run, render, argv)


if __name__ == "__main__":
    main()
