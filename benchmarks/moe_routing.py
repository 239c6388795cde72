"""Routing that depends on the data: plans of an MoE model against the batches it trains on.

Hugging Face MoE models (Mixtral at two widths, one under bf16 autocast; Qwen3-MoE; OLMoE
with 8 experts; Qwen2-MoE with its shared expert) with their eager experts loop
(``experts_implementation="eager"``: each expert runs on the tokens routed to it, so memory
follows the routing). Each plan is made two ways at the same budgets:

* **bounded** (ours): profiled at forced routings and planned for the worst routing of
  every layer (`solvers.routing`);
* **profiled routing** (the peer: what a plan of one batch gives): planned for the routing
  of the batch it profiled (``profile_model(..., bound_routing=False)``).

Each is measured on batches other than the profiled one and on adversarial routings (the
experts run on forced counts: the bound's worst, with every expert kept at one token, and
lopsided ones). Two settings: one process (PeakTracker, every model), and FSDP2 over two
gloo ranks (Mixtral, Qwen2-MoE; each rank's own peak, ``PeakTracker(follow_resizes=True)``),
planned per rank on the fake process group, where the gathered weights are placeholders and
the router routes otherwise than the real step. Every measured peak is compared with the
budget.

    python benchmarks/moe_routing.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from gloo_ranks import free_port, spawn_ranks
from results_files import write_results

from planner import InfeasibleBudgetError, Plan, apply, profile_model, remove
from planner.measure import PeakTracker, least_peak_over_gloo
from planner.plan import format_bytes
from planner.solving import solve
from profiles import default_loss
from profiles.parallel import local_tensor
from profiles.routing import routed_experts, routing_forced
from solvers.routing import worst_routing

FRACTIONS = (0.8, 0.6, 0.45)  # of the unplanned step's activations, above static memory
WORLD = 2


# name: (config class, model class, config options, autocast dtype)
_SMALL = dict(vocab_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, experts_implementation="eager", use_cache=False)
MODELS = {
    "Mixtral h64": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
        None),
    "Mixtral h96 bf16 autocast": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=96, intermediate_size=160, num_local_experts=4, num_experts_per_tok=2),
        torch.bfloat16),
    "Qwen3-MoE h64": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, head_dim=16,
        num_experts=4, num_experts_per_tok=2), None),
    "OLMoE h64 8 experts top 2": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        hidden_size=64, intermediate_size=64, num_experts=8, num_experts_per_tok=2), None),
    "Qwen2-MoE h64 shared expert": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2), None),
}
ONE_PROCESS = list(MODELS)
RANKS = ["Mixtral h64", "Qwen2-MoE h64 shared expert"]
ROWS, LENGTH = 4, 64


def build(name: str) -> torch.nn.Module:
    """A small model of ``name`` (random init) with the eager experts loop."""
    import transformers

    config_class, model_class, options, _ = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**_SMALL, **options)
    return getattr(transformers, model_class)(config)


def experts_of(name: str) -> tuple[int, int]:
    options = MODELS[name][2]
    return (options.get("num_local_experts") or options["num_experts"],
            options["num_experts_per_tok"])


def batch_of(seed: int, rows: int, length: int) -> dict:
    ids = torch.randint(3, 512, (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def all_hit(counts: tuple[int, ...]) -> tuple[int, ...]:
    """The worst counts with every expert on one token at least (the same op stream as
    the profile: the bound takes an idle expert's share as zero)."""
    hit = [max(1, c) for c in counts]
    hit[hit.index(max(hit))] -= sum(hit) - sum(counts)
    return tuple(hit)


def adversarial(plan: Plan, tokens: int, k: int, experts: int) -> dict[str, tuple[int, ...]]:
    """Forced routings to measure: the bound's worst (all experts hit) and lopsided ones."""
    total = k * tokens
    lopsided = {"first full": (tokens, tokens - experts + 2, *[1] * (experts - 2)),
                "last full": (*[1] * (experts - 2), tokens - experts + 2, tokens)}
    out = {name: c for name, c in lopsided.items() if sum(c) == total}
    if plan.routing is not None:
        worst = worst_routing(plan.problem(), plan.routing, plan.schedule)
        out["bound's worst"] = all_hit(worst.counts)
    return out


def _peak(model: torch.nn.Module, batch: dict, counts: tuple[int, ...] | None = None,
          follow_resizes: bool = False, autocast: torch.dtype | None = None) -> int:
    static = [*(local_tensor(p) for p in model.parameters()), *model.buffers(),
              *batch.values()]
    forced = routing_forced(routed_experts(model), lambda t, k, e: counts) \
        if counts is not None else contextlib.nullcontext()
    precision = torch.autocast("cpu", dtype=autocast) if autocast else \
        contextlib.nullcontext()
    gc.collect()
    with forced, PeakTracker(static, follow_resizes=follow_resizes) as tracker:
        with precision:
            loss = default_loss(model(**batch))
        loss.backward()
    for p in model.parameters():
        p.grad = None
    return tracker.own_peak_bytes if follow_resizes else tracker.peak_bytes


def plans(model: torch.nn.Module, batch: dict, **profile_options) -> list[dict]:
    """Both kinds of plan at each fraction: kind, fraction, plan, the budget asked."""
    out = []
    bounded = profile_model(model, batch, timing="estimate", progress=False,
                            **profile_options)
    peer = profile_model(model, batch, timing="estimate", progress=False,
                         bound_routing=False, **profile_options)
    assert bounded.routing is not None, "the experts loop was not bounded"
    static = bounded.problem().static_bytes + sum(bounded.problem().param_grad_bytes)
    top = bounded.unplanned_peak_bytes
    for fraction in FRACTIONS:
        budget = int(static + (top - static) * fraction)
        for kind, step in (("bounded", bounded), ("profiled routing", peer)):
            try:
                plan = solve(step, budget_bytes=budget, time_limit_s=20)
            except InfeasibleBudgetError as error:  # its lowest plan, at that plan's peak
                plan = error.plan
            out.append({"kind": kind, "fraction": fraction, "plan": plan, "asked": budget})
    return out


def measure_rows(name: str, model, planned: list[dict], batches: list[dict]) -> list[dict]:
    experts, k = experts_of(name)
    autocast = MODELS[name][3]
    rows = []
    for entry in planned:
        plan = entry["plan"]
        apply(model, plan)
        try:
            data = [_peak(model, b, None, autocast=autocast) for b in batches]
            forced = {label: _peak(model, batches[0], counts, autocast=autocast)
                      for label, counts in adversarial(plan, ROWS * LENGTH, k,
                                                       experts).items()}
        finally:
            remove(model)
        rows.append(_row(entry, plan, data, forced))
    return rows


def _row(entry: dict, plan: Plan, data: list[int], forced: dict[str, int]) -> dict:
    budget = plan.budget_bytes
    worst = max([*data, *forced.values()])
    return {"kind": entry["kind"], "fraction": entry["fraction"], "budget": budget,
            "asked": entry.get("asked", budget),
            "predicted": plan.predicted_peak_bytes, "batches_max": max(data),
            "batches_over": sum(p > budget for p in data), "batches": len(data),
            "forced": forced, "worst_measured": worst,
            "worst_over_budget_pct": 100 * (worst / budget - 1),
            "prediction_minus_worst_pct": 100 * (plan.predicted_peak_bytes / worst - 1)}


# ----------------------------------------------------------------------------- one process


def one_process(name: str, steps: int) -> list[dict]:
    model = build(name)
    batches = [batch_of(seed, ROWS, LENGTH) for seed in range(steps)]
    planned = plans(model, batches[0], autocast=MODELS[name][3])
    return [{"model": name, "setting": "one process", **r}
            for r in measure_rows(name, model, planned, batches[1:])]


# ----------------------------------------------------------------------------- FSDP2 ranks


def fsdp2(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _rank(rank: int, world: int, name: str, paths: list[str], steps: int, port: int,
          out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        results = [_rank_row(name, rank, Plan.load(path), mesh, steps) for path in paths]
    finally:
        dist.destroy_process_group()
    torch.save(results, f"{out}.{rank}")


def _rank_row(name: str, rank: int, plan: Plan, mesh, steps: int) -> dict:
    """One plan on this rank: applied, sharded, stepped on the rank's own batches (none
    the profiled one) and on forced routings."""
    experts, k = experts_of(name)
    model = build(name)
    apply(model, plan)
    fsdp2(model, mesh)
    batches = [batch_of(1000 * rank + seed, ROWS, LENGTH) for seed in range(1, steps)]
    data = [least_peak_over_gloo(functools.partial(_peak, model, b, None, True))
            for b in batches]
    forced = {label: least_peak_over_gloo(functools.partial(_peak, model, batches[0], c, True))
              for label, c in adversarial(plan, ROWS * LENGTH, k, experts).items()}
    return _row({"kind": "", "fraction": 0.0}, plan, data, forced)


def fsdp2_ranks(name: str, steps: int, folder: str) -> list[dict]:
    model = build(name)
    planned = plans(model, batch_of(0, ROWS, LENGTH), parallelize=fsdp2,
                    mesh_shape=(WORLD,))
    paths = []
    for i, entry in enumerate(planned):
        paths.append(f"{folder}/plan-{i}.json")
        entry["plan"].save(paths[-1])
    out = f"{folder}/ranks"
    spawn_ranks(_rank, (WORLD, name, paths, steps, free_port(), out), WORLD)
    ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    rows = []
    for i, entry in enumerate(planned):
        for r, res in enumerate(ranks):
            row = {**res[i], "kind": entry["kind"], "fraction": entry["fraction"],
                   "asked": entry["asked"]}
            rows.append({"model": name, "setting": f"FSDP2, {WORLD} gloo ranks: rank {r}",
                         **row})
    return rows


# ----------------------------------------------------------------------------- report


def render(result: dict) -> str:
    lines = [f"# MoE routing: plans against the batches they meet ({result['date']}, "
             f"{result['seconds']:.0f} s)", "",
             "budget: the plan's (where the asked one is infeasible, the lowest peak "
             "found, and the row says so)", "",
             "| model | setting | plan | budget | predicted | batches over | max of batches | "
             "worst forced | worst vs budget |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        asked = f" (asked {format_bytes(r['asked'])}: infeasible)" \
            if r["asked"] < r["budget"] else ""
        lines.append(
            f"| {r['model']} | {r['setting']} | {r['kind']} @ {r['fraction']} | "
            f"{format_bytes(r['budget'])}{asked} "
            f"| {format_bytes(r['predicted'])} | {r['batches_over']} of {r['batches']} | "
            f"{format_bytes(r['batches_max'])} | {format_bytes(max(r['forced'].values()))} | "
            f"{r['worst_over_budget_pct']:+.2f} % |")
    ours = [r for r in result["rows"] if r["kind"] == "bounded"]
    peer = [r for r in result["rows"] if r["kind"] != "bounded"]
    lines += ["", f"bounded: {_over(ours)}; profiled routing: {_over(peer)}"]
    return "\n".join(lines)


def _over(rows: list[dict]) -> str:
    over = [r["worst_over_budget_pct"] for r in rows]
    return f"{sum(p > 0 for p in over)} of {len(over)} rows over budget (worst {max(over):+.2f} %)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 batches instead of 9")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    steps = 5 if args.quick else 10
    started = time.perf_counter()
    rows = []
    for name in ONE_PROCESS:
        print(f"{name}: one process", flush=True)
        rows += one_process(name, steps)
    for name in RANKS:
        print(f"{name}: FSDP2 over {WORLD} gloo ranks", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            rows += fsdp2_ranks(name, steps, folder)
    result = {"date": datetime.date.today().isoformat(),
              "seconds": time.perf_counter() - started, "rows": rows}
    write_results("moe-routing-cpu", result, render)


if __name__ == "__main__":
    main()
