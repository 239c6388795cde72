"""Lightning's ``Trainer.fit(torch.compile(module))`` with the switch, on the CPU: padded
batches of every length, each training step measured against the plan's budget.

    python benchmarks/compile_lightning.py                  # HF Llama tiny and HF GPT-2
    python benchmarks/compile_lightning.py --models hf-gpt2 --steps 8

As `compile_trainer.py` does for the HF Trainer: per model, rows of random lengths
(``--shortest`` to ``--longest`` tokens) batched by a loader that pads each batch to its
longest row, so training meets a new length at almost every step. A LightningModule as
users write one (``training_step`` returns ``model(**batch).loss`` and logs it, AdamW),
fitted twice, compiled each time (``torch.compile(module)``, inductor's C++): without the
switch, and with ``PlannedCheckpointing(budget_gb=..., max_length=--longest)`` at
``--share`` of the unplanned compiled step's largest peak, or where no schedule fits that,
at the least the switch's error names (the switch plans the step Lightning compiles:
``compiled="model"``). Each ``training_step`` with its backward is measured by the CPU
allocator's events (`allocator_steps`: absolute peaks); the verdict: every step within the
budget (a step in which dynamo compiled is marked; the first holds no optimizer state yet).
Losses of the two runs side by side (compile's tolerance, not bit-identical).

Writes benchmarks/results/compile-lightning-cpu.{json,md} (``--out`` another folder).
"""

from __future__ import annotations

import platform
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from allocator_steps import (
    AllocatorSteps,
    arguments,
    command,
    pad_to_longest,
    random_rows,
    run_and_write,
)

from planner import InfeasibleBudgetError, zoo
from planner.switches.lightning import PlannedCheckpointing

MODELS = {"hf-llama": dict(batch=4), "hf-gpt2": dict(batch=4)}


class CausalLM(pl.LightningModule):
    """A Hugging Face causal LM as users train one in Lightning."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Measured(pl.Callback):
    """Each ``training_step`` and its backward marked for the allocator's events (the
    optimizer's step left out, as the plan's step leaves it); ``steps`` gets (tokens,
    padded, compiled in it) and ``losses`` each step's loss."""

    def __init__(self) -> None:
        self.events = AllocatorSteps()
        self.steps: list[tuple[int, bool, bool]] = []
        self.losses: list[float] = []
        self.peaks: list[int] = []
        self._window: Any = None
        self._graphs = 0

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.events.start([*module.parameters(), *module.buffers()])  # after the switch's

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        from torch._dynamo.utils import counters

        self._graphs = counters["stats"]["unique_graphs"]
        self._window = AllocatorSteps.step(len(self.steps))
        self._window.__enter__()
        self._batch = batch

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        from torch._dynamo.utils import counters

        self._window.__exit__(None, None, None)
        mask = self._batch["attention_mask"]
        self.steps.append((mask.shape[1], not bool(mask.all()),
                           counters["stats"]["unique_graphs"] > self._graphs))

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.peaks = self.events.stop()


def _fit(model: torch.nn.Module, rows: list, steps: int, batch: int,
         callbacks: list) -> _Measured:
    torch._dynamo.reset()
    pl.seed_everything(0, verbose=False)
    measured = _Measured()
    loader = torch.utils.data.DataLoader(rows, batch_size=batch, collate_fn=pad_to_longest)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[*callbacks, measured])
    trainer.fit(torch.compile(CausalLM(model)), loader)
    return measured


def run_model(name: str, steps: int, shortest: int, longest: int, share: float) -> dict:
    cfg = MODELS[name]
    zm = zoo.get(name, batch=cfg["batch"])
    rows = random_rows(zm.model.config.vocab_size, steps * cfg["batch"] * 2, shortest,
                       longest)
    start = {k: v.clone() for k, v in zm.model.state_dict().items()}
    began = time.perf_counter()
    plain = _fit(zm.model, rows, steps, cfg["batch"], [])
    unplanned = max(p for (*_, compiling), p in zip(plain.steps, plain.peaks, strict=True)
                    if not compiling)
    budget = int(share * unplanned)
    try:
        zm.model.load_state_dict(start)
        planned, switch = _planned(zm.model, rows, steps, cfg["batch"], budget, longest)
    except InfeasibleBudgetError as error:  # the least the fit measured, which it holds
        zm.model.load_state_dict(start)
        budget = error.min_budget_bytes
        planned, switch = _planned(zm.model, rows, steps, cfg["batch"], budget, longest)
    plan = switch.plan
    return {"model": name, "budget_bytes": budget, "share": share,
            "unplanned_peak_bytes": unplanned, "plan_peak_bytes": plan.compiled.peak_bytes,
            "plan_batches": plan.compiled.batches, "source": plan.compiled.source,
            "compiles": plan.compiled.compiles,
            "steps_plain": [(*s, p) for s, p in zip(plain.steps, plain.peaks, strict=True)],
            "steps_planned": [(*s, p) for s, p in zip(planned.steps, planned.peaks,
                                                       strict=True)],
            "within": sum(p <= budget for p in planned.peaks), "measured": len(planned.peaks),
            "losses": [plain.losses, planned.losses],
            "seconds": round(time.perf_counter() - began, 1)}


def _planned(model: torch.nn.Module, rows: list, steps: int, batch: int, budget: int,
             longest: int) -> tuple[_Measured, PlannedCheckpointing]:
    switch = PlannedCheckpointing(budget_gb=budget / 2**30, max_length=longest,
                                  timing="estimate", solver="dp")
    return _fit(model, rows, steps, batch, [switch]), switch


def main(argv: list[str]) -> None:
    args = arguments(__doc__.split("\n")[0], list(MODELS), argv)
    run_and_write(args, lambda name: run_model(name, args.steps, args.shortest, args.longest,
                                               args.share), "compile-lightning-cpu",
                  [f"# Lightning, Trainer.fit(torch.compile(module)), padded batches of every "
                   f"length (`{command('compile_lightning.py', argv)}`)", "",
                   f"torch {torch.__version__}, lightning {pl.__version__}, "
                   f"{platform.machine()}; CPU, inductor's C++; peaks of each training_step "
                   "with its backward by the CPU allocator's events, MiB."])


if __name__ == "__main__":
    main(sys.argv[1:])
