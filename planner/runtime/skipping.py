"""A checkpoint's rerun that skips the ops whose values nothing needs (`solvers.frame` F9).

Where a region keeps a softmax's output, its rerun still runs the score matmul, the scale
and the mask that made it, only to drop their results: torch's selective checkpointing
replays every op it does not serve from its cache. The plan names those ops (by op and
occurrence in the rerun, as the policy counts them); beneath the SAC mode that recomputes,
:class:`SkipOps` answers each with uninitialized tensors of the shapes its meta kernel
gives, made through the modes below (a memory tracker sees them as the op's outputs), so
the rerun's memory is as it was and their time is not spent. Nothing they make is read:
the plan skips only ops whose outputs no op the rerun runs or packs reads.

Beneath the SAC mode, it sees only the ops the rerun recomputes (the SAC cache answers the
kept ones above it, and asks no policy in the rerun): the plan names each skipped op by
its occurrence among the ops of its name the region recomputes (`skipped_ops`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS

__all__ = ["SkipOps", "with_skips"]

# what a skipped op may read: plain tensors, a module's own parameters among them (a
# projection's bias); a subclass (DTensor, fake) runs its op
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


class SkipOps(TorchDispatchMode):
    """Below a SAC rerun: the ops ``skipped`` (op name, occurrence among the recomputed ops
    of that name) return uninitialized outputs while ``enabled()``; the others run.
    ``skipped_count``: how many it answered."""

    def __init__(self, skipped: frozenset[tuple[str, int]],
                 enabled: Callable[[], bool] = lambda: True) -> None:
        super().__init__()
        self.skipped, self.enabled = skipped, enabled
        self.seen: Counter[str] = Counter()
        self.skipped_count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:  # the policy never counted it
            return func(*args, **kwargs)
        name = str(func)
        occurrence = self.seen[name]
        self.seen[name] += 1
        if (name, occurrence) not in self.skipped or not self.enabled():
            return func(*args, **kwargs)
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(type(t) not in _PLAIN for t in tensors):  # a DTensor, a fake: run it
            return func(*args, **kwargs)
        device = tensors[0].device if tensors else None
        meta_kwargs = tree_map(_meta, kwargs)
        if "device" in meta_kwargs:  # a factory-like op (new_ones): shapes only, no memory
            device = kwargs["device"] or device
            meta_kwargs["device"] = torch.device("meta")
        if device is None:  # no tensor to place the outputs by: run it
            return func(*args, **kwargs)
        try:
            with _disable_current_modes():
                shapes = func(*tree_map(_meta, args), **meta_kwargs)
        except (NotImplementedError, RuntimeError):  # no meta kernel: run it
            return func(*args, **kwargs)
        self.skipped_count += 1
        return tree_map(lambda m: torch.empty_strided(m.size(), m.stride(), dtype=m.dtype,
                                                      device=device)
                        if isinstance(m, torch.Tensor) else m, shapes)


def with_skips(contexts: tuple[Any, Any], skipped: frozenset[tuple[str, int]],
               enabled: Callable[[], bool]) -> tuple[Any, Any]:
    """SAC's (forward, recompute) contexts with :class:`SkipOps` beneath the recompute one
    (entered first: the SAC mode sees each op first and recomputes through it). It skips
    only while ``enabled()``: the call's forward ran the op stream the plan was made for
    (else the occurrences it names are other ops)."""
    forward, recompute = contexts

    @contextlib.contextmanager
    def rerun() -> Iterator[None]:
        with SkipOps(skipped, enabled), recompute:
            yield

    return forward, rerun()
