"""Llama-3-8B and -70B shapes planned per rank under FSDP2, from a 2-core CPU machine.

    python benchmarks/distributed_shapes.py [--sizes 8b 70b] [--ranks 8 64] [--seq-len 8192]

Each model is built on the meta device; torchtitan's wrapping (``fully_shard`` every
decoder layer, then the root, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``)
runs over a fake process group of each size inside the profile, on fake tensors, and the
step of one rank (its batch: ``--batch`` x ``--seq-len``) is planned at ``--budget-gb``.
Printed per row: the unplanned per-rank peak (with ``--check-torch``, torch's
``FSDPMemTracker`` over the same step beside it), the plan's peak and its recompute overhead,
profile and solve times, the process's peak RSS, and a hand count of what FSDP2 holds at
the peak (sharded parameters and gradients, the gathered root, one layer gathered plus
the one prefetched, in bf16). Writes ``benchmarks/results/distributed-shapes.{json,md}``
unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import time
from pathlib import Path

import torch

from planner import InfeasibleBudgetError, profile_model, solve, zoo
from planner.plan import GIB, format_bytes

RESULTS = Path(__file__).resolve().parent / "results"


def parallelize(model: torch.nn.Module, mesh: object) -> None:
    """torchtitan's FSDP2 recipe in bf16 mixed precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def hand_count(model: torch.nn.Module, ranks: int) -> dict[str, int]:
    """What FSDP2 holds at a backward peak, counted by hand from the parameter sizes."""
    layer = model.model.layers[0]
    layer_params = sum(p.numel() for p in layer.parameters())
    total = sum(p.numel() for p in model.parameters())
    root = total - layer_params * len(model.model.layers)
    return {"sharded fp32 parameters": 4 * total // ranks,
            "sharded fp32 gradients": 4 * total // ranks,
            "root gathered (bf16)": 2 * root,
            "two layers gathered (bf16)": 2 * 2 * layer_params,
            "one layer's bf16 gradients": 2 * layer_params}


def torch_tracker_peak(size: str, ranks: int, args: argparse.Namespace) -> int:
    """torch's ``FSDPMemTracker`` over the same unplanned step (fake tensors, the fake
    process group, the H100's fused attention): the independent measure of the shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from profiles.devices import device_spec
    from profiles.kernels import FusedKernels
    from profiles.parallel import Parallelism, fake_world

    zm = zoo.get("hf-llama", size=size, batch=args.batch, seq_len=args.seq_len,
                 device="meta")
    with fake_world(Parallelism(parallelize, (ranks,)), "cpu") as mesh:
        model = zm.model
        parallelize(model, mesh)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            ids = torch.zeros(args.batch, args.seq_len, dtype=torch.long)
            tracker = FSDPMemTracker(model)
            with FusedKernels(device_spec("H100")), tracker:
                model(input_ids=ids, labels=ids).loss.backward()
    peaks = tracker.get_tracker_snapshot("peak")
    return int(sum(by_kind.get("Total", 0) for by_kind in peaks.values()))


def rows_of(size: str, ranks: int, args: argparse.Namespace) -> list[dict]:
    """One profile of the shape at ``ranks``, planned at each budget."""
    zm = zoo.get("hf-llama", size=size, batch=args.batch, seq_len=args.seq_len,
                 device="meta")
    started = time.perf_counter()
    step = profile_model(zm.model, zm.example_inputs, parallelize=parallelize,
                         mesh_shape=(ranks,), device="H100", progress=args.progress)
    profiled = time.perf_counter()
    torch_peak = torch_tracker_peak(size, ranks, args) if args.check_torch else None
    rows = []
    for budget_gb in args.budget_gb:
        rows.append(_planned(step, int(budget_gb * GIB), args, zm.model, size, ranks))
        rows[-1].update(profile_s=round(profiled - started, 1),
                        fsdp_mem_tracker_unplanned_bytes=torch_peak)
    return rows


def _planned(step: object, budget: int, args: argparse.Namespace, model: torch.nn.Module,
             size: str, ranks: int) -> dict:
    solving = time.perf_counter()
    try:
        plan = solve(step, budget_bytes=budget, time_limit_s=args.time_limit_s)
    except InfeasibleBudgetError as error:
        plan = error.plan
    solved = time.perf_counter()
    counted = hand_count(model, ranks)
    return {"size": size, "ranks": ranks, "batch": args.batch, "seq_len": args.seq_len,
            "nodes": len(step.profile.nodes), "unplanned_bytes": step.unplanned_peak_bytes,
            "budget_bytes": budget, "planned_bytes": plan.predicted_peak_bytes,
            "overhead_pct": 100 * plan.predicted_overhead, "within_budget":
            plan.predicted_peak_bytes <= budget, "solver": plan.solver.name,
            "status": plan.solver.status, "gap": plan.solver.gap,
            "solve_s": round(solved - solving, 1),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                                  2), "hand_count": counted}


def _printed(rows: list[dict]) -> list[dict]:
    for r in rows:
        torch_peak = r.get("fsdp_mem_tracker_unplanned_bytes")
        print(f"{r['size']:>4} x{r['ranks']:<3} unplanned "
              f"{format_bytes(r['unplanned_bytes']):>10} "
              f"{'(FSDPMemTracker ' + format_bytes(torch_peak) + ') ' if torch_peak else ''}plan "
              f"{format_bytes(r['planned_bytes']):>10} at {format_bytes(r['budget_bytes'])} "
              f"(+{r['overhead_pct']:.1f} %), profile {r['profile_s']} s, solve "
              f"{r['solve_s']} s, RSS {r['peak_rss_gib']} GiB; FSDP2 by hand: " + ", ".join(
                  f"{k} {format_bytes(v)}" for k, v in r["hand_count"].items()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["8b", "70b"],
                        choices=["7b", "8b", "70b"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 64])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget-gb", type=float, nargs="+", default=[70.0, 40.0])
    parser.add_argument("--time-limit-s", type=float, default=120.0)
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--check-torch", action="store_true",
                        help="also run torch's FSDPMemTracker over the unplanned step")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = [r for size in args.sizes for ranks in args.ranks
            for r in _printed(rows_of(size, ranks, args))]
    if args.no_write:
        return
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "batch": args.batch, "seq_len": args.seq_len,
              "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distributed-shapes.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "distributed-shapes.md").write_text(render(result))


def render(result: dict) -> str:
    """The results as a Markdown table."""
    lines = ["# Llama-3 shapes planned per rank (FSDP2, bf16 mixed precision, fake tensors)",
             "", f"{result['date']}, torch {result['torch']}, on a 2-core CPU machine; "
             f"batch {result['batch']} x {result['seq_len']} per rank, H100 kernels. A plan "
             "above its budget is the lowest peak found (the budget cannot be met).", "",
             "| shape | ranks | unplanned | FSDPMemTracker | budget | plan | fits | overhead "
             "| profile s | solve s | peak RSS GiB | FSDP2 by hand |", "|" + "---|" * 12]
    for r in result["rows"]:
        hand = "; ".join(f"{k} {format_bytes(v)}" for k, v in r["hand_count"].items())
        torch_peak = r.get("fsdp_mem_tracker_unplanned_bytes")
        lines.append(f"| {r['size']} | {r['ranks']} | {format_bytes(r['unplanned_bytes'])} | "
                     f"{format_bytes(torch_peak) if torch_peak else ''} | "
                     f"{format_bytes(r['budget_bytes'])} | {format_bytes(r['planned_bytes'])} "
                     f"| {'yes' if r['within_budget'] else 'no'} | +{r['overhead_pct']:.1f} % "
                     f"| {r['profile_s']} | {r['solve_s']} | {r['peak_rss_gib']} | {hand} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
