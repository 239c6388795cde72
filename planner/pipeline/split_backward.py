"""What torch's split backward does to a pipeline stage's memory, measured against its full
backward (:class:`solvers.pipeline.SplitBackward`).

Zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``) run a stage's backward as two passes
(``torch.distributed.pipelining._backward``): the input's gradient
(``stage_backward_input``: ``autograd.grad`` with ``retain_graph=True``, every saved tensor
kept, the gradient reaching each parameter's node captured by a hook) and later the
weights' (``stage_backward_weight``, one ``autograd.grad`` per parameter group from the
captured gradients). Between the two a microbatch holds what its forward saved and the
captured gradients. The first stage skips the input's pass and runs the full backward as
the weights' (``PipelineStage.backward_weight_one_chunk``).

Those passes are not op-by-op replays: each is run once on the stage's module, as torch
runs it, beside a full backward of the same microbatch, and the differences are what the
stage's replay adds to the full backward's timeline. They hold for the step as profiled,
nothing checkpointed: under a split backward torch reruns a checkpointed region once more
per parameter group (``tests/test_pipeline_split_backward.py``), so a stage after the
first runs as profiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.pipelining._backward import (
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)

from planner.measure import PeakTracker
from planner.model_state import _training_config, _training_mode
from planner.runtime.install import _plan_suspended
from profiles.devices import DeviceSpec, device_spec
from profiles.kernels import FusedKernels
from profiles.swap import swapped_tensors
from solvers.pipeline import SplitBackward

__all__ = ["measure_split_backward"]

LossFn = Callable[[Any], torch.Tensor]


def measure_split_backward(module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], *,
                           loss_fn: LossFn | None = None, received: torch.Tensor | None = None,
                           keeps_output: bool = False, autocast: torch.dtype | None = None,
                           device: str | DeviceSpec | None = None) -> SplitBackward:
    """The split backward of one microbatch, before the stage's first backward (no
    parameter gradients) and after it, against its full backward. The last stage's
    backward starts from ``loss_fn(output)``, another's from the gradient ``received`` for
    its output. ``keeps_output``: the stage keeps its output to the step's end (the last
    stage's ``output_chunks``), and with it the autograd graph where the output is a view
    (torch detaches it only otherwise). ``autocast``: the step runs under
    ``torch.autocast`` of that dtype, as the profile's. On the meta device it measures
    without memory, running the fused kernels that ``device`` (the profile's target)
    selects, as the profile does (``profiles.kernels``). It runs the training step as the
    profile does (``train()`` mode, no plan installed, copies of the buffers); the module,
    its gradients, the inputs' and the random state are as they were.

    Raises:
        ValueError: the stage returns a view, which torch's input pass cannot detach (the
            pipeline would fail the same way).
    """
    params = list(module.parameters())
    kept = [p.grad for p in params]
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    kept_inputs = [t.grad for t in inputs]
    buffers = {k: b.clone() for k, b in module.named_buffers(remove_duplicate=False)}
    try:
        step = _Step(module, args, kwargs, loss_fn, received, inputs, keeps_output, autocast)
        # the training step as profiled: no plan installed, train() mode, no key/value
        # cache, and copies of the buffers (BatchNorm's statistics are the model's)
        with _plan_suspended(module), _training_mode(module), _training_config(module), \
                swapped_tensors(module, buffers), _kernels(step, device):
            split0, split1 = (_passes(step, allocated, split=True) for allocated in (False, True))
            full1 = _passes(step, allocated=True, split=False)
    finally:
        for p, grad in zip(params, kept, strict=True):
            p.grad = grad
        for t, grad in zip(inputs, kept_inputs, strict=True):
            t.grad = grad
    return SplitBackward(input_rise=(split0.peak - split0.after_forward,
                                     split1.peak - split1.after_forward),
                         held=split1.after - split1.sent - split1.after_forward,
                         weight_rise=(split0.weight_peak - split0.after,
                                      split1.weight_peak - split1.after),
                         finished=split1.end - split1.sent - (full1.end - full1.sent))


def _input_pass(tensors: list[torch.Tensor], grads: list[torch.Tensor] | None,
                inputs: list[torch.Tensor], module: nn.Module) -> list[dict[str, Any]]:
    """torch's input pass; its parameter groups, for the weights' pass."""
    try:
        return stage_backward_input(tensors, grads, inputs, module.parameters())[1]
    except RuntimeError as error:
        if "detach views in-place" not in str(error.__cause__):
            raise
        raise ValueError(
            f"{type(module).__name__} returns a view: a zero-bubble schedule's input pass "
            "detaches a stage's output in place (torch.distributed.pipelining's "
            "stage_backward_input), which torch cannot do to a view, so the pipeline would "
            "fail. Return a tensor of its own (e.g. output.clone()).") from error


def _kernels(step: _Step, device: str | DeviceSpec | None) -> contextlib.AbstractContextManager:
    """On the meta device, the fused kernels the profile's target device selects; real
    tensors run their own."""
    tensors = [*step.module.parameters(), *step.inputs]
    if device is None or not any(t.device.type == "meta" for t in tensors):
        return contextlib.nullcontext()
    return FusedKernels(device_spec(device))


class _Passes(NamedTuple):
    """One microbatch's step: live bytes after the forward, the backward's peak (split: the
    input pass's) and live bytes after it; split, the weights' pass's peak; live bytes at
    the end, the output held or not as the stage holds it; and the bytes of the input's
    gradient, the stage's to send (the replay counts it apart), at the end."""

    after_forward: int
    peak: int
    after: int
    weight_peak: int
    end: int
    sent: int


class _Step(NamedTuple):
    """The stage's step to measure: its module and one microbatch, what its backward
    starts from (the last stage's loss, or the gradient received), and how it runs."""

    module: nn.Module
    args: Sequence[Any]
    kwargs: dict[str, Any]
    loss_fn: LossFn | None
    received: torch.Tensor | None
    inputs: list[torch.Tensor]
    keeps_output: bool
    autocast: torch.dtype | None

    def forward(self) -> tuple[Any, list[torch.Tensor], list[torch.Tensor] | None]:
        """The output, and the tensors the backward starts from with their gradients."""
        device = next(iter(self.module.parameters()), torch.empty(0)).device.type
        with torch.autocast(device, self.autocast) if self.autocast is not None else \
                contextlib.nullcontext():
            output = self.module(*self.args, **self.kwargs)
            loss = self.loss_fn(output) if self.loss_fn is not None else None
        return (output, [loss], None) if loss is not None else \
            (output, [output], [self.received])


def _passes(step: _Step, allocated: bool, split: bool) -> _Passes:
    """One microbatch's step, the parameters' gradients ``allocated`` or not, its backward
    full or split as torch's stage runs it (``PipelineStage.backward_one_chunk``)."""
    module, inputs, keeps_output = step.module, step.inputs, step.keeps_output
    for t in inputs:
        t.grad = None
    for p in module.parameters():
        p.grad = torch.zeros_like(p) if allocated else None
    static = [*module.parameters(), *(p.grad for p in module.parameters()
                                      if p.grad is not None), *inputs]
    static += [step.received] if step.received is not None else []
    devices = [t.device for t in static if t.device.type == "cuda"][:1]
    with torch.random.fork_rng(devices=devices), PeakTracker(static) as tracker:
        output, tensors, grads = step.forward()
        after_forward = tracker.live_bytes
        tracker.peak_bytes = after_forward
        if split:
            groups = _input_pass(tensors, grads, inputs, module)
        else:  # the last stage's loss is one tensor, with no gradient given
            stage_backward(tensors[0] if grads is None else tensors, grads, inputs)
        peak, after = tracker.peak_bytes, tracker.live_bytes
        if keeps_output:  # the last stage detaches its output unless it is a view
            for t in torch.utils._pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and not t._is_view():
                    t.detach_()
        tracker.peak_bytes = after
        if split:
            stage_backward_weight(module.parameters(), groups)
            del groups
        weight_peak = tracker.peak_bytes
        del tensors, grads
        if not keeps_output:
            del output
        sent = sum(t.grad.untyped_storage().nbytes() for t in inputs if t.grad is not None)
        return _Passes(after_forward, peak, after, weight_peak, tracker.live_bytes, sent)
