"""The conformance harness's "custom Function" dimension: every model's blocks carry
autograd Functions of a user's own, whose backward is theirs, not their ops'.

`with_functions(case)` is the case with, in each repeated block of its model, the first
activation module replaced by `WithFunctions`: a straight-through estimator (quantize in
forward, pass the gradient through) before the activation, and a fused op written as one
Function after it (SiLU with a hand-written backward that saves its input and makes
temporaries, as Bloom's GeLU does). `WithFunctions`' own forward is traced by the planner
(its child is a leaf), so its Functions sit between child calls, where op ranges cut: a plan
that recomputes one must run it through the Function (`profiles.functions`), or the
gradients come out wrong. Planned and unplanned models are the same transformed model, so
their losses and gradients must be bit-identical under every plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from conformance_harness import Case
from torch import nn

from planner import zoo

__all__ = ["FusedSiLU", "StraightThrough", "WithFunctions", "insert_functions",
           "with_functions"]

_ACTIVATIONS = ("relu", "gelu", "silu", "swish", "tanh", "sigmoid", "mish", "hardswish",
                "activation", "quickgelu")


class StraightThrough(torch.autograd.Function):
    """Quantize to sixteenths in forward; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 16) / 16

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class FusedSiLU(torch.autograd.Function):
    """``x * sigmoid(x)`` as one op with its own backward (saves the input, recomputes the
    sigmoid there: temporaries the size of the input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s * (1 + x * (1 - s)))


class WithFunctions(nn.Module):
    """``FusedSiLU(activation(StraightThrough(x)))``: Functions around a child call."""

    def __init__(self, activation: nn.Module) -> None:
        super().__init__()
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FusedSiLU.apply(self.activation(StraightThrough.apply(x)))


def _is_activation(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return not list(module.children()) and any(a in name for a in _ACTIVATIONS)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: children of a ModuleList, Sequential or ModuleDict, two or more
    of one type, each with modules of its own."""
    found = []
    for container in model.modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            continue
        members = [m for m in container.children() if list(m.children())]
        kinds = {type(m) for m in members}
        if len(members) >= 2 and len(kinds) == 1:
            found.extend(members)
    return found


def insert_functions(model: nn.Module) -> int:
    """Wrap the first activation module of each repeated block of ``model`` (in place) in
    `WithFunctions`; returns how many were wrapped."""
    wrapped = 0
    for block in _blocks(model):
        for path, module in block.named_modules():
            if path and _is_activation(module):
                parent_path, _, name = path.rpartition(".")
                parent = block.get_submodule(parent_path) if parent_path else block
                if isinstance(parent, WithFunctions):
                    break  # nested blocks: wrapped once
                setattr(parent, name, WithFunctions(module))
                wrapped += 1
                break
    return wrapped


def with_functions(case: Case) -> Case | None:
    """``case`` with Functions in its model's blocks; None when its model has no
    activation module inside repeated blocks (nothing would be tested)."""
    if not insert_functions(case.build().model):
        return None

    def build() -> zoo.ZooModel:
        zm = case.build()
        insert_functions(zm.model)
        return zm

    built: Callable[[], zoo.ZooModel] = build
    return replace(case, name=f"{case.name} + Functions", build=built)
