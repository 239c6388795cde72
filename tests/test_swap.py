"""Planning leaves the model exactly as it found it: every parameter, buffer and gradient
the same object with the same bits under every name that reaches it, the same hooks,
forwards and modes (``benchmarks/model_snapshot.py`` says what is compared)."""

from __future__ import annotations

import pytest
import torch
from model_snapshot import ModelSnapshot
from torch import nn

from planner import apply, optimize, profile_model, solve
from planner.zoo import ZooModel


class SharedTwice(nn.Module):
    """One Linear registered under two names (as timm's CoaT registers its cpe modules),
    and a tied weight across two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU())
                                      for _ in range(3)])
        self.alias = self.blocks[1]
        self.head = nn.Linear(64, 32)
        self.head.weight = nn.Parameter(self.embed.weight.t().contiguous())
        self.norm = nn.BatchNorm1d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(x))))


def _planned_midway(zm: ZooModel) -> None:
    """Profile, then solve halfway between static memory and the unplanned peak."""
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, progress=False)
    static = step.profile.static.total_bytes
    solve(step, budget_bytes=(static + step.unplanned_peak_bytes) // 2, time_limit_s=5)


def test_a_module_under_two_names_keeps_its_parameters() -> None:
    torch.manual_seed(0)
    model = SharedTwice()
    model.head.register_forward_hook(lambda m, a, o: None)
    model.blocks[0].eval()  # a frozen piece stays frozen
    model.embed.weight.grad = torch.ones_like(model.embed.weight)
    before = ModelSnapshot.of(model)
    _planned_midway(ZooModel("shared", model, (torch.randn(64, 32),), lambda o: o.square().mean()))
    assert before.differences(model) == []
    assert all(type(p) is nn.Parameter for p in model.parameters())
    model(torch.randn(8, 32)).sum().backward()  # and it still trains on real tensors


def test_zoo_models_are_untouched(zoo_model: ZooModel) -> None:
    """Profiling is what runs the model (solving reads the profile only); measured op times
    run it once more, on the small MLP."""
    before = ModelSnapshot.of(zoo_model.model)
    timing = "measure" if zoo_model.name == "mlp" else "estimate"
    profile_model(zoo_model.model, zoo_model.example_inputs, loss_fn=zoo_model.loss_fn,
                  timing=timing, progress=False)
    assert before.differences(zoo_model.model) == []


def test_the_snapshot_sees_a_swapped_parameter() -> None:
    """The check itself can fail: a parameter replaced by an equal copy is a change."""
    model = SharedTwice()
    before = ModelSnapshot.of(model)
    model.alias[0].weight = nn.Parameter(model.alias[0].weight.detach().clone())
    assert any("alias.0.weight" in line for line in before.differences(model))


@pytest.mark.parametrize("offload", [False, True])
def test_apply_keeps_shared_parameters(offload: bool) -> None:
    torch.manual_seed(0)
    model = SharedTwice()
    x = torch.randn(64, 32)
    plan = optimize(model, (x,), budget_gb=1, loss_fn=lambda o: o.square().mean(),
                    progress=False, offload=offload, time_limit_s=5)
    params = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    apply(model, plan)
    assert params == {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}


def test_planning_a_planned_model_leaves_its_plan_as_it_was() -> None:
    """Re-planning takes the plan off while profiling and puts every hook back under its own
    key and in its own place, offload hooks and guard included."""
    torch.manual_seed(0)
    model = SharedTwice()
    x = torch.randn(64, 32)
    plan = optimize(model, (x,), budget_gb=1, loss_fn=lambda o: o.square().mean(),
                    progress=False, offload=True, time_limit_s=5)
    apply(model, plan)
    model.register_forward_pre_hook(lambda m, a: None)  # a user's hook after the plan's
    before = ModelSnapshot.of(model)
    optimize(model, (x,), budget_gb=1, loss_fn=lambda o: o.square().mean(), progress=False,
             offload=True, time_limit_s=5)
    assert before.differences(model) == []
