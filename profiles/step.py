"""How the profiler runs one training step of the model, and what it starts from.

``_Step`` is the step (model, inputs, loss, precision; for a parallel step, a fresh twin per
run). A step runs on the model's own tensors (copies of its buffers) or on fake twins under
``FakeTensorMode`` as the target device runs it (``profiles.fake``, ``profiles.kernels``).
A step with ``grads_at_start`` starts from gradients laid out as a backward leaves them
(``GradLayout``). Profiling hands back the RNG state it drew from.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map

from profiles.devices import DeviceSpec
from profiles.errors import _first_line
from profiles.fake import (
    KnownValues,
    MetaAsDevice,
    fake_converter,
    fake_mode,
    library_value_branches,
    meta_failures_at_debug,
)
from profiles.kernels import FusedKernels
from profiles.parallel import RuntimeMemory
from profiles.schema import StaticMemory
from profiles.swap import swapped_tensors

log = logging.getLogger(__name__)


@dataclass
class _Step:
    """How to run one training step of the model: inputs, loss, precision."""

    model: nn.Module
    args: tuple
    kwargs: dict
    loss_fn: Callable[[Any], torch.Tensor]
    autocast_dtype: torch.dtype | None
    device_type: str
    grads_at_start: bool = False  # every .grad allocated when the step starts
    grad_layout: GradLayout | None = None  # how, with grads_at_start (`_grad_layout`)
    grads_in_forward: bool = False  # the last .grad held through the forward, freed before
    meta_as: str = "cpu"  # a fake step runs meta tensors as fake tensors of this device
    twin: Callable[[Any], nn.Module] | None = None  # a parallel step: a fresh twin per run

    def renew(self, convert: Callable[[Any], Any] | None) -> RuntimeMemory | None:
        """Before a run of a parallel step: a fresh parallelized twin (its runtime starts
        from nothing), on fake tensors made by ``convert`` when given, and the memory
        record of its runtime; one process: None."""
        if self.twin is None:
            return None
        self.model = self.twin(convert)
        return RuntimeMemory()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def forward_loss(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """``loss_fn(model(*args, **kwargs))``: the output is dropped, the loss kept."""
        with self.autocast():
            loss = self.loss_fn(self.model(*args, **kwargs))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                             f"{getattr(loss, 'shape', '')}")
        return loss


@dataclass
class _StepState:
    """The tensors a step runs on: the model's parameters by name (its own, or their fake
    twins, as swapped in) and the inputs."""

    params: dict[str, torch.Tensor]
    args: tuple
    kwargs: dict
    runtime: RuntimeMemory | None = None  # a parallel twin's


@contextlib.contextmanager
def _fake_step(step: _Step, spec: DeviceSpec | None) -> Iterator[Callable[[Any], Any]]:
    """Fake tensor mode for one step run as the device runs it (``profiles.fake``): meta
    tensors as fake ``step.meta_as`` ones, small values known. Yields the converter of
    real/meta tensors to fake ones. The step itself runs under :func:`_kernels`."""
    known = KnownValues()
    with meta_failures_at_debug(), fake_mode(allow_non_fake_inputs=True) as mode:
        convert = fake_converter(mode, step.meta_as, known)
        with MetaAsDevice(convert), known, library_value_branches(known):
            yield convert


def _kernels(spec: DeviceSpec | None, real: bool) -> contextlib.AbstractContextManager:
    """On fake tensors, the fused kernels ``spec``'s device selects (``profiles.kernels``);
    enter it innermost, so that the ops it runs are seen like any other."""
    return FusedKernels(spec) if spec is not None and not real else contextlib.nullcontext()


@contextlib.contextmanager
def _fake_state(step: _Step, spec: DeviceSpec | None) -> Iterator[_StepState]:
    """Inside a fake step (:func:`_fake_step`) run with ``spec``'s kernels: the model's
    parameters and buffers swapped for fake twins."""
    with _fake_step(step, spec) as convert:
        runtime = step.renew(convert)  # a parallel twin: on fake tensors already
        model = step.model
        state = {k: convert(v) if runtime is None else v
                 for k, v in [*model.named_parameters(remove_duplicate=False),
                              *model.named_buffers(remove_duplicate=False)]}
        args, kwargs = tree_map(convert, (step.args, step.kwargs))
        params = {k: state[k] for k, _ in model.named_parameters(remove_duplicate=False)}
        with swapped_tensors(model, state), _kernels(spec, real=False):
            yield _StepState(params, args, kwargs, runtime)


@contextlib.contextmanager
def _real_state(step: _Step) -> Iterator[_StepState]:
    """On the model's own tensors (copies of its buffers), its gradients put back after."""
    model = step.model
    grads = {p: p.grad for p in model.parameters()}
    buffers = {k: b.clone() for k, b in model.named_buffers(remove_duplicate=False)}
    try:
        with swapped_tensors(model, buffers):
            yield _StepState(dict(model.named_parameters(remove_duplicate=False)),
                             step.args, step.kwargs)
    finally:
        for p, grad in grads.items():
            p.grad = grad


@contextlib.contextmanager
def _rng_state_preserved() -> Iterator[None]:
    """Profiling may draw random numbers (dropout on real tensors); give them back."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


# ----------------------------------------------------------------------------- gradients


@dataclass(frozen=True)
class _GradView:
    storage: int  # index into GradLayout.storages
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class GradLayout:
    """Where a backward from no gradients leaves each parameter's ``.grad``.

    AccumulateGrad keeps an incoming gradient as ``.grad`` when nothing else holds it and
    its strides are the parameter's, also when it is a view of a larger storage: the
    backward of ``cat`` passes slices of one gradient, so ``cat([a.t(), b])`` leaves
    ``b.grad`` holding the storage of both. Later micro-batches of gradient accumulation
    start from these (``+=`` keeps them), so the storages, each once, are what they hold.
    """

    storages: tuple[tuple[int, torch.dtype], ...]  # (nbytes, dtype)
    views: dict[str, _GradView]  # parameter name -> its gradient; none: no gradient

    @property
    def nbytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.storages)

    @classmethod
    def of(cls, params: dict[str, torch.Tensor]) -> GradLayout:
        """The layout of the ``.grad`` that ``params`` hold now."""
        index: dict[StorageWeakRef, int] = {}
        storages: list[tuple[int, torch.dtype]] = []
        views = {}
        for name, p in params.items():
            grad = p.grad
            if grad is None:
                continue
            ref = StorageWeakRef(grad.untyped_storage())
            if ref not in index:
                index[ref] = len(storages)
                storages.append((grad.untyped_storage().nbytes(), grad.dtype))
            views[name] = _GradView(index[ref], tuple(grad.shape), tuple(grad.stride()),
                                    grad.storage_offset())
        return cls(tuple(storages), views)

    def allocate(self, params: dict[str, torch.Tensor]) -> None:
        """Give ``params`` zeroed gradients laid out like this, on their own device and
        tensor mode (fake twins get fake gradients)."""
        bases: dict[int, torch.Tensor] = {}
        for name, p in params.items():
            view = self.views.get(name)
            if view is None or not p.requires_grad:
                p.grad = None
                continue
            if view.storage not in bases:
                nbytes, dtype = self.storages[view.storage]
                # made from the parameter: a fake one's mode makes (and counts) it, active
                # or not
                bases[view.storage] = p.new_zeros(-(-nbytes // dtype.itemsize), dtype=dtype)
            p.grad = bases[view.storage].as_strided(view.shape, view.stride, view.offset)


def _grad_layout(step: _Step, real: bool, spec: DeviceSpec | None) -> GradLayout | None:
    """Where one backward from no gradients leaves the gradients, on a fake step, or on a
    real one when the forward ran on real tensors and fake ones cannot run the backward;
    None when neither can (each ``.grad`` is then taken as a tensor of its own)."""
    for on_real in [False, True] if real else [False]:
        try:
            with _real_state(step) if on_real else _fake_state(step, spec) as state:
                for p in state.params.values():
                    p.grad = None
                step.forward_loss(state.args, state.kwargs).backward()
                return GradLayout.of(state.params)
        except Exception as error:
            log.info("could not run the backward of %s on %s tensors to lay out its "
                     "gradients (%s)", type(step.model).__name__,
                     "real" if on_real else "fake", _first_line(error))
    log.warning("could not run the backward of %s to see how it lays out its gradients; "
                "counting each parameter's .grad as a tensor of its own size",
                type(step.model).__name__)
    return None


def _start_grads(params: dict[str, torch.Tensor], step: _Step) -> None:
    """Give ``params`` the gradients the step starts with: none (``zero_grad()``), or, with
    ``grads_at_start``, zeros laid out as a backward leaves them (``step.grad_layout``) that
    this one accumulates into. The model's own ``.grad`` (left by a step before planning)
    never leak into the profile."""
    if step.grads_at_start and step.grad_layout is not None:
        step.grad_layout.allocate(params)
        return
    for p in params.values():
        p.grad = torch.zeros_like(p) if step.grads_at_start and p.requires_grad else None


def _laid_out_grads(static: StaticMemory, layout: GradLayout | None) -> StaticMemory:
    """Static memory whose gradients are the storages ``layout`` holds, each once (more
    than the parameters where a gradient is a view of a larger one, less where a parameter
    gets none); as it was without a layout."""
    if layout is None:
        return static
    return static.model_copy(update={"grad_bytes": layout.nbytes})
