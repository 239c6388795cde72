"""The "torch.compile" peer of ``benchmarks/frontier.py`` (opt-in: ``--peers compile``).

The model compiled once per ``activation_memory_budget`` of ``torch._functorch.config`` (its
min-cut partitioner then recomputes in the backward to keep that share of the saved
activations): inductor on CUDA, ``aot_eager_decomp_partition`` (the same partitioner, no code
generation) on CPU. Compiling reorders floating point, so its gradients are compared within a
relative tolerance (``grad_rel_error``: the largest over parameters of ||g - g_ref|| /
||g_ref||), not bit for bit. With dropout they are not comparable: inductor draws its own
masks, and on the CPU path a budget below 1 recomputes dropout in the backward with fresh
random numbers (same loss, other gradients); ``gpu_suite.py`` runs its model with dropout 0.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from frontier_measure import TIME_UP, Runner, grads_match, grads_rel_error

import planner.measure
from planner import zoo
from planner.measure import PeakTracker

COMPILE = "torch.compile"
COMPILE_BUDGETS = (0.5, 0.1)
# relative gradient error allowed to a compiled step, by autocast dtype (None: fp32)
GRAD_TOLERANCE: dict[torch.dtype | None, float] = {None: 1e-4, torch.bfloat16: 5e-2,
                                                   torch.float16: 1e-2}


class _CompiledRegionTracker(PeakTracker):
    """PeakTracker that lets Dynamo run compiled code under it: Dynamo runs a frame eagerly
    while a dispatch mode that does not ignore compile internals is active."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


@contextlib.contextmanager
def _compiled_code_measured(device: str) -> Iterator[None]:
    """On CPU, ``measure_step``'s PeakTracker swapped for one under which the compiled code
    runs (the warm-up step compiled it outside any mode); on CUDA the allocator measures."""
    if device == "cuda":
        yield
        return
    original = planner.measure.PeakTracker
    planner.measure.PeakTracker = _CompiledRegionTracker
    try:
        yield
    finally:
        planner.measure.PeakTracker = original


def compile_backend(device: str) -> str:
    """Inductor on CUDA; on CPU the min-cut partitioner without code generation."""
    return "inductor" if device == "cuda" else "aot_eager_decomp_partition"


def compile_peer(zm: zoo.ZooModel, runner: Runner, budgets: tuple[float, ...],
                 reference: dict[str, torch.Tensor], row: Callable[..., dict[str, Any]]
                 ) -> None:
    """The model under ``torch.compile`` at each ``activation_memory_budget``: compiled
    afresh per budget (``torch._dynamo.reset()``), the partition made at the warm-up step
    inside ``torch._functorch.config.patch``; then measured like the other peers."""
    backend = compile_backend(runner.device)
    tolerance = GRAD_TOLERANCE.get(runner.autocast, 5e-2)
    for budget in budgets:
        label = f"{COMPILE} (activation_memory_budget {budget:g})"
        fields: dict[str, Any] = dict(short=f"compile@{budget:g}", backend=backend,
                                      activation_memory_budget=budget)
        if runner.out_of_time():
            row(label, "peer", status=TIME_UP, **fields)
            continue
        torch._dynamo.reset()
        try:
            with torch._functorch.config.patch(activation_memory_budget=budget), \
                    _compiled_code_measured(runner.device):
                compiled = torch.compile(zm.model, backend=backend)
                began = time.perf_counter()
                runner.warm_up(compiled)  # compiles forward and backward: the partition
                fields["compile_s"] = time.perf_counter() - began
                peak, ms, base, grads = runner.run(compiled)
        except Exception as error:  # a peer failing is a result to record
            row(label, "peer", status=f"failed: {type(error).__name__}: {error}"[:300],
                **fields)
            continue
        finally:
            torch._dynamo.reset()
        equal, diff = grads_match(reference, grads)
        rel = grads_rel_error(reference, grads)
        row(label, "peer", status="ok", peak_bytes=peak, step_ms=ms, base_step_ms=base,
            grads_equal=equal, grad_max_abs_diff=diff, grad_rel_error=rel,
            grad_tolerance=tolerance, grads_close=rel <= tolerance, **fields)
