"""A fake process group of any size in this process, as the profile of one rank runs in it.

torch's ``fake`` backend makes collectives return at once with real buffers of real sizes,
so FSDP2 and DTensor run their real code for a world this machine does not have. Around it:
the job's own process groups (torchrun) set aside and put back; DTensor's caches, keyed by
meshes that compare equal across worlds, emptied; and on the CPU gloo's reduce-scatter copy
of its input, which the fake backend does not make.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from profiles.parallel import Parallelism

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(parallelism: Parallelism, device_type: str, rank: int = 0) -> Iterator[Any]:
    """A fake process group of ``parallelism.world_size`` ranks (this process is ``rank``)
    and its device mesh. A process group that already exists (torchrun, NCCL or gloo) is
    set aside while the fake one runs and put back after (``_JobGroups``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    job = _JobGroups.set_aside()
    _forget_meshes()
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank,
                                world_size=parallelism.world_size)
        try:
            with _as_gloo() if device_type == "cpu" else contextlib.nullcontext():
                yield init_device_mesh(device_type, parallelism.mesh_shape,
                                       mesh_dim_names=parallelism.mesh_dim_names)
        finally:
            dist.destroy_process_group()
    finally:
        _forget_meshes()
        job.put_back()


def _forget_meshes() -> None:
    """Empty DTensor's caches of sharding and redistribution plans: they are keyed by
    meshes that compare equal across worlds (a fake one of the same shape, another rank,
    the job's own), and hold the process groups of the world that filled them."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


@contextlib.contextmanager
def _as_gloo() -> Iterator[None]:
    """A step on the CPU runs over gloo (torch's backend for CPU tensors), whose
    reduce-scatter works on a copy of its input, allocated inside the collective (measured:
    the input's bytes, while the shards are copied out); NCCL's needs none. The fake
    group's reduce-scatter makes that copy too."""
    import torch.distributed as dist

    original = dist.reduce_scatter_single

    def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor,
                              *args: Any, **kwargs: Any) -> Any:
        copy = torch.empty_like(input)
        work = original(output, input, *args, **kwargs)
        del copy
        return work

    dist.reduce_scatter_single = reduce_scatter_single
    try:
        yield
    finally:
        dist.reduce_scatter_single = original


class _JobGroups:
    """The process groups of the job planning (none outside torchrun), set aside so that a
    fake default group can exist, then put back as they were: c10d keeps them in module
    tables and a C++ registry by name, which destroying the fake group empties."""

    _TABLES = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config",
               "_tags_to_pg", "_pg_to_tag")

    def __init__(self, c10d: Any) -> None:
        self.c10d = c10d
        self.default = c10d._world.default_pg
        self.tables = {name: dict(getattr(c10d, name)) for name in self._TABLES}
        self.count = c10d._group_count

    @classmethod
    def set_aside(cls) -> _JobGroups:
        import torch.distributed.distributed_c10d as c10d

        job = cls(c10d)
        if job.default is not None:
            c10d._update_default_pg(None)
            for name in cls._TABLES:
                getattr(c10d, name).clear()
        return job

    def put_back(self) -> None:
        if self.default is None:
            return
        c10d = self.c10d
        for name, saved in self.tables.items():
            getattr(c10d, name).clear()
            getattr(c10d, name).update(saved)
        c10d._group_count = self.count
        c10d._update_default_pg(self.default)
        for group, name in self.tables["_pg_names"].items():
            c10d._register_process_group(name, group)
