"""Gradient accumulation starts each later micro-batch from the gradients the backward left,
laid out as AccumulateGrad left them: an incoming gradient is kept as ``.grad`` when its
strides are the parameter's, also when it is a slice of a larger storage (the backward of
``cat``). The profile counts those storages, and ``measure_step`` measures from them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import profiles
from planner import InfeasibleBudgetError, apply, measure_step, profile_model, solve
from planner.measure import PeakTracker
from profiles.fake import SMALL_NUMEL

VOCAB, HIDDEN, EMBEDDING = 512, 64, 32


class _Head(nn.Module):
    """The MLM head of MobileBERT (transformers' MobileBertLMPredictionHead): the logits
    multiply by ``cat([decoder.weight.t(), dense.weight])``, so ``dense.weight.grad`` is a
    slice of the cat's gradient and keeps all of it."""

    def __init__(self) -> None:
        super().__init__()
        self.transform = nn.Linear(HIDDEN, HIDDEN)
        self.dense = nn.Linear(VOCAB, HIDDEN - EMBEDDING, bias=False)
        self.decoder = nn.Linear(EMBEDDING, VOCAB, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.transform(hidden))
        return hidden.matmul(torch.cat([self.decoder.weight.t(), self.dense.weight], dim=0))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.flatten(0, 1)).view_as(x)
        return x + self.drop(self.down(F.gelu(self.up(x))))


class _CatHeadModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = _Head()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _cat_head_model() -> tuple[nn.Module, tuple, Any]:
    torch.manual_seed(0)
    model = _CatHeadModel()
    ids = torch.randint(0, VOCAB, (2, 32))
    labels = torch.randint(0, VOCAB, (2, 32))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return model, (ids,), loss_fn


def _grad_storage_bytes(model: nn.Module) -> int:
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                for p in model.parameters() if (g := p.grad) is not None}
    return sum(storages.values())


def _second_micro_batch_peak(model: nn.Module, args: tuple, kwargs: dict, loss_fn) -> int:
    """Peak bytes of the second micro-batch of a training loop: ``zero_grad()``, one
    backward, then one that accumulates into the gradients it left."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(*args, **kwargs)).backward()
    static = [*model.parameters(), *model.buffers(),
              *(p.grad for p in model.parameters() if p.grad is not None),
              *(t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))]
    with PeakTracker(static) as tracker:
        loss_fn(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def _planned_at_the_minimum(model: nn.Module, inputs: Any, loss_fn) -> Any:
    step = profile_model(model, inputs, loss_fn=loss_fn, grad_accumulation=True,
                         timing="estimate", progress=False)
    with pytest.raises(InfeasibleBudgetError) as error:
        solve(step, budget_bytes=step.profile.static.total_bytes, op_ranges=False,
              time_limit_s=20)
    plan = solve(step, budget_bytes=error.value.min_budget_bytes, op_ranges=False,
                 time_limit_s=20)
    assert plan.checkpointing
    return plan


def _assert_holds(model: nn.Module, args: tuple, kwargs: dict, loss_fn, plan: Any) -> None:
    apply(model, plan)
    measured = _second_micro_batch_peak(model, args, kwargs, loss_fn)
    assert measured <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.01 * measured


def test_the_profile_counts_the_storages_a_backward_leaves_gradients_in() -> None:
    model, args, loss_fn = _cat_head_model()
    loss_fn(model(*args)).backward()
    left = _grad_storage_bytes(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert left == params + model.head.decoder.weight.numel() * 4  # dense.weight keeps the cat
    accumulating = profiles.profile(model, args, loss_fn=loss_fn, grad_accumulation=True,
                                    timing="estimate", progress=False)
    assert accumulating.static.grad_bytes == left
    fresh = profiles.profile(model, args, loss_fn=loss_fn, timing="estimate", progress=False)
    assert fresh.static.grad_bytes == params  # as before: a fresh step's gradients are modelled


def test_a_fake_profile_of_a_meta_model_lays_out_gradients_alike() -> None:
    model, args, loss_fn = _cat_head_model()
    loss_fn(model(*args)).backward()
    left = _grad_storage_bytes(model)
    with torch.device("meta"):
        meta = _CatHeadModel()
    prof = profiles.profile(meta, args, loss_fn=loss_fn, grad_accumulation=True,
                            progress=False)
    assert prof.execution == "fake"
    assert prof.static.grad_bytes == left


def test_an_accumulation_plan_at_its_minimum_holds_on_the_second_micro_batch() -> None:
    model, args, loss_fn = _cat_head_model()
    plan = _planned_at_the_minimum(model, args, loss_fn)
    _assert_holds(model, args, {}, loss_fn, plan)


def test_measure_step_starts_from_the_gradients_a_backward_leaves() -> None:
    model, args, loss_fn = _cat_head_model()
    loop = _second_micro_batch_peak(model, args, {}, loss_fn)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    fresh_peak, fresh_loss, fresh_grads = measure_step(model, args, {}, loss_fn)
    model.load_state_dict(state)
    torch.manual_seed(1)
    peak, loss, grads = measure_step(model, args, {}, loss_fn, grads_at_start=True)
    assert peak == loop > fresh_peak
    # the backward before it leaves no trace but the gradients' layout: same draws of
    # dropout, same BatchNorm statistics, one step's gradients
    assert torch.equal(loss, fresh_loss)
    assert grads.keys() == fresh_grads.keys()
    assert all(torch.equal(grads[k], fresh_grads[k]) for k in grads)
    assert all(p.grad is None for p in model.parameters())


def test_mobilebert_accumulation_plan_holds_on_the_second_micro_batch() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MobileBertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, embedding_size=EMBEDDING, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, intra_bottleneck_size=32,
        true_hidden_size=32, num_feedforward_networks=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MobileBertForMaskedLM(config)
    ids = torch.randint(0, VOCAB, (2, 32))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    plan = _planned_at_the_minimum(model, inputs, None)
    _assert_holds(model, (), inputs, profiles.default_loss, plan)


class _BranchyHead(nn.Module):
    """A forward that branches on a tensor's value (fake tensors cannot run it) before the
    cat of weights."""

    def __init__(self) -> None:
        super().__init__()
        self.head = _Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x if x.sum() > 0 else -x)


def test_a_real_profile_lays_out_gradients_on_real_tensors_and_leaves_the_model_as_it_was(
        ) -> None:
    torch.manual_seed(0)
    model = _BranchyHead()
    x = torch.rand(SMALL_NUMEL // HIDDEN + 1, HIDDEN)  # too large for a known value: real
    model(x).sum().backward()
    left = _grad_storage_bytes(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    prof = profiles.profile(model, x, loss_fn=lambda y: y.sum(), execution="fake",
                            grad_accumulation=True, timing="estimate", progress=False)
    assert prof.execution == "real"
    assert prof.static.grad_bytes == left
    assert all(p.grad.untyped_storage().nbytes() == p.numel() * 4 and bool((p.grad == 0.5).all())
               for p in model.parameters())
