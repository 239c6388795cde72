"""Memory/time frontier: our plans against how people checkpoint today, in one process.

For each model, every strategy is applied to the same model and inputs, and each run's peak
memory (MemTracker on CPU, the CUDA allocator on GPU), median step time and gradients are
measured. Our plans are made at budgets equal to each peer's measured peak.

    python benchmarks/frontier.py                 # CPU mode
    python benchmarks/frontier.py --device cuda   # GPT-2-medium 24x1024, batch 8x1024, fp32
    python benchmarks/frontier.py --quick         # smallest sizes, for the smoke test
    python benchmarks/frontier.py --autocast bf16 # every step under torch.autocast(bfloat16)

Writes benchmarks/results/frontier-<device>[-bf16].{json,md,png} (``--out`` to change the
folder). Every number written is measured in that run (``--models``/``--peers`` for a short
run). With ``--autocast bf16`` every step (peers, ours, the interleaved no-checkpointing
steps) runs its forward under ``torch.autocast(device, torch.bfloat16)`` and our plans are
made with ``optimize(..., autocast=torch.bfloat16)``; gradients are compared with the
no-checkpointing step of the same precision.

The peers, one file each beside this one: the hand-written ones (``frontier_peers.py``, their
blocks ``solvers.baselines.POLICIES``), torch.compile (``frontier_compile.py``) and torch's
auto-SAC (``frontier_auto_sac.py``); measuring (``frontier_measure.py``) and the written
results (``frontier_report.py``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import frontier_auto_sac
import frontier_compile
import frontier_peers
import torch
from frontier_auto_sac import AUTO_SAC, auto_sac_not_run, auto_sac_peer
from frontier_compile import COMPILE, COMPILE_BUDGETS, compile_backend, compile_peer
from frontier_measure import CPU_THREADS, TIME_UP, Runner, distinct_peaks, grads_match
from frontier_peers import eager_peer, replay_peers
from frontier_report import format_row, make_result, write_result
from kept_memory import keep_freed_memory
from torch import nn

import planner
from planner import zoo
from planner.api import replan
from planner.plan import InfeasibleBudgetError
from solvers.simulate import simulate

# what gpu_suite.py and the smoke test use of the frontier
__all__ = ["AUTOCAST", "AUTO_SAC", "RESULTS", "bench_model", "compile_backend", "main",
           "make_result", "write_result"]

RESULTS = Path(__file__).resolve().parent / "results"
PEERS = ("none", "every-layer", "every-2nd", "every-4th", "chen-sqrt-n", "sac-matmuls",
         "sac-linear",
         "auto-sac-milp", "rockmate")
QUICK_PEERS = ("none", "every-layer", "sac-matmuls", "auto-sac-milp", "rockmate")
# every peer in the order run ("compile" only when asked for: it compiles once per budget)
ALL_PEERS = (*PEERS[:PEERS.index("auto-sac-milp")], "compile",
             *PEERS[PEERS.index("auto-sac-milp"):])
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cases(device: str, quick: bool) -> list[tuple[str, dict[str, Any]]]:
    hf = zoo.has_transformers()
    if quick:
        # no dropout: torch's auto-SAC may keep dropout's in-place `bernoulli_` (its MILP's
        # choice varies with the timings it measures), and eager SAC then gives other
        # gradients, silently; the smoke test checks every row's gradients
        return [("gpt", dict(size="tiny", batch=4, device=device, dropout=0.0))]
    if device == "cuda":
        out = [("gpt", dict(size="gpt2-medium", batch=8, device=device))]
        if hf:
            out += [("hf-llama", dict(size="tiny", batch=8, seq_len=1024, device=device,
                                      hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=16, num_attention_heads=16,
                                      num_key_value_heads=16, vocab_size=32000))]
        out.append(("resnet", dict(batch=256, device=device)))
        if hf:
            out.append(("hf-gpt2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                        batch=8, seq_len=1024, device=device)))
        return out
    # CPU: batches where activations dominate memory, small enough for 2 cores
    out = [("gpt", dict(size="small", batch=4, device=device))]
    if hf:
        out.append(("hf-llama", dict(size="tiny", batch=4, seq_len=128, device=device,
                                     num_hidden_layers=4)))
    out.append(("resnet", dict(batch=16, device=device)))
    if hf:
        out.append(("hf-gpt2", dict(n_layer=4, batch=4, seq_len=128, device=device)))
    return out


def peer_not_run(name: str, device: str) -> str | None:
    """Why peer ``name`` cannot run here, or None."""
    if name == "rockmate":
        if device != "cuda":
            return "not run: no GPU (Rockmate is GPU only)"
        try:
            import rockmate  # noqa: F401
        except ImportError as error:
            return f"not run: rockmate not installed ({error})"
        return "not run: Rockmate adapter not written for this torch version"
    if name == "auto-sac-milp":
        return auto_sac_not_run()
    if name == "compile" and not hasattr(torch._functorch.config, "activation_memory_budget"):
        return (f"not run: torch {torch.__version__} has no "
                "torch._functorch.config.activation_memory_budget")
    return None


def bench_model(name: str, kwargs: dict[str, Any], device: str, steps: int, quick: bool,
                timing: str, peers: list[str] | None = None, *,
                autocast: torch.dtype | None = None, deadline: float | None = None,
                compile_budgets: tuple[float, ...] = COMPILE_BUDGETS, warmup: int = 2,
                op_ranges: bool = True, solve_time_limit_s: float = 60.0, passes: int = 0
                ) -> list[dict[str, Any]]:
    """Every selected peer, then our plans at their measured peaks, on zoo model ``name``;
    then, ``passes`` times, every row's step timed again (`Runner.retime`).
    ``autocast``: every step under ``torch.autocast(dtype)``; ``deadline``: a
    ``time.perf_counter()`` value past which what is left is recorded as not run;
    ``warmup``: untimed steps before the timed ones; ``op_ranges``: as in ``optimize``;
    ``solve_time_limit_s``: each of our solves' limit (``replan``'s ``time_limit_s``)
    (the smoke runs plan module calls only, for the test suite's time)."""
    zm = zoo.get(name, **kwargs)
    runner = Runner(zm, device, steps, autocast, deadline, warmup)
    rows: list[dict[str, Any]] = []
    timed: list[tuple[dict[str, Any], nn.Module, Callable[[], Any]]] = []
    short = {"batch": "b", "seq_len": "seq", "num_hidden_layers": "L", "n_layer": "L"}
    model_label = f"{zm.name} " + " ".join(f"{short.get(k, k)}{v}" for k, v in kwargs.items()
                                           if k not in ("device", "size"))

    def row(strategy: str, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"model": model_label, "strategy": strategy, "kind": kind, **fields}
        if "step_ms" in out:
            out["overhead"] = out["step_ms"] / out["base_step_ms"] - 1.0
            if runner.last_timed is not None:
                timed.append((out, *runner.last_timed))
            if runner.last_host is not None:
                out["host_ms"], out["base_host_ms"] = runner.last_host
        runner.last_timed = runner.last_host = None
        rows.append(out)
        print(format_row(out), flush=True)
        return out

    selected = QUICK_PEERS if quick else PEERS
    if peers is not None:  # "none" always: it is the reference for gradients and memory
        selected = tuple(p for p in ALL_PEERS if p == "none" or p in peers)
    reference: dict[str, torch.Tensor] = {}
    for peer in selected:
        reason = peer_not_run(peer, device) or (TIME_UP if runner.out_of_time() else None)
        if reason:
            row({"auto-sac-milp": AUTO_SAC, "compile": COMPILE}.get(peer, peer), "peer",
                status=reason)
        elif peer == "auto-sac-milp":
            auto_sac_peer(zm, runner, device, rows, reference, row)
        elif peer == "compile":
            compile_peer(zm, runner, compile_budgets, reference, row)
        else:
            grads = eager_peer(peer, zm, runner, reference, row)
            reference = grads if peer == "none" and grads is not None else reference
    first = our_plans(zm, runner, timing, rows, reference, row, op_ranges, solve_time_limit_s)
    if passes and timed:
        print(f"   timing every row {passes} more times", flush=True)
        runner.retime(timed, passes)
    if first is not None:
        replay_peers(zm, first, rows)
    if passes and timed:
        print("   timing each plan of ours head to head with the peers at whose peak it was "
              "made", flush=True)
        duel_peers(runner, timed, 3 * steps)
    return rows


def duel_peers(runner: Runner, timed: list[tuple[dict[str, Any], nn.Module, Callable[[], Any]]],
               rounds: int) -> None:
    """Each plan of ours timed head to head with each peer at whose peak it was made
    (`Runner.duel`), where the two run different schedules: ``versus`` on our row, by peer."""
    by_name = {(row["model"], row.get("short", row["strategy"])): (row, module, context)
               for row, module, context in timed if row["kind"] == "peer"}
    for row, module, context in timed:
        if row["kind"] != "ours":
            continue
        for name in row["strategy"].removeprefix("ours @ ").split("/"):
            peer = by_name.get((row["model"], name))
            if peer is None or name in row.get("same_plan_as", ()) or runner.out_of_time():
                continue
            row.setdefault("versus", {})[name] = runner.duel((module, context),
                                                             peer[1:], rounds)


def our_plans(zm: zoo.ZooModel, runner: Runner, timing: str, rows: list[dict[str, Any]],
              reference: dict[str, torch.Tensor], row: Callable[..., dict[str, Any]],
              op_ranges: bool = True, solve_time_limit_s: float = 60.0
              ) -> planner.Plan | None:
    """Our plans, one per distinct peer peak (torch auto-SAC's and torch.compile's included):
    the first via optimize() (profile + solve, timed), the others reuse its profile (replan,
    timed). Planned under the runner's autocast, and run under it. Returns the first."""
    first: planner.Plan | None = None
    for budget, peers in distinct_peaks(rows):
        label = f"ours @ {'/'.join(peers)}"
        if runner.out_of_time():
            row(label, "ours", status=TIME_UP, budget_bytes=budget)
            continue
        began = time.perf_counter()
        try:
            if first is None:
                first = planner.optimize(zm.model, zm.example_inputs, budget_gb=1e6,
                                         loss_fn=zm.loss_fn, timing=timing, progress=False,
                                         autocast=runner.autocast)
                how = f"optimize(timing={timing!r})"
            else:
                how = "replan (profile reused)"
            plan = replan(first, budget_bytes=budget, op_ranges=op_ranges,
                          time_limit_s=solve_time_limit_s)
        except InfeasibleBudgetError as error:
            row(label, "ours", status=f"infeasible: {error.args[0][:200]}", budget_bytes=budget)
            continue
        planning_s = time.perf_counter() - began
        # timed on a copy with the plan applied once, as training applies it; the
        # interleaved no-checkpointing steps run the plain model
        peak, ms, base, grads = runner.run(runner.applied(plan))
        equal, diff = grads_match(reference, grads)
        row(label, "ours", status="ok", budget_bytes=budget, peak_bytes=peak, step_ms=ms,
            base_step_ms=base,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            peak_error=(plan.predicted_peak_bytes - peak) / peak,
            within_budget=peak <= budget, planning_s=planning_s, planning_how=how,
            solver=plan.solver.name, solver_status=plan.solver.status,
            autocast_dtype=plan.autocast_dtype, grads_equal=equal, grad_max_abs_diff=diff,
            plan_schedule=plan.schedule.describe(),
            predicted_overhead=plan.predicted_overhead,
            predicted_host_overhead=predicted_host_overhead(plan),
            **({"checkpoint_costs": plan.profile.checkpoint_costs.model_dump()}
               if how.startswith("optimize") and plan.profile.checkpoint_costs else {}))
    return first


def predicted_host_overhead(plan: planner.Plan) -> float:
    """The host's part of the plan's predicted overhead: what the clock charges for its
    checkpoint regions, packs, policy hops, op ranges, the step's first rerun and the guard
    (the plan's recompute time and guard less the schedule's time with those costs 0), over
    the unplanned step."""
    problem = plan.problem()
    device_only = simulate(problem.model_copy(update={
        "checkpoint_region_ms": 0.0, "checkpoint_pack_ms": 0.0, "checkpoint_sac_op_ms": 0.0,
        "checkpoint_range_ms": 0.0, "checkpoint_step_ms": 0.0}), plan.schedule).recompute_time_ms
    return (plan.recompute_ms + plan.guard_ms - device_only) / plan.baseline_step_ms \
        if plan.baseline_step_ms else 0.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    peers_help = [m.__doc__ for m in (frontier_peers, frontier_compile, frontier_auto_sac)]
    parser = argparse.ArgumentParser(description="\n".join([__doc__, *peers_help]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="smallest sizes, 2 timed steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (15; --quick 2)")
    parser.add_argument("--passes", type=int, default=None,
                        help="times every row is timed again, the median kept (2; --quick 0)")
    parser.add_argument("--timing", default="measure", choices=["measure", "estimate"])
    parser.add_argument("--autocast", default=None, choices=sorted(AUTOCAST),
                        help="run every step under torch.autocast(this dtype)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--models", nargs="*", default=None, help="zoo names to keep")
    parser.add_argument("--peers", nargs="*", default=None, choices=ALL_PEERS,
                        help="peer strategies to run ('none' always runs)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads (default: 1 on the CPU, see CPU_THREADS)")
    opts = parser.parse_args(argv)
    steps = opts.steps or (2 if opts.quick else 15)
    passes = opts.passes if opts.passes is not None else (0 if opts.quick else 2)
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    autocast = AUTOCAST.get(opts.autocast)
    # CPU rows are timed on memory the allocator keeps, as a GPU's allocator keeps it
    allocator = keep_freed_memory() if opts.device == "cpu" else "torch's CUDA caching allocator"
    if opts.threads or opts.device == "cpu":
        torch.set_num_threads(opts.threads or CPU_THREADS)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name, kwargs in cases(opts.device, opts.quick):
        if opts.models and name not in opts.models:
            continue
        print(f"== {name} {kwargs}", flush=True)
        rows += bench_model(name, kwargs, opts.device, steps, opts.quick, opts.timing,
                            opts.peers, autocast=autocast, op_ranges=not opts.quick,
                            passes=passes)
    result = make_result(opts.device, "quick" if opts.quick else "full", steps, opts.timing,
                         autocast, started, rows)
    result["passes"] = passes
    result["allocator"] = allocator
    stem = (f"frontier-{opts.device}" + (f"-{opts.autocast}" if opts.autocast else "")
            + ("-quick" if opts.quick else ""))
    write_result(result, opts.out, stem)
    return result


if __name__ == "__main__":
    main()
