"""A compiled training step's peak counted on fake tensors, without running it.

:class:`FakeCompiledStep` takes what :class:`planner.compiled_step.CompiledStep` takes and
counts the same peak (the step's parameters, buffers, gradients, inputs and loss target,
and the most its ops and compiled graphs hold above them) on a fake twin of the model: the
plan applied to the twin, the twin compiled as training compiles it (whole or per block,
under the partitioner's fraction), inductor compiling each graph for real and its generated
code run with the kernels stubbed (:func:`profiles.compiled_memory.inductor_on_fake`).
Nothing is computed, so a schedule is counted whether or not it fits the device, and the
model's own tensors are not touched.

Each batch's step is counted as the measure measures it: the compiling step's own peak,
what it leaves (and what a cycle collection after it does not free), and the next step,
set together by the same rule (:func:`planner.compiled_step.training_peaks`). What it does
not count (the measured step does): a kernel's own temporaries (a CPU convolution's
scratch). Given a device's roofline (``spec``), the step on the example inputs is also
timed from the kernels its generated code calls (:mod:`profiles.compiled_time`):
``step_ms`` predicted, where the measure times it; without one ``step_ms`` is None.
``benchmarks/compiled_fake.py`` sets the count and the time beside the measure.
"""

from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from planner.compiled_step import (
    Batch,
    CompiledMeasure,
    SteppedBatch,
    _recompile_limit_hits,
    compiled,
    step_batches,
    training_peaks,
)
from planner.measure import garbage_kept, storages_bytes
from planner.model_state import _model_device
from planner.plan import Plan, PlanMismatchWarning
from planner.runtime.applying import apply
from planner.runtime.compile_garbage import frames_traced
from planner.runtime.install import _plan_suspended
from planner.runtime.partitioner import partitioner_budget_set
from planner.verification import _autocast, bound_tensors, step_residents
from profiles.compiled_memory import CountingFakeMode, inductor_on_fake
from profiles.compiled_time import KernelClock
from profiles.devices import DeviceSpec
from profiles.host_roofline import HOST
from profiles.step import GradLayout

__all__ = ["FakeCompiledStep"]


class FakeCompiledStep:
    """One training step of ``model`` compiled ``mode``, counted on fake tensors:
    ``peak_bytes(plan)`` with ``plan`` applied (``None``: without a plan), each of
    ``batches`` stepped once (compiling where its shape is new), then counted; with a
    ``spec``, the step on ``args`` and ``kwargs`` timed on its roofline (this host's, from
    :func:`profiles.host_roofline.host_roofline`: its compute ops timed here too)."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict,
                 loss_fn: Callable[[Any], torch.Tensor], mode: str, blocks: list[str], *,
                 autocast_dtype: str | None = None, grads_at_start: bool = False,
                 grads_in_forward: bool = False, batches: list[Batch] | None = None,
                 garbage_collected: bool = False, spec: DeviceSpec | None = None) -> None:
        if grads_at_start and grads_in_forward:
            raise ValueError("FakeCompiledStep: a step either adds into the .grad it starts "
                             "with (grads_at_start) or frees them after its forward "
                             "(grads_in_forward), not both")
        self.batches = step_batches(model, mode, blocks, args, kwargs, batches)
        self.timed = Batch("", args, kwargs)
        self.spec = spec
        self.model, self.loss_fn, self.mode, self.blocks = model, loss_fn, mode, blocks
        self.autocast_dtype, self.grads_at_start = autocast_dtype, grads_at_start
        self.grads_in_forward = grads_in_forward
        self.recompile_limit_hit: int | None = None  # as `CompiledStep`'s
        self.garbage_collected = garbage_collected  # training_peaks's
        # the last timed step's ms by kind (fused kernels, aten ops, graph calls)
        self.step_ms_by_kind: dict[str, float] = {}

    @property
    def measure(self) -> str:
        """What counts the peak (and predicts the time), in words."""
        counted = "fake tensors, inductor's generated code run with its kernels stubbed"
        return counted if self.spec is None else \
            f"{counted}; time predicted from its kernels on {self.spec.name}"

    def peak_bytes(self, plan: Plan | None) -> int:
        return self.run(plan).peak_bytes

    def run(self, plan: Plan | None, partitioner_budget: float | None = None
            ) -> CompiledMeasure:
        """The step with ``plan`` compiled under ``partitioner_budget`` (None: the one
        ``plan`` sets, else the process's), counted on each batch."""
        fake = CountingFakeMode(None if self.spec is None else KernelClock(
            self.spec, on_host=self.spec.name == HOST and _model_device(self.model).type
            == "cpu"))
        twin = self._twin(fake, plan)
        with partitioner_budget_set(partitioner_budget), garbage_kept(), \
                compiled(twin, self.mode, self.blocks, backend=inductor_on_fake(fake)), \
                warnings.catch_warnings():
            # a candidate is an eager plan, compiled here on purpose: its guard says so
            warnings.simplefilter("ignore", PlanMismatchWarning)
            steps, step_ms = [], None
            for batch in self.batches:
                steps.append(self._counted(twin, fake, batch))
                if batch.args is self.timed.args and batch.kwargs is self.timed.kwargs:
                    step_ms, self.step_ms_by_kind = self._step_ms, self._by_kind
            if self.spec is not None and step_ms is None:  # the timed batch is not a batch
                self._counted(twin, fake, self.timed)
                step_ms, self.step_ms_by_kind = self._step_ms, self._by_kind
        peaks = training_peaks(steps, self.garbage_collected)
        return CompiledMeasure(max(peaks), step_ms if self.spec is not None else None, peaks)

    def _twin(self, fake: CountingFakeMode, plan: Plan | None) -> nn.Module:
        """A copy of the model on fake tensors (any plan of its own left out), ``plan``
        applied to it."""
        from torch._subclasses.fake_tensor import FakeCopyMode

        with _plan_suspended(self.model), FakeCopyMode(fake.mode):
            twin = copy.deepcopy(self.model)
        twin.train(self.model.training)
        if plan is not None:
            apply(twin, plan)
        return twin

    def _counted(self, twin: nn.Module, fake: CountingFakeMode, batch: Batch) -> SteppedBatch:
        """``batch`` stepped as :meth:`CompiledStep._measured` steps it: once, compiling
        where its shape is new (a step of training too), then counted from the state the
        model was given in."""
        to_fake = fake.mode.from_tensor
        args, kwargs = tree_map(lambda v: to_fake(v) if isinstance(v, torch.Tensor) else v,
                                (batch.args, batch.kwargs))
        target = bound_tensors(self.loss_fn)  # a loss target: fake mode makes its twin
        twin.zero_grad(set_to_none=True)
        hits, frames = _recompile_limit_hits(), frames_traced()
        compiling_peak, left, kept = self._one_step(twin, fake, args, kwargs, target,
                                                    lambda: frames_traced() > frames)
        compiled_now = frames_traced() > frames
        if _recompile_limit_hits() > hits:
            self.recompile_limit_hit = torch._dynamo.config.recompile_limit
        # in Lightning's order, the counted step starts with the gradients the one before
        # it left (as `measure_step`'s, the compiling step with none: training's first)
        last = self._last if self.grads_in_forward else None
        peak, _, _ = self._one_step(twin, fake, args, kwargs, target, lambda: False, last)
        return SteppedBatch(compiled_now, compiling_peak, left, kept, peak)

    def _one_step(self, twin: nn.Module, fake: CountingFakeMode, args: tuple, kwargs: dict,
                  target: list[torch.Tensor], collect: Callable[[], bool],
                  last: GradLayout | None = None) -> tuple[int, int, int]:
        """One step counted: its peak above nothing (the resident tensors and the fake twin
        of the loss's ``target`` included; the real target is not counted again), what it
        leaves alive besides them once its gradients are dropped (or zeroed, where a step
        starts with them: ``grads_at_start``), and what of that is left after a cycle
        collection, where ``collect()`` says to run one. ``last``: the gradients the step
        starts with and frees after its forward (Lightning's order), allocated in it."""
        resident = [*step_residents(twin, args, kwargs), *map(fake.mode.from_tensor, target)]
        with fake.counting([*resident, *target]):
            self._step(twin, args, kwargs, last)
            # the step's time: its forward, loss and backward, as `CompiledStep` times it
            self._step_ms = fake.clock.ms if fake.clock is not None else None
            self._by_kind = dict(fake.clock.by_kind) if fake.clock is not None else {}
            self._last = GradLayout.of(dict(twin.named_parameters(remove_duplicate=False)))
            grads = [p.grad for p in twin.parameters() if p.grad is not None] \
                if self.grads_at_start else []
            for grad in grads:
                grad.zero_()
            if not self.grads_at_start:
                twin.zero_grad(set_to_none=True)
            left = fake.live_bytes() - storages_bytes(grads)
            if collect():
                gc.collect()
            kept = fake.live_bytes() - storages_bytes(grads)
        return storages_bytes(resident) + fake.peak_bytes, left, kept

    def _step(self, twin: nn.Module, args: tuple, kwargs: dict,
              last: GradLayout | None = None) -> None:
        if last is not None:
            last.allocate(dict(twin.named_parameters(remove_duplicate=False)))
        with _autocast(_model_device(self.model).type, self.autocast_dtype):
            loss = self.loss_fn(twin(*args, **kwargs))
        if last is not None:
            twin.zero_grad(set_to_none=True)
        loss.backward()
