"""A training step as ``torch.compile`` runs it, with a schedule applied: its peak, measured.

The model is compiled as it will train: whole (``mode="model"``: ``model.compile()``, as
``torch.compile(model)`` or the Trainer's ``torch_compile=True`` does) or per block
(``mode="blocks"``: each repeated block's ``.compile()`` after the checkpoints, in
torchtitan's order). One step compiles (its peak is dynamo's and inductor's, not the
step's), the next is measured from the same state: on a GPU by the CUDA allocator, on the
CPU by the allocator's own events (inductor's generated code allocates below the
dispatcher, where ``PeakTracker`` sees nothing; :func:`planner.measure.allocator_peak`).
The model is left as it was given: its plan (if any), state, gradients, RNG, and any
compile of its own.

Dynamo compiles a function again for each new input shape up to its recompile limit
(``torch._dynamo.config.recompile_limit``); past it, the calls run eager. Blocks of many
shapes compiled one by one (torchvision's MobileNetV2: 17) reach it: the step measured is
then partly eager, as training under the same limit will be. ``recompile_limit_hit`` says
so, and a plan records it (:class:`planner.plan.CompiledFit`).

A trainer gives batches of many lengths (an :class:`~planner.envelope.Envelope`): the first
length compiles a graph of that shape, the next another with the length dynamic, and every
later length runs that one. ``batches`` lists the batches in that order (a shorter one first,
then the longest of each mask branch); each is stepped, compiling where it is new, then
measured, and the step's peak is the largest.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from planner.config import COMPILE_MODES
from planner.measure import garbage_kept
from planner.model_state import _model_device, _training_config, _training_mode
from planner.plan import Plan, PlanMismatchWarning
from planner.runtime.applying import apply
from planner.runtime.compile_garbage import frames_traced
from planner.runtime.install import _plan_suspended, remove
from planner.runtime.partitioner import partitioner_budget_set
from planner.verification import (
    _autocast,
    _grads_kept,
    bound_tensors,
    measure_step,
    step_residents,
)

__all__ = ["TIMED_STEPS", "Batch", "CompiledMeasure", "CompiledStep", "SteppedBatch",
           "compiled", "step_batches", "training_peaks"]

# steps timed after the measured one; the least is the step's time (a busy host only adds
# to a step, and schedules are timed one after another, not in turns)
TIMED_STEPS = 9


class CompiledMeasure(NamedTuple):
    """A schedule's compiled step: its peak (the largest of its batches'), the least of its
    timed steps (ms), and each batch's peak in the order of ``CompiledStep.batches``."""

    peak_bytes: int
    step_ms: float | None  # None: not timed
    batch_peaks: tuple[int, ...] = ()


class SteppedBatch(NamedTuple):
    """One batch stepped as training meets it: whether its step traced a frame, that
    step's peak, what it left allocated when it returned (``left``) and what of that a
    cycle collection did not free (``kept``), and the next step's peak, measured from the
    model's state (``peak``). Bytes."""

    compiled: bool
    compiling_peak: int
    left: int
    kept: int
    peak: int


def training_peaks(steps: list[SteppedBatch], garbage_collected: bool) -> tuple[int, ...]:
    """Each batch's peak in training, what the compiles before hold included: the one rule
    for the measure and the fake count. A compile may leave garbage that holds its step's
    output (:mod:`planner.runtime.compile_garbage`) until Python's collector runs, at no step
    training chooses: every later step may hold it from every compile, and a compile in
    training meets whichever length comes first, so each compile counts the most any
    compile here left. ``garbage_collected`` (the loop calls ``collect_compile_garbage``
    after each step): a compile leaves only what a collection does not free."""
    carried = [s.kept if garbage_collected else s.left for s in steps if s.compiled]
    each = max(carried, default=0)
    compiles_before, peaks = 0, []
    for s in steps:
        compiling = s.compiling_peak + compiles_before * each if s.compiled else 0
        compiles_before += s.compiled
        peaks.append(max(s.peak + len(carried) * each, compiling))
    return tuple(peaks)


class Batch(NamedTuple):
    """One batch a compiled step is measured on: what it is, in words, and its inputs."""

    label: str
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def compiled(model: nn.Module, mode: str, blocks: list[str],
             backend: Any = None) -> Iterator[None]:
    """``model`` compiled whole or each module of ``blocks`` compiled (with ``backend``;
    None: ``.compile()``'s own, inductor), while inside; dynamo's caches are reset before
    and after (each schedule compiles afresh, and no recompile limit is reached over many
    schedules)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compiled must be one of {list(COMPILE_MODES)}, got {mode!r}")
    targets = [model] if mode == "model" else [model.get_submodule(b) for b in blocks]
    before = [module._compiled_call_impl for module in targets]
    torch._dynamo.reset()
    try:
        for module in targets:
            module.compile() if backend is None else module.compile(backend=backend)
        yield
    finally:
        for module, impl in zip(targets, before, strict=True):
            module._compiled_call_impl = impl
        torch._dynamo.reset()


def step_batches(model: nn.Module, mode: str, blocks: list[str], args: tuple, kwargs: dict,
                 batches: list[Batch] | None) -> list[Batch]:
    """The batches a compiled step of ``model`` is measured (or counted) on: ``batches``, or
    ``args`` and ``kwargs`` alone; refused where ``mode="blocks"`` has no block to compile."""
    if mode == "blocks" and not blocks:
        raise ValueError(f"compiled='blocks' compiles each repeated block, and "
                         f"{type(model).__name__} has none the profile found; use "
                         "compiled='model'")
    return batches or [Batch("", args, kwargs)]


class CompiledStep:
    """One training step of ``model`` on fixed inputs, compiled ``mode``: ``peak_bytes(plan)``
    measures it with ``plan`` applied (``None``: without a plan). ``batches``: the batches
    measured, in the order training meets them (module docstring; default: ``args`` and
    ``kwargs`` alone, which are the ones timed)."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict,
                 loss_fn: Callable[[Any], torch.Tensor], mode: str, blocks: list[str], *,
                 autocast_dtype: str | None = None, grads_at_start: bool = False,
                 grads_in_forward: bool = False, batches: list[Batch] | None = None,
                 garbage_collected: bool = False) -> None:
        self.batches = step_batches(model, mode, blocks, args, kwargs, batches)
        self.model, self.args, self.kwargs, self.loss_fn = model, args, kwargs, loss_fn
        self.mode, self.blocks = mode, blocks
        self.autocast_dtype, self.grads_at_start = autocast_dtype, grads_at_start
        self.grads_in_forward = grads_in_forward
        self.garbage_collected = garbage_collected  # training_peaks's
        # dynamo's recompile limit where a step measured reached it (calls past it ran eager)
        self.recompile_limit_hit: int | None = None

    @property
    def measure(self) -> str:
        """What measures the peak, in words."""
        return ("torch.cuda.max_memory_allocated" if _model_device(self.model).type == "cuda"
                else "the CPU allocator's events")

    def peak_bytes(self, plan: Plan | None) -> int:
        return self.run(plan, timed_steps=0).peak_bytes

    def run(self, plan: Plan | None, timed_steps: int = TIMED_STEPS,
            partitioner_budget: float | None = None) -> CompiledMeasure:
        """The step with ``plan`` compiled: one step compiles, the next is measured, and
        ``timed_steps`` more are timed (compiled, the eager clock does not say what a
        schedule costs: inductor fuses what a region recomputes). ``partitioner_budget``:
        the partitioner's ``activation_memory_budget`` while it compiles (None: the one
        ``plan`` sets, else the process's)."""
        model = self.model
        with _plan_suspended(model), _buffers_kept(model) as restore, _grads_kept(model), \
                _training_mode(model), _training_config(model), warnings.catch_warnings():
            warnings.simplefilter("ignore", PlanMismatchWarning)
            if plan is not None:
                apply(model, plan)
            try:
                with partitioner_budget_set(partitioner_budget), garbage_kept(), \
                        compiled(model, self.mode, self.blocks):
                    steps = [self._measured(batch, restore) for batch in self.batches]
                    step_ms = self._least_ms(timed_steps) if timed_steps else None
            finally:
                remove(model)
        peaks = training_peaks(steps, self.garbage_collected)
        return CompiledMeasure(max(peaks), step_ms, peaks)

    def _measured(self, batch: Batch, restore: Callable[[], None]) -> SteppedBatch:
        """``batch`` stepped as training meets it: its step, compiling where its shape is new
        (a step of training too), and the next measured from the state the model was given
        in."""
        hits, frames = _recompile_limit_hits(), frames_traced()
        compiling_peak, left, kept = self._compiling(batch, lambda: frames_traced() > frames)
        compiled_now = frames_traced() > frames
        if _recompile_limit_hits() > hits:
            self.recompile_limit_hit = torch._dynamo.config.recompile_limit
        restore()
        peak, _, _ = measure_step(self.model, batch.args, batch.kwargs, self.loss_fn,
                                  self.autocast_dtype, compiled=True,
                                  grads_at_start=self.grads_at_start,
                                  grads_in_forward=self.grads_in_forward)
        return SteppedBatch(compiled_now, compiling_peak, left, kept, peak)

    def _compiling(self, batch: Batch, compiled_now: Callable[[], bool]
                   ) -> tuple[int, int, int]:
        """``batch``'s step, which compiles where its shape is new: its peak, the bytes it
        leaves allocated when it returns, and what of them a cycle collection after it
        leaves where it compiled (the CPU allocator's events; HF GPT-2's compiling step
        leaves its logits, 1 MiB beside a 13 MiB step, to the collector:
        :func:`training_peaks`). On a GPU none is measured yet (0, 0, 0): a step there is
        measured above what the process held at its start."""
        if _model_device(self.model).type == "cuda":
            self._step(batch.args, batch.kwargs)
            return 0, 0, 0
        from planner.measure import allocator_peak, storages_bytes

        resident = [*step_residents(self.model, batch.args, batch.kwargs),
                    *bound_tensors(self.loss_fn)]
        seen = allocator_peak(lambda: self._step(batch.args, batch.kwargs), compiled_now)
        return (storages_bytes(resident) + seen.peak_bytes, max(seen.end_bytes, 0),
                max(seen.kept_bytes, 0))

    def _least_ms(self, steps: int) -> float:
        """The least wall time of ``steps`` steps (forward, loss, backward), each waited
        for on a GPU."""
        device = _model_device(self.model)
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            self._step(self.args, self.kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - began) * 1e3)
        return min(times)

    def _step(self, args: tuple, kwargs: dict) -> None:
        with _autocast(_model_device(self.model).type, self.autocast_dtype):
            loss = self.loss_fn(self.model(*args, **kwargs))
        loss.backward()
        self.model.zero_grad(set_to_none=True)


def _recompile_limit_hits() -> int:
    """How often dynamo has given up compiling a function at its recompile limit in this
    process (its counters are not cleared by ``torch._dynamo.reset``)."""
    from torch._dynamo.utils import counters

    return sum(n for reason, n in counters["unimplemented"].items()
               if "recompile limit exceeded" in reason.lower())


@contextlib.contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Yields a function that puts the model's buffers (BatchNorm's statistics) and the RNG
    back as they were; parameters are not copied (a step without the optimizer leaves
    them), so a model that fills its device is not doubled."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    device = _model_device(model)
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore() -> None:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)

    try:
        yield restore
    finally:
        restore()
