"""One switch for Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``, a subclass):
``Trainer(..., callbacks=[PlannedCheckpointing(budget_gb=70)])``.

The callback plans on the trainer's own first batch, with the precision (``bf16``/``fp16``),
gradient accumulation and optimizer the trainer will use, and installs the plan before the
first step: at ``on_train_begin``, the first event that sees the optimizer and the data
loader (``accelerator.prepare`` has run, which on one process leaves the model as it is).
Over several processes DDP or FSDP2 wrap the model before ``on_train_begin``, so the
callback plans when the trainer is built (``on_init_end``), on ``example_batch`` (one
rank's batch: no data loader exists yet), with the optimizer ``TrainingArguments.optim``
names and each rank's DDP or FSDP2 step (``planner.switches.hf_accelerate.plan_for_processes``).
It refuses, when the trainer is built, the trainer's own ``gradient_checkpointing`` (a plan
replaces it; both would rerun each layer twice).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from planner.api import apply, optimize
from planner.arguments import _budget_bytes
from planner.compile_fit import warn_eager_plan_compiled
from planner.config import PlanConfig
from planner.envelope import Envelope, row_lengths, sequence_length
from planner.plan import Plan, PlanMismatchWarning
from planner.plan_table import PlanTable
from planner.runtime.compile_garbage import collect_compile_garbage
from planner.switches.loader import first_batch
from profiles.errors import LossNotFoundError

log = logging.getLogger(__name__)

__all__ = ["PlannedCheckpointing"]

_DECIDED = ("autocast", "grad_accumulation", "optimizer", "loss_fn")


class PlannedCheckpointing(TrainerCallback):
    """Plan and install activation checkpointing at ``budget_gb`` GiB per device when
    training starts; ``plan`` holds the plan after that. Other options (keywords or
    ``config=``) are :class:`~planner.config.PlanConfig`'s (``time_limit_s``, ``offload``,
    ``device``, ...), checked here; those the trainer decides (``autocast``,
    ``grad_accumulation``, ``optimizer``, ``loss_fn``) come from it.
    ``example_batch``: one rank's batch, needed over several processes (planned when the
    Trainer is built, before its data loader exists).

    The plan covers every batch the Trainer gives (a :class:`~planner.plan_table.PlanTable`
    over an :class:`~planner.envelope.Envelope`): up to ``max_length`` tokens per row
    (default: TRL's ``max_length``, the collator's, the training set's longest row, else
    the tokenizer's ``model_max_length`` or the model's positions, whichever is less),
    padded or not,
    ``per_device_train_batch_size`` rows, with the ``gradient_accumulation_steps``
    micro-batches the Trainer loads before the first forward; ``buckets="pow2"`` plans a
    bucket per power of two, so short batches recompute less."""

    def __init__(self, budget_gb: float, example_batch: dict | None = None, *,
                 max_length: int | None = None, buckets: Any = "one",
                 config: PlanConfig | None = None, **options: Any) -> None:
        self.config = PlanConfig.for_switch(
            config, options, "PlannedCheckpointing", _DECIDED, "the Trainer (TrainingArguments "
            "bf16/fp16 and gradient_accumulation_steps, its optimizer and loss)")
        _budget_bytes(budget_gb)  # a wrong budget is said now, not when training starts
        if self.config.envelope is not None:
            raise TypeError("PlannedCheckpointing builds the envelope from the Trainer (its "
                            "collator's or tokenizer's max_length, batch size and "
                            "accumulation); give max_length= or buckets= to change it")
        Envelope(max_length=max_length or 1, buckets=buckets)  # said now, not at training
        self.budget_gb = budget_gb
        self.example_batch = example_batch
        self.max_length = max_length
        self.buckets = buckets
        self.plan: Plan | PlanTable | None = None
        self.compiled: str | None = None  # "model" where the Trainer compiles

    def on_init_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        # transformers 5 renamed gradient_checkpointing (the old name still sets it)
        flag = "activation_checkpointing" if hasattr(args, "activation_checkpointing") \
            else "gradient_checkpointing"
        if getattr(args, flag):
            raise ValueError(
                "PlannedCheckpointing plans activation checkpointing itself, and "
                f"TrainingArguments({flag}=True) would checkpoint every layer again under it: "
                f"set {flag}=False (TRL's SFTConfig turns it on by default)")
        if getattr(args, "torch_compile", False):
            self._plan_compiled(args)
        if args.world_size > 1:
            self._plan_each_rank(args, state, kwargs.get("model"),
                                 kwargs.get("processing_class"))

    def _plan_compiled(self, args: TrainingArguments) -> None:
        """The Trainer compiles the model whole (``torch.compile(model)``, through
        accelerate): on one process the step it compiles is planned (``compiled='model'``,
        measured on a short batch, then the longest, padded and not: the length dynamic as
        dynamo makes it on the second length), with one plan for every batch."""
        if args.world_size > 1:  # a rank's compiled step is not measured yet
            warn_eager_plan_compiled("TrainingArguments(torch_compile=True)",
                                     "a rank's compiled step is measured on one process only")
            return
        if self.buckets != "one":
            raise ValueError("TrainingArguments(torch_compile=True): a compiled step is planned "
                             "with one plan for every batch length, measured on them; "
                             f"buckets={self.buckets!r} would switch plans inside the "
                             "compiled graph: leave buckets='one'")
        backend, mode = args.torch_compile_backend, args.torch_compile_mode
        if backend not in (None, "inductor") or mode not in (None, "default"):
            warnings.warn(
                "TrainingArguments(torch_compile=True): the switch plans the step the Trainer "
                "compiles, measured under inductor's default mode, not torch_compile_backend="
                f"{backend!r}, torch_compile_mode={mode!r}, which may keep other buffers: "
                "leave a margin", PlanMismatchWarning, stacklevel=3)
        self.compiled = "model"

    def _compiling(self) -> dict[str, Any]:
        """``optimize``'s options for the step the Trainer compiles: measured as this
        switch trains it, collecting what each compile leaves (:meth:`on_step_end`)."""
        if self.compiled is None:
            return {}
        return {"compiled": self.compiled, "compile_garbage_collected": True}

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        """After a step in which torch.compile compiled, what the compile left to Python's
        cycle collector (the step's output, for a forward of several graphs) is freed, as
        the plan was measured (:mod:`planner.runtime.compile_garbage`)."""
        if self.compiled is not None:
            collect_compile_garbage()

    on_substep_end = on_step_end  # a micro-batch of gradient accumulation

    def _plan_each_rank(self, args: TrainingArguments, state: TrainerState,
                        model: torch.nn.Module | None, processing_class: Any) -> None:
        """Over several processes: plan now, before accelerate wraps the model."""
        from accelerate.state import AcceleratorState

        from planner.switches.hf_accelerate import plan_for_processes

        if self.example_batch is None or model is None:
            raise ValueError(
                f"this Trainer runs {args.world_size} processes, whose model DDP or FSDP2 "
                "wraps before training starts, so it is planned when the Trainer is built, "
                "before a data loader exists: pass PlannedCheckpointing(budget_gb=..., "
                "example_batch=one rank's batch)")
        inputs, loss_fn = _the_trainers_step(args, model, self.example_batch)
        envelope = self._envelope(args, model, self.example_batch, None, processing_class)
        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        with _the_trainers_loss():
            self.plan = plan_for_processes(
                AcceleratorState(), model, inputs, budget_gb=self.budget_gb, loss_fn=loss_fn,
                grad_accumulation=args.gradient_accumulation_steps > 1,
                optimizer=optimizer_cls([p for p in model.parameters() if p.requires_grad],
                                        **optimizer_kwargs), envelope=envelope,
                config=self.config)
        if state.is_world_process_zero:
            self.plan.log_summary(log)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, *, model: torch.nn.Module | None = None,
                       optimizer: torch.optim.Optimizer | None = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        if args.world_size > 1:  # planned when the Trainer was built
            return
        if model is None or train_dataloader is None:
            raise RuntimeError("PlannedCheckpointing: the Trainer gave no model or data loader "
                               "at on_train_begin; plan with optimize() and apply() instead")
        batch = first_batch(train_dataloader)
        inputs, loss_fn = _the_trainers_step(args, model, batch)
        envelope = self._envelope(args, model, batch, train_dataloader,
                                  kwargs.get("processing_class"))
        with _the_trainers_loss():
            self.plan = optimize(
                model, inputs, budget_gb=self.budget_gb, autocast=_autocast(args),
                loss_fn=loss_fn, grad_accumulation=args.gradient_accumulation_steps > 1,
                optimizer=getattr(optimizer, "optimizer", optimizer), envelope=envelope,
                config=self.config, **self._compiling())
        apply(model, self.plan)
        if state.is_world_process_zero:
            self.plan.log_summary(log)

    def _envelope(self, args: TrainingArguments, model: torch.nn.Module, batch: dict,
                  loader: Any, processing_class: Any) -> Envelope | None:
        """The batches this Trainer gives (:func:`trainers_max_length`), its rows, and the
        ``gradient_accumulation_steps`` micro-batches it loads before the first forward
        (``Trainer.get_batch_samples``). Without token ids (images), rows and resident
        batches only (None when those are the example's)."""
        resident = args.gradient_accumulation_steps if hasattr(Trainer, "get_batch_samples") \
            else 1
        rows = args.per_device_train_batch_size
        length = sequence_length((), dict(batch))
        if length is None:
            return Envelope(batch_size=rows, resident_batches=resident) if resident > 1 \
                else None
        most, source = self.max_length, "max_length="
        if most is None:
            most, source = trainers_max_length(args, model, loader, processing_class,
                                               positions=loader is not None)
        if most is None or most < length:
            most, source = length, "the first batch (no max_length known)"
            log.warning("PlannedCheckpointing: no collator, tokenizer or model states a "
                        "longest batch, so the plan covers batches up to the first one's %d "
                        "tokens; give PlannedCheckpointing(max_length=...)", length)
        log.info("planning batches of up to %d tokens (from %s)", most, source)
        lengths = row_lengths(getattr(loader, "dataset", None))
        shortest = min(lengths[0], most) if lengths else 1  # a batch is its longest row's
        return Envelope(max_length=most, min_length=shortest, batch_size=rows,
                        buckets=self.buckets, resident_batches=resident)


def trainers_max_length(args: TrainingArguments, model: torch.nn.Module, loader: Any,
                        processing_class: Any, positions: bool = True
                        ) -> tuple[int | None, str]:
    """The longest batch the Trainer can give, and what says so: TRL's ``max_length``, the
    collator's ``max_length``, the training set's longest row (a map-style set of up to
    ``SCANNED_ROWS`` rows, rounded up to the collator's ``pad_to_multiple_of``), else the
    tokenizer's ``model_max_length`` or the model's positions (``positions``: not over
    several processes, planned before a loader exists: the example batch is the longest
    there, unless a tokenizer says more), whichever is less."""
    trl = getattr(args, "max_length", None) if type(args).__name__ == "SFTConfig" else None
    if trl:
        return int(trl), "SFTConfig.max_length"
    collator = getattr(loader, "collate_fn", None)
    collator = getattr(collator, "data_collator", collator)  # RemoveColumnsCollator
    if getattr(collator, "max_length", None):
        return int(collator.max_length), f"{type(collator).__name__}.max_length"
    lengths = row_lengths(getattr(loader, "dataset", None))
    if lengths is not None:
        multiple = getattr(collator, "pad_to_multiple_of", None) or 1
        return -(-lengths[1] // multiple) * multiple, "the training set's longest row"
    tokenizer = getattr(collator, "tokenizer", None) or processing_class
    found = []
    tokens = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokens, int) and tokens < 10**6:  # 1e30 where none is known
        found.append((tokens, "the tokenizer's model_max_length"))
    config = getattr(model, "config", None)
    most = getattr(config, "max_position_embeddings", None) or \
        getattr(config, "n_positions", None)
    if positions and isinstance(most, int):
        found.append((most, "the model's max_position_embeddings"))
    return min(found) if found else (None, "")


@contextlib.contextmanager
def _the_trainers_loss() -> Iterator[None]:
    """A batch whose output carries no loss, said as the Trainer's user can act on it: the
    callback takes no loss_fn, the Trainer takes its loss from the model's output."""
    try:
        yield
    except LossNotFoundError as error:
        raise error.with_remedy(
            "Trainer takes the loss from model(**batch).loss, so its batches need `labels` "
            "(a data collator that adds them, e.g. DataCollatorForLanguageModeling(tokenizer, "
            "mlm=False)). A Trainer that computes its own loss (compute_loss) is planned with "
            "planner.optimize(model, batch, loss_fn=...) and planner.apply() before "
            "trainer.train(), without this callback.") from None


def _the_trainers_step(args: TrainingArguments, model: torch.nn.Module,
                       batch: dict) -> tuple[dict, Any]:
    """The model call and loss a training step makes: ``model(**batch).loss`` for Trainer,
    with ``num_items_in_batch`` where the model takes it (:func:`_items_in_batch`). TRL's
    SFTTrainer (``trl.SFTTrainer.compute_loss``) calls the model with ``use_cache=False,
    fused_lm_head=True`` (the LM head it fuses on the model in its constructor: per-token
    log-probabilities, never the full logits) and takes the loss from their sum."""
    if type(args).__name__ != "SFTConfig" or not _forward_takes(model, "fused_lm_head"):
        return {**batch, **_items_in_batch(model, batch)}, None
    return {**batch, "use_cache": False, "fused_lm_head": True}, _fused_head_loss


def _items_in_batch(model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """``num_items_in_batch``, as ``Trainer.compute_loss`` passes it to a model that takes
    loss kwargs: the label tokens its loss counts (shifted for a causal LM's loss), as a
    float (the Trainer divides it by its tensor, context and sequence parallel sizes).
    Compiled, it is another graph (HF Llama's backward allocated 0.25 MiB more with it
    than without: over a plan measured without it)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD
                      for p in inspect.signature(model.forward).parameters.values())
    labels = batch.get("labels")
    if not accepts or not isinstance(labels, torch.Tensor):
        return {}
    shifts = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss and \
        not getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    counted = (labels[..., 1:] if shifts else labels).ne(-100).sum()
    return {"num_items_in_batch": counted / 1}  # divided by its parallel sizes: a float


def _forward_takes(model: torch.nn.Module, argument: str) -> bool:
    """Whether the forward set on the instance (under accelerate's wrappers) names
    ``argument``."""
    forward = vars(model).get("forward")
    for _ in range(8):
        code = getattr(forward, "__code__", None)
        if code is not None and argument in code.co_varnames:
            return True
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            return False
    return False


def _fused_head_loss(outputs: Any) -> torch.Tensor:
    return -outputs.log_probs.sum() / outputs.label_mask.sum().clamp(min=1)


def _autocast(args: TrainingArguments) -> torch.dtype | None:
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return None
