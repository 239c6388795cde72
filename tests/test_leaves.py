"""profiles.leaves: an op's tensors found directly are the ones pytree finds, in its order."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch
from torch.utils._pytree import tree_leaves

from profiles.leaves import tensors_in

Pair = namedtuple("Pair", "first second")


def _pytree(value: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def test_the_tensors_of_any_structure_are_pytrees_in_its_order() -> None:
    a, b, c, d = (torch.zeros(k + 1) for k in range(4))
    structures = [
        ((a, [b, None, 3], {"out": c}), {"dim": 1, "weight": d}),  # an aten op's arguments
        (Pair(a, b), [c]),  # a namedtuple: pytree opens it
        OrderedDict(x=a, y=(b, c)),  # a dict subclass pytree registers
        torch.max(torch.stack([a, a]), dim=0),  # a structseq (torch.return_types)
        {"z": a, "a": b},  # insertion order, not sorted keys
        (torch.Size([2, 3]), a, "text", torch.float32, torch.device("cpu")),
        (),
    ]
    for value in structures:
        assert [id(t) for t in tensors_in(value)] == [id(t) for t in _pytree(value)], value
