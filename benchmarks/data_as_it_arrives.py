"""Data as it arrives: the trainer switches on streams of padded batches of every length.

For each model (Hugging Face decoders the tests do not use: Mistral with ``sdpa``, GPT-NeoX
with eager attention, Granite with ``sdpa`` under bf16 autocast) and each workflow
(Hugging Face Trainer with a padding collator at accumulation 1 and 4, TRL's SFT trainer
with and without packing, Lightning with a pad-to-longest collate, accelerate), one run
trains without the switch and one with it, on the same rows (lengths 8-512, random
sampler). Reported per run: every step's measured peak against the budget (the batches
the trainer holds counted, `data_streams`), losses and trained weights bit-identical to
the run without the switch, and with buckets the mean predicted recompute of the plans the
steps took against the plan for the longest batch, and what choosing a plan cost per step.
The peer, for the Hugging Face Trainer runs: the switch planning the first batch only (as
it did before envelopes), measured on the same stream.

    python benchmarks/data_as_it_arrives.py               # every model and workflow
    python benchmarks/data_as_it_arrives.py --models Mistral --workflows trainer-k1

Writes ``results/data-as-it-arrives-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from statistics import mean
from time import perf_counter
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
import data_streams as ds

from planner import optimize
from planner.envelope import Envelope
from planner.switches.hf_trainer import PlannedCheckpointing
from solvers.auto import lowest_peak

RESULTS = Path(__file__).parent / "results"
LONGEST, SHORTEST, ROWS, BATCH = 512, 8, 48, 4
_SIZE = dict(vocab_size=ds.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=1024)


def _mistral() -> torch.nn.Module:
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        **_SIZE, num_key_value_heads=2, attn_implementation="sdpa", pad_token_id=0))


def _neox() -> torch.nn.Module:
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **_SIZE, attn_implementation="eager", pad_token_id=0))


def _granite() -> torch.nn.Module:
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(
        **_SIZE, num_key_value_heads=2, attn_implementation="sdpa", pad_token_id=0))


MODELS = {"Mistral sdpa": (_mistral, None), "GPT-NeoX eager": (_neox, None),
          "Granite sdpa bf16-autocast": (_granite, "bf16")}


def _budget(build: Any, precision: str | None) -> int:
    """Halfway between the least peak a plan reaches and the unplanned peak, for the
    envelope's longest padded batch (4 rows of 512 tokens)."""
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(3, ds.VOCAB, (BATCH, LONGEST))
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    autocast = torch.bfloat16 if precision == "bf16" else None
    top = optimize(model, batch, budget_gb=1e3, timing="estimate", progress=False,
                   autocast=autocast, optimizer=torch.optim.AdamW(model.parameters()))
    least = lowest_peak(top.problem(), 20.0).peak_bytes
    return (least + top.unplanned_peak_bytes) // 2


class FirstBatchOnly(PlannedCheckpointing):
    """The peer: the switch as it planned before envelopes, on the trainer's first batch
    only (longer batches warn once; padding and held batches are not counted)."""

    def _envelope(self, *args: Any) -> None:
        return None


def _sft_budget(build: Any, precision: str | None, workflow: str) -> int:
    """As `_budget`, for TRL's own step (its fused LM head), read from a table the switch
    plans without a bound."""
    probe = PlannedCheckpointing(budget_gb=1e3, timing="estimate")
    with tempfile.TemporaryDirectory() as out:
        _trainer_run(build, precision, 0, workflow, probe, Path(out))
    longest = probe.plan.entries[-1].plan
    least = lowest_peak(longest.problem(), 20.0).peak_bytes
    return (least + longest.unplanned_peak_bytes) // 2


def _trainer_run(build: Any, precision: str | None, budget: int, workflow: str,
                 switch: PlannedCheckpointing | None, out: Path) -> dict[str, Any]:
    """One Hugging Face (or TRL) training run: losses, weights, peaks, step times."""
    torch.manual_seed(0)
    model = build()
    tok = ds.tokenizer(LONGEST)
    data = ds.rows(ROWS, SHORTEST, LONGEST, seed=1)
    k = 4 if workflow == "trainer-k4" else 1
    common = dict(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=6 // k + 2,
                  learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                  use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                  gradient_accumulation_steps=k, bf16=precision == "bf16")
    resident, peaks = ds.Resident(), None
    callbacks = [switch] if switch else []
    peaks = ds.StepPeaks(resident, measure=switch is not None)
    callbacks.append(peaks)
    if workflow.startswith("sft"):
        import datasets
        import trl

        args = trl.SFTConfig(**common, max_length=LONGEST, packing=workflow == "sft-packing",
                             gradient_checkpointing=False, dataset_text_field="input_ids")
        trainer_cls = trl.SFTTrainer
        trainer = trl.SFTTrainer(model=model, args=args, processing_class=tok,
                                 train_dataset=datasets.Dataset.from_list(data),
                                 callbacks=callbacks)
    else:
        args = transformers.TrainingArguments(**common)
        trainer_cls = transformers.Trainer
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=data, callbacks=callbacks,
            data_collator=transformers.DataCollatorForLanguageModeling(tok, mlm=False))
    choices = ds.Choices()
    with resident.watching(trainer_cls), choices.watching(), warnings.catch_warnings(
            record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "peaks": peaks.peaks, "lengths": peaks.lengths, "seconds": peaks.seconds,
            "choices": choices, "warnings": [str(w.message)[:200] for w in caught
                                             if "Plan" in type(w.message).__name__]}


def _lightning_run(build: Any, precision: str | None, budget: int,
                   switch: Any) -> dict[str, Any]:
    """Lightning: ``training_step`` returns ``model(**batch).loss``; the loader pads each
    batch to its longest row (Lightning keeps one batch on the device at a time)."""
    import lightning.pytorch as pl

    from planner.measure import PeakTracker

    class LM(pl.LightningModule):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Peaks(pl.Callback):
        def __init__(self) -> None:
            self.peaks, self.lengths, self.losses, self.tracker = [], [], [], None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            state = [t for s in trainer.optimizers[0].state.values() for t in s.values()
                     if isinstance(t, torch.Tensor)]
            self.lengths.append(batch["input_ids"].shape[1])
            if switch is not None:
                # the last step's gradients count until zero_grad() frees them, after
                # the forward (Lightning's order)
                self.tracker = PeakTracker([*module.parameters(), *module.buffers(), *state,
                                            *ds.tensors_of(batch)],
                                           held=[p.grad for p in module.parameters()
                                                 if p.grad is not None])
                self.tracker.__enter__()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any,
                               *args: Any) -> None:
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)
                self.peaks.append(self.tracker.peak_bytes)
            self.losses.append(outputs["loss"].item())

    pl.seed_everything(0, verbose=False)
    torch.manual_seed(0)
    module = LM(build())
    collate = transformers.DataCollatorForLanguageModeling(ds.tokenizer(LONGEST), mlm=False)
    loader = torch.utils.data.DataLoader(ds.rows(ROWS, SHORTEST, LONGEST, seed=1),
                                         batch_size=BATCH, shuffle=True, collate_fn=collate)
    peaks = Peaks()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         precision="bf16-mixed" if precision == "bf16" else "32-true",
                         callbacks=[*([switch] if switch else []), peaks])
    choices = ds.Choices()
    with choices.watching(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    return {"losses": peaks.losses, "peaks": peaks.peaks, "lengths": peaks.lengths,
            "weights": {k: v.detach().clone() for k, v in module.model.state_dict().items()},
            "seconds": [], "choices": choices,
            "warnings": [str(w.message)[:200] for w in caught
                         if "Plan" in type(w.message).__name__]}


def _accelerate_run(build: Any, precision: str | None, budget: int,
                    planned: bool) -> dict[str, Any]:
    """accelerate: ``planned()`` before ``prepare``, accumulation 2 with ``accumulate``;
    accelerate's loader sends the current batch to the device (the next one waits)."""
    from accelerate import Accelerator

    from planner.measure import PeakTracker
    from planner.switches.hf_accelerate import planned as plan_it

    torch.manual_seed(0)
    model = build()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                              mixed_precision="bf16" if precision == "bf16" else "no")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    collate = transformers.DataCollatorForLanguageModeling(ds.tokenizer(LONGEST), mlm=False)
    loader = torch.utils.data.DataLoader(ds.rows(ROWS, SHORTEST, LONGEST, seed=1),
                                         batch_size=BATCH, shuffle=True, collate_fn=collate,
                                         generator=torch.Generator().manual_seed(0))
    table = None
    if planned:
        table = plan_it(accelerator, model, collate(ds.rows(BATCH, 8, 8, seed=2)),
                budget_gb=budget / 2**30, optimizer=optimizer, timing="estimate",
                envelope=Envelope(max_length=LONGEST, batch_size=BATCH))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    out: dict[str, Any] = {"losses": [], "peaks": [], "lengths": [], "seconds": []}
    choices = ds.Choices()
    with choices.watching(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(loader):
            if step == 12:
                break
            state = [t for s in optimizer.optimizer.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor)]
            tracker = PeakTracker([*model.parameters(), *model.buffers(), *state,
                                   *ds.tensors_of(batch)])
            with accelerator.accumulate(model), (tracker if planned else _nothing()):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            out["losses"].append(loss.item())
            out["lengths"].append(batch["input_ids"].shape[1])
            if planned:
                out["peaks"].append(tracker.peak_bytes)
    out["weights"] = {k: v.detach().clone()
                      for k, v in accelerator.unwrap_model(model).state_dict().items()}
    out["choices"], out["table"] = choices, table
    out["warnings"] = [str(w.message)[:200] for w in caught
                       if "Plan" in type(w.message).__name__]
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


WORKFLOWS = ("trainer-k1", "trainer-k4", "sft", "sft-packing", "lightning", "accelerate")


def run_case(name: str, workflow: str) -> dict[str, Any]:
    """The plain run and the planned run of one model in one workflow, compared."""
    build, precision = MODELS[name]
    budget = _sft_budget(build, precision, workflow) if workflow.startswith("sft") else \
        _budget(build, precision)
    buckets = "pow2" if workflow in ("trainer-k1", "lightning") else "one"
    started, first = perf_counter(), None
    with tempfile.TemporaryDirectory() as out:
        if workflow == "accelerate":
            plain = _accelerate_run(build, precision, budget, planned=False)
            planned = _accelerate_run(build, precision, budget, planned=True)
            table = planned["table"]
        elif workflow == "lightning":
            from planner.switches.lightning import PlannedCheckpointing as LightningSwitch

            plain = _lightning_run(build, precision, budget, None)
            switch = LightningSwitch(budget_gb=budget / 2**30, max_length=LONGEST,
                                     buckets=buckets, timing="estimate")
            planned = _lightning_run(build, precision, budget, switch)
            table = switch.plan
        else:
            plain = _trainer_run(build, precision, budget, workflow, None, Path(out))
            switch = PlannedCheckpointing(budget_gb=budget / 2**30, buckets=buckets,
                                          timing="estimate")
            planned = _trainer_run(build, precision, budget, workflow, switch, Path(out))
            table = switch.plan
            first = _trainer_run(build, precision, budget, workflow,
                                 FirstBatchOnly(budget_gb=budget / 2**30, timing="estimate"),
                                 Path(out)) if workflow.startswith("trainer") else None
    row = _compare(name, workflow, budget, plain, planned, table, perf_counter() - started)
    if first is not None:  # the peer, measured in the same run
        row.update(first_over=sum(p > budget for p in first["peaks"]),
                   first_worst=max(first["peaks"]) / budget - 1,
                   first_warnings=len(first["warnings"]))
    return row


def _compare(name: str, workflow: str, budget: int, plain: dict, planned: dict, table: Any,
             seconds: float) -> dict[str, Any]:
    same_weights = all(torch.equal(plain["weights"][k], planned["weights"][k])
                       for k in plain["weights"])
    row: dict[str, Any] = {
        "model": name, "workflow": workflow, "budget": budget, "peaks": planned["peaks"],
        "lengths": planned["lengths"], "over": sum(p > budget for p in planned["peaks"]),
        "worst": max(planned["peaks"]) / budget - 1 if planned["peaks"] else None,
        "losses_identical": plain["losses"] == planned["losses"],
        "weights_identical": same_weights, "warnings": planned["warnings"],
        "seconds": round(seconds, 1)}
    choices = planned["choices"]
    if table is not None and hasattr(table, "entries") and choices.entries:
        taken = [table.entries[k].plan.recompute_ms for k in choices.entries]
        row.update(entries=len(table.entries),
                   mean_recompute_ms=mean(taken),
                   longest_recompute_ms=max(e.plan.recompute_ms for e in table.entries
                                            if e.length == table.envelope.max_length),
                   choose_ms=1e3 * mean(choices.seconds),
                   step_ms=1e3 * mean(plain["seconds"]) if plain["seconds"] else None)
    return row


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["# Data as it arrives (CPU)", "",
             f"Rows of {SHORTEST}-{LONGEST} tokens, {BATCH} per batch, random sampler, padded "
             "to the longest row; budget halfway between the least peak and the unplanned "
             "peak of the longest padded batch. Measured: every step's peak with the "
             "batches its trainer holds. `python benchmarks/data_as_it_arrives.py`.", "",
             "| model | workflow | steps | over budget | worst vs budget | losses = | "
             "weights = | plans | mean recompute (ms) | longest plan's (ms) | choose/step | "
             "first batch only: over, worst |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        choose = (f"{r['choose_ms']:.3f} ms / {r['step_ms']:.0f} ms "
                  f"({100 * r['choose_ms'] / r['step_ms']:.2f} %)"
                  if r.get("step_ms") else f"{r['choose_ms']:.3f} ms" if "choose_ms" in r
                  else "")
        worst = f"{100 * r['worst']:+.2f} %" if r["worst"] is not None else ""
        lines.append(
            f"| {r['model']} | {r['workflow']} | {len(r['peaks'])} | {r['over']} | {worst} "
            f"| {r['losses_identical']} | {r['weights_identical']} | {r.get('entries', '')} "
            f"| {r.get('mean_recompute_ms', float('nan')):.2f} "
            f"| {r.get('longest_recompute_ms', float('nan')):.2f} | {choose} | "
            + (f"{r['first_over']} of {len(r['peaks'])}, {100 * r['first_worst']:+.2f} % "
               f"({r['first_warnings']} warnings) |" if "first_over" in r else "|"))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--workflows", nargs="*", default=list(WORKFLOWS))
    parser.add_argument("--out", default="data-as-it-arrives-cpu")
    options = parser.parse_args()
    logging.disable(logging.WARNING)
    rows = []
    for name in options.models:
        for workflow in options.workflows:
            row = run_case(name, workflow)
            rows.append(row)
            print(f"{name:<28} {workflow:<12} over {row['over']}/{len(row['peaks'])} worst "
                  f"{row['worst']} same {row['losses_identical']} {row['weights_identical']}"
                  f" {row.get('mean_recompute_ms', '')} {row.get('choose_ms', '')} "
                  f"{row['seconds']} s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{options.out}.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / f"{options.out}.md").write_text(_markdown(rows))


if __name__ == "__main__":
    main()
