"""FSDP2 over gloo, measured as it runs over NCCL: a reduce-scatter with no buffer of its own.

gloo has no reduce-scatter of its own: ``reduce_scatter_tensor`` all-reduces a copy of the
input that the collective's ``Work`` allocates out of sight (no op the step dispatches makes
it), then copies this rank's chunk out in ``wait()``. gloo's worker thread drops the last
reference to that ``Work``, so the copy dies whenever the thread is next scheduled: a rank's
measured peak carried one layer's gradients more or not, from run to run (the 2 x 2 TP test
read 11 KiB over its budget once in three runs, always at the same op). NCCL reduce-scatters
in place, and the fake process group the plans are profiled on allocates nothing either.

:func:`reduce_scatter_in_place` gives each FSDP2 module of a gloo rank a reduce-scatter that
all-reduces FSDP2's own input buffer in place and copies this rank's chunk out: the same sums,
the same buffers as the profiled step, nothing freed by another thread.

Used by the gloo rank tests and ``distributed.py``; not part of the library.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

__all__ = ["reduce_scatter_in_place"]


class _InPlaceReduceScatter(DefaultReduceScatter):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp,
                 async_op: bool = False) -> dist.Work | None:
        if async_op:
            raise NotImplementedError("FSDP2 reduce-scatters synchronously")
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return None


def reduce_scatter_in_place(model: torch.nn.Module) -> torch.nn.Module:
    """Every FSDP2 module of ``model`` (wrapped, over gloo) reduce-scatters in place;
    returns ``model``."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(_InPlaceReduceScatter())
    return model
