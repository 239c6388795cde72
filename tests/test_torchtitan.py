"""`planner.switches.torchtitan.PlannedAC`: a torchtitan activation-checkpointing policy that plans
on the meta model, as torchtitan applies its policies (``ac_config.build().apply(model)``
before materialising), and trains like the model without it, within the budget.

torchtitan 0.3.0's language models attend with FlexAttention, which has no backward on the
CPU; the model here is torchtitan's Llama 3 debug model with its inner attention set to
torchtitan's own ``ScaledDotProductAttention``. Several ranks (``fully_shard``) are not run
here: per-rank plans are tested in test_parallel.py and test_distributed.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from planner import InfeasibleBudgetError, Plan, PlanMismatchWarning, replan
from planner.measure import PeakTracker

pytest.importorskip("torchtitan")
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.common.attention import (
    FlexAttention,
    ScaledDotProductAttention,
)
from torchtitan.models.llama3 import llama3_configs

from planner.switches.torchtitan import PlannedAC

GIB = 2**30
BATCH, SEQ = 2, 128


def _meta_llama() -> torch.nn.Module:
    config = llama3_configs["debugmodel"]("flex")
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    with torch.device("meta"):
        return config.build()


def _materialise(model: torch.nn.Module) -> torch.nn.Module:
    """What torchtitan does after parallelize: real storage, then its own init."""
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _train(model: torch.nn.Module) -> tuple[list[float], list[int]]:
    """Two AdamW steps on fixed tokens: each step's loss and measured peak."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses, peaks = [], []
    for _ in range(2):
        tokens = torch.randint(2048, (BATCH, SEQ), generator=generator)
        labels = torch.randint(2048, (BATCH, SEQ), generator=generator)
        state = [t for s in optimizer.state.values() for t in s.values()]
        with PeakTracker([*model.parameters(), *model.buffers(), *state, tokens,
                          labels]) as tracker:
            # the logits go once the loss has them, as in torchtitan's step (del pred)
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten(0, 1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        peaks.append(tracker.peak_bytes)
    return losses, peaks


def _policy(budget_gb: float) -> PlannedAC:
    return PlannedAC.Config(budget_gb=budget_gb, local_batch_size=BATCH, seq_len=SEQ,
                            device="cpu", time_limit_s=10).build()


def _half_budget_gb() -> float:
    """Static memory (AdamW's state included) plus half the activations, or 2 % over the
    least budget a plan meets when that is more."""
    policy = _policy(1e3)
    policy.apply(_meta_llama())
    first = policy.plan
    static = first.profile.static.total_bytes
    try:
        half = replan(first, budget_bytes=static + (first.unplanned_peak_bytes - static) // 2,
                      time_limit_s=10)
        return half.budget_bytes / GIB
    except InfeasibleBudgetError as error:
        return 1.02 * error.min_budget_gb


def test_the_policy_plans_the_meta_model_and_trains_like_torchtitan() -> None:
    """Applied as torchtitan applies a policy (on the meta model, before materialising),
    the plan checkpoints the model's own blocks; two AdamW steps give bit-identical losses
    and weights to the model without it, each step's measured peak within the budget."""
    policy = _policy(_half_budget_gb())
    planned = _meta_llama()
    policy.apply(planned)
    plan = policy.plan
    assert isinstance(plan, Plan) and plan.checkpointing
    assert plan.profile.static.optimizer_state_bytes > 0  # AdamW's state is counted
    _materialise(planned)
    unplanned = _materialise(_meta_llama())
    with warnings.catch_warnings():  # materialised from meta is not a change to the model
        warnings.simplefilter("error", PlanMismatchWarning)
        losses, peaks = _train(planned)
    expected, _ = _train(unplanned)
    assert losses == expected
    for (name, a), (_, b) in zip(planned.named_parameters(), unplanned.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert max(peaks) <= plan.budget_bytes, (peaks, plan.predicted_peak_bytes)


def test_the_policy_on_blocks_torchtitan_already_checkpoints_is_refused() -> None:
    model = _meta_llama()
    FullAC.Config().build().apply(model)
    with pytest.raises(ValueError, match="activation_checkpoint=None"):
        _policy(1.0).apply(model)


@pytest.mark.parametrize("elsewhere", [("norm", "lm_head"), ("tok_embeddings",)],
                         ids=["first stage", "later stage"])
def test_a_pipeline_part_is_refused_with_the_reason(elsewhere: tuple[str, ...]) -> None:
    """torchtitan's pipeline split leaves each part the modules of its own stage: a part
    is no whole model's step (it crashed on later parts, and planned the first part as if
    its hidden states were logits)."""
    model = _meta_llama()
    for name in elsewhere:
        setattr(model, name, None)
    with pytest.raises(ValueError, match="pipeline part") as caught:
        _policy(1.0).apply(model)
    assert all(name in str(caught.value) for name in elsewhere)


def test_a_budget_that_is_no_budget_is_refused_when_the_policy_is_built() -> None:
    with pytest.raises(TypeError, match="budget_gb"):
        _policy("70")  # type: ignore[arg-type]


def test_blocks_compiled_after_the_policy_are_told_the_plan_is_the_eager_steps() -> None:
    """torchtitan's compile (``compile.enable``) compiles each block in place after the
    policy is applied: the plan is the eager step's, said at the first step."""
    policy = _policy(1e3)
    planned = _meta_llama()
    policy.apply(planned)
    _materialise(planned)
    for block in planned.layers.children():
        block.compile(backend="eager")  # torchtitan's order (its backend: inductor)
    tokens = torch.randint(2048, (BATCH, SEQ))
    try:
        with pytest.warns(PlanMismatchWarning, match=r"modules 'layers.0', 'layers.1'.* "
                          r"compiled \(torch.compile\), and its plan is the eager step's"):
            planned(tokens).float().mean().backward()
    finally:
        torch._dynamo.reset()
