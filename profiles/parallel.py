"""One rank's step as torch.distributed runs it: the user's parallelize function on a twin
of the model, over a fake process group of the target size, in this process.

A rank's memory is its own compute (its batch, its shards of each parameter, in the dtype
the mixed-precision policy runs) plus what the parallel runtime holds around it: FSDP2's
all-gathered parameters (freed and re-allocated by resizing their storages, which no op
shows), its all-gather and reduce-scatter buffers, prefetching, the sharded gradients it
writes. Rather than describe that runtime, the profile runs it: ``fake_world``
(``profiles.fake_world``) makes a process group of ``mesh_shape``, ``parallel_twin``
deep-copies the model and hands the copy to the user's own ``parallelize(model, mesh)``,
and the profiler records that copy's step, with FSDP2's reduce-scatters as the backend
in use runs them (`Parallelism.backend`): NCCL in place (``reduce_scatter_in_place``), gloo
on a copy of the input (the fake group makes that copy too, ``profiles.fake_world``).
Ops the runtime dispatches (``is_runtime_op``) are not nodes of the plan: what they make is
``RuntimeMemory``, followed at its current size at every op, and added to each event of
the step as measured (``NodeProfile.fwd_runtime_bytes``, the observed backward).
"""

from __future__ import annotations

import copy
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from profiles.errors import ProfileError
from profiles.fake_world import fake_world
from profiles.schema import ParallelLayout
from profiles.swap import swapped_tensors

try:
    from torch.distributed._functional_collectives import (
        AsyncCollectiveTensor as _AsyncCollectiveTensor,
    )
except ImportError:  # torch built without distributed: no such tensors
    _AsyncCollectiveTensor = ()

__all__ = ["BACKENDS", "Parallelism", "RuntimeMemory", "describe_parallel", "fake_world",
           "is_runtime_op", "job_backend",
           "layout_changes", "local_tensor", "parallel_layout", "parallel_twin",
           "reduce_scatter_in_place", "storage_nbytes"]

# where the runtime that manages parameters lives: an op dispatched while one of these files
# runs is FSDP2's (all-gathers, reduce-scatters, its copies). Tensor parallel's
# redistributions are the model's own ops: they run inside module calls and again in their
# reruns, like any op
log = logging.getLogger(__name__)

_RUNTIME_DIRS = ("/torch/distributed/fsdp/", "/torch/distributed/_composable/")
_ACTIVATION_CASTS = ("_cast_fp_tensor",)  # torch.distributed.fsdp._fully_shard._fsdp_common


@dataclass(frozen=True)
class Parallelism:
    """How every rank runs the model: ``parallelize(model, mesh)`` (the user's function,
    called the same way on the real model after ``apply``) over a device mesh of
    ``mesh_shape`` (``(dp,)``, ``(dp, tp)``), named ``mesh_dim_names``."""

    parallelize: Callable[[nn.Module, Any], Any]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None = None
    # the collectives' backend, "nccl" or "gloo" (what a reduce-scatter holds);
    # None: the running job's, else the target device's (`for_target`)
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in (*BACKENDS, None):
            raise ValueError(f"backend must be one of {BACKENDS} (or None: the job's, else "
                             f"the device's), got {self.backend!r}")
        if not callable(self.parallelize):
            raise TypeError("parallelize must be a function parallelize(model, mesh), the "
                            f"one the training script calls; got {type(self.parallelize)}")
        if not isinstance(self.mesh_shape, tuple | list):
            raise TypeError(f"mesh_shape must be a tuple with one size per mesh dimension "
                            f"(e.g. (8,) or (4, 2)), got {self.mesh_shape!r}; for one "
                            f"dimension write ({self.mesh_shape!r},)")
        shape = tuple(self.mesh_shape)
        if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                            for n in shape):
            raise ValueError(f"mesh_shape must be positive ints, one per mesh dimension "
                             f"(e.g. (8,) or (4, 2)), got {self.mesh_shape!r}")
        names = self.mesh_dim_names
        if names is not None and len(tuple(names)) != len(shape):
            raise ValueError(f"mesh_dim_names {names!r} must name each of the "
                             f"{len(shape)} dimensions of mesh_shape {shape}")
        object.__setattr__(self, "mesh_shape", shape)
        if names is not None:
            object.__setattr__(self, "mesh_dim_names", tuple(names))

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def for_target(self, device_type: str, for_gpu: bool) -> Parallelism:
        """This parallelism with its backend said: as given, else the running job's process
        group's for ``device_type`` (planning inside the job), else NCCL for a GPU target
        (``for_gpu``: what the times are for) and gloo for the CPU."""
        if self.backend is not None:
            return self
        return replace(self, backend=job_backend(device_type) or (
            "nccl" if for_gpu or device_type == "cuda" else "gloo"))


BACKENDS = ("nccl", "gloo")


def job_backend(device_type: str) -> str | None:
    """The backend the job's default process group runs ``device_type``'s collectives on
    ("cpu:gloo,cuda:nccl" names one per device), if a job's group exists."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    named = str(dist.get_backend())
    for part in named.split(","):
        device, _, backend = part.rpartition(":")
        if device in ("", device_type) and backend in BACKENDS:
            return backend
    return None


def parallel_twin(model: nn.Module, parallelism: Parallelism, mesh: Any,
                  convert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """A deep copy of ``model`` parallelized by the user's function (inside
    :func:`fake_world`); the model itself is not touched. With ``convert`` (a fake step's
    converter, called inside its fake mode) the copy holds the fake twins of the model's
    parameters and buffers, and copying costs no memory however large the model."""
    try:
        twin = copy.deepcopy(model) if convert is None else _fake_copy(model, convert)
    except Exception as error:
        raise ProfileError(
            f"planning one rank runs parallelize on a copy of {type(model).__name__} "
            f"(copy.deepcopy), which failed: {type(error).__name__}: {error}. Make the "
            "model copyable (a module attribute such as a lock or a file cannot be), or "
            "plan it without parallelize=.") from error
    try:
        returned = parallelism.parallelize(twin, mesh)
    except Exception as error:
        raise ProfileError(
            f"parallelize(model, mesh) failed on a copy of {type(model).__name__} over a fake "
            f"process group of {parallelism.world_size} ranks (mesh {parallelism.mesh_shape}"
            f"{', ' + str(parallelism.mesh_dim_names) if parallelism.mesh_dim_names else ''})"
            f": {type(error).__name__}: {error}. It must run on the model as optimize() was "
            "given it, before apply(), as in the training script.") from error
    if isinstance(returned, nn.Module) and returned is not twin:
        raise ValueError(
            "parallelize(model, mesh) returned another module than the one it was given: "
            "the planner installs its plan on the model's own modules, so parallelize must "
            "change the model in place (as fully_shard and parallelize_module do)")
    return twin if parallelism.backend == "gloo" else reduce_scatter_in_place(twin)


def reduce_scatter_in_place(model: nn.Module) -> nn.Module:
    """FSDP2's reduce-scatters in ``model`` as NCCL runs them, in place; returns ``model``.

    NCCL reduce-scatters FSDP2's input buffer in place. gloo and the fake process group make
    a copy of the input inside the collective (gloo all-reduces it and copies this rank's
    chunk out in ``wait()``), one FSDP2 unit's gradients in the reduce dtype (8 % of a bf16
    rank's step in ``distributed.py``). A plan for NCCL profiles its step with this; a plan
    for gloo keeps gloo's copy (`Parallelism.backend`). Each FSDP2 group still on torch's
    default reduce-scatter gets one that all-reduces the input buffer in place and copies
    this rank's chunk out: the same sums, no copy. A custom reduce-scatter of the user's is
    left as it is."""
    if _InPlaceReduceScatter is None:  # a torch without the custom-collective hooks
        return model
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        fsdp = state()
        groups = getattr(fsdp, "_fsdp_param_groups", None) or [
            getattr(fsdp, "_fsdp_param_group", None)]
        for group in groups:
            if type(getattr(group, "_reduce_scatter_comm", None)) is _DefaultReduceScatter:
                group._reduce_scatter_comm = _InPlaceReduceScatter()
    return model


def _in_place_reduce_scatter() -> tuple[type | None, type | None]:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:
        return None, None
    import torch.distributed as dist

    class InPlaceReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
            if async_op:  # FSDP2 reduce-scatters synchronously
                raise NotImplementedError("an asynchronous in-place reduce-scatter")
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])

    return DefaultReduceScatter, InPlaceReduceScatter


_DefaultReduceScatter, _InPlaceReduceScatter = _in_place_reduce_scatter()


def _fake_copy(model: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor]
               ) -> nn.Module:
    """A deep copy of ``model`` made on the meta device (outside the fake modes), then given
    the fake twin of each tensor, one per tensor object (tied weights stay tied)."""
    from torch.utils._python_dispatch import _disable_current_modes

    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    with _disable_current_modes():  # the fake step's modes would make meta tensors real
        meta = {name: torch.empty_like(t, device="meta") for name, t in named}
        with swapped_tensors(model, meta):
            twin = copy.deepcopy(model)
    owners = dict(twin.named_modules(remove_duplicate=False))
    made: dict[int, torch.Tensor] = {}
    for name, tensor in named:
        if id(tensor) not in made:
            fake = convert(tensor)
            made[id(tensor)] = nn.Parameter(fake, requires_grad=tensor.requires_grad) \
                if isinstance(tensor, nn.Parameter) else fake
        path, _, attr = name.rpartition(".")
        owner = owners[path]
        table = owner._parameters if attr in owner._parameters else owner._buffers
        table[attr] = made[id(tensor)]
    return twin


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``tensor``'s bytes on this rank: a DTensor's shard, the
    result a functional collective's ``AsyncCollectiveTensor`` wraps (the wrapper allocates
    nothing); any other tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    if isinstance(tensor, _AsyncCollectiveTensor):
        return tensor.elem
    return tensor


def is_runtime_op() -> bool:
    """Whether the op being dispatched now comes from FSDP2 (its hooks' all-gathers,
    reduce-scatters and copies), not from the model's own code. A cast of the activations
    its mixed-precision policy makes (module inputs to ``param_dtype``, the root's outputs
    to ``output_dtype``) is the model's: autograd records it like any op of the step."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _ACTIVATION_CASTS:
            return False
        name = frame.f_code.co_filename
        if any(part in name for part in _RUNTIME_DIRS):
            return True
        frame = frame.f_back
    return False


class RuntimeAwareMode(TorchDispatchMode):
    """A profiling dispatch mode that runs prim ops as they are and hands the parallel
    runtime's ops (`is_runtime_op`) to `_runtime_op` when it tracks `runtime` memory;
    every other op goes to `_op`."""

    runtime: RuntimeMemory | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":
            return func(*args, **kwargs)
        if self.runtime is not None and is_runtime_op():
            return self._runtime_op(func, args, kwargs)
        return self._op(func, args, kwargs)

    def _runtime_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError


class RuntimeMemory:
    """The storages a parallel runtime made during the step, at their current sizes.

    FSDP2 frees an all-gathered parameter by resizing its storage to 0 and re-allocates it
    by resizing it back, which no op shows: a storage is followed through a weak reference
    and counted at the size it has whenever ``nbytes()`` is asked."""

    def __init__(self) -> None:
        self._refs: set[StorageWeakRef] = set()

    def add(self, tensor: torch.Tensor) -> None:
        self._refs.add(StorageWeakRef(local_tensor(tensor).untyped_storage()))

    def holds(self, tensor: torch.Tensor) -> bool:
        ref = StorageWeakRef(local_tensor(tensor).untyped_storage())
        return ref in self._refs and not ref.expired()

    def nbytes(self) -> int:
        total = 0
        for ref in list(self._refs):
            if ref.expired():
                self._refs.discard(ref)
                continue
            total += storage_nbytes(ref)
        return total


def storage_nbytes(ref: StorageWeakRef) -> int:
    """The current size of a storage, read through its weak reference (not through a
    tensor on it, which may die while the storage lives on in another view); 0 once it
    died, which another thread (a collective's worker) can make it do at any moment."""
    storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    return 0 if storage is None else storage.nbytes()


def parallel_layout(twin: nn.Module, parallelism: Parallelism) -> ParallelLayout:
    """What ``parallelize`` made of the model (:func:`describe_parallel`) on its mesh, and
    the backend its collectives were profiled for."""
    found = describe_parallel(twin)
    if found is None:
        log.warning(
            "parallelize(model, mesh) over %d ranks left %s as it was (no fully_shard unit, "
            "no DTensor parameter): each rank's plan is the one process's step, with no "
            "parallel runtime counted. If the ranks should shard, check the function",
            parallelism.world_size, type(twin).__name__)
        found = ParallelLayout(mesh_shape=[])
    return found.model_copy(update={
        "backend": parallelism.backend,
        "mesh_shape": list(parallelism.mesh_shape),
        "mesh_dim_names": list(parallelism.mesh_dim_names) if parallelism.mesh_dim_names
        else None})


def describe_parallel(model: nn.Module) -> ParallelLayout | None:
    """How ``model`` is parallelized now: its FSDP2 units and their policies, and where each
    DTensor parameter lives (placements on its mesh's shape); None for a model neither
    ``fully_shard`` nor tensor parallel touched. The mesh itself is the caller's to say."""
    units, reshard, dtypes, offload = [], [], [], False
    for path, module in model.named_modules():
        group = _fsdp_group(module)
        if group is None:
            continue
        units.append(path)
        reshard.append(_reshard_after_forward(group))
        policy = group.mp_policy
        dtypes.append([_dtype(policy.param_dtype), _dtype(policy.reduce_dtype)])
        offload = offload or type(group.offload_policy).__name__ == "CPUOffloadPolicy"
    # one policy for every unit: its dtypes; mixed policies (bf16 blocks, an fp32 root) are
    # told apart by `unit_dtypes` alone
    same = len({tuple(d) for d in dtypes}) == 1
    param_dtype, reduce_dtype = dtypes[0] if same else (None, None)
    placements = {name: _where(param) for name, param in model.named_parameters()
                  if hasattr(param, "placements")}
    paths = {id(m): p for p, m in model.named_modules()}
    for module in model.modules():  # in a forward, FSDP2 holds them unsharded
        group = _fsdp_group(module)
        for fsdp_param in group.fsdp_params if group is not None else ():
            info = fsdp_param._module_info
            owner = paths.get(id(info.module), "")
            name = f"{owner}.{info.param_name}" if owner else info.param_name
            placements[name] = _where(fsdp_param.sharded_param)
    if not units and not placements:
        return None
    return ParallelLayout(mesh_shape=[], fsdp_units=units, param_dtype=param_dtype,
                          reduce_dtype=reduce_dtype, unit_dtypes=dtypes,
                          reshard_after_forward=reshard, cpu_offload=offload,
                          placements=placements)


def layout_changes(planned: ParallelLayout | None, now: ParallelLayout | None) -> str:
    """How a model's parallelism differs from the planned one, in words ('' when not)."""
    if planned is None:
        return "" if now is None else (
            "it is parallelized (FSDP2 or tensor parallel), but its plan is for one process")
    if now is None:
        return (f"its plan is for one rank ({planned.describe()}), but it is not "
                "parallelized: call your parallelize(model, mesh) after apply()")
    for field, what in (("fsdp_units", "fully_shard units"), ("param_dtype",
                        "MixedPrecisionPolicy.param_dtype"), ("reduce_dtype",
                        "MixedPrecisionPolicy.reduce_dtype"), ("reshard_after_forward",
                        "reshard_after_forward"), ("cpu_offload", "CPUOffloadPolicy")):
        if getattr(planned, field) != getattr(now, field):
            return f"its {what}: {getattr(now, field)!r}, planned {getattr(planned, field)!r}"
    if planned.unit_dtypes and planned.unit_dtypes != now.unit_dtypes:  # files before it: []
        unit = next((k for k, (a, b) in enumerate(zip(planned.unit_dtypes, now.unit_dtypes,
                                                      strict=False)) if a != b), 0)
        name = repr(now.fsdp_units[unit]) if unit < len(now.fsdp_units) else unit
        return (f"the MixedPrecisionPolicy of fully_shard unit {name} (param_dtype, "
                f"reduce_dtype): {now.unit_dtypes[unit] if unit < len(now.unit_dtypes) else None}"
                f", planned {planned.unit_dtypes[unit]}")
    moved = [name for name in planned.placements.keys() | now.placements.keys()
             if planned.placements.get(name) != now.placements.get(name)]
    if moved:
        name = sorted(moved)[0]
        return (f"parameter {name!r} is {now.placements.get(name, 'not a DTensor')}, planned "
                f"{planned.placements.get(name, 'not a DTensor')}")
    return ""


def _where(param: torch.Tensor) -> str:
    return f"{', '.join(str(p) for p in param.placements)} on {tuple(param.device_mesh.shape)}"


def _fsdp_group(module: nn.Module) -> Any:
    state = getattr(module, "_get_fsdp_state", None)
    return getattr(state(), "_fsdp_param_group", None) if state is not None else None


def _reshard_after_forward(group: Any) -> bool | int:
    info = group.post_forward_mesh_info
    if info is None:
        return False
    if info is group.mesh_info or info == group.mesh_info:
        return True
    return int(info.shard_mesh_size)


def _dtype(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None
