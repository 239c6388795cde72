"""optimize / apply / verify: plan a model's checkpoints under a memory budget and use them."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import profiles
from planner.plan import (
    GIB,
    InfeasibleBudgetError,
    InputSpec,
    Plan,
    PlanMismatchError,
    PlanRegion,
    SolverReport,
)
from planner.rewrite import rewrite
from profiles.schema import GraphProfile
from profiles.tracing import flat_placeholder_values, graph_fingerprint, normalize_inputs
from solvers import (
    SOLVERS,
    Problem,
    Region,
    Schedule,
    Solution,
    Status,
    Timeline,
    memory_lower_bound,
    simulate,
)
from solvers.baselines import BASELINES
from solvers.from_profile import problem_from_profile

log = logging.getLogger(__name__)


def _input_specs(args: tuple, kwargs: dict) -> list[InputSpec]:
    specs: list[InputSpec] = []
    seen: dict[int, str] = {}  # the same tensor passed twice traces differently: keep it so
    for keyword, items in ((False, enumerate(args)), (True, kwargs.items())):
        for name, value in items:
            if isinstance(value, torch.Tensor):
                specs.append(InputSpec(name=str(name), keyword=keyword, shape=list(value.shape),
                                       dtype=str(value.dtype).removeprefix("torch."),
                                       same_as=seen.get(id(value))))
                seen.setdefault(id(value), str(name))
            else:
                specs.append(InputSpec(name=str(name), keyword=keyword, value=value))
    return specs


def _stand_in_inputs(plan: Plan, device: torch.device) -> tuple[tuple, dict]:
    """Zeros shaped like the planned inputs: enough to capture the same graph again."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    made: dict[str, Any] = {}
    for spec in plan.inputs:
        value = spec.value
        if spec.same_as is not None:
            value = made[spec.same_as]
        elif spec.shape is not None:
            value = torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
        made[spec.name] = value
        if spec.keyword:
            kwargs[spec.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def _plan_regions(profile: GraphProfile, regions: tuple[Region, ...]) -> list[PlanRegion]:
    names = [n.name for n in profile.nodes]
    return [PlanRegion(start=r.start, stop=r.stop, mode=r.mode, nodes=names[r.start:r.stop],
                       kept=[names[i] for i in sorted(r.keep)],
                       children=_plan_regions(profile, r.children)) for r in regions]


def _make_plan(profile: GraphProfile, problem: Problem, unplanned: Timeline,
               schedule: Schedule, budget_bytes: int, report: SolverReport,
               inputs: list[InputSpec], note: str = "") -> Plan:
    timeline = simulate(problem, schedule)
    breakdown = timeline.breakdown
    return Plan(
        model_name=profile.model_name,
        fingerprint=profile.fingerprint,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=timeline.peak_bytes,
        peak_breakdown={"static": breakdown.static_bytes,
                        "kept_activations": breakdown.kept_activation_bytes,
                        "recomputed_activations": breakdown.recomputed_activation_bytes,
                        "gradients": breakdown.gradient_bytes,
                        "temporaries": breakdown.temp_bytes},
        peak_at=timeline.peak_label,
        unplanned_peak_bytes=unplanned.peak_bytes,
        baseline_step_ms=unplanned.total_time_ms,
        recompute_ms=timeline.recompute_time_ms,
        checkpointing=any(r.mode == "recompute" for r in schedule.regions),
        note=note,
        solver=report,
        regions=_plan_regions(profile, schedule.regions),
        schedule=schedule,
        inputs=inputs,
        profile=profile,
    )


def optimize(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    budget_gb: float,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    solver: str = "auto",
    time_limit_s: float = 60.0,
    timing: str = "auto",
    device: str | None = None,
    progress: bool = True,
) -> Plan:
    """Plan which activations to keep so one training step peaks under ``budget_gb`` GiB.

    The budget covers parameters, gradients, buffers, inputs, activations, temporaries and,
    when ``optimizer`` is given, its state (1 GiB = 2**30 bytes).

    Raises:
        CaptureError: the model cannot be captured as a graph.
        InfeasibleBudgetError: no schedule fits; the message names the minimum in GiB.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    if budget_gb <= 0:
        raise ValueError(f"budget_gb must be positive, got {budget_gb}")
    budget_bytes = int(budget_gb * GIB)
    args, kwargs = normalize_inputs(model, example_inputs)
    inputs = _input_specs(args, kwargs)
    gm = profiles.capture(model, kwargs or args, loss_fn)
    prof = profiles.profile(gm, None, loss_fn=loss_fn, optimizer=optimizer, timing=timing,
                            device=device, progress=progress)
    return plan_for_profile(prof, budget_bytes, inputs, solver=solver,
                            time_limit_s=time_limit_s)


def plan_for_profile(prof: GraphProfile, budget_bytes: int, inputs: list[InputSpec], *,
                     solver: str = "auto", time_limit_s: float = 60.0) -> Plan:
    """The solving half of :func:`optimize`, for a profile already taken."""
    problem = problem_from_profile(prof)
    unplanned = simulate(problem, Schedule.store_all(problem.n_nodes))
    if unplanned.peak_bytes <= budget_bytes:
        report = SolverReport(name="none", status=Status.OPTIMAL.value, objective_ms=0.0,
                              bound_ms=0.0, gap=0.0, solve_time_s=0.0)
        note = (f"No checkpointing needed: the unplanned step peaks at "
                f"{unplanned.peak_bytes / GIB:.3f} GiB, within the budget.")
        log.info(note)
        return _make_plan(prof, problem, unplanned, Schedule.store_all(problem.n_nodes),
                          budget_bytes, report, inputs, note)
    log.info("solving with %s: %d nodes, budget %.3f GiB", solver, problem.n_nodes,
             budget_bytes / GIB)
    solution = SOLVERS[solver](problem, budget_bytes, time_limit_s)
    if not solution.feasible or solution.schedule is None:
        raise _infeasible(prof, problem, budget_bytes, solution)
    report = SolverReport(name=solution.solver, status=solution.status.value,
                          objective_ms=solution.objective_ms, bound_ms=solution.bound_ms,
                          gap=solution.gap, solve_time_s=solution.solve_time_s)
    return _make_plan(prof, problem, unplanned, solution.schedule, budget_bytes, report,
                      inputs)


def _infeasible(prof: GraphProfile, problem: Problem, budget_bytes: int,
                solution: Solution) -> InfeasibleBudgetError:
    """The error for a budget no schedule met, naming the lowest peak any schedule reached
    (the budget to ask for) and, when it is not proven minimal, the proven lower bound."""
    tried = [solution] + [baseline(problem, budget_bytes, 1.0)
                          for baseline in BASELINES.values()]
    reached = [(s.peak_bytes, s.solver) for s in tried if s.peak_bytes]
    lowest, how = min(reached) if reached else (0, "")
    bound = solution.min_feasible_budget_bytes or memory_lower_bound(problem)
    exact = solution.min_feasible_budget_exact and bound >= lowest
    minimum = f"{lowest / GIB:.4f} GiB ({lowest} bytes, reached by {how})"
    if not exact:
        minimum += (f"; no schedule can go below {bound / GIB:.4f} GiB, and schedules in "
                    "between may exist that the solver did not find in its time limit")
    return InfeasibleBudgetError(
        f"No checkpointing schedule of {prof.model_name} found within {budget_bytes / GIB:.4f} "
        f"GiB: the minimum is {minimum}. Static memory alone is "
        f"{prof.static.total_bytes / GIB:.4f} GiB. Raise budget_gb, shrink the batch, or "
        "shard parameters/optimizer state.", lowest)


def _model_device(model: nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


def apply(model: nn.Module, plan: Plan) -> torch.fx.GraphModule:
    """A module that runs ``plan``: call it exactly like ``model``; it trains ``model``'s own
    parameters (same objects, same ``state_dict()``).

    Raises:
        PlanMismatchError: the model or its input shapes differ from the planned ones.
    """
    args, kwargs = _stand_in_inputs(plan, _model_device(model))
    gm = profiles.capture(model, kwargs or args)
    actual = graph_fingerprint(gm, flat_placeholder_values(gm, args, kwargs))
    if actual != plan.fingerprint:
        raise PlanMismatchError(
            f"This plan was made for {plan.model_name} with fingerprint {plan.fingerprint}, "
            f"but {type(model).__name__} with the planned input shapes has fingerprint "
            f"{actual}: the architecture, parameter shapes, dtypes or input shapes differ. "
            "Run planner.optimize() on this model and these inputs.")
    planned = rewrite(gm, plan.profile, plan.schedule)
    planned.meta["planner"]["plan_fingerprint"] = plan.fingerprint
    return planned


@dataclass(frozen=True)
class VerifyReport:
    """Measured against predicted, for one training step."""

    device: str
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    unplanned_peak_bytes: int
    step_ms: float
    unplanned_step_ms: float
    losses_equal: bool
    grads_equal: bool

    @property
    def peak_error(self) -> float:
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def within_budget(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def overhead(self) -> float:
        return self.step_ms / self.unplanned_step_ms - 1.0

    def summary(self) -> str:
        return (f"measured peak {self.measured_peak_bytes / GIB:.3f} GiB vs predicted "
                f"{self.predicted_peak_bytes / GIB:.3f} GiB ({100 * self.peak_error:+.2f} %), "
                f"budget {self.budget_bytes / GIB:.3f} GiB "
                f"({'met' if self.within_budget else 'EXCEEDED'}); unplanned "
                f"{self.unplanned_peak_bytes / GIB:.3f} GiB; step {self.step_ms:.1f} ms vs "
                f"{self.unplanned_step_ms:.1f} ms ({100 * self.overhead:+.1f} %); losses "
                f"{'equal' if self.losses_equal else 'DIFFER'}, gradients "
                f"{'bit-identical' if self.grads_equal else 'DIFFER'}")


def measure_step(module: nn.Module, args: tuple, kwargs: dict,
                 loss_fn: Callable[[Any], torch.Tensor]) -> tuple[int, torch.Tensor, dict]:
    """Peak allocated bytes of one training step (CUDA allocator or MemTracker), the loss
    and the gradients. Gradients are cleared afterwards."""
    device = _model_device(module)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = loss_fn(module(*args, **kwargs))
        loss.backward()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(module, *[t for t in [*args, *kwargs.values()]
                                         if isinstance(t, torch.Tensor)])
        with tracker:
            loss = loss_fn(module(*args, **kwargs))
            loss.backward()
        peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()
             if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return peak, loss.detach(), grads


def _time_step(module: nn.Module, args: tuple, kwargs: dict,
               loss_fn: Callable[[Any], torch.Tensor], repeats: int) -> float:
    device = _model_device(module)
    samples = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        loss_fn(module(*args, **kwargs)).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            samples.append((time.perf_counter() - begin) * 1e3)
        module.zero_grad(set_to_none=True)
    return statistics.median(samples)


def verify(model: nn.Module, plan: Plan, example_inputs: Any = None,
           loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
           repeats: int = 3) -> VerifyReport:
    """Run one step of the planned and the unplanned model; compare with the plan.

    Model state (parameters, buffers such as BatchNorm statistics, RNG) is restored after
    the unplanned step, so both steps start from the same state.
    """
    args, kwargs = normalize_inputs(model, example_inputs)
    loss_fn = loss_fn or profiles.default_loss
    planned = apply(model, plan)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    _, base_loss, base_grads = measure_step(model, args, kwargs, loss_fn)
    model.load_state_dict(state)
    torch.set_rng_state(rng)
    peak, loss, grads = measure_step(planned, args, kwargs, loss_fn)
    unplanned_ms = _time_step(model, args, kwargs, loss_fn, repeats)
    step_ms = _time_step(planned, args, kwargs, loss_fn, repeats)
    model.load_state_dict(state)
    device = _model_device(model)
    return VerifyReport(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        budget_bytes=plan.budget_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_peak_bytes=peak,
        unplanned_peak_bytes=plan.unplanned_peak_bytes,
        step_ms=step_ms,
        unplanned_step_ms=unplanned_ms,
        losses_equal=bool(torch.equal(loss, base_loss)),
        grads_equal=base_grads.keys() == grads.keys()
        and all(torch.equal(base_grads[k], grads[k]) for k in grads),
    )
