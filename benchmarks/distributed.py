"""Per-rank plans under DDP and FSDP2, measured: two CPU processes over gloo.

    python benchmarks/distributed.py

For each zoo model and each sharding, plans made with ``optimize(world_size=2,
sharding=...)`` (a solved one at half way between the rank's static memory and its
unplanned peak, and the fixed every-block / save-matmuls / no-checkpoint schedules) are
applied, the model wrapped as torchtitan does (``fully_shard`` each unit, then the root; or
DDP), and one step measured on each rank with ``PeakTracker(follow_resizes=True)``. Prints
predicted vs measured per rank (the FSDP2 model is an upper bound: its slack is the
column) and whether losses and gradients equal the same wrapping of the unplanned model.
Writes ``benchmarks/results/distributed-cpu.{json,md}``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner import InfeasibleBudgetError, Plan, apply, optimize, replan, zoo
from planner.api import plan_for_schedule
from planner.plan import format_bytes
from solvers import baselines

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 2
MODELS = [("gpt", {"size": "small", "dropout": 0.0}), ("hf-gpt2", {"n_layer": 4}),
          ("hf-llama", {})]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def wrap(model: torch.nn.Module, plan: Plan) -> torch.nn.Module:
    """torchtitan's recipe: each FSDP2 unit, then the root; or DDP."""
    assert plan.sharding is not None
    if plan.sharding.kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for unit in plan.sharding.units:
            fully_shard(model.get_submodule(unit))
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def measured_step(model: torch.nn.Module, zm: zoo.ZooModel) -> tuple[int, float, list]:
    from planner.measure import PeakTracker
    from profiles import default_loss
    from profiles.inputs import normalize_inputs

    args, kwargs = normalize_inputs(model, zm.example_inputs)
    static = [*(_local(p) for p in model.parameters()), *model.buffers(),
              *(t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))]
    torch.manual_seed(0)  # the same dropout masks in both steps
    with PeakTracker(static, follow_resizes=True) as tracker:
        loss = (zm.loss_fn or default_loss)(model(*args, **kwargs))
        loss.backward()
    return tracker.peak_bytes, loss.item(), [_local(p.grad).clone() for p in model.parameters()
                                             if p.grad is not None]


def _rank(rank: int, name: str, options: dict, plans: list[str], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = []
    try:
        for path in plans:
            plan = Plan.load(path)
            # measured first, with nothing else alive: PeakTracker counts every tensor
            zm = zoo.get(name, **options)
            planned = wrap(apply(zm.model, plan), plan)
            peak, loss, grads = measured_step(planned, zm)
            del planned, zm
            zm = zoo.get(name, **options)
            _, base_loss, base_grads = measured_step(wrap(zm.model, plan), zm)
            del zm
            results.append({"peak": peak, "losses_equal": loss == base_loss,
                            "grads_equal": len(grads) == len(base_grads) and all(
                                torch.equal(a, b) for a, b in zip(grads, base_grads,
                                                                  strict=True))})
            del grads, base_grads
    finally:
        dist.destroy_process_group()
    torch.save(results, f"{out}.{rank}")


def _plans(name: str, options: dict, kind: str, folder: str) -> list[tuple[str, Plan]]:
    zm = zoo.get(name, **options)
    first = optimize(zm.model, zm.example_inputs, budget_gb=1e3, loss_fn=zm.loss_fn,
                     timing="estimate", world_size=WORLD, sharding=kind, progress=False)
    problem = first.problem()
    half = problem.static_bytes + (first.unplanned_peak_bytes - problem.static_bytes) // 2
    try:
        solved = replan(first, budget_bytes=half)
    except InfeasibleBudgetError as error:
        solved = error.plan
    plans = [("solved at 50 %", solved)]
    for strategy in ("none", "every_block", "save_matmuls"):
        schedule = baselines.BASELINES[strategy](problem, 2**62).schedule
        plans.append((strategy, plan_for_schedule(first.profile, schedule, first.inputs,
                                                  first.structure_fingerprint,
                                                  sharding=first.sharding)))
    out = []
    for k, (label, plan) in enumerate(plans):
        path = f"{folder}/{name}-{kind}-{k}.json"
        plan.save(path)
        out.append((label, plan, path))
    return out


def main() -> dict:
    torch.set_num_threads(2)
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for name, options in MODELS:
            for kind in ("ddp", "fsdp2"):
                plans = _plans(name, options, kind, folder)
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                out = f"{folder}/result"
                mp.spawn(_rank, args=(name, options, [p for _, _, p in plans], port, out),
                         nprocs=WORLD)
                per_rank = [torch.load(f"{out}.{r}") for r in range(WORLD)]
                for k, (label, plan, _) in enumerate(plans):
                    peak = max(res[k]["peak"] for res in per_rank)
                    rows.append({
                        "model": name, "sharding": kind, "plan": label,
                        "budget_bytes": plan.budget_bytes,
                        "predicted_bytes": plan.predicted_peak_bytes, "measured_bytes": peak,
                        "slack_pct": 100 * (plan.predicted_peak_bytes - peak) / peak,
                        "within_budget": peak <= plan.budget_bytes,
                        "equal": all(res[k]["losses_equal"] and res[k]["grads_equal"]
                                     for res in per_rank)})
                    r = rows[-1]
                    print(f"{name:9} {kind:6} {label:16} predicted "
                          f"{format_bytes(r['predicted_bytes']):>10} measured "
                          f"{format_bytes(peak):>10} slack {r['slack_pct']:+6.1f} % "
                          f"{'ok' if r['within_budget'] else 'OVER'} "
                          f"{'=' if r['equal'] else 'DIFF'}", flush=True)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "world_size": WORLD,
              "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distributed-cpu.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Per-rank plans under DDP and FSDP2 (CPU, gloo, {WORLD} ranks)", "",
             f"{result['date']}, torch {result['torch']}, {result['seconds']} s. Measured: "
             "the larger rank's peak.", "",
             "| model | sharding | plan | budget | predicted | measured | slack | "
             "within | losses, grads |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['sharding']} | {r['plan']} | "
                     f"{format_bytes(r['budget_bytes'])} | "
                     f"{format_bytes(r['predicted_bytes'])} | "
                     f"{format_bytes(r['measured_bytes'])} | {r['slack_pct']:+.1f} % | "
                     f"{'yes' if r['within_budget'] else 'NO'} | "
                     f"{'=' if r['equal'] else 'DIFF'} |")
    (RESULTS / "distributed-cpu.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
