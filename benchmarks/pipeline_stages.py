"""Pipeline stages' peaks, measured against the planner's replay (`solvers.pipeline`).

    python benchmarks/pipeline_stages.py   # 2, 3 and 4 ranks, 2, 4 and 8 microbatches

torch's GPipe and 1F1B run a small GPT cut into stages of two blocks, one gloo process per
stage (`pipeline_harness`), once with nothing checkpointed and once with a plan per stage
(one microbatch's step planned halfway between its static memory and its peak).
Interleaved1F1B runs two stages (chunks) per rank, cut the same way, unplanned and with
the rank's chunks planned together (`planner.plan_rank`) halfway between the rank's static
memory and its unplanned peak (or at the least rank peak found). The zero-bubble schedules
split each backward: InterleavedZeroBubble with one and two chunks per rank, ZBVZeroBubble
and DualPipeV with two in a V (stages r and 2p - 1 - r); planned as Interleaved1F1B is,
their stages after the first run as profiled (`planner.pipeline.split_backward`).
``--schedules`` runs some of them. Each rank's measured peak counts everything its process
holds (`PeakTracker(follow_resizes=True)`, as a GPU allocator counts); the prediction
replays the rank's passes in its schedule's order from the profile of one microbatch per
chunk. Writes ``benchmarks/results/pipeline-stages-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
from pathlib import Path

import pipeline_harness as harness
import torch

from planner.plan import format_bytes

RESULTS = Path(__file__).resolve().parent / "results"


def _predicted(specs: list, planned: bool) -> tuple[list[int], list | None]:
    """Each rank's predicted peak, and the plans by pipeline stage (None: unplanned)."""
    if specs[0].num_chunks == 1 and not specs[0].splits_backward:
        plans = [harness.halfway_plan(spec) for spec in specs] if planned else None
        return [harness.predicted_peak(spec, plans[r] if plans else None)
                for r, spec in enumerate(specs)], plans
    ranks = [harness.rank_steps(spec) for spec in specs]
    by_rank = [harness.halfway_rank_plans(rank) if planned else None for rank in ranks]
    by_stage = None
    if planned:
        chunk_of = {spec.chunk_stage(c): (r, c) for r, spec in enumerate(specs)
                    for c in range(spec.num_chunks)}
        by_stage = [by_rank[r][c] for _, (r, c) in sorted(chunk_of.items())]
    return [rank.peak(plans) for rank, plans in zip(ranks, by_rank, strict=True)], by_stage


def rows_of(schedule: str, world: int, n_microbatches: int, planned: bool,
            scratch: Path, chunks: int = 1) -> list[dict]:
    specs = [harness.spec_of(schedule, r, world, n_microbatches, chunks)
             for r in range(world)]
    predicted_peaks, plans = _predicted(specs, planned)
    ran = harness.run_pipeline(schedule, world, n_microbatches,
                               scratch / f"{schedule}-{world}-{n_microbatches}-{planned}",
                               plans, chunks=chunks)
    rows = []
    for rank, spec in enumerate(specs):
        predicted = predicted_peaks[rank]
        measured = ran[rank]["peak"]
        rows.append({"schedule": schedule, "stages": world, "microbatches": n_microbatches,
                     "chunks": chunks,
                     "stage": rank, "planned": planned, "in_flight": spec.in_flight(),
                     "order_as_replayed": [tuple(a) for a in ran[rank]["order"]]
                     == spec.actions(),
                     "measured_bytes": measured, "predicted_bytes": predicted,
                     "error_pct": 100 * (predicted - measured) / measured})
        print(f"{schedule:>5} {world} stages x {n_microbatches} microbatches, stage {rank}"
              f"{' planned' if planned else ''}: measured {format_bytes(measured)}, "
              f"predicted {format_bytes(predicted)} ({rows[-1]['error_pct']:+.2f} %)",
              flush=True)
    return rows


# each schedule, with the chunks per rank it runs
SCHEDULES = {"GPipe": (1,), "1F1B": (1,), "Interleaved1F1B": (2,),
             "InterleavedZeroBubble": (1, 2), "ZBVZeroBubble": (2,), "DualPipeV": (2,)}


def _runs(schedules: list[str], world: int, m: int) -> list[tuple[str, int]]:
    """The schedules torch takes for ``world`` ranks and ``m`` microbatches, with their
    chunks per rank."""
    runs = []
    for schedule in schedules:
        for chunks in SCHEDULES[schedule]:
            try:
                harness.spec_of(schedule, 0, world, m, chunks)
            except ValueError:  # e.g. 1F1B with fewer microbatches than stages
                continue
            runs.append((schedule, chunks))
    return runs


def render(result: dict) -> str:
    rows = result["rows"]
    exact = sum(abs(r["measured_bytes"] - r["predicted_bytes"]) <= 64 for r in rows)
    worst = max(rows, key=lambda r: abs(r["error_pct"]))
    lines = [f"# Pipeline stages: measured and predicted peaks ({result['date']}, torch "
             f"{result['torch']}, {result['machine']})", "",
             "A GPT cut into stages of two blocks (width 128, 4 x 64 tokens per microbatch), "
             "torch's schedules over gloo, one process per rank (x2: two stages per "
             "rank, `stages` counts ranks, `stage` is the rank); measured: "
             "everything the process holds. Predicted: `planner.pipeline.stage.stage_peak_bytes`, "
             "for a rank of chunks `planner.pipeline.rank.RankSteps.peak`.", "",
             f"{len(rows)} stage peaks: {exact} within 64 bytes, worst "
             f"{worst['error_pct']:+.2f} % ({worst['schedule']}, {worst['stages']} stages, "
             f"stage {worst['stage']}{', planned' if worst['planned'] else ''}); "
             f"{sum(r['order_as_replayed'] for r in rows)} of {len(rows)} ran their "
             "passes in the replayed order.", "",
             "| schedule | stages | microbatches | stage | plan | in flight | measured | "
             "predicted | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        schedule = r["schedule"] + (f" x{r['chunks']}" if r.get("chunks", 1) > 1 else "")
        lines.append(f"| {schedule} | {r['stages']} | {r['microbatches']} | "
                     f"{r['stage']} | {'yes' if r['planned'] else 'no'} | {r['in_flight']} | "
                     f"{format_bytes(r['measured_bytes'])} | "
                     f"{format_bytes(r['predicted_bytes'])} | {r['error_pct']:+.2f} % |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 3, 4])
    parser.add_argument("--microbatches", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES),
                        choices=list(SCHEDULES))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for world in args.stages:
            for m in args.microbatches:
                for schedule, chunks in _runs(args.schedules, world, m):
                    for planned in (False, True):
                        rows += rows_of(schedule, world, m, planned, Path(scratch), chunks)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__,
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "rows": rows}
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "pipeline-stages-cpu.json").write_text(json.dumps(result, indent=1))
        (RESULTS / "pipeline-stages-cpu.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
