"""Where a checkpoint region's time goes on the CPU, against what the clock charges.

    python benchmarks/region_costs.py          # about 4 minutes on 2 cores

For a model checkpointed at every block (each block's call one region), at several batch
sizes, four steps are timed in interleaved rounds (process CPU time, one thread, lower
quartiles): the unplanned step, the step under our installed plan (``planner.apply``),
the same blocks under raw ``torch.utils.checkpoint`` (non-reentrant), and the regions'
forwards alone (each block on its own recorded input, grad enabled: what the reruns run).
Against the plan's clock (`solvers.clock`): the rerun node time and the overhead term it
charges. Per region:

* checkpoint beyond the reruns = (raw - unplanned - forwards) / regions: what torch's
  checkpoint costs per region, measured;
* the clock's overhead term / regions: what the plan charges for it;
* ours over raw = (ours - raw) / regions: what our installed wrapper adds.

Issue 62 (the step's clock) reads these: a region's cost the clock does not see is why
plans of many regions measure slower than predicted.
"""

from __future__ import annotations

import copy
import datetime
import platform
import time
import warnings

import torch
from results_files import write_results  # benchmarks/, the script's folder
from torch.utils.checkpoint import checkpoint

from planner import apply, profile_model, zoo
from planner.api import plan_for_schedule
from profiles import default_loss
from profiles.calibrate import interleaved_ms, lower_quartile
from profiles.inputs import normalize_inputs
from solvers import baselines
from solvers.clock import rerun_overhead_ms

CASES = [("gpt", {"size": "small", "batch": b}) for b in (1, 4, 16)] + [
    ("hf-llama", {"batch": 4})]
ROUNDS = 25


def _raw(model: torch.nn.Module, blocks: str) -> torch.nn.Module:
    """A copy whose blocks run under raw non-reentrant checkpoint."""
    raw = copy.deepcopy(model)
    for block in raw.get_submodule(blocks):
        forward = block.forward
        block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False,
                                                              **k))(forward)
    return raw


def _block_inputs(model: torch.nn.Module, blocks: str, args: tuple,
                  kwargs: dict) -> list[tuple[torch.nn.Module, tuple, dict]]:
    """Each block with the inputs it got in one forward (detached)."""
    got = []

    def grab(module, a, k):
        got.append((module, tuple(x.detach() if isinstance(x, torch.Tensor) else x
                                  for x in a), dict(k)))

    handles = [b.register_forward_pre_hook(grab, with_kwargs=True)
               for b in model.get_submodule(blocks)]
    with torch.no_grad():
        model(*args, **kwargs)
    for h in handles:
        h.remove()
    return got


def case(name: str, options: dict) -> dict:
    zm = zoo.get(name, **options)
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    loss_fn = zm.loss_fn or default_loss
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="measure",
                         progress=False)
    problem = step.problem()
    plan = plan_for_schedule(step.profile,
                             baselines.BASELINES["every_block"](problem, 2**62).schedule,
                             step.inputs, step.structure)
    regions = plan.schedule.recompute_regions()
    overhead = sum(rerun_overhead_ms(plan.problem(), r.start, r.stop) for r in regions)
    ours = copy.deepcopy(zm.model)
    apply(ours, plan)
    raw = _raw(zm.model, zm.block_prefix)
    inputs = _block_inputs(zm.model, zm.block_prefix, args, kwargs)

    def run(model):
        def go() -> None:
            torch.manual_seed(0)
            loss_fn(model(*args, **kwargs)).backward()
            model.zero_grad(set_to_none=True)
        return go

    def forwards() -> None:
        torch.manual_seed(0)
        outs = [block(*(a.requires_grad_() if isinstance(a, torch.Tensor) and
                        a.is_floating_point() else a for a in a_), **k)
                for block, a_, k in inputs]
        del outs

    samples = interleaved_ms({"unplanned": run(zm.model), "ours": run(ours),
                              "raw": run(raw), "forwards": forwards},
                             torch.device("cpu"), rounds=ROUNDS)
    q = {k: lower_quartile(v) for k, v in samples.items()}
    n = len(regions)
    return {"model": f"{name} {options}", "regions": n, **{f"{k}_ms": v for k, v in q.items()},
            "clock_rerun_nodes_ms": plan.recompute_ms - overhead, "clock_overhead_ms": overhead,
            "checkpoint_per_region_ms": (q["raw"] - q["unplanned"] - q["forwards"]) / n,
            "clock_per_region_ms": overhead / n,
            "ours_over_raw_per_region_ms": (q["ours"] - q["raw"]) / n,
            "calibrated": step.profile.checkpoint_costs.model_dump()
            if step.profile.checkpoint_costs else None}


def render(result: dict) -> str:
    lines = [f"# Region costs on the CPU ({result['date']}, torch {result['torch']}, "
             f"{result['seconds']:.0f} s)", "",
             "Every block one region; lower quartiles of interleaved steps, process CPU time, "
             "one thread (benchmarks/region_costs.py says what each column is).", "",
             "| model | regions | unplanned ms | ours ms | raw checkpoint ms | region forwards "
             "ms | clock's rerun nodes ms | checkpoint per region ms | clock per region ms | "
             "ours over raw per region ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['regions']} | {r['unplanned_ms']:.2f} | {r['ours_ms']:.2f} "
            f"| {r['raw_ms']:.2f} | {r['forwards_ms']:.2f} | {r['clock_rerun_nodes_ms']:.2f} "
            f"| {r['checkpoint_per_region_ms']:.3f} | {r['clock_per_region_ms']:.3f} | "
            f"{r['ours_over_raw_per_region_ms']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = []
    for name, options in CASES:
        print(f"{name} {options}", flush=True)
        rows.append(case(name, options))
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "machine": platform.machine(),
              "seconds": time.perf_counter() - started, "rows": rows}
    write_results("region-costs-cpu", result, render)


if __name__ == "__main__":
    main()
