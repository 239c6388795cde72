"""Where a GPU's measured peak and the simulator's differ, for one model: a short lease part.

Measured on an H100 on 2026-11-27 (`benchmarks/results/README.md`, GPU): every planned step
of GPT-2-medium peaked 64,520 B below its prediction, and the unplanned peer, the first step
of its process, 34.5 MB above it. This script measures what that reading found by hand, and
what it could not see, in about 30 s:

- the first and a second unplanned step of the process, and what each leaves allocated
  (cuBLAS's workspaces, made on first use and kept);
- every layer checkpointed, measured and simulated;
- on a GPU, the allocations alive at the measured peak of a warm step (the CUDA caching
  allocator's own trace), against the storages of each size the simulator holds at its
  peak, so that a tensor one side holds and the other does not shows by its size.

    python benchmarks/gpu_peak_gaps.py                       # on a GPU machine
    python benchmarks/gpu_peak_gaps.py --autocast bfloat16   # the same under bf16 autocast
    python benchmarks/gpu_peak_gaps.py --device cpu --size small --batch 2   # the code path

On a GPU the allocator's trace is taken of the warm unplanned step and of the every-layer
step. Writes gpu-peak-gaps-<gpu or cpu>[-<autocast>].{json,md} under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from frontier_peers import peer_context, peer_schedule
from record_profiles import gpu_slug

import profiles
from planner import zoo
from planner.verification import measure_step
from profiles.inputs import normalize_inputs
from solvers import Schedule, simulate
from solvers.from_profile import problem_from_profile

RESULTS = Path(__file__).resolve().parent / "results"


def _allocated(device: str) -> int | None:
    return torch.cuda.memory_allocated() if device == "cuda" else None


def _measured(zm: zoo.ZooModel, args: tuple, kwargs: dict, peer: str | None,
              autocast: str | None) -> int:
    """`measure_step`'s peak, under hand-written policy `peer` (None: unplanned)."""
    with peer_context(peer, zm) if peer else contextlib.nullcontext():
        return measure_step(zm.model, args, kwargs, zm.loss_fn, autocast)[0]


def _step(zm: zoo.ZooModel, args: tuple, kwargs: dict, device: str,
          peer: str | None = None, autocast: str | None = None) -> dict[str, Any]:
    """One measured step (under hand-written policy `peer`, if any) and what it left."""
    before = _allocated(device)
    peak = _measured(zm, args, kwargs, peer, autocast)
    return {"peak_bytes": peak, "allocated_before": before, "allocated_after": _allocated(device)}


def _live_at_peak(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """The allocations alive at the highest point of the allocator's trace, by size."""
    live: dict[int, dict[str, Any]] = {}
    best: list[dict[str, Any]] = []
    total = most = 0
    for event in snapshot["device_traces"][0]:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = event
            total += size
            if total > most:
                most, best = total, list(live.values())
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)["size"]
    return [{"size": e["size"], "frames": [
        f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
        for f in e.get("frames", []) if f["filename"].endswith(".py")][:6]} for e in best]


def _traced_step(zm: zoo.ZooModel, args: tuple, kwargs: dict, autocast: str | None,
                 peer: str | None = None) -> list[dict[str, Any]]:
    """A warm step (under hand-written policy `peer`, if any) under the CUDA allocator's
    recorder: what the step allocated and still holds at its peak (what was allocated
    before it is not in the trace)."""
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        _measured(zm, args, kwargs, peer, autocast)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return _live_at_peak(snapshot)


def _simulated_sizes(problem: Any, nbytes: list[int]) -> dict[str, list[str]]:
    """Per size in `nbytes`: the storages of that size, named by their producer and the
    ops that read or save them (the simulator's side of a size both sides hold apart)."""
    out: dict[str, list[str]] = {}
    for s, size in enumerate(problem.storage_bytes):
        if size in nbytes:
            prod = problem.storage_producer[s]
            readers = [problem.node_names[j] for j in problem.consumers[s]][:4]
            out.setdefault(str(size), []).append(
                f"made by {problem.node_names[prod]}, read by {', '.join(readers) or 'none'}")
    return out


def run(device: str, size: str, batch: int, autocast: str | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    zm = zoo.get("gpt", device=device, size=size, batch=batch, dropout=0.0)
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    result: dict[str, Any] = {"device": device, "size": size, "batch": batch,
                              "autocast": autocast,
                              "torch": torch.__version__,
                              "device_name": torch.cuda.get_device_name() if device == "cuda"
                              else "cpu", "allocated_after_model": _allocated(device)}
    result["unplanned_first"] = _step(zm, args, kwargs, device, autocast=autocast)
    result["unplanned_second"] = _step(zm, args, kwargs, device, autocast=autocast)
    result["every_layer"] = _step(zm, args, kwargs, device, "every-layer", autocast)
    prof = profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                            progress=False,
                            autocast=getattr(torch, autocast) if autocast else None)
    problem = problem_from_profile(prof, op_ranges=True)
    n_blocks = len(zm.model.get_submodule(zm.block_prefix))
    for key, schedule in (("unplanned", Schedule.store_all(problem.n_nodes)),
                          ("every_layer", peer_schedule("every-layer", problem, n_blocks))):
        timeline = simulate(problem, schedule)
        result[f"simulated_{key}"] = {"peak_bytes": timeline.peak_bytes,
                                      "peak_event": timeline.peak_label,
                                      "breakdown": dataclasses.asdict(timeline.breakdown)}
    warm = result["unplanned_second"]["peak_bytes"]
    result["gap_unplanned_second"] = result["simulated_unplanned"]["peak_bytes"] - warm
    result["gap_every_layer"] = (result["simulated_every_layer"]["peak_bytes"]
                                 - result["every_layer"]["peak_bytes"])
    result["gap_unplanned_first"] = (result["simulated_unplanned"]["peak_bytes"]
                                     - result["unplanned_first"]["peak_bytes"])
    gaps = {abs(result[key]) for key in ("gap_unplanned_second", "gap_every_layer")} - {0}
    # a tensor held on one side only, less the allocator's rounding of a few small ones
    sizes = sorted({n for n in problem.storage_bytes if any(g <= n <= g + 4096 for g in gaps)})
    result["simulated_storages_by_size"] = _simulated_sizes(problem, sizes)
    if device == "cuda":
        live = _traced_step(zm, args, kwargs, autocast)
        result["gpu_live_at_peak_by_size"] = dict(Counter(e["size"] for e in live))
        result["gpu_live_small"] = [e for e in live if e["size"] <= 4 * 2 ** 20][:60]
        live = _traced_step(zm, args, kwargs, autocast, "every-layer")
        result["gpu_live_at_peak_by_size_every_layer"] = dict(Counter(e["size"] for e in live))
        result["gpu_live_every_layer"] = live
    result["wall_s"] = time.perf_counter() - started
    return result


def render(result: dict[str, Any]) -> str:
    rows = [("unplanned, first step of the process", result["unplanned_first"]),
            ("unplanned, second step", result["unplanned_second"]),
            ("every layer checkpointed", result["every_layer"])]
    precision = f"{result['autocast']} autocast" if result.get("autocast") else "fp32"
    lines = [f"# Where the GPU's peak and the simulator's differ ({result['device_name']})", "",
             f"GPT ({result['size']}), batch {result['batch']}, {precision}, "
             f"torch {result['torch']}; "
             f"{result['wall_s']:.0f} s.", "",
             "| step | measured peak B | allocated before | after |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['peak_bytes']:,} | {r['allocated_before']} | "
              f"{r['allocated_after']} |" for name, r in rows]
    lines += ["", f"Simulated: unplanned {result['simulated_unplanned']['peak_bytes']:,} B at "
              f"`{result['simulated_unplanned']['peak_event']}`, every layer "
              f"{result['simulated_every_layer']['peak_bytes']:,} B. Simulated minus measured: "
              f"{result['gap_unplanned_first']:,} B (first step), "
              f"{result['gap_unplanned_second']:,} B (second), "
              f"{result['gap_every_layer']:,} B (every layer).", ""]
    if "gpu_live_at_peak_by_size" in result:
        lines += ["Allocations alive at the warm step's peak, by size (B: count): "
                  + ", ".join(f"{k}: {v}" for k, v in sorted(
                      result["gpu_live_at_peak_by_size"].items())) + ".", ""]
    return "\n".join(lines) + "\n"


def gpt_parser(description: str | None) -> argparse.ArgumentParser:
    """The options of a GPU lead's script: the zoo GPT it runs, and where."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--size", default="gpt2-medium")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def lead_main(doc: str | None, name: str, run_lead: Callable[..., dict[str, Any]],
              render_lead: Callable[[dict[str, Any]], str], argv: list[str] | None
              ) -> dict[str, Any]:
    """A GPU lead's command line: ``run_lead(device, size, batch, autocast)``, written to
    ``<name>-<gpu or cpu>[-<autocast>].{json,md}`` under ``--out`` and printed."""
    parser = gpt_parser(doc)
    parser.add_argument("--autocast", choices=("bfloat16", "float16"), default=None)
    opts = parser.parse_args(argv)
    result = run_lead(opts.device, opts.size, opts.batch, opts.autocast)
    opts.out.mkdir(parents=True, exist_ok=True)
    where = gpu_slug(torch.cuda.get_device_name()) if opts.device == "cuda" else "cpu"
    suffix = f"-{opts.autocast}" if opts.autocast else ""
    stem = opts.out / f"{name}-{where}{suffix}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(render_lead(result))
    print(render_lead(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return lead_main(__doc__, "gpu-peak-gaps", run, render, argv)


if __name__ == "__main__":
    main()
