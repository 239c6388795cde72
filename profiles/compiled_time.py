"""A compiled step's time from the kernels its generated code calls, on a device's roofline.

Inductor's wrapper for a graph calls two kinds of kernels (``profiles.compiled_memory``
runs it on fake tensors): its own fused kernels (``cpp_fused_*``, ``triton_*``), which take
the buffers they read and write as arguments, and torch's ops (``extern_kernels.mm``,
fallbacks such as CPU flash attention), which dispatch as aten ops. :class:`KernelClock`
adds up, on one :class:`profiles.devices.DeviceSpec`:

1. a fused kernel: the roofline of a streaming kernel that reads and writes each of its
   distinct tensor arguments once, plus the spec's launch cost; of class
   ``transcendental`` where its name (inductor names a kernel by the aten ops it fused)
   holds an op that computes a transcendental or a root per element (``TRANSCENDENTAL``:
   softmax, GELU, SiLU, norms, RoPE's sine), else ``pointwise``. A GPU streams both at its
   bandwidth; a CPU computes the first at a fraction of it (``profiles.host_roofline``).
   On the host itself (``on_host``), a generated C++ kernel is instead run, once per
   kernel and layout of its arguments: on real buffers, one per storage its arguments
   share (an in-out buffer is one), of their sizes, floats random and integers zero (an
   index 0 is in range of any gather), the least of ``REPEATS``. A roofline per byte
   missed these kernels by 4-22 x on GPT small (a masked softmax's three passes over its
   rows, a GELU's tanh) and a dropout's random numbers cost more than any of it (HF GPT-2:
   0.78 ms a softmax with dropout against 0.06 predicted); a kernel that raises on those
   buffers (an index check) keeps its roofline;
2. an aten op that returns a tensor: ``DeviceSpec.estimate_ms``, the eager clock's own rule
   (its FLOPs from torch's flop counter), so an extern matmul costs what the eager profile
   charges it; on the host itself, a matmul, convolution, attention or reduction op
   (``HOST_TIMED_CLASSES``: a log-softmax over a vocabulary ran 7 x its roofline) is
   instead timed once per shape on random tensors of its shapes, strides and dtypes (the
   least of ``REPEATS``): a CPU's GEMM rate varies by shape more than a roofline says
   (GPT small's 128 x 64 x 192 products ran at 80 GFLOPS where 512-cubed ones ran at 100);
   one whose roofline is over ``HOST_TIMED_MAX_MS`` is not run (large GEMMs reach the
   fitted rate, and timing them would cost seconds each). Random numbers on the host come
   from a generator of the clock's own: the process's RNG is not touched;
3. a compiled graph's call: ``DeviceSpec.compiled_graph_us`` (guards, the AOT runtime
   wrapper, autograd's function, the wrapper's own Python) and ``compiled_input_us`` per
   tensor it takes (a guard and a check each, a parameter's accumulation node).

What a fused kernel does not pay here: the pointwise ops it fused, each a launch and a round
trip through memory in the eager step. That is the difference compiling makes to a rerun,
and why the eager clock cannot time a compiled schedule.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from profiles.devices import COMPUTE_CLASSES, DeviceSpec, op_class

__all__ = ["KernelClock", "fused_class"]

_GENERATOR = torch.Generator().manual_seed(0)  # the host's random inputs, not the process's RNG
REPEATS = 5  # an op timed on the host: the least of this many runs (after one warm run)
HOST_TIMED_MAX_MS = 20.0  # a kernel estimated longer is not timed on the host (rules 1, 2)
HOST_TIMED_CLASSES = COMPUTE_CLASSES | {"reduction"}  # aten ops timed on the host (rule 2)
# words of a fused kernel's name (split at "_") that make it transcendental (rule 1)
TRANSCENDENTAL = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "log2", "softmax", "gelu", "silu", "sigmoid",
    "tanh", "erf", "rsqrt", "sqrt", "reciprocal", "pow", "norm", "sin", "cos", "mish",
    "softplus", "elu"})


def fused_class(name: str) -> str:
    """The roofline class of a fused kernel named ``name`` (rule 1)."""
    return "transcendental" if TRANSCENDENTAL & set(name.split("_")) else "pointwise"


class KernelClock:
    """Milliseconds of the kernels a compiled step calls, added up on ``spec`` while
    ``running`` (``ms``; :meth:`restart` sets it to 0); ``on_host``: the step's device is
    this process's CPU, whose compute ops are timed (rule 2)."""

    def __init__(self, spec: DeviceSpec, on_host: bool = False) -> None:
        self.spec, self.on_host = spec, on_host
        self._timed: dict[tuple, float] = {}  # host op times by op and operands
        self.running = False
        self.ms = 0.0
        self.by_kind: dict[str, float] = {}  # ms of fused kernels, aten ops, graph calls
        self.kernels = 0  # fused kernels and aten ops that run one, since the restart
        self.graphs = 0

    def restart(self) -> None:
        self.ms, self.by_kind, self.kernels, self.graphs = 0.0, {}, 0, 0

    def _charge(self, kind: str, ms: float) -> None:
        self.ms += ms
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + ms

    def fused(self, args: Iterable[Any], name: str = "", kernel: Any = None) -> None:
        """The fused kernel ``name`` called on ``args`` (rule 1); ``kernel``: the generated
        C++ function, run on the host where the clock is on it."""
        if not self.running:
            return
        args = tuple(args)
        tensors = _distinct([a for a in args if isinstance(a, torch.Tensor)])
        if not tensors:
            return
        dtype = max(tensors, key=_nbytes).dtype
        ms = self.spec.op_time_ms(0, sum(map(_nbytes, tensors)),
                                  str(dtype).removeprefix("torch."), fused_class(name))
        if self.on_host and kernel is not None and ms <= HOST_TIMED_MAX_MS:
            ms = self._kernel_ms(kernel, args, ms)
        self._charge("fused", ms)
        self.kernels += 1

    def aten(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """An aten op the step dispatched (rule 2); ``out=`` is an output, not an input."""
        if not self.running:
            return
        given = {k: v for k, v in kwargs.items() if k != "out"}
        inputs = [t for t in tree_leaves((args, given)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:  # a query (``prim.device``): no kernel
            return
        ms = self.spec.estimate_ms(func, inputs, outputs, _flops(func, args, given, out))
        if self.on_host and op_class(func) in HOST_TIMED_CLASSES and ms <= HOST_TIMED_MAX_MS:
            ms = self._host_ms(func, args, kwargs)
        self._charge("aten", ms)
        self.kernels += ms > 0

    def graph(self, inputs: int) -> None:
        """A compiled graph called on ``inputs`` tensors (rule 3)."""
        if self.running:
            self._charge("graph", (self.spec.compiled_graph_us
                                   + inputs * self.spec.compiled_input_us) * 1e-3)
            self.graphs += 1

    def _kernel_ms(self, kernel: Any, args: tuple, roofline_ms: float) -> float:
        """The generated ``kernel`` run on real buffers laid out as ``args`` (rule 1), once
        per kernel and layout; ``roofline_ms`` where it raises on them."""
        key = (kernel, *_layout(args))
        if key not in self._timed:
            with _outside_modes():
                try:
                    buffers = _real_buffers(args)
                    self._timed[key] = _least_ms(lambda: kernel(*buffers))
                except Exception:  # an index check the zeros fail, a dtype without random
                    self._timed[key] = roofline_ms  # numbers (float8): the roofline stands
        return self._timed[key]

    def _host_ms(self, func: Any, args: tuple, kwargs: dict) -> float:
        """``func`` run on this host on random tensors like ``args`` and ``kwargs`` (their
        shapes, strides and dtypes), once per such call: the least of ``REPEATS``, in ms."""
        key = (func, *(_signature(t) for t in tree_leaves((args, kwargs))))
        if key not in self._timed:
            real_args, real_kwargs = tree_map(_real_like, (args, kwargs))
            with _outside_modes():
                self._timed[key] = _least_ms(lambda: func(*real_args, **real_kwargs))
        return self._timed[key]


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype)
    return value if isinstance(value, (int, float, bool, str, type(None))) else type(value)


def _real_like(value: Any) -> Any:
    """A real CPU tensor of ``value``'s shape, strides and dtype (random where it is
    floating), else ``value``."""
    if not isinstance(value, torch.Tensor):
        return value
    with _outside_modes():
        real = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
        return real.normal_(generator=_GENERATOR) if real.is_floating_point() \
            else real.zero_()


def _layout(args: tuple) -> list[Any]:
    """What a kernel's time depends on: each argument's signature, and which of them share
    a storage (by the first argument on it)."""
    first: dict[int, int] = {}
    layout = []
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            owner = first.setdefault(StorageWeakRef(value.untyped_storage()).cdata, index)
            layout.append((_signature(value), value.storage_offset(), owner))
        else:
            layout.append(_signature(value))
    return layout


def _real_buffers(args: tuple) -> list[Any]:
    """``args`` with each tensor made a real CPU tensor of its layout, on one real storage
    per storage they share, as far as they reach into it (a slice of a large buffer does not
    allocate the buffer); floats random, all else zero."""
    reach: dict[int, int] = {}
    for value in args:
        if isinstance(value, torch.Tensor):
            key = StorageWeakRef(value.untyped_storage()).cdata
            reach[key] = max(reach.get(key, 0), _reach_bytes(value))
    storages: dict[int, torch.Tensor] = {}
    real_args = []
    for value in args:
        if not isinstance(value, torch.Tensor):
            real_args.append(value)
            continue
        key = StorageWeakRef(value.untyped_storage()).cdata
        if key not in storages:
            storages[key] = torch.zeros(reach[key], dtype=torch.uint8)
        base = storages[key]
        if value.is_floating_point() and base.numel() % value.element_size() == 0:
            base.view(value.dtype).normal_(generator=_GENERATOR)
        real = torch.empty(0, dtype=value.dtype)
        real_args.append(real.set_(base.untyped_storage(), value.storage_offset(),
                                   value.shape, value.stride()))
    return real_args


def _reach_bytes(tensor: torch.Tensor) -> int:
    """Bytes of its storage a tensor reaches: to its last element."""
    last = tensor.storage_offset() + sum((size - 1) * stride for size, stride
                                         in zip(tensor.shape, tensor.stride(), strict=True)
                                         if size > 0)
    return (last + 1) * tensor.element_size() if tensor.numel() else 0


def _outside_modes() -> Any:
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _least_ms(run: Any) -> float:
    run()
    times = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return min(times) * 1e3


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    count = flop_registry.get(getattr(func, "_overloadpacket", None))
    if count is None:
        return 0
    try:
        return int(count(*args, **kwargs, out_val=out))
    except Exception:  # a signature the counter does not take: a roofline without FLOPs
        return 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage and offset (a buffer passed twice is read once)."""
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for tensor in tensors:
        key = (StorageWeakRef(tensor.untyped_storage()).cdata, tensor.storage_offset())
        if key not in seen or _nbytes(tensor) > _nbytes(seen[key]):
            seen[key] = tensor
    return list(seen.values())
