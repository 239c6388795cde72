"""Profile one training step of a model as it runs eagerly: every aten op is a node.

What the planned model runs is the user's own eager model with checkpoints on some of its
modules, so the profile observes exactly that program, not a captured graph of it:

1. **Memory** (``_ForwardRecorder``): the forward and the loss run once under
   ``FakeTensorMode`` (exact shapes, dtypes and aliasing, no memory used) as the target
   device runs them (``profiles.fake``, ``profiles.kernels``), or on real tensors when the
   forward branches on tensor values it cannot know. A dispatch mode sees every aten op in
   call order, its inputs, the storages it allocates (views share their base's) and what it
   writes in place; module hooks give the span of nodes each module call ran (the regions a
   plan can checkpoint) and the tensors passed to it (what a checkpoint of it holds).
   ``saved_tensors_hooks`` see every tensor autograd saves, packed as placeholders so autograd
   holds nothing: a storage then dies exactly when the Python program drops it, which the
   recorder notices between ops (``StorageInfo.release``; a local variable outlives its last
   reader). A saved tensor belongs to the op it was packed for: autograd packs an op's inputs
   just before the op reaches the dispatch mode and its outputs just after, so the packs
   between two ops are split by identity with the next op's arguments.
2. **Backward**: each op that records autograd history is re-run alone on fresh leaves shaped
   like its inputs and differentiated, under the same dispatch mode, for its backward FLOPs,
   temporaries and which inputs receive gradients.
3. **Time** (``timing="measure"``): the step runs for real once more, recording each op's
   arguments; each op is timed alone (forward, and forward + backward) and the node times
   are scaled to the measured whole step; ``profiles.calibrate`` measures the checkpoint
   overhead. ``timing="estimate"`` uses FLOPs and bytes against a device roofline.

The model is left exactly as it was: parameters, buffers (they are swapped for copies while
the step runs), gradients and the RNG state.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry
from tqdm.auto import tqdm as _tqdm

from profiles.calibrate import calibrate_checkpoint_costs
from profiles.devices import DeviceSpec, device_spec
from profiles.errors import ProfileError
from profiles.fake import (
    KnownValues,
    MetaAsDevice,
    fake_converter,
    library_value_branches,
    meta_failures_at_debug,
)
from profiles.inputs import normalize_inputs
from profiles.kernels import FusedKernels
from profiles.parallel import (
    Parallelism,
    RuntimeMemory,
    fake_world,
    is_runtime_op,
    local_tensor,
    parallel_layout,
    parallel_twin,
)
from profiles.schema import (
    MAX_SCALE,
    GraphProfile,
    ModuleCall,
    NodeProfile,
    StaticMemory,
    StepTiming,
    StorageInfo,
    TensorMeta,
    fingerprint,
)
from profiles.swap import swapped_tensors
from profiles.traced import traced_calls

log = logging.getLogger(__name__)

LOSS_NODE = "loss"
CALIBRATION_S = 0.5  # time spent measuring checkpoint overhead (timing="measure")

# ops that update their arguments in place without saying so in their schema
_UNDECLARED_WRITES = {
    "aten.native_batch_norm.default": (3, 4),
    "aten.cudnn_batch_norm.default": (3, 4),
    "aten.miopen_batch_norm.default": (3, 4),
}


# ----------------------------------------------------------------------------- loss


def _bar(items: Any, desc: str, progress: bool) -> Any:
    """A progress bar over ``items`` on a terminal or in a notebook; plain iteration in
    logs and CI, where tqdm would write carriage returns."""
    shown = _in_notebook() or getattr(sys.stderr, "isatty", lambda: False)()
    return _tqdm(items, desc=desc, leave=False, disable=not (progress and shown))


def _in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (a module merely imported does not count)."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model output when the user gave no loss_fn.

    A scalar output is the loss; HF-style outputs carry ``.loss`` / ``["loss"]`` when labels
    were passed, and a tuple whose first element is a scalar (``(loss, logits)``) starts
    with it. Anything else needs an explicit ``loss_fn``.
    """
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(())
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, tuple | list) and output \
            and isinstance(output[0], torch.Tensor) and output[0].numel() == 1:
        loss = output[0].reshape(())
    if isinstance(loss, torch.Tensor):
        return loss
    kind = type(output).__name__
    shape = f" of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else ""
    raise ValueError(
        f"Cannot tell the training loss from the model's output ({kind}{shape}): pass "
        "loss_fn=lambda output: ... returning a scalar tensor (for HF models, passing "
        "`labels` in the inputs makes the output carry `.loss`)."
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _device_name(device_type: str) -> str:
    """The device a measured profile ran on: "cpu", or "cuda (NVIDIA H100 80GB HBM3)" (the
    model's name finds the device's copy path to the host, `profiles.devices`)."""
    if device_type == "cuda" and torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name()})"
    return device_type


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- storages


@dataclass
class _Storages:
    """Storage registry: ids for live storages, their kind, size, producer and death.

    Static storages (params, buffers, inputs) are held by the model and the caller for the
    whole step. Activations are watched through weak references: ``poll`` notes which died
    since the last op (``release``) and forgets them, so a new storage at a reused address
    gets a new id.
    """

    refs: dict[StorageWeakRef, int] = field(default_factory=dict)
    infos: list[dict[str, Any]] = field(default_factory=list)
    watched: dict[int, StorageWeakRef] = field(default_factory=dict)

    def lookup(self, tensor: torch.Tensor) -> int | None:
        ref = StorageWeakRef(local_tensor(tensor).untyped_storage())
        sid = self.refs.get(ref)
        if sid is None:
            return None
        watched = self.watched.get(sid)
        if watched is not None and watched.expired():  # died; the address was reused
            self._forget(sid, self.infos[sid]["producer"])
            return None
        return sid

    def add(self, tensor: torch.Tensor, kind: str, producer: int | None,
            name: str = "") -> int:
        sid = self.lookup(tensor)
        if sid is not None:
            return sid
        storage = local_tensor(tensor).untyped_storage()  # a DTensor's: its shard's
        ref = StorageWeakRef(storage)
        sid = len(self.infos)
        self.refs[ref] = sid
        self.infos.append({"id": sid, "nbytes": storage.nbytes(), "kind": kind,
                           "producer": producer, "name": name, "release": None})
        if kind in ("activation", "internal"):
            self.watched[sid] = ref
        return sid

    def alias(self, tensor: torch.Tensor, sid: int) -> None:
        """``tensor``'s storage stands for storage ``sid`` (the fake twin of a constant
        that fake mode converted on the fly): later readers of it read ``sid``."""
        self.refs.setdefault(StorageWeakRef(local_tensor(tensor).untyped_storage()), sid)

    def _forget(self, sid: int, release: int | None) -> None:
        ref = self.watched.pop(sid)
        self.infos[sid]["release"] = release
        if self.refs.get(ref) == sid:
            del self.refs[ref]

    def poll(self, last_node: int) -> None:
        """Storages that died since the last poll were held by Python up to ``last_node``."""
        for sid, ref in list(self.watched.items()):
            if ref.expired():
                self._forget(sid, max(last_node, self.infos[sid]["producer"]))

    def close(self, last_node: int) -> None:
        """End of the forward: what is still alive was held up to ``last_node``."""
        for sid in list(self.watched):
            self._forget(sid, last_node)

    def total_bytes(self, kind: str) -> int:
        return sum(s["nbytes"] for s in self.infos if s["kind"] == kind)


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class _TensorSpec:
    """Enough of a tensor argument to make a stand-in for an isolated run of its op."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    storage: int | None
    param: bool
    sharded: bool = False  # a DTensor's shard: shape arguments of its op are global

    def make(self, real: bool) -> torch.Tensor:
        """A leaf with this layout: random floats on real devices, zeros for indices and
        masks (valid wherever an op takes them)."""
        size = 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride, strict=True)) \
            if all(self.shape) else 0
        floating = self.dtype.is_floating_point or self.dtype.is_complex
        if floating and real:
            flat = torch.randn(size, dtype=self.dtype, device=self.device)
        else:
            flat = torch.zeros(size, dtype=self.dtype, device=self.device)
        return flat.as_strided(self.shape, self.stride).detach().requires_grad_(
            self.requires_grad and floating)


@dataclass
class _OpRecord:
    index: int
    func: Any
    name: str
    call: int | None  # innermost module call
    grad_enabled: bool
    arg_specs: Any  # (args, kwargs) with tensors replaced by _TensorSpec
    reads: list[int] = field(default_factory=list)
    outputs: list[TensorMeta] = field(default_factory=list)
    new_storages: list[int] = field(default_factory=list)
    written: list[int] = field(default_factory=list)  # activations written in place
    mutated_state: list[int] = field(default_factory=list)  # params/buffers written
    saved: list[int] = field(default_factory=list)  # storage ids, one per pack
    packed_after_running: bool = False  # some pack came after the op ran (its outputs)
    random: bool = False
    flops: int = 0
    estimated_ms: float = 0.0
    runtime_bytes: int | None = None  # a parallel step: what its runtime holds meanwhile
    runtime_ops_before: int = 0


@dataclass
class _CallRecord:
    index: int
    path: str
    module_type: str
    start: int
    parent: int | None
    call_number: int
    inputs: list[int]
    stop: int = -1


class _Placeholder:
    """What autograd holds for a saved tensor while memory is recorded: nothing real."""

    __slots__ = ()


def _unpack_placeholder(_: Any) -> torch.Tensor:
    raise ProfileError("the memory run of the profiler never runs backward")


class _CallMarker(TorchFunctionMode):
    """Tells the recorder where each torch function call begins (see `_resolve_packs`)."""

    def __init__(self, recorder: _ForwardRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.recorder.mark()
        return func(*args, **(kwargs or {}))


class _ForwardRecorder(TorchDispatchMode):
    """Runs the forward and the loss, recording ops, storages, saves and module calls."""

    def __init__(self, storages: _Storages, spec: DeviceSpec | None,
                 paths: dict[int, str]) -> None:
        super().__init__()
        self.storages = storages
        self.spec = spec
        self.paths = paths  # id(module) -> path
        self.records: list[_OpRecord] = []
        self.calls: list[_CallRecord] = []
        self.stack: list[int] = []
        self.call_counts: Counter[str] = Counter()
        self.pending: list[torch.Tensor] = []  # packed since the last op
        self.marker = 0  # packs before it came before the last torch function call began
        self.runtime: RuntimeMemory | None = None  # a parallel step's runtime memory
        self.runtime_peak = 0  # most the runtime held since the last op of the model's
        self.runtime_ops = 0  # runtime ops since then

    # ------------------------------------------------------------ saved tensors
    def pack(self, tensor: torch.Tensor) -> _Placeholder:
        self.pending.append(tensor)
        return _Placeholder()

    def _runtime_storage(self, tensor: torch.Tensor) -> int | None:
        """The id of ``tensor``'s storage when the parallel runtime made it (FSDP2's gathered
        parameters and views of them): static for the plan, its bytes the runtime's."""
        if self.runtime is None or not self.runtime.holds(tensor):
            return None
        return self.storages.add(tensor, "runtime", None, "runtime")

    def mark(self) -> None:
        """A torch function call begins: what was packed until now belongs to earlier ops."""
        self.marker = len(self.pending)

    def _resolve_packs(self, args: Any) -> list[int]:
        """Split the packs since the last op between that op (its outputs, saved after it
        ran) and the op about to run (its inputs, saved just before it reaches this mode,
        so they are the last packs, after the start of its torch function call, and each is
        one of its arguments). Returns the latter."""
        marker, self.marker = self.marker, 0
        if not self.pending:
            return []
        arg_ids = Counter(id(t) for t in _tensors(args))
        split = len(self.pending)
        while split > marker and arg_ids[id(self.pending[split - 1])] > 0:
            arg_ids[id(self.pending[split - 1])] -= 1
            split -= 1
        last = len(self.records) - 1
        upcoming: list[int] = []
        for position, tensor in enumerate(self.pending):
            to_last = position < split and last >= 0
            sid = self.storages.lookup(tensor)
            if sid is None:
                sid = self._runtime_storage(tensor)
            if sid is None and last >= 0:  # made outside any op we saw (a custom Function)
                sid = self.storages.add(tensor, "internal", last)
                self.records[last].new_storages.append(sid)
            elif sid is None:
                sid = self.storages.add(tensor, "constant", None, "constant")
            if to_last:
                self.records[last].saved.append(sid)
                self.records[last].packed_after_running = True
            else:
                upcoming.append(sid)
        self.pending.clear()
        return upcoming

    def flush(self) -> None:
        """After the last op: its output saves."""
        self._resolve_packs(())

    # ------------------------------------------------------------ module calls
    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        path = self.paths.get(id(module))
        if path is None:
            return
        inputs = sorted({sid for t in _tensors((args, kwargs))
                         if (sid := self.storages.lookup(t)) is not None})
        call = _CallRecord(len(self.calls), path, type(module).__name__, len(self.records),
                           self.stack[-1] if self.stack else None, self.call_counts[path],
                           inputs)
        self.call_counts[path] += 1
        self.calls.append(call)
        self.stack.append(call.index)

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.paths.get(id(module)) is None or not self.stack:
            return
        call = self.calls[self.stack.pop()]
        call.stop = len(self.records)

    # ------------------------------------------------------------ ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":
            return func(*args, **kwargs)
        if self.runtime is not None and is_runtime_op():
            return self._runtime_op(func, args, kwargs)
        inputs = _tensors((args, kwargs))
        # a tensor no op made: a module attribute or a loss target, there all step; but
        # ``torch.tensor(...)`` in forward enters through lift_fresh: a temporary this op
        # makes (its output is that tensor), made again by every rerun
        if func is not torch.ops.aten.lift_fresh.default:
            for tensor in inputs:
                if self.storages.lookup(tensor) is None and \
                        self._runtime_storage(tensor) is None:
                    self.storages.add(tensor, "constant", None, "constant")
        upcoming = self._resolve_packs((args, kwargs))
        self.storages.poll(len(self.records) - 1)
        index = len(self.records)
        record = _OpRecord(index, func, str(func), self.stack[-1] if self.stack else None,
                           torch.is_grad_enabled(), None, saved=upcoming)
        record.arg_specs = tree_map(self._spec, (args, kwargs))
        record.reads = sorted({sid for t in inputs
                               if (sid := self.storages.lookup(t)) is not None})
        record.written, record.mutated_state = self._writes(func, args, kwargs)
        record.random = torch.Tag.nondeterministic_seeded in func.tags
        if self.runtime is not None:
            record.runtime_bytes = max(self.runtime_peak, self.runtime.nbytes())
            record.runtime_ops_before = self.runtime_ops
            self.runtime_peak = self.runtime_ops = 0
        self.records.append(record)

        out = func(*args, **kwargs)

        first = len(self.storages.infos)
        views = [r.alias_info is not None for r in func._schema.returns]
        for k, tensor in enumerate(_tensors(out)):  # new storages, or views of inputs
            sid = self.storages.lookup(tensor)
            if sid is None:
                sid = self._runtime_storage(tensor)
            if sid is None and k < len(views) and views[k] and inputs:
                # a view of a tensor that fake mode converted on the fly (a closure constant
                # such as a loss target): it shares that tensor's storage
                sid = self.storages.lookup(inputs[0])
                if sid is not None:
                    self.storages.alias(tensor, sid)
            if sid is None:
                sid = self.storages.add(tensor, "activation", index)
            local = local_tensor(tensor)  # a DTensor: this rank's shard
            record.outputs.append(TensorMeta(
                shape=list(local.shape), dtype=_dtype_name(local.dtype),
                nbytes=_nbytes(local), storage=sid, requires_grad=False))
        record.new_storages = list(range(first, len(self.storages.infos)))
        # this rank's work: on its shards (a DTensor op runs its op on them)
        local_args, local_kwargs, local_out = tree_map(local_tensor, (args, kwargs, out))
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            with contextlib.suppress(Exception):
                record.flops = int(counter(*local_args, **local_kwargs, out_val=local_out))
        if self.spec is not None:
            record.estimated_ms = self.spec.estimate_ms(
                func, _tensors((local_args, local_kwargs)), _tensors(local_out), record.flops)
        return out

    def _runtime_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op of the parallel runtime: no node; what it makes is runtime memory (a view
        of the model's tensor, such as FSDP2's backward hook on an output, is not)."""
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            if self.storages.lookup(local_tensor(tensor)) is None:
                self.runtime.add(tensor)
        self.runtime_ops += 1
        self.runtime_peak = max(self.runtime_peak, self.runtime.nbytes())
        return out

    def _spec(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        local = local_tensor(value)  # an op's backward on this rank runs on its shards
        sid = self.storages.lookup(local)
        param = sid is not None and self.storages.infos[sid]["kind"] == "param"
        return _TensorSpec(tuple(local.shape), tuple(local.stride()), local.dtype,
                           local.device, value.requires_grad, sid, param, local is not value)

    def _writes(self, func: Any, args: tuple, kwargs: dict) -> tuple[list[int], list[int]]:
        targets: list[Any] = []
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                targets.append(args[position] if position < len(args)
                               else kwargs.get(argument.name))
        undeclared = _UNDECLARED_WRITES.get(str(func))
        if undeclared and len(args) > 5 and args[5]:  # training: running stats update
            targets.extend(args[position] for position in undeclared if position < len(args))
        written, state = set(), set()
        for tensor in _tensors(targets):
            sid = self.storages.lookup(tensor)
            if sid is None:
                continue
            kind = self.storages.infos[sid]["kind"]
            (state if kind in ("param", "buffer") else written).add(sid)
        return sorted(written), sorted(state)


# ----------------------------------------------------------------------------- backward


class _WindowTracker(TorchDispatchMode):
    """FLOPs, roofline time and the peak of new storages alive during a block of ops."""

    def __init__(self, spec: DeviceSpec | None) -> None:
        super().__init__()
        self.spec = spec
        self.flops = 0
        self.estimated_ms = 0.0
        self.peak_new_bytes = 0
        self._new: dict[StorageWeakRef, int] = {}
        self._known: set[StorageWeakRef] = set()

    def reset(self, known: list[torch.Tensor]) -> None:
        self.flops, self.estimated_ms, self.peak_new_bytes = 0, 0.0, 0
        self._new = {}
        self._known = {StorageWeakRef(t.untyped_storage()) for t in known}

    def live_new_bytes(self) -> int:
        return sum(n for ref, n in self._new.items() if not ref.expired())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out
        inputs = _tensors((args, kwargs))
        aliased = {StorageWeakRef(t.untyped_storage()) for t in inputs} | self._known
        for tensor in _tensors(out):
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref not in aliased and ref not in self._new:
                self._new[ref] = tensor.untyped_storage().nbytes()
        self.peak_new_bytes = max(self.peak_new_bytes, self.live_new_bytes())
        flops = 0
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            with contextlib.suppress(Exception):
                flops = int(counter(*args, **kwargs, out_val=out))
        self.flops += flops
        if self.spec is not None:
            self.estimated_ms += self.spec.estimate_ms(func, inputs, _tensors(out), flops)
        return out


@dataclass
class _Backward:
    flops: int = 0
    estimated_ms: float = 0.0
    temp_bytes: int = 0
    grad_storages: list[int] = field(default_factory=list)  # inputs it sends gradients to
    output_requires_grad: list[bool] = field(default_factory=list)


def _written_positions(func: Any) -> set[int]:
    return {i for i, argument in enumerate(func._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write}


def _fresh_args(func: Any, args: Any, kwargs: Any
                ) -> tuple[Any, Any, list[torch.Tensor], list[torch.Tensor]]:
    """Copies of an op's arguments for an isolated run: tensors that need grad become new
    leaves (passed on through a clone, so in-place ops on them stay legal) and tensors the
    op writes are cloned (the recorded ones stay as they were). Returns (args, kwargs,
    leaves, the original tensor of each leaf)."""
    leaves: list[torch.Tensor] = []
    origins: list[torch.Tensor] = []
    written = _written_positions(func)

    def fresh(value: Any, write: bool) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.requires_grad:
            leaf = value.detach().clone().requires_grad_()
            leaves.append(leaf)
            origins.append(value)
            return leaf.clone()
        return value.detach().clone() if write else value.detach()

    new_args = tuple(tree_map(lambda v, w=(i in written): fresh(v, w), a)
                     for i, a in enumerate(args))
    new_kwargs = {k: tree_map(lambda v: fresh(v, False), v) for k, v in kwargs.items()}
    return new_args, new_kwargs, leaves, origins


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]


def _profile_backward(func: Any, args: Any, kwargs: Any, storages: list[int | None],
                      tracker: _WindowTracker) -> _Backward:
    """FLOPs, roofline time, temporaries and gradient targets of one op's backward, run in
    isolation on stand-in inputs; ``storages`` are the storage ids of the op's tensor args."""
    fresh_args, fresh_kwargs, leaves, origins = _fresh_args(func, args, kwargs)
    out = func(*fresh_args, **fresh_kwargs)
    outs = _grad_outputs(out)
    requires = [t.requires_grad for t in _tensors(out)]
    if not outs or not leaves:
        return _Backward(output_requires_grad=requires)
    grad_outputs = [torch.ones_like(t) for t in outs]
    tracker.reset([*leaves, *outs, *grad_outputs])
    with tracker:
        grads = torch.autograd.grad(outs, leaves, grad_outputs, allow_unused=True)
        final = tracker.live_new_bytes()
    arg_tensors = _tensors((args, kwargs))
    targets = set()
    for origin, grad in zip(origins, grads, strict=True):
        if grad is None:
            continue
        for position, tensor in enumerate(arg_tensors):
            if tensor is origin and storages[position] is not None:
                targets.add(storages[position])
    del grads
    return _Backward(tracker.flops, tracker.estimated_ms,
                     max(0, tracker.peak_new_bytes - final), sorted(targets), requires)


# ----------------------------------------------------------------------------- observed backward


class _BackwardObserver(TorchDispatchMode):
    """A fake training step with ordinary autograd: in forward, which autograd node each op
    made; in backward, the bytes the backward has allocated and still holds (gradients,
    temporaries) before, during and after each node's work.

    A gradient that a view's or an add's backward passes on allocates nothing; one added
    into an existing buffer may be summed out of place: the engine does what it does, and
    this records it, node by node. Nodes are matched to ops after the forward
    (``map_nodes``): autograd creates an op's node, numbering it, just before the op reaches
    this mode, so the counter read at each op says which node it made (checked by name:
    ``NativeBatchNormBackward0`` with ``native_batch_norm``); nodes that check fails for are
    aligned by name in creation order. ``grad_fn`` is not read inside the mode, where
    autograd may hold its own lock.
    """

    def __init__(self) -> None:
        super().__init__()
        self.backward = False
        self.runtime: RuntimeMemory | None = None  # a parallel step's: counted as held
        self.names: list[str] = []
        self.seqs: list[int] = []  # autograd's next sequence number when each op ran
        self.op_of_seq: dict[int, int] = {}  # autograd sequence number -> forward op
        self._live: dict[StorageWeakRef, int] = {}
        self.ops: list[tuple[int | None, int, int]] = []  # (forward op, live before, after)

    def map_nodes(self, loss: torch.Tensor) -> None:
        """Match the autograd nodes of ``loss``'s graph to the forward ops that made them."""
        import difflib
        import re

        seen: dict[int, str] = {}
        stack = [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = ""
            name = type(node).__name__
            if name != "AccumulateGrad":
                seen[id(node)] = name
                self._seq_name = getattr(self, "_seq_name", {})
                self._seq_name[node._sequence_nr()] = name
            stack.extend(n for n, _ in node.next_functions)
        by_seq = sorted(getattr(self, "_seq_name", {}).items())
        node_keys = [re.sub(r"Backward\d*$", "", name).lower() for _, name in by_seq]
        op_keys = [op.split(".")[1].replace("_", "").lower() if op.count(".") >= 2 else op
                   for op in self.names]
        left: list[int] = []  # positions in by_seq not placed by their sequence number
        for position, ((seq, _), key) in enumerate(zip(by_seq, node_keys, strict=True)):
            op = bisect.bisect_right(self.seqs, seq)  # the first op run after it was made
            if op < len(op_keys) and op_keys[op] == key:
                self.op_of_seq[seq] = op
            else:
                left.append(position)
        taken = set(self.op_of_seq.values())
        free_ops = [i for i in range(len(op_keys)) if i not in taken]
        matcher = difflib.SequenceMatcher(None, [node_keys[k] for k in left],
                                          [op_keys[i] for i in free_ops], autojunk=False)
        for a, b, size in matcher.get_matching_blocks():
            for k in range(size):
                self.op_of_seq[by_seq[left[a + k]][0]] = free_ops[b + k]

    def live_bytes(self) -> int:
        for ref in [r for r in self._live if r.expired()]:
            del self._live[ref]
        return sum(self._live.values()) + self._runtime_bytes()

    def _runtime_bytes(self) -> int:
        return self.runtime.nbytes() if self.runtime is not None else 0

    def _runtime_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The parallel runtime's op (FSDP2's all-gather, reduce-scatter): what it makes
        is runtime memory, held in backward like a gradient; in forward it is no node."""
        before = self.live_bytes() if self.backward else 0
        inputs = {StorageWeakRef(local_tensor(t).untyped_storage())
                  for t in _tensors((args, kwargs))}
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            if StorageWeakRef(local_tensor(tensor).untyped_storage()) not in inputs:
                self.runtime.add(tensor)
        if self.backward:
            self.ops.append((None, before, self.live_bytes()))
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":
            return func(*args, **kwargs)
        if self.runtime is not None and is_runtime_op():
            return self._runtime_op(func, args, kwargs)
        if not self.backward:
            self.names.append(str(func))
            self.seqs.append(torch._C._autograd._get_sequence_nr())
            return func(*args, **kwargs)
        before = self.live_bytes()
        inputs = {StorageWeakRef(local_tensor(t).untyped_storage())
                  for t in _tensors((args, kwargs))}
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            storage = local_tensor(tensor).untyped_storage()
            ref = StorageWeakRef(storage)
            if ref not in inputs and ref not in self._live:
                self._live[ref] = storage.nbytes()
        node = torch._C._current_autograd_node()
        forward = self.op_of_seq.get(node._sequence_nr()) if node is not None else None
        self.ops.append((forward, before, sum(self._live.values()) + self._runtime_bytes()))
        return out


def _observe_backward(step: _Step, names: list[str], real: bool, spec: DeviceSpec | None
                      ) -> list[tuple[int, int, int]] | None:
    """Per op of the profile (``names``, then the loss), the backward-held bytes before its
    backward, at its peak and after it, observed in a fake step, or in a real one when the
    forward ran on real tensors and fake ones cannot run the backward; None if neither can.
    """
    attempts = [False, True] if real else [False]
    if step.twin is not None:  # as the forward was recorded: the twin's runtime is its own
        attempts = [real]
    for on_real in attempts:
        observer = _BackwardObserver()
        try:
            if on_real:
                observer.runtime = step.renew(None)
            model = step.model
            with _real_state(step) if on_real else _fake_state(step, spec) as state:
                observer.runtime = observer.runtime or state.runtime
                _start_grads(state.params, step)
                _observe(step, observer, state.args, state.kwargs)
        except Exception as error:
            log.info("could not observe the backward of %s on %s tensors (%s)",
                     type(model).__name__, "real" if on_real else "fake", _first_line(error))
            continue
        return _per_op(observer, names)
    log.warning("could not observe the backward of %s; gradients are modelled instead",
                type(model).__name__)
    return None


def _observe(step: _Step, observer: _BackwardObserver, args: tuple, kwargs: dict) -> None:
    with observer:
        loss = step.forward_loss(args, kwargs)
        observer.map_nodes(loss)
        observer.backward = True
        loss.backward()


@dataclass
class _StepState:
    """The tensors a step runs on: the model's parameters by name (its own, or their fake
    twins, as swapped in) and the inputs."""

    params: dict[str, torch.Tensor]
    args: tuple
    kwargs: dict
    runtime: RuntimeMemory | None = None  # a parallel twin's


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


# ----------------------------------------------------------------------------- gradients


@dataclass(frozen=True)
class _GradView:
    storage: int  # index into _GradLayout.storages
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _GradLayout:
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
    def of(cls, params: dict[str, torch.Tensor]) -> _GradLayout:
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
                bases[view.storage] = torch.zeros(-(-nbytes // dtype.itemsize), dtype=dtype,
                                                  device=p.device)
            p.grad = bases[view.storage].as_strided(view.shape, view.stride, view.offset)


def _grad_layout(step: _Step, real: bool, spec: DeviceSpec | None) -> _GradLayout | None:
    """Where one backward from no gradients leaves the gradients, on a fake step, or on a
    real one when the forward ran on real tensors and fake ones cannot run the backward;
    None when neither can (each ``.grad`` is then taken as a tensor of its own)."""
    for on_real in [False, True] if real else [False]:
        try:
            with _real_state(step) if on_real else _fake_state(step, spec) as state:
                for p in state.params.values():
                    p.grad = None
                step.forward_loss(state.args, state.kwargs).backward()
                return _GradLayout.of(state.params)
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


def _per_op(observer: _BackwardObserver, names: list[str]) -> list[tuple[int, int, int]]:
    """Fold the observed backward ops onto the profile's ops (aligned by name where the
    observed forward differs, e.g. a mask a library builds only for fake tensors)."""
    import difflib

    n = len(names)
    mapping: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, observer.names, names, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            mapping[a + k] = b + k
    before: dict[int, int] = {}
    peak: dict[int, int] = {}
    after: dict[int, int] = {}
    current = n  # the loss pseudo-node: the seed made before any node runs
    for forward, live_before, live_after in observer.ops:
        target = mapping.get(forward) if forward is not None else None
        if target is not None and target < current:
            after[current] = live_before  # what it freed is gone once the next one starts
            current = target
        before.setdefault(current, live_before)
        peak[current] = max(peak.get(current, 0), live_after, live_before)
        after[current] = live_after
    rows: list[tuple[int, int, int]] = []
    carry = 0
    for j in range(n, -1, -1):  # backward order; nodes without work keep what is live
        if j in before:
            rows.append((before[j], peak[j], after[j]))
            carry = after[j]
        else:
            rows.append((carry, carry, carry))
    return rows[::-1]


# ----------------------------------------------------------------------------- timing


class _Timer:
    """Warm median wall time of a callable: CUDA events on a GPU, perf_counter on CPU.

    On CPU with one intra-op thread the process's CPU time is used instead: the same on a
    quiet host, but time the host gives other processes does not count; with more threads
    CPU time would add them up, so wall time stays.
    """

    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self.clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
        self.engine_overhead_ms = 0.0
        self.engine_overhead_ms = self._engine_overhead_ms()

    def _engine_overhead_ms(self) -> float:
        """Time of a backward through one trivial op: the per-call cost of the engine."""
        def setup() -> tuple:
            leaf = torch.ones(1, device=self.device, requires_grad=True)
            out = leaf.clone()
            return [out], [leaf], [torch.ones_like(out)]

        return self.median_ms(setup, _isolated_backward)

    def median_ms(self, setup: Callable[[], Any], run: Callable[[Any], Any]) -> float:
        samples = []
        for i in range(self.warmup + self.repeats):
            state = setup()
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(self.device)
                start.record()
                run(state)
                end.record()
                torch.cuda.synchronize(self.device)
                elapsed = start.elapsed_time(end)
            else:
                begin = self.clock()
                run(state)
                elapsed = (self.clock() - begin) * 1e3
            if i >= self.warmup:
                samples.append(elapsed)
        return statistics.median(samples)


def _isolated_backward(state: tuple[list[torch.Tensor], list[torch.Tensor], list]) -> Any:
    outs, leaves, grads = state
    if not outs or not leaves:
        return ()
    return torch.autograd.grad(outs, leaves, grads, allow_unused=True)


def _measure_op(func: Any, args: Any, kwargs: Any, timer: _Timer) -> tuple[float, float]:
    """Warm median forward and backward wall time of one op on real tensors.

    The backward time excludes the fixed cost of entering the autograd engine once per op,
    which a whole-step backward pays once (calibrated in ``_Timer``).
    """
    def forward(state: Any) -> Any:
        return func(*state[0], **state[1])

    def setup_backward() -> tuple:
        fresh_args, fresh_kwargs, leaves, _ = _fresh_args(func, args, kwargs)
        outs = _grad_outputs(func(*fresh_args, **fresh_kwargs))
        return outs, leaves, [torch.ones_like(t) for t in outs]

    forward_ms = timer.median_ms(lambda: _fresh_args(func, args, kwargs), forward)
    backward_ms = timer.median_ms(setup_backward, _isolated_backward)
    return forward_ms, _net_of_engine(backward_ms, timer)


ENGINE_FLOOR_SHARE = 0.1  # a backward keeps at least this share of its raw time


def _net_of_engine(raw_ms: float, timer: _Timer) -> float:
    """A backward's time less the engine's per-call cost, never below a share of the raw time.

    On a noisy host the calibrated cost can exceed a small op's whole backward; a floor of
    zero would then erase every op's share, and scaling zeros to the step's total explodes.
    """
    return max(raw_ms - timer.engine_overhead_ms, ENGINE_FLOOR_SHARE * raw_ms)


class _ArgRecorder(TorchDispatchMode):
    """Keeps every op's (func, args, kwargs) of a real run, for timing ops alone.

    Autograd saving an op's output detaches it (an ``aten.detach`` the profile, whose saves
    are hooked, does not see): those are views that cost nothing and are left out.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "prim" and func is not torch.ops.aten.detach.default:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


@dataclass
class _MeasuredTimes:
    per_node: list[tuple[float, float]]  # (forward, backward) ms per op, calibrated
    step_fwd_ms: float
    step_bwd_ms: float
    fwd_scale: float
    bwd_scale: float


# ----------------------------------------------------------------------------- the step


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
    grad_layout: _GradLayout | None = None  # how, with grads_at_start (`_grad_layout`)
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


@contextlib.contextmanager
def _module_hooks(model: nn.Module, recorder: _ForwardRecorder) -> Iterator[None]:
    handles = []
    try:
        for _, module in model.named_modules():
            # ours run last before forward and first after it: the span is forward's ops
            handles.append(module.register_forward_pre_hook(recorder.pre_hook,
                                                            with_kwargs=True))
            handles.append(module.register_forward_hook(recorder.post_hook, with_kwargs=True,
                                                        always_call=True, prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


_DATA_DEPENDENT = ("DataDependentOutputException", "DynamicOutputShapeException",
                   "UnsupportedOperatorException", "GuardOnDataDependentSymNode")


def _is_data_dependent(error: BaseException) -> bool:
    while error is not None:
        if type(error).__name__ in _DATA_DEPENDENT:
            return True
        if "meta tensors" in str(error) or "FakeTensor" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


@dataclass
class _Recorded:
    recorder: _ForwardRecorder
    storages: _Storages
    loss_storage: int | None
    real: bool
    backward: list[_Backward] = field(default_factory=list)
    static: StaticMemory | None = None


@contextlib.contextmanager
def _fake_step(step: _Step, spec: DeviceSpec | None) -> Iterator[Callable[[Any], Any]]:
    """Fake tensor mode for one step run as the device runs it (``profiles.fake``): meta
    tensors as fake ``step.meta_as`` ones, small values known. Yields the converter of
    real/meta tensors to fake ones. The step itself runs under :func:`_kernels`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    known = KnownValues()
    with meta_failures_at_debug(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        convert = fake_converter(mode, step.meta_as, known)
        with MetaAsDevice(convert), known, library_value_branches(known):
            yield convert


def _kernels(spec: DeviceSpec | None, real: bool) -> contextlib.AbstractContextManager:
    """On fake tensors, the fused kernels ``spec``'s device selects (``profiles.kernels``);
    enter it innermost, so that the ops it runs are seen like any other."""
    return FusedKernels(spec) if spec is not None and not real else contextlib.nullcontext()


@contextlib.contextmanager
def _observed(step: _Step, real: bool, spec: DeviceSpec | None
              ) -> Iterator[tuple[_Recorded, Callable[[Any], Any]]]:
    """Run the forward + loss once, fake or on real tensors, recording everything; yields
    the record and the converter to the tensors it ran on, inside that tensor mode."""
    storages = _Storages()
    with _fake_step(step, spec) if not real else contextlib.nullcontext(lambda t: t) \
            as convert:
        runtime = step.renew(None if real else convert)
        model = step.model
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        recorder = _ForwardRecorder(storages, spec,
                                    {id(m): n for n, m in model.named_modules()})
        recorder.runtime = runtime
        # buffers are updated by the forward: it runs on copies (fake ones are copies); a
        # parallel twin's parameters are its runtime's, fake already when the step is
        state = {k: convert(v) if runtime is None else v for k, v in params.items()}
        state.update({k: convert(v) if not real else v.detach().clone()
                      for k, v in buffers.items()})
        for key in params:  # a DTensor parameter: this rank's shard
            storages.add(local_tensor(state[key]), "param", None, key)
        for key in buffers:
            storages.add(state[key], "buffer", None, key)
        args, kwargs = tree_map(convert, (step.args, step.kwargs))
        for position, tensor in enumerate(_tensors((args, kwargs))):
            storages.add(tensor, "input", None, f"input{position}")
        with (swapped_tensors(model, state),
              _module_hooks(model, recorder),
              torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack_placeholder)):
            with recorder, _CallMarker(recorder), _kernels(spec, real):
                loss = step.forward_loss(args, kwargs)
                recorder.flush()
            if runtime is not None:  # the loss pseudo-node's
                recorder.runtime_peak = max(recorder.runtime_peak, runtime.nbytes())
            n_ops = len(recorder.records)
            if n_ops == 0:
                raise ProfileError(f"{type(model).__name__}'s forward and loss ran no aten op")
            storages.poll(n_ops - 1)
            loss_storage = storages.lookup(loss)
            storages.close(n_ops - 1)
            del loss
        yield _Recorded(recorder, storages, loss_storage, real), convert


def _record(step: _Step, real: bool, spec: DeviceSpec | None,
            optimizer: torch.optim.Optimizer | None, progress: bool) -> _Recorded:
    """The observed forward + loss, then each op's backward alone, and static memory."""
    with _observed(step, real, spec) as (rec, _):
        pass
    rec.backward = _backward_pass(rec.recorder.records, spec, progress)
    params = dict(step.model.named_parameters(remove_duplicate=False))
    storages = rec.storages
    state_bytes, step_bytes = _optimizer_memory(optimizer)
    rec.static = StaticMemory(
        param_bytes=storages.total_bytes("param"),
        grad_bytes=sum(s["nbytes"] for s in storages.infos if s["kind"] == "param"
                       and params[s["name"]].requires_grad),
        buffer_bytes=storages.total_bytes("buffer") + storages.total_bytes("constant"),
        input_bytes=storages.total_bytes("input"),
        optimizer_state_bytes=state_bytes,
        optimizer_step_bytes=step_bytes,
        grads_at_start=step.grads_at_start,
    )
    return rec


def _laid_out_grads(static: StaticMemory, layout: _GradLayout | None) -> StaticMemory:
    """Static memory whose gradients are the storages ``layout`` holds, each once (more
    than the parameters where a gradient is a view of a larger one, less where a parameter
    gets none); as it was without a layout."""
    if layout is None:
        return static
    return static.model_copy(update={"grad_bytes": layout.nbytes})


def observe_forward(model: nn.Module, args: tuple, kwargs: dict,
                    loss_fn: Callable[[Any], torch.Tensor] | None = None,
                    autocast: torch.dtype | None = None) -> str:
    """The trace fingerprint of one fake forward + loss of ``model`` (see
    :func:`trace_fingerprint`): cheap (no backward, no memory), for checking a plan."""
    step = _Step(model, args, kwargs, loss_fn or default_loss, autocast,
                 _device_type(model, _tensors((args, kwargs))))
    with _rng_state_preserved(), _observed(step, False, None) as (rec, _):
        return trace_fingerprint(model, rec.recorder.records, rec.recorder.calls,
                                 _tensors((args, kwargs)), autocast)


def _backward_pass(records: list[_OpRecord], spec: DeviceSpec | None,
                   progress: bool) -> list[_Backward]:
    """Each op's backward alone, on fake stand-ins shaped like its arguments."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with meta_failures_at_debug(), FakeTensorMode():
        return _backward_of(records, spec, progress)


def _backward_of(records: list[_OpRecord], spec: DeviceSpec | None,
                 progress: bool) -> list[_Backward]:
    tracker = _WindowTracker(spec)
    out = []
    failed: dict[str, list[str]] = {}  # op -> the error of each call that could not run
    for record in _bar(records, "profiling backward", progress):
        specs = _tensors_specs(record.arg_specs)
        if not record.grad_enabled or not any(s.requires_grad for s in specs):
            out.append(_Backward(output_requires_grad=[False] * len(record.outputs)))
            continue
        try:
            args, kwargs = tree_map(_stand_ins(specs), record.arg_specs,
                                    is_leaf=lambda v: isinstance(v, _TensorSpec))
            out.append(_profile_backward(record.func, args, kwargs,
                                         [s.storage for s in specs], tracker))
        except Exception as error:  # an op that cannot run on stand-ins: no backward data
            if not any(s.sharded for s in specs):  # a view of a DTensor to its global
                failed.setdefault(record.name, []).append(_first_line(error))  # shape
            out.append(_Backward(grad_storages=[s.storage for s in specs if s.requires_grad
                                                and s.storage is not None],
                                 output_requires_grad=[True] * len(record.outputs)))
    for name, errors in failed.items():  # one line per op, not per call
        calls = f"{len(errors)} calls; " if len(errors) > 1 else ""
        log.warning("could not profile the backward of %s alone (%s%s); counting no "
                    "backward temporaries for it", name, calls, errors[0])
    return out


def _stand_ins(specs: list[_TensorSpec]) -> Callable[[Any], Any]:
    """Fake stand-ins for an op's tensor arguments, one per argument tensor. A meta
    constant met in a fake step of a meta model ran as a tensor of the step's device
    (``profiles.fake.MetaAsDevice``): its stand-in goes there too."""
    made: dict[int, torch.Tensor] = {}
    devices = {s.device for s in specs if s.device.type != "meta"}
    device = next(iter(devices)) if len(devices) == 1 else None

    def build(value: Any) -> Any:
        if not isinstance(value, _TensorSpec):
            return value
        if id(value) not in made:
            spec = value if device is None or value.device.type != "meta" else \
                dataclasses.replace(value, device=device)
            made[id(value)] = spec.make(real=False)
        return made[id(value)]

    return build


def _tensors_specs(arg_specs: Any) -> list[_TensorSpec]:
    return [v for v in tree_leaves(arg_specs, is_leaf=lambda v: isinstance(v, _TensorSpec))
            if isinstance(v, _TensorSpec)]


def _optimizer_memory(optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
    """(bytes of the optimizer's state, bytes its ``step()`` allocates beyond that state
    while it runs), found by stepping a fake twin twice: the first step creates the state,
    the second is a step like every later one (foreach buffers, per-parameter
    temporaries; the twin chooses foreach or not as the real one does, by device)."""
    if optimizer is None:
        return 0, 0
    from torch._subclasses.fake_tensor import FakeTensorMode

    with meta_failures_at_debug(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        groups = []
        for group in optimizer.param_groups:
            twins = [mode.from_tensor(p).detach().requires_grad_(p.requires_grad)
                     for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": twins})
        twin_params = [p for g in groups for p in g["params"]]
        for p in twin_params:
            p.grad = torch.zeros_like(p)
        held = [*twin_params, *(p.grad for p in twin_params)]
        tracker = _WindowTracker(None)
        peaks = []
        try:
            # groups carry every hyperparameter; lr is passed for optimizers that require it
            twin = type(optimizer)(groups, lr=optimizer.defaults.get("lr", 1e-3))
            for _ in range(2):
                tracker.reset(held + _tensors([twin.state[p] for p in twin_params
                                               if p in twin.state]))
                with tracker:
                    twin.step()
                peaks.append(tracker.peak_new_bytes)
        except Exception as error:
            raise ProfileError(f"could not size the state of {type(optimizer).__name__}: "
                               f"{error}; profile without optimizer= and add its state to "
                               "the budget by hand") from error
        seen: set[StorageWeakRef] = set()
        total = 0
        for state in twin.state.values():
            for tensor in _tensors(state):
                ref = StorageWeakRef(tensor.untyped_storage())
                if ref not in seen:
                    seen.add(ref)
                    total += tensor.untyped_storage().nbytes()
    return total, max(0, peaks[0] - total, peaks[1])


def _measure_times(step: _Step, records: list[_OpRecord], timer: _Timer,
                   progress: bool) -> _MeasuredTimes | None:
    """Forward/backward wall time of every op (loss last), on real tensors.

    Isolated op times carry costs a whole step does not (cold caches, per-call engine
    entry), most visibly on CPU; so the whole step is timed too and op times are scaled to
    add up to it: ops give the split, the step gives the total. Runs on copies of the
    buffers, so the model's statistics do not move. Returns None when the real run does
    not dispatch the ops the profile saw (the forward branched differently).
    """
    model = step.model
    buffers = {name: b.clone() for name, b in model.named_buffers(remove_duplicate=False)}
    with swapped_tensors(model, buffers):
        recorder = _ArgRecorder()
        with recorder:
            loss = step.forward_loss(step.args, step.kwargs)
        del loss
        names = [str(func) for func, _, _ in recorder.calls]
        if names != [r.name for r in records]:
            log.warning("the real forward dispatched other ops than the profiled one (%d vs "
                        "%d); op times are estimated instead", len(names), len(records))
            return None
        times: list[tuple[float, float]] = []
        for (func, args, kwargs), record in _bar(list(zip(recorder.calls, records,
                                                          strict=True)), "timing ops", progress):
            try:
                if record.grad_enabled:
                    times.append(_measure_op(func, args, kwargs, timer))
                else:
                    times.append((timer.median_ms(lambda: None,
                                                  lambda _, f=func, a=args, k=kwargs:
                                                  f(*a, **k)), 0.0))
            except Exception as error:  # an op that cannot be rerun alone: estimate it
                log.warning("could not time %s alone (%s); using its roofline estimate",
                            record.name, type(error).__name__)
                times.append((record.estimated_ms, 2 * record.estimated_ms))
        del recorder
        step_fwd_ms, step_bwd_ms = _measure_step(step, timer)
    fwd_scale = _scale(step_fwd_ms, sum(f for f, _ in times))
    bwd_scale = _scale(step_bwd_ms, sum(b for _, b in times))
    return _MeasuredTimes([(f * fwd_scale, b * bwd_scale) for f, b in times],
                          step_fwd_ms, step_bwd_ms, fwd_scale, bwd_scale)


def _measure_step(step: _Step, timer: _Timer) -> tuple[float, float]:
    """Warm median time of the whole forward+loss and of the whole backward.

    Gradients go through ``torch.autograd.grad``, so the model's ``.grad`` stay untouched.
    """
    params = [p for p in step.model.parameters() if p.requires_grad]

    def forward(_: Any = None) -> torch.Tensor:
        return step.forward_loss(step.args, step.kwargs)

    def backward(loss: torch.Tensor) -> Any:
        return torch.autograd.grad(loss, params, allow_unused=True) if params else ()

    return (timer.median_ms(lambda: None, forward),
            _net_of_engine(timer.median_ms(forward, backward), timer))


def _scale(step_ms: float, isolated_ms: float) -> float:
    """Whole-step time over the sum of isolated op times, 1 where either is not measurable."""
    if step_ms <= 0 or isolated_ms <= 0:
        return 1.0
    return min(step_ms / isolated_ms, MAX_SCALE)


# ----------------------------------------------------------------------------- assembly


def _resolve_timing(timing: str, tensors: list[torch.Tensor]) -> str:
    abstract = _abstract(tensors)
    if timing == "auto":
        return "estimate" if abstract else "measure"
    if timing == "measure" and abstract:
        raise ValueError("timing='measure' needs real tensors, but the model or inputs are on "
                         "the meta device or fake; use timing='estimate' with device='H100' "
                         "(or another profiles.DEVICES entry)")
    if timing not in ("measure", "estimate"):
        raise ValueError(f"timing must be 'auto', 'measure' or 'estimate', not {timing!r}")
    return timing


def _device_type(model: nn.Module, tensors: list[torch.Tensor]) -> str:
    for tensor in [*model.parameters(), *model.buffers(), *tensors]:
        if tensor.device.type != "meta":
            return tensor.device.type
    return "cpu"


def _node_names(records: list[_OpRecord], calls: list[_CallRecord]) -> list[str]:
    seen: Counter[str] = Counter()
    names = []
    for record in records:
        path = calls[record.call].path if record.call is not None else ""
        op = record.name.removeprefix("aten.").rsplit(".", 1)[0]
        base = f"{path}/{op}" if path else op
        names.append(base if not seen[base] else f"{base}_{seen[base]}")
        seen[base] += 1
    return names


def _node_profiles(rec: _Recorded, measured: _MeasuredTimes | None) -> list[NodeProfile]:
    records, calls, storages = rec.recorder.records, rec.recorder.calls, rec.storages
    names = _node_names(records, calls)
    producer_name = {sid: names[info["producer"]] for sid, info in enumerate(storages.infos)
                     if info["producer"] is not None and info["producer"] < len(names)}
    users: dict[str, list[str]] = {}
    nodes = []
    writers: dict[int, int] = {}  # storage -> last node writing it in place
    for record in records:
        for sid in record.written:
            writers[sid] = record.index
    for record, bwd in zip(records, rec.backward, strict=True):
        name = names[record.index]
        args = sorted({producer_name[s] for s in record.reads if s in producer_name
                       and storages.infos[s]["producer"] != record.index},
                      key=names.index)
        for arg in args:
            users.setdefault(arg, []).append(name)
        params = sorted({storages.infos[s]["name"] for s in record.reads
                         if storages.infos[s]["kind"] == "param"})
        outputs = [o.model_copy(update={"requires_grad": bool(
            bwd.output_requires_grad[k]) if k < len(bwd.output_requires_grad) else False})
            for k, o in enumerate(record.outputs)]
        # SAC keeps a node by saving its op's output; a later in-place write would change
        # the cached tensor (torch refuses it), so such nodes are not keepable
        keepable = bool(record.new_storages) and not any(
            writers.get(s, -1) > record.index for s in record.new_storages)
        mutated = sorted(storages.infos[s]["name"] for s in record.mutated_state)
        times = measured.per_node[record.index] if measured else None
        nodes.append(NodeProfile(
            index=record.index, name=name, op="aten", target=record.name,
            module=calls[record.call].path if record.call is not None else "",
            args=args, read_storages=record.reads, outputs=outputs,
            new_storages=record.new_storages, saved_storages=sorted(set(record.saved)),
            params=params,
            fwd_time_ms=times[0] if times else record.estimated_ms,
            bwd_time_ms=times[1] if times else bwd.estimated_ms,
            fwd_flops=record.flops, bwd_flops=bwd.flops, fwd_temp_bytes=0,
            bwd_temp_bytes=bwd.temp_bytes, stateful=bool(mutated), mutated_buffers=mutated,
            random=record.random, ops=[record.name],
            output_ops=[0] if record.new_storages else [], keepable=keepable,
            saved_tensors=len(record.saved), written_storages=record.written,
            packs_after_running=record.packed_after_running if record.saved else None,
            grad_storages=bwd.grad_storages, fwd_runtime_bytes=record.runtime_bytes,
            runtime_ops_before=record.runtime_ops_before))
    nodes = [n.model_copy(update={"users": users.get(n.name, [])}) for n in nodes]
    loss_reads = [rec.loss_storage] if rec.loss_storage is not None else []
    loss_ms = (0.0, 0.0)
    nodes.append(NodeProfile(
        index=len(records), name=LOSS_NODE, op="loss", target="backward()",
        args=[producer_name[s] for s in loss_reads if s in producer_name],
        read_storages=loss_reads, fwd_time_ms=loss_ms[0], bwd_time_ms=loss_ms[1],
        grad_storages=loss_reads, saved_tensors=0,
        fwd_runtime_bytes=rec.recorder.runtime_peak if rec.recorder.runtime else None))
    return nodes


def _module_calls(rec: _Recorded) -> list[ModuleCall]:
    calls, records = rec.recorder.calls, rec.recorder.records
    totals = Counter(c.path for c in calls)
    buffer_names = {s["id"]: s["name"] for s in rec.storages.infos if s["kind"] == "buffer"}
    out = []
    for call in calls:
        mutated = sorted({buffer_names[s] for r in records[call.start:call.stop]
                          for s in r.mutated_state if s in buffer_names})
        out.append(ModuleCall(index=call.index, path=call.path, module_type=call.module_type,
                              start=call.start, stop=max(call.stop, call.start),
                              parent=call.parent, call_number=call.call_number,
                              calls=totals[call.path], input_storages=call.inputs,
                              mutated_buffers=_owned_buffers(mutated, buffer_names)))
    return out


def _owned_buffers(mutated: list[str], buffer_names: dict[int, str]) -> list[str]:
    """Buffers a call may update: every buffer of each module seen updating one (BatchNorm's
    kernels update running statistics without saying so; num_batches_tracked's add_ shows)."""
    owners = {name.rpartition(".")[0] for name in mutated}
    return sorted({name for name in buffer_names.values()
                   if name.rpartition(".")[0] in owners} | set(mutated))


def trace_fingerprint(model: nn.Module, records: list[Any], calls: list[Any],
                      inputs: list[torch.Tensor], autocast_dtype: torch.dtype | None,
                      grads_at_start: bool = False) -> str:
    """Hash of what a plan depends on: the ops in order and the module call that ran each,
    the module calls' spans, parameter/buffer shapes and dtypes, input shapes and dtypes, the
    autocast dtype and whether the step starts with gradients allocated. No generated names,
    so it is stable across runs."""
    structure: list[object] = [[r.name, r.call] for r in records]
    structure.append([[c.path, c.start, c.stop, c.parent] for c in calls])
    structure.append([(name, list(t.shape), str(t.dtype)) for name, t in
                      [*model.named_parameters(remove_duplicate=False),
                       *model.named_buffers(remove_duplicate=False)]])
    structure.append([(list(t.shape), str(t.dtype)) for t in inputs])
    structure.append(str(autocast_dtype))
    if grads_at_start:  # appended only then: fingerprints of fresh-start steps stay as they were
        structure.append("gradients allocated at step start")
    return fingerprint(structure)


def profile(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    autocast: torch.dtype | None = None,
    timing: str = "auto",
    device: str | DeviceSpec | None = None,
    execution: str = "auto",
    grad_accumulation: bool = False,
    repeats: int = 5,
    warmup: int = 2,
    progress: bool = True,
    parallel: Parallelism | None = None,
) -> GraphProfile:
    """Profile one training step (forward, loss, backward) of ``model`` as it runs eagerly.

    Args:
        model: any ``nn.Module`` on any device (``meta`` works with ``timing="estimate"``).
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs
            shaped like one real batch; None: the model's ``dummy_inputs`` (HF).
        loss_fn: ``loss_fn(output) -> scalar``; default :func:`default_loss`.
        optimizer: counted in static memory (its state after one step), and the peak of
            its ``step()`` after the backward.
        autocast: run the step under ``torch.autocast(dtype=autocast)`` (e.g.
            ``torch.bfloat16``), as mixed-precision training does.
        timing: ``"measure"`` runs ops on the model's device (warm median of ``repeats``)
            and calibrates the checkpoint overhead there (``profiles.calibrate``, about
            ``CALIBRATION_S``); ``"estimate"`` uses FLOPs and the roofline of ``device``, and
            its default checkpoint overhead; ``"auto"`` measures real tensors and estimates
            meta/fake ones.
        device: roofline for estimates (``"H100"``, ``"A100"``, ``"cpu"`` or a DeviceSpec);
            default: H100 when estimating on a GPU or meta, the CPU's when on the CPU.
        execution: how the forward is observed. ``"real"``: on the model's own tensors (on
            copies of its buffers; autograd keeps nothing, so it needs only the forward's
            working set, not a step's memory), with the kernels of the device they are on.
            ``"fake"``: under ``FakeTensorMode``, no memory at all, run as ``device`` runs
            it (its fused attention and dropout, ``profiles.kernels``; meta tensors as CPU
            ones so that autocast applies, ``profiles.fake``); a branch on a value that
            follows from shapes and small inputs takes the real step's way, any other
            value-dependent forward is redone on real tensors. ``"auto"`` (default): real
            unless the model is on the meta device.
        grad_accumulation: the step starts with every ``.grad`` allocated and adds into it
            (micro-batches of gradient accumulation, ``zero_grad(set_to_none=False)``),
            laid out as one backward leaves them (``_GradLayout``: a gradient that is a
            slice of a larger one keeps all of it), found by running that backward once,
            fake or real as the profile runs; default: it starts with none, as
            ``zero_grad()`` leaves them. The ``.grad`` the model holds now never matter.
        progress: show a progress bar (on a terminal or in a notebook).
        parallel: profile one rank of this parallelism (``profiles.parallel``): the user's
            ``parallelize`` runs on a copy of the model over a fake process group of the
            mesh's size, and the step recorded is that copy's on ``example_inputs`` (one
            rank's batch), with its runtime's memory measured at every node; the optimizer
            state and step count ``1/world_size`` of the model's. Times are estimated.

    The model is left as it was: parameters, buffers, gradients and RNG state.

    Raises:
        ProfileError: the step cannot run (the message says where and what to do).
    """
    _refuse_active_tools(type(model).__name__)
    args, kwargs = normalize_inputs(model, example_inputs)
    loss_fn = loss_fn or default_loss
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    input_tensors = _tensors((args, kwargs))
    everything = [*params.values(), *buffers.values(), *input_tensors]
    requested_timing, timing = timing, _resolve_timing(timing, everything)
    device_type = _device_type(model, input_tensors)
    default_device = "cpu" if device_type == "cpu" and timing == "measure" else "H100"
    spec = device_spec(device or default_device)  # estimates (or fallbacks when measuring)
    abstract = _abstract(everything)
    execution = _resolve_execution(execution, abstract)
    step = _Step(model, args, kwargs, loss_fn, autocast, device_type, bool(grad_accumulation))
    if parallel is not None:
        timing = _check_parallel(requested_timing, step)
    with _rng_state_preserved(), _parallel_world(step, parallel):
        rec = _record_with_fallback(step, execution == "real", abstract, spec, optimizer,
                                    progress)
        measured, costs, timing = _timings(step, rec, timing, spec, device_type,
                                           (repeats, warmup), progress)
        records = rec.recorder.records
        # the same program as recorded: a real recording ran the real device's kernels
        kernels = None if rec.real else spec
        if step.grads_at_start:
            step.grad_layout = _grad_layout(step, rec.real, kernels)
            rec.static = _laid_out_grads(rec.static, step.grad_layout)
        observed = _observe_backward(step, [r.name for r in records], rec.real, kernels)
        # as the planned model will see it in its first step: after FSDP2's lazy init
        layout = parallel_layout(step.model, parallel) if parallel is not None else None
    if layout is not None:
        observed = _with_last_rank(step, parallel, rec, observed, kernels)
        rec.static = _rank_optimizer(rec.static, layout.world_size)
    nodes = _with_observed_backward(_node_profiles(rec, measured), observed)
    return GraphProfile(
        model_name=type(model).__name__,
        execution="real" if rec.real else "fake",
        timing=timing,
        device=_device_name(device_type) if measured else spec.name,
        torch_version=torch.__version__,
        fingerprint=trace_fingerprint(model, records, rec.recorder.calls, input_tensors,
                                      autocast, step.grads_at_start),
        autocast_dtype=_dtype_name(autocast) if autocast is not None else None,
        nodes=nodes,
        storages=[StorageInfo(**info) for info in rec.storages.infos],
        module_calls=traced_calls(model, _module_calls(rec), nodes),
        static=rec.static,
        step=StepTiming(fwd_ms=measured.step_fwd_ms, bwd_ms=measured.step_bwd_ms,
                        fwd_scale=measured.fwd_scale, bwd_scale=measured.bwd_scale)
        if measured else None,
        checkpoint_costs=costs,
        parallel=layout,
    )


def _check_parallel(timing: str, step: _Step) -> str:
    """The options a parallel profile supports; returns its timing (estimated: collectives
    on a fake process group take no time)."""
    if timing == "measure":
        raise ValueError("timing='measure' times one process's ops, but a rank's step runs "
                         "its collectives on a fake process group, where they take no time: "
                         "plan a rank with timing='estimate' (or 'auto') and device=")
    if step.grads_at_start:
        raise ValueError("grad_accumulation=True is not planned per rank yet: FSDP2 keeps "
                         "its sharded gradients; plan the first micro-batch's step")
    return "estimate"


def _with_last_rank(step: _Step, parallel: Parallelism, rec: _Recorded,
                    observed: list | None, kernels: DeviceSpec | None) -> list:
    """The runtime's bytes at each node, the most of rank 0's and the last rank's: ranks
    run the same ops, but FSDP2 shards dim 0 unevenly (the last rank's shard is shorter,
    or empty, and its gradient a copy rather than a view), so what one holds is not what
    every one does. ``observed`` and ``rec`` are rank 0's; ``rec`` is updated."""
    name = type(step.model).__name__
    last = parallel.world_size - 1
    if observed is None:
        raise ProfileError(f"could not run the backward of one rank of {name} under its "
                           "parallelize function (the log says why)")
    if last == 0:
        return observed
    with _rng_state_preserved(), _parallel_world(step, parallel, rank=last):
        with _observed(step, rec.real, kernels if not rec.real else None) as (other, _):
            pass
        names = [r.name for r in rec.recorder.records]
        theirs = _observe_backward(step, names, rec.real, kernels)
    if theirs is None or [r.name for r in other.recorder.records] != names:
        raise ProfileError(f"rank {last} of {name} runs other ops than rank 0 under its "
                           "parallelize function; the planner plans ranks that run the same "
                           "program")
    for mine, their in zip(rec.recorder.records, other.recorder.records, strict=True):
        mine.runtime_bytes = max(mine.runtime_bytes or 0, their.runtime_bytes or 0)
    rec.recorder.runtime_peak = max(rec.recorder.runtime_peak, other.recorder.runtime_peak)
    return [tuple(max(a, b) for a, b in zip(x, y, strict=True))
            for x, y in zip(observed, theirs, strict=True)]


@contextlib.contextmanager
def _parallel_world(step: _Step, parallel: Parallelism | None,
                    rank: int = 0) -> Iterator[None]:
    """For a parallel step: inside a fake process group of its mesh, as ``rank``, every run
    of the step on a fresh twin parallelized by the user's function (``step.twin``). One
    process: nothing."""
    if parallel is None:
        yield
        return
    with fake_world(parallel, step.device_type, rank) as mesh:
        user_model = step.model
        step.twin = lambda convert: parallel_twin(user_model, parallel, mesh, convert)
        try:
            yield
        finally:
            step.model, step.twin = user_model, None


def _rank_optimizer(static: StaticMemory, world_size: int) -> StaticMemory:
    """Each rank steps its shards: the optimizer's state and temporaries shrink with them."""
    return static.model_copy(update={
        "optimizer_state_bytes": -(-static.optimizer_state_bytes // world_size),
        "optimizer_step_bytes": -(-static.optimizer_step_bytes // world_size)})


def _refuse_active_tools(name: str) -> None:
    """Profiling runs the step under its own dispatch modes and fake tensors: a tool that
    is still watching (``MemTracker``, ``FlopCounterMode``, ``DebugMode``, another profiler's
    mode) would see those and fail somewhere deep inside, so it is named up front."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = [type(mode).__name__ for mode in _get_current_dispatch_mode_stack()]
    if modes:
        raise ProfileError(
            f"cannot profile {name} inside {', '.join(modes)} (a TorchDispatchMode that is "
            "still active, e.g. torch's MemTracker or FlopCounterMode): plan outside its "
            "`with` block.")
    from torch.nn.modules import module as nn_module

    hooks = sum(len(getattr(nn_module, table, {})) for table in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))
    if hooks:
        log.warning("%d global module hooks are registered (torch.nn.modules.module."
                    "register_module_forward_hook and friends, as ModTracker/MemTracker "
                    "register while active); they run in the profiled step too", hooks)


def _timings(step: _Step, rec: Any, timing: str, spec: DeviceSpec, device_type: str,
             repeats_warmup: tuple[int, int], progress: bool) -> tuple[Any, Any, str]:
    """(measured op times or None, checkpoint costs, the timing that holds): measured and
    calibrated on the device with ``timing="measure"``, else the roofline's estimates (also
    when the measured run took another path than the recorded one)."""
    if timing != "measure":
        return None, spec.checkpoint_costs(), timing
    timer = _Timer(torch.device(device_type), *repeats_warmup)
    measured = _measure_times(step, rec.recorder.records, timer, progress)
    costs = calibrate_checkpoint_costs(device_type, budget_s=CALIBRATION_S)
    return measured, costs, "measure" if measured is not None else "estimate"


def _resolve_execution(execution: str, abstract: bool) -> str:
    if execution == "auto":
        execution = "fake" if abstract else "real"
    if execution not in ("real", "fake"):
        raise ValueError(f"execution must be 'auto', 'real' or 'fake', not {execution!r}")
    if execution == "real" and abstract:
        raise ValueError("execution='real' needs real tensors, but the model or inputs are on "
                         "the meta device or fake; use execution='fake'")
    return execution


def _with_observed_backward(nodes: list[NodeProfile], observed: list | None
                            ) -> list[NodeProfile]:
    """Nodes with the backward's live bytes before, at and after each (when observed)."""
    if observed is None:
        return nodes
    return [node.model_copy(update={"bwd_live_before_bytes": b, "bwd_peak_bytes": p,
                                    "bwd_live_after_bytes": a})
            for node, (b, p, a) in zip(nodes, observed, strict=True)]


def _abstract(tensors: list[torch.Tensor]) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(t.is_meta or isinstance(t, FakeTensor) for t in tensors)


def _record_with_fallback(step: _Step, real: bool, abstract: bool, spec: DeviceSpec,
                          optimizer: torch.optim.Optimizer | None,
                          progress: bool) -> _Recorded:
    """Record on real or fake tensors; a fake forward that branches on tensor values is
    redone on real ones, a real one that runs out of device memory on fake ones."""
    name = type(step.model).__name__
    try:
        return _record(step, real=real, spec=spec, optimizer=optimizer, progress=progress)
    except torch.OutOfMemoryError as error:
        if not real:
            raise _profile_error(name, error) from error
        log.warning("%s: the forward's working set does not fit on the device (%s); "
                    "observing it with fake tensors instead", name, _first_line(error))
        fallback_real = False
    except Exception as error:
        if real or not _is_data_dependent(error):
            raise _profile_error(name, error) from error
        if abstract:
            raise ProfileError(
                f"{name}'s forward depends on tensor values ({_first_line(error)}), so it "
                "must be profiled on real tensors, but the model or inputs are on the meta "
                "device. Profile it where its forward fits (execution='real'), or remove the "
                "value-dependent branch (`.item()`, `if tensor:`, data-dependent shapes)."
            ) from error
        log.info("%s branches on tensor values (%s); observing it on real tensors", name,
                 _first_line(error))
        fallback_real = True
    try:
        return _record(step, real=fallback_real, spec=spec, optimizer=optimizer,
                       progress=progress)
    except Exception as error:
        raise _profile_error(name, error) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _profile_error(name: str, error: BaseException) -> Exception:
    if isinstance(error, ProfileError | ValueError | TypeError):
        return error  # ours, or a clear one about the inputs or the loss
    return ProfileError(
        f"one training step of {name} failed while profiling: {_first_line(error)}. Check "
        "that example_inputs are what forward() expects and that loss_fn(output) returns a "
        "scalar; the traceback above shows where it failed.")
