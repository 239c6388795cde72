"""Measure the host overhead of torch.utils.checkpoint and check the time model against it.

    python benchmarks/checkpoint_overhead.py            # CPU, about 3 minutes on 2 cores
    python benchmarks/checkpoint_overhead.py --quick    # fewer rounds, no zoo plans

1. Tiny ops (overhead dominates): chains of ``regions`` checkpointed regions of ``ops`` tiny
   ops, ``packs`` of which save a tensor, against the same chain without checkpointing and
   its plain forward (what the rerun re-executes); with and without a selective-checkpoint
   (SAC) policy. Least squares over the grid fits

       checkpoint overhead = regions * (region_ms + packs * pack_ms)
       SAC extra           = regions * ops * sac_op_ms

   and prints each configuration's residual; ``profiles.calibrate`` (what ``profile`` runs,
   ~0.5 s) is run a few times next to it.
2. Zoo blocks: ``gpt`` (small) and ``hf-llama`` (tiny, 4 layers) are profiled
   (``timing="measure"``, which calibrates), planned with one checkpoint per block and with
   SAC save-matmuls per block (``planner.apply`` on copies of the model), and their step
   times measured (interleaved with the unplanned model, lower quartiles; on CPU with one
   thread, the default, in process CPU time, so other processes on a shared host do not
   count). Predicted overhead = ``simulate``'s recompute time, with and without the
   checkpoint overhead term; measured = planned step minus unplanned step. Also our plan
   at the save-matmuls peak.

Writes benchmarks/results/checkpoint-overhead-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import profiles
from planner import apply, profile_model, solve, zoo
from planner.api import measure_step, plan_for_schedule
from planner.runtime.emit import checkpointed_modules
from profiles.calibrate import (
    OPS,
    REGIONS,
    calibrate_checkpoint_costs,
    calibration_chains,
    chain_runs,
    costs_from_samples,
    interleaved_ms,
    lower_quartile,
    step_clock,
    tiny_chain,
)
from profiles.inputs import normalize_inputs
from solvers import Schedule, baselines, simulate
from solvers.from_profile import problem_from_profile

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
GRID = [(k, m, p) for k in (4, 16) for m in (1, 4, 16) for p in sorted({1, m})]
ZOO = [("gpt", dict(size="small", batch=4)),
       ("hf-llama", dict(size="tiny", batch=4, seq_len=128, num_hidden_layers=4))]


# --------------------------------------------------------------------------- tiny ops


def micro(device: torch.device, rounds: int) -> dict[str, Any]:
    """Overheads of the tiny-op grid and the least-squares constants."""
    chains = {f"k{k}_m{m}_p{p}": tiny_chain(k, m, p) for k, m, p in GRID}
    samples = interleaved_ms(chain_runs(chains, device), device, rounds=rounds)
    q = {key: lower_quartile(v) for key, v in samples.items()}
    rows = []
    for (k, m, p), name in zip(GRID, chains, strict=True):
        rows.append(dict(regions=k, ops=m, packs=p,
                         plain_ms=q[(name, "plain")], forward_ms=q[(name, "forward")],
                         ckpt_over_ms=q[(name, "checkpoint")] - q[(name, "plain")]
                         - q[(name, "forward")],
                         sac_extra_ms=q[(name, "sac")] - q[(name, "checkpoint")]))
    a = np.array([[r["regions"], r["regions"] * r["packs"]] for r in rows], dtype=float)
    y = np.array([r["ckpt_over_ms"] for r in rows])
    (region, pack), *_ = np.linalg.lstsq(a, y, rcond=None)
    ops = np.array([r["regions"] * r["ops"] for r in rows], dtype=float)
    sac = float(ops @ np.array([r["sac_extra_ms"] for r in rows]) / (ops @ ops))
    for r in rows:
        r["ckpt_fit_ms"] = r["regions"] * (region + r["packs"] * pack)
        r["sac_fit_ms"] = r["regions"] * r["ops"] * sac
    return dict(region_ms=float(region), pack_ms=float(pack), sac_op_ms=sac, rows=rows)


# --------------------------------------------------------------------------- zoo


def _model_clock(device: torch.device) -> Any:
    """`step_clock`, but wall time for CPU steps with more than one thread (process time
    would add the threads up)."""
    many = device.type == "cpu" and torch.get_num_threads() > 1
    return time.perf_counter if many else step_clock(device)


def _step(module: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Any) -> None:
    loss_fn(module(*args, **kwargs)).backward()
    module.zero_grad(set_to_none=True)


def _region_forwards(module: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Any
                     ) -> Any:
    """A callable running each checkpointed region's forward alone, grad enabled, on its
    inputs from a step: what the reruns re-execute (up to the regions' ends)."""
    calls: list[tuple[torch.nn.Module, tuple, dict]] = []

    def fresh(value: Any) -> Any:
        return value.detach().requires_grad_(value.requires_grad) \
            if isinstance(value, torch.Tensor) else value

    def grab(m: torch.nn.Module, inputs: tuple, kw: dict) -> None:
        # keyword inputs too: HF decoder layers take position_embeddings=... by keyword
        calls.append((m, tuple(fresh(t) for t in inputs), {k: fresh(v) for k, v in kw.items()}))

    wrappers = list(checkpointed_modules(module).values())
    handles = [w.module.register_forward_pre_hook(grab, with_kwargs=True) for w in wrappers]
    loss_fn(module(*args, **kwargs))  # forward only: the hooks see each region once
    for h in handles:
        h.remove()

    originals = {id(w.module): w.original for w in wrappers}

    def run() -> None:
        for m, inputs, kw in calls:
            originals[id(m)](*inputs, **kw)

    return run


def zoo_case(name: str, kwargs: dict[str, Any], rounds: int, plans: bool) -> dict[str, Any]:
    zm = zoo.get(name, **kwargs)
    loss_fn = zm.loss_fn or profiles.default_loss
    args, kw = normalize_inputs(zm.model, zm.example_inputs)
    began = time.perf_counter()
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="measure",
                         progress=False)
    prof = step.profile
    profile_s = time.perf_counter() - began
    problem = problem_from_profile(prof)
    plain = problem.model_copy(update={"checkpoint_region_ms": 0.0, "checkpoint_pack_ms": 0.0,
                                       "checkpoint_sac_op_ms": 0.0})
    big = 2**62
    schedules = {"every block": baselines.every_block(problem, big).schedule,
                 "SAC save-matmuls": baselines.save_matmuls(problem, big).schedule}
    if plans:
        budget = simulate(problem, schedules["SAC save-matmuls"]).peak_bytes
        plan = solve(step, budget_bytes=budget, time_limit_s=30.0)
        schedules[f"ours @ save-matmuls peak ({plan.solver.name})"] = plan.schedule
    modules: dict[str, torch.nn.Module] = {"none": zm.model}
    for label, sched in schedules.items():  # each plan on its own copy of the model
        modules[label] = apply(copy.deepcopy(zm.model), plan_for_schedule(
            prof, sched, step.inputs, step.structure))
    # one interleaved loop: the steps, the regions' forwards (schedules without keeps) and
    # the calibration chains again, so all of them see the same host load
    runs: dict[Any, Any] = {("step", k): functools.partial(_step, m, args, kw, loss_fn)
                            for k, m in modules.items()}
    for label, sched in schedules.items():
        if not any(r.keep for r in sched.recompute_regions()):
            runs[("forwards", label)] = _region_forwards(modules[label], args, kw, loss_fn)
    device = torch.device(kwargs.get("device", "cpu"))
    runs.update(chain_runs(calibration_chains(), device))
    samples = interleaved_ms(runs, device, rounds=rounds, clock=_model_clock(device))
    q = {k: lower_quartile(v) for k, v in samples.items()}
    again = costs_from_samples(samples, REGIONS, OPS, "calibrated next to the steps")
    same = problem.model_copy(update={"checkpoint_region_ms": again.region_ms,
                                      "checkpoint_pack_ms": again.pack_ms,
                                      "checkpoint_sac_op_ms": again.sac_op_ms})
    base_pred = simulate(problem, Schedule.store_all(problem.n_nodes)).total_time_ms
    rows = []
    for label, sched in schedules.items():
        tl = simulate(problem, sched)
        peak, _, _ = measure_step(modules[label], args, kw, loss_fn)
        regions = sched.recompute_regions()
        rows.append(dict(
            strategy=label, regions=len(regions),
            kept=sum(len(r.keep) for r in regions),
            predicted_ms=tl.recompute_time_ms,
            predicted_without_overhead_ms=simulate(plain, sched).recompute_time_ms,
            predicted_recalibrated_ms=simulate(same, sched).recompute_time_ms,
            measured_ms=q[("step", label)] - q[("step", "none")],
            measured_region_forward_ms=q.get(("forwards", label)),
            measured_step_ms=q[("step", label)], base_step_ms=q[("step", "none")],
            predicted_peak_gib=tl.peak_bytes / GIB, measured_peak_gib=peak / GIB))
    costs = prof.checkpoint_costs
    assert costs is not None
    return dict(model=f"{zm.name} b{kwargs.get('batch')}", profile_s=profile_s,
                predicted_base_ms=base_pred, costs=costs.model_dump(),
                recalibrated=again.model_dump(), rows=rows)


# --------------------------------------------------------------------------- output


def markdown(result: dict[str, Any]) -> str:
    m = result["micro"]
    us = 1e3
    lines = [f"# Checkpoint overhead on {result['device_name']} (torch {result['torch']}, "
             f"{result['date']})", "",
             "## Tiny ops: least squares over the grid", "",
             f"region {m['region_ms'] * us:.0f} us, per saved tensor {m['pack_ms'] * us:.1f} "
             f"us, SAC per op (forward + rerun) {m['sac_op_ms'] * us:.1f} us", "",
             "| regions | ops/region | saved/region | no-ckpt ms | ckpt overhead ms | fit "
             "| SAC extra ms | fit |", "|---|---|---|---|---|---|---|---|"]
    for r in m["rows"]:
        lines.append(f"| {r['regions']} | {r['ops']} | {r['packs']} | {r['plain_ms']:.2f} | "
                     f"{r['ckpt_over_ms']:.2f} | {r['ckpt_fit_ms']:.2f} | "
                     f"{r['sac_extra_ms']:.2f} | {r['sac_fit_ms']:.2f} |")
    lines += ["", "`profiles.calibrate` (what `profile(timing=\"measure\")` runs), repeated:", "",
              "| run | seconds | region us | per saved tensor us | SAC per op us |",
              "|---|---|---|---|---|"]
    for i, c in enumerate(result["calibrations"]):
        lines.append(f"| {i + 1} | {c['seconds']:.2f} | {c['region_ms'] * us:.0f} | "
                     f"{c['pack_ms'] * us:.1f} | {c['sac_op_ms'] * us:.1f} |")
    lines += ["", "## Zoo models: predicted vs measured overhead (ms per step)", "",
              "| model | strategy | regions | kept | measured | predicted | predicted, "
              "recalibrated | predicted without overhead | measured region forwards "
              "| measured − forwards vs predicted overhead term | measured peak GiB "
              "| predicted peak GiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def consts(c: dict[str, Any]) -> str:
        return (f"{c['region_ms'] * us:.0f} / {c['pack_ms'] * us:.1f} / "
                f"{c['sac_op_ms'] * us:.1f}")

    for case in result["zoo"]:
        for r in case["rows"]:
            base = r["base_step_ms"]

            def ms(x: float, base: float = base) -> str:
                return f"{x:.1f} ({100 * x / base:+.1f} %)"

            lines.append(
                f"| {case['model']} | {r['strategy']} | {r['regions']} | {r['kept']} | "
                f"{ms(r['measured_ms'])} | {ms(r['predicted_ms'])} | "
                f"{ms(r['predicted_recalibrated_ms'])} | "
                f"{ms(r['predicted_without_overhead_ms'])} | "
                + (f"{fwd:.1f} | {r['measured_ms'] - fwd:.1f} vs "
                   f"{r['predicted_ms'] - r['predicted_without_overhead_ms']:.1f} | "
                   if (fwd := r["measured_region_forward_ms"]) is not None else "| | ")
                + f"{r['measured_peak_gib']:.4f} | {r['predicted_peak_gib']:.4f} |")
    lines += ["", "Constants (region us / per saved tensor us / SAC per op us): "
              + "; ".join(f"{case['model']}: profile {consts(case['costs'])}, recalibrated "
                          f"next to the steps {consts(case['recalibrated'])}"
                          for case in result["zoo"]) + ".",
              "", "Percentages are of the measured unplanned step (the captured module): "
              + ", ".join(f"{case['model']} {case['rows'][0]['base_step_ms']:.1f} ms "
                          f"(predicted {case['predicted_base_ms']:.1f} ms)"
                          for case in result["zoo"]) + ".",
              "Measured region forwards: each checkpointed region's forward run alone with "
              "grad enabled (what the reruns re-execute); measured minus that is the "
              "checkpoint overhead as measured, next to the overhead term of the prediction "
              "(predicted minus predicted without overhead). Predicted, recalibrated: the "
              "same with the constants measured by the calibration chains interleaved with "
              "the steps. Step times: lower quartiles of interleaved steps.",
              f"Step clock: {result['clock']}. Wall time {result['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: a shared host oversubscribed by "
                             "other processes makes multi-threaded CPU ops erratic)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    torch.set_num_threads(opts.threads)
    started = time.perf_counter()
    calibrate_checkpoint_costs(device, budget_s=0.1)  # first use imports torch._dynamo
    m = micro(device, 8 if opts.quick else 40)
    print(f"grid fit: region {m['region_ms'] * 1e3:.0f} us, saved tensor "
          f"{m['pack_ms'] * 1e3:.1f} us, SAC op {m['sac_op_ms'] * 1e3:.1f} us", flush=True)
    calibrations = []
    for _ in range(2 if opts.quick else 5):
        began = time.perf_counter()
        c = calibrate_checkpoint_costs(device)
        calibrations.append({**c.model_dump(), "seconds": time.perf_counter() - began})
    cases = []
    for name, kwargs in ZOO:
        if name.startswith("hf-") and not zoo.has_transformers():
            continue
        kwargs = {**kwargs, "device": opts.device}
        cases.append(zoo_case(name, kwargs, 5 if opts.quick else 30, plans=not opts.quick))
        for r in cases[-1]["rows"]:
            print(f"{cases[-1]['model']:<22} {r['strategy']:<40} measured "
                  f"{r['measured_ms']:7.1f} ms  predicted {r['predicted_ms']:7.1f} ms "
                  f"(without overhead {r['predicted_without_overhead_ms']:7.1f})", flush=True)
    result = dict(torch=torch.__version__, device=opts.device,
                  device_name=(torch.cuda.get_device_name() if opts.device == "cuda" else
                               f"CPU {platform.machine()}, {torch.get_num_threads()} threads"),
                  date=datetime.datetime.now().isoformat(timespec="seconds"), micro=m,
                  calibrations=calibrations, zoo=cases, clock=_model_clock(device).__name__,
                  wall_s=time.perf_counter() - started)
    opts.out.mkdir(parents=True, exist_ok=True)
    stem = f"checkpoint-overhead-{opts.device}" + ("-quick" if opts.quick else "")
    (opts.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (opts.out / f"{stem}.md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
