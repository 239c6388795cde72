"""Per-rank plans under FSDP2, tensor parallel and a 2-D mesh: predicted against measured.

    python benchmarks/distributed.py [--modes gloo fake] [--models gpt hf-llama ...]
                                     [--no-write]

Each row is one model under one parallelize recipe on one world: plans made with
``optimize(parallelize=recipe, mesh_shape=...)`` (unplanned, solved half way between the
rank's static memory and its unplanned peak, and the fixed every-block and save-matmuls
schedules) are applied to a fresh model, the same recipe parallelizes it, and one step is
measured per rank with ``PeakTracker`` (FSDP2's storage resizes followed, DTensors by
their shards, minus what the process held that the step never touched):

* ``gloo``: two and four CPU processes; the planned model's loss and gradients must equal
  those of the same parallel model unplanned (``=``); each plan's peak is the least of two
  steps (``least_peak_over_gloo``: gloo's worker thread drops a collective's output late);
* ``fake``: one process under torch's fake process group at 8 and 64 ranks, with torch's
  ``FSDPMemTracker`` beside ours on the FSDP2 rows (its peak, not ours, in the last
  column; a fake group leaves collective outputs unwritten, so losses are not compared).

Plans are for gloo, the backend the ranks run (``device="cpu"``), measured as gloo runs its
collectives, not patched; each row also replays the plan on the step profiled for NCCL
(``device="H100"``), whose reduce-scatters work in place: what differs there.

Recipes: FSDP2 in fp32, in bf16 ``MixedPrecisionPolicy`` (``reduce_dtype=fp32``), bf16
without ``reshard_after_forward``; tensor parallel on 2 ranks and a 2 x 2 data x tensor
mesh (HF Llama's and Qwen2's own TP plan, FSDP2 over ``dp``). Writes
``benchmarks/results/distributed-cpu.{json,md}`` unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gloo_ranks import free_port, spawn_ranks

from planner import InfeasibleBudgetError, Plan, apply, optimize, replan, zoo
from planner.api import plan_for_schedule
from planner.measure import least_peak_over_gloo
from planner.plan import format_bytes
from solvers import baselines

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"gpt": ("gpt", {"size": "small", "dropout": 0.0}),
          "hf-gpt2": ("hf-gpt2", {"n_layer": 4}),
          "hf-llama": ("hf-llama", {}),
          "hf-qwen2": ("hf-qwen2", {})}
TP_MODELS = ("hf-llama", "hf-qwen2")  # nn.Linear projections named as HF's TP plan names
GLOO_RUNS = [(2, r) for r in ("fsdp2-fp32", "fsdp2-bf16", "fsdp2-bf16-keep", "tp")] + \
    [(4, r) for r in ("fsdp2-bf16", "dp-tp")]
FAKE_RUNS = [(w, r) for w in (8, 64) for r in ("fsdp2-fp32", "fsdp2-bf16",
                                               "fsdp2-bf16-keep", "dp-tp")]


# ----------------------------------------------------------------------------- models


def build(name: str) -> zoo.ZooModel:
    """A zoo model, or a small HF Qwen2 (random init) for the second TP family."""
    if name != "hf-qwen2":
        key, options = MODELS[name]
        return zoo.get(key, **options)
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=128, intermediate_size=344,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1024,
                                      use_cache=False, max_position_embeddings=128)
    model = transformers.Qwen2ForCausalLM(config)
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
    return zoo.ZooModel("hf-qwen2", model, {"input_ids": ids, "labels": ids}, None,
                        "model.layers", {})


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    for path in ("blocks", "transformer.h", "model.layers"):
        try:
            return list(model.get_submodule(path))
        except AttributeError:
            continue
    raise ValueError(f"no blocks in {type(model).__name__}")


# ----------------------------------------------------------------------------- recipes


def _fsdp2(model: torch.nn.Module, mesh: Any, dtype: torch.dtype | None,
           reshard: bool = True) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype,
                                  reduce_dtype=torch.float32 if dtype else None)
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp2_fp32(model: torch.nn.Module, mesh: Any) -> None:
    _fsdp2(model, mesh, None)


def fsdp2_bf16(model: torch.nn.Module, mesh: Any) -> None:
    _fsdp2(model, mesh, torch.bfloat16)


def fsdp2_bf16_keep(model: torch.nn.Module, mesh: Any) -> None:
    _fsdp2(model, mesh, torch.bfloat16, reshard=False)


def tensor_parallel(model: torch.nn.Module, mesh: Any) -> None:
    """HF's TP plan for Llama-style layers on ``mesh["tp"]``, then FSDP2 over ``dp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    col, row = ColwiseParallel(), RowwiseParallel()
    for layer in blocks(model):
        parallelize_module(layer, mesh["tp"], {
            "self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
            "self_attn.o_proj": row, "mlp.gate_proj": col, "mlp.up_proj": col,
            "mlp.down_proj": row})
    if "dp" in mesh.mesh_dim_names:
        for layer in blocks(model):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])


RECIPES = {"fsdp2-fp32": fsdp2_fp32, "fsdp2-bf16": fsdp2_bf16,
           "fsdp2-bf16-keep": fsdp2_bf16_keep, "tp": tensor_parallel,
           "dp-tp": tensor_parallel}


def mesh_of(recipe: str, world: int) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    if recipe == "tp":
        return (world,), ("tp",)
    if recipe == "dp-tp":
        return (world // 2, 2), ("dp", "tp")
    return (world,), None


# ----------------------------------------------------------------------------- plans


def unplanned(name: str, recipe: str, world: int, device: str) -> Plan:
    """The rank's step under ``recipe``, planned for ``device`` (the CPU: gloo's collectives;
    a GPU: NCCL's) at a budget it fits as it is."""
    zm = build(name)
    shape, names = mesh_of(recipe, world)
    return optimize(zm.model, zm.example_inputs, budget_gb=1e3, loss_fn=zm.loss_fn,
                    parallelize=RECIPES[recipe], mesh_shape=shape, mesh_dim_names=names,
                    progress=False, device=device)


def plans_for(name: str, recipe: str, world: int) -> list[tuple[str, Plan]]:
    """Unplanned, solved half way, every block and save-matmuls, per rank of ``world``:
    for gloo, the backend these CPU ranks run (`profiles.parallel.Parallelism.backend`)."""
    first = unplanned(name, recipe, world, "cpu")
    assert first.profile.parallel.backend == "gloo", first.profile.parallel
    problem = first.problem()
    half = problem.static_bytes + (first.unplanned_peak_bytes - problem.static_bytes) // 2
    try:
        solved = replan(first, budget_bytes=half)
    except InfeasibleBudgetError as error:
        solved = error.plan
    plans = [("unplanned", first), ("solved at 50 %", solved)]
    for strategy in ("every_block", "save_matmuls"):
        schedule = baselines.BASELINES[strategy](problem, 2**62).schedule
        if schedule is not None:
            plans.append((strategy, plan_for_schedule(first.profile, schedule, first.inputs,
                                                      first.structure_fingerprint)))
    return plans


def nccl_peaks(name: str, recipe: str, world: int, plans: list[tuple[str, Plan]]
               ) -> list[int]:
    """What differs on NCCL: each plan's schedule replayed on the rank's step profiled for
    NCCL's collectives (its reduce-scatters in place; no NCCL here to measure)."""
    from solvers import simulate

    nccl = unplanned(name, recipe, world, "H100")
    assert nccl.profile.parallel.backend == "nccl", nccl.profile.parallel
    return [simulate(nccl.problem(), plan.schedule).peak_bytes for _, plan in plans]


# ----------------------------------------------------------------------------- one step


def measured_step(model: torch.nn.Module, zm: zoo.ZooModel,
                  fsdp_tracker: bool = False) -> dict:
    """One step's peak on this rank (and torch's FSDPMemTracker's, when asked)."""
    from planner.measure import PeakTracker
    from profiles import default_loss
    from profiles.inputs import normalize_inputs
    from profiles.parallel import local_tensor

    args, kwargs = normalize_inputs(model, zm.example_inputs)
    static = [*(local_tensor(p) for p in model.parameters()), *model.buffers()]
    torch.manual_seed(0)  # the same dropout masks in every step
    gc.collect()
    with PeakTracker(static, follow_resizes=True) as tracker:
        loss = (zm.loss_fn or default_loss)(model(*args, **kwargs))
        loss.backward()
    out = {"peak": tracker.own_peak_bytes, "loss": loss.item(),
           "grads": [local_tensor(p.grad).clone() for p in model.parameters()
                     if p.grad is not None]}
    if fsdp_tracker:
        out["torch_peak"] = _fsdp_mem_tracker_peak(model, zm, args, kwargs)
    return out


def _fsdp_mem_tracker_peak(model: torch.nn.Module, zm: zoo.ZooModel, args: tuple,
                           kwargs: dict) -> int | None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule

    from profiles import default_loss

    if not isinstance(model, FSDPModule):
        return None
    for p in model.parameters():
        p.grad = None
    tracker = FSDPMemTracker(model)
    torch.manual_seed(0)
    with tracker:
        (zm.loss_fn or default_loss)(model(*args, **kwargs)).backward()
    peaks = tracker.get_tracker_snapshot("peak")
    return int(sum(by_kind.get("Total", 0) for by_kind in peaks.values()))


def step_of(name: str, recipe: str, plan: Plan | None, mesh: Any,
            fsdp_tracker: bool = False) -> dict:
    zm = build(name)
    if plan is not None:
        apply(zm.model, plan)
    RECIPES[recipe](zm.model, mesh)  # gloo's reduce-scatter as it is, as planned for
    return measured_step(zm.model, zm, fsdp_tracker)


# ----------------------------------------------------------------------------- gloo


def _gloo_rank(rank: int, world: int, name: str, recipe: str, paths: list[str], port: int,
               out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        shape, names = mesh_of(recipe, world)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        base = step_of(name, recipe, None, mesh)
        results = []
        for path in paths:
            first: list[dict] = []

            def measure(path: str = path, first: list[dict] = first) -> int:
                got = step_of(name, recipe, Plan.load(path), mesh)
                first[:] = first or [got]
                return got["peak"]

            peak = least_peak_over_gloo(measure)  # not gloo's worker thread's lag
            got = first[0]
            results.append({"peak": peak, "equal": got["loss"] == base["loss"] and len(
                got["grads"]) == len(base["grads"]) and all(torch.equal(a, b) for a, b in zip(
                    got["grads"], base["grads"], strict=True))})
    finally:
        dist.destroy_process_group()
    torch.save(results, f"{out}.{rank}")


def gloo_rows(name: str, recipe: str, world: int, folder: str) -> list[dict]:
    plans = plans_for(name, recipe, world)
    paths = []
    for k, (_, plan) in enumerate(plans):
        paths.append(f"{folder}/{name}-{recipe}-{world}-{k}.json")
        plan.save(paths[-1])
    out = f"{folder}/result"
    spawn_ranks(_gloo_rank, (world, name, recipe, paths, free_port(), out), world)
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    nccl = nccl_peaks(name, recipe, world, plans)
    return [_row("gloo", world, recipe, name, label, plan,
                 max(res[k]["peak"] for res in ranks),
                 equal=all(res[k]["equal"] for res in ranks), nccl_bytes=nccl[k])
            for k, (label, plan) in enumerate(plans)]


# ----------------------------------------------------------------------------- fake


def fake_rows(name: str, recipe: str, world: int) -> list[dict]:
    from profiles.parallel import Parallelism, fake_world

    plans = plans_for(name, recipe, world)
    shape, names = mesh_of(recipe, world)
    nccl = nccl_peaks(name, recipe, world, plans)
    rows = []
    for (label, plan), nccl_bytes in zip(plans, nccl, strict=True):
        with fake_world(Parallelism(RECIPES[recipe], shape, names), "cpu") as mesh:
            got = step_of(name, recipe, None if label == "unplanned" else plan, mesh,
                          fsdp_tracker=True)
        rows.append(_row("fake", world, recipe, name, label, plan, got["peak"],
                         torch_peak=got.get("torch_peak"), nccl_bytes=nccl_bytes))
    return rows


def _row(mode: str, world: int, recipe: str, name: str, label: str, plan: Plan,
         measured: int, equal: bool | None = None, torch_peak: int | None = None,
         nccl_bytes: int | None = None) -> dict:
    row = {"mode": mode, "world": world, "recipe": recipe, "model": name, "plan": label,
           "budget_bytes": plan.budget_bytes, "predicted_bytes": plan.predicted_peak_bytes,
           "measured_bytes": measured,
           "error_pct": 100 * (plan.predicted_peak_bytes - measured) / measured,
           "within_budget": measured <= plan.budget_bytes, "equal": equal,
           "fsdp_mem_tracker_bytes": torch_peak, "nccl_predicted_bytes": nccl_bytes}
    print(f"{mode:4} x{world:<3} {recipe:16} {name:9} {label:15} predicted "
          f"{format_bytes(row['predicted_bytes']):>10} measured {format_bytes(measured):>10} "
          f"{row['error_pct']:+6.2f} % {'ok' if row['within_budget'] else 'OVER'}"
          f"{'' if equal is None else ' =' if equal else ' DIFF'}"
          f"{'' if torch_peak is None else ' torch ' + format_bytes(torch_peak)}", flush=True)
    return row


# ----------------------------------------------------------------------------- main


def runs(args: argparse.Namespace) -> list[tuple[str, int, str, str]]:
    out = []
    for mode, table in (("gloo", GLOO_RUNS), ("fake", FAKE_RUNS)):
        if mode not in args.modes:
            continue
        for world, recipe in table:
            tp = recipe in ("tp", "dp-tp")
            out.extend((mode, world, recipe, name) for name in args.models
                       if not tp or name in TP_MODELS)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["gloo", "fake"],
                        choices=["gloo", "fake"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as folder:
        for mode, world, recipe, name in runs(args):
            rows.extend(gloo_rows(name, recipe, world, folder) if mode == "gloo"
                        else fake_rows(name, recipe, world))
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"{len(rows)} rows, worst |predicted - measured| {worst:.2f} %, "
          f"{sum(not r['within_budget'] for r in rows)} over budget, "
          f"{sum(r['equal'] is False for r in rows)} with other losses or gradients")
    if not args.no_write:
        write(rows, round(time.perf_counter() - started, 1))


def write(rows: list[dict], seconds: float) -> None:
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "seconds": seconds, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distributed-cpu.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "distributed-cpu.md").write_text(render(result))


def render(result: dict) -> str:
    """The results as a Markdown table."""
    rows = result["rows"]
    worst = max(abs(r["error_pct"]) for r in rows)
    lines = ["# Per-rank plans: predicted against measured (CPU)", "",
             f"{result['date']}, torch {result['torch']}, {result['seconds']} s. Measured: the "
             "largest rank's peak (`PeakTracker`); gloo rows also compare losses and "
             "gradients with the same parallel model unplanned; fake rows show torch's "
             f"`FSDPMemTracker` beside it. {len(rows)} rows, worst |predicted - measured| "
             f"{worst:.2f} %. Planned and measured for gloo's collectives as they are (its "
             "reduce-scatter works on a copy of each FSDP2 unit's gradients); \"for NCCL\": "
             "the same schedule replayed on the step profiled for NCCL's in-place "
             "reduce-scatters (predicted only: no NCCL here).", "",
             "| mode | ranks | recipe | model | plan | budget | predicted | measured | error "
             "| within | losses, grads | FSDPMemTracker | for NCCL |", "|" + "---|" * 13]
    for r in rows:
        torch_peak = r["fsdp_mem_tracker_bytes"]
        lines.append(
            f"| {r['mode']} | {r['world']} | {r['recipe']} | {r['model']} | {r['plan']} | "
            f"{format_bytes(r['budget_bytes'])} | {format_bytes(r['predicted_bytes'])} | "
            f"{format_bytes(r['measured_bytes'])} | {r['error_pct']:+.2f} % | "
            f"{'yes' if r['within_budget'] else 'NO'} | "
            f"{'' if r['equal'] is None else '=' if r['equal'] else 'DIFF'} | "
            f"{format_bytes(torch_peak) if torch_peak is not None else ''} | "
            f"{format_bytes(r['nccl_predicted_bytes']) if r.get('nccl_predicted_bytes') else ''} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
