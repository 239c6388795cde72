"""`planner.switches.lightning`: one callback plans and installs checkpointing inside Lightning's
Trainer (its ``training_step``, precision and optimizer), and training is Lightning's own,
within the budget; `plan_in_configure_model` does it under ``ModelParallelStrategy``."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import pytest
import torch
from budgets import halfway_budget_gb

from planner import Plan, PlanMismatchWarning, optimize, zoo
from planner.measure import PeakTracker

pl = pytest.importorskip("lightning.pytorch")
from planner.switches.lightning import (  # noqa: E402  (needs lightning)
    PlannedCheckpointing,
    TrainingStep,
    plan_in_configure_model,
)

GIB = 2**30


class CausalLM(pl.LightningModule):
    """A Lightning module as users write one: a Hugging Face model inside, the loss from
    ``training_step`` (a dict batch), ``self.log`` in the step, AdamW."""

    def __init__(self, model: torch.nn.Module, plan_gb: float | None = None,
                 batch: Any = None) -> None:
        super().__init__()
        self.model = model
        self.plan_gb, self.batch, self.plan = plan_gb, batch, None

    def configure_model(self) -> None:
        """As under ``ModelParallelStrategy``: plan, then shard each decoder layer."""
        if self.device_mesh is None:  # another strategy
            return
        if self.plan_gb is not None and self.plan is None:
            self.plan = plan_in_configure_model(self, self.batch, budget_gb=self.plan_gb,
                                                parallelize=shard_layers,
                                                timing="estimate", time_limit_s=10)
        shard_layers(self, self.device_mesh)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def shard_layers(module: pl.LightningModule, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in module.model.model.layers:
        fully_shard(layer, mesh=mesh)


class StepPeaks(pl.Callback):
    """The peak allocated bytes of each training batch (forward, backward, optimizer step)
    with the parameters, buffers and optimizer state counted, and the last step's gradients
    while they live (Lightning frees them after the forward), and its loss."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.losses: list[float] = []
        self._tracker: PeakTracker | None = None

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
        state = [t for s in trainer.optimizers[0].state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        self._tracker = PeakTracker([*module.parameters(), *module.buffers(), *state],
                                    held=[p.grad for p in module.parameters()
                                          if p.grad is not None])
        self._tracker.__enter__()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        assert self._tracker is not None
        self._tracker.__exit__(None, None, None)
        self.peaks.append(self._tracker.peak_bytes)
        self.losses.append(outputs["loss"].item())


class Losses(pl.Callback):
    """Each training batch's loss and how many frames dynamo had traced by its end
    (`StepPeaks` without its tracker: a dispatch mode, under which dynamo compiles nothing)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.frames: list[int] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        from planner.runtime.compile_garbage import frames_traced

        self.losses.append(outputs["loss"].item())
        self.frames.append(frames_traced())


def _rows(ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": row, "labels": row} for row in torch.cat([ids, ids.flip(0)])]


def _fit(module: pl.LightningModule, rows: list, callbacks: list, **options: Any) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=options.pop("max_steps", 2),
                         logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, **options)
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=4))


def _half_budget_gb(model: torch.nn.Module, batch: dict, adamw: bool = True,
                    **options: Any) -> float:
    """Static memory plus half the activations of Lightning's step with AdamW (gradients
    allocated when it starts), or 2 % over the least budget a plan meets when that is
    more, in GiB."""
    first = optimize(model, batch, budget_gb=1e3, timing="estimate", progress=False,
                     optimizer=torch.optim.AdamW(model.parameters()) if adamw else None,
                     grad_accumulation=True, **options)
    return halfway_budget_gb(first)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_callback_plans_training_step_and_trains_like_lightning(
        precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the callback, Lightning's steps run the plan made on its first batch with its
    precision and AdamW, checkpoints rerunning inside; each step peaks within the budget;
    losses and trained weights are bit-identical to Lightning without it."""
    import planner.runtime.emit

    reruns: list[int] = []
    real_checkpoint = planner.runtime.emit.checkpoint
    monkeypatch.setattr(planner.runtime.emit, "checkpoint",
                        lambda *a, **k: reruns.append(1) or real_checkpoint(*a, **k))
    base = zoo.get("hf-llama", batch=4)
    ids = base.example_inputs["input_ids"]
    planned, unplanned = CausalLM(base.model), CausalLM(copy.deepcopy(base.model))
    autocast = torch.bfloat16 if precision == "bf16-mixed" else None
    budget_gb = _half_budget_gb(base.model, {"input_ids": ids, "labels": ids},
                                autocast=autocast)
    switch, peaks = PlannedCheckpointing(budget_gb=budget_gb, timing="estimate"), StepPeaks()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)  # the step is the one planned
        _fit(planned, _rows(ids), [switch, peaks], precision=precision)
    plan = switch.plan
    assert isinstance(plan, Plan) and plan.checkpointing and reruns
    assert plan.autocast_dtype == ("bfloat16" if autocast else None)
    assert plan.profile.static.optimizer_state_bytes > 0  # AdamW's state is counted
    assert isinstance(planned.training_step.__self__, TrainingStep)
    expected = StepPeaks()
    _fit(unplanned, _rows(ids), [expected], precision=precision)
    assert peaks.losses == expected.losses and len(peaks.losses) == 2
    for (name, a), (_, b) in zip(planned.named_parameters(), unplanned.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert max(peaks.peaks) <= plan.budget_bytes, (peaks.peaks, plan.predicted_peak_bytes)


def test_a_changed_batch_is_named_at_the_step() -> None:
    """The plan's guard runs at Lightning's steps: a batch longer than planned warns."""
    base = zoo.get("hf-llama", batch=4)
    ids = base.example_inputs["input_ids"]
    module = CausalLM(base.model)
    _fit(module, _rows(ids), [PlannedCheckpointing(budget_gb=1.0, timing="estimate")])
    longer = torch.cat([ids, ids], dim=1)
    module.log = lambda *args, **kwargs: None  # outside Lightning's loop
    with pytest.warns(PlanMismatchWarning, match="input_ids|larger|shape"):
        module.training_step({"input_ids": longer, "labels": longer}, 0)


def test_a_compiled_module_has_its_compiled_step_planned_and_run_compiled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer.fit(torch.compile(module)): the switch plans the step Lightning compiles
    (compiled='model', measured as inductor compiles it in tests/test_compile_fit.py and
    benchmarks/compile_lightning.py; here the plan is made eager to keep the suite fast), the
    planned step runs compiled by the user's own torch.compile call (its backend here counts
    the graphs it is given: none would reach it from an eager wrapper), what each compile
    leaves is collected after each batch, and a backend other than the one measured is
    said. Losses are those of the same compiled module without the switch, and no step
    after the second compiles (the batch index dynamic, as Lightning's own compiled step
    makes it)."""
    import dataclasses

    import planner.switches.lightning as lightning
    from planner.api import optimize as real_optimize

    asked: list[Any] = []

    def optimize(model: torch.nn.Module, inputs: Any, **options: Any) -> Any:
        asked.append(options["config"])
        eager = dataclasses.replace(options["config"], compiled=None,
                                    compile_garbage_collected=False)
        return real_optimize(model, inputs, **{**options, "config": eager})

    graphs: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    collected: list[int] = []
    monkeypatch.setattr(lightning, "optimize", optimize)
    monkeypatch.setattr(lightning, "collect_compile_garbage", lambda: collected.append(1))
    base = zoo.get("hf-llama", batch=4)
    ids = base.example_inputs["input_ids"]
    planned, unplanned = CausalLM(base.model), CausalLM(copy.deepcopy(base.model))
    switch, losses = PlannedCheckpointing(budget_gb=_half_budget_gb(
        base.model, {"input_ids": ids, "labels": ids}), timing="estimate"), Losses()
    torch._dynamo.reset()
    rows = _rows(ids) * 2  # four batches an epoch: batch indices 0 to 3
    with pytest.warns(PlanMismatchWarning, match="default mode, not backend='backend'"):
        _fit(torch.compile(planned, backend=backend), rows, [switch, losses], max_steps=4)
    assert asked[0].compiled == "model" and asked[0].compile_garbage_collected
    assert switch.plan.checkpointing and graphs, "the planned step ran eager"
    assert isinstance(planned.training_step.__self__, TrainingStep)
    assert len(collected) == 4  # one per batch
    assert losses.frames[1] == losses.frames[3], "a step after the second compiled"
    expected = Losses()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanMismatchWarning)
        _fit(torch.compile(unplanned, backend=backend), rows, [expected], max_steps=4)
    torch._dynamo.reset()
    assert losses.losses == expected.losses and len(losses.losses) == 4


def test_a_compiled_module_with_a_plan_per_bucket_is_refused_saying_why() -> None:
    module = CausalLM(zoo.get("hf-llama", batch=4).model)
    module._compiler_ctx = {"compiler": "dynamo"}  # as Lightning's fit leaves a compiled one
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"one plan for every batch length.*buckets='pow2'"):
        PlannedCheckpointing(budget_gb=1.0, buckets="pow2").setup(trainer, module, "fit")


def test_lightnings_own_checkpointing_or_manual_optimization_is_refused() -> None:
    base = zoo.get("hf-llama", batch=4)
    rows = _rows(base.example_inputs["input_ids"])
    module = CausalLM(base.model)
    module.automatic_optimization = False
    with pytest.raises(ValueError, match="automatic_optimization=False"):
        _fit(module, rows, [PlannedCheckpointing(budget_gb=1.0)])
    with pytest.raises(TypeError, match=r"takes \['autocast'\] from Lightning"):
        PlannedCheckpointing(budget_gb=1.0, autocast=torch.bfloat16)


def test_plan_in_configure_model_under_model_parallel_strategy() -> None:
    """``configure_model`` plans the module's step before any sharding, under Lightning's
    ``ModelParallelStrategy`` (one CPU process over gloo); training matches the unplanned
    module's bit for bit."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    base = zoo.get("hf-llama", batch=4)
    ids = base.example_inputs["input_ids"]
    batch = {"input_ids": ids, "labels": ids}
    grads = sum(p.numel() * p.element_size() for p in base.model.parameters())
    planned = CausalLM(base.model, batch=batch,  # room for the last step's gradients
                       plan_gb=_half_budget_gb(base.model, batch, adamw=False) + grads / GIB)
    unplanned = CausalLM(copy.deepcopy(base.model))
    seen, expected = StepPeaks(), StepPeaks()
    environment = dict(os.environ)  # the strategy sets MASTER_ADDR, WORLD_SIZE, LOCAL_RANK...
    for module, callback in ((planned, seen), (unplanned, expected)):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _fit(module, _rows(ids), [callback], strategy=ModelParallelStrategy())
            # the plan counts the last step's gradient shards through the forward
            assert not [w for w in caught if ".grad allocated" in str(w.message)]
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            os.environ.clear()
            os.environ.update(environment)
    assert isinstance(planned.plan, Plan) and planned.plan.checkpointing
    assert planned.plan.profile.parallel is not None  # each rank's sharded step
    assert seen.losses == expected.losses and len(seen.losses) == 2
    optimizer_state = sum(t.numel() * t.element_size() for p in planned.parameters()
                          for t in (p, p))  # AdamW's exp_avg and exp_avg_sq, not planned
    assert max(seen.peaks) <= planned.plan_gb * GIB + optimizer_state


@pytest.mark.parametrize("budget", ["8", 0.0, float("inf")])
def test_a_budget_that_is_no_budget_is_refused_when_the_callback_is_made(budget: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="budget_gb"):
        PlannedCheckpointing(budget_gb=budget)


def _with_metadata(rows: list[dict]) -> Any:
    """A collate as Hugging Face collators write one: a ``BatchEncoding`` of the stacked
    tensors, with sample ids and sources as lists beside them."""
    from transformers import BatchEncoding

    ids = torch.stack([r["input_ids"] for r in rows])
    return BatchEncoding({"input_ids": ids, "labels": ids,
                          "id": [r["id"] for r in rows], "source": [r["source"] for r in rows]})


def test_a_batch_encoding_is_checked_and_its_metadata_is_not() -> None:
    """Metadata in a batch (ids, names) changes every step and sets no memory: no warning.
    A BatchEncoding batch is checked tensor by tensor (it was one unchecked leaf): a
    longer one warns."""
    base = zoo.get("hf-llama", batch=4)
    ids = base.example_inputs["input_ids"]
    rows = [{"input_ids": row, "id": k, "source": f"doc{k}"}
            for k, row in enumerate(torch.cat([ids, ids.flip(0), ids]))]
    module = CausalLM(base.model)
    loader = torch.utils.data.DataLoader(rows, batch_size=4, collate_fn=_with_metadata)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[PlannedCheckpointing(budget_gb=1.0, timing="estimate")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanMismatchWarning)
        trainer.fit(module, loader)
    module.log = lambda *args, **kwargs: None  # outside Lightning's loop
    longer = torch.cat([ids, ids], dim=1)
    with pytest.warns(PlanMismatchWarning, match="larger than the planned"):
        module.training_step(_with_metadata(
            [{"input_ids": row, "id": 9, "source": "x"} for row in longer]), 0)
