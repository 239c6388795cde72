"""How much activation memory the planner can save on real models, and what users reach by hand.

    python benchmarks/reach.py                          # every conformance case (fp32)
    python benchmarks/reach.py --models resnet18 U-Net  # a subset (substring match)
    python benchmarks/reach.py --time-limit 10          # solver seconds per solve
    python benchmarks/reach.py --render                 # rewrite the .md from the .json

Each case of ``conformance_harness.CASES`` is built and profiled as ``conformance.py``
profiles its fp32 rows (CPU, real tensors, estimated times). For the lowest peak each space
of regions can reach, the share of the activation memory saved,
``(unplanned - peak) / (unplanned - static)``:

* module calls only (``problem_from_profile(op_ranges=False)``, ``auto.lowest_peak``);
* with op ranges of the traced forwards (``op_ranges=True``, ``auto.lowest_peak``);
* the schedule-independent lower bound (``bounds.memory_lower_bound``) of that problem;
* by hand: ``checkpoint_sequential`` style (every direct child call of the model
  checkpointed) and per-block checkpointing as Hugging Face and timm do (every repeated
  block that is one module call), both flat and simulated.

A full run writes ``benchmarks/results/reach.{json,md}``; a subset writes only where
``--out`` says. A row whose peak with op ranges is above its peak over module calls only
is a FAIL (op ranges add regions, they can only lower the reachable peak).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from conformance_harness import CASES, Case, quiet

from planner import ProfiledStep, profile_model
from planner.plan import format_bytes
from profiles.schema import GraphProfile
from solvers import Problem, Schedule, Solution, auto, memory_lower_bound, simulate
from solvers.from_profile import problem_from_profile

RESULTS = Path(__file__).resolve().parent / "results"
STEM = "reach"


@dataclass
class ReachRow:
    """One model: its peaks (bytes) and shares saved under each way of planning."""

    model: str
    family: str
    nodes: int = 0
    calls: int = 0  # module calls profiled
    traced: int = 0  # of them, forwards traced with torch.fx
    call_spans: int = 0  # module spans of kind "call" (emittable calls)
    ops_spans: int = 0  # module spans of kind "ops" (op ranges of traced forwards)
    unplanned_bytes: int = 0
    static_bytes: int = 0
    calls_peak: int | None = None
    calls_solver: str = ""
    calls_status: str = ""
    calls_s: float = 0.0
    ops_peak: int | None = None
    ops_solver: str = ""
    ops_status: str = ""
    ops_proven: bool = False  # CP-SAT proved no schedule of its space peaks lower
    ops_regions: int = 0
    ops_op_regions: int = 0  # of them, op ranges
    ops_s: float = 0.0
    bound_bytes: int | None = None
    sequential_regions: int = 0
    sequential_peak: int | None = None
    blocks_regions: int = 0
    blocks_peak: int | None = None
    profile_s: float = 0.0
    untraced: dict[str, int] = field(default_factory=dict)  # reason -> calls
    error: str = ""
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def share(self, peak: int | None) -> float | None:
        """The share of the activation memory saved at ``peak`` (None: not reached)."""
        activations = self.unplanned_bytes - self.static_bytes
        if peak is None or activations <= 0:
            return None
        return (self.unplanned_bytes - peak) / activations


# ----------------------------------------------------------------------------- hand policies


def flat_regions(problem: Problem, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` in order, without those that overlap an earlier one or hold a node that
    cannot be recomputed: the flat checkpoints a user's policy wraps."""
    chosen: list[tuple[int, int]] = []
    for a, b in sorted(set(spans)):
        if chosen and a < chosen[-1][1]:
            continue
        if b > a and all(problem.recomputable[a:b]) and problem.emittable(a, b):
            chosen.append((a, b))
    return chosen


def root_children(profile: GraphProfile, problem: Problem) -> list[tuple[int, int]]:
    """The call spans of the model's direct children (``checkpoint_sequential``'s regions)."""
    roots = [c.index for c in profile.module_calls if c.path == ""]
    if not roots:
        return []
    children = {(c.start, c.stop) for c in profile.module_calls if c.parent == roots[0]}
    return [(sp.start, sp.stop) for sp in problem.module_spans or ()
            if sp.kind == "call" and (sp.start, sp.stop) in children]


def block_spans(problem: Problem) -> list[tuple[int, int]]:
    """The repeated blocks that are one module call each (HF/timm gradient checkpointing)."""
    return [(a, b) for a, b in problem.blocks() if problem.is_call(a, b)]


def hand_peak(problem: Problem, spans: list[tuple[int, int]]) -> tuple[int, int | None]:
    """How many flat regions ``spans`` give, and the simulated peak (None: nothing to
    checkpoint)."""
    regions = flat_regions(problem, spans)
    if not regions:
        return 0, None
    return len(regions), simulate(problem, Schedule.from_segments(problem.n_nodes,
                                                                  regions)).peak_bytes


# ----------------------------------------------------------------------------- one model


def profile_case(case: Case) -> tuple[ProfiledStep, float]:
    """Build and profile ``case`` as conformance.py's fp32 rows do."""
    zm = case.build()
    started = time.perf_counter()
    with quiet():
        profiled = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                                 timing="estimate", autocast=None, progress=False,
                                 device=None)
    return profiled, time.perf_counter() - started


def lowest(problem: Problem, time_limit_s: float) -> tuple[Solution, int, float]:
    """``auto.lowest_peak`` and its schedule's simulated peak, with the solve's seconds."""
    started = time.perf_counter()
    sol = auto.lowest_peak(problem, time_limit_s)
    seconds = time.perf_counter() - started
    if sol.schedule is None:
        raise RuntimeError(f"lowest_peak found no schedule ({sol.solver}, {sol.status})")
    return sol, simulate(problem, sol.schedule).peak_bytes, seconds


def count_structure(row: ReachRow, profile: GraphProfile, problem: Problem) -> None:
    """Calls, traced calls, spans of each kind and why the others were not traced."""
    spans = problem.module_spans or []
    row.nodes = problem.n_nodes
    row.calls = len(profile.module_calls)
    row.traced = sum(bool(c.traced) for c in profile.module_calls)
    row.call_spans = sum(sp.kind == "call" for sp in spans)
    row.ops_spans = sum(sp.kind == "ops" for sp in spans)
    row.untraced = dict(Counter(c.untraced for c in profile.module_calls
                                if not c.traced and c.untraced).most_common())


def solve_spaces(row: ReachRow, calls: Problem, ops: Problem, time_limit_s: float) -> None:
    """The lowest peaks over module calls, and with op ranges."""
    sol, row.calls_peak, row.calls_s = lowest(calls, time_limit_s)
    row.calls_solver, row.calls_status = sol.solver, sol.status.value
    if sol.peak_bytes != row.calls_peak:
        row.warnings.append(f"module calls: solution says {sol.peak_bytes} B, simulated "
                            f"{row.calls_peak} B")
    sol, row.ops_peak, row.ops_s = lowest(ops, time_limit_s)
    row.ops_solver, row.ops_status = sol.solver, sol.status.value
    row.ops_proven = sol.least_peak_bytes is not None and sol.least_peak_bytes >= row.ops_peak
    if sol.peak_bytes != row.ops_peak:
        row.warnings.append(f"op ranges: solution says {sol.peak_bytes} B, simulated "
                            f"{row.ops_peak} B")
    recomputed = sol.schedule.recompute_regions() if sol.schedule else []
    row.ops_regions = len(recomputed)
    row.ops_op_regions = sum(1 for r in recomputed
                             if (sp := ops.span(r.start, r.stop)) is not None
                             and sp.kind == "ops")


def judge(row: ReachRow) -> None:
    """FAIL: op ranges peak above module calls only. Warnings: a peak below the lower bound,
    a hand policy that beats the solver, unplanned peaks that differ between problems."""
    if row.ops_peak is not None and row.calls_peak is not None \
            and row.ops_peak > row.calls_peak:
        row.failures.append(f"with op ranges {format_bytes(row.ops_peak)} > module calls "
                            f"only {format_bytes(row.calls_peak)}")
    for label, peak in (("module calls", row.calls_peak), ("op ranges", row.ops_peak)):
        if peak is not None and row.bound_bytes is not None and peak < row.bound_bytes:
            row.warnings.append(f"{label} peak {peak} B below the lower bound "
                                f"{row.bound_bytes} B")
    for label, peak in (("checkpoint_sequential", row.sequential_peak),
                        ("per block", row.blocks_peak)):
        if peak is not None and row.ops_peak is not None and peak < row.ops_peak:
            row.warnings.append(f"{label} by hand peaks lower ({peak} B) than the solver "
                                f"({row.ops_peak} B)")


def reach_case(case: Case, time_limit_s: float) -> ReachRow:
    """Profile ``case`` once, solve both spaces, bound, and simulate the hand policies."""
    row = ReachRow(case.name, case.family)
    stage = "build/profile"
    try:
        profiled, row.profile_s = profile_case(case)
        profile = profiled.profile
        stage = "problem"
        calls = problem_from_profile(profile, op_ranges=False)
        ops = problem_from_profile(profile, op_ranges=True)
        count_structure(row, profile, ops)
        row.static_bytes = ops.static_bytes
        row.unplanned_bytes = simulate(ops, Schedule.store_all(ops.n_nodes)).peak_bytes
        other = simulate(calls, Schedule.store_all(calls.n_nodes)).peak_bytes
        if other != row.unplanned_bytes:
            row.warnings.append(f"unplanned peaks differ: {other} B (calls) vs "
                                f"{row.unplanned_bytes} B (op ranges)")
        stage = "lower bound"
        row.bound_bytes = memory_lower_bound(ops)
        stage = "hand policies"
        row.sequential_regions, row.sequential_peak = hand_peak(
            calls, root_children(profile, calls))
        row.blocks_regions, row.blocks_peak = hand_peak(calls, block_spans(calls))
        stage = "lowest_peak"
        solve_spaces(row, calls, ops, time_limit_s)
    except Exception as error:  # a crash is a finding, not the end of the run
        tail = traceback.format_exc().strip().splitlines()[-6:]
        row.error = f"{stage}: {type(error).__name__}: {error}"
        row.failures.append(row.error)
        row.warnings.append("traceback: " + " | ".join(line.strip() for line in tail))
        return row
    judge(row)
    return row


# ----------------------------------------------------------------------------- reporting


def pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f} %"


def cell(row: ReachRow, peak: int | None, regions: int | None = None) -> str:
    """``share (peak)``, with the number of regions of a hand policy."""
    if peak is None:
        return "-"
    extra = f", {regions} regions" if regions is not None else ""
    return f"{pct(row.share(peak))} ({format_bytes(peak)}{extra})"


def table_line(r: ReachRow) -> str:
    if r.error:
        return (f"| {r.model} | {r.nodes or '-'} | {r.traced}/{r.calls} | {r.ops_spans} | "
                f"CRASH: {r.error} | | | | | | | |")
    proven = ", proven" if r.ops_proven else ""
    return (f"| {r.model} | {r.nodes} | {r.traced}/{r.calls} | {r.ops_spans} | "
            f"{format_bytes(r.unplanned_bytes)} | {cell(r, r.calls_peak)} | "
            f"{cell(r, r.ops_peak)} | {r.ops_solver} ({r.ops_status}{proven}), "
            f"{r.ops_op_regions}/{r.ops_regions} op ranges | {cell(r, r.bound_bytes)} | "
            f"{cell(r, r.sequential_peak, r.sequential_regions or None)} | "
            f"{cell(r, r.blocks_peak, r.blocks_regions or None)} | "
            f"{r.profile_s:.0f} / {r.calls_s:.0f} / {r.ops_s:.0f} |")


def markdown_table(rows: list[ReachRow]) -> str:
    lines = ["| model | ops | traced calls | op-range spans | unplanned peak | module calls "
             "only | with op ranges | solver (status), op ranges used | lower bound | "
             "checkpoint_sequential | per block | profile / calls / ops s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [table_line(r) for r in rows])


def summary(rows: list[ReachRow]) -> dict[str, Any]:
    solved = [r for r in rows if not r.error]
    gains = [(r.share(r.ops_peak) or 0) - (r.share(r.calls_peak) or 0) for r in solved]
    return {
        "models": len(rows),
        "crashed": [f"{r.model}: {r.error}" for r in rows if r.error],
        "with_traced_module": sum(r.traced > 0 for r in rows),
        "with_ops_spans": sum(r.ops_spans > 0 for r in rows),
        "op_ranges_lower": sum(r.ops_peak < r.calls_peak for r in solved),
        "max_gain_pct": round(100 * max(gains, default=0.0), 2),
        "fail_count": sum(1 for r in rows for f in r.failures if not r.error),
        "failures": [f"{r.model}: {f}" for r in rows for f in r.failures if not r.error],
        "warnings": [f"{r.model}: {w}" for r in rows for w in r.warnings],
    }


def render_markdown(result: dict) -> str:
    """The results file: what the columns mean, the table, the summary."""
    rows = [ReachRow(**r) for r in result["rows"]]
    s = result["summary"]
    failures = "".join(f"\n* FAIL {f}" for f in s["failures"]) or "\n* none"
    notes = "".join(f"\n* {w}" for w in s["warnings"]) or "\n* none"
    crashed = "".join(f"\n* {c}" for c in s["crashed"]) or "\n* none"
    return (
        f"# Reach: activation memory saved at the lowest plannable peak (CPU, fp32)\n\n"
        f"{result['date']}, {result['machine']}, {result['seconds']} s; "
        f"`auto.lowest_peak` with {result['time_limit_s']:.0f} s per solve.\n\n"
        f"Each cell: the share of the activation memory saved, (unplanned - peak) / "
        f"(unplanned - static), and the peak. *module calls only*: regions are module "
        f"calls (`problem_from_profile(op_ranges=False)`); *with op ranges*: also runs of "
        f"a traced forward's segments (`op_ranges=True`), then the solver that found it, "
        f"whether CP-SAT proved no schedule of its space peaks lower, and how many of the "
        f"plan's regions are op ranges; *lower bound*: `memory_lower_bound` (no schedule "
        f"saves more); by hand, flat and simulated: *checkpoint_sequential* checkpoints "
        f"every direct child call of the model, *per block* every repeated block that is "
        f"one module call (Hugging Face / timm gradient checkpointing); \"-\": the policy "
        f"has nothing to checkpoint. *traced calls*: module calls whose forward was traced "
        f"with torch.fx, of all calls; *op-range spans*: the regions that tracing adds.\n\n"
        f"{s['models']} models; {s['with_traced_module']} with at least one traced module "
        f"call, {s['with_ops_spans']} with op-range spans; op ranges lower the peak on "
        f"{s['op_ranges_lower']} (at most {s['max_gain_pct']:.1f} points more saved); "
        f"{s['fail_count']} FAIL (op ranges above module calls only); "
        f"{len(s['crashed'])} crashed.\n\n{markdown_table(rows)}\n\n"
        f"## Failures\n{failures}\n\n## Crashes\n{crashed}\n\n## Notes\n{notes}\n")


def run(cases: list[Case], time_limit_s: float) -> tuple[list[ReachRow], list[str]]:
    """Every case, one progress line each as it finishes."""
    rows, skipped = [], []
    for case in cases:
        if case.needs and importlib.util.find_spec(case.needs) is None:
            skipped.append(f"{case.name}: needs {case.needs}")
            continue
        t0 = time.perf_counter()
        row = reach_case(case, time_limit_s)
        rows.append(row)
        if row.error:
            print(f"{case.name}: CRASH {row.error} ({time.perf_counter() - t0:.1f} s)\n    "
                  + "\n    ".join(row.warnings), flush=True)
            continue
        print(f"{case.name}: calls {pct(row.share(row.calls_peak))}, op ranges "
              f"{pct(row.share(row.ops_peak))}, bound {pct(row.share(row.bound_bytes))}, "
              f"sequential {pct(row.share(row.sequential_peak))}, blocks "
              f"{pct(row.share(row.blocks_peak))}; traced {row.traced}/{row.calls}, "
              f"{row.ops_spans} op spans ({time.perf_counter() - t0:.1f} s)", flush=True)
        for failure in row.failures:
            print(f"    FAIL {failure}", flush=True)
        for warning in row.warnings:
            print(f"    note: {warning}", flush=True)
    return rows, skipped


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=None,
                        help="run the cases whose name contains any of these")
    parser.add_argument("--time-limit", type=float, default=30.0,
                        help="solver seconds per lowest_peak solve")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write {STEM}.{{json,md}} (default: {RESULTS} for "
                             "a full run; a subset writes only when given)")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the .md from the recorded .json")
    args = parser.parse_args(argv)
    out = args.out or (None if args.models else RESULTS)
    if args.render:
        result = json.loads(((out or RESULTS) / f"{STEM}.json").read_text())
        ((out or RESULTS) / f"{STEM}.md").write_text(render_markdown(result))
        return result
    torch.set_num_threads(2)
    cases = [c for c in CASES if not args.models
             or any(m.lower() in c.name.lower() for m in args.models)]
    started = time.perf_counter()
    rows, skipped = run(cases, args.time_limit)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "seconds": round(time.perf_counter() - started, 1),
        "time_limit_s": args.time_limit,
        "summary": summary(rows),
        "skipped": skipped,
        "rows": [asdict(r) for r in rows],
    }
    print("\n" + markdown_table(rows))
    print(json.dumps({k: v for k, v in result["summary"].items() if k != "warnings"},
                     indent=1))
    print(f"{result['seconds']} s")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{STEM}.json").write_text(json.dumps(result, indent=1))
        (out / f"{STEM}.md").write_text(render_markdown(result))
    return result


if __name__ == "__main__":
    main()
