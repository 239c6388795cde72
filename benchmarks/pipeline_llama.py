"""A 16-layer Llama-style pipeline of 4 stages: one plan per stage and a balanced split,
against checkpointing every layer of a uniform split (what users apply to every stage).

    python benchmarks/pipeline_llama.py            # 1F1B, 8 microbatches, 10/12/16/20 GiB
    python benchmarks/pipeline_llama.py --budgets 16 --layers 3 5

HF ``LlamaForCausalLM`` at the 7B width (hidden 4096, intermediate 11008) with 16 layers,
built on the meta device in bf16; a stage is the first stage's embedding and layers, a middle
stage's layers, or the last stage's layers, norm and LM head, run on one microbatch of
1 x 4096 tokens (torchtitan's ``module_fqns_per_model_part``), trained with AdamW (its
state counted, in the parameters' bf16). Each stage's step is profiled
on the meta device with the H100's estimated timing (``planner.pipeline.stage.StageSteps``) and
every number is the planner's replay of the stage over one 1F1B step
(``solvers.pipeline``): stage r of p holds min(m, p - r) microbatches.

Per budget (per GPU), three ways to run the pipeline:

- **every layer, uniform split**: 4 layers per stage, each layer checkpointed (torchtitan's
  full AC, applied to every model part);
- **per-stage plans, uniform split**: each stage planned for what it holds
  (``StageSteps.plan``: the least recompute whose stage peak fits);
- **per-stage plans, balanced split**: the split of the layers (each stage between
  ``--layers`` bounds) whose slowest stage is fastest, each stage planned
  (``planner.pipeline.split.plan_pipeline``).

A stage's time is one microbatch's forward, backward and recompute; the pipeline's step is
(m + p - 1) slots of the slowest stage (1F1B's bubble model: every slot waits for the
slowest stage).

Interleaved1F1B (``--chunks``, default 2): the same 16 layers as 4 ranks x 2 chunks of 2
layers (stage c·4 + r on rank r), every rank's chunks replayed together over one step
(``solvers.pipeline.rank_peak``); every layer checkpointed on every chunk against each
rank's chunks planned together (``planner.pipeline.rank.RankSteps.plan``). A rank's time is
its chunks' times for one microbatch; the step is m + (p - 1)/v slots of the slowest rank
(the interleaved bubble); and the chunks' layers balanced (1 to 3 a chunk,
``planner.pipeline.split.plan_interleaved``).

Zero-bubble schedules in a V (``--v-schedules``, default ZBVZeroBubble and DualPipeV): 4
ranks x 2 chunks of 2 layers, rank r holding stages r and 7 - r; each rank's unplanned
peak, the least its plans reach (only the pipeline's first stage checkpoints under a split
backward), and its planned peak at each budget. Writes
``benchmarks/results/pipeline-llama.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
from torch import nn

from planner import zoo
from planner.pipeline.rank import RankSteps
from planner.pipeline.split import PipelinePlan, plan_interleaved, plan_pipeline
from planner.pipeline.stage import StageSteps
from planner.plan import GIB, InfeasibleBudgetError, format_bytes
from solvers import Schedule, simulate
from solvers.baselines import policy_schedule
from solvers.pipeline import StageSpec, rank_peak

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, STAGES, SEQ = 16, 4, 4096


class LlamaStage(nn.Module):
    """Layers ``first..last`` of an HF Llama as a pipeline stage (embedding on the first,
    norm and LM head on the last), as torchtitan's model parts cut it."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers:  # no mask: sdpa's causal kernel
            hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)
        if self.lm_head is None:
            return hidden
        return self.lm_head(self.norm(hidden))


def _next_token_loss(logits: torch.Tensor) -> torch.Tensor:
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


class StageCosts:
    """Each (stage index, layer count)'s profiled steps, made once."""

    def __init__(self, n_microbatches: int) -> None:
        zm = zoo.get("hf-llama", size="7b", batch=1, seq_len=SEQ, device="meta",
                     num_hidden_layers=LAYERS)
        self.model = zm.model.to(torch.bfloat16)
        self.hidden = zm.config["hidden_size"]
        self.n_microbatches = n_microbatches
        self._steps: dict[tuple[int, int], StageSteps] = {}

    def _microbatch(self, first: bool) -> tuple[torch.Tensor]:
        if first:
            return (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),)
        return (torch.empty(1, SEQ, self.hidden, dtype=torch.bfloat16, device="meta",
                            requires_grad=True),)

    def steps(self, rank: int, layers: int) -> StageSteps:
        if (rank, layers) not in self._steps:
            first, last = rank == 0, rank == STAGES - 1
            stage = LlamaStage(self.model, range(layers), first, last)
            microbatch = self._microbatch(first)
            spec = StageSpec(schedule="1F1B", stage_index=rank, num_stages=STAGES,
                             n_microbatches=self.n_microbatches)
            self._steps[rank, layers] = StageSteps(
                stage, microbatch, spec, loss_fn=_next_token_loss if last else None,
                target_bytes=8 * SEQ if last else 0, device="H100",
                optimizer=torch.optim.AdamW(stage.parameters()))
        return self._steps[rank, layers]


class ChunkCosts(StageCosts):
    """Each rank's chunks (``chunks`` per rank) under ``schedule``, each (rank, chunk,
    layers) profiled once."""

    def __init__(self, n_microbatches: int, chunks: int,
                 schedule: str = "Interleaved1F1B") -> None:
        super().__init__(n_microbatches)
        self.chunks, self.schedule = chunks, schedule
        self._chunks: dict[tuple[int, int, int], StageSteps] = {}
        self._ranks: dict[tuple[int, tuple[int, ...]], RankSteps] = {}

    def chunk(self, rank: int, chunk: int, layers: int) -> StageSteps:
        if (rank, chunk, layers) not in self._chunks:
            spec = StageSpec(schedule=self.schedule, stage_index=rank, num_stages=STAGES,
                             n_microbatches=self.n_microbatches, num_chunks=self.chunks)
            first, last = spec.chunk_first(chunk), spec.chunk_last(chunk)
            stage = LlamaStage(self.model, range(layers), first, last)
            self._chunks[rank, chunk, layers] = StageSteps(
                stage, self._microbatch(first), spec,
                loss_fn=_next_token_loss if last else None,
                target_bytes=8 * SEQ if last else 0, chunk=chunk, device="H100",
                optimizer=torch.optim.AdamW(stage.parameters()))
        return self._chunks[rank, chunk, layers]

    def rank(self, rank: int, layers: tuple[int, ...] | None = None) -> RankSteps:
        """Rank ``rank`` with its chunks holding ``layers`` (default: the even split)."""
        layers = layers or (LAYERS // (STAGES * self.chunks),) * self.chunks
        if (rank, layers) not in self._ranks:
            self._ranks[rank, layers] = RankSteps(
                [self.chunk(rank, c, k) for c, k in enumerate(layers)])
        return self._ranks[rank, layers]


def interleaved_rows(costs: ChunkCosts, budget_gib: float, time_limit_s: float) -> dict:
    """Every layer checkpointed on every chunk, each rank's chunks planned together, and
    the chunks' layers balanced."""
    budget, m = int(budget_gib * GIB), costs.n_microbatches
    slots = m + (STAGES - 1) / costs.chunks
    even = [LAYERS // (STAGES * costs.chunks)] * (STAGES * costs.chunks)
    row: dict = {"budget_gib": budget_gib}
    for key in ("unplanned", "every_layer", "planned"):
        ranks = [_rank_numbers(costs.rank(r), key, budget, time_limit_s)
                 for r in range(STAGES)]
        row[key] = pipeline_of(ranks, even, slots)
    try:
        found = plan_interleaved(costs.rank, LAYERS, STAGES, costs.chunks,
                                 budget_gb=budget_gib, least=1, most=3,
                                 time_limit_s=time_limit_s)
        row["balanced"] = pipeline_of(
            [{"peak_bytes": r.peak_bytes, "time_ms": r.time_ms,
              "recompute_ms": sum(p.recompute_ms for p in r.plans)} for r in found],
            [found[g % STAGES].layers[g // STAGES] for g in range(len(even))], slots)
    except InfeasibleBudgetError:
        row["balanced"] = None
    return row


def v_rows(costs: ChunkCosts, budgets: list[float], time_limit_s: float) -> dict:
    """A zero-bubble schedule in a V (two chunks per rank, stages r and 2p - 1 - r): each
    rank's unplanned peak, the least rank peak its plans reach (only the chunk that is the
    pipeline's first stage checkpoints), and each rank's planned peak per budget (None
    where it does not fit)."""
    ranks = [costs.rank(r) for r in range(STAGES)]
    least = []
    for rank in ranks:
        try:
            least.append(rank.plan(1, time_limit_s)[1])
        except InfeasibleBudgetError as error:
            least.append(error.min_budget_bytes)
    rows = []
    for budget_gib in budgets:
        budget = int(budget_gib * GIB)
        rows.append({"budget_gib": budget_gib, "rank_peaks": [
            rank.plan(budget, time_limit_s)[1] if low <= budget else None
            for rank, low in zip(ranks, least, strict=True)]})
    return {"schedule": costs.schedule, "unplanned": [rank.peak() for rank in ranks],
            "least": least, "rows": rows}


def _rank_numbers(rank: RankSteps, key: str, budget: int, time_limit_s: float
                  ) -> dict | None:
    """A rank's peak, time and recompute unplanned, with every layer checkpointed, or with
    its chunks planned together (None: over the budget)."""
    if key == "planned":
        try:
            plans = rank.plan(budget, time_limit_s)[0]
        except InfeasibleBudgetError:
            return None
        schedules = [p.schedule for p in plans]
    else:
        schedules = [policy_schedule("every-layer", c.problems[1]) if key == "every_layer"
                     else Schedule.store_all(c.problems[1].n_nodes) for c in rank.chunks]
    timelines = [simulate(c.problems[1], s) for c, s in zip(rank.chunks, schedules,
                                                            strict=True)]
    peak = rank_peak(rank.spec, [c.replay(s) for c, s in zip(rank.chunks, schedules,
                                                             strict=True)])
    if peak > budget and key != "unplanned":
        return None
    return {"peak_bytes": peak, "time_ms": sum(t.total_time_ms for t in timelines),
            "recompute_ms": sum(t.recompute_time_ms for t in timelines)}


def every_layer(steps: StageSteps) -> dict:
    """Every layer checkpointed: the stage's peak and one microbatch's time."""
    problem = steps.problems[1]
    schedule = policy_schedule("every-layer", problem)
    timeline = simulate(problem, schedule)
    return {"peak_bytes": steps.peak(schedule), "time_ms": timeline.total_time_ms,
            "recompute_ms": timeline.recompute_time_ms}


def unplanned(steps: StageSteps) -> dict:
    problem = steps.problems[1]
    timeline = simulate(problem, Schedule.store_all(problem.n_nodes))
    return {"peak_bytes": steps.peak(), "time_ms": timeline.total_time_ms, "recompute_ms": 0.0}


def pipeline_of(stages: list[dict | None], split: list[int], slots: float) -> dict:
    """The pipeline's numbers from its stages' (or ranks'; None where one does not fit):
    the step is ``slots`` times the slowest."""
    fits = all(s is not None for s in stages)
    slowest = max(s["time_ms"] for s in stages) if fits else None
    return {"split": split, "fits": fits, "stages": stages,
            "total_recompute_ms": sum(s["recompute_ms"] for s in stages) if fits else None,
            "slowest_stage_ms": slowest, "step_ms": slots * slowest if fits else None}


def _of(pipeline: PipelinePlan, n_microbatches: int) -> dict:
    stages = [{"peak_bytes": stage.peak_bytes, "time_ms": stage.time_ms,
               "recompute_ms": stage.plan.recompute_ms} for stage in pipeline.stages]
    return pipeline_of(stages, pipeline.split, n_microbatches + STAGES - 1)


def rows_of(costs: StageCosts, budget_gib: float, args: argparse.Namespace) -> dict:
    budget = int(budget_gib * GIB)
    m, uniform = args.microbatches, [LAYERS // STAGES] * STAGES
    slots = m + STAGES - 1  # 1F1B's: every slot waits for the slowest stage
    row = {"budget_gib": budget_gib}
    row["unplanned"] = pipeline_of(
        [unplanned(costs.steps(r, k)) for r, k in enumerate(uniform)], uniform, slots)
    stages = [every_layer(costs.steps(r, k)) for r, k in enumerate(uniform)]
    row["every_layer"] = pipeline_of(
        [s if s["peak_bytes"] <= budget else None for s in stages], uniform, slots)
    for key, (least, most) in (("per_stage", (uniform[0], uniform[0])),
                               ("balanced", tuple(args.layers))):
        try:
            row[key] = _of(plan_pipeline(costs.steps, LAYERS, STAGES, budget_gb=budget_gib,
                                         least=least, most=most,
                                         time_limit_s=args.time_limit_s), m)
        except InfeasibleBudgetError:
            row[key] = None
    return row


def _cell(pipeline: dict | None) -> str:
    if pipeline is None or not pipeline["fits"]:
        return "does not fit"
    peaks = " / ".join(format_bytes(s["peak_bytes"]) for s in pipeline["stages"])
    return (f"split {pipeline['split']}: recompute {pipeline['total_recompute_ms']:.1f} ms, "
            f"slowest stage {pipeline['slowest_stage_ms']:.1f} ms, step "
            f"{pipeline['step_ms']:.0f} ms; peaks {peaks}")


WAYS = {"every_layer": "every layer, uniform split", "per_stage": "per-stage plans, uniform",
        "balanced": "per-stage plans, balanced split"}


def _row(budget: str, way: str, pipeline: dict | None, every: dict | None) -> str:
    if pipeline is None or not pipeline["fits"]:
        return f"| {budget} | {way} | does not fit | | | | | |"
    versus = f"{pipeline['step_ms'] / every['step_ms']:.2f}" if every and every["fits"] \
        else "-"
    peaks = " / ".join(f"{s['peak_bytes'] / GIB:.2f}" for s in pipeline["stages"])
    return (f"| {budget} | {way} | {pipeline['split']} | {pipeline['total_recompute_ms']:.1f} "
            f"| {pipeline['slowest_stage_ms']:.1f} | {pipeline['step_ms']:.0f} | {versus} "
            f"| {peaks} |")


def render(result: dict) -> str:
    lines = [f"# A 16-layer Llama pipeline, 4 stages, 1F1B ({result['date']}, torch "
             f"{result['torch']})", "",
             f"7B width, bf16, AdamW, microbatch 1 x {SEQ}, {result['microbatches']} "
             "microbatches, H100 estimates; every number is the planner's replay of each "
             "stage over one 1F1B step (`benchmarks/pipeline_llama.py`). Recompute is the "
             "stages' total per microbatch; a stage's time is one microbatch's forward + "
             "backward + recompute; the step is (m + p - 1) slots of the slowest stage. "
             "Peaks per stage in GiB.", "",
             "| budget | how | split | recompute (ms) | slowest stage (ms) | step (ms) | "
             "step / every layer's | stage peaks (GiB) |", "|---|---|---|---|---|---|---|---|"]
    first = result["rows"][0]
    lines.append(_row("none", "unplanned", first["unplanned"], None))
    for row in result["rows"]:
        for key, way in WAYS.items():
            lines.append(_row(f"{row['budget_gib']:g} GiB", way, row[key], row["every_layer"]))
    if result.get("interleaved"):
        v = result["chunks"]
        lines += ["", f"## Interleaved1F1B: 4 ranks x {v} chunks of {LAYERS // (STAGES * v)} "
                  "layers", "",
                  "Each rank's chunks replayed together over one step; a rank's time is its "
                  "chunks' for one microbatch, the step m + (p - 1)/v slots of the slowest "
                  "rank. Peaks per rank in GiB.", "",
                  "| budget | how | chunk layers | recompute (ms) | slowest rank (ms) | step (ms) "
                  "| step / every layer's | rank peaks (GiB) |",
                  "|---|---|---|---|---|---|---|---|"]
        rows = result["interleaved"]
        lines.append(_row("none", "unplanned", rows[0]["unplanned"], None))
        for row in rows:
            for key, way in (("every_layer", "every layer, every chunk"),
                             ("planned", "each rank's chunks planned together"),
                             ("balanced", "chunk layers balanced, planned together")):
                lines.append(_row(f"{row['budget_gib']:g} GiB", way, row[key],
                                  row["every_layer"]))
    if result.get("v_schedules"):
        lines += _v_section(result["v_schedules"])
    return "\n".join(lines) + "\n"


def _gib(peaks: list[int]) -> str:
    return " / ".join(f"{p / GIB:.2f}" for p in peaks)


def _v_section(schedules: list[dict]) -> list[str]:
    lines = ["", "## Zero-bubble schedules in a V: 4 ranks x 2 chunks of 2 layers", "",
             "Rank r holds stages r and 7 - r (rank 0 the first and the last). Each backward "
             "is split into the input's gradient and, later, the weights' "
             "(`planner.pipeline.split_backward` measures what a microbatch holds between them, on "
             "the meta device with the H100's fused kernels). Only the chunk that is the "
             "pipeline's first stage is planned: under the split torch reruns a checkpointed "
             "region once more per parameter group, so stages after the first run as "
             "profiled. No every-layer row: that is what torch's split makes costly. Rank "
             "peaks in GiB; `least` is the least rank peak the rank's plans reach, so the "
             "least per-GPU budget is its largest.", "",
             "| schedule | budget | rank peaks (GiB) |", "|---|---|---|"]
    for v in schedules:
        lines.append(f"| {v['schedule']} | unplanned | {_gib(v['unplanned'])} |")
        lines.append(f"| {v['schedule']} | least | {_gib(v['least'])} (per GPU: "
                     f"{max(v['least']) / GIB:.2f}) |")
        for row in v["rows"]:
            peaks = row["rank_peaks"]
            cell = _gib(peaks) if all(p is not None for p in peaks) else "does not fit (rank " + \
                ", ".join(str(r) for r, p in enumerate(peaks) if p is None) + ")"
            lines.append(f"| {v['schedule']} | {row['budget_gib']:g} GiB | {cell} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[10.0, 12.0, 16.0, 20.0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, nargs=2, default=[2, 6],
                        help="least and most layers a stage of the balanced split has")
    parser.add_argument("--time-limit-s", type=float, default=16.0)
    parser.add_argument("--chunks", type=int, default=2,
                        help="Interleaved1F1B's chunks per rank (0: leave it out)")
    parser.add_argument("--v-schedules", nargs="*", default=["ZBVZeroBubble", "DualPipeV"],
                        help="zero-bubble schedules in a V to replay (none: leave them out)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    costs = StageCosts(args.microbatches)
    rows = []
    for budget in args.budgets:
        rows.append(rows_of(costs, budget, args))
        print(f"{budget:g} GiB: every layer: {_cell(rows[-1]['every_layer'])}\n"
              f"  per-stage: {_cell(rows[-1]['per_stage'])}\n"
              f"  balanced: {_cell(rows[-1]['balanced'])}", flush=True)
    interleaved = []
    if args.chunks:
        chunk_costs = ChunkCosts(args.microbatches, args.chunks)
        for budget in args.budgets:
            interleaved.append(interleaved_rows(chunk_costs, budget, args.time_limit_s))
            print(f"{budget:g} GiB, interleaved: every layer: "
                  f"{_cell(interleaved[-1]['every_layer'])}\n"
                  f"  planned: {_cell(interleaved[-1]['planned'])}\n"
                  f"  balanced: {_cell(interleaved[-1]['balanced'])}", flush=True)
    v_schedules = []
    for schedule in args.v_schedules:
        v_schedules.append(v_rows(ChunkCosts(args.microbatches, 2, schedule), args.budgets,
                                  args.time_limit_s))
        print("\n".join(_v_section(v_schedules[-1:])[-2 - len(args.budgets):]), flush=True)
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "microbatches": args.microbatches, "rows": rows, "chunks": args.chunks,
              "interleaved": interleaved, "v_schedules": v_schedules,
              "seconds": round(time.perf_counter() - started)}
    if not args.no_write:
        (RESULTS / "pipeline-llama.json").write_text(json.dumps(result, indent=1))
        (RESULTS / "pipeline-llama.md").write_text(render(result))
    return result


if __name__ == "__main__":
    main()
