"""Running a training step on fake tensors as the real device would run it.

A fake step (``FakeTensorMode``: shapes, dtypes and aliasing, no memory) differs from the
real one in three ways that change what is saved, each handled here:

1. **The meta device has no kernels of its own.** Autocast does nothing to meta tensors
   and attention decomposes to math there. A model on the meta device is therefore run on
   fake tensors of a real device type (:func:`fake_converter`; the CPU by default), where
   autocast casts and kernels are chosen as on real tensors; the target's fused kernels are
   then put in by :class:`profiles.kernels.FusedKernels`.
2. **Values.** Fake tensors have none, so ``bool(t)`` / ``t.item()`` fail, and libraries
   take a conservative branch for them. :class:`KnownValues` computes, on the CPU, the
   values of the small tensors a step derives from constants and from small real inputs
   (position ids from ``arange``, a padding mask of ones) and answers those questions
   exactly as the real step would.
3. **Hugging Face treats every fake tensor as "tracing"** (``transformers.masking_utils``
   asks ``is_tracing(tensor)``, true for a FakeTensor) and then builds the full causal /
   packed-sequence mask that its real run skips for ``is_causal=True``: at 8k tokens a
   64 MiB mask, converted to a float mask per layer and saved by attention, and a kernel
   choice (no flash with a mask). :func:`library_value_branches` makes that check answer
   "not tracing" for tensors whose value is known, so the real branch runs.

A meta kernel that refuses its arguments (``_grouped_mm``'s wants bfloat16, which the CPU
kernel does not) makes ``FakeTensorMode`` log the error with its traceback at ERROR before
raising it; the profiler catches it and says in one line what it does instead, so
:func:`meta_failures_at_debug` sends those tracebacks to this module's DEBUG log.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from profiles.leaves import tensors_in

log = logging.getLogger(__name__)

SMALL_NUMEL = 1 << 16  # tensors up to this many elements get values computed on the CPU
# modules whose `is_tracing(tensor)` decides a branch on a tensor's value (item 3)
VALUE_BRANCH_MODULES = ("transformers.masking_utils",)


class _MetaFailuresAtDebug(logging.Filter):
    """Passes ``FakeTensorMode``'s ERROR records of a meta kernel that raised on to this
    module's DEBUG log (traceback included) instead; the error itself still propagates."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.exc_info:
            return True
        log.debug("fake tensors: %s", record.getMessage(), exc_info=record.exc_info)
        return False


@contextlib.contextmanager
def meta_failures_at_debug() -> Iterator[None]:
    """Inside: the tracebacks ``FakeTensorMode`` logs for meta kernels that raise go to DEBUG
    (``profiles.fake``), for code that catches those errors and reports them itself."""
    torch_log = logging.getLogger("torch._subclasses.fake_tensor")
    quiet = _MetaFailuresAtDebug()
    torch_log.addFilter(quiet)
    try:
        yield
    finally:
        torch_log.removeFilter(quiet)


def fake_mode(**options: Any) -> Any:
    """A ``FakeTensorMode(**options)`` that asks once whether a device could be initialised.

    torch asks ``torch.cuda.is_available()`` on every fake op (``avoid_device_init``); where
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (importing Lightning sets it) each ask loads NVML:
    122 us against 3 us on a machine without a GPU, more than most fake ops cost. The answer
    cannot change during a profile."""
    return _asks_once_class()(**options)


@functools.cache
def _asks_once_class() -> type:
    from torch._subclasses.fake_tensor import FakeTensorMode

    asked = getattr(FakeTensorMode, "avoid_device_init", None)
    if not isinstance(asked, property):  # another torch: nothing to remember
        return FakeTensorMode

    class AsksOnceFakeTensorMode(FakeTensorMode):
        avoid_device_init = functools.cached_property(asked.fget)

    return AsksOnceFakeTensorMode


def _is_fake(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, FakeTensor) or tensor.is_meta


class _OpFacts(NamedTuple):
    """What `KnownValues` asks of an op on every call, read from its schema once."""

    computable: bool  # a value from its inputs' values: no random numbers, no empty memory
    value_only: bool  # returns no tensor (``_local_scalar_dense``, ``is_nonzero``)
    written: tuple[tuple[int, str], ...]  # the arguments it writes: position and name


@functools.cache
def _op_facts(func: Any) -> _OpFacts:
    schema = func._schema
    computable = func.namespace != "prim" \
        and torch.Tag.nondeterministic_seeded not in func.tags \
        and not schema.name.startswith("aten::empty") and "new_empty" not in schema.name
    value_only = bool(schema.returns) and not any("Tensor" in str(r.type)
                                                  for r in schema.returns)
    written = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    return _OpFacts(computable, value_only, written)


class KnownValues(TorchDispatchMode):
    """Values of the small tensors of a fake step that are computable (item 2).

    Enter it inside ``FakeTensorMode`` (so it sees each op before fake mode does). An op
    whose tensor inputs all have known values, which draws no random numbers and whose
    outputs are small, also runs on real CPU copies; an op that asks for a value
    (``_local_scalar_dense``, ``is_nonzero``, ``equal``) is answered from them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.values = WeakTensorKeyDictionary()

    def seed(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """``fake`` stands for ``real`` (a small input of the step)."""
        if not _is_fake(real) and real.numel() <= SMALL_NUMEL:
            with _disable_current_modes():  # a copy, not an op of the fake step
                self.values[fake] = real.detach().to("cpu", copy=True)

    def knows(self, tensor: torch.Tensor) -> bool:
        return not _is_fake(tensor) or tensor in self.values

    def _value(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.values[tensor] if _is_fake(tensor) else tensor.detach().cpu()

    def _computable(self, func: Any, args: tuple, kwargs: dict) -> bool:
        return _op_facts(func).computable \
            and all(self.knows(t) for t in tensors_in((args, kwargs)))

    def _on_cpu(self, func: Any, args: tuple, kwargs: dict) -> Any:
        def real(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return self._value(value)
            return torch.device("cpu") if isinstance(value, torch.device) else value

        args, kwargs = tree_map(real, (args, kwargs))
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        with _disable_current_modes(), torch.no_grad():
            return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        computable = self._computable(func, args, kwargs)
        if computable and _op_facts(func).value_only:
            return self._on_cpu(func, args, kwargs)  # a value: as the real step has it
        out = func(*args, **kwargs)
        outs = tensors_in(out)
        if computable and outs and sum(t.numel() for t in outs) <= SMALL_NUMEL:
            with contextlib.suppress(Exception):  # a value we cannot compute stays unknown
                for fake, real in zip(outs, tensors_in(self._on_cpu(func, args, kwargs)),
                                      strict=True):
                    self.values[fake] = real
        elif not computable:
            self._forget_written(func, args, kwargs)
        return out

    def _forget_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An op we did not compute wrote in place: what shares its storage is unknown."""
        written = [args[i] if i < len(args) else kwargs.get(name)
                   for i, name in _op_facts(func).written]
        storages = {StorageWeakRef(t.untyped_storage()) for t in tensors_in(written)}
        if not storages:
            return
        for tensor in list(self.values.keys()):
            if StorageWeakRef(tensor.untyped_storage()) in storages:
                del self.values[tensor]


@contextlib.contextmanager
def library_value_branches(known: KnownValues) -> Iterator[None]:
    """While a fake step runs, a library's "is this tensor being traced?" check says no for
    tensors whose value ``known`` has (item 3), so it takes the branch the real step takes.
    Restored afterwards; modules not imported are left alone."""
    patched = []
    for name in VALUE_BRANCH_MODULES:
        module = sys.modules.get(name)
        original = getattr(module, "is_tracing", None)
        if original is None:
            continue

        def is_tracing(tensor: Any = None, _original: Callable = original) -> bool:
            if isinstance(tensor, torch.Tensor) and known.knows(tensor):
                return _original(None)  # still true under compile, export or jit
            return _original(tensor)

        module.is_tracing = is_tracing
        patched.append((module, original))
    try:
        yield
    finally:
        for module, original in patched:
            module.is_tracing = original


class MetaAsDevice(TorchDispatchMode):
    """Meta tensors the step meets that were not converted up front (a loss target the
    loss function closes over, a module attribute that is not a buffer) reach fake mode
    as fake tensors of ``convert``'s device too, not as meta ones (item 1). Enter it
    right inside ``FakeTensorMode``."""

    def __init__(self, convert: Callable[[Any], Any]) -> None:
        super().__init__()
        self.convert = convert

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def unconverted(value: Any) -> bool:
            return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) \
                and value.is_meta

        kwargs = kwargs or {}
        if any(map(unconverted, tensors_in((args, kwargs)))):  # rare: skip the rebuild
            args, kwargs = tree_map(lambda v: self.convert(v) if unconverted(v) else v,
                                    (args, kwargs))
        return func(*args, **kwargs)


def fake_converter(mode: Any, meta_device: str, known: KnownValues | None = None
                   ) -> Callable[[Any], Any]:
    """Tensor -> its fake twin in ``mode``; meta tensors become fake ``meta_device`` ones
    (item 1). Storages shared among the converted tensors stay shared (tied weights, an
    input passed twice); small real tensors seed ``known``."""
    bases: dict[StorageWeakRef, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}

    def convert(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in made:
            return made[id(value)]
        if not value.is_meta or meta_device == "meta":
            fake = mode.from_tensor(value)
        else:
            fake = _fake_of_meta(value, meta_device, bases)
        made[id(value)] = fake
        if known is not None:
            known.seed(fake, value)
        return fake

    return convert


def _fake_of_meta(tensor: torch.Tensor, device: str,
                  bases: dict[StorageWeakRef, torch.Tensor]) -> torch.Tensor:
    """A fake tensor on ``device`` shaped and strided like a meta one, a view of the fake
    twin of its storage (made once per storage and dtype)."""
    if tensor.requires_grad:  # a leaf of its own (parameters are never views of others)
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                   device=device, requires_grad=True)
    ref = StorageWeakRef(tensor.untyped_storage())
    base = bases.get(ref)
    numel = tensor.untyped_storage().nbytes() // tensor.element_size()
    if base is None or base.dtype != tensor.dtype:
        base = torch.empty(numel, dtype=tensor.dtype, device=device)
        bases.setdefault(ref, base)
    return base.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
