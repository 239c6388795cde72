"""How a model's example inputs are given: a tensor, positional inputs, or keyword inputs."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

Inputs = Any  # a tensor, a tuple of positional inputs, or a dict of keyword inputs

# the model's own example batches, where it has one, when no inputs are given
_OWN_INPUTS = (("dummy_inputs", "HF PreTrainedModel"), ("example_input_array", "Lightning"))


class ToyBatchWarning(UserWarning):
    """The step is planned for the model's own example batch (HF ``dummy_inputs``,
    Lightning ``example_input_array``), not for a batch it will train on."""


def normalize_inputs(model: nn.Module, example_inputs: Inputs) -> tuple[tuple, dict]:
    """Return ``(args, kwargs)`` for ``example_inputs``; None means the model's own example
    batch (:class:`ToyBatchWarning` says its shapes and how to pass a real one)."""
    if example_inputs is None:
        example_inputs = _own_inputs(model)
    empty = empty_input(example_inputs)
    if empty:
        raise ValueError(f"example_inputs: {empty}, with no elements; a training step needs "
                         "at least one sample (sizes must be positive)")
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, tuple | list):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict) or hasattr(example_inputs, "keys"):
        return (), dict(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor, a tuple or a dict, not {type(example_inputs).__name__}"
    )


def empty_input(inputs: Inputs, name: str = "input") -> str | None:
    """``input[0] has shape [0, 64]``: the first tensor of ``inputs`` with no elements."""
    if isinstance(inputs, torch.Tensor):
        return f"{name} has shape {list(inputs.shape)}" if inputs.numel() == 0 else None
    items = (dict(inputs).items() if isinstance(inputs, dict) or hasattr(inputs, "keys") else
             enumerate(inputs) if isinstance(inputs, list | tuple) else ())
    for key, value in items:
        found = empty_input(value, f"{name}[{key!r}]")
        if found:
            return found
    return None


def _own_inputs(model: nn.Module) -> Inputs:
    """The model's own example batch; warns that a plan for it holds for that batch only."""
    name = type(model).__name__
    for attribute, library in _OWN_INPUTS:
        inputs = getattr(model, attribute, None)
        if inputs is None:
            continue
        warnings.warn(
            f"No example_inputs given: {name} is planned for its `{attribute}` "
            f"({library}), a toy batch ({_shapes(inputs)}), so its plan and any "
            "'No checkpointing needed' hold for batches that small only. Pass one real "
            "training batch: optimize(model, example_inputs=batch, budget_gb=...) (a tensor, "
            "a tuple of positional inputs or a dict of keyword inputs).",
            ToyBatchWarning, stacklevel=_caller_stacklevel())
        return inputs
    raise ValueError(
        f"{name} has no `dummy_inputs` or `example_input_array`; pass example_inputs (a "
        "tensor, a tuple of positional inputs or a dict of keyword inputs) shaped like one "
        "real training batch."
    )


def _shapes(inputs: Inputs) -> str:
    """``input_ids [3, 5], attention_mask [3, 5]`` for the tensors of an example batch."""
    if isinstance(inputs, dict) or hasattr(inputs, "keys"):
        named = [(f"{key} ", value) for key, value in dict(inputs).items()]
    else:
        named = [("", value) for value in tree_leaves(inputs)]
    shown = [f"{key}{list(value.shape)}" for key, value in named
             if isinstance(value, torch.Tensor)]
    return ", ".join(shown) or "no tensors"


_PACKAGES = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + name
                  + os.sep for name in ("profiles", "planner"))


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this library: the user's call of
    ``optimize``, ``profile`` or ``verify``, where the warning points."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGES):
        frame, level = frame.f_back, level + 1
    return level
