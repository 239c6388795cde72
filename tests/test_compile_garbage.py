"""What a compiling step leaves to Python's cycle collector (`planner.runtime.compile_garbage`):
freed by ``collect_compile_garbage`` after the step that compiled, and only then."""

from __future__ import annotations

import weakref

import torch

from planner import collect_compile_garbage, zoo
from planner.measure import garbage_kept


def test_a_compiling_steps_output_left_to_the_collector_is_freed_after_that_step() -> None:
    """HF GPT-2 compiled (dynamo with the eager backend: the garbage is dynamo's tracing
    objects, whatever compiles the graphs): the compiling step's logits outlive the step,
    held by nothing but garbage, until ``collect_compile_garbage`` runs the collector; after
    a step that compiled nothing it does not run it."""
    zm = zoo.get("hf-gpt2", batch=2)
    collect_compile_garbage()  # what this process compiled before
    model = torch.compile(zm.model, backend="eager")
    with garbage_kept():  # the collector runs where the test says, not when objects pile up
        out = model(**zm.example_inputs)
        logits = weakref.ref(out.logits)
        out.loss.backward()
        del out
        assert logits() is not None  # the step is over; its output is not freed
        assert collect_compile_garbage()
        assert logits() is None
        out = model(**zm.example_inputs)  # the same shape: nothing compiles
        out.loss.backward()
        del out
        assert not collect_compile_garbage()
