"""Capture a model as a torch.fx GraphModule: symbolic_trace first, then torch.export.

The captured module shares the model's Parameter and buffer objects (no copies, tied weights
stay tied), so a plan applied to it trains the user's own weights. ``gm.meta["planner"]`` keeps
what profiling needs later: how it was captured, the loss function and the input binding.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.fx._pytree as fx_pytree
from torch import nn

from profiles.errors import CaptureError
from profiles.schema import fingerprint

log = logging.getLogger(__name__)

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


def flat_placeholder_values(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """Values for ``gm``'s placeholders, in graph order, from user-style ``args``/``kwargs``."""
    info = gm.meta.get("planner", {})
    if info.get("method") == "export":
        in_spec = gm.graph._codegen.pytree_info.in_spec  # type: ignore[attr-defined]
        return list(fx_pytree.tree_flatten_spec((args, kwargs), in_spec))
    signature = info.get("signature")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if signature is None:
        return list(args) + [kwargs[n.target] for n in placeholders[len(args):]]
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    # fx makes one placeholder per forward() parameter, in order (renamed when specialised)
    return [bound.arguments[name] for name in signature.parameters][:len(placeholders)]


def graph_fingerprint(gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> str:
    """Hash of what determines a step's memory and time: the graph's nodes (ops, targets,
    arguments and constants), parameter/buffer shapes and dtypes, and input shapes/dtypes.

    Intermediate shapes follow from these, so no run is needed: ``apply`` checks a plan
    against a model in milliseconds.
    """
    structure: list[object] = [node.format_node() for node in gm.graph.nodes]
    structure += [(name, list(t.shape), str(t.dtype))
                  for name, t in [*gm.named_parameters(remove_duplicate=False),
                                  *gm.named_buffers(remove_duplicate=False)]]
    structure += [(list(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
                  for t in flat_inputs]
    return fingerprint(structure)


def _share_model_state(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Point ``gm``'s parameters and buffers at ``model``'s own objects (export may copy)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers(remove_duplicate=False)))
    for name, tensor in list(gm.named_parameters(remove_duplicate=False)) + list(
        gm.named_buffers(remove_duplicate=False)
    ):
        original = own.get(name)
        if original is None or original is tensor:
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if isinstance(original, nn.Parameter):
            owner._parameters[attr] = original
        else:
            owner._buffers[attr] = original


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    """symbolic_trace, specialising optional arguments the example leaves out to their
    defaults (so ``if mask is not None`` follows the branch the example takes)."""
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    concrete = {name: param.default for name, param in signature.parameters.items()
                if name not in bound.arguments and param.default is not inspect.Parameter.empty}
    gm = torch.fx.symbolic_trace(model, concrete_args=concrete or None)
    gm.meta["planner"] = {"method": "fx", "signature": signature}
    return gm


def _trace_export(model: nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    program = torch.export.export(model, args, kwargs, strict=False)
    gm = program.module()
    _share_model_state(gm, model)
    gm.meta["planner"] = {"method": "export", "signature": None}
    return gm


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def capture(
    model: nn.Module,
    example_inputs: Inputs = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> torch.fx.GraphModule:
    """Capture ``model`` as an fx GraphModule that shares its parameters and buffers.

    Tries ``torch.fx.symbolic_trace`` (module-level nodes, keeps leaf modules) and, when that
    fails, ``torch.export.export(..., strict=False).module()`` (aten-level nodes, handles HF
    models and dict/ModelOutput outputs). ``loss_fn(output) -> scalar`` is stored with the
    graph for profiling; the graph itself is the model's forward only.

    >>> import torch
    >>> gm = capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.ones(2, 4))
    >>> [n.op for n in gm.graph.nodes]
    ['placeholder', 'call_module', 'call_module', 'output']

    Raises:
        CaptureError: both methods failed; the message names both causes and what to do.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture expects an nn.Module, got {type(model).__name__}")
    args, kwargs = normalize_inputs(model, example_inputs)
    errors: dict[str, BaseException] = {}
    gm: torch.fx.GraphModule | None = None
    try:
        gm = _trace_fx(model, args, kwargs)
    except Exception as error:  # symbolic tracing fails on data-dependent Python control flow
        errors["torch.fx.symbolic_trace"] = error
        log.info("symbolic_trace failed (%s); trying torch.export", _first_line(error))
    if gm is None:
        try:
            gm = _trace_export(model, args, kwargs)
        except Exception as error:
            errors["torch.export (non-strict)"] = error
    if gm is None:
        causes = "\n".join(f"  - {how}: {_first_line(err)}" for how, err in errors.items())
        raise CaptureError(
            f"Could not capture {type(model).__name__} as a graph:\n{causes}\n"
            "What to do: remove Python control flow that depends on tensor values (an `if` on "
            "a tensor, `.item()`, data-dependent shapes) from forward(), or move it into a "
            "submodule that you do not want planned and mark it a leaf with "
            "torch.fx.wrap / a custom fx.Tracer; torch.cond replaces tensor-dependent `if`s. "
            "Check that example_inputs match what forward() expects."
        ) from errors.get("torch.export (non-strict)")
    gm.meta["planner"]["loss_fn"] = loss_fn
    gm.meta["planner"]["model_name"] = type(model).__name__
    gm.meta["planner"]["inputs"] = (args, kwargs)  # profile()'s default inputs
    return gm
