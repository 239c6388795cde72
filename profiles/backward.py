"""What the backward of the recorded step does, seen two ways.

Alone: each op that records autograd history is rerun on fake stand-ins shaped like its
inputs and differentiated under ``_WindowTracker``, for its backward FLOPs, roofline time,
temporaries and which inputs receive gradients (``_backward_pass``). Observed: a fake (or
real) step runs with ordinary autograd under ``_BackwardObserver``, which records the bytes
the backward holds before, during and after each node's work (``_observe_backward``).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from profiles.devices import DeviceSpec
from profiles.errors import _first_line
from profiles.fake import fake_mode, meta_failures_at_debug
from profiles.functions import FunctionCall, function_name, watched_functions
from profiles.leaves import tensors_in
from profiles.parallel import RuntimeAwareMode, RuntimeMemory, local_tensor
from profiles.progress import _bar
from profiles.recording import _Backward, _FunctionRecord, _OpRecord, _TensorSpec
from profiles.step import _fake_state, _real_state, _start_grads, _Step

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- each op alone


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
        inputs = tensors_in((args, kwargs))
        aliased = {StorageWeakRef(t.untyped_storage()) for t in inputs} | self._known
        for tensor in tensors_in(out):
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
            self.estimated_ms += self.spec.estimate_ms(func, inputs, tensors_in(out), flops)
        return out


def _written_positions(func: Any) -> set[int]:
    """The arguments an aten op writes (a Function's apply, with no schema: none)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return set()
    return {i for i, argument in enumerate(schema.arguments)
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
    return [t for t in tensors_in(out) if t.requires_grad and t.grad_fn is not None]


def _profile_backward(func: Any, args: Any, kwargs: Any, storages: list[int | None],
                      tracker: _WindowTracker) -> _Backward:
    """FLOPs, roofline time, temporaries and gradient targets of one op's backward, run in
    isolation on stand-in inputs; ``storages`` are the storage ids of the op's tensor args."""
    fresh_args, fresh_kwargs, leaves, origins = _fresh_args(func, args, kwargs)
    out = func(*fresh_args, **fresh_kwargs)
    outs = _grad_outputs(out)
    requires = [t.requires_grad for t in tensors_in(out)]
    if not outs or not leaves:
        return _Backward(output_requires_grad=requires)
    grad_outputs = [torch.ones_like(t) for t in outs]
    tracker.reset([*leaves, *outs, *grad_outputs])
    with tracker:
        grads = torch.autograd.grad(outs, leaves, grad_outputs, allow_unused=True)
        final = tracker.live_new_bytes()
    arg_tensors = tensors_in((args, kwargs))
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


def _backward_pass(records: list[_OpRecord], functions: list[_FunctionRecord],
                   spec: DeviceSpec | None, progress: bool) -> list[_Backward]:
    """Each op's backward alone, on fake stand-ins shaped like its arguments; a custom
    Function's own backward stands for its ops' and is its last op's
    (`_with_function_backwards`)."""
    with meta_failures_at_debug(), fake_mode():
        out = _backward_of(records, spec, progress)
        return _with_function_backwards(out, records, functions, spec)


def _with_function_backwards(out: list[_Backward], records: list[_OpRecord],
                             functions: list[_FunctionRecord], spec: DeviceSpec | None
                             ) -> list[_Backward]:
    """``out`` with each Function call's backward, run alone on stand-ins, as its last
    op's; its outputs that receive gradients marked so on the ops that made them (its ops
    ran without autograd)."""
    tracker = _WindowTracker(spec)
    for function in functions:
        if function.last is None:
            continue
        grads = set(function.grad_outputs)
        for k in range(function.start, function.stop):
            out[k] = dataclasses.replace(out[k], output_requires_grad=[
                o.storage in grads for o in records[k].outputs])
        specs = _tensors_specs(function.arg_specs)
        if not grads or not any(s.requires_grad for s in specs):
            continue
        last = out[function.last]
        try:
            args, kwargs = tree_map(_stand_ins(specs), function.arg_specs,
                                    is_leaf=lambda v: isinstance(v, _TensorSpec))
            found = _profile_backward(FunctionCall(function.cls), args, kwargs,
                                      [s.storage for s in specs], tracker)
        except Exception as error:  # e.g. a backward that reads values: fake ones have none
            if not any(s.sharded for s in specs):  # DTensor's own (to_local): not on shards
                log.warning("could not profile the backward of autograd Function %s alone "
                            "(%s); counting no backward temporaries for it",
                            function_name(function.cls), _first_line(error))
            found = _Backward(grad_storages=[s.storage for s in specs if s.requires_grad
                                             and s.storage is not None])
        out[function.last] = dataclasses.replace(
            found, output_requires_grad=last.output_requires_grad)
    return out


class _AloneMemo:
    """Each op's backward alone, by its stand-ins' layout (`_layout_key`), the device whose
    roofline times it and the ambient grad and autocast modes: all that run reads, so it is
    the same in every profile of this process (the ops of repeated blocks, of a model
    profiled again at another budget or beside its variants) and runs once. Bounded: the
    least recently asked go first."""

    SIZE = 16384

    def __init__(self) -> None:
        self._found: OrderedDict[Hashable, _Backward] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def context(spec: DeviceSpec | None) -> Hashable:
        """What a run alone reads besides its op and stand-ins."""
        autocast = tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in ("cpu", "cuda"))
        return repr(spec), torch.is_grad_enabled(), autocast

    def get(self, key: Hashable) -> _Backward | None:
        with self._lock:
            found = self._found.get(key)
            if found is not None:
                self._found.move_to_end(key)
            return found

    def put(self, key: Hashable, found: _Backward) -> None:
        with self._lock:
            self._found[key] = found
            while len(self._found) > self.SIZE:
                self._found.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._found.clear()


ALONE = _AloneMemo()


def _backward_of(records: list[_OpRecord], spec: DeviceSpec | None,
                 progress: bool) -> list[_Backward]:
    tracker = _WindowTracker(spec)
    out = []
    failed: dict[str, list[str]] = {}  # op -> the error of each call that could not run
    context = ALONE.context(spec)
    for record in _bar(records, "profiling backward", progress):
        specs = _tensors_specs(record.arg_specs)
        if not record.grad_enabled or not any(s.requires_grad for s in specs):
            out.append(_Backward(output_requires_grad=[False] * len(record.outputs)))
            continue
        try:
            key = (_layout_key(record.func, record.arg_specs, specs), context)
            found = ALONE.get(key)
            if found is None:  # gradients by argument position, mapped below
                args, kwargs = tree_map(_stand_ins(specs), record.arg_specs,
                                        is_leaf=lambda v: isinstance(v, _TensorSpec))
                found = _profile_backward(record.func, args, kwargs,
                                          list(range(len(specs))), tracker)
                ALONE.put(key, found)
            out.append(dataclasses.replace(found, grad_storages=sorted(
                {specs[k].storage for k in found.grad_storages} - {None})))
        except Exception as error:  # an op that cannot run on stand-ins: no backward data
            found = _on_the_cpu(record, specs, tracker)
            if found is not None:
                out.append(found)
                continue
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


def _layout_key(func: Any, arg_specs: Any, specs: list[_TensorSpec]) -> Any:
    """What an op's backward alone depends on: the op, its non-tensor arguments and its
    stand-ins' layouts (`_stand_ins` makes one per spec object, whatever the storage), so
    the repeated blocks of a model profile each distinct op once."""
    first = {}
    for k, spec in enumerate(specs):
        first.setdefault(id(spec), k)

    def part(value: Any) -> Any:
        if isinstance(value, _TensorSpec):
            return (value.shape, value.stride, value.dtype, value.device, value.requires_grad,
                    value.sharded, first[id(value)])
        return value if isinstance(value, Hashable) else repr(value)

    leaves, structure = tree_flatten(arg_specs, is_leaf=lambda v: isinstance(v, _TensorSpec))
    return func, repr(structure), tuple(part(v) for v in leaves)


def _on_the_cpu(record: _OpRecord, specs: list[_TensorSpec], tracker: _WindowTracker
                ) -> _Backward | None:
    """An op of the CPU whose fake kernel refuses what its real one runs (``_grouped_mm``
    in fp32): its backward alone on real stand-ins, which cost a few tensors of one op;
    None where that fails too, or for another device's ops."""
    if not specs or any(s.device.type != "cpu" for s in specs):
        return None
    try:
        with _disable_current_modes():  # the fake mode the stand-ins otherwise run in
            args, kwargs = tree_map(_stand_ins(specs, real=True), record.arg_specs,
                                    is_leaf=lambda v: isinstance(v, _TensorSpec))
            return _profile_backward(record.func, args, kwargs, [s.storage for s in specs],
                                     tracker)
    except Exception:
        return None


def _stand_ins(specs: list[_TensorSpec], real: bool = False) -> Callable[[Any], Any]:
    """Stand-ins for an op's tensor arguments, one per argument tensor: fake ones, or
    ``real`` ones. A meta constant met in a fake step of a meta model ran as a tensor of
    the step's device (``profiles.fake.MetaAsDevice``): its stand-in goes there too."""
    made: dict[int, torch.Tensor] = {}
    devices = {s.device for s in specs if s.device.type != "meta"}
    device = next(iter(devices)) if len(devices) == 1 else None

    def build(value: Any) -> Any:
        if not isinstance(value, _TensorSpec):
            return value
        if id(value) not in made:
            spec = value if device is None or value.device.type != "meta" else \
                dataclasses.replace(value, device=device)
            made[id(value)] = spec.make(real=real)
        return made[id(value)]

    return build


def _tensors_specs(arg_specs: Any) -> list[_TensorSpec]:
    return [v for v in tree_leaves(arg_specs, is_leaf=lambda v: isinstance(v, _TensorSpec))
            if isinstance(v, _TensorSpec)]


# ----------------------------------------------------------------------------- observed backward


class _BackwardObserver(RuntimeAwareMode):
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
        self.function_ops: dict[int, int] = {}  # a Function call's node -> its last op
        self.written_views: list[torch.Tensor] = []  # views an op wrote in place, in forward
        self._live: dict[StorageWeakRef, int] = {}
        # (forward op, live before, after, what): each backward op ("op"), each unpack of a
        # saved tensor ("unpack": live then is what a rerun it starts runs on top of), and
        # each node's release of its saved tensors ("release", `_Saved`)
        self.ops: list[tuple[int | None, int, int, str]] = []

    def function_started(self, cls: type, args: tuple, kwargs: dict) -> tuple[int, int]:
        """A custom Function's node is made, numbered, before its forward's ops run."""
        return torch._C._autograd._get_sequence_nr(), len(self.names)

    def function_ended(self, started: tuple[int, int], output: Any) -> None:
        seq, start = started
        if len(self.names) > start:  # booked to its last op, as the profile books it
            self.function_ops[seq] = len(self.names) - 1

    def pack(self, tensor: torch.Tensor) -> _Saved:
        """Kept as autograd keeps it, in a holder whose death says when its node let go."""
        return _Saved(tensor, self._released)

    def _released(self) -> None:
        """A node released its saved tensors (the engine does so once the node's work is
        done, before it adds the node's gradients into buffers of other nodes' inputs)."""
        if self.backward:
            self.ops.append((self._current_forward(), *(self.live_bytes(),) * 2, "release"))

    def _current_forward(self) -> int | None:
        """The forward op whose backward node the engine is running now, if known."""
        node = torch._C._current_autograd_node()
        return self.op_of_seq.get(node._sequence_nr()) if node is not None else None

    def unpack(self, saved: _Saved) -> torch.Tensor:
        """A backward node unpacks a saved tensor: what the backward holds now is what a
        checkpoint's rerun that this unpack starts runs on top of (CopySlices, the backward
        of an in-place op on a view, allocates its gradient buffers before it unpacks)."""
        if self.backward:
            self.ops.append((self._current_forward(), *(self.live_bytes(),) * 2, "unpack"))
        return saved.tensor

    def _as_strided_backwards(self) -> None:
        """A view written in place has its backward rebased onto the new base: on a device's
        tensors it is an ``AsStridedBackward0``, which makes a gradient of the base's whole
        size (``new_zeros``) and hands it to the base's ``CopySlices``. Fake tensors replay
        the view instead (a ``ViewBackward0``: no buffer), so here that backward's output is
        copied into a buffer of its own, as the device's engine makes one."""
        for view in self.written_views:
            node = view.grad_fn
            if node is not None and type(node).__name__ != "AsStridedBackward0":
                node.register_hook(_fresh_gradients)
        self.written_views.clear()

    def map_nodes(self, loss: torch.Tensor) -> None:
        """Match the autograd nodes of ``loss``'s graph to the forward ops that made them."""
        import difflib
        import re

        self._as_strided_backwards()

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
            if seq in self.function_ops:
                self.op_of_seq[seq] = self.function_ops[seq]
                continue
            copied = self._in_place_on_a_view(seq, key)
            if copied is not None:
                self.op_of_seq[seq] = copied
                continue
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

    def _in_place_on_a_view(self, seq: int, key: str) -> int | None:
        """The in-place op a ``CopySlices`` node stands for (its backward wraps the op's):
        autograd makes it just after that op reached this mode, numbered with the counter
        the op read."""
        if key != "copyslices":
            return None
        op = bisect.bisect_right(self.seqs, seq) - 1
        if op >= 0 and self.seqs[op] == seq and self.names[op].split(".")[1].endswith("_"):
            return op
        return None

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
                  for t in tensors_in((args, kwargs))}
        out = func(*args, **kwargs)
        for tensor in tensors_in(out):
            if StorageWeakRef(local_tensor(tensor).untyped_storage()) not in inputs:
                self.runtime.add(tensor)
        if self.backward:
            self.ops.append((None, before, self.live_bytes(), "op"))
        return out

    def _op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not self.backward:
            self.names.append(str(func))
            self.seqs.append(torch._C._autograd._get_sequence_nr())
            if args and isinstance(args[0], torch.Tensor) and args[0]._is_view() and \
                    0 in _written_positions(func) and args[0].requires_grad:
                self.written_views.append(args[0])  # its backward is rebased (`map_nodes`)
            return func(*args, **kwargs)
        before = self.live_bytes()
        inputs = {StorageWeakRef(local_tensor(t).untyped_storage())
                  for t in tensors_in((args, kwargs))}
        out = func(*args, **kwargs)
        # a view op allocates nothing, whatever storage its output shows: its input may be
        # a tensor from before the step that fake mode converted when the op read it (a
        # pipeline stage's received gradient), whose twin's storage is new to this mode
        for tensor in () if getattr(func, "is_view", False) else tensors_in(out):
            storage = local_tensor(tensor).untyped_storage()
            ref = StorageWeakRef(storage)
            if ref not in inputs and ref not in self._live:
                self._live[ref] = storage.nbytes()
        self.ops.append((self._current_forward(), before,
                         sum(self._live.values()) + self._runtime_bytes(), "op"))
        return out


class _Saved:
    """A saved tensor as `_BackwardObserver.pack` keeps it: ``released`` is called when
    autograd drops it (the node's ``release_variables``), or the graph dies."""

    __slots__ = ("released", "tensor")

    def __init__(self, tensor: torch.Tensor, released: Callable[[], None]) -> None:
        self.tensor, self.released = tensor, released

    def __del__(self) -> None:
        self.released()


def _fresh_gradients(grad_inputs: tuple, grad_outputs: tuple) -> tuple:
    """A backward node's outputs, each in a buffer of its own (`_as_strided_backwards`)."""
    return tuple(g.clone() if isinstance(g, torch.Tensor) else g for g in grad_inputs)


def _observe_backward(step: _Step, names: list[str], real: bool, spec: DeviceSpec | None
                      ) -> list[tuple[int, int, int, int, int]] | None:
    """Per op of the profile (``names``, then the loss), the backward-held bytes before its
    backward, at its peak, after it, at its first unpack and at its peak while it holds its
    saved tensors (`_per_op`), observed in a fake
    step, or in a real one when the forward ran on real tensors and fake ones cannot run
    the backward, or run another forward (LED's slices: the nodes of the fake backward then
    fold onto the profile's ops only approximately, and its temporaries land on other
    nodes); None if neither can.
    """
    attempts = [False, True] if real else [False]
    if step.twin is not None:  # as the forward was recorded: the twin's runtime is its own
        attempts = [real]
    approximate = None  # a fake observation of another forward, if nothing better comes
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
        if on_real or observer.names == names or True not in attempts:
            return _per_op(observer, names)
        approximate = observer
        log.info("the fake forward of %s runs other ops than the recorded one; observing its "
                 "backward on real tensors", type(model).__name__)
    if approximate is not None:
        return _per_op(approximate, names)
    log.warning("could not observe the backward of %s; gradients are modelled instead",
                type(model).__name__)
    return None


def _observe(step: _Step, observer: _BackwardObserver, args: tuple, kwargs: dict) -> None:
    with observer:
        with watched_functions(observer.function_started, observer.function_ended), \
                torch.autograd.graph.saved_tensors_hooks(observer.pack, observer.unpack):
            loss = step.forward_loss(args, kwargs)
        observer.map_nodes(loss)
        observer.backward = True
        loss.backward()
        observer.backward = False  # what dies with the graph from here on is no node's


def _per_op(observer: _BackwardObserver, names: list[str]
            ) -> list[tuple[int, int, int, int, int]]:
    """Fold the observed backward ops onto the profile's ops (aligned by name where the
    observed forward differs, e.g. a mask a library builds only for fake tensors): per op,
    what the backward holds before its backward, at its peak, after it, when it first
    unpacks a saved tensor, and at its peak while it still holds its saved tensors (below
    the peak where the most comes after it released them: a gradient summed into a buffer)."""
    import difflib

    n = len(names)
    mapping: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, observer.names, names, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            mapping[a + k] = b + k
    before: dict[int, int] = {}
    peak: dict[int, int] = {}
    held: dict[int, int] = {}
    after: dict[int, int] = {}
    unpack: dict[int, int] = {}
    released: set[int] = set()
    current = n  # the loss pseudo-node: the seed made before any node runs
    for forward, live_before, live_after, what in observer.ops:
        target = mapping.get(forward) if forward is not None else None
        if target is not None and target < current:
            after[current] = live_before  # what it freed is gone once the next one starts
            current = target
        if what == "release":
            released.add(current)
            continue
        before.setdefault(current, live_before)
        peak[current] = max(peak.get(current, 0), live_after, live_before)
        if current not in released:
            held[current] = peak[current]
        after[current] = live_after
        if what == "unpack":
            unpack.setdefault(current, live_before)
    rows: list[tuple[int, int, int, int, int]] = []
    carry = 0
    for j in range(n, -1, -1):  # backward order; nodes without work keep what is live
        if j in before:
            rows.append((before[j], peak[j], after[j], unpack.get(j, before[j]),
                         held.get(j, before[j])))
            carry = after[j]
        else:
            rows.append((carry, carry, carry, carry, carry))
    return rows[::-1]
