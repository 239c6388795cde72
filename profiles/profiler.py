"""Profile one training step of a model as it runs eagerly: every aten op is a node.

What the planned model runs is the user's own eager model with checkpoints on some of its
modules, so the profile observes exactly that program, not a captured graph of it:

1. **Memory** (``profiles.recording``): the forward and the loss run once under
   ``FakeTensorMode`` (exact shapes, dtypes and aliasing, no memory used) as the target
   device runs them (``profiles.fake``, ``profiles.kernels``), or on real tensors when the
   forward branches on tensor values it cannot know; every op, storage, save and module
   call is recorded.
2. **Backward** (``profiles.backward``): each op that records autograd history is re-run
   alone on fresh leaves shaped like its inputs and differentiated, for its backward FLOPs,
   temporaries and which inputs receive gradients; a second step observes what the
   backward holds per node.
3. **Time** (``profiles.timing``): with ``timing="measure"`` each op is timed alone and the
   node times are scaled to the measured whole step; ``timing="estimate"`` uses FLOPs and
   bytes against a device roofline.

This module assembles those into a ``GraphProfile`` (nodes, module calls, static memory).
How a step runs, fake or real, and what it starts from is ``profiles.step``. The model is
left exactly as it was: parameters, buffers (they are swapped for copies while the step
runs), gradients and the RNG state.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from profiles.backward import _backward_pass, _observe_backward, _WindowTracker
from profiles.devices import DeviceSpec, device_spec
from profiles.errors import LossNotFoundError, ProfileError, _first_line
from profiles.fake import fake_mode, meta_failures_at_debug
from profiles.functions import function_name
from profiles.inputs import normalize_inputs
from profiles.leaves import tensors_in
from profiles.parallel import Parallelism, fake_world, parallel_layout, parallel_twin
from profiles.recording import (
    _CallRecord,
    _dtype_name,
    _observed,
    _OpRecord,
    _Recorded,
    skippable_op,
)
from profiles.schema import (
    CheckpointCosts,
    FunctionSpan,
    GraphProfile,
    ModuleCall,
    NodeProfile,
    ParallelLayout,
    StaticMemory,
    StorageInfo,
    fingerprint,
)
from profiles.step import _grad_layout, _laid_out_grads, _rng_state_preserved, _Step
from profiles.timing import _MeasuredTimes, _timings
from profiles.traced import traced_calls

log = logging.getLogger(__name__)

LOSS_NODE = "loss"


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
    raise LossNotFoundError(f"{kind}{shape}")


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
    zero_grad_after_forward: bool = False,
    repeats: int = 5,
    warmup: int = 2,
    progress: bool = True,
    parallel: Parallelism | None = None,
    whole_step: bool = True,
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
            and calibrates the checkpoint overhead there (``profiles.calibrate``, for about
            ``profiles.host_costs.CALIBRATION_S``, once per host, device and torch version,
            `profiles.host_costs`); ``"estimate"``
            uses FLOPs and the roofline of ``device``, and its default checkpoint overhead;
            ``"auto"`` measures real tensors and estimates meta/fake ones.
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
            laid out as one backward leaves them (``profiles.step.GradLayout``: a
            gradient that is a slice of a larger one keeps all of it), found by running
            that backward once, fake or real as the profile runs; default: it starts with
            none, as ``zero_grad()`` leaves them. The ``.grad`` the model holds now never
            matter.
        zero_grad_after_forward: the step starts with the ``.grad`` one backward left (laid
            out as it left them) and frees them between its forward and its backward
            (``zero_grad()`` there: Lightning's order): the backward is a fresh one, the
            forward and the loss hold the gradients too.
        progress: show a progress bar (on a terminal or in a notebook).
        parallel: profile one rank of this parallelism (``profiles.parallel``): the user's
            ``parallelize`` runs on a copy of the model over a fake process group of the
            mesh's size, and the step recorded is that copy's on ``example_inputs`` (one
            rank's batch), with its runtime's memory measured at every node; the optimizer
            state and step count ``1/world_size`` of the model's. Times are estimated.
        whole_step: with measured times, time the whole step too and scale the op times
            to it (``step``); False leaves them as timed alone and ``step`` None, for a
            caller that scales them to steps it times itself (the planner's calibration on
            the CPU, `planner.region_calibration`).

    The model is left as it was: parameters, buffers, gradients and RNG state.

    Raises:
        ProfileError: the step cannot run (the message says where and what to do).
    """
    _refuse_active_tools(type(model).__name__)
    request = _request(model, example_inputs, loss_fn=loss_fn, autocast=autocast,
                       timing=timing, device=device, execution=execution,
                       grad_accumulation=grad_accumulation,
                       zero_grad_after_forward=zero_grad_after_forward, parallel=parallel)
    step, spec = request.step, request.spec
    if parallel is not None:  # the backend its collectives run on, said once for every run
        parallel = parallel.for_target(step.device_type, spec.name.lower() != "cpu")
    with _rng_state_preserved(), _parallel_world(step, parallel):
        rec = _record_with_fallback(step, request.execution == "real", request.abstract, spec,
                                    optimizer, progress)
        measured, costs, timing = _timings(step, rec, request.timing, spec, step.device_type,
                                           (repeats, warmup), progress, whole_step)
        # the same program as recorded: a real recording ran the real device's kernels
        kernels = None if rec.real else spec
        observed = _backward_memory(step, rec, kernels)
        # as the planned model will see it in its first step: after FSDP2's lazy init
        layout = parallel_layout(step.model, parallel) if parallel is not None else None
    if layout is not None:
        observed = _with_last_rank(step, parallel, rec, observed, kernels)
        rec.static = _rank_optimizer(rec.static, layout.world_size)
    nodes = _with_observed_backward(_node_profiles(rec, measured), observed)
    return _graph_profile(model, request, rec, nodes, measured, costs, timing, layout)


@dataclass
class _Request:
    """What :func:`profile` was asked for, checked and resolved: the step, how its forward
    is observed (``execution``), how it is timed and the device whose roofline estimates."""

    step: _Step
    inputs: list[torch.Tensor]
    timing: str
    execution: str
    abstract: bool  # the model or inputs are on the meta device or fake
    spec: DeviceSpec


def _request(model: nn.Module, example_inputs: Any, *,
             loss_fn: Callable[[Any], torch.Tensor] | None, autocast: torch.dtype | None,
             timing: str, device: str | DeviceSpec | None, execution: str,
             grad_accumulation: bool, zero_grad_after_forward: bool,
             parallel: Parallelism | None) -> _Request:
    """:func:`profile`'s options checked and resolved, in this order."""
    if grad_accumulation and zero_grad_after_forward:
        raise ValueError("grad_accumulation=True and zero_grad_after_forward=True: a step "
                         "either adds into the .grad it starts with or frees them before its "
                         "backward; plan the one whose peak is higher (accumulation's)")
    args, kwargs = normalize_inputs(model, example_inputs)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    input_tensors = tensors_in((args, kwargs))
    everything = [*params.values(), *buffers.values(), *input_tensors]
    resolved = _resolve_timing(timing, everything)
    device_type = _device_type(model, input_tensors)
    default_device = "cpu" if device_type == "cpu" and resolved == "measure" else "H100"
    spec = device_spec(device or default_device)  # estimates (or fallbacks when measuring)
    abstract = _abstract(everything)
    execution = _resolve_execution(execution, abstract)
    step = _Step(model, args, kwargs, loss_fn or default_loss, autocast, device_type,
                 bool(grad_accumulation), grads_in_forward=bool(zero_grad_after_forward))
    if parallel is not None:
        resolved = _check_parallel(timing, step)
    return _Request(step, input_tensors, resolved, execution, abstract, spec)


def _backward_memory(step: _Step, rec: _Recorded, kernels: DeviceSpec | None
                     ) -> list[tuple[int, int, int]] | None:
    """What the backward holds at each node, observed with ``kernels``
    (``profiles.backward._observe_backward``). With ``grads_at_start`` it starts from the
    gradients laid out as one backward leaves them, which are then the static gradient
    bytes of ``rec``; with ``grads_in_forward`` those bytes are the forward's, and the
    backward starts from none (a rank's: its parameters' shards, as FSDP2 leaves them)."""
    if step.grads_at_start or (step.grads_in_forward and step.twin is None):
        layout = _grad_layout(step, rec.real, kernels)
        rec.static = _laid_out_grads(rec.static, layout)
        step.grad_layout = layout if step.grads_at_start else None
    return _observe_backward(step, [r.name for r in rec.recorder.records], rec.real, kernels)


def _graph_profile(model: nn.Module, request: _Request, rec: _Recorded,
                   nodes: list[NodeProfile], measured: _MeasuredTimes | None,
                   costs: CheckpointCosts, timing: str,
                   layout: ParallelLayout | None) -> GraphProfile:
    """The profile of the recorded step, its nodes made."""
    autocast = request.step.autocast_dtype
    functions = [FunctionSpan(name=function_name(f.cls), start=f.start, stop=f.stop)
                 for f in rec.recorder.functions if f.last is not None]
    return GraphProfile(
        model_name=type(model).__name__,
        execution="real" if rec.real else "fake",
        timing=timing,
        device=_device_name(request.step.device_type) if measured else request.spec.name,
        torch_version=torch.__version__,
        fingerprint=trace_fingerprint(model, rec.recorder.records, rec.recorder.calls,
                                      request.inputs, autocast, request.step.grads_at_start,
                                      request.step.grads_in_forward),
        autocast_dtype=_dtype_name(autocast) if autocast is not None else None,
        nodes=nodes,
        storages=[StorageInfo(**info) for info in rec.storages.infos],
        module_calls=traced_calls(model, _module_calls(rec), nodes, functions),
        function_calls=functions,
        static=rec.static,
        step=measured.step if measured else None,
        checkpoint_costs=costs,
        parallel=layout,
    )


def observe_forward(model: nn.Module, args: tuple, kwargs: dict,
                    loss_fn: Callable[[Any], torch.Tensor] | None = None,
                    autocast: torch.dtype | None = None) -> str:
    """The trace fingerprint of one fake forward + loss of ``model`` (see
    :func:`trace_fingerprint`): cheap (no backward, no memory), for checking a plan."""
    step = _Step(model, args, kwargs, loss_fn or default_loss, autocast,
                 _device_type(model, tensors_in((args, kwargs))))
    with _rng_state_preserved(), _observed(step, False, None) as (rec, _):
        return trace_fingerprint(model, rec.recorder.records, rec.recorder.calls,
                                 tensors_in((args, kwargs)), autocast)


def trace_fingerprint(model: nn.Module, records: list[Any], calls: list[Any],
                      inputs: list[torch.Tensor], autocast_dtype: torch.dtype | None,
                      grads_at_start: bool = False, grads_in_forward: bool = False) -> str:
    """Hash of what a plan depends on: the ops in order and the module call that ran each,
    the module calls' spans, parameter/buffer shapes and dtypes, input shapes and dtypes, the
    autocast dtype and whether the step starts with gradients allocated (or holds them
    through its forward only). No generated names,
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
    if grads_in_forward:
        structure.append("gradients held through the forward, freed before the backward")
    return fingerprint(structure)


# ----------------------------------------------------------------------------- options


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


def _resolve_execution(execution: str, abstract: bool) -> str:
    if execution == "auto":
        execution = "fake" if abstract else "real"
    if execution not in ("real", "fake"):
        raise ValueError(f"execution must be 'auto', 'real' or 'fake', not {execution!r}")
    if execution == "real" and abstract:
        raise ValueError("execution='real' needs real tensors, but the model or inputs are on "
                         "the meta device or fake; use execution='fake'")
    return execution


def _abstract(tensors: list[torch.Tensor]) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(t.is_meta or isinstance(t, FakeTensor) for t in tensors)


def _device_type(model: nn.Module, tensors: list[torch.Tensor]) -> str:
    for tensor in [*model.parameters(), *model.buffers(), *tensors]:
        if tensor.device.type != "meta":
            return tensor.device.type
    return "cpu"


def _device_name(device_type: str) -> str:
    """The device a measured profile ran on: "cpu", or "cuda (NVIDIA H100 80GB HBM3)" (the
    model's name finds the device's copy path to the host, `profiles.devices`)."""
    if device_type == "cuda" and torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name()})"
    return device_type


# ----------------------------------------------------------------------------- the recorded step


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


def _profile_error(name: str, error: BaseException) -> Exception:
    if isinstance(error, ProfileError | ValueError | TypeError):
        return error  # ours, or a clear one about the inputs or the loss
    return ProfileError(
        f"one training step of {name} failed while profiling: {_first_line(error)}. Check "
        "that example_inputs are what forward() expects and that loss_fn(output) returns a "
        "scalar; the traceback above shows where it failed.")


def _record(step: _Step, real: bool, spec: DeviceSpec | None,
            optimizer: torch.optim.Optimizer | None, progress: bool) -> _Recorded:
    """The observed forward + loss, then each op's backward alone, and static memory."""
    with _observed(step, real, spec) as (rec, _):
        pass
    rec.backward = _backward_pass(rec.recorder.records, rec.recorder.functions, spec,
                                  progress)
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
        grads_in_forward=step.grads_in_forward,
    )
    return rec


def _optimizer_memory(optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
    """(bytes of the optimizer's state, bytes its ``step()`` allocates beyond that state
    while it runs), found by stepping a fake twin twice: the first step creates the state,
    the second is a step like every later one (foreach buffers, per-parameter
    temporaries; the twin chooses foreach or not as the real one does, by device)."""
    if optimizer is None:
        return 0, 0
    with meta_failures_at_debug(), fake_mode(allow_non_fake_inputs=True) as mode:
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
                tracker.reset(held + tensors_in([twin.state[p] for p in twin_params
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
            for tensor in tensors_in(state):
                ref = StorageWeakRef(tensor.untyped_storage())
                if ref not in seen:
                    seen.add(ref)
                    total += tensor.untyped_storage().nbytes()
    return total, max(0, peaks[0] - total, peaks[1])


# ----------------------------------------------------------------------------- parallel ranks


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


def _rank_optimizer(static: StaticMemory, world_size: int) -> StaticMemory:
    """Each rank steps its shards: the optimizer's state and temporaries shrink with them."""
    return static.model_copy(update={
        "optimizer_state_bytes": -(-static.optimizer_state_bytes // world_size),
        "optimizer_step_bytes": -(-static.optimizer_step_bytes // world_size)})


# ----------------------------------------------------------------------------- nodes, module calls


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
    # a custom Function's forward: its own backward reads what it saved, unseen by our rules
    in_function = {i for f in rec.recorder.functions for i in range(f.start, f.stop)}
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
            skippable=keepable and record.index not in in_function and _skippable(record),
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


def _skippable(record: _OpRecord) -> bool:
    """Whether a rerun may skip the op (`NodeProfile.skippable`): one `skippable_op` that
    draws no random numbers, writes nothing in place and saves none of its outputs."""
    return skippable_op(record.func, len(record.outputs), len(record.new_storages)) and not (
        record.random or record.written or record.mutated_state
        or set(record.saved) & set(record.new_storages))


def _with_observed_backward(nodes: list[NodeProfile], observed: list | None
                            ) -> list[NodeProfile]:
    """Nodes with the backward's live bytes before, at and after each (when observed)."""
    if observed is None:
        return nodes
    return [node.model_copy(update={"bwd_live_before_bytes": b, "bwd_peak_bytes": p,
                                    "bwd_live_after_bytes": a, "bwd_unpack_bytes": u,
                                    "bwd_held_peak_bytes": h})
            for node, (b, p, a, u, h) in zip(nodes, observed, strict=True)]


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
