"""Measured op times (``timing="measure"``): each op timed alone, scaled to the whole step.

The step runs for real once more, recording each op's arguments (``_ArgRecorder``); each op
is timed alone (forward, and forward + backward, less the autograd engine's per-call cost)
and the op times are scaled to the measured whole step: ops give the split, the step the
total (``whole_step=False`` leaves them as timed alone, for a caller that scales them to
steps it times itself: the planner's calibration on the CPU, `planner.region_calibration`).
``profiles.calibrate`` measures the checkpoint overhead on the same device.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from profiles.backward import _fresh_args, _grad_outputs
from profiles.devices import DeviceSpec
from profiles.functions import FunctionCall, function_name, watched_functions
from profiles.host_costs import host_checkpoint_costs
from profiles.progress import _bar
from profiles.recording import _OpRecord, _Recorded
from profiles.schema import MAX_SCALE, CheckpointCosts, StepTiming
from profiles.step import _Step
from profiles.swap import swapped_tensors

log = logging.getLogger(__name__)

ENGINE_FLOOR_SHARE = 0.1  # a backward keeps at least this share of its raw time


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
                out = run(state)
                end.record()
                torch.cuda.synchronize(self.device)
                elapsed = start.elapsed_time(end)
            else:
                begin = self.clock()
                out = run(state)
                elapsed = (self.clock() - begin) * 1e3
            del out  # freeing what ran (a forward's whole graph) is not its time
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
        # custom Function calls: (class, args, kwargs, first op, one past their last op)
        self.functions: list[tuple[Any, tuple, dict, int, int]] = []

    def function_started(self, cls: type, args: tuple, kwargs: dict) -> tuple:
        return cls, args, kwargs, len(self.calls)

    def function_ended(self, started: tuple, output: Any) -> None:
        self.functions.append((*started, len(self.calls)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "prim" and func is not torch.ops.aten.detach.default:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


@dataclass
class _MeasuredTimes:
    per_node: list[tuple[float, float]]  # (forward, backward) ms per op, scaled to `step`
    step: StepTiming | None  # the whole step and the scales applied; None: not timed whole


def _timings(step: _Step, rec: _Recorded, timing: str, spec: DeviceSpec, device_type: str,
             repeats_warmup: tuple[int, int], progress: bool, whole_step: bool = True
             ) -> tuple[_MeasuredTimes | None, CheckpointCosts, str]:
    """(measured op times or None, checkpoint costs, the timing that holds): measured and
    calibrated on the device with ``timing="measure"`` (scaled to the whole step where
    ``whole_step``), else the roofline's estimates (also when the measured run took another
    path than the recorded one)."""
    if timing != "measure":
        return None, spec.checkpoint_costs(), timing
    timer = _Timer(torch.device(device_type), *repeats_warmup)
    measured = _measure_times(step, rec.recorder.records, timer, progress, whole_step)
    return measured, host_checkpoint_costs(device_type), \
        "measure" if measured is not None else "estimate"


def _measure_times(step: _Step, records: list[_OpRecord], timer: _Timer,
                   progress: bool, whole_step: bool = True) -> _MeasuredTimes | None:
    """Forward/backward wall time of every op (loss last), on real tensors.

    Isolated op times carry costs a whole step does not (cold caches, per-call engine
    entry), most visibly on CPU; so the whole step is timed too and op times are scaled to
    add up to it: ops give the split, the step gives the total (not ``whole_step``: left
    as timed alone). Runs on copies of the buffers, so the model's statistics do not move.
    Returns None when the real run does not dispatch the ops the profile saw (the forward
    branched differently).
    """
    model = step.model
    buffers = {name: b.clone() for name, b in model.named_buffers(remove_duplicate=False)}
    with swapped_tensors(model, buffers):
        recorder = _ArgRecorder()
        with recorder, watched_functions(recorder.function_started, recorder.function_ended):
            loss = step.forward_loss(step.args, step.kwargs)
        del loss
        names = [str(func) for func, _, _ in recorder.calls]
        if names != [r.name for r in records]:
            log.warning("the real forward dispatched other ops than the profiled one (%d vs "
                        "%d); op times are estimated instead", len(names), len(records))
            return None
        times: list[tuple[float, float]] = []
        timed: dict[tuple, tuple[float, float]] = {}  # by `_alike` key: repeated blocks' ops
        for (func, args, kwargs), record in _bar(list(zip(recorder.calls, records,
                                                          strict=True)), "timing ops", progress):
            key = _alike(func, args, kwargs, record.grad_enabled)
            if key in timed:
                times.append(timed[key])
                continue
            try:
                times.append(_measure_op(func, args, kwargs, timer) if record.grad_enabled
                             else (timer.median_ms(lambda: None,
                                                   lambda _, f=func, a=args, k=kwargs:
                                                   f(*a, **k)), 0.0))
            except Exception as error:  # an op that cannot be rerun alone: estimate it
                log.warning("could not time %s alone (%s); using its roofline estimate",
                            record.name, type(error).__name__)
                times.append((record.estimated_ms, 2 * record.estimated_ms))
                continue
            if key is not None:
                timed[key] = times[-1]
        _time_function_backwards(times, recorder.functions, timer)
        del recorder
        if not whole_step:
            return _MeasuredTimes(times, None)
        step_fwd_ms, step_bwd_ms = _measure_step(step, timer)
    fwd_scale = _scale(step_fwd_ms, sum(f for f, _ in times))
    bwd_scale = _scale(step_bwd_ms, sum(b for _, b in times))
    return _MeasuredTimes([(f * fwd_scale, b * bwd_scale) for f, b in times],
                          StepTiming(fwd_ms=step_fwd_ms, bwd_ms=step_bwd_ms,
                                     fwd_scale=fwd_scale, bwd_scale=bwd_scale))


# ops whose time follows their inputs' values (their outputs' shapes do): timed every time
VALUE_TIMED = frozenset({"nonzero", "unique", "_unique", "_unique2", "unique_consecutive",
                         "unique_dim", "masked_select", "repeat_interleave", "bincount",
                         "_local_scalar_dense", "index_put", "index_put_", "_index_put_impl_"})
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)


def _alike(func: Any, args: Any, kwargs: Any, grad_enabled: bool) -> tuple | None:
    """What an op's time follows: the op, and each argument's shape, strides, dtype, device
    and ``requires_grad`` (a tensor) or value (anything else). Ops with the same key take
    the same time, so each is timed once: the repeated blocks of a transformer are most of
    its ops, and timing them again only gave each block its own noise (GPT small: 4 times
    the ops, and blocks that differed by a few percent, so a plan chose among equal blocks
    by that noise). None where the time follows values (`VALUE_TIMED`) or an argument
    has no plain value: timed on its own."""
    packet = getattr(func, "overloadpacket", None)
    if packet is None or getattr(packet, "__name__", "") in VALUE_TIMED:
        return None
    leaves, spec = tree_flatten((args, kwargs))
    key: list[Any] = [func, grad_enabled, str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device,
                        leaf.requires_grad))
        elif isinstance(leaf, _PLAIN):
            key.append((type(leaf), leaf))
        else:
            return None
    return tuple(key)


def _time_function_backwards(times: list[tuple[float, float]],
                             functions: list[tuple[Any, tuple, dict, int, int]],
                             timer: _Timer) -> None:
    """Each custom Function call's own backward, timed alone, as its last op's (its ops ran
    without autograd, so theirs was never timed; `profiles.functions`)."""
    for cls, args, kwargs, start, stop in functions:
        if stop <= start:
            continue
        try:
            backward_ms = _measure_op(FunctionCall(cls), args, kwargs, timer)[1]
        except Exception as error:  # a Function that cannot run alone: not timed
            log.warning("could not time the backward of autograd Function %s alone (%s)",
                        function_name(cls), type(error).__name__)
            continue
        times[stop - 1] = (times[stop - 1][0], backward_ms)


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
