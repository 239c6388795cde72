"""Predicted: keep, recompute or offload (ours, `solvers.joint`) against recompute only and
against offloading everything, on GPT-2-medium for an H100.

    python benchmarks/offload.py           # GPT-2-medium 24 x 1024, batch 8 x 1024 (~6 min)
    python benchmarks/offload.py --quick   # a tiny GPT (smoke test)

One profile (meta device, H100 roofline, the model of DESIGN.md's measured anchors) and one
simulator for every row; copies between device and host at the H100's `host_link`
(`profiles.devices`: its bandwidth and source are printed). At the H100 anchors (8.37 /
17.37 / 27.87 GiB, the peaks HF checkpointing, SAC save-linear and save-matmuls measured):
ours without and with offload, the joint solver's proven bound, the bytes moved each way,
the copy time and the stall. Peers, as the simulator replays them: offload every block's
saved activations with the next block prefetched (torchtune's `OffloadActivations`), and
the same fetched only when needed (`torch.autograd.graph.save_on_cpu`); ours at each peer's
peak. Nothing here has run on a GPU: the copy model (one queue per direction beside compute,
no contention with compute for memory bandwidth) is unmeasured.

Writes benchmarks/results/offload-predicted.{json,md,png} (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from predicted_frontier import ANCHORS_GIB

from planner import zoo
from planner.api import profile_model
from solvers import Schedule, auto, joint, simulate
from solvers.choice_bound import choice_bound
from solvers.from_profile import problem_from_profile
from solvers.problem import Problem

GIB = 2**30
RESULTS = Path(__file__).resolve().parent / "results"


def _row(problem: Problem, schedule: Schedule | None, step_ms: float) -> dict[str, Any]:
    if schedule is None:
        return {"feasible": False}
    tl = simulate(problem, schedule)
    return {"feasible": True, "peak_gib": tl.peak_bytes / GIB,
            "overhead": tl.added_time_ms / step_ms, "recompute_ms": tl.recompute_time_ms,
            "stall_ms": tl.stall_time_ms, "transfer_ms": tl.transfer_time_ms,
            "moved_gib": tl.offloaded_bytes / GIB, "offloaded_calls": len(schedule.offloads)}


def ours(problem: Problem, budget: int, step_ms: float, time_limit_s: float,
         deterministic: bool = False) -> dict[str, Any]:
    """Recompute only (auto) and with offload (joint) at `budget`."""
    started = time.perf_counter()
    plain = auto.solve(problem, budget, time_limit_s, deterministic=deterministic)
    plain_s = time.perf_counter() - started
    started = time.perf_counter()
    both = joint.solve(problem, budget, time_limit_s, deterministic=deterministic)
    joint_s = time.perf_counter() - started
    if plain.feasible and (not both.feasible or plain.objective_ms <= both.objective_ms):
        best = plain
    else:
        best = both
    limits = {"recompute_only": choice_bound(problem, budget, offload=False).added_ms,
              "with_offload": choice_bound(problem, budget).added_ms,
              "copies_out_in_forward": choice_bound(problem, budget,
                                                    copies_end_in_forward=True).added_ms}
    return {"budget_gib": budget / GIB,
            "any_choice_bound": {k: None if v is None else v / step_ms
                                 for k, v in limits.items()},
            "recompute_only": {**_row(problem, plain.schedule if plain.feasible else None,
                                      step_ms), "solve_s": plain_s},
            "with_offload": {**_row(problem, best.schedule if best.feasible else None,
                                    step_ms), "solve_s": plain_s + joint_s,
                             "bound": None if both.bound_ms is None else
                             min(both.bound_ms, plain.bound_ms or both.bound_ms) / step_ms,
                             "status": both.status.value,
                             "schedule": (best.schedule.describe() if best.feasible
                                          else None)}}


def peers(problem: Problem, step_ms: float) -> dict[str, dict[str, Any]]:
    """Offload every block, prefetching the next (torchtune), or fetching at need
    (save_on_cpu); nothing recomputed."""
    chain = [b for b in problem.blocks() if problem.is_call(*b)]
    store = Schedule.store_all(problem.n_nodes)
    return {"offload every block, prefetch the next (torchtune-style)":
            _row(problem, store.with_offloads(joint.offloads(problem, chain, chain, 1)),
                 step_ms),
            "offload every block, fetch when needed (save_on_cpu-style)":
            _row(problem, store.with_offloads(chain), step_ms)}


def bench(quick: bool, time_limit_s: float, deterministic: bool = False) -> dict[str, Any]:
    zm = (zoo.get("gpt", size="small", batch=2, device="meta") if quick else
          zoo.get("gpt", size="gpt2-medium", batch=8, device="meta"))
    profiled = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                             timing="estimate", device="H100", progress=False)
    problem = problem_from_profile(profiled.profile)
    plain = simulate(problem, Schedule.store_all(problem.n_nodes))
    step_ms = plain.forward_time_ms + plain.backward_time_ms
    link = problem.host_link
    print(f"{zm.name}: {problem.n_nodes} ops, unplanned {plain.peak_bytes / GIB:.2f} GiB, step "
          f"{step_ms:.0f} ms (H100 estimate); host link {link.d2h_gbps:g} GB/s each way "
          f"({link.source})", flush=True)
    anchors = []
    for name, (gib, _) in ({} if quick else ANCHORS_GIB).items():
        row = {"anchor": name, **ours(problem, int(gib * GIB), step_ms, time_limit_s,
                                      deterministic)}
        anchors.append(row)
        _print(f"at {gib:.2f} GiB ({name})", row)
    rows = []
    for name, peer in peers(problem, step_ms).items():
        row = {"peer": name, "theirs": peer,
               **ours(problem, int(peer["peak_gib"] * GIB), step_ms, time_limit_s,
                      deterministic)}
        rows.append(row)
        print(f"  {name}: peak {peer['peak_gib']:.2f} GiB, overhead {peer['overhead']:.1%} "
              f"(stall {peer['stall_ms']:.0f} ms)", flush=True)
        _print("    ours at that peak", row)
    return {"model": zm.name, "ops": problem.n_nodes, "unplanned_gib": plain.peak_bytes / GIB,
            "step_ms": step_ms, "host_link_gbps": link.d2h_gbps, "host_link_source": link.source,
            "anchors": anchors, "peers": rows}


def _print(label: str, row: dict[str, Any]) -> None:
    a, b, limit = row["recompute_only"], row["with_offload"], row["any_choice_bound"]
    print(f"  {label}: recompute only {_pct(a.get('overhead'))} (any per-tensor choice "
          f"{_pct(limit['recompute_only'])}); with offload "
          f"{_pct(b.get('overhead'))} (bound {_pct(b.get('bound'))}, any per-tensor choice "
          f">= {_pct(limit['with_offload'])}, copies out in the forward "
          f">= {_pct(limit['copies_out_in_forward'])}, "
          f"{b.get('moved_gib', 0):.1f} GiB each way, copies {b.get('transfer_ms', 0):.0f} ms, "
          f"stall {b.get('stall_ms', 0):.1f} ms, {b['solve_s']:.0f} s)", flush=True)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def markdown(result: dict[str, Any]) -> str:
    m = result["result"]
    out = ["# Predicted: keep, recompute or offload", "",
           f"{result['when']}, {result['machine']}; torch {result['torch']}. {m['model']}, "
           f"{m['ops']} ops, unplanned {m['unplanned_gib']:.2f} GiB, step {m['step_ms']:.0f} ms "
           f"(H100 estimate). Host link {m['host_link_gbps']:g} GB/s each way: "
           f"{m['host_link_source']}. Every number from `simulate`; none measured on a GPU. "
           "Overhead = (recompute + stall) / unplanned step.", "",
           "Bounds: the joint solver's, over its space; the LP over every per-tensor keep / "
           "recompute / offload choice (`solvers.choice_bound`), below which no planner goes; "
           "and the same LP with every copy out ended in the forward, as our runtime's "
           "releases (forward calls) end them, below which no schedule `simulate` replays goes.",
           "", "| budget | goal | recompute only | its any-choice bound | with offload | bound "
           "(joint space) | any-choice bound with offload | the same, copies out in the "
           "forward | moved each way | copies busy | stall | offloaded calls |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in m["anchors"]:
        r, o = a["recompute_only"], a["with_offload"]
        goal = ANCHORS_GIB[a["anchor"]][1]
        limit = a["any_choice_bound"]
        out.append(f"| {a['budget_gib']:.2f} GiB ({a['anchor']}) | {goal:.0%} | "
                   f"{_pct(r.get('overhead'))} | {_pct(limit['recompute_only'])} | "
                   f"{_pct(o.get('overhead'))} | {_pct(o.get('bound'))} | "
                   f"{_pct(limit['with_offload'])} | "
                   f"{_pct(limit.get('copies_out_in_forward'))} | "
                   f"{o.get('moved_gib', 0):.1f} GiB | "
                   f"{o.get('transfer_ms', 0):.0f} ms | {o.get('stall_ms', 0):.1f} ms | "
                   f"{o.get('offloaded_calls', 0)} |")
    out += ["", "| peer | its peak | its overhead (stall) | ours, recompute only | ours, with "
            "offload |", "|---|---|---|---|---|"]
    for p in m["peers"]:
        t = p["theirs"]
        out.append(f"| {p['peer']} | {t['peak_gib']:.2f} GiB | {_pct(t['overhead'])} "
                   f"({t['stall_ms']:.0f} ms) | {_pct(p['recompute_only'].get('overhead'))} | "
                   f"{_pct(p['with_offload'].get('overhead'))} |")
    return "\n".join(out) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["result"]
    rows = m["anchors"] + m["peers"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, color in (("recompute_only", "ours, recompute only", "tab:blue"),
                              ("with_offload", "ours, keep / recompute / offload",
                               "tab:orange")):
        points = sorted((r["budget_gib"], 100 * r[key]["overhead"]) for r in rows
                        if r[key].get("feasible"))
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", color=color, label=label)
    ours_top = max([100 * r[key]["overhead"] for r in rows
                    for key in ("recompute_only", "with_offload") if r[key].get("feasible")]
                   + [100 * goal for _, goal in ANCHORS_GIB.values()])
    top = 1.4 * ours_top  # peers far above are drawn at the top edge, their value named
    for k, p in enumerate(m["peers"]):
        t = p["theirs"]
        y = min(100 * t["overhead"], top * (0.95 - 0.08 * k))
        ax.scatter(t["peak_gib"], y, marker="x", s=60, zorder=3, color="0.2")
        ax.annotate(f"{p['peer'].split(' (')[0]}: {t['overhead']:.0%}", (t["peak_gib"], y),
                    textcoords="offset points", xytext=(8, -3), fontsize=8, ha="left")
    for k, (gib, goal) in enumerate(ANCHORS_GIB.values() if m["anchors"] else ()):
        ax.scatter(gib, 100 * goal, marker="*", color="tab:green", s=90, zorder=3,
                   label="DESIGN.md's goal at a measured H100 peak" if k == 0 else None)
    ax.set_ylim(0, top)
    ax.set_xlabel("budget / peak memory (GiB, predicted)")
    ax.set_ylabel("added step time (% of the unplanned step)")
    ax.set_title(f"{m['model']} on an H100 (predicted, not measured)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT (smoke test)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds")
    parser.add_argument("--deterministic", action="store_true",
                        help="the solvers decide by their work, never by the clock: the same "
                        "answers on a loaded machine (writes offload-predicted-deterministic)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.getLogger("profiles").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    result = {"when": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
              f"{torch.get_num_threads()} threads", "torch": torch.__version__,
              "deterministic": args.deterministic,
              "result": bench(args.quick, args.time_limit, args.deterministic)}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("offload-predicted" + ("-quick" if args.quick else "")
                       + ("-deterministic" if args.deterministic else ""))
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md, .png")
    return result


if __name__ == "__main__":
    main()
