"""Hugging Face Trainer with ``torch_compile=True`` and the switch, on the CPU: padded
batches of every length, each training step measured against the plan's budget.

    python benchmarks/compile_trainer.py                  # HF Llama tiny and HF GPT-2
    python benchmarks/compile_trainer.py --models hf-llama --steps 8

Per model, a training set of rows of random lengths (``--shortest`` to ``--longest``
tokens), batched by a collator that pads each batch to its longest row (masks with zeros,
labels -100), so the Trainer gives a new length at almost every step. Trained twice,
``torch_compile=True`` each time (inductor's C++), AdamW: without the switch, and with
``PlannedCheckpointing(budget_gb=...)`` at ``--share`` of the unplanned compiled step's
largest peak, or where no schedule fits that, at the least the switch's error names (the
switch plans the compiled step over the Trainer's envelope: ``compiled="model"``). Each
``training_step`` (forward and backward) is measured by the CPU allocator's events, one
profiler from training's start to its end (``_StepPeaks``: absolute peaks, everything
training holds, what one step leaves to the next included); the verdict: every step
within the budget (a step in which dynamo compiled is marked; the first step holds no
optimizer state yet). Losses of the two runs side by side (compile's tolerance, not
bit-identical).

Writes benchmarks/results/compile-trainer-cpu.{json,md} (``--out`` another folder).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from planner import InfeasibleBudgetError, zoo
from planner.switches.hf_trainer import PlannedCheckpointing

MIB = 2**20
MODELS = {"hf-llama": dict(batch=4), "hf-gpt2": dict(batch=4)}


def _rows(vocab: int, count: int, shortest: int, longest: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=gen)
    lengths[0] = longest  # the set's longest row is the envelope's
    return [{"input_ids": torch.randint(0, vocab, (int(n),), generator=gen)} for n in lengths]


def _pad(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Each batch padded to its longest row: ids 0, mask 0 and labels -100 at the pads."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row["input_ids"])] = row["input_ids"]
        mask[i, :len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


class _MeasuredTrainer(transformers.Trainer):
    """Each ``training_step`` marked for :class:`_StepPeaks`; ``steps`` gets (tokens, padded,
    compiled in it)."""

    steps: list[tuple[int, bool, bool]]

    def training_step(self, model: Any, inputs: dict, *rest: Any, **kw: Any) -> Any:
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        with torch.profiler.record_function(f"{_STEP}{len(self.steps)}"):
            out = transformers.Trainer.training_step(self, model, inputs, *rest, **kw)
        self.steps.append((inputs["input_ids"].shape[1], not bool(inputs["attention_mask"].all()),
                           counters["stats"]["unique_graphs"] > graphs))
        return out


_STEP = "measured training_step "


class _StepPeaks(transformers.TrainerCallback):
    """The CPU allocator's events from training's start (after the switch planned) to its
    end, replayed in time order: what every tensor made since holds (gradients, AdamW's
    state, batches, activations, compiled code's buffers, what a step leaves to the next),
    at most within each training_step, plus the parameters and buffers made before. The
    peaks are absolute, as the plan's budget is; nothing is left out for a block allocated
    before a step and freed in it (``planner.measure.allocator_peak`` measures one call)."""

    def __init__(self) -> None:
        self.prof: torch.profiler.profile | None = None
        self.peaks: list[int] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, *, model: Any = None,
                       **kw: Any) -> None:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*model.parameters(), *model.buffers())}
        self.static = sum(storages.values())
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                           profile_memory=True)
        self.prof.start()

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        from torch._C._profiler import _EventType

        assert self.prof is not None
        self.prof.stop()
        events, windows = [], {}
        stack = list(self.prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.name.startswith(_STEP):
                windows[int(node.name[len(_STEP):])] = (node.start_time_ns, node.end_time_ns)
            elif node.typed[0] == _EventType.Allocation and \
                    str(node.typed[1].device) == "cpu":
                events.append((node.start_time_ns, node.typed[1].alloc_size,
                               node.typed[1].ptr))
            stack.extend(node.children)
        self.peaks = [self.static + _most_within(sorted(events), *windows[i])
                      for i in sorted(windows)]


def _most_within(events: list[tuple[int, int, int]], start: int, end: int) -> int:
    """The most the blocks allocated since the events began hold within [start, end]."""
    allocated: dict[int, int] = {}
    live = most = 0
    for when, size, ptr in events:
        if when > end:
            break
        if size < 0 and allocated.pop(ptr, None) is None:
            continue  # allocated before the events began
        if size > 0:
            allocated[ptr] = size
        live += size
        if when >= start:
            most = max(most, live)
    return most


def _train(model: torch.nn.Module, rows: list, out: Path, steps: int, batch: int,
           callbacks: list) -> tuple[_MeasuredTrainer, list[tuple[int, bool, bool, int]]]:
    torch._dynamo.reset()
    # accelerate marks a model it prepared, and a later Trainer's prepare skips it: that
    # Trainer would train it eager, uncompiled (measured: no graph compiled in the second run)
    model.__dict__.pop("_is_accelerate_prepared", None)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=batch, max_steps=steps,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        seed=0, dataloader_num_workers=0, disable_tqdm=True, torch_compile=True)
    peaks = _StepPeaks()
    trainer = _MeasuredTrainer(model=model, args=args, train_dataset=rows, data_collator=_pad,
                               callbacks=[*callbacks, peaks])
    trainer.steps = []
    trainer.train()
    return trainer, [(*step, peak) for step, peak in zip(trainer.steps, peaks.peaks,
                                                          strict=True)]


def run_model(name: str, steps: int, shortest: int, longest: int, share: float,
              out: Path) -> dict:
    cfg = MODELS[name]
    zm = zoo.get(name, batch=cfg["batch"])
    vocab = zm.model.config.vocab_size
    rows = _rows(vocab, steps * cfg["batch"] * 2, shortest, longest)
    start = {k: v.clone() for k, v in zm.model.state_dict().items()}
    began = time.perf_counter()
    plain, plain_steps = _train(zm.model, rows, out / f"{name}-plain", steps, cfg["batch"],
                                [])
    zm.model.load_state_dict(start)
    unplanned = max(p for *_, compiling, p in plain_steps if not compiling)
    budget = int(share * unplanned)
    where = out / f"{name}-planned"
    try:
        planned, planned_steps, plan = _planned(zm.model, rows, where, steps, cfg["batch"],
                                                budget)
    except InfeasibleBudgetError as error:  # the least the fit measured, which it holds
        zm.model.load_state_dict(start)
        budget = error.min_budget_bytes
        planned, planned_steps, plan = _planned(zm.model, rows, where, steps, cfg["batch"],
                                                budget)
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h]
              for t in (plain, planned)]
    measured = planned_steps
    return {"model": name, "budget_bytes": budget, "share": share,
            "unplanned_peak_bytes": unplanned, "plan_peak_bytes": plan.compiled.peak_bytes,
            "plan_batches": plan.compiled.batches, "source": plan.compiled.source,
            "compiles": plan.compiled.compiles,
            "steps_plain": plain_steps, "steps_planned": planned_steps,
            "within": sum(p <= budget for *_, p in measured), "measured": len(measured),
            "losses": losses, "seconds": round(time.perf_counter() - began, 1)}


def _planned(model: torch.nn.Module, rows: list, out: Path, steps: int, batch: int,
             budget: int) -> tuple[_MeasuredTrainer, list, Any]:
    switch = PlannedCheckpointing(budget_gb=budget / 2**30, timing="estimate", solver="dp")
    trainer, measured = _train(model, rows, out, steps, batch, [switch])
    return trainer, measured, switch.plan


def _markdown(rows: list[dict], argv: list[str]) -> str:
    lines = [f"# HF Trainer, torch_compile=True, padded batches of every length "
             f"(`python benchmarks/compile_trainer.py {' '.join(argv)}`)", "",
             f"torch {torch.__version__}, transformers {transformers.__version__}, "
             f"{platform.machine()}; CPU, inductor's C++; peaks of each training_step "
             "(forward and backward) by the CPU allocator's events, MiB.", "",
             "| model | budget | unplanned compiled (largest step) | plan's measured peak | "
             "steps within budget | planned on | seconds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        batches = "; ".join(f"{label} {peak / MIB:.3f}" for label, peak in r["plan_batches"])
        lines.append(f"| {r['model']} | {r['budget_bytes'] / MIB:.3f} | "
                     f"{r['unplanned_peak_bytes'] / MIB:.3f} | "
                     f"{r['plan_peak_bytes'] / MIB:.3f} ({r['source']}) | "
                     f"{r['within']} of {r['measured']} | {batches} | {r['seconds']} |")
    lines += ["", "Each step: tokens, padded, compiled in it, peak MiB (planned; plain).", ""]
    for r in rows:
        lines.append(f"- {r['model']}: " + ", ".join(
            f"{n}{'p' if pad else ''}{'*' if comp else ''} {peak / MIB:.3f}"
            for n, pad, comp, peak in r["steps_planned"]) + " (plain: " + ", ".join(
            f"{n}{'*' if comp else ''} {peak / MIB:.3f}"
            for n, _, comp, peak in r["steps_plain"]) + ")")
        lines.append(f"  losses planned / plain: {r['losses'][1]} / {r['losses'][0]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--shortest", type=int, default=8)
    parser.add_argument("--longest", type=int, default=64)
    parser.add_argument("--share", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="compile-trainer-"))  # the Trainer's output_dir
    rows = []
    for name in args.models:
        rows.append(run_model(name, args.steps, args.shortest, args.longest, args.share, work))
        print(f"{name}: {rows[-1]['within']} of {rows[-1]['measured']} steps within budget, "
              f"{rows[-1]['seconds']} s", flush=True)
    (args.out / "compile-trainer-cpu.json").write_text(json.dumps(rows, indent=1))
    (args.out / "compile-trainer-cpu.md").write_text(_markdown(rows, argv))


if __name__ == "__main__":
    main(sys.argv[1:])
