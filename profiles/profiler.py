"""Profile a captured graph: storages, saved tensors, temporaries and times per node.

Memory comes from one run of the graph under ``FakeTensorMode`` (exact shapes, dtypes and
aliasing, no real memory): a dispatch mode sees every aten op's outputs, and
``saved_tensors_hooks`` see every tensor autograd keeps. Storages are the unit of memory (views
share their base's), so each saved tensor is attributed to the storage it lives in and to the
node that allocated that storage.

Backward cost is profiled per node in isolation: the node is re-run on fresh leaf copies of
its inputs and ``torch.autograd.grad`` is taken through it, under the same dispatch mode, so
backward FLOPs, temporaries and (with ``timing="measure"``) wall time are the node's own, not
an assumed multiple of forward.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry
from tqdm.auto import tqdm

from profiles.calibrate import calibrate_checkpoint_costs
from profiles.devices import DeviceSpec, device_spec
from profiles.errors import ProfileError
from profiles.schema import (
    GraphProfile,
    NodeProfile,
    StaticMemory,
    StepTiming,
    StorageInfo,
    TensorMeta,
)
from profiles.tracing import flat_placeholder_values, graph_fingerprint, normalize_inputs

log = logging.getLogger(__name__)

LOSS_NODE = "loss"
CALIBRATION_S = 0.5  # time spent measuring checkpoint overhead (timing="measure")


# ----------------------------------------------------------------------------- loss


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model output when the user gave no loss_fn.

    A scalar output is the loss; HF-style outputs carry ``.loss`` / ``["loss"]`` when labels
    were passed. Anything else needs an explicit ``loss_fn``.
    """
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(())
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    kind = type(output).__name__
    shape = f" of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else ""
    raise ValueError(
        f"Cannot tell the training loss from the model's output ({kind}{shape}): pass "
        "loss_fn=lambda output: ... returning a scalar tensor (for HF models, passing "
        "`labels` in the inputs makes the output carry `.loss`)."
    )


# ----------------------------------------------------------------------------- storages


@dataclass
class _Storages:
    """Registry mapping live storages to ids, with kind, size, producer and name."""

    refs: dict[StorageWeakRef, int] = field(default_factory=dict)
    infos: list[StorageInfo] = field(default_factory=list)
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # ids must never be reused

    def lookup(self, tensor: torch.Tensor) -> int | None:
        return self.refs.get(StorageWeakRef(tensor.untyped_storage()))

    def add(self, tensor: torch.Tensor, kind: str, producer: int | None, name: str = "") -> int:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref in self.refs:
            return self.refs[ref]
        sid = len(self.infos)
        self.refs[ref] = sid
        self.infos.append(StorageInfo(id=sid, nbytes=tensor.untyped_storage().nbytes(),
                                      kind=kind, producer=producer, name=name))
        self.keep_alive.append(tensor)
        return sid

    def total_bytes(self, kind: str) -> int:
        return sum(s.nbytes for s in self.infos if s.kind == kind)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ----------------------------------------------------------------------------- op tracking


@dataclass
class _OpStats:
    flops: int = 0
    estimated_ms: float = 0.0
    peak_new_bytes: int = 0
    params: set[int] = field(default_factory=set)
    mutated: set[int] = field(default_factory=set)
    random: bool = False
    ops: list[str] = field(default_factory=list)  # aten ops in call order (no prim ops)
    op_allocs: list[set[StorageWeakRef]] = field(default_factory=list)  # per op: allocated
    op_inplace: list[set[StorageWeakRef]] = field(default_factory=list)  # per op: mutated
    written: set[int] = field(default_factory=set)  # known activations mutated in place


class _OpTracker(TorchDispatchMode):
    """Sees every aten op: FLOPs, roofline time, live new storages, mutations of state."""

    def __init__(self, storages: _Storages, spec: DeviceSpec | None) -> None:
        super().__init__()
        self.storages = storages
        self.spec = spec
        self.stats = _OpStats()
        self._new: dict[StorageWeakRef, int] = {}

    @contextmanager
    def window(self) -> Iterator[_OpStats]:
        """Collect stats for the ops run inside this block."""
        self.stats, self._new = _OpStats(), {}
        try:
            yield self.stats
        finally:  # ops outside any window go to a throwaway record
            self.stats, self._new = _OpStats(), {}

    def live_new_bytes(self) -> int:
        return sum(n for ref, n in self._new.items() if not ref.expired())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        stats = self.stats
        flops = 0
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
        stats.flops += flops
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        aliased = {StorageWeakRef(t.untyped_storage()) for t in inputs}
        for tensor in inputs:
            sid = self.storages.lookup(tensor)
            if sid is not None and self.storages.infos[sid].kind == "param":
                stats.params.add(sid)
        written: set[StorageWeakRef] = set()
        if func._schema.is_mutable:
            for index, argument in enumerate(func._schema.arguments):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    value = args[index] if index < len(args) else kwargs.get(argument.name)
                    for tensor in _tensors(value):
                        written.add(StorageWeakRef(tensor.untyped_storage()))
                        sid = self.storages.lookup(tensor)
                        if sid is None:
                            continue
                        if self.storages.infos[sid].kind in ("buffer", "param"):
                            stats.mutated.add(sid)
                        else:
                            stats.written.add(sid)
        if torch.Tag.nondeterministic_seeded in func.tags:
            stats.random = True
        for tensor in outputs:  # allocated by this op: not a view of (or same as) an input
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref not in aliased and ref not in self._new and ref not in self.storages.refs:
                self._new[ref] = tensor.untyped_storage().nbytes()
        if func.namespace != "prim":
            stats.ops.append(str(func))
            stats.op_allocs.append({StorageWeakRef(t.untyped_storage())
                                    for t in outputs} - aliased)
            stats.op_inplace.append(written)
        stats.peak_new_bytes = max(stats.peak_new_bytes, self.live_new_bytes())
        if self.spec is not None:
            traffic = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
            dtype = str(outputs[0].dtype).removeprefix("torch.") if outputs else "float32"
            stats.estimated_ms += self.spec.op_time_ms(flops, traffic, dtype)
        return out


# ----------------------------------------------------------------------------- timing


class _Timer:
    """Warm median wall time of a callable: CUDA events on a GPU, perf_counter on CPU.

    On CPU with one intra-op thread the process's CPU time is used instead: the same on a
    quiet host, but time the host gives other processes does not count (a shared host makes
    wall times erratic); with more threads CPU time would add them up, so wall time stays.
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


# ----------------------------------------------------------------------------- interpreter


@dataclass
class _NodeRecord:
    outputs: list[TensorMeta] = field(default_factory=list)
    new_storages: list[int] = field(default_factory=list)
    saved: list[torch.Tensor] = field(default_factory=list)
    saved_storages: list[int] = field(default_factory=list)
    stats: _OpStats = field(default_factory=_OpStats)
    fwd_temp_bytes: int = 0
    output_ops: list[int] = field(default_factory=list)
    keepable: bool = True


class _ProfilingInterpreter(torch.fx.Interpreter):
    """Runs the graph once, recording per node its storages, saved tensors and op stats."""

    def __init__(self, gm: torch.fx.GraphModule, storages: _Storages, tracker: _OpTracker,
                 progress: tqdm) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.storages = storages
        self.tracker = tracker
        self.progress = progress
        self.index = {node: i for i, node in enumerate(gm.graph.nodes)}
        self.records: list[_NodeRecord] = []
        self.values: dict[torch.fx.Node, Any] = {}  # strong refs for the isolated backward

    def run_node(self, node: torch.fx.Node) -> Any:
        record = _NodeRecord()
        self.records.append(record)
        with (torch.autograd.graph.saved_tensors_hooks(self._pack(record), lambda t: t),
              self.tracker.window() as stats):
            try:
                result = super().run_node(node)
            except Exception as error:
                raise ProfileError(f"profiling failed at {node.format_node()}: "
                                   f"{type(error).__name__}: {error}") from error
            final_new = self.tracker.live_new_bytes()
        record.stats = stats
        record.fwd_temp_bytes = max(0, stats.peak_new_bytes - final_new)
        self.register(self.index[node], result, record)
        self.values[node] = result
        self.progress.update(1)
        return result

    def register(self, index: int, result: Any, record: _NodeRecord) -> None:
        """Give new storages of outputs and saved tensors their producer ``index``."""
        known = len(self.storages.infos)
        for tensor in _tensors(result):
            sid = self.storages.add(tensor, "activation", index)
            record.outputs.append(TensorMeta(
                shape=list(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."),
                nbytes=_nbytes(tensor), storage=sid, requires_grad=tensor.requires_grad))
        for tensor in record.saved:
            record.saved_storages.append(self.storages.add(tensor, "internal", index))
        record.saved_storages = sorted(set(record.saved_storages))
        record.new_storages = list(range(known, len(self.storages.infos)))
        # A SAC policy can keep a storage only by saving the op that allocates it, and only
        # if no later op of the node mutates it (callers keep using the mutated argument, so
        # an in-place op cannot be replayed from a cache): dropout's mask is not keepable.
        stats = record.stats
        new_refs = {ref for ref, sid in self.storages.refs.items() if sid >= known}
        allocator: dict[StorageWeakRef, int] = {}
        for position, refs in enumerate(stats.op_allocs):
            for ref in refs & new_refs:
                allocator.setdefault(ref, position)
        mutated_later = {ref for position, refs in enumerate(stats.op_inplace)
                         for ref in refs if ref in allocator and position > allocator[ref]}
        record.keepable = not mutated_later
        record.output_ops = sorted(set(allocator.values())) if record.keepable else []

    @staticmethod
    def _pack(record: _NodeRecord) -> Callable[[torch.Tensor], torch.Tensor]:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            record.saved.append(tensor)
            return tensor

        return pack


# ----------------------------------------------------------------------------- backward

Call = Callable[[tuple, dict], Any]


def _fresh_inputs(args: Any, kwargs: Any, params: list[torch.Tensor],
                  origins: list[torch.Tensor] | None = None
                  ) -> tuple[Any, Any, list[torch.Tensor]]:
    """Copies of a node's arguments for an isolated run: tensors that need grad become new
    leaves (passed on through a clone, so in-place ops on them stay legal). The parameters
    the node reads (module attributes or arguments) are leaves as they are. ``origins``, if
    given, receives the original tensor of each leaf."""
    leaves: list[torch.Tensor] = [p for p in params if p.requires_grad]
    sources = origins if origins is not None else []
    sources.extend(leaves)

    def fresh(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_leaf and value.requires_grad:
            if not any(value is leaf for leaf in leaves):
                leaves.append(value)
                sources.append(value)
            return value
        if value.requires_grad:
            leaf = value.detach().clone().requires_grad_()
            leaves.append(leaf)
            sources.append(value)
            return leaf.clone()
        return value.detach()

    return tree_map(fresh, args), tree_map(fresh, kwargs), leaves


def _isolated_forward(call: Call, state: tuple[Any, Any, list[torch.Tensor]]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    args, kwargs, leaves = state
    out = call(args, kwargs)
    return [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None], leaves


def _with_grad_outputs(state: tuple[list[torch.Tensor], list[torch.Tensor]]) -> tuple:
    outs, leaves = state
    return outs, leaves, [torch.ones_like(t) for t in outs]


def _isolated_backward(state: tuple[list[torch.Tensor], list[torch.Tensor], list]) -> Any:
    outs, leaves, grads = state
    if not outs or not leaves:
        return ()
    return torch.autograd.grad(outs, leaves, grads, allow_unused=True)


@dataclass
class _Backward:
    flops: int = 0
    estimated_ms: float = 0.0
    temp_bytes: int = 0
    grad_storages: list[int] = field(default_factory=list)  # inputs it sends gradients to


def _profile_backward(call: Call, args: Any, kwargs: Any, params: list[torch.Tensor],
                      tracker: _OpTracker) -> _Backward:
    """FLOPs, roofline time, temporaries and gradient targets of one node's backward, run in
    isolation."""
    origins: list[torch.Tensor] = []
    outs, leaves = _isolated_forward(call, _fresh_inputs(args, kwargs, params, origins))
    if not outs or not leaves:
        return _Backward()
    grad_outputs = [torch.ones_like(t) for t in outs]
    with tracker.window() as stats:
        grads = torch.autograd.grad(outs, leaves, grad_outputs, allow_unused=True)
        final = tracker.live_new_bytes()
    targets = {tracker.storages.lookup(origin)
               for origin, grad in zip(origins, grads, strict=True) if grad is not None}
    del grads
    return _Backward(stats.flops, stats.estimated_ms, max(0, stats.peak_new_bytes - final),
                     sorted(t for t in targets if t is not None))


def _measure(call: Call, args: Any, kwargs: Any, params: list[torch.Tensor], timer: _Timer
             ) -> tuple[float, float]:
    """Warm median forward and backward wall time of one node on real tensors.

    The backward time excludes the fixed cost of entering the autograd engine once per
    node, which a whole-graph backward pays once (calibrated in ``_Timer``).
    """
    forward_ms = timer.median_ms(lambda: _fresh_inputs(args, kwargs, params),
                                 lambda state: _isolated_forward(call, state))
    backward_ms = timer.median_ms(
        lambda: _with_grad_outputs(_isolated_forward(call, _fresh_inputs(args, kwargs, params))),
        _isolated_backward)
    return forward_ms, max(0.0, backward_ms - timer.engine_overhead_ms)


def _node_call(interp: torch.fx.Interpreter, node: torch.fx.Node) -> Call:
    return lambda args, kwargs: getattr(interp, node.op)(node.target, args, kwargs)


def _loss_call(loss_fn: Callable[[Any], torch.Tensor]) -> Call:
    return lambda args, kwargs: loss_fn(args[0])


def _node_args(values: dict[torch.fx.Node, Any], node: torch.fx.Node) -> tuple[tuple, dict]:
    def value(n: torch.fx.Node) -> Any:
        return values[n]

    return (torch.fx.node.map_arg(node.args, value),  # type: ignore[return-value]
            torch.fx.node.map_arg(node.kwargs, value))


COMPUTE_OPS = ("call_module", "call_function", "call_method")


@dataclass
class _MeasuredTimes:
    per_node: list[tuple[float, float]]  # (forward, backward) ms, loss last, calibrated
    step_fwd_ms: float  # whole forward + loss, measured
    step_bwd_ms: float  # whole backward, measured
    fwd_scale: float  # whole / sum of isolated node times
    bwd_scale: float


def _measure_times(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], flat_inputs: list,
                   node_params: list[list[str]], loss_fn: Callable[[Any], torch.Tensor],
                   timer: _Timer, progress: bool) -> _MeasuredTimes:
    """Forward/backward wall time of every node (loss last), on real tensors.

    Isolated node times carry costs a whole step does not (cold caches, per-call engine
    entry), most visibly on CPU; so the whole step is timed too and node times are scaled
    to add up to it: nodes give the split, the step gives the total.
    Runs on copies of the buffers, so BatchNorm statistics of the model do not move.
    """
    buffers = {name: b.clone() for name, b in gm.named_buffers(remove_duplicate=False)}
    times: list[tuple[float, float]] = []
    with _reparametrize_module(gm, buffers, strict=False):
        interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
        # with grad enabled, so values know whether they need grad, as in training
        flat_out = interp.run(*flat_inputs, enable_io_processing=False)
        values = interp.env
        for node, names in tqdm(list(zip(nodes, node_params, strict=False)),
                                desc="timing nodes", disable=not progress, leave=False):
            if node.op in COMPUTE_OPS:
                args, kwargs = _node_args(values, node)
                params = [gm.get_parameter(name) for name in names]
                times.append(_measure(_node_call(interp, node), args, kwargs, params, timer))
            else:
                times.append((0.0, 0.0))
        output = gm.graph.process_outputs(flat_out)
        output = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point())
                          if isinstance(t, torch.Tensor) else t, output)
        times.append(_measure(_loss_call(loss_fn), (output,), {}, [], timer))
        del values, interp, flat_out, output
        step_fwd_ms, step_bwd_ms = _measure_step(gm, flat_inputs, loss_fn, timer)
    fwd_scale = step_fwd_ms / max(sum(f for f, _ in times), 1e-9)
    bwd_scale = step_bwd_ms / max(sum(b for _, b in times), 1e-9)
    return _MeasuredTimes([(f * fwd_scale, b * bwd_scale) for f, b in times],
                          step_fwd_ms, step_bwd_ms, fwd_scale, bwd_scale)


def _measure_step(gm: torch.fx.GraphModule, flat_inputs: list,
                  loss_fn: Callable[[Any], torch.Tensor], timer: _Timer) -> tuple[float, float]:
    """Warm median time of the whole forward+loss and of the whole backward.

    Gradients go through ``torch.autograd.grad``, so the model's ``.grad`` stay untouched.
    """
    params = [p for p in gm.parameters() if p.requires_grad]

    def forward(_: Any = None) -> torch.Tensor:
        flat_out = torch.fx.Interpreter(gm).run(*flat_inputs, enable_io_processing=False)
        return loss_fn(gm.graph.process_outputs(flat_out))

    def backward(loss: torch.Tensor) -> Any:
        return torch.autograd.grad(loss, params, allow_unused=True) if params else ()

    return (timer.median_ms(lambda: None, forward),
            max(0.0, timer.median_ms(forward, backward) - timer.engine_overhead_ms))


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None) or str(target)
    return f"{module}.{qualname}" if module and module != "builtins" else qualname


def _module_path(node: torch.fx.Node | None) -> str:
    if node is None:
        return ""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return str(path).removeprefix("L['self'].").removeprefix("L__self__")
    return ""


# ----------------------------------------------------------------------------- state


@contextmanager
def _rng_state_preserved() -> Iterator[None]:
    """Profiling draws random numbers (dropout); give the user's RNG state back."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer | None,
                           fake_params: dict[int, torch.Tensor]) -> int:
    """Bytes of the optimizer's state after one step, found by stepping a fake twin."""
    if optimizer is None:
        return 0
    groups = []
    for group in optimizer.param_groups:
        params = [fake_params[id(p)] for p in group["params"] if id(p) in fake_params]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    twin_params = [p for g in groups for p in g["params"]]
    for p in twin_params:
        p.grad = torch.zeros_like(p)
    try:
        # groups carry every hyperparameter; lr is passed for optimizers that require it
        twin = type(optimizer)(groups, lr=optimizer.defaults.get("lr", 1e-3))
        twin.step()
    except Exception as error:
        raise ProfileError(f"could not size the state of {type(optimizer).__name__}: {error}; "
                           "profile without optimizer= and add its state to the budget by "
                           "hand") from error
    finally:
        for p in twin_params:
            p.grad = None
    seen: set[StorageWeakRef] = set()
    total = 0
    for state in twin.state.values():
        for tensor in _tensors(state):
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref not in seen:
                seen.add(ref)
                total += tensor.untyped_storage().nbytes()
    return total


# ----------------------------------------------------------------------------- entry point


def _resolve_timing(timing: str, tensors: list[torch.Tensor]) -> str:
    from torch._subclasses.fake_tensor import FakeTensor

    abstract = any(t.is_meta or isinstance(t, FakeTensor) for t in tensors)
    if timing == "auto":
        return "estimate" if abstract else "measure"
    if timing == "measure" and abstract:
        raise ValueError("timing='measure' needs real tensors, but the model or inputs are on "
                         "the meta device or fake; use timing='estimate' with device='H100' "
                         "(or another profiles.DEVICES entry)")
    if timing not in ("measure", "estimate"):
        raise ValueError(f"timing must be 'auto', 'measure' or 'estimate', not {timing!r}")
    return timing


def profile(
    gm: torch.fx.GraphModule,
    example_inputs: Any = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    timing: str = "auto",
    device: str | DeviceSpec | None = None,
    repeats: int = 5,
    warmup: int = 2,
    progress: bool = True,
) -> GraphProfile:
    """Profile one training step (forward, loss, backward) of a captured graph.

    Args:
        gm: from :func:`profiles.capture` (a plain fx GraphModule works too).
        example_inputs: a tensor, tuple or dict, as passed to capture; None: the inputs
            capture was given (or found on the model).
        loss_fn: ``loss_fn(output) -> scalar``; default: the one given to capture, else
            :func:`default_loss`.
        optimizer: counted in static memory (its state after one step).
        timing: ``"measure"`` runs nodes on the model's device (warm median of ``repeats``)
            and calibrates the checkpoint overhead there (``profiles.calibrate``, about
            ``CALIBRATION_S``); ``"estimate"`` uses FLOPs and the roofline of ``device``, and
            its default checkpoint overhead; ``"auto"`` measures real tensors and estimates
            meta/fake ones.
        device: roofline for estimates (``"H100"``, ``"A100"``, ``"cpu"`` or a DeviceSpec);
            default: H100 when estimating.
        progress: show a progress bar.

    The model is left as it was: parameters, buffers, gradients and RNG state.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    info = gm.meta.get("planner", {})
    if example_inputs is None and "inputs" in info:
        args, kwargs = info["inputs"]
    else:
        args, kwargs = normalize_inputs(gm, example_inputs)
    flat_inputs = flat_placeholder_values(gm, args, kwargs)
    loss_fn = loss_fn or info.get("loss_fn") or default_loss
    params = dict(gm.named_parameters(remove_duplicate=False))
    buffers = dict(gm.named_buffers(remove_duplicate=False))
    input_tensors = _tensors(flat_inputs)
    timing = _resolve_timing(timing, [*params.values(), *buffers.values(), *input_tensors])
    spec = device_spec(device or "H100") if timing == "estimate" else None
    nodes = list(gm.graph.nodes)
    name = info.get("model_name", type(gm).__name__)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    storages = _Storages()
    with _rng_state_preserved(), fake_mode:
        fake_state = {k: fake_mode.from_tensor(t) for k, t in {**params, **buffers}.items()}
        for key in params:
            storages.add(fake_state[key], "param", None, key)
        for key in buffers:
            storages.add(fake_state[key], "buffer", None, key)
        fake_inputs = [fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                       for v in flat_inputs]
        placeholders = [n.name for n in nodes if n.op == "placeholder"]
        for key, value in zip(placeholders, fake_inputs, strict=False):
            for tensor in _tensors(value):
                storages.add(tensor, "input", None, key)
        tracker = _OpTracker(storages, spec)
        with (tqdm(total=2 * len(nodes) + 2, desc=f"profiling {name}", disable=not progress,
                   leave=False) as bar,
              _reparametrize_module(gm, fake_state, tie_weights=True, strict=False),
              tracker):
            interp = _ProfilingInterpreter(gm, storages, tracker, bar)
            output = gm.graph.process_outputs(interp.run(*fake_inputs,
                                                         enable_io_processing=False))
            loss_record = _run_loss(interp, loss_fn, output, len(nodes))
            bar.update(1)
            backward = []
            for node, record in zip(nodes, interp.records, strict=True):
                if node.op in COMPUTE_OPS:
                    node_args, node_kwargs = _node_args(interp.values, node)
                    reads = [storages.keep_alive[sid] for sid in sorted(record.stats.params)]
                    backward.append(_profile_backward(_node_call(interp, node), node_args,
                                                      node_kwargs, reads, tracker))
                else:
                    backward.append(_Backward())
                bar.update(1)
            backward.append(_profile_backward(_loss_call(loss_fn), (output,), {}, [], tracker))
            bar.update(1)
        fake_params = {id(p): fake_state[key] for key, p in params.items()}
        static = StaticMemory(
            param_bytes=storages.total_bytes("param"),
            grad_bytes=sum(s.nbytes for s in storages.infos if s.kind == "param"
                           and storages.keep_alive[s.id].requires_grad),
            buffer_bytes=storages.total_bytes("buffer"),
            input_bytes=storages.total_bytes("input"),
            optimizer_state_bytes=_optimizer_state_bytes(optimizer, fake_params),
        )

    measured: _MeasuredTimes | None = None
    run_device = "cpu"
    costs = spec.checkpoint_costs() if spec else None
    if timing == "measure":
        tensors = [*params.values(), *input_tensors]
        run_device = str(tensors[0].device) if tensors else "cpu"
        with _rng_state_preserved():
            node_params = [[storages.infos[sid].name for sid in sorted(r.stats.params)]
                           for r in interp.records]
            measured = _measure_times(gm, nodes, flat_inputs, node_params, loss_fn,
                                   _Timer(torch.device(run_device), repeats, warmup), progress)
            costs = calibrate_checkpoint_costs(run_device, budget_s=CALIBRATION_S)

    records = [*interp.records, loss_record]
    node_profiles = [
        _node_profile(i, nodes[i] if i < len(nodes) else None, record, backward[i],
                      measured.per_node[i] if measured else None, storages, loss_fn, nodes)
        for i, record in enumerate(records)
    ]
    return GraphProfile(
        model_name=name,
        capture_method=info.get("method", "fx"),
        timing=timing,
        device=spec.name if spec else run_device,
        torch_version=torch.__version__,
        fingerprint=graph_fingerprint(gm, flat_inputs),
        nodes=node_profiles,
        storages=list(storages.infos),
        static=static,
        step=StepTiming(fwd_ms=measured.step_fwd_ms, bwd_ms=measured.step_bwd_ms,
                        fwd_scale=measured.fwd_scale, bwd_scale=measured.bwd_scale)
        if measured else None,
        checkpoint_costs=costs,
    )


def _run_loss(interp: _ProfilingInterpreter, loss_fn: Callable[[Any], torch.Tensor],
              output: Any, index: int) -> _NodeRecord:
    """Run the loss as the last node of the step, recording it like a graph node."""
    record = _NodeRecord()
    with (torch.autograd.graph.saved_tensors_hooks(interp._pack(record), lambda t: t),
          interp.tracker.window() as stats):
        loss = loss_fn(output)
        final = interp.tracker.live_new_bytes()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                         f"{getattr(loss, 'shape', '')}")
    record.stats = stats
    record.fwd_temp_bytes = max(0, stats.peak_new_bytes - final)
    interp.register(index, loss, record)
    return record


def _owned_state(storages: _Storages, mutated: set[int]) -> list[str]:
    """Buffers a stateful node may update: every buffer of each module whose state it was
    seen mutating. (native_batch_norm updates running stats without declaring it in its
    schema; only num_batches_tracked's add_ is visible.)"""
    owners = {storages.infos[s].name.rpartition(".")[0] for s in mutated}
    return sorted(info.name for info in storages.infos if info.kind == "buffer"
                  and info.name.rpartition(".")[0] in owners)


def _node_profile(i: int, node: torch.fx.Node | None, record: _NodeRecord, bwd: _Backward,
                  measured: tuple[float, float] | None, storages: _Storages,
                  loss_fn: Callable[..., Any], nodes: list[torch.fx.Node]) -> NodeProfile:
    stats = record.stats
    if node is None:  # the loss
        op, target, args, users = "loss", _target_name(loss_fn), [nodes[-1].name], []
    else:
        op, target = node.op, _target_name(node.target)
        args = [a.name for a in node.all_input_nodes]
        users = [LOSS_NODE] if node.op == "output" else [u.name for u in node.users]
    return NodeProfile(
        index=i,
        name=LOSS_NODE if node is None else node.name,
        op=op,
        target=target,
        module=_module_path(node),
        args=args,
        users=users,
        outputs=record.outputs,
        new_storages=record.new_storages,
        saved_storages=record.saved_storages,
        params=sorted({storages.infos[s].name for s in stats.params}),
        fwd_time_ms=measured[0] if measured else stats.estimated_ms,
        bwd_time_ms=measured[1] if measured else bwd.estimated_ms,
        fwd_flops=stats.flops,
        bwd_flops=bwd.flops,
        fwd_temp_bytes=record.fwd_temp_bytes,
        bwd_temp_bytes=bwd.temp_bytes,
        stateful=bool(stats.mutated),
        random=stats.random,
        ops=stats.ops,
        output_ops=record.output_ops,
        keepable=record.keepable,
        saved_tensors=len(record.saved),
        written_storages=sorted(stats.written),
        mutated_buffers=_owned_state(storages, stats.mutated),
        grad_storages=bwd.grad_storages,
    )
