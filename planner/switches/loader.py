"""The first batch of a trainer's data loader, for planning on the batch training sees."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["first_batch"]


def first_batch(loader: Any) -> Any:
    """The loader's first batch, leaving the random state as it was: taking it must not
    change the order of the batches or the dropout masks training then sees."""
    with torch.random.fork_rng(devices=[]):
        return next(iter(loader))
