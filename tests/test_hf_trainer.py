"""`planner.switches.hf_trainer.PlannedCheckpointing`: one callback plans and installs checkpointing
inside Hugging Face Trainer, and training is the trainer's own, within the budget."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from budgets import halfway_budget_gb

from planner import PlanMismatchWarning, PlanTable, optimize, zoo
from planner.measure import PeakTracker
from planner.runtime.emit import checkpointed_modules

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from planner.switches.hf_trainer import PlannedCheckpointing  # noqa: E402  (needs transformers)

GIB = 2**30


class StepPeaks(transformers.TrainerCallback):
    """The peak allocated bytes of each training step (forward, backward, optimizer step),
    counting the parameters, buffers, optimizer state and the batch for the whole step."""

    def __init__(self, ranks: bool = False) -> None:
        self.peaks: list[int] = []
        self.ranks = ranks  # everything the process holds (DDP's buckets), as PeakTracker
        self._tracker: PeakTracker | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, *, model: torch.nn.Module,
                      optimizer: Any, **kwargs: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        state_tensors = [t for s in inner.state.values() for t in s.values()
                         if isinstance(t, torch.Tensor)]
        self._tracker = PeakTracker([*model.parameters(), *model.buffers(), *state_tensors],
                                    follow_resizes=self.ranks)
        self._tracker.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self._tracker is not None
        self._tracker.__exit__(None, None, None)
        self.peaks.append(self._tracker.own_peak_bytes if self.ranks else
                          self._tracker.peak_bytes)


def _rows(ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": row, "labels": row} for row in torch.cat([ids, ids.flip(0)])]


def _train(model: torch.nn.Module, rows: list, out: Path, callbacks: list,
           **args: Any) -> tuple[list[float], transformers.Trainer]:
    arguments = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, **args)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=rows,
                                   callbacks=callbacks)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def _half_budget_gb(model: torch.nn.Module, batch: dict, **options: Any) -> float:
    """Static memory plus half the activations of the trainer's step (AdamW over what
    trains), or 2 % over the least budget a plan meets when that is more, in GiB."""
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    first = optimize(model, batch, budget_gb=1e3, timing="estimate", progress=False,
                     optimizer=adamw, **options)
    return halfway_budget_gb(first)


@pytest.mark.parametrize("lora_bf16", [False, True], ids=["fp32", "lora-bf16"])
def test_the_switch_plans_the_trainers_step_and_trains_like_the_trainer(
        tmp_path: Path, lora_bf16: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the callback, Trainer's steps run the plan made on its first batch, with its
    precision and AdamW, its checkpoints rerunning inside them; each step peaks within the
    budget; losses and trained weights are bit-identical to Trainer without it."""
    import planner.runtime.emit

    reruns: list[int] = []
    real_checkpoint = planner.runtime.emit.checkpoint

    def counting_checkpoint(*args: Any, **kwargs: Any) -> Any:
        reruns.append(1)
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(planner.runtime.emit, "checkpoint", counting_checkpoint)
    base = zoo.get("hf-llama", batch=4)
    model = base.model
    if lora_bf16:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    unplanned = copy.deepcopy(model)
    ids = base.example_inputs["input_ids"]
    rows = _rows(ids)
    precision = {"bf16": True} if lora_bf16 else {}
    budget_gb = _half_budget_gb(model, {"input_ids": ids, "labels": ids},
                                autocast=torch.bfloat16 if lora_bf16 else None)
    switch, peaks = PlannedCheckpointing(budget_gb=budget_gb, timing="estimate"), StepPeaks()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)  # the step is the one planned
        losses, _ = _train(model, rows, tmp_path / "planned", [switch, peaks], **precision)
    table = switch.plan
    assert isinstance(table, PlanTable) and table.envelope.max_length == ids.shape[1]
    plan = table.plans[-1]  # the rows are all as long as the longest: one bucket
    assert plan.checkpointing
    assert reruns, "Trainer's steps did not run the plan's checkpoints"
    assert plan.autocast_dtype == ("bfloat16" if lora_bf16 else None)
    assert plan.profile.static.optimizer_state_bytes > 0  # AdamW's state is counted
    expected, _ = _train(unplanned, rows, tmp_path / "unplanned", [], **precision)
    assert losses == expected and len(losses) == 2
    for (name, a), (_, b) in zip(model.named_parameters(), unplanned.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    budget = plan.budget_bytes
    assert max(peaks.peaks) <= budget, (peaks.peaks, budget, plan.predicted_peak_bytes)


# transformers 5 names it activation_checkpointing (the old name still sets it)
CHECKPOINTING = "activation_checkpointing" if "activation_checkpointing" in \
    transformers.TrainingArguments.__dataclass_fields__ else "gradient_checkpointing"


@pytest.mark.parametrize("flag", sorted({"gradient_checkpointing", CHECKPOINTING}))
def test_the_trainers_own_checkpointing_with_the_switch_is_refused(tmp_path: Path,
                                                                   flag: str) -> None:
    """Refused under the name this transformers gives it, whichever name turned it on."""
    base = zoo.get("hf-llama", batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name, in transformers 5
        with pytest.raises(ValueError, match=f"TrainingArguments\\({CHECKPOINTING}=True\\)"):
            _train(base.model, _rows(base.example_inputs["input_ids"]), tmp_path,
                   [PlannedCheckpointing(budget_gb=1.0)], **{flag: True})


class _Planned(Exception):
    """Raised by a stand-in for optimize: what the switch asked for is all a test needs."""


def test_a_trainer_that_compiles_gets_its_compiled_step_planned_over_its_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer's torch_compile=True on one process: the switch plans the step the
    Trainer compiles (compiled='model', inductor's C++ measured in
    tests/test_compile_fit.py), with one plan over the envelope of its batches; after each
    step (and micro-batch) it frees what a compile left to the cycle collector, as the plan
    was measured, so nothing is left to warn about (benchmarks/results/compile-trainer-cpu.md:
    every step within budget); under another compile mode than the one measured, it
    warns."""
    import planner.switches.hf_trainer as hf_trainer

    base = zoo.get("hf-llama", batch=4)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile=True,
                                          per_device_train_batch_size=4, use_cpu=True,
                                          report_to=[])
    switch = PlannedCheckpointing(budget_gb=1.0)
    asked: dict[str, Any] = {}

    def optimize(model: torch.nn.Module, inputs: Any, **options: Any) -> None:
        asked.update(options, inputs=inputs)
        raise _Planned

    monkeypatch.setattr(hf_trainer, "optimize", optimize)
    loader = torch.utils.data.DataLoader(_rows(base.example_inputs["input_ids"]), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)
        switch.on_init_end(args, transformers.TrainerState(), transformers.TrainerControl())
        with pytest.raises(_Planned):
            switch.on_train_begin(args, transformers.TrainerState(),
                                  transformers.TrainerControl(), model=base.model,
                                  train_dataloader=loader)
    assert asked["compiled"] == "model" and asked["envelope"].buckets == "one"
    # the step the Trainer runs: num_items_in_batch passed as its compute_loss passes it
    # (compiled, another graph: HF Llama's backward allocated 0.25 MiB more with it)
    batch = next(iter(loader))
    trainer = transformers.Trainer(model=base.model, args=args)
    counted = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    given = asked["inputs"]["num_items_in_batch"]
    assert given.dtype == counted.dtype and given.shape == counted.shape and given == counted
    # measured as the switch trains it: what each compile leaves is collected after its step
    assert asked["compile_garbage_collected"] is True
    collections: list[int] = []
    monkeypatch.setattr(hf_trainer, "collect_compile_garbage", lambda: collections.append(1))
    for end in (switch.on_step_end, switch.on_substep_end):
        end(args, transformers.TrainerState(), transformers.TrainerControl())
    assert len(collections) == 2
    autotuned = dataclasses.replace(args, torch_compile_mode="max-autotune")
    with pytest.warns(PlanMismatchWarning, match="default mode, not.*'max-autotune'.*margin"):
        PlannedCheckpointing(budget_gb=1.0).on_init_end(
            autotuned, transformers.TrainerState(), transformers.TrainerControl())


def test_a_compiling_trainer_with_a_plan_per_bucket_is_refused_saying_why(
        tmp_path: Path) -> None:
    args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile=True,
                                          report_to=[])
    switch = PlannedCheckpointing(budget_gb=1.0, buckets="pow2")
    with pytest.raises(ValueError, match="buckets='one'"):
        switch.on_init_end(args, transformers.TrainerState(), transformers.TrainerControl())


def test_a_compiling_trainer_over_several_processes_is_told_the_plan_is_the_eager_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's compiled step is not measured: said when the Trainer is built, with what to
    do instead."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile=True,
                                          report_to=[])
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda _: 2))
    switch = PlannedCheckpointing(budget_gb=1.0)
    with pytest.warns(PlanMismatchWarning, match="one process only.*compiled='model'"), \
            pytest.raises(ValueError, match="example_batch"):
        switch.on_init_end(args, transformers.TrainerState(), transformers.TrainerControl())


def test_what_the_trainer_decides_is_not_an_option_of_the_switch() -> None:
    with pytest.raises(TypeError, match="from the Trainer"):
        PlannedCheckpointing(budget_gb=1.0, autocast=torch.bfloat16)


@pytest.mark.parametrize("budget", ["8", -1.0, float("nan"), True])
def test_a_budget_that_is_no_budget_is_refused_when_the_switch_is_made(budget: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="budget_gb"):
        PlannedCheckpointing(budget_gb=budget)


def test_batches_without_labels_are_refused_with_what_the_trainer_needs(
        tmp_path: Path) -> None:
    """The Trainer takes its loss from model(**batch).loss: the advice is about its batches
    (labels, a collator), not a loss_fn the callback does not take."""
    base = zoo.get("hf-llama", batch=4)
    rows = [{"input_ids": row} for row in base.example_inputs["input_ids"]]
    with pytest.raises(ValueError, match="its batches need `labels`") as caught:
        _train(base.model, rows, tmp_path, [PlannedCheckpointing(budget_gb=1.0)])
    assert "pass loss_fn" not in str(caught.value)
    assert not checkpointed_modules(base.model)


def _word_tokenizer() -> Any:
    """A tokenizer built in memory (no download): whitespace-split words w0 .. w999."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "</s>", "<unk>", *(f"w{i}" for i in range(1000))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                                eos_token="</s>", unk_token="<unk>")


def test_the_switch_in_trls_sft_trainer(tmp_path: Path) -> None:
    """TRL's SFTTrainer (a Trainer) with the switch: its collated text batches planned and
    trained bit-identically to SFTTrainer without it, every step within the budget."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    generator = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{j}" for j in torch.randint(1000, (15,), generator=generator).tolist())
             for _ in range(8)]
    data = datasets.Dataset.from_dict({"text": texts})
    base = zoo.get("hf-llama", batch=4)
    unplanned = copy.deepcopy(base.model)

    def train(model: torch.nn.Module, out: str, callbacks: list, **options: Any) -> list[float]:
        args = trl.SFTConfig(output_dir=str(tmp_path / out), per_device_train_batch_size=4,
                             max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_num_workers=0, **options)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data,
                                 processing_class=_word_tokenizer(), callbacks=callbacks)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    # the budget: halfway into SFTTrainer's own step (its fused LM head), planned unbounded
    probe = PlannedCheckpointing(budget_gb=1e3, timing="estimate")
    train(copy.deepcopy(unplanned), "probe", [probe], gradient_checkpointing=False)
    first = probe.plan.plans[-1]
    assert "fused_lm_head" in [i.name for i in first.inputs]
    budget_gb = halfway_budget_gb(first)
    switch, peaks = PlannedCheckpointing(budget_gb=budget_gb, timing="estimate"), StepPeaks()
    with pytest.raises(ValueError, match="SFTConfig turns it on by default"):
        train(base.model, "refused", [switch])  # SFTConfig's gradient_checkpointing=True
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)
        losses = train(base.model, "planned", [switch, peaks], gradient_checkpointing=False)
    longest = switch.plan.plans[-1]
    assert longest.checkpointing
    assert losses == train(unplanned, "unplanned", [], gradient_checkpointing=False)
    assert len(losses) == 2
    for (name, a), (_, b) in zip(base.model.named_parameters(), unplanned.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert max(peaks.peaks) <= longest.budget_bytes, (peaks.peaks,
                                                      longest.predicted_peak_bytes)


def _rank_trains(rank: int, port: int, out: str) -> None:
    """One of two DDP processes: Trainer with the switch, then without; saves losses,
    peaks, weights and the plan."""
    import os

    from accelerate.state import AcceleratorState, GradientState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    ids = zoo.get("hf-llama", batch=4).example_inputs["input_ids"]
    batch = {"input_ids": ids, "labels": ids}
    results = {}
    for planned in (True, False):
        AcceleratorState._reset_state(False)
        GradientState._reset_state()
        model = zoo.get("hf-llama", batch=4).model
        switch, peaks = None, StepPeaks(ranks=True)
        if planned:
            budget_gb = _half_budget_gb(model, batch, world_size=2, sharding="ddp",
                                        autocast=torch.bfloat16)
            switch = PlannedCheckpointing(budget_gb=budget_gb, example_batch=batch,
                                          timing="estimate")
        with warnings.catch_warnings():
            warnings.simplefilter("error", PlanMismatchWarning)
            losses, _ = _train(model, _rows(ids), Path(out).parent / f"run{planned}",
                               [c for c in (switch, peaks) if c is not None], bf16=True)
        results[planned] = {"losses": losses, "peaks": peaks.peaks,
                            "weights": [p.detach().clone() for p in model.parameters()],
                            "plan": switch.plan.model_dump_json() if switch else None}
    torch.save(results, f"{out}.{rank}")


def test_the_switch_over_two_processes_plans_each_ranks_ddp_step(tmp_path: Path) -> None:
    """Over several processes the callback plans when the Trainer is built, on the example
    batch, for DDP's rank (two gloo processes, bf16 autocast); each rank within the budget,
    losses and weights as Trainer's without the switch."""
    from gloo_ranks import free_port, spawn_ranks

    out = str(tmp_path / "rank")
    spawn_ranks(_rank_trains, (free_port(), out), 2)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    plan = PlanTable.model_validate_json(ranks[0][True]["plan"]).plans[-1]
    assert ranks[1][True]["plan"] == ranks[0][True]["plan"]
    assert plan.checkpointing and plan.sharding is not None and plan.sharding.world_size == 2
    assert plan.autocast_dtype == "bfloat16"
    for rank, result in enumerate(ranks):
        assert result[True]["losses"] == result[False]["losses"] and \
            len(result[True]["losses"]) == 2, rank
        assert all(torch.equal(a, b) for a, b in zip(result[True]["weights"],
                                                     result[False]["weights"], strict=True))
        assert max(result[True]["peaks"]) <= plan.budget_bytes, (
            rank, result[True]["peaks"], plan.budget_bytes, plan.predicted_peak_bytes)


def test_over_several_processes_the_switch_asks_for_a_batch() -> None:
    """Over several processes the model is planned when the Trainer is built, before any
    data loader: without ``example_batch`` the switch says so."""
    from types import SimpleNamespace

    args = SimpleNamespace(gradient_checkpointing=False, world_size=2)
    with pytest.raises(ValueError, match=r"example_batch=one rank's batch"):
        PlannedCheckpointing(budget_gb=1.0).on_init_end(
            args, None, None, model=zoo.get("hf-llama").model)


class HeldBatches:
    """Remembers the micro-batches ``Trainer.get_batch_samples`` loads for each step (the
    Trainer holds them on the device through every micro-step)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[dict] = []
        original = transformers.Trainer.get_batch_samples

        def remembered(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            samples, count = original(trainer, *args, **kwargs)
            self.batches = list(samples)
            return samples, count

        monkeypatch.setattr(transformers.Trainer, "get_batch_samples", remembered)


class HeldStepPeaks(StepPeaks):
    """StepPeaks with the held micro-batches counted from the step's start."""

    def __init__(self, held: HeldBatches) -> None:
        super().__init__()
        self.held = held

    def on_step_begin(self, args: Any, state: Any, control: Any, *, model: torch.nn.Module,
                      optimizer: Any, **kwargs: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        state_tensors = [t for s in inner.state.values() for t in s.values()
                         if isinstance(t, torch.Tensor)]
        batches = [t for b in self.held.batches for t in b.values()
                   if isinstance(t, torch.Tensor)]
        self._tracker = PeakTracker([*model.parameters(), *model.buffers(), *state_tensors,
                                     *batches])
        self._tracker.__enter__()


def test_padded_batches_of_every_length_with_accumulation_stay_within_the_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's stream: a padding collator over rows of 8-64 tokens, random sampler,
    accumulation 2 (the Trainer loads both micro-batches before the first forward). The
    switch plans the envelope the Trainer states (the training set's longest row, its
    batch size, 2 resident batches) per power-of-two bucket; every step's peak, with the
    held batches counted, is within the budget; losses and weights as without it."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(8, 65, (24,), generator=generator).tolist()
    rows = [{"input_ids": torch.randint(3, 1000, (n,), generator=generator).tolist()}
            for n in lengths]
    collator = transformers.DataCollatorForLanguageModeling(_word_tokenizer(), mlm=False)
    longest = collator(rows[:4])  # the budget: halfway into a batch of the longest rows
    longest = {k: torch.cat([v] * 4, dim=1)[:, :64] for k, v in longest.items()}
    base = zoo.get("hf-llama", batch=4, seq_len=64)
    unplanned = copy.deepcopy(base.model)
    budget_gb = _half_budget_gb(base.model, longest, grad_accumulation=True)
    held = HeldBatches(monkeypatch)
    switch, peaks = PlannedCheckpointing(budget_gb=budget_gb, buckets="pow2",
                                         timing="estimate"), HeldStepPeaks(held)
    arguments = dict(gradient_accumulation_steps=2, max_steps=4)

    def train(model: torch.nn.Module, name: str, callbacks: list) -> list[float]:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=4,
            learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
            use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, **arguments)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                       data_collator=collator, callbacks=callbacks)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)
        losses = train(base.model, "planned", [switch, peaks])
    table = switch.plan
    assert table.envelope.max_length == max(lengths) and table.envelope.resident_batches == 2
    assert table.plans[-1].profile.static.resident_input_bytes > 0
    assert len({len(b["input_ids"][0]) for b in held.batches}) >= 1 and len(peaks.peaks) == 4
    assert max(peaks.peaks) <= table.budget_bytes, (peaks.peaks, table.budget_bytes)
    assert losses == train(unplanned, "unplanned", [])
    for (name, a), (_, b) in zip(base.model.named_parameters(), unplanned.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
