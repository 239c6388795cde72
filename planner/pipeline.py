"""The peak of a pipeline stage: its module's step profiled for one microbatch, replayed in
the order its schedule runs the microbatches (:mod:`solvers.pipeline`).

A stage that is not the last has no loss: its backward starts from the gradient the next
stage sends. Its step is profiled with :class:`_ReceivedGradient` as the loss, whose
backward hands the output a gradient made before the step, as the stage's receive buffer
is (no allocation of its own, as in the pipeline).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from planner.profiling import profile_model
from profiles.inputs import normalize_inputs
from solvers.pipeline import StageBoundary, StageSpec, held_after_forward, stage_peak
from solvers.problem import Problem
from solvers.schedule import Schedule
from solvers.simulate import simulate

__all__ = ["stage_loss", "stage_peak_bytes"]


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
               loss_fn: Callable[[Any], torch.Tensor] | None = None
               ) -> Callable[[Any], torch.Tensor]:
    """The loss to profile (or plan) a stage's step with: ``loss_fn`` on the last stage,
    elsewhere the gradient the next stage sends (made here, once, in the output's shape)."""
    return _stage_loss(module, microbatch, spec, loss_fn)[0]


def _stage_loss(module: nn.Module, microbatch: Any, spec: StageSpec,
                loss_fn: Callable[[Any], torch.Tensor] | None
                ) -> tuple[Callable[[Any], torch.Tensor], int, int]:
    """`stage_loss`, the bytes of one microbatch's output and of its loss."""
    args, kwargs = normalize_inputs(module, microbatch)
    with torch.no_grad():
        received = torch.zeros_like(module(*args, **kwargs))  # the output's shape
    if spec.last:
        if loss_fn is None:
            raise ValueError("the last stage computes the loss: pass loss_fn")
        with torch.no_grad():
            loss_bytes = _bytes(loss_fn(received))
        return loss_fn, _bytes(received), loss_bytes
    return (lambda output: _ReceivedGradient.apply(output, received)), _bytes(received), 0


def stage_peak_bytes(module: nn.Module, microbatch: Any, spec: StageSpec, *,
                     loss_fn: Callable[[Any], torch.Tensor] | None = None,
                     target_bytes: int = 0, schedule: Schedule | None = None,
                     **profile_options: Any) -> int:
    """The peak of stage ``spec.stage_index`` over one step of ``spec``'s schedule, with
    ``schedule`` (default: nothing checkpointed) on ``module``; ``microbatch`` is one
    microbatch of the stage's input (on a stage after the first, a tensor that requires
    grad, as the received activation does). The last stage's ``loss_fn(output)`` computes
    its loss, reading a target of ``target_bytes`` per microbatch."""
    args, kwargs = normalize_inputs(module, microbatch)
    loss, output_bytes, loss_bytes = _stage_loss(module, microbatch, spec, loss_fn)
    timelines, problems = [], []
    for grads_allocated in (False, True):
        step = profile_model(module, microbatch, loss_fn=loss, progress=False,
                             grad_accumulation=grads_allocated, **profile_options)
        problem = step.problem() if spec.last else _received_gradient_apart(step.problem())
        chosen = schedule or Schedule.store_all(problem.n_nodes)
        problems.append(problem)
        timelines.append(simulate(problem, chosen))
    nodes = step.profile.nodes
    # the stage's output: what the received gradient's "loss" reads (its last op)
    output = set() if spec.last else set(next(
        n for n in reversed(nodes) if n.read_storages).read_storages)
    boundary = StageBoundary(
        held_bytes=held_after_forward(timelines[0], problems[0].static_bytes),
        input_bytes=_bytes((args, kwargs)),
        output_bytes=output_bytes,
        target_bytes=target_bytes, loss_bytes=loss_bytes,
        output_in_timeline=any(output & set(n.saved_storages) for n in nodes))
    return stage_peak(spec, timelines[0], timelines[1], boundary)

