"""The tensors among an op's arguments, found without pytree's per-node dispatch.

Every mode of a profile (the recorder, the backward observer, fake mode's helpers) asks
which tensors an op reads or returns, for every op of every pass: through
``torch.utils._pytree`` that was about a fifth of a profile's time. An aten op's arguments
are tuples, lists and dicts of tensors and plain values, which this walks directly, in
pytree's order; anything pytree would open some other way (a namedtuple, a structseq, a
registered class) goes to pytree, so the answer is always pytree's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_leaves


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors among ``value``'s pytree leaves, in pytree's order."""
    found: list[torch.Tensor] = []
    if _walk(value, found):
        return found
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _walk(value: Any, found: list[torch.Tensor]) -> bool:
    """Append ``value``'s tensors to ``found``; False where pytree must say."""
    kind = type(value)
    if kind is tuple or kind is list:
        return all(_walk(item, found) for item in value)
    if kind is dict:
        return all(_walk(item, found) for item in value.values())
    if isinstance(value, torch.Tensor):
        found.append(value)
        return True
    # a subclass of a container (namedtuple, structseq, OrderedDict) or a registered node
    return not isinstance(value, (tuple, list, dict)) and kind not in SUPPORTED_NODES
