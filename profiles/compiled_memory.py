"""What a compiled step allocates, counted on fake tensors: inductor compiles, nothing runs.

``torch.compile`` traces the step on fake tensors anyway (dynamo, then aot_autograd's joint
graph and the min-cut partitioner, with a plan's checkpoint tags); inductor then fuses and
schedules each graph and writes its Python wrapper: every buffer the graph allocates
(``empty_strided_cpu`` / ``_cuda``), reuses (``buf7 = buf2; del buf2``), frees (``del``) and
returns, around calls of the generated kernels (``cpp_fused_*``, triton launches) and of
torch's own ops (``extern_kernels.mm``, fallbacks). :func:`inductor_on_fake` compiles each
graph with inductor as ``torch.compile`` does and runs its wrapper on fake tensors with the
generated kernels stubbed out (they write into buffers the wrapper allocated; their values
do not change what is allocated) and the allocating helpers replaced by their
``torch.empty_strided`` / ``as_strided`` equivalents, which fake tensors run.
:class:`CountingFakeMode` counts every storage the step makes, compiled graphs and eager ops
(the loss, autograd's accumulation) alike, and when each is freed.

Dynamo does not compile under an active dispatch mode (it runs such calls eager), so the step
runs on fake tensors *without* the mode active: a fake tensor brings its mode into each op
it takes part in, and the wrappers enter the mode themselves (their allocations take no
fake tensor). What fake tensors do not show: a kernel's own temporaries (a CPU convolution's
scratch: ResNet's compiled step measured 2.7 % above its count; a cuDNN workspace).

Given a :class:`profiles.compiled_time.KernelClock`, the same run times the step: each
stubbed kernel and each aten op counted is charged on the clock's roofline, and each graph
called its call cost.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from profiles.compiled_time import KernelClock

__all__ = ["CountingFakeMode", "inductor_on_fake"]

# the wrapper's allocating helpers (torch._C._dynamo.guards' C functions, which make plain
# tensors past any mode), by device
_EMPTY_STRIDED = ("cpu", "cuda", "xpu", "mtia")


class CountingFakeMode:
    """A fake tensor mode (``.mode``, a plain ``FakeTensorMode``: higher-order ops such as
    checkpoint's ``run_and_save_rng_state`` find their fake rules by the mode's exact type)
    whose ops, inside :meth:`counting`, are counted: the bytes of the storages they make
    and still alive, at most (``peak_bytes``) and now (:meth:`live_bytes`), beside the
    storages of ``resident`` tensors (counted by the caller). A storage is freed when its
    last tensor is: the count drops before the next op. ``clock``: times the same ops, and
    the kernels of :func:`inductor_on_fake`, while counting (restarted each time)."""

    def __init__(self, clock: KernelClock | None = None) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._dispatch = self.mode.dispatch
        self.mode.dispatch = self._counted_dispatch  # FakeTensorMode calls self.dispatch
        self._counting, self._depth = False, 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._resident: set[int] = set()
        self.peak_bytes = 0
        self.clock = clock

    @contextlib.contextmanager
    def counting(self, resident: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        self._live = {}
        self._resident = {StorageWeakRef(t.untyped_storage()).cdata
                          for t in resident if isinstance(t, torch.Tensor)}
        self.peak_bytes = 0
        self._counting = True
        if self.clock is not None:
            self.clock.restart()
            self.clock.running = True
        try:
            yield
        finally:
            self._counting = False
            if self.clock is not None:
                self.clock.running = False

    def live_bytes(self) -> int:
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            del self._live[key]
        return sum(size for _, size in self._live.values())

    def _counted_dispatch(self, func: Any, types: Any, args: tuple = (),
                          kwargs: dict | None = None) -> Any:
        # an op fake mode runs through others (``addmm.out``: ``addmm``, then a copy into
        # ``out``) makes tensors the real kernel does not: only the outermost op's outputs
        # are the program's
        counted = self._counting and not self._depth and not _compiling()
        if counted:
            self.note_real(tree_leaves((args, kwargs)))
        self._depth += 1
        try:
            out = self._dispatch(func, types, args, kwargs)
        finally:
            self._depth -= 1
        if counted:
            self._note(out)
            if self.clock is not None:
                self.clock.aten(func, args, kwargs or {}, out)
        return out

    def note_real(self, values: Iterable[Any]) -> None:
        """Counts, while alive, the real tensors among ``values``: made outside the mode and
        handed to fake code (autograd materializes an unused output's gradient as real
        zeros and passes them to the compiled backward, where stubbed kernels alone read
        them; HF Llama's logits: 0.5 MiB of a 6.2 MiB step)."""
        if self._counting and not _compiling():
            self._note([v for v in values
                        if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor)])

    def _note(self, out: Any) -> None:
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            ref = StorageWeakRef(storage)
            known = self._live.get(ref.cdata)
            # a storage freed since the last op may have left its address to this one
            if (known is None or known[0].expired()) and ref.cdata not in self._resident:
                self._live[ref.cdata] = (ref, storage.nbytes())
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())


def _compiling() -> bool:
    """Whether dynamo or aot_autograd is tracing (their fake tensors are not the step's)."""
    from torch._guards import TracingContext

    return TracingContext.try_get() is not None


def inductor_on_fake(counter: CountingFakeMode) -> Callable[..., Any]:
    """A ``torch.compile`` backend: inductor's own compile (``compile_fx``: its decompositions,
    joint-graph passes, partitioner and scheduling), each graph's generated wrapper then run
    inside ``counter``'s mode with its kernels stubbed (timed on ``counter.clock``, where it
    has one), real tensors among its inputs counted."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    clock = counter.clock
    kernel = (lambda name, real: _NO_OP) if clock is None else \
        (lambda name, real: _Timed(clock, name, real if name.startswith("cpp_") else None))

    def inner_compile(graph: torch.fx.GraphModule, example_inputs: list, **options: Any):
        compiled = compile_fx_inner(graph, example_inputs, **options)
        wrapper = _kernels_stubbed(compiled.current_callable, kernel)

        def run(args: list) -> Any:
            counter.note_real(args)
            if counter.clock is not None:
                counter.clock.graph(sum(isinstance(a, torch.Tensor) for a in args))
            with counter.mode:
                return wrapper(args)

        compiled.current_callable = run
        return compiled

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        # AOT autograd's cache would return a whole compiled step, past inner_compile, with
        # its real kernels; inductor's graph cache (the user's setting) returns generated
        # code through compile_fx_inner, whose kernels inner_compile stubs as any other's:
        # a graph counted or measured before is not generated again
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(graph, example_inputs, inner_compile=inner_compile)

    return backend


def _kernels_stubbed(call: Callable[[list], Any],
                     kernel: Callable[[str, Any], Any] = lambda name, real: _NO_OP
                     ) -> Callable[[list], Any]:
    """The generated wrapper ``call`` (a function, or a method of inductor's ``Runner``) with
    each of its module's kernels replaced by ``kernel(its name, the kernel)`` (default: a
    no-op) and its allocating helpers by ones fake tensors run; the module itself is not
    changed."""
    function = getattr(call, "__func__", call)
    names = dict(function.__globals__)
    # every generated kernel: one left would get a fake tensor's address (a crash)
    for name in [n for n in names if n.startswith(("cpp_", "triton_"))]:
        names[name] = kernel(name, names[name])
    for device in _EMPTY_STRIDED:
        names[f"empty_strided_{device}"] = _empty_strided_on(device)
    names["reinterpret_tensor"] = _reinterpret
    stubbed = types.FunctionType(function.__code__, names, function.__name__,
                                 function.__defaults__, function.__closure__)
    owner = getattr(call, "__self__", None)
    return stubbed if owner is None else types.MethodType(stubbed, owner)


class _NoOp:
    """A kernel that does nothing: called (``cpp_fused_0(...)``) or launched
    (``triton_poi_0.run(...)``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> _NoOp:
        return self


_NO_OP = _NoOp()


class _Timed(_NoOp):
    """A kernel that does nothing but charge its call on a clock (its tensor arguments are
    the buffers it reads and writes); ``real``: the generated C++ kernel, which the clock
    may run on real buffers of the same layout (rule 1 on the host)."""

    def __init__(self, clock: KernelClock, name: str, real: Any = None) -> None:
        self._clock, self._name, self._real = clock, name, real

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self._clock.fused(args, self._name, self._real)

    def __getattr__(self, name: str) -> _Timed:
        return self


def _empty_strided_on(device: str) -> Callable[..., torch.Tensor]:
    def empty_strided(size: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    return empty_strided


def _reinterpret(tensor: torch.Tensor, size: tuple, stride: tuple,
                 offset: int = 0) -> torch.Tensor:
    """inductor's ``reinterpret_tensor``: a view at ``offset`` elements past the tensor's own."""
    return torch.as_strided(tensor, size, stride, tensor.storage_offset() + offset)
