"""One switch for Lightning: ``Trainer(..., callbacks=[PlannedCheckpointing(budget_gb=8)])``,
and :func:`plan_in_configure_model` for ``configure_model`` under ``ModelParallelStrategy``.

Lightning's step is the module's ``training_step(batch, batch_idx)``, not ``model(inputs)``:
what is planned is that method on the trainer's first batch, seen as the forward of a small
wrapper (:class:`TrainingStep`) whose children are the LightningModule's own modules. The
plan's checkpoints sit on those modules; the wrapper's plan guard runs at each step because
the module's ``training_step`` is, on the instance, the wrapper's call.

The callback plans at ``on_fit_start``: the strategy has moved the model to its device and
built the optimizers, and the data loader is known. ``self.log`` is silent while planning
(the planned steps are not training steps). The step is planned with ``.grad`` allocated
when it starts: Lightning zeroes gradients after ``training_step``, so each forward but the
first runs beside the last step's gradients. ``Trainer.fit(torch.compile(module))``
(Lightning then compiles the module's ``training_step`` and ``forward``) has its compiled
step planned (``compiled="model"``: the wrapper compiled whole, measured on the loader's
batches), and the planned ``training_step`` runs compiled by the same ``torch.compile``
call; what each compile leaves to Python's cycle collector is freed after each batch, as
it was measured.
Refused: the strategy's own activation checkpointing, manual optimization (the step is not
one backward), and a run over several processes (the strategy wraps the model before
``on_fit_start``: plan in ``configure_model`` with :func:`plan_in_configure_model`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils._pytree import SequenceKey, tree_flatten_with_path, tree_unflatten

from planner.api import apply, optimize, replan
from planner.arguments import _budget_bytes
from planner.config import SEARCH, PlanConfig
from planner.envelope import Envelope, row_lengths, sequence_length
from planner.plan import GIB, InfeasibleBudgetError, Plan, PlanMismatchWarning, format_bytes
from planner.plan_table import PlanTable
from planner.runtime.compile_garbage import collect_compile_garbage
from planner.switches.loader import first_batch

log = logging.getLogger(__name__)

__all__ = ["PlannedCheckpointing", "TrainingStep", "plan_in_configure_model"]

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_DECIDED = frozenset({"autocast", "grad_accumulation", "zero_grad_after_forward", "loss_fn"})


class TrainingStep(nn.Module):
    """``training_step`` of a LightningModule as a forward over the batch's tensors, so
    that the planner profiles, checks and checkpoints the step Lightning runs."""

    def __init__(self, module: LightningModule) -> None:
        super().__init__()
        self.module = module
        self._eager = type(module).training_step.__get__(module)
        self._step = self._eager
        self._spec: Any = None
        self._metadata: dict[int, Any] = {}
        self._mapping: type | None = None
        self._batch_idx = 0

    def forward(self, *leaves: Any) -> Any:
        given = iter(leaves)
        full = [self._metadata[k] if k in self._metadata else next(given)
                for k in range(self._spec.num_leaves)]
        batch = tree_unflatten(full, self._spec)
        if self._mapping is not None:  # a BatchEncoding, a UserDict: rebuilt as it came
            batch = self._mapping(batch)
        return self._step(batch, self._batch_idx)

    def leaves(self, batch: Any, batch_idx: int = 0) -> tuple[Any, ...]:
        """The batch's leaves as this forward takes them (and how to rebuild the batch):
        its tensors and plain values, not its metadata (`_metadata`), which rides along
        unchecked."""
        # a mapping pytree does not know (Hugging Face collators' BatchEncoding) is
        # flattened as a dict, so that its tensors are the step's inputs, checked
        self._mapping = type(batch) if isinstance(batch, Mapping) and \
            not isinstance(batch, dict) else None
        found, self._spec = tree_flatten_with_path(
            dict(batch) if self._mapping is not None else batch)
        self._metadata = _metadata(found)
        self._batch_idx = batch_idx
        return tuple(leaf for k, (_, leaf) in enumerate(found) if k not in self._metadata)

    def compiled_by(self, compiler: Callable[[Any], Any] | None) -> None:
        """Run ``training_step`` compiled by ``compiler`` (None: as written, which planning
        profiles, and whose compiled step it measures compiling this wrapper whole). Compiled
        as Lightning compiles it: the step's own frame, whose batch index is an argument
        (dynamo makes it dynamic), not this wrapper, whose attributes dynamo specializes on
        (HF GPT-2 in Lightning: a recompile at every step for the batch index, and 2 MiB
        more in each, over the budget)."""
        self._step = self._eager if compiler is None else compiler(self._eager)

    def run(self, batch: Any, batch_idx: int, *rest: Any) -> Any:
        """What ``module.training_step`` is once planned: the step, under the plan's guard."""
        if rest:
            return self._step(batch, batch_idx, *rest)
        return self(*self.leaves(batch, batch_idx))


def _metadata(found: list[tuple[tuple, Any]]) -> dict[int, Any]:
    """A batch's leaves that cannot change the step's memory, by position: strings, and
    the values of a list or tuple that holds no tensor (sample ids, lengths as data). A
    plain value of its own (a flag, a depth under a key) can, and stays a checked input."""
    parents: dict[tuple, list[Any]] = {}
    for path, leaf in found:
        parents.setdefault(path[:-1], []).append(leaf)
    return {k: leaf for k, (path, leaf) in enumerate(found)
            if not isinstance(leaf, torch.Tensor) and (
                isinstance(leaf, str) or (path and isinstance(path[-1], SequenceKey)
                                          and len(parents[path[:-1]]) > 1
                                          and not any(isinstance(v, torch.Tensor)
                                                      for v in parents[path[:-1]])))}


def _loss(output: Any) -> torch.Tensor:
    loss = output["loss"] if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError("the LightningModule's training_step returned no loss tensor (nor a "
                        f"dict with 'loss'), but {type(output).__name__}: nothing to plan")
    return loss


@contextlib.contextmanager
def _quiet_logging(module: LightningModule) -> Iterator[None]:
    """``self.log`` outside Lightning's loop raises; planning runs the step outside it."""
    module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log, module.log_dict


def _trainer_settings(trainer: Trainer) -> dict[str, Any]:
    precision = str(trainer.precision)
    if precision not in _AUTOCAST and "mixed" in precision:
        raise ValueError(f"PlannedCheckpointing plans precision '32-true', 'bf16-mixed', "
                         f"'16-mixed' or a '-true' precision, not {precision!r}")
    # Lightning's automatic optimization zeroes gradients after training_step's forward,
    # so every step but the first runs its forward with the last step's .grad allocated;
    # accumulating, the later micro-batches of a window also add into them in the backward
    accumulating = trainer.accumulate_grad_batches > 1
    return {"autocast": _AUTOCAST.get(precision), "grad_accumulation": accumulating,
            "zero_grad_after_forward": not accumulating}


def _plan_step(module: LightningModule, batch: Any, budget_gb: float,
               settings: dict[str, Any], config: PlanConfig,
               compiler: Callable[[Any], Any] | None = None) -> Plan | PlanTable:
    """Plan and install ``module``'s training step on ``batch`` (module docstring);
    ``compiler``: what compiles ``training_step`` (Lightning's ``torch.compile`` call), for
    a plan with ``compiled="model"``."""
    if not module.automatic_optimization:
        raise ValueError("Planned checkpointing plans Lightning's automatic optimization (one "
                         "backward of the loss training_step returns); this module sets "
                         "automatic_optimization=False: plan its model with optimize()")
    step = getattr(module.training_step, "__self__", None)
    if not isinstance(step, TrainingStep):  # planned before: the same wrapper plans again
        step = TrainingStep(module)
    step.compiled_by(None)
    per_rank = config.parallelize is not None
    # a rank's plan cannot start from gradients to accumulate into: plan a fresh start,
    # then make room for them (`_room_for_last_gradients`)
    room = per_rank and settings["grad_accumulation"]
    with _quiet_logging(module):
        plan = optimize(step, step.leaves(batch), budget_gb=budget_gb, loss_fn=_loss,
                        config=config,
                        **({**settings, "grad_accumulation": False} if room else settings))
    if room and isinstance(plan, PlanTable):
        plan = plan.model_copy(update={"entries": [
            e.model_copy(update={"plan": _room_for_last_gradients(e.plan, config)})
            for e in plan.entries]})
    elif room:
        plan = _room_for_last_gradients(plan, config)
    apply(step, plan)
    step.compiled_by(compiler)
    module.training_step = step.run
    return plan


def _room_for_last_gradients(plan: Plan, config: PlanConfig) -> Plan:
    """A rank's plan under gradient accumulation is made for a step that starts with no
    gradients (per-rank planning cannot start from gradients to add into), but its later
    micro-batches hold the sharded gradients throughout: plan for the budget less those."""
    grads = plan.profile.static.grad_bytes
    try:
        return replan(plan, budget_bytes=plan.budget_bytes - grads,
                      **config.options(SEARCH))
    except InfeasibleBudgetError as error:
        least = error.min_budget_bytes + grads
        raise InfeasibleBudgetError(
            f"No plan of this rank's Lightning step fits {format_bytes(plan.budget_bytes)} "
            f"with {format_bytes(grads)} of sharded gradients accumulating beside it; "
            f"the least that fits is {format_bytes(least)}: budget_gb={least / GIB!r}"
            f"\n{error}", least, plan=error.plan) from error


def _switch_config(config: PlanConfig | None, options: dict[str, Any],
                   switch: str) -> PlanConfig:
    return PlanConfig.for_switch(config, options, switch, _DECIDED, "Lightning (Trainer "
                                 "precision and accumulate_grad_batches, the module's "
                                 "training_step)")


class PlannedCheckpointing(Callback):
    """Plan and install activation checkpointing at ``budget_gb`` GiB per device when
    fitting starts; ``plan`` holds the plan after that. Other options (keywords or
    ``config=``) are :class:`~planner.config.PlanConfig`'s (``time_limit_s``, ``offload``,
    ``device``, ...), checked here; precision, gradient accumulation and the loss come
    from the trainer and module, the optimizer too unless given."""

    def __init__(self, budget_gb: float, *, example_batch: Any = None,
                 max_length: int | None = None, buckets: Any = "one",
                 config: PlanConfig | None = None, **options: Any) -> None:
        self.config = _switch_config(config, options, "PlannedCheckpointing")
        _budget_bytes(budget_gb)  # a wrong budget is said now, not when fitting starts
        Envelope(max_length=max_length or 1, buckets=buckets)  # said now, not when fitting
        self.budget_gb = budget_gb
        self.example_batch = example_batch
        self.max_length = max_length
        self.buckets = buckets
        self.plan: Plan | PlanTable | None = None
        self.compiler: Callable[[Any], Any] | None = None  # Lightning's torch.compile call

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if getattr(trainer.strategy, "_activation_checkpointing_kwargs", None):
            raise ValueError("PlannedCheckpointing plans activation checkpointing itself; the "
                             "strategy's activation_checkpointing_policy would checkpoint its "
                             "modules again under it: leave that policy unset")
        if trainer.world_size > 1:
            raise ValueError(
                f"PlannedCheckpointing plans one process; this Trainer runs "
                f"{trainer.world_size}, whose model the strategy wraps before fitting starts. "
                "Plan in configure_model: planner.switches.lightning.plan_in_configure_model(self, "
                "batch, budget_gb=..., parallelize=...) before fully_shard (docs/recipes.md)")
        self.compiler = _lightnings_compiler(pl_module, self.buckets)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.fit_loop.setup_data()
        loader = trainer.train_dataloader
        batch = trainer.strategy.batch_to_device(
            first_batch(loader) if self.example_batch is None else self.example_batch)
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        envelope = _loaders_envelope(loader, batch, self.max_length, self.buckets)
        config = self.config if "optimizer" in self.config.given() else \
            dataclasses.replace(self.config, optimizer=optimizer)
        if "envelope" not in self.config.given():
            config = dataclasses.replace(config, envelope=envelope)
        if self.compiler is not None:
            config = dataclasses.replace(config, compiled="model",
                                         compile_garbage_collected=True)
        self.plan = _plan_step(pl_module, batch, self.budget_gb, _trainer_settings(trainer),
                               config, self.compiler)
        if trainer.is_global_zero:
            self.plan.log_summary(log)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """After a batch in which dynamo traced a frame, what the compile left to Python's
        cycle collector (a forward of several graphs keeps its output in cycles) is freed,
        as the plan was measured (:mod:`planner.runtime.compile_garbage`)."""
        if self.compiler is not None:
            collect_compile_garbage()


def _lightnings_compiler(module: LightningModule, buckets: Any) -> Callable[[Any], Any] | None:
    """How ``Trainer.fit(torch.compile(module))`` compiles (the ``torch.compile`` call it
    took, which Lightning keeps on the module), or None where it does not compile. The plan
    is measured under inductor's default mode: another backend or mode is said."""
    compiling = getattr(module, "_compiler_ctx", None)
    if not compiling:
        return None
    if buckets != "one":
        raise ValueError(f"Trainer.fit(torch.compile({type(module).__name__})): a compiled step "
                         "is planned with one plan for every batch length, measured on them; "
                         f"buckets={buckets!r} would switch plans inside the compiled graph: "
                         "leave buckets='one'")
    compiler = compiling.get("dynamo_ctx") or torch.compile
    other = _not_as_measured(compiler)
    if other is not None:
        warnings.warn(
            f"Trainer.fit(torch.compile({type(module).__name__})): the switch plans the step "
            f"Lightning compiles, measured under inductor's default mode, not {other}, which "
            "may keep other buffers: leave a margin", PlanMismatchWarning, stacklevel=3)
    return compiler


def _not_as_measured(compiler: Any) -> str | None:
    """How a ``torch.compile`` call differs from inductor's default mode (the one a compiled
    plan is measured under), in words, or None. Read from what dynamo keeps of the call
    (private: "a backend this switch cannot read" where this torch keeps it elsewhere)."""
    if compiler is torch.compile:
        return None
    backend = getattr(getattr(getattr(compiler, "callback", None),
                              "_torchdynamo_orig_backend", None), "_torchdynamo_orig_backend",
                      None)
    name = getattr(backend, "_compiler_name", None)
    if name is None:
        return "a backend this switch cannot read"
    options, dynamic = getattr(backend, "config", None), getattr(backend, "dynamic", None)
    said = [f"backend={name!r}"] if name != "inductor" else []
    if options:
        said.append(f"options {options}")
    if dynamic is not None:
        said.append(f"dynamic={dynamic}")
    return ", ".join(said) or None


def _loaders_envelope(loader: Any, batch: Any, max_length: int | None,
                      buckets: Any) -> Envelope | None:
    """The batches Lightning's loader gives: up to ``max_length`` tokens (default the
    collator's ``max_length`` or its tokenizer's ``model_max_length``), the loader's
    ``batch_size`` rows, from the training set's shortest row (a map-style set of rows with
    ``input_ids``; else from 1); one batch on the device at a time (Lightning moves each batch in
    its step; the next one waits on the host). None where the batch has no ``[rows,
    tokens]`` input, or no longest batch is known (the plan then covers the example's
    shape, and a longer batch warns)."""
    flat = dict(batch) if isinstance(batch, Mapping) else batch
    length = sequence_length(tuple(leaf for _, leaf in tree_flatten_with_path(flat)[0]), {})
    if length is None:
        return None
    collate = getattr(loader, "collate_fn", None)
    found = max_length or getattr(collate, "max_length", None) or getattr(
        getattr(collate, "tokenizer", None), "model_max_length", None)
    if not isinstance(found, int) or found >= 10**6:
        log.warning("PlannedCheckpointing: no longest batch is known, so the plan covers "
                    "batches up to the example's %d tokens; give max_length=", length)
        return None
    rows = getattr(loader, "batch_size", None)
    lengths = row_lengths(getattr(loader, "dataset", None))  # a batch is its longest row's
    shortest = min(lengths[0], length) if lengths else 1
    return Envelope(max_length=max(found, length), min_length=shortest, batch_size=rows,
                    buckets=buckets)


def plan_in_configure_model(module: LightningModule, batch: Any, *, budget_gb: float,
                            parallelize: Any = None, config: PlanConfig | None = None,
                            **options: Any) -> Plan | PlanTable:
    """Plan ``module.training_step`` on ``batch`` (one rank's) at ``budget_gb`` GiB per
    rank, install the plan and return it; call it in ``configure_model`` before sharding.

    ``parallelize(model, mesh)``, when given, is what ``configure_model`` then does to the
    model (``fully_shard``, ``parallelize_module``): the plan is made for the step each rank
    runs over the strategy's device mesh (its shape and dimension names), as
    :func:`planner.optimize`'s ``parallelize`` (its first argument is the wrapper whose
    ``module`` is this LightningModule). The optimizer is not built yet here: pass
    ``optimizer=`` to count its state. Other options: :class:`~planner.config.PlanConfig`'s."""
    made = _switch_config(config, options, "plan_in_configure_model()")
    if parallelize is not None:
        mesh = module.device_mesh
        made = dataclasses.replace(
            made, parallelize=lambda step, mesh: parallelize(step.module, mesh),
            mesh_shape=tuple(mesh.shape), mesh_dim_names=mesh.mesh_dim_names)
    return _plan_step(module, batch, budget_gb, _trainer_settings(module.trainer), made)
