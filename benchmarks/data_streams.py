"""Batches as trainers feed them, for the "data as it arrives" runs: a word-level tokenizer
built in code (no downloads), rows of random lengths, padding collators, and a callback that
measures each optimizer step's peak with the batches the trainer holds on the device.

Each measured step counts the parameters, buffers and optimizer state, and the batches the
trainer has loaded for it (Hugging Face Trainer: the ``gradient_accumulation_steps``
micro-batches ``get_batch_samples`` returns, held through every micro-step), as a device's
allocator counts them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models

from planner.measure import PeakTracker
from planner.plan_table import PlanTable
from planner.runtime.table_install import TableGuard

VOCAB = 512


def tokenizer(max_length: int) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of ``VOCAB`` ids, pad id 0, right padding."""
    words = {f"w{i}": i for i in range(VOCAB)}
    inner = Tokenizer(models.WordLevel(words, unk_token="w1"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="w0",
                                                unk_token="w1", eos_token="w2",
                                                model_max_length=max_length)


def rows(n: int, shortest: int, longest: int, seed: int) -> list[dict[str, list[int]]]:
    """``n`` rows of token ids (no pad id), lengths uniform in [shortest, longest]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(shortest, longest)
        out.append({"input_ids": [rng.randrange(3, VOCAB) for _ in range(length)]})
    return out


def tensors_of(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        return [t for v in dict(batch).values() for t in tensors_of(v)]
    if isinstance(batch, list | tuple):
        return [t for v in batch for t in tensors_of(v)]
    return []


class Resident:
    """The batches a trainer holds now: Hugging Face Trainer's ``get_batch_samples``
    wrapped to remember each step's list (the trainer keeps it through its micro-steps)."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    @contextmanager
    def watching(self, trainer_cls: type) -> Iterator[None]:
        original = trainer_cls.get_batch_samples

        def remembered(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            samples, count = original(trainer, *args, **kwargs)
            self.batches = list(samples)
            return samples, count

        trainer_cls.get_batch_samples = remembered
        try:
            yield
        finally:
            trainer_cls.get_batch_samples = original


class StepPeaks(transformers.TrainerCallback):
    """Each optimizer step's measured peak (module docstring), and the length of its
    longest batch."""

    def __init__(self, resident: Resident, measure: bool = True) -> None:
        self.resident = resident
        self.measure = measure  # False: step times only, without a tracker's cost
        self.peaks: list[int] = []
        self.lengths: list[int] = []
        self.seconds: list[float] = []
        self._tracker: PeakTracker | None = None
        self._started = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, *, model: torch.nn.Module,
                      optimizer: Any, **kwargs: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        state_tensors = [t for s in inner.state.values() for t in s.values()
                         if isinstance(t, torch.Tensor)]
        held = [t for batch in self.resident.batches for t in tensors_of(batch)]
        self.lengths.append(max((t.shape[1] for t in held if t.dim() >= 2), default=0))
        if self.measure:
            self._tracker = PeakTracker([*model.parameters(), *model.buffers(),
                                         *state_tensors, *held])
            self._tracker.__enter__()
        self._started = perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds.append(perf_counter() - self._started)
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.peaks.append(self._tracker.peak_bytes)
            self._tracker = None


class Choices:
    """What each training step's plan choice took: the entry, and the time of choosing it
    (``PlanTable.select``) and of swapping the checkpoints when it changes."""

    def __init__(self) -> None:
        self.entries: list[int] = []
        self.seconds: list[float] = []

    @contextmanager
    def watching(self) -> Iterator[None]:
        select, switch, call = PlanTable.select, TableGuard._switch, TableGuard.__call__
        choices, spent = self, [0.0]

        def timed_select(table: PlanTable, *args: Any) -> int | None:
            started = perf_counter()
            try:
                return select(table, *args)
            finally:
                spent[0] += perf_counter() - started

        def timed_switch(guard: TableGuard, *args: Any) -> None:
            started = perf_counter()
            switch(guard, *args)
            spent[0] += perf_counter() - started

        def step(guard: TableGuard, module: Any, args: tuple, kwargs: dict) -> None:
            spent[0] = 0.0
            call(guard, module, args, kwargs)
            if torch.is_grad_enabled():
                choices.seconds.append(spent[0])
                choices.entries.append(guard.current)

        PlanTable.select, TableGuard._switch, TableGuard.__call__ = \
            timed_select, timed_switch, step
        try:
            yield
        finally:
            PlanTable.select, TableGuard._switch, TableGuard.__call__ = select, switch, call
