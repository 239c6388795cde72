"""verify / measure_step: one training step run without and with a plan, its measured
peak, time, loss and gradients against what the plan predicts."""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import profiles
from planner.model_state import _model_device, _training_config
from planner.plan import Plan, PlanMismatchWarning, format_bytes
from planner.runtime.applying import apply
from planner.runtime.emit import checkpointed_modules
from planner.runtime.install import _guards, remove
from planner.runtime.offload import offloaded_modules
from profiles.inputs import normalize_inputs
from profiles.step import GradLayout


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
        return (f"measured peak {format_bytes(self.measured_peak_bytes)} vs predicted "
                f"{format_bytes(self.predicted_peak_bytes)} ({100 * self.peak_error:+.2f} %), "
                f"budget {format_bytes(self.budget_bytes)} "
                f"({'met' if self.within_budget else 'EXCEEDED'}); unplanned "
                f"{format_bytes(self.unplanned_peak_bytes)}; step {self.step_ms:.1f} ms vs "
                f"{self.unplanned_step_ms:.1f} ms ({100 * self.overhead:+.1f} %); losses "
                f"{'equal' if self.losses_equal else 'DIFFER'}, gradients "
                f"{'bit-identical' if self.grads_equal else 'DIFFER'}")


def _autocast(device_type: str, dtype: str | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, dtype))


_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this


def _allocated_bytes(tensors: list[torch.Tensor], device: torch.device) -> int:
    """What the CUDA allocator holds for ``tensors`` on ``device``, each storage once."""
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
             if t.device.type == device.type}
    return sum(-(-n // _BLOCK) * _BLOCK for n in sizes.values())


def bound_tensors(fn: Callable[..., Any]) -> list[torch.Tensor]:
    """Tensors a loss function closes over or is bound to (a loss target): inputs of the
    step made before it. On the CPU :class:`planner.measure.PeakTracker` counts them when
    an op reads them; the CUDA allocator cannot tell them from the process's other tensors,
    so ``measure_step`` counts these as the step's (the simulator counts the target too)."""
    found: list[Any] = []
    if isinstance(fn, nn.Module):  # a loss module's weights (CrossEntropyLoss(weight=...))
        found += [*fn.parameters(), *fn.buffers()]
    while isinstance(fn, functools.partial):
        found += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # a cell not yet filled
            found.append(cell.cell_contents)
    found += [*(getattr(fn, "__defaults__", None) or ()), getattr(fn, "__self__", None)]
    return [t for t in tree_leaves(found) if isinstance(t, torch.Tensor)]


def step_residents(module: nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """What a training step holds from its start to its end: the model's parameters,
    buffers and gradients, and the batch's tensors."""
    return [*module.parameters(), *module.buffers(),
            *(p.grad for p in module.parameters() if p.grad is not None),
            *[t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]]


def measure_step(module: nn.Module, args: tuple, kwargs: dict,
                 loss_fn: Callable[[Any], torch.Tensor],
                 autocast_dtype: str | None = None, *,
                 grads_at_start: bool = False, grads_in_forward: bool = False,
                 compiled: bool = False) -> tuple[int, torch.Tensor, dict]:
    """Peak allocated bytes of one training step (the CUDA allocator, or on CPU
    :class:`planner.measure.PeakTracker`), the loss and the gradients. As on the CPU, the
    step is the model's parameters, buffers, gradients and inputs (the tensors ``loss_fn``
    is bound to included: a loss target) and what the step allocates: on a GPU, whatever
    else the process holds on the device when the step starts (another model, tensors kept
    from earlier steps) is subtracted. The step starts with no ``.grad``, or
    (``grads_at_start``) as a later micro-batch of gradient accumulation does: with the
    gradients one backward before it left, zeroed, laid out as that backward laid them out
    (AccumulateGrad keeps an incoming gradient, a slice of a larger one included); that
    backward's random draws and buffer updates are undone. ``grads_in_forward``: as a step
    in Lightning's order, which starts with the ``.grad`` one backward left (laid out so,
    allocated in the step) and frees them (``zero_grad()``) between its forward and its
    backward. ``compiled``: the step runs compiled code, whose buffers a dispatch mode does
    not see; on the CPU the allocator's own events measure it
    (:func:`planner.measure.allocator_peak`), above the same tensors. Gradients are
    cleared afterwards."""
    device = _model_device(module)
    module.zero_grad(set_to_none=True)

    # the last step's gradients, once laid out (None while `_last_gradients` runs the step
    # that leaves them)
    left: GradLayout | None = None

    def run() -> torch.Tensor:
        if left is not None:
            left.allocate(dict(module.named_parameters(remove_duplicate=False)))
        with _autocast(device.type, autocast_dtype):
            loss = loss_fn(module(*args, **kwargs))
        if left is not None:
            module.zero_grad(set_to_none=True)
        loss.backward()
        return loss.detach()

    left = _last_gradients(module, device, run, grads_at_start, grads_in_forward)
    static = step_residents(module, args, kwargs)
    if device.type == "cuda" or compiled:
        held: list[torch.Tensor] = []
        peak = _peak_above([*static, *bound_tensors(loss_fn)], device,
                           lambda: held.append(run()))
        loss = held[0]
    else:
        from planner.measure import PeakTracker

        with PeakTracker(static) as tracker:
            loss = run()
        peak = tracker.peak_bytes
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()
             if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return peak, loss.detach(), grads


def measure_training_step(module: nn.Module, args: tuple, kwargs: dict,
                          loss_fn: Callable[[Any], torch.Tensor],
                          optimizer: torch.optim.Optimizer,
                          autocast_dtype: str | None = None) -> int:
    """Peak bytes of a training step with ``optimizer`` (forward, backward, ``step()``,
    ``zero_grad()``) as training meets it from its second step on: a first step makes the
    optimizer's state (and compiles, where ``module`` is compiled), the second is measured.
    The step's tensors are the parameters, buffers, inputs, loss target and the optimizer's
    state, plus what the step allocates above them: the CUDA allocator's peak on a GPU
    (less what else the process holds), the CPU allocator's events on the CPU (compiled
    code included, :func:`planner.measure.allocator_peak`). Both steps update the
    parameters, as training does."""
    device = _model_device(module)

    def step() -> None:
        with _autocast(device.type, autocast_dtype):
            loss = loss_fn(module(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    state = [t for s in optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    resident = [*module.parameters(), *module.buffers(), *state, *bound_tensors(loss_fn),
                *[t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]]
    return _peak_above(resident, device, step)


def _peak_above(resident: list[torch.Tensor], device: torch.device,
                call: Callable[[], Any]) -> int:
    """Peak bytes of ``call()`` with ``resident`` held: on a GPU the CUDA allocator's peak,
    less what else the process holds; on the CPU ``resident`` plus the most the CPU
    allocator's events hold above them (compiled code included)."""
    if device.type != "cuda":
        from planner.measure import allocator_peak, storages_bytes

        return storages_bytes(resident) + allocator_peak(call).peak_bytes
    torch.cuda.synchronize(device)
    bystanders = torch.cuda.memory_allocated(device) - _allocated_bytes(resident, device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - max(bystanders, 0)


def _last_gradients(module: nn.Module, device: torch.device, run: Callable[[], torch.Tensor],
                    grads_at_start: bool, grads_in_forward: bool) -> GradLayout | None:
    """The gradients `measure_step`'s step starts from: with ``grads_at_start``, those one
    ``run()`` leaves, zeroed, on the model; with ``grads_in_forward``, their layout (the
    step allocates them itself, so that they count until ``zero_grad()`` frees them)."""
    if grads_at_start and grads_in_forward:
        raise ValueError("measure_step: a step either adds into the .grad it starts with "
                         "(grads_at_start) or frees them after its forward "
                         "(grads_in_forward), not both")
    if grads_at_start or grads_in_forward:
        _grads_as_one_backward_left_them(module, device, run)
    if not grads_in_forward:
        return None
    layout = GradLayout.of(dict(module.named_parameters(remove_duplicate=False)))
    module.zero_grad(set_to_none=True)
    return layout


def _grads_as_one_backward_left_them(module: nn.Module, device: torch.device,
                                     run: Callable[[], torch.Tensor]) -> None:
    """``run()`` once for the gradients it leaves, then zeroed; its random draws and
    buffer updates undone."""
    buffers = [b.detach().clone() for b in module.buffers()]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        run()
    with torch.no_grad():
        for buffer, before in zip(module.buffers(), buffers, strict=True):
            buffer.copy_(before)
        for p in module.parameters():
            if p.grad is not None:
                p.grad.zero_()


def _time_step(module: nn.Module, args: tuple, kwargs: dict,
               loss_fn: Callable[[Any], torch.Tensor], repeats: int,
               autocast_dtype: str | None) -> float:
    device = _model_device(module)
    samples = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        with _autocast(device.type, autocast_dtype):
            loss = loss_fn(module(*args, **kwargs))
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            samples.append((time.perf_counter() - begin) * 1e3)
        module.zero_grad(set_to_none=True)
    return statistics.median(samples)


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Yields a function that puts the model's state and the RNG back as they were."""
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    rng = torch.get_rng_state()

    def restore() -> None:
        with torch.no_grad():
            for key, value in model.state_dict(keep_vars=True).items():
                value.copy_(state[key])
        torch.set_rng_state(rng)

    try:
        yield restore
    finally:
        restore()


@contextlib.contextmanager
def _grads_kept(model: nn.Module) -> Iterator[None]:
    """The user's ``.grad`` set aside, and put back after."""
    params = list(model.parameters())
    kept = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, grad in zip(params, kept, strict=True):
            p.grad = grad


def verify(model: nn.Module, plan: Plan, example_inputs: Any = None,
           loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
           repeats: int = 3) -> VerifyReport:
    """Run one step of the model without and with the plan; compare with the plan.

    Both steps start from the same state (parameters, buffers such as BatchNorm statistics,
    RNG); the model is left as it was given (planned or not) and in the state it had.

    Raises:
        ValueError: a per-rank plan (``parallelize=``): one process cannot run a rank's
            step; measure on each rank (``benchmarks/distributed.py`` shows how).
    """
    if plan.profile.parallel is not None:
        raise ValueError(
            f"this plan is {plan.profile.parallel.describe()}: verify() runs one process's "
            "step, not a rank's. Measure each rank's step where it trains (PeakTracker with "
            "follow_resizes=True on CPU, torch.cuda.max_memory_allocated on a GPU), as "
            "benchmarks/distributed.py does")
    args, kwargs = normalize_inputs(model, example_inputs)
    loss_fn = loss_fn or profiles.default_loss
    was_planned = bool(checkpointed_modules(model) or _guards(model) or offloaded_modules(model))
    dtype = plan.autocast_dtype
    grads = {"grads_at_start": plan.profile.static.grads_at_start,
             "grads_in_forward": plan.profile.static.grads_in_forward}
    with _state_kept(model) as restore, _grads_kept(model), warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanMismatchWarning)
        remove(model)
        with _training_config(model):
            _, base_loss, base_grads = measure_step(model, args, kwargs, loss_fn, dtype,
                                                    **grads)
            restore()
            unplanned_ms = _time_step(model, args, kwargs, loss_fn, repeats, dtype)
            restore()
        apply(model, plan)
        peak, loss, planned_grads = measure_step(model, args, kwargs, loss_fn, dtype,
                                                 **grads)
        restore()
        step_ms = _time_step(model, args, kwargs, loss_fn, repeats, dtype)
        if not was_planned:
            remove(model)
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
        grads_equal=base_grads.keys() == planned_grads.keys()
        and all(torch.equal(base_grads[k], planned_grads[k]) for k in planned_grads),
    )
