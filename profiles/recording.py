"""The memory run: the forward and the loss run once, every aten op recorded as it runs.

A dispatch mode (``_ForwardRecorder``) sees every aten op in call order, its inputs, the
storages it allocates (views share their base's) and what it writes in place; module hooks
give the span of ops each module call ran (the regions a plan can checkpoint) and the
tensors passed to it (what a checkpoint of it holds). ``saved_tensors_hooks`` see every
tensor autograd saves, packed as placeholders so autograd holds nothing: a storage then
dies exactly when the Python program drops it, which the recorder notices between ops
(``StorageInfo.release``; a local variable outlives its last reader). A saved tensor
belongs to the op it was packed for: autograd packs an op's inputs just before the op
reaches the dispatch mode and its outputs just after, so the packs between two ops are
split by identity with the next op's arguments. ``_observed`` runs the step so, fake or
on real tensors, and yields the ``_Recorded`` step.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import flop_registry

from profiles.devices import DeviceSpec
from profiles.errors import ProfileError
from profiles.functions import watched_functions
from profiles.leaves import tensors_in
from profiles.parallel import RuntimeAwareMode, RuntimeMemory, local_tensor
from profiles.schema import StaticMemory, TensorMeta
from profiles.step import _fake_step, _kernels, _Step
from profiles.swap import swapped_tensors

# ops that update their arguments in place without saying so in their schema
_UNDECLARED_WRITES = {
    "aten.native_batch_norm.default": (3, 4),
    "aten.cudnn_batch_norm.default": (3, 4),
    "aten.miopen_batch_norm.default": (3, 4),
}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


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

    def close(self, loss_node: int) -> None:
        """End of the forward and loss: what is still alive outlives them, held by the model
        itself (a module attribute: RAFT's correlation pyramid) or the caller (the loss),
        to the end of the step; its release is ``loss_node``."""
        for sid in list(self.watched):
            self._forget(sid, loss_node)

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


def skippable_op(func: Any, n_outputs: int, n_new_storages: int) -> bool:
    """Whether a rerun may answer a call of ``func`` with uninitialized tensors of the
    shapes its meta kernel gives (`solvers.frame` F9): an aten op a SAC policy sees, that
    reads a tensor, mutates nothing, returns only tensors, none of them a view, each on a
    new storage, and draws no random numbers."""
    if not isinstance(func, torch._ops.OpOverload) or func in SAC_IGNORED_OPS:
        return False
    schema = func._schema
    return (not schema.is_mutable and torch.Tag.nondeterministic_seeded not in func.tags
            and any(str(a.type) == "Tensor" for a in schema.arguments)  # not a factory
            and 0 < n_outputs == n_new_storages == len(schema.returns)
            and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns))


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


@dataclass
class _FunctionRecord:
    """One call of a custom autograd Function (``profiles.functions``): its ops
    ``[start, stop)``, its arguments for a run alone, and the storages of its outputs that
    receive gradients through its own backward."""

    cls: type
    start: int
    arg_specs: Any  # (args, kwargs) with tensors replaced by _TensorSpec
    stop: int = -1
    grad_outputs: list[int] = field(default_factory=list)

    @property
    def last(self) -> int | None:
        """The op its backward is booked to (its saves are packed after it), if it ran any."""
        return self.stop - 1 if self.stop > self.start else None


@dataclass(frozen=True)
class _Backward:
    """What one op's backward does, profiled alone on stand-ins (``profiles.backward``)."""

    flops: int = 0
    estimated_ms: float = 0.0
    temp_bytes: int = 0
    grad_storages: list[int] = field(default_factory=list)  # inputs it sends gradients to
    output_requires_grad: list[bool] = field(default_factory=list)


@dataclass
class _Recorded:
    """The recorded step: its ops, module calls and storages (``recorder``, ``storages``),
    and, filled in by the profiler, each op's backward and the static memory."""

    recorder: _ForwardRecorder
    storages: _Storages
    loss_storage: int | None
    real: bool
    backward: list[_Backward] = field(default_factory=list)
    static: StaticMemory | None = None


# ----------------------------------------------------------------------------- the recorder


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


class _ForwardRecorder(RuntimeAwareMode):
    """Runs the forward and the loss, recording ops, storages, saves and module calls."""

    def __init__(self, storages: _Storages, spec: DeviceSpec | None,
                 paths: dict[int, str]) -> None:
        super().__init__()
        self.storages = storages
        self.spec = spec
        self.paths = paths  # id(module) -> path
        self.records: list[_OpRecord] = []
        self.calls: list[_CallRecord] = []
        self.functions: list[_FunctionRecord] = []
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
        arg_ids = Counter(id(t) for t in tensors_in(args))
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
                record = self.records[last]
                record.saved.append(sid)
                record.packed_after_running = True
                if sid not in record.reads and sid not in record.new_storages:
                    # a custom Function's ctx.save_for_backward of a tensor made before its
                    # last op: that op's save holds it, as if it read it
                    record.reads.append(sid)
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
        inputs = sorted({sid for t in tensors_in((args, kwargs))
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

    # ------------------------------------------------------------ custom Functions
    def function_started(self, cls: type, args: tuple, kwargs: dict) -> _FunctionRecord:
        self._resolve_packs(())  # a Function packs after its forward: these are earlier ops'
        record = _FunctionRecord(cls, len(self.records), tree_map(self._spec, (args, kwargs)))
        self.functions.append(record)
        return record

    def function_ended(self, record: _FunctionRecord, output: Any) -> None:
        """Its saves were packed as it returned: its last op's (`_FunctionRecord.last`)."""
        record.stop = len(self.records)
        record.grad_outputs = sorted({sid for t in tensors_in(output) if t.requires_grad
                                      and (sid := self.storages.lookup(t)) is not None})
        if record.last is None:
            return
        self._resolve_packs(())
        last = self.records[record.last]
        # its backward, booked to its last op, sends gradients to its inputs: that op reads
        # them (it holds them until then anyway, as the call's arguments)
        last.reads = sorted(set(last.reads) | {
            spec.storage for spec in tree_leaves(record.arg_specs)
            if isinstance(spec, _TensorSpec) and spec.requires_grad
            and spec.storage is not None})

    # ------------------------------------------------------------ ops
    def _op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        inputs = tensors_in((args, kwargs))
        if func is not torch.ops.aten.lift_fresh.default:  # see _add_constants
            self._add_constants(inputs)
        record = self._record_op(func, args, kwargs, inputs)
        out = func(*args, **kwargs)
        self._record_outputs(record, func, inputs, out)
        self._count_work(record, func, args, kwargs, out)
        return out

    def _add_constants(self, inputs: list[torch.Tensor]) -> None:
        """Inputs no op made are constants: a module attribute or a loss target, there all
        step. Not for ``lift_fresh``: ``torch.tensor(...)`` in forward enters through it, a
        temporary that op makes (its output is that tensor), made again by every rerun."""
        for tensor in inputs:
            if self.storages.lookup(tensor) is None and \
                    self._runtime_storage(tensor) is None:
                self.storages.add(tensor, "constant", None, "constant")

    def _record_op(self, func: Any, args: tuple, kwargs: dict,
                   inputs: list[torch.Tensor]) -> _OpRecord:
        """The record of the op about to run: its saves, what it reads and writes."""
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
        return record

    def _record_outputs(self, record: _OpRecord, func: Any, inputs: list[torch.Tensor],
                        out: Any) -> None:
        """The op's outputs: new storages, or views of its inputs."""
        first = len(self.storages.infos)
        views = [r.alias_info is not None for r in func._schema.returns]
        for k, tensor in enumerate(tensors_in(out)):
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
                sid = self.storages.add(tensor, "activation", record.index)
            local = local_tensor(tensor)  # a DTensor: this rank's shard
            record.outputs.append(TensorMeta(
                shape=list(local.shape), dtype=_dtype_name(local.dtype),
                nbytes=_nbytes(local), storage=sid, requires_grad=False))
        record.new_storages = list(range(first, len(self.storages.infos)))

    def _count_work(self, record: _OpRecord, func: Any, args: tuple, kwargs: dict,
                    out: Any) -> None:
        """The op's FLOPs and roofline time: this rank's work, on its shards (a DTensor op
        runs its op on them)."""
        local_args, local_kwargs, local_out = args, kwargs, out
        if any(local_tensor(t) is not t for t in tensors_in((args, kwargs, out))):
            local_args, local_kwargs, local_out = tree_map(local_tensor, (args, kwargs, out))
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            with contextlib.suppress(Exception):
                record.flops = int(counter(*local_args, **local_kwargs, out_val=local_out))
        if self.spec is not None:
            record.estimated_ms = self.spec.estimate_ms(
                func, tensors_in((local_args, local_kwargs)), tensors_in(local_out), record.flops)

    def _runtime_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op of the parallel runtime: no node; what it makes is runtime memory (a view
        of the model's tensor, such as FSDP2's backward hook on an output, is not)."""
        out = func(*args, **kwargs)
        for tensor in tensors_in(out):
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
        for tensor in tensors_in(targets):
            sid = self.storages.lookup(tensor)
            if sid is None:
                continue
            kind = self.storages.infos[sid]["kind"]
            (state if kind in ("param", "buffer") else written).add(sid)
        return sorted(written), sorted(state)


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
        for position, tensor in enumerate(tensors_in((args, kwargs))):
            storages.add(tensor, "input", None, f"input{position}")
        with (swapped_tensors(model, state),
              _module_hooks(model, recorder),
              watched_functions(recorder.function_started, recorder.function_ended),
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
            storages.close(n_ops)  # the loss pseudo-node's index
            del loss
        yield _Recorded(recorder, storages, loss_storage, real), convert
