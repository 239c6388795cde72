"""A torchtitan activation-checkpointing policy that plans: ``PlannedAC.Config(budget_gb=70,
local_batch_size=8, seq_len=8192)`` where a config names ``FullAC.Config()`` or
``SelectiveAC.Config()`` (``Trainer.Config(activation_checkpoint=...)``).

torchtitan builds the model on the meta device and calls ``ac_config.build().apply(model)``
once per model part, after tensor parallel and before ``torch.compile`` and
``fully_shard``. Without pipeline parallelism the part is the whole model: ``apply`` plans
its training step there, on the meta model, at
the per-rank budget (``data_parallel_shard_degree`` > 1: FSDP2 over that many ranks), and
installs the plan on the part's own modules; the model is then materialised
(``to_empty``, ``init_weights``) and trained by torchtitan as usual. The plan's memory is
estimated for ``device`` (default an H100: nothing runs on the meta device). With
torchtitan's compile on, each block is compiled after ``apply``: the plan is the eager
step's (a rank's compiled step is not measured yet), and the plan's guard says so at the
first step. A pipeline
stage is refused with the reason (its step holds microbatches under a schedule this config
does not name): plan stages with ``planner.optimize(..., pipeline=...)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

from planner.api import apply, optimize
from planner.arguments import _budget_bytes
from planner.plan import Plan

log = logging.getLogger(__name__)

__all__ = ["PlannedAC"]


def _refuse_pipeline_part(model: nn.Module) -> None:
    """PlannedAC plans a whole model's step; a pipeline stage's is another (no tokens in or
    no loss out, several microbatches held under its schedule), so a part is refused."""
    # torchtitan's pipeline split sets the top-level modules another stage holds to None
    elsewhere = [name for name, module in model._modules.items() if module is None]
    if elsewhere:
        raise ValueError(
            f"PlannedAC plans a whole model's step (tokens in, next-token loss out), and this "
            f"{type(model).__name__} is a pipeline part: its {', '.join(elsewhere)} "
            f"{'is' if len(elsewhere) == 1 else 'are'} another stage's. A stage holds several "
            "microbatches under its schedule, which this config does not know. Plan each "
            "stage with planner.optimize(stage_module, microbatch, budget_gb=..., "
            "pipeline={...}) and planner.apply() (docs/recipes.md, 'Pipeline stages'), with "
            "activation_checkpoint=None in the config.")


def _next_token_loss(labels: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    return loss


class PlannedAC(ActivationCheckpointing):
    """Checkpointing planned under a per-rank budget in GiB (module docstring); ``plan``
    holds the last part's plan after ``apply``."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        budget_gb: float
        """Per-rank memory budget in GiB (2**30 bytes) for the step, parameters included."""

        local_batch_size: int = 8
        """Sequences per rank in a step, as ``training.local_batch_size``."""

        seq_len: int = 2048
        """Tokens per sequence, as ``training.seq_len``."""

        data_parallel_shard_degree: int = 1
        """Ranks FSDP2 shards over, as ``parallelism.data_parallel_shard_degree``."""

        device: str | None = None
        """What the plan's timings and kernels are estimated for: ``None`` (an H100),
        ``"cpu"``, or a name ``profiles.devices`` knows."""

        optimizer: str | None = "AdamW"
        """The ``torch.optim`` class training steps with (its state counts in the budget),
        as ``optimizer.name``; ``None`` counts none."""

        time_limit_s: float = 60.0
        """Bound on the solver's search."""

    def __init__(self, config: PlannedAC.Config, dump_folder: str = "") -> None:
        _budget_bytes(config.budget_gb)  # a wrong budget is said when the config is built
        super().__init__(config, dump_folder)
        self.plan: Plan | None = None

    def apply(self, model: nn.Module) -> None:
        config: PlannedAC.Config = self.config  # type: ignore[assignment]
        _refuse_pipeline_part(model)
        device = next(model.parameters()).device
        vocab = model.get_submodule("tok_embeddings").num_embeddings
        shape = (config.local_batch_size, config.seq_len)
        tokens = torch.randint(vocab, shape, device=device)
        labels = torch.randint(vocab, shape, device=device)
        sharded = config.data_parallel_shard_degree > 1
        optimizer = getattr(torch.optim, config.optimizer)(model.parameters()) \
            if config.optimizer else None
        self.plan = optimize(
            model, (tokens,), budget_gb=config.budget_gb, loss_fn=_next_token_loss(labels),
            optimizer=optimizer, timing="estimate", device=config.device,
            time_limit_s=config.time_limit_s,
            world_size=config.data_parallel_shard_degree,
            sharding="fsdp2" if sharded else None, progress=False)
        apply(model, self.plan)
        self.plan.log_summary(log)
