"""How a model's example inputs are given: a tensor, positional inputs, or keyword inputs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

Inputs = Any  # a tensor, a tuple of positional inputs, or a dict of keyword inputs


def normalize_inputs(model: nn.Module, example_inputs: Inputs) -> tuple[tuple, dict]:
    """Return ``(args, kwargs)`` for ``example_inputs``; None means the model's own dummies."""
    if example_inputs is None:
        example_inputs = getattr(model, "dummy_inputs", None)  # HF PreTrainedModel
        if example_inputs is None:
            example_inputs = getattr(model, "example_input_array", None)  # Lightning
        if example_inputs is None:
            raise ValueError(
                f"{type(model).__name__} has no `dummy_inputs` or `example_input_array`; pass "
                "example_inputs (a tensor, a tuple of positional inputs or a dict of keyword "
                "inputs) shaped like one real training batch."
            )
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, tuple | list):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict) or hasattr(example_inputs, "keys"):
        return (), dict(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor, a tuple or a dict, not {type(example_inputs).__name__}"
    )
