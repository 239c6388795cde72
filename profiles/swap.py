"""Run a model on other tensors than its own, and put its own back exactly.

Profiling runs the user's model on fake tensors (or on copies of its buffers). torch's
``_reparametrize_module`` swaps one *name* at a time; a module reachable by two names
(timm's CoaT registers its ``cpe``/``crpe`` modules twice, a user's ``self.alias =
self.block``) is then swapped twice, the second swap saves the first one's fake tensor as
"the original", and the model is left holding fakes. Here each slot, a (module, attribute)
pair, is swapped once, whatever the number of names that reach it, and restored last in,
first out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

__all__ = ["swapped_tensors"]


def _slot(owner: nn.Module, attr: str, name: str) -> dict[str, torch.Tensor | None]:
    """The table (``_parameters`` or ``_buffers``) that holds ``owner.attr``."""
    for table in (owner._parameters, owner._buffers):
        if attr in table:
            return table
    raise KeyError(f"{name!r} is neither a parameter nor a buffer of the model")


@contextlib.contextmanager
def swapped_tensors(model: nn.Module, state: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``model`` with each parameter or buffer named in ``state`` (names as
    ``named_parameters(remove_duplicate=False)`` gives them) replaced by its value, and
    the very objects it held put back after, also when the body raises. Tied tensors
    (one tensor in two modules) are swapped in each module, each to its own name's value."""
    owners = dict(model.named_modules(remove_duplicate=False))
    swapped: dict[tuple[int, str], tuple[dict, str, torch.Tensor | None]] = {}
    try:
        for name, value in state.items():
            path, _, attr = name.rpartition(".")
            owner = owners[path]
            if (id(owner), attr) in swapped:  # the same slot under another name
                continue
            table = _slot(owner, attr, name)
            swapped[(id(owner), attr)] = (table, attr, table[attr])
            table[attr] = value
        yield
    finally:
        for table, attr, original in reversed(swapped.values()):
            table[attr] = original
