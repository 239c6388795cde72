"""What "planning left the model as it found it" means, checked: every parameter, buffer and
gradient the same object with the same bits, under every name that reaches it (shared
modules, tied weights), and the same module tree, hooks, instance forwards and modes.

Used by the conformance harness and the tests; not part of the library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ModelSnapshot"]

_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def _tensor_record(t: torch.Tensor | None) -> tuple[Any, ...]:
    if t is None:
        return (None,)
    bits = t.detach().clone() if t.device.type != "meta" else None
    return (id(t), type(t), t.dtype, t.device, tuple(t.shape), t.requires_grad, bits)


def _same_record(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    if len(a) != len(b):
        return False
    *head_a, bits_a = a
    *head_b, bits_b = b
    if head_a != head_b:
        return False
    return (bits_a is None) == (bits_b is None) and (bits_a is None or torch.equal(bits_a,
                                                                                  bits_b))


def _module_record(module: nn.Module) -> tuple[Any, ...]:
    hooks = tuple((table, tuple(getattr(module, table, {}).items())) for table in _HOOK_TABLES)
    return (id(module), type(module), module.training, module.__dict__.get("forward"), hooks)


@dataclass
class ModelSnapshot:
    """Taken before planning; :meth:`differences` after says what changed."""

    tensors: dict[str, tuple[Any, ...]]
    grads: dict[str, tuple[Any, ...]]
    modules: dict[str, tuple[Any, ...]]

    @classmethod
    def of(cls, model: nn.Module) -> ModelSnapshot:
        named = [*model.named_parameters(remove_duplicate=False),
                 *model.named_buffers(remove_duplicate=False)]
        return cls(
            tensors={name: _tensor_record(t) for name, t in named},
            grads={name: _tensor_record(p.grad)
                   for name, p in model.named_parameters(remove_duplicate=False)},
            modules={name: _module_record(m)
                     for name, m in model.named_modules(remove_duplicate=False)})

    def differences(self, model: nn.Module) -> list[str]:
        """Each change since the snapshot, one line each (empty: untouched)."""
        now = ModelSnapshot.of(model)
        found = []
        for kind, before, after in (("tensor", self.tensors, now.tensors),
                                    ("gradient of", self.grads, now.grads)):
            if before.keys() != after.keys():
                found.append(f"{kind} names changed: {sorted(before.keys() ^ after.keys())[:3]}")
            for name in before.keys() & after.keys():
                if not _same_record(before[name], after[name]):
                    found.append(f"{kind} {name!r}: another object, type or bits "
                                 f"({after[name][1].__name__ if after[name][0] else 'None'})")
        if self.modules.keys() != now.modules.keys():
            found.append("the module tree changed")
        for name in self.modules.keys() & now.modules.keys():
            if self.modules[name] != now.modules[name]:
                found.append(f"module {name or '<model>'!r}: object, class, mode, forward or "
                             "hooks changed")
        return sorted(found)
