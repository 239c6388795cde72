"""What a compiling step leaves to Python's cycle collector, freed after that step.

When dynamo compiles a frame it wraps the real values the frame sees (a module's output, a
graph break's locals) in its tracing objects, which end as garbage in reference cycles. A
model whose forward breaks into several graphs hands its output from one frame to the next,
so the compiling step's output stays alive until the collector reaches that garbage: HF
GPT-2 on the CPU kept each compiling step's logits (1 MiB beside a 13 MiB step), and under
the HF Trainer every later step held one or both compiles' logits as the collector's timing
went (`benchmarks/results/compile-trainer-cpu.md`). Training runs the collector at no step
it chooses, so an unplanned loop may hold that garbage through every later step: a compiled
plan counts it so (:func:`planner.compiled_step.training_peaks`), unless the loop frees it
with :func:`collect_compile_garbage` after each step, which the trainer switches do.
"""

from __future__ import annotations

import gc

__all__ = ["collect_compile_garbage", "frames_traced"]

_frames_at_last_collection = 0


def frames_traced() -> int:
    """The frames dynamo has traced in this process, a graph made of them or not (its
    counter survives ``torch._dynamo.reset``): each trace leaves its garbage, a recompile
    that makes no new graph too (a LightningModule's step traced again for a guard on its
    batch index kept the last step's logits, 2 MiB on HF GPT-2)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def collect_compile_garbage() -> bool:
    """Run Python's cycle collector where dynamo traced a frame since the last call (in
    this process), freeing what that compile kept alive; call it after each training step
    (with ``optimize(..., compiled=, compile_garbage_collected=True)``). Returns whether it
    collected: a collection costs 0.3-0.4 s (HF GPT-2 in a Trainer's process, measured), so
    it runs after the steps that compiled, not after every step."""
    global _frames_at_last_collection
    frames = frames_traced()
    if frames == _frames_at_last_collection:
        return False
    _frames_at_last_collection = frames
    gc.collect()
    return True
