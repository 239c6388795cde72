"""Custom autograd Functions (`profiles.functions`): the ops one call ran are one unit, its
own backward is the one that runs, and what it holds is booked where it runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from custom_functions import StraightThrough  # benchmarks/, on the path (conftest.py)
from torch import nn

import profiles
from planner import InfeasibleBudgetError, apply, optimize, remove
from planner.api import measure_step, plan_for_schedule, structure_fingerprint
from planner.arguments import _input_specs
from profiles.functions import FunctionCall, functions_as_leaves, watched_functions
from profiles.inputs import normalize_inputs
from profiles.traced import ChildrenAsLeaves
from solvers import Schedule, simulate
from solvers.from_profile import problem_from_profile, unemittable_calls


class Quantized(nn.Module):
    """A forward whose own ops hold a Function between child calls (an op range)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = StraightThrough.apply(torch.relu(self.up(x)))
        return self.head(torch.tanh(self.down(h)))


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class TanhGelu(torch.autograd.Function):
    """Bloom's GeLU: saves its input, and its backward makes several temporaries."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _tanh_gelu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        slope = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        return slope * grad


class Gelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TanhGelu.apply(x)


class Mlp(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 4 * width), Gelu(), \
            nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class CallsAModule(torch.autograd.Function):
    """A fused op whose forward calls a module (without autograd, as every Function's)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight = layer.weight
        return layer(x).relu()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return (grad * (x @ ctx.weight.t() > 0)) @ ctx.weight, None


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(CallsAModule.apply(x, self.inner))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _profile(model: nn.Module, x: torch.Tensor) -> profiles.GraphProfile:
    return profiles.profile(model, (x,), loss_fn=_loss, timing="estimate", progress=False)


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model(x)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_a_trace_calls_a_function_as_one_node_and_leaves_apply_as_it_was() -> None:
    before = torch.autograd.Function.__dict__["apply"]
    graph = ChildrenAsLeaves().trace(Quantized())
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert FunctionCall(StraightThrough) in targets
    assert "round" not in str(graph)  # its forward's ops are not the graph's
    assert torch.autograd.Function.__dict__["apply"] is before
    with functions_as_leaves(ChildrenAsLeaves()), watched_functions(lambda *a: None,
                                                                    lambda *a: None):
        pass
    assert torch.autograd.Function.__dict__["apply"] is before


def test_a_function_inside_an_op_range_keeps_its_own_backward() -> None:
    torch.manual_seed(0)
    model, x = Quantized(), torch.randn(8, 16)
    expected = _grads(model, x)
    prof = _profile(model, x)
    [call] = prof.function_calls
    assert call.name.endswith("StraightThrough")
    problem = problem_from_profile(prof)
    ranges = [s for s in problem.module_spans if s.kind == "ops"
              and s.start <= call.start and call.stop <= s.stop]
    assert ranges, "an op range holding the Function is a region"
    args, kwargs = normalize_inputs(model, (x,))
    for span in ranges:
        plan = plan_for_schedule(prof, Schedule.from_segments(problem.n_nodes,
                                                             [(span.start, span.stop)]),
                                 _input_specs(args, kwargs), structure_fingerprint(model))
        apply(model, plan)
        try:
            got = _grads(model, x)
        finally:
            remove(model)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in got), span.name


def test_its_backward_is_booked_to_its_last_op_where_its_saves_are() -> None:
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 16, 32)
    prof = _profile(model, x)
    assert len(prof.function_calls) == 3
    for call in prof.function_calls:
        last = prof.nodes[call.stop - 1]
        saved_input = prof.nodes[call.start].read_storages[0]
        assert saved_input in last.saved_storages  # packed as the call returned
        assert last.bwd_time_ms > 0 and saved_input in last.grad_storages
        # the observed backward's temporaries are its own, not the next op's
        assert last.bwd_peak_bytes > last.bwd_live_before_bytes
        assert all(not n.saved_storages for n in prof.nodes[call.start:call.stop - 1])


def test_a_recomputed_function_is_measured_as_predicted() -> None:
    """The GeLU call recomputed alone: its rerun happens at its backward, which must be
    where its temporaries are counted (booked to the next op, the prediction was low)."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 64, 32)
    prof = _profile(model, x)
    acts = [c for c in prof.module_calls if c.path.endswith(".act")]
    problem = problem_from_profile(prof)
    schedule = Schedule.from_segments(problem.n_nodes, [(c.start, c.stop) for c in acts])
    args, kwargs = normalize_inputs(model, (x,))
    plan = plan_for_schedule(prof, schedule, _input_specs(args, kwargs),
                             structure_fingerprint(model))
    expected = _grads(model, x)
    apply(model, plan)
    try:
        peak, _, grads = measure_step(model, args, kwargs, _loss)
    finally:
        remove(model)
    assert all(torch.equal(grads[k], expected[k]) for k in expected)
    assert abs(plan.predicted_peak_bytes - peak) <= 0.001 * peak, (plan.predicted_peak_bytes,
                                                                   peak)


def test_a_module_a_function_calls_is_no_region() -> None:
    torch.manual_seed(0)
    model, x = Fused(), torch.randn(4, 8)
    prof = _profile(model, x)
    inner = next(c for c in prof.module_calls if c.path == "inner")
    assert "autograd Function" in unemittable_calls(prof)[inner.index]
    expected = _grads(model, x)
    plan = optimize(model, (x,), budget_gb=1.0, loss_fn=_loss, timing="estimate",
                    progress=False)
    apply(model, plan)
    try:
        got = _grads(model, x)
    finally:
        remove(model)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("width", [16, 24])
def test_a_planned_model_with_a_function_trains_like_the_unplanned_one(width: int) -> None:
    torch.manual_seed(0)
    model, x = Quantized(width), torch.randn(128, width)
    expected = _grads(model, x)
    prof = _profile(model, x)
    static = prof.static.total_bytes
    unplanned = simulate(problem_from_profile(prof),
                         Schedule.store_all(len(prof.nodes))).peak_bytes
    options = dict(loss_fn=_loss, timing="estimate", progress=False)
    try:
        plan = optimize(model, (x,), budget_gb=(static + 0.5 * (unplanned - static)) / 2**30,
                        **options)
    except InfeasibleBudgetError as error:
        plan = optimize(model, (x,), budget_gb=error.min_budget_gb, **options)
    assert plan.checkpointing
    apply(model, plan)
    try:
        peak, _, grads = measure_step(model, *normalize_inputs(model, (x,)), _loss)
    finally:
        remove(model)
    assert peak <= plan.budget_bytes
    assert all(torch.equal(grads[k], expected[k]) for k in expected)


def test_its_backward_is_timed_where_it_is_booked() -> None:
    """Measured timing times the Function's own backward alone (its ops ran without
    autograd, so no op's backward stands for it)."""
    torch.manual_seed(0)
    model, x = Stack(depth=1), torch.randn(4, 16, 32)
    prof = profiles.profile(model, (x,), loss_fn=_loss, timing="measure", progress=False,
                            repeats=1, warmup=0)
    [call] = prof.function_calls
    assert prof.nodes[call.stop - 1].bwd_time_ms > 0
    assert all(n.bwd_time_ms == 0 for n in prof.nodes[call.start:call.stop - 1])
