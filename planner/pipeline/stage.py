"""The peak of a pipeline stage: its module's step profiled for one microbatch, replayed in
the order its schedule runs the microbatches (:mod:`solvers.pipeline`).

A stage that is not the last has no loss: its backward starts from the gradient the next
stage sends. Its step is profiled with :class:`_ReceivedGradient` as the loss, whose
backward hands the output a gradient made before the step, as the stage's receive buffer
is (no allocation of its own, as in the pipeline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from planner.arguments import MAX_BUDGET_BYTES, MIN_BUDGET_BYTES
from planner.pipeline.split_backward import measure_split_backward
from planner.plan import GIB, InfeasibleBudgetError, PipelineStage, Plan, format_bytes
from planner.profiling import profile_model
from planner.solving import solve
from profiles.inputs import normalize_inputs
from solvers.pipeline import ChunkReplay, StageBoundary, StageSpec, held_after_forward, rank_peak
from solvers.problem import Problem
from solvers.schedule import Schedule
from solvers.simulate import simulate

__all__ = ["StageSteps", "checked_target_bytes", "plan_stage", "stage_loss", "stage_peak_bytes",
           "stage_spec"]


class _ReceivedGradient(torch.autograd.Function):
    """A scalar "loss" whose backward gives ``output`` the gradient ``received``."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        ctx.received = received
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.received, None


def _received_gradient_apart(problem: Problem) -> Problem:
    """The step with its output's gradient made by nobody: it is the stage's receive
    buffer, which the stage's replay counts for every microbatch."""
    reader = max(i for i in range(problem.n_nodes) if problem.node_inputs[i])
    grads = list(problem.storage_grad_bytes)
    for storage in problem.node_inputs[reader]:
        grads[storage] = 0
    return Problem.model_validate({**problem.model_dump(), "storage_grad_bytes": grads})


def _bytes(tree: Any) -> int:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return sum(t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor))


def stage_loss(module: nn.Module, microbatch: Any, spec: StageSpec,
               loss_fn: Callable[[Any], torch.Tensor] | None = None, chunk: int = 0
               ) -> Callable[[Any], torch.Tensor]:
    """The loss to profile (or plan) a stage's step (the rank's ``chunk``) with:
    ``loss_fn`` on the pipeline's last stage, elsewhere the gradient the next stage sends
    (made here, once, in the output's shape)."""
    return _stage_loss(module, microbatch, spec.chunk_last(chunk), loss_fn)[0]


def _stage_loss(module: nn.Module, microbatch: Any, last: bool,
                loss_fn: Callable[[Any], torch.Tensor] | None
                ) -> tuple[Callable[[Any], torch.Tensor], int, int, torch.Tensor | None]:
    """`stage_loss`, the bytes of one microbatch's output and of its loss, and (not on the
    last stage) the gradient the next stage sends."""
    args, kwargs = normalize_inputs(module, microbatch)
    with torch.no_grad():
        received = torch.zeros_like(module(*args, **kwargs))  # the output's shape
    if last:
        if loss_fn is None:
            raise ValueError("the last stage computes the loss: pass loss_fn")
        with torch.no_grad():
            loss_bytes = _bytes(loss_fn(received))
        return loss_fn, _bytes(received), loss_bytes, None
    return ((lambda output: _ReceivedGradient.apply(output, received)), _bytes(received), 0,
            received)


def checked_target_bytes(value: Any) -> int:
    """The last stage's loss target per microbatch in bytes (``labels.nbytes``), checked:
    a whole number of bytes, at least 0 (a negative one would lower every predicted
    stage peak)."""
    if isinstance(value, bool) or not isinstance(value, int) or not \
            0 <= value <= MAX_BUDGET_BYTES:
        raise ValueError(f"target_bytes is the bytes of the last stage's loss target per "
                         f"microbatch (e.g. labels.nbytes): a whole number from 0 to "
                         f"{MAX_BUDGET_BYTES}, not {value!r}")
    return value


class StageSteps:
    """A stage's step for one microbatch (the rank's ``chunk`` under an interleaved
    schedule), profiled twice: before the stage's first backward (no parameter gradients
    yet) and after it (gradients allocated)."""

    def __init__(self, module: nn.Module, microbatch: Any, spec: StageSpec,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, target_bytes: int = 0,
                 chunk: int = 0, **profile_options: Any) -> None:
        target_bytes = checked_target_bytes(target_bytes)
        last = spec.chunk_last(chunk)
        loss, output_bytes, loss_bytes, received = _stage_loss(module, microbatch, last, loss_fn)
        self.spec, self.chunk = spec, chunk
        # a stage's plan is for the routing it profiled: its two steps are not bounded
        # over routings (solvers.routing) and the note says so
        options = {"progress": False, "bound_routing": False, **profile_options}
        self.steps = [profile_model(module, microbatch, loss_fn=loss,
                                    grad_accumulation=allocated, **options)
                      for allocated in (False, True)]
        self.problems = [step.problem() if last else
                         _received_gradient_apart(step.problem()) for step in self.steps]
        nodes = self.steps[0].profile.nodes
        # the stage's output: what the received gradient's "loss" reads (its last op)
        output = set() if last else set(next(
            n for n in reversed(nodes) if n.read_storages).read_storages)
        self.boundary = StageBoundary(
            held_bytes=0, input_bytes=self.steps[0].profile.static.input_bytes,
            output_bytes=output_bytes,
            target_bytes=target_bytes, loss_bytes=loss_bytes,
            output_in_timeline=any(output & set(n.saved_storages) for n in nodes))
        self.split = None
        if spec.splits_backward and not spec.chunk_first(chunk):
            self.split = measure_split_backward(
                module, *normalize_inputs(module, microbatch), loss_fn=loss_fn,
                received=received, keeps_output=last and spec.return_outputs,
                autocast=profile_options.get("autocast"), device=self.steps[0].profile.device)

    @property
    def plannable(self) -> bool:
        """Whether a plan may checkpoint or offload the stage: not under a split backward,
        except on the pipeline's first stage, which runs its backward whole."""
        return self.split is None

    def replay(self, schedule: Schedule | None = None) -> ChunkReplay:
        """The stage's timelines with ``schedule`` (default: no checkpoint), for the replay."""
        if schedule is not None and not self.plannable and \
                schedule != Schedule.store_all(self.problems[0].n_nodes):
            raise ValueError(
                f"{self.spec.schedule} splits the backward of stage "
                f"{self.spec.chunk_stage(self.chunk)}: it runs as profiled, nothing "
                "checkpointed (torch reruns a checkpointed region once more per parameter "
                "group in the weights' pass)")
        before, after = (simulate(p, schedule or Schedule.store_all(p.n_nodes))
                         for p in self.problems)
        held = held_after_forward(before, self.problems[0].static_bytes)
        return ChunkReplay(before, after, self.boundary._replace(held_bytes=held),
                           self.problems[0].static_bytes, self.problems[1].static_bytes,
                           self.split)

    def peak(self, schedule: Schedule | None = None) -> int:
        """The stage's peak over one step with ``schedule`` (default: no checkpoint)."""
        return rank_peak(self.spec, [self.replay(schedule)])

    def plan(self, budget_bytes: int, time_limit_s: float = 60.0, solver: str = "auto", *,
             deterministic: bool = False) -> tuple[Plan, int]:
        """:func:`plan_stage` on these steps (profiled once, planned at many budgets)."""
        return _plan_stage_steps(self, budget_bytes, time_limit_s, solver, deterministic)


def stage_peak_bytes(module: nn.Module, microbatch: Any, spec: StageSpec, *,
                     loss_fn: Callable[[Any], torch.Tensor] | None = None,
                     target_bytes: int = 0, schedule: Schedule | None = None,
                     **profile_options: Any) -> int:
    """The peak of stage ``spec.stage_index`` over one step of ``spec``'s schedule, with
    ``schedule`` (default: nothing checkpointed) on ``module``; ``microbatch`` is one
    microbatch of the stage's input (on a stage after the first, a tensor that requires
    grad, as the received activation does). The last stage's ``loss_fn(output)`` computes
    its loss, reading a target of ``target_bytes`` per microbatch."""
    return StageSteps(module, microbatch, spec, loss_fn, target_bytes,
                      **profile_options).peak(schedule)


def stage_spec(pipeline: StageSpec | dict[str, Any]) -> tuple[StageSpec, int]:
    """``optimize``'s ``pipeline=``: a :class:`StageSpec` or its fields as a dict (torch's
    names), with the last stage's ``target_bytes`` per microbatch; returns both."""
    if isinstance(pipeline, StageSpec):
        return pipeline, 0
    if not isinstance(pipeline, dict):
        raise TypeError(f"pipeline= takes a dict of schedule, stage_index, num_stages, "
                        f"n_microbatches (and target_bytes), not {type(pipeline).__name__}")
    fields = dict(pipeline)
    target_bytes = checked_target_bytes(fields.pop("target_bytes", 0))
    return StageSpec.model_validate(fields), target_bytes


BISECTIONS = 8  # of the one-microbatch budget, each solve with its share of the time left
PRECISION = 128  # the bisection stops within 1/PRECISION of the stage's budget
LOWEST_SHARE = 0.4  # of the time left, for the lowest-peak plan


def plan_stage(module: nn.Module, microbatch: Any, spec: StageSpec, *, budget_gb: float,
               loss_fn: Callable[[Any], torch.Tensor] | None = None, target_bytes: int = 0,
               time_limit_s: float = 60.0, deterministic: bool = False,
               **profile_options: Any) -> tuple[Plan, int]:
    """A plan of the stage's step whose peak over one step of ``spec``'s schedule (every
    microbatch it holds) is within ``budget_gb``; returns it and that peak. Arguments as
    :func:`stage_peak_bytes`; ``deterministic`` as :func:`planner.optimize`'s (each
    solve's share of the limit is then counted, not timed).

    The plan is one microbatch's, made for steps that start with gradients allocated (as
    they are from the stage's first backward on): the least recompute at the largest
    one-microbatch budget whose plan fits the stage, found by bisection to within
    1/``PRECISION`` of the stage's budget. Each plan is
    optimal for its budget as the solver says; the stage objective itself is not proven.

    Raises:
        InfeasibleBudgetError: no plan tried fits; ``min_budget_bytes`` is the least stage
            peak of those tried, ``plan`` the plan that peaks there.
    """
    steps = StageSteps(module, microbatch, spec, loss_fn, target_bytes, **profile_options)
    return steps.plan(int(budget_gb * GIB), time_limit_s, deterministic=deterministic)


class _Limit:
    """The seconds left of a stage's time limit: measured, or, for a deterministic plan,
    the limit less the shares handed out (a clock would give a loaded machine fewer
    seconds per solve, so another plan)."""

    def __init__(self, seconds: float, deterministic: bool) -> None:
        self.deterministic, self.given = deterministic, 0.0
        self.end = seconds if deterministic else time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - (self.given if self.deterministic else time.perf_counter())

    def give(self, seconds: float) -> float:
        self.given += seconds
        return seconds


def _plan_stage_steps(steps: StageSteps, budget: int, time_limit_s: float,
                      solver: str = "auto", deterministic: bool = False) -> tuple[Plan, int]:
    """`plan_stage` on a stage's profiled steps, at ``budget`` bytes."""
    spec = steps.spec
    if not steps.plannable:
        return _unplanned_stage(steps, budget, time_limit_s, solver, deterministic)
    clock = _Limit(time_limit_s, deterministic)

    def attempt(one: int, limit: float) -> tuple[Plan, int, int]:
        """The plan at one microbatch's budget ``one`` (or, where none fits ``one``, the
        lowest-peak plan), its stage peak, and the least one-microbatch budget known to
        fit (``one``, or the minimum the error named)."""
        search = dict(time_limit_s=limit, solver=solver, deterministic=deterministic)
        try:
            plan = solve(steps.steps[1], budget_bytes=one, **search)
        except InfeasibleBudgetError as error:
            plan = error.plan or solve(steps.steps[1], budget_bytes=error.min_budget_bytes,
                                       **search)
            return plan, steps.peak(plan.schedule), error.min_budget_bytes
        return plan, steps.peak(plan.schedule if plan.checkpointing else None), one

    best: tuple[Plan, int] | None = None
    least: tuple[Plan, int] | None = None
    low, high = 0, budget + 1  # one-microbatch budgets: below high, the stage may fit
    for tries in range(BISECTIONS):
        # the budget first; then, where its plan does not fit the stage, the lowest-peak
        # plan, whose search gets LOWEST_SHARE of the time left (the floor of the
        # bisection: a 4-layer Llama stage at 10 GiB fits when that search has 8 s, not
        # 2); then halves between. A try that ends early leaves its time to the next
        left = clock.left()
        lowest = tries == 1 and low == 0
        one = budget if tries == 0 else MIN_BUDGET_BYTES if lowest else (low + high) // 2
        limit = max(0.05, LOWEST_SHARE * left if lowest else left / (BISECTIONS - tries))
        plan, peak, fits_from = attempt(one, clock.give(limit))
        at_one = fits_from <= one
        if least is None or peak < least[1]:
            least = (plan, peak)
        if peak <= budget and (at_one or best is None):
            best = (plan, peak)
        if not at_one and tries == 0:
            break  # one microbatch alone does not fit the stage's budget
        if at_one and peak > budget:
            # every budget from the plan's own peak up to ``one`` has the same optimum
            high = min(one, plan.predicted_peak_bytes)
        else:  # a fit, or a budget too small for one microbatch: go higher (below the
            low = max(one, fits_from - 1)  # minimum the error named, nothing fits)
        if high - low <= max(1, budget // PRECISION):
            break
    if best is None:
        raise InfeasibleBudgetError(
            f"No plan of this pipeline stage ({spec.schedule}, stage {spec.stage_index} of "
            f"{spec.num_stages}, {spec.in_flight()} of {spec.n_microbatches} microbatches in "
            f"flight) fits {format_bytes(budget)}; the least stage peak found is "
            f"{format_bytes(least[1])} (error.plan).", least[1], plan=least[0])
    plan, peak = best
    stage = PipelineStage(spec=spec, budget_bytes=budget, peak_bytes=peak)
    return plan.model_copy(update={"pipeline": stage}), peak


def _unplanned_stage(steps: StageSteps, budget: int, time_limit_s: float,
                     solver: str, deterministic: bool = False) -> tuple[Plan, int]:
    """A stage whose backward the schedule splits runs as profiled: its plan checkpoints
    nothing, and the budget holds it or names its peak."""
    spec = steps.spec
    plan = solve(steps.steps[1], budget_bytes=MAX_BUDGET_BYTES, time_limit_s=time_limit_s,
                 solver=solver, deterministic=deterministic)
    peak = steps.peak()
    if peak > budget:
        raise InfeasibleBudgetError(
            f"Pipeline stage {spec.stage_index} of {spec.num_stages} ({spec.schedule}, "
            f"{spec.in_flight()} of {spec.n_microbatches} microbatches in flight) peaks at "
            f"{format_bytes(peak)} and its budget is {format_bytes(budget)}: under a split "
            "backward a stage after the first is not checkpointed (torch reruns a "
            "checkpointed region once more per parameter group in the weights' pass, and "
            "keeps what the reruns make until it ends), so its peak is the least. Give it "
            "that budget, fewer microbatches in flight, or fewer layers.", peak, plan=plan)
    stage = PipelineStage(spec=spec, budget_bytes=budget, peak_bytes=peak)
    return plan.model_copy(update={"pipeline": stage}), peak
