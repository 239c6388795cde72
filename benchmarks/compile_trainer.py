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
profiler from training's start to its end (`allocator_steps`: absolute peaks, everything
training holds, what one step leaves to the next included); the verdict: every step
within the budget (a step in which dynamo compiled is marked; the first step holds no
optimizer state yet). Losses of the two runs side by side (compile's tolerance, not
bit-identical).

Writes benchmarks/results/compile-trainer-cpu.{json,md} (``--out`` another folder).
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from allocator_steps import (
    AllocatorSteps,
    arguments,
    command,
    pad_to_longest,
    random_rows,
    run_and_write,
)

from planner import InfeasibleBudgetError, zoo
from planner.switches.hf_trainer import PlannedCheckpointing

MODELS = {"hf-llama": dict(batch=4), "hf-gpt2": dict(batch=4)}


class _MeasuredTrainer(transformers.Trainer):
    """Each ``training_step`` marked for :class:`_StepPeaks`; ``steps`` gets (tokens, padded,
    compiled in it)."""

    steps: list[tuple[int, bool, bool]]

    def training_step(self, model: Any, inputs: dict, *rest: Any, **kw: Any) -> Any:
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        with AllocatorSteps.step(len(self.steps)):
            out = transformers.Trainer.training_step(self, model, inputs, *rest, **kw)
        self.steps.append((inputs["input_ids"].shape[1], not bool(inputs["attention_mask"].all()),
                           counters["stats"]["unique_graphs"] > graphs))
        return out


class _StepPeaks(transformers.TrainerCallback):
    """Each training_step's peak by the CPU allocator's events (`allocator_steps`), from
    training's start (after the switch planned) to its end."""

    def __init__(self) -> None:
        self.steps = AllocatorSteps()
        self.peaks: list[int] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, *, model: Any = None,
                       **kw: Any) -> None:
        self.steps.start([*model.parameters(), *model.buffers()])

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.peaks = self.steps.stop()


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
    trainer = _MeasuredTrainer(model=model, args=args, train_dataset=rows,
                               data_collator=pad_to_longest, callbacks=[*callbacks, peaks])
    trainer.steps = []
    trainer.train()
    return trainer, [(*step, peak) for step, peak in zip(trainer.steps, peaks.peaks,
                                                          strict=True)]


def run_model(name: str, steps: int, shortest: int, longest: int, share: float,
              out: Path) -> dict:
    cfg = MODELS[name]
    zm = zoo.get(name, batch=cfg["batch"])
    vocab = zm.model.config.vocab_size
    rows = random_rows(vocab, steps * cfg["batch"] * 2, shortest, longest)
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


def main(argv: list[str]) -> None:
    args = arguments(__doc__.split("\n")[0], list(MODELS), argv)
    work = Path(tempfile.mkdtemp(prefix="compile-trainer-"))  # the Trainer's output_dir
    run_and_write(args, lambda name: run_model(name, args.steps, args.shortest, args.longest,
                                               args.share, work), "compile-trainer-cpu",
                  [f"# HF Trainer, torch_compile=True, padded batches of every length "
                   f"(`{command('compile_trainer.py', argv)}`)", "",
                   f"torch {torch.__version__}, transformers {transformers.__version__}, "
                   f"{platform.machine()}; CPU, inductor's C++; peaks of each training_step "
                   "(forward and backward) by the CPU allocator's events, MiB."])


if __name__ == "__main__":
    main(sys.argv[1:])
