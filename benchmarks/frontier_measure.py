"""Measuring one training step of ``benchmarks/frontier.py``'s strategies: its peak
(``PeakTracker`` on CPU, the CUDA allocator on GPU), its median step time interleaved with
that of the model without checkpointing, and its gradients, compared with the reference's.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import planner
from planner import zoo
from planner.api import measure_step
from planner.runtime.emit import checkpointed_modules
from planner.runtime.guard import PlanGuard

GIB = 2**30
TIME_UP = "not run: the run's time limit was reached"
# CPU rows run on one intra-op thread: on a 2-vCPU host, forty plain HF GPT-2 steps with two
# threads spread 3-11 % of their median (p10 to p90; the second thread shares a core with
# the host's own work, and each op waits for the slower one), with one 0.8-1.6 % on memory
# the allocator keeps (10.5 % on glibc's defaults). The planner's calibration then times
# with the process's CPU clock (`planner.region_calibration`), the frontier with the wall's.
CPU_THREADS = 1


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}


def default_loss(output: Any) -> torch.Tensor:
    return output.loss if hasattr(output, "loss") else output


def autocast_context(device: str, dtype: torch.dtype | None
                     ) -> contextlib.AbstractContextManager:
    """``torch.autocast(device, dtype)``, or nothing for None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device, dtype=dtype)


def precision_name(dtype: torch.dtype | None) -> str:
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


class Runner:
    """Measures one callable module on fixed inputs: peak, gradients, median step time.

    ``autocast``: every step's forward and loss run under ``torch.autocast(dtype)``;
    ``deadline`` (a ``time.perf_counter()`` value): past it, ``out_of_time()`` says so;
    ``warmup``: untimed steps of each kind before the timed ones.
    """

    def __init__(self, zm: zoo.ZooModel, device: str, steps: int,
                 autocast: torch.dtype | None = None, deadline: float | None = None,
                 warmup: int = 2):
        self.zm, self.device, self.steps, self.warmup = zm, device, steps, warmup
        self.autocast, self.deadline = autocast, deadline
        self.autocast_name = None if autocast is None else str(autocast).removeprefix("torch.")
        self.args, self.kwargs = split_inputs(zm.example_inputs)
        self.loss_fn = zm.loss_fn or default_loss
        self.state = {k: v.detach().clone() for k, v in zm.model.state_dict().items()}
        self.names = {p: n for n, p in zm.model.named_parameters()}
        self.last_timed: tuple[nn.Module, Callable[[], Any]] | None = None
        # the host's share of the last paired_ms: median ms until backward() returned (its
        # last launch issued; before the GPU's synchronize), of the module and of the plain
        self.last_host: tuple[float, float] | None = None
        self._host_ms = 0.0
        self._copies: list[nn.Module] = []  # `applied`'s, reset with the model

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def applied(self, plan: planner.Plan) -> nn.Module:
        """A copy of the model with ``plan`` applied once, as a training loop applies it,
        to time against the plain model. Applied around each step instead (`planned`),
        every timed step is a first step after ``apply``: GPT small's one-block plan
        measured 16.5 % that way and 14.8 % applied once (predicted 14.8), raw
        ``torch.utils.checkpoint`` on that block 14.9 % (2 cores, 3 x 30 paired steps)."""
        self._reset()
        module = copy.deepcopy(self.zm.model)
        planner.apply(module, plan)
        self._copies.append(module)
        return module

    def _reset(self) -> None:
        for model in [self.zm.model, *self._copies]:
            model.load_state_dict(self.state)
            model.zero_grad(set_to_none=True)  # a run that failed mid-step leaves some
        torch.manual_seed(1234)
        if self.device == "cuda":
            torch.cuda.manual_seed_all(1234)

    def _peak_and_grads(self, module: nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
        self._reset()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        # measure_step names gradients by module.named_parameters(): map to the model's names
        by_name = dict(module.named_parameters())
        peak, _, grads = measure_step(module, self.args, self.kwargs, self.loss_fn,
                                      self.autocast_name)
        return peak, {self.names.get(by_name[k], k): g for k, g in grads.items()}

    def _step_ms(self, module: nn.Module, context: Callable[[], Any]) -> float:
        with context():
            if self.device == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            with autocast_context(self.device, self.autocast):
                loss = self.loss_fn(module(*self.args, **self.kwargs))
            loss.backward()
            self._host_ms = (time.perf_counter() - begin) * 1e3
            if self.device == "cuda":
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - begin) * 1e3
        module.zero_grad(set_to_none=True)
        return elapsed

    def warm_up(self, module: nn.Module) -> None:
        """One untimed step (e.g. the one that compiles), from the model's initial state."""
        self._reset()
        self._step_ms(module, contextlib.nullcontext)
        self._reset()

    def warm_peak(self, module: nn.Module, context: Callable[[], Any]) -> int:
        """Peak bytes of a step under ``context`` after one untimed step under it: what a
        training loop meets from its second step on (an offload plan's pinned host buffers
        are new, and slow to allocate, in the first)."""
        with context():
            self._reset()
            self._step_ms(module, contextlib.nullcontext)
            peak, _ = self._peak_and_grads(module)
        self._reset()
        return peak

    def paired_ms(self, module: nn.Module, context: Callable[[], Any]) -> tuple[float, float]:
        """Step ms of ``module`` under ``context`` and median step ms of the model without
        checkpointing, their steps interleaved (after ``warmup`` warm-up steps each), so load
        from other processes hits both alike. The first is the median of each round's
        ratio times the second: a round's two steps share the host's state, so their ratio
        is steadier than a ratio of two medians (rows of no checkpointing, which predict 0,
        measured -3.9 to +12.0 % as a ratio of medians on 2 cores)."""
        plain = contextlib.nullcontext
        samples: tuple[list[float], list[float]] = ([], [])
        hosts: tuple[list[float], list[float]] = ([], [])
        for i in range(self.steps + self.warmup):
            order = [(module, context, 0), (self.zm.model, plain, 1)]
            # each goes first in every other round: the second step of a round pays what
            # the first left behind
            for mod, ctx, k in (order if i % 2 else order[::-1]):
                ms = self._step_ms(mod, ctx)
                if i >= self.warmup:
                    samples[k].append(ms)
                    hosts[k].append(self._host_ms)
        self._reset()
        self.last_host = (statistics.median(hosts[0]), statistics.median(hosts[1]))
        base_ms = statistics.median(samples[1])
        ratio = statistics.median(ms / base for ms, base in zip(*samples, strict=True))
        return ratio * base_ms, base_ms

    def duel(self, ours: tuple[nn.Module, Callable[[], Any]],
             theirs: tuple[nn.Module, Callable[[], Any]], rounds: int) -> dict[str, float]:
        """Two strategies timed head to head: each of ``rounds`` rounds runs a step of each
        and one of the plain model, in an order that turns every round (each goes first,
        second and last alike), and takes their difference over the plain step. Timed in
        separate loops, one row's passes of the same schedule moved 9 points apart on 2
        cores; here both share every round's host. Returns the median difference (``ours``
        minus ``theirs``, a share of the plain step) and the order statistics around it
        that hold the median with 95 % confidence (``low``, ``high``; distribution-free)."""
        steps = [ours, theirs, (self.zm.model, contextlib.nullcontext)]
        diffs = []
        for i in range(rounds + self.warmup):
            times = [0.0] * 3
            for k in (i % 3, (i + 1) % 3, (i + 2) % 3):
                times[k] = self._step_ms(*steps[k])
            if i >= self.warmup:
                diffs.append((times[0] - times[1]) / times[2])
        self._reset()
        return median_interval(diffs)

    def run(self, module: nn.Module, context: Callable[[], Any] = contextlib.nullcontext
            ) -> tuple[int, float, float, dict[str, torch.Tensor]]:
        """Peak bytes, median step ms, median no-checkpointing step ms, gradients."""
        with context():
            peak, grads = self._peak_and_grads(module)
        ms, base = self.paired_ms(module, context)
        self.last_timed = (module, context)
        return peak, ms, base, grads

    def retime(self, timed: list[tuple[dict[str, Any], nn.Module, Callable[[], Any]]],
               passes: int) -> None:
        """Times each row's step ``passes`` more times, every row once per pass (a pass in
        the order of the last rotated by one), and sets its step ms, plain ms and overhead
        (and its host ms) to the median over all its passes; ``overhead_passes`` lists them.
        A drift of the
        host (load from elsewhere, a slow minute) then hits every row of a model alike
        instead of the few measured while it lasted: one run's rows of the same schedule
        measured 27.6 and 37.4 % apart, one pass of 15 rounds each (HF GPT-2, 2 cores)."""
        for row, _, _ in timed:
            row["overhead_passes"] = [row["overhead"]]
            row["_passes"] = [(row["step_ms"], row["base_step_ms"])]
            row["_hosts"] = [(row["host_ms"], row["base_host_ms"])] if "host_ms" in row else []
        for i in range(passes):
            shift = (i + 1) % max(len(timed), 1)
            for row, module, context in timed[shift:] + timed[:shift]:
                if self.out_of_time():
                    break
                ms, base = self.paired_ms(module, context)
                row["_passes"].append((ms, base))
                if row["_hosts"]:  # a row with its host's ms (`paired_ms` set them)
                    row["_hosts"].append(self.last_host)
                row["overhead_passes"].append(ms / base - 1.0)
        for row, _, _ in timed:
            passes_ms, hosts = row.pop("_passes"), row.pop("_hosts")
            row["overhead"] = statistics.median(row["overhead_passes"])
            row["base_step_ms"] = statistics.median(base for _, base in passes_ms)
            row["step_ms"] = (1.0 + row["overhead"]) * row["base_step_ms"]
            if hosts:  # the host's ms over the same passes
                row["host_ms"] = statistics.median(h for h, _ in hosts)
                row["base_host_ms"] = statistics.median(h for _, h in hosts)


def median_interval(diffs: list[float]) -> dict[str, float]:
    """The median of paired differences and the order statistics around it that hold the
    median with 95 % confidence (``low``, ``high``; distribution-free, the sign test's)."""
    ordered = sorted(diffs)
    n = len(ordered)
    k = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))  # 1.96 / 2
    return {"median": statistics.median(ordered), "low": ordered[k],
            "high": ordered[n - 1 - k], "rounds": n}


def grads_match(reference: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
                ) -> tuple[bool, float]:
    """Bit-identical, and the largest absolute difference."""
    if reference.keys() != grads.keys():
        return False, math.inf
    diff = max((float((reference[k] - grads[k]).abs().max()) for k in reference), default=0.0)
    return all(torch.equal(reference[k], grads[k]) for k in reference), diff


def grads_rel_error(reference: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
                    ) -> float:
    """The largest over parameters of ||g - g_ref|| / ||g_ref|| (absolute where g_ref is 0)."""
    if reference.keys() != grads.keys():
        return math.inf
    worst = 0.0
    for k, ref in reference.items():
        diff, scale = float((grads[k].float() - ref.float()).norm()), float(ref.float().norm())
        worst = max(worst, diff / scale if scale else diff)
    return worst


def grads_global_rel_error(reference: dict[str, torch.Tensor],
                           grads: dict[str, torch.Tensor]) -> float:
    """||g - g_ref|| / ||g_ref|| over all parameters together: a parameter whose gradient is
    rounding noise (a BatchNorm bias the next normalization cancels) weighs what it is."""
    if reference.keys() != grads.keys():
        return math.inf
    diff = sum(float((grads[k].float() - ref.float()).norm()) ** 2
               for k, ref in reference.items())
    scale = sum(float(ref.float().norm()) ** 2 for ref in reference.values())
    return math.sqrt(diff / scale) if scale else math.sqrt(diff)


def distinct_peaks(rows: list[dict[str, Any]]) -> list[tuple[int, list[str]]]:
    """The measured peaks of ``rows`` (status ok), those within 0.5 % merged, ascending, each
    with the short names of the rows at it."""
    budgets: list[tuple[int, list[str]]] = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        for b in budgets:
            if abs(b[0] - r["peak_bytes"]) <= 0.005 * b[0]:
                b[1].append(r.get("short", r["strategy"]))
                break
        else:
            budgets.append((r["peak_bytes"], [r.get("short", r["strategy"])]))
    return sorted(budgets)


_OPS_CHECKED: set[tuple[str, str]] = set()  # plans whose op streams were checked once


@contextlib.contextmanager
def planned(model: nn.Module, plan: planner.Plan) -> Iterator[None]:
    """``plan`` applied around one step. A planned call checks its op stream against the
    plan on its first training call after ``apply`` (a selective-checkpoint dispatch mode
    over its ops), and the guard the parallelism it runs under (0.21 ms on GPT small); a
    training loop applies once, so those checks run on the first step only, here too. A
    step after each ``apply`` still pays more than a loop's (GPT small: 0.7-1.2 ms): time
    plans on `Runner.applied`'s copy."""
    planner.apply(model, plan)
    key = (plan.fingerprint, plan.schedule.describe())
    if key in _OPS_CHECKED:
        for wrapper in checkpointed_modules(model).values():
            wrapper.checked = True
        for hook in model._forward_pre_hooks.values():
            if isinstance(hook, PlanGuard):
                hook.parallel_checked = True
    try:
        yield
        _OPS_CHECKED.add(key)
    finally:
        planner.remove(model)
