"""Peak allocated bytes of one step on the CPU, measured without changing the step.

On a GPU ``torch.cuda.max_memory_allocated`` is the measure (less what the process held
besides the step when it began: ``verification.measure_step``). On the CPU there is no
allocator statistic, so :class:`PeakTracker` counts what ``MemTracker``
(``torch.distributed._tools``) counts — parameters, buffers, inputs, and every storage an
op allocates while it lives (activations, gradients, temporaries that outlive an op) — as
a dispatch mode that watches storages through weak references. It hooks no module: MemTracker's
module tracker registers ``register_multi_grad_hook(..., mode="all")`` on every module's
inputs, which holds the first gradients of a multi-input module until the last arrives
(measured: +2.8 % on a 2-layer BERT over the same step untracked), and registers a gradient
hook on every parameter, which fails on frozen ones (Whisper's positional embeddings,
PEFT adapters). ``tests/test_measure.py`` holds the two to the same numbers where MemTracker
is undisturbed.

A dispatch mode still gives every tensor a Python wrapper, so autograd adds gradients into
existing buffers out of place (as under MemTracker); the profile's observed backward runs
under one too, so prediction and measurement see the same engine behaviour, and a run
without any mode (training on a GPU) holds at most that much.

A compiled step's generated code (inductor's C++ on the CPU) allocates its buffers below the
dispatcher, where no dispatch mode sees them: :func:`allocator_peak` reads the CPU
allocator's own events as torch's profiler records them (``profile_memory=True``), every
allocation and free with its size, in order. On an eager step the two measures agree
(``tests/test_measure.py``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from profiles.parallel import local_tensor, storage_nbytes

__all__ = ["AllocatorPeak", "PeakTracker", "allocator_peak", "garbage_kept", "host_memory",
           "least_peak_over_gloo", "storages_bytes"]


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The storage a tensor allocates on this process: a DTensor's is its local shard's."""
    return local_tensor(tensor).untyped_storage()


def storages_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages under ``tensors``, each storage counted once."""
    storages = {StorageWeakRef(_storage(t)): _storage(t).nbytes() for t in tensors}
    return sum(storages.values())


_host = threading.local()


class AllocatorPeak(NamedTuple):
    """What the CPU allocator held during a call, in bytes above what it held when the call
    began: at most (``peak_bytes``) and at the end (``end_bytes``); ``events`` counts the
    allocations and frees seen; ``kept_bytes``: what the call's allocations still hold once
    Python's cycle collector has run after it (``end_bytes`` where it did not run)."""

    peak_bytes: int
    end_bytes: int
    events: int
    kept_bytes: int = 0


def allocator_peak(call: Callable[[], Any],
                   collect_after: Callable[[], bool] | None = None) -> AllocatorPeak:
    """Run ``call()`` under torch's profiler with memory profiling and replay the CPU
    allocator's events in time order. Counts every CPU tensor's allocation, also those of a
    compiled graph's generated code and of kernels' internal temporaries, which a dispatch
    mode does not see; not what Python objects or the allocator's own bookkeeping take.
    ``collect_after``: where it returns True after ``call``, Python's cycle collector runs
    inside the measure, so ``kept_bytes`` says what more than garbage holds (what a compile leaves:
    :mod:`planner.runtime.compile_garbage`).

    A free counts only where its block was allocated during the call: the profiler reports
    the free of any block whose size it recorded, also in an earlier profiled call, and such
    a block (garbage collected during this call, a cache replaced) freed here made the
    count read below what the call held (measured: a compiled Llama step read 0.57 MiB low
    in a process that had profiled other steps first)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
        if collect_after is not None and collect_after():
            with torch.profiler.record_function(_COLLECTING):
                gc.collect()
    events: list[tuple[int, int, int]] = []
    collected_at = None  # when the collection began (ns)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation and str(node.typed[1].device) == "cpu":
            fields = node.typed[1]
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        elif node.name == _COLLECTING:
            collected_at = node.start_time_ns
        stack.extend(node.children)
    allocated: dict[int, int] = {}  # address -> size, of blocks this call allocated
    live = peak = 0
    end = None
    for when, size, ptr in sorted(events):
        if collected_at is not None and end is None and when >= collected_at:
            end = live
        if size < 0 and allocated.pop(ptr, None) is None:
            continue  # allocated before this call
        if size > 0:
            allocated[ptr] = size
        live += size
        peak = max(peak, live)
    return AllocatorPeak(peak, live if end is None else end, len(events), live)


_COLLECTING = "planner: the cycle collector after the measured call"


def least_peak_over_gloo(step: Callable[[], int], steps: int = 2) -> int:
    """The least of ``steps`` peaks that ``step()`` measures on a gloo rank, each on a fresh
    model: the peak of the program, not of gloo's worker thread.

    gloo runs a functional collective (tensor parallel's all-reduces) on a worker thread
    that marks the work done, waking the rank, and only then drops its reference to the
    output: right after ``wait``, 5 % of 3,000 all-reduce outputs of (4, 64, 64) were
    still referenced (two ranks, an idle machine). The rank frees that output a few ops
    later than the program does whenever the worker is not scheduled meanwhile, and on a
    busy machine that once held one activation past a rank's peak (+64 KiB, 1 of 192 rows
    of ``benchmarks/distributed.py``). The lag only ever adds, so the least of two steps
    is the program's peak unless both steps lag at their peaks."""
    return min(step() for _ in range(steps))


@contextlib.contextmanager
def garbage_kept() -> Iterator[None]:
    """Python's cycle collector paused while inside: a tensor only a reference cycle holds
    stays counted until the cycle is collected, which training does at no step it chooses.
    Measured: HF GPT-2's compiling step leaves its logits in a cycle (0.5 MiB of a 6.7 MiB
    step); a cold compile's many objects ran the collector before the step ended, and the
    measure read 0.5 MiB less than when the graph came from inductor's cache."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """Tensors made inside are host memory (offload's buffers): a `PeakTracker` counts them
    in ``host_bytes``, not in the device's ``live_bytes``."""
    _host.depth = getattr(_host, "depth", 0) + 1
    try:
        yield
    finally:
        _host.depth -= 1


def _plain_tensors_alive() -> list[torch.Tensor]:
    """Every tensor alive that is not a subclass dispatching on its own (a DTensor's local
    shard is one of these; the DTensor is not), after a collection. Types, not
    ``isinstance``: deprecated objects warn on ``__class__``. Filtered in C: half a million
    objects take 0.3 s one by one in Python."""
    gc.collect()
    objects = gc.get_objects()
    plain = {kind for kind in set(map(type, objects)) if issubclass(kind, torch.Tensor)
             and kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__}
    return list(itertools.compress(objects, map(plain.__contains__, map(type, objects))))


class PeakTracker(TorchDispatchMode):
    """``with PeakTracker(static_tensors) as t: step()``, then ``t.peak_bytes``.

    ``static_tensors`` (parameters, buffers, inputs) count for the whole step, each storage
    once, as does any other tensor from before the step that an op reads (a loss target);
    everything ops allocate counts while alive, and so do ``held`` tensors from before the
    step (the last step's gradients, which ``zero_grad()`` frees half-way).
    """

    def __init__(self, static_tensors: Iterable[torch.Tensor], *,
                 follow_resizes: bool = False, held: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._static: set[StorageWeakRef] = set()
        self.static_bytes = 0
        for tensor in static_tensors:
            self._keep_static(tensor)
        self._live: dict[StorageWeakRef, int] = {}
        self._live_bytes = self.static_bytes
        for tensor in held:
            if StorageWeakRef(_storage(tensor)) not in self._static:
                self._track(tensor)
        self.peak_bytes = self._live_bytes
        # FSDP2 frees and re-allocates unsharded parameters by resizing their storages
        # (``untyped_storage().resize_``, no op a dispatch mode sees): with
        # ``follow_resizes`` every tensor alive in the process when the step starts counts
        # (as the CUDA allocator counts everything allocated: DDP's gradient buckets,
        # FSDP2's shards and its emptied unsharded storages), and every storage is counted
        # at its current size, read before each op through its weak reference (not through
        # a tensor on it, which may die while the storage lives on in another view)
        self.follow_resizes = follow_resizes
        self._bystanders: dict[StorageWeakRef, int] = {}  # from before, never touched
        self._bystander_bytes = 0  # of those, alive now
        self.own_peak_bytes = self.peak_bytes
        # host memory (``host_memory()``): offloaded copies, counted apart
        self._host: dict[StorageWeakRef, int] = {}
        self.host_bytes = 0
        self.host_peak_bytes = 0

    @property
    def live_bytes(self) -> int:
        """The bytes alive now. Deaths are otherwise noticed at the next op: a tensor freed
        after the step's last op (``del`` of what a backward left) would still count."""
        self._forget_dead()
        return self._live_bytes

    def __enter__(self) -> PeakTracker:
        if self.follow_resizes:
            for obj in _plain_tensors_alive():
                if obj.device.type != "meta" and StorageWeakRef(_storage(obj)) not in \
                        self._static:
                    self._track(obj)
            self._bystanders = dict(self._live)
            self._bystander_bytes = sum(self._bystanders.values())
            self._note_peak()
        return super().__enter__()

    def _note_peak(self) -> None:
        """``peak_bytes`` counts everything alive; ``own_peak_bytes`` (with
        ``follow_resizes``) leaves out the tensors alive when the step began that it never
        reads, writes or resizes (a device mesh, another model), each only while it lives:
        one freed half-way (by a collective's worker thread, a cache) was never the step's."""
        self.peak_bytes = max(self.peak_bytes, self._live_bytes)
        self.own_peak_bytes = max(self.own_peak_bytes, self._live_bytes - self._bystander_bytes)

    def _touch(self, ref: StorageWeakRef) -> None:
        """The step used a storage it found (a loss target, DDP's buckets): it was the
        step's all along, at every instant so far, so the own peak gains its size."""
        nbytes = self._bystanders.pop(ref, 0)
        self._bystander_bytes -= nbytes
        self.own_peak_bytes += nbytes

    def _refresh_sizes(self) -> None:
        for ref, old in self._live.items():
            nbytes = storage_nbytes(ref)
            if nbytes != old:
                self._live_bytes += nbytes - old
                self._live[ref] = nbytes
                self._touch(ref)

    def _track(self, tensor: torch.Tensor) -> None:
        ref = StorageWeakRef(_storage(tensor))
        if ref not in self._live:
            nbytes = _storage(tensor).nbytes()
            self._live[ref] = nbytes
            self._live_bytes += nbytes

    def _keep_static(self, tensor: torch.Tensor) -> None:
        ref = StorageWeakRef(_storage(tensor))
        if ref not in self._static:
            self._static.add(ref)
            self.static_bytes += _storage(tensor).nbytes()

    def _forget_dead(self) -> None:
        dead = [ref for ref in self._live if ref.expired()]
        for ref in dead:
            self._live_bytes -= self._live.pop(ref)
            self._bystander_bytes -= self._bystanders.pop(ref, 0)
        for ref in [ref for ref in self._host if ref.expired()]:
            self.host_bytes -= self._host.pop(ref)

    def _track_host(self, out: object) -> None:
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                ref = StorageWeakRef(_storage(tensor))
                if ref not in self._host:
                    self._host[ref] = _storage(tensor).nbytes()
                    self.host_bytes += self._host[ref]
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._forget_dead()
        if getattr(_host, "depth", 0):
            out = func(*args, **(kwargs or {}))
            self._track_host(out)
            return out
        if self.follow_resizes:
            self._refresh_sizes()
        for tensor in tree_leaves((args, kwargs)):
            # made before the step and read by it (a loss target the loss closes over):
            # allocated all along; but ``torch.tensor(...)`` in forward enters through
            # lift_fresh, a temporary counted below as that op's output
            if func is torch.ops.aten.lift_fresh.default or not isinstance(
                    tensor, torch.Tensor):
                continue
            ref = StorageWeakRef(_storage(tensor))
            self._touch(ref)
            if ref in self._static or ref in self._host:
                continue
            if self.follow_resizes:
                self._track(tensor)
            elif ref not in self._live:
                before = self.static_bytes
                self._keep_static(tensor)
                self._live_bytes += self.static_bytes - before
        self._note_peak()
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            ref = StorageWeakRef(_storage(tensor))
            self._touch(ref)
            if ref not in self._static and ref not in self._host:
                self._track(tensor)
        self._note_peak()
        return out
