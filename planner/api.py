"""optimize / apply / remove / verify: plan a model's checkpoints under a memory budget."""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import re
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS

import profiles
from planner.emit import RegionSpec, checkpointed_modules, prepare_checkpoints, remove_checkpoints
from planner.guard import PlanGuard
from planner.offload import (
    KEEPS_THROUGH_HOOKS,
    install_offload,
    offloaded_modules,
    remove_offload,
    suspended_offload,
)
from planner.plan import (
    GIB,
    InfeasibleBudgetError,
    InputSpec,
    Plan,
    PlanMismatchError,
    PlanMismatchWarning,
    SolverReport,
    format_bytes,
)
from planner.sharding import (
    SHARDINGS,
    Sharding,
    fsdp2_recipe,
    rank_problem,
    repeated_blocks,
    sharding_for,
)
from profiles.inputs import normalize_inputs
from profiles.kernels import attention_kernels
from profiles.parallel import Parallelism
from profiles.schema import GraphProfile, fingerprint
from solvers import (
    SOLVERS,
    ModuleCall,
    OpRange,
    Problem,
    Region,
    Save,
    Schedule,
    Solution,
    Status,
    simulate,
)
from solvers import joint as solvers_joint
from solvers.auto import lowest_peak
from solvers.from_profile import op_range_targets, problem_from_profile
from solvers.simulate import optimizer_step_peak

log = logging.getLogger(__name__)

__all__ = ["PlanGuard", "PlanMismatchWarning", "ProfiledStep", "VerifyReport", "apply",
           "measure_step", "optimize", "plan_for_profile", "plan_for_schedule",
           "profile_model", "remove", "replan", "solve", "structure_fingerprint", "verify"]


# ----------------------------------------------------------------------------- inputs


def _budget_bytes(budget_gb: Any) -> int:
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, numbers.Real):
        raise TypeError(f"budget_gb must be a number of GiB (2**30 bytes), got "
                        f"{type(budget_gb).__name__} {budget_gb!r}")
    if not math.isfinite(budget_gb) or budget_gb <= 0:
        raise ValueError(f"budget_gb must be a positive, finite number of GiB, got "
                         f"{budget_gb!r}")
    return _checked_budget(int(budget_gb * GIB), f"budget_gb={budget_gb!r} GiB")


MIN_BUDGET_BYTES = 2**10
MAX_BUDGET_BYTES = 2**60


def _checked_budget(nbytes: int, given: str) -> int:
    """A budget in bytes that can mean something: at least a KiB (no training step fits
    in less), at most an EiB."""
    if nbytes < MIN_BUDGET_BYTES:
        raise ValueError(f"{given} is {nbytes} bytes, less than 1 KiB: no training step fits. "
                         "budget_gb is in GiB (2**30 bytes), e.g. budget_gb=8")
    if nbytes > MAX_BUDGET_BYTES:
        raise ValueError(f"{given} is more than 2**60 bytes (1 EiB); give a budget a device "
                         "could have")
    return nbytes


def _input_specs(args: tuple, kwargs: dict) -> list[InputSpec]:
    specs: list[InputSpec] = []
    seen: dict[int, str] = {}
    for keyword, items in ((False, enumerate(args)), (True, kwargs.items())):
        for name, value in items:
            if isinstance(value, torch.Tensor):
                specs.append(InputSpec(name=str(name), keyword=keyword, shape=list(value.shape),
                                       dtype=str(value.dtype).removeprefix("torch."),
                                       same_as=seen.get(id(value))))
                seen.setdefault(id(value), str(name))
            else:
                specs.append(InputSpec(name=str(name), keyword=keyword,
                                       value=value if _plain(value) else repr(value)))
    return specs


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _model_device(model: nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


def _ambient_autocast(device_type: str) -> torch.dtype | None:
    if device_type in ("meta",) or not torch.amp.is_autocast_available(device_type):
        return None
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def structure_fingerprint(model: nn.Module) -> str:
    """Hash of the module tree (paths and classes) and every parameter's and buffer's
    name, shape and dtype: what a plan needs of the model it is applied to."""
    structure: list[object] = [(name, type(m).__name__) for name, m in model.named_modules()]
    structure += [(name, list(t.shape), str(t.dtype)) for name, t in
                  [*model.named_parameters(remove_duplicate=False),
                   *model.named_buffers(remove_duplicate=False)]]
    return fingerprint(structure)


def _cached_configs(model: nn.Module) -> list[Any]:
    """Configs in the module tree that turn on a key/value cache (HF ``use_cache``): the
    model's and the copies its submodules keep (T5's decoder has its own)."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False) is True:
            found.setdefault(id(config), config)
    return list(found.values())


@contextlib.contextmanager
def _training_config(model: nn.Module) -> Iterator[bool]:
    """Hugging Face models cache keys and values (``use_cache``) unless told not to; a
    training step does not need them, and a checkpoint's rerun would find the cache filled
    by the forward (a cross-attention then skips its projections, a self-attention extends
    the cache twice), so HF itself turns the cache off under gradient checkpointing.
    Planning does the same while it profiles, on every config of the module tree; yields
    whether it had to."""
    configs = _cached_configs(model)
    for config in configs:
        config.use_cache = False
    try:
        yield bool(configs)
    finally:
        for config in configs:
            config.use_cache = True


def _refuse_existing_checkpointing(model: nn.Module) -> None:
    """HF's own checkpointing on the model or a wrapped one (PEFT) would nest with a plan."""
    for module in model.modules():
        cls = type(module)
        flag = ("is_activation_checkpointing" if hasattr(cls, "is_activation_checkpointing")
                else "is_gradient_checkpointing" if hasattr(cls, "is_gradient_checkpointing")
                else None)  # transformers 5 renamed it
        if flag is not None and getattr(module, flag, False):
            off = flag.replace("is_", "", 1) + "_disable"
            raise ValueError(
                f"{cls.__name__} already has Hugging Face gradient checkpointing on; a plan "
                f"replaces it. Call model.{off}() first.")


# ----------------------------------------------------------------------------- optimize


@dataclass(frozen=True)
class ProfiledStep:
    """One training step of a model, profiled as it will train: what :func:`solve` plans
    at any budget without profiling again (:func:`profile_model` makes it)."""

    profile: GraphProfile
    inputs: list[InputSpec]
    structure: str  # structure_fingerprint() of the model
    sharding: Sharding | None = None
    notes: tuple[str, ...] = ()

    @property
    def unplanned_peak_bytes(self) -> int:
        """The peak of the step without checkpoints (as one rank runs it)."""
        return simulate(self.problem(), Schedule.store_all(len(self.profile.nodes))).peak_bytes

    def problem(self) -> Problem:
        """The step as the solvers see it (per rank)."""
        return rank_problem(problem_from_profile(self.profile),
                            self.sharding)


def profile_model(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    autocast: torch.dtype | None = None,
    grad_accumulation: bool = False,
    timing: str = "auto",
    device: str | None = None,
    execution: str = "auto",
    world_size: int = 1,
    sharding: str | None = None,
    shard_modules: list[str] | None = None,
    parallelize: Callable[[nn.Module, Any], Any] | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
    progress: bool = True,
) -> ProfiledStep:
    """Profile one training step of ``model`` as it will train, for :func:`solve` to plan
    at one budget or many. Arguments as :func:`optimize`.

    Whatever state the object is in, the step profiled is the training step: a plan
    already applied is taken off while profiling and put back as it was (``apply`` of the
    new plan replaces it); the ``.grad`` the model holds now do not count (the step
    starts as ``grad_accumulation`` says); a model in ``eval()`` is profiled in ``train()``
    mode, each module's mode restored after, and the plan's note says so.
    """
    parallel, ddp = _parallelism(model, world_size, sharding, shard_modules, parallelize,
                                 mesh_shape, mesh_dim_names)
    _refuse_existing_checkpointing(model)
    toy_batch = example_inputs is None
    args, kwargs = normalize_inputs(model, example_inputs)
    if autocast is None:
        autocast = _ambient_autocast(_model_device(model).type)
        if autocast is not None:
            log.info("planning under the ambient torch.autocast(%s)", autocast)
    notes = []
    with (_plan_suspended(model), _training_mode(model) as was_eval,
          _training_config(model) as cache_off):
        prof = profiles.profile(model, _as_inputs(args, kwargs), loss_fn=loss_fn,
                                optimizer=optimizer, autocast=autocast, timing=timing,
                                device=device, execution=execution,
                                grad_accumulation=grad_accumulation, progress=progress,
                                parallel=parallel)
    if was_eval:
        notes.append("Planned the training step (dropout on, BatchNorm updating): the model "
                     "was in eval mode; call model.train() before training with it.")
        log.warning("%s is in eval mode; planning its training step (train() mode)",
                    type(model).__name__)
    if toy_batch:
        notes.append("Planned for the model's own example batch (a toy batch, "
                     f"{_batch_shapes(args, kwargs)}), not one it trains on: pass "
                     "example_inputs shaped like one real training batch.")
    if cache_off:
        notes.append("Profiled with config.use_cache=False (a training step keeps no cache); "
                     "apply() turns it off.")
    notes.extend(_cpu_kernels_for_a_gpu(prof))
    notes.extend(_untraced_note(prof))
    return ProfiledStep(prof, _input_specs(args, kwargs), structure_fingerprint(model), ddp,
                        tuple(notes))


def _parallelism(model: nn.Module, world_size: int, sharding: str | None,
                 shard_modules: list[str] | None,
                 parallelize: Callable[[nn.Module, Any], Any] | None,
                 mesh_shape: tuple[int, ...] | None, mesh_dim_names: tuple[str, ...] | None
                 ) -> tuple[Parallelism | None, Sharding | None]:
    """How each rank runs the model, from ``optimize``'s arguments: the user's parallelize
    function over its mesh (``sharding="fsdp2"`` is torchtitan's recipe as one), or DDP's
    constant, or one process."""
    if sharding is not None and sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if parallelize is not None:
        if sharding is not None:
            raise ValueError("give parallelize= or sharding=, not both: parallelize is the "
                             "wrapping itself (sharding='fsdp2' is a shorthand for one)")
        if mesh_shape is None:
            if world_size == 1:
                raise ValueError("parallelize= needs mesh_shape=(dp,) or (dp, tp): the mesh "
                                 "each rank's step runs on")
            mesh_shape = (world_size,)
        parallel = Parallelism(parallelize, tuple(mesh_shape), mesh_dim_names)
        if world_size not in (1, parallel.world_size):
            raise ValueError(f"world_size={world_size} but mesh_shape {parallel.mesh_shape} "
                             f"has {parallel.world_size} ranks")
        return parallel, None
    if mesh_shape is not None or mesh_dim_names is not None:
        raise ValueError("mesh_shape= and mesh_dim_names= go with parallelize=(model, mesh), "
                         "the function that parallelizes the model on that mesh")
    if world_size != 1 and sharding is None:
        raise ValueError(f"world_size={world_size!r} needs sharding='ddp' or 'fsdp2', or "
                         "parallelize=: how each rank holds the model decides its memory")
    if sharding == "fsdp2":
        units = repeated_blocks(model, shard_modules)
        return Parallelism(fsdp2_recipe(units), (world_size,)), None
    if sharding == "ddp":
        return None, sharding_for(model, world_size)
    return None, None


def _batch_shapes(args: tuple, kwargs: dict) -> str:
    named = [*enumerate(args), *kwargs.items()]
    return ", ".join(f"{name} {list(v.shape)}" for name, v in named
                     if isinstance(v, torch.Tensor)) or "no tensors"


_OPTIONAL = r"argument '([^']*)' is optional"
_OPTIONAL_ANY = "<optional arguments>"
UNTRACED_LINES = 6  # module types the note names per reason; the rest are counted


def _untraced_note(prof: GraphProfile) -> list[str]:
    """Which modules offer module-call regions only (their forward is not traced, or not
    as it ran): one sentence per reason, naming the module types it holds for (optional
    arguments, the usual reason in Hugging Face models, are one reason whatever their
    names); nothing when every one traced."""
    by_reason: dict[str, Counter[str]] = {}
    optional: dict[str, None] = {}  # argument names, in order met
    for call in prof.module_calls:
        if call.untraced:
            found = re.search(_OPTIONAL, call.untraced)
            if found:
                optional[found.group(1)] = None
            reason = re.sub(_OPTIONAL, _OPTIONAL_ANY, call.untraced)
            by_reason.setdefault(reason, Counter())[call.module_type] += 1
    if not by_reason:
        return []
    traced = sum(1 for call in prof.module_calls if call.traced)
    names = ", ".join(repr(name) for name in optional)
    lines = []
    for reason, kinds in sorted(by_reason.items(), key=lambda kv: -sum(kv[1].values())):
        reason = reason.replace(_OPTIONAL_ANY, f"argument {names} is optional"
                                if len(optional) == 1 else f"arguments {names} are optional")
        named = [f"{kind} ({count} call{'s' * (count > 1)})"
                 for kind, count in kinds.most_common(UNTRACED_LINES)]
        more = len(kinds) - UNTRACED_LINES
        lines.append(f"{', '.join(named)}{f' and {more} more types' if more > 0 else ''}: "
                     f"{reason}.")
    return [f"Op ranges inside a forward (torch.fx): {traced} module calls traced; these "
            "offer module-call regions only: " + " ".join(lines)]


def _cpu_kernels_for_a_gpu(prof: GraphProfile) -> list[str]:
    """A note when real CPU tensors stood in for a GPU: attention and dropout ran the CPU's
    kernels, which save other tensors than the GPU's fused ones (``profiles.kernels``).
    The plan's note says it (``summary()``); the log only at INFO, as the CLI estimates
    for an H100 by default."""
    if prof.execution != "real" or prof.timing != "estimate" or prof.device.lower() == "cpu":
        return []
    targets = [node.target for node in prof.nodes]
    kernels = attention_kernels(targets)
    cpu_only = [k for k in kernels if k in ("flash_cpu", "math")]
    if "aten.bernoulli_.float" in targets:
        cpu_only.append("dropout as bernoulli_ noise")
    if not cpu_only:
        return []
    log.info("%s was profiled on real CPU tensors for %s: its attention/dropout ran the "
             "CPU's kernels", prof.model_name, prof.device)
    return [f"Profiled on real CPU tensors for {prof.device}: {', '.join(cpu_only)} ran as "
            f"on the CPU, where {prof.device} runs fused kernels that save less. Build the "
            "model on the meta device to profile the GPU's kernels."]


def solve(profiled: ProfiledStep, budget_gb: float | None = None, *,
          budget_bytes: int | None = None, solver: str = "auto",
          time_limit_s: float = 60.0, offload: bool = False,
          host_budget_gb: float | None = None, op_ranges: bool = True) -> Plan:
    """Plan a step profiled by :func:`profile_model` at ``budget_gb`` (or ``budget_bytes``);
    call it as often as you like, each call solves without profiling. ``offload``,
    ``host_budget_gb`` and ``op_ranges`` as in :func:`optimize`.

    >>> step = profile_model(model, batch, loss_fn=loss_fn)  # doctest: +SKIP
    >>> plans = [solve(step, budget_gb=b) for b in (4, 6, 8)]  # doctest: +SKIP
    """
    if not isinstance(profiled, ProfiledStep):
        raise TypeError(f"solve() takes what profile_model() returns, not "
                        f"{type(profiled).__name__}; for a Plan use replan(plan, budget_gb=...)")
    budget = _budget_arg(budget_gb, budget_bytes)
    _check_solver_options(solver, time_limit_s)
    plan = plan_for_profile(profiled.profile, budget, profiled.inputs, profiled.structure,
                            solver=solver, time_limit_s=time_limit_s,
                            sharding=profiled.sharding,
                            host_budget_bytes=host_budget_arg(offload, host_budget_gb),
                            op_ranges=op_ranges)
    if profiled.notes:
        plan = plan.model_copy(update={"note": " ".join(filter(None, [plan.note,
                                                                      *profiled.notes]))})
    return plan


def optimize(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    budget_gb: float,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    autocast: torch.dtype | None = None,
    grad_accumulation: bool = False,
    solver: str = "auto",
    time_limit_s: float = 60.0,
    timing: str = "auto",
    device: str | None = None,
    execution: str = "auto",
    world_size: int = 1,
    sharding: str | None = None,
    shard_modules: list[str] | None = None,
    parallelize: Callable[[nn.Module, Any], Any] | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
    progress: bool = True,
    offload: bool = False,
    host_budget_gb: float | None = None,
    op_ranges: bool = True,
) -> Plan:
    """Plan which module calls to checkpoint so one training step peaks under ``budget_gb``.

    The budget covers parameters, gradients, buffers, inputs, activations, temporaries and,
    when ``optimizer`` is given, its state and its ``step()`` (1 GiB = 2**30 bytes), for one
    step run as ``loss_fn(model(*inputs)).backward()``. ``autocast`` plans mixed precision
    (e.g. ``torch.bfloat16``); called inside ``torch.autocast``, that dtype is used.
    ``time_limit_s`` bounds the solving (profiling comes on top). See
    :func:`profiles.profile` for ``timing``, ``device`` and ``execution``.

    Gradients: by default each step starts with no ``.grad`` (``zero_grad()``'s default,
    ``set_to_none=True``); ``grad_accumulation=True`` plans steps that start with every
    ``.grad`` allocated (micro-batches of gradient accumulation,
    ``zero_grad(set_to_none=False)``). The planned model warns when a step starts with
    gradients its plan did not count.

    Any state of the object plans the same training step: a plan already applied (it stays
    installed until :func:`apply` replaces it), gradients left by a backward, eval mode
    (the training step is planned; the note says so). To plan one profile at several
    budgets use :func:`profile_model` and :func:`solve`.

    Parallel training: ``parallelize=`` is the training script's own function
    ``parallelize(model, mesh)`` (``fully_shard`` with its mixed-precision and reshard
    policies, ``parallelize_module`` for tensor parallel), ``mesh_shape=(dp,)`` or
    ``(dp, tp)`` with ``mesh_dim_names``. The budget is per rank and ``example_inputs`` one
    rank's batch: the function runs on a copy of the model over a fake process group of the
    mesh's size, and that rank's real step is profiled (:mod:`profiles.parallel`). Train
    with ``apply(model, plan)`` first, then ``parallelize(model, mesh)``, as torchtitan
    orders them. ``sharding="fsdp2"`` over ``world_size`` ranks is torchtitan's FSDP2
    recipe as such a function (units: ``shard_modules``, default the model's repeated
    blocks); ``sharding="ddp"`` adds DDP's gradient buckets to the single process's step.

    ``offload=True`` also lets the plan send module calls' saved activations to host memory
    and back (:mod:`planner.offload`), within ``host_budget_gb`` (default
    ``default_host_budget_bytes``); ``plan.offloads`` and ``plan.stall_ms`` say what and
    at what cost.

    ``op_ranges=False`` checkpoints module calls only: no op range inside a forward
    (:mod:`profiles.traced`), so no module's forward is replaced by its fx trace.

    Raises:
        InfeasibleBudgetError: no schedule fits; ``.min_budget_gb`` is a budget that does.
        ProfileError: one training step of the model could not run.
    """
    budget = _budget_bytes(budget_gb)
    _check_solver_options(solver, time_limit_s)
    host_budget = host_budget_arg(offload, host_budget_gb)
    profiled = profile_model(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                             autocast=autocast, grad_accumulation=grad_accumulation,
                             timing=timing, device=device, execution=execution,
                             world_size=world_size, sharding=sharding,
                             shard_modules=shard_modules, parallelize=parallelize,
                             mesh_shape=mesh_shape, mesh_dim_names=mesh_dim_names,
                             progress=progress)
    return solve(profiled, budget_bytes=budget, solver=solver, time_limit_s=time_limit_s,
                 offload=host_budget is not None,
                 host_budget_gb=None if host_budget is None else host_budget / GIB,
                 op_ranges=op_ranges)


def default_host_budget_bytes() -> int:
    """Host memory offload may take by default: half the machine's physical memory (pinned
    pages cannot be swapped out; the rest stays for the OS, data loading and the host-side
    optimizer)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * GIB
    return total // 2


def host_budget_arg(offload: bool, host_budget_gb: float | None) -> int | None:
    """The host budget in bytes when offloading (None: no offload), checked."""
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be True or False, got {offload!r}")
    if host_budget_gb is not None and not offload:
        raise ValueError("host_budget_gb is given but offload is False; pass offload=True to "
                         "let the plan use host memory")
    if not offload:
        return None
    if host_budget_gb is None:
        return default_host_budget_bytes()
    if isinstance(host_budget_gb, bool) or not isinstance(host_budget_gb, numbers.Real) or \
            not math.isfinite(host_budget_gb) or host_budget_gb < 0:
        raise ValueError(f"host_budget_gb must be a number of GiB (2**30 bytes), 0 or more, "
                         f"got {host_budget_gb!r}")
    if host_budget_gb * GIB > MAX_BUDGET_BYTES:
        raise ValueError(f"host_budget_gb={host_budget_gb!r} is more than 2**60 bytes (1 EiB); "
                         "give a budget a host could have")
    return int(host_budget_gb * GIB)


def _check_solver_options(solver: str, time_limit_s: float) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    if isinstance(time_limit_s, bool) or not (isinstance(time_limit_s, numbers.Real)
                                              and math.isfinite(time_limit_s)
                                              and time_limit_s > 0):
        raise ValueError(f"time_limit_s must be a positive number, got {time_limit_s!r}")


def _budget_arg(budget_gb: float | None, budget_bytes: int | None) -> int:
    """Exactly one of ``budget_gb`` and ``budget_bytes``, checked, as bytes."""
    if (budget_gb is None) == (budget_bytes is None):
        raise TypeError("give budget_gb or budget_bytes")
    if budget_bytes is None:
        return _budget_bytes(budget_gb)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
    return _checked_budget(int(budget_bytes), f"budget_bytes={budget_bytes!r}")


@contextlib.contextmanager
def _plan_suspended(model: nn.Module) -> Iterator[bool]:
    """Take a plan already applied off ``model`` (its checkpoints, offload hooks and guard)
    and put the same objects back after: profiling sees the model as it runs without a
    plan, and the old plan stays installed until ``apply`` replaces it. Yields whether
    there was one."""
    wrappers = checkpointed_modules(model)
    guards = [model._forward_pre_hooks[key] for key in _guards(model)]
    if not wrappers and not guards and not offloaded_modules(model):
        yield False
        return
    hooks = _hook_tables(model)
    with suspended_offload(model):
        remove(model)
        try:
            yield True
        finally:
            _put_back(wrappers, guards, hooks)


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _hook_tables(model: nn.Module) -> list[tuple[dict, list[tuple[Any, Any]]]]:
    """Every forward-hook table of the model's modules with its entries, in order."""
    return [(table, list(table.items())) for module in model.modules()
            for table in (getattr(module, name, None) for name in _HOOK_TABLES)
            if table is not None]


def _put_back(wrappers: dict[str, Any], guards: list[PlanGuard],
              hooks: list[tuple[dict, list[tuple[Any, Any]]]]) -> None:
    """The checkpoints and guard `_plan_suspended` took off, each hook under its own key
    and in its own place (re-registering would give it another key)."""
    for wrapper in wrappers.values():
        wrapper.module.forward = wrapper
    for table, entries in hooks:
        table.clear()
        table.update(entries)
    for guard in guards:
        for config in guard.restore_use_cache:
            config.use_cache = False


@contextlib.contextmanager
def _training_mode(model: nn.Module) -> Iterator[bool]:
    """The model in ``train()`` mode while profiling when it is in ``eval()`` (planning
    the eval step would leave out dropout's masks); each module's own mode is put back.
    A model in training mode is left as it is (a frozen submodule may be in eval on
    purpose). Yields whether it was in eval mode."""
    if model.training:
        yield False
        return
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield True
    finally:
        for module, training in modes:
            module.training = training


def _as_inputs(args: tuple, kwargs: dict) -> Any:
    if kwargs and args:
        raise ValueError("example_inputs mixes positional and keyword inputs; pass a tuple or "
                         "a dict")
    return kwargs if kwargs else args


def _report(solution: Solution) -> SolverReport:
    space = str(solution.space) if solution.space is not None else ""
    return SolverReport(name=solution.solver, status=solution.status.value,
                        objective_ms=solution.objective_ms, bound_ms=solution.bound_ms,
                        gap=solution.gap, solve_time_s=solution.solve_time_s, space=space)


def plan_for_profile(prof: GraphProfile, budget_bytes: int, inputs: list[InputSpec],
                     structure: str, *, solver: str = "auto", time_limit_s: float = 60.0,
                     sharding: Sharding | None = None,
                     host_budget_bytes: int | None = None, op_ranges: bool = True) -> Plan:
    """The solving half of :func:`optimize`, for a profile already taken;
    ``host_budget_bytes``: offload within it (None: no offload); ``op_ranges``: as in
    :func:`optimize`."""
    started = time.perf_counter()
    problem = rank_problem(problem_from_profile(prof, op_ranges=op_ranges),
                           sharding)
    unplanned = simulate(problem, Schedule.store_all(problem.n_nodes))
    if unplanned.peak_bytes <= budget_bytes:
        report = SolverReport(name="none", status=Status.OPTIMAL.value, objective_ms=0.0,
                              bound_ms=0.0, gap=0.0, solve_time_s=0.0,
                              space="every schedule (nothing is recomputed)")
        note = (f"No checkpointing needed: the unplanned step peaks at "
                f"{format_bytes(unplanned.peak_bytes)}, within the budget.")
        log.debug(note)  # the plan says it (summary, note); the CLI logs at INFO
        return _make_plan(prof, Schedule.store_all(problem.n_nodes), budget_bytes, report,
                          inputs, structure, note, sharding, problem,
                          host_budget_bytes)
    log.info("solving with %s: %d nodes, %d module calls, budget %s", solver, problem.n_nodes,
             len(problem.module_spans or ()), format_bytes(budget_bytes))
    # the solvers stop a little after their limit (CP-SAT's last model, the final replay),
    # and building the problem has taken time already: the solver gets what is left less a
    # margin, so that time_limit_s holds for the whole call (a conformance run once took
    # 20.05 s of 20 when only the margin was taken off)
    margin = min(0.5, max(0.05, 0.05 * time_limit_s), 0.5 * time_limit_s)
    left = max(0.05, time_limit_s - margin - (time.perf_counter() - started))
    # the optimizer step after the backward peaks the same under every schedule: a budget
    # below it is infeasible whatever the solvers find for forward and backward
    if optimizer_step_peak(problem) <= budget_bytes:
        solution = _solve(problem, budget_bytes, left, solver, host_budget_bytes)
    else:
        solution = Solution(solver=solver, status=Status.INFEASIBLE, schedule=None,
                            budget_bytes=budget_bytes, objective_ms=None)
    if not solution.feasible or solution.schedule is None:
        left = max(0.05, time_limit_s - margin - (time.perf_counter() - started))
        lowest = lowest_peak(problem, left)
        if lowest.schedule is None or lowest.peak_bytes is None:
            raise RuntimeError(f"no schedule of {prof.model_name} could be simulated")
        if lowest.peak_bytes > budget_bytes:
            at_minimum = _make_plan(prof, lowest.schedule, lowest.peak_bytes,
                                    _report(lowest), inputs, structure, sharding=sharding,
                                    problem=problem)
            raise _infeasible(prof, problem, budget_bytes, lowest, at_minimum,
                              host_budget_bytes)
        solution = lowest  # the solver missed a schedule that fits
    return _make_plan(prof, solution.schedule, budget_bytes, _report(solution), inputs,
                      structure, sharding=sharding, problem=problem,
                      host_budget_bytes=host_budget_bytes)


def _offloads_keeps(schedule: Schedule) -> bool:
    """Whether a checkpoint that keeps outputs runs inside an offloaded call."""
    return any(o.start <= r.start and r.stop <= o.stop for o in schedule.offloads
               for r in schedule.regions if r.is_recompute and r.keep)


def _solve(problem: Problem, budget_bytes: int, time_limit_s: float, solver: str,
           host_budget_bytes: int | None) -> Solution:
    """The named solver, or with offload the joint one (`solvers.joint`, the DP beneath);
    an offload plan is taken only where it adds less time than the named solver's."""
    if host_budget_bytes is None or problem.host_link is None:
        if host_budget_bytes is not None:
            log.warning("%s: no host link is known for this device (profiles.devices): "
                        "planning without offload", problem.name)
        return SOLVERS[solver](problem, budget_bytes, time_limit_s)
    started = time.perf_counter()
    plain = SOLVERS[solver](problem, budget_bytes, time_limit_s / 2)
    left = max(0.05, time_limit_s - (time.perf_counter() - started))
    # offloaded keeps need torch to route SAC's cache through saved-tensor hooks
    joint = solvers_joint.solve(problem, budget_bytes, left, host_budget_bytes=host_budget_bytes,
                                keeps_offloaded=KEEPS_THROUGH_HOOKS)
    if not joint.feasible or (plain.feasible and plain.objective_ms <= joint.objective_ms):
        return plain
    return joint


def replan(plan: Plan, budget_gb: float | None = None, *, budget_bytes: int | None = None,
           solver: str = "auto", time_limit_s: float = 60.0, offload: bool = False,
           host_budget_gb: float | None = None, op_ranges: bool = True) -> Plan:
    """A plan for the same model, inputs and precision at another budget (no profiling);
    ``offload``, ``host_budget_gb`` and ``op_ranges`` as in :func:`optimize`.

    >>> cheaper = replan(plan, budget_gb=6)  # doctest: +SKIP
    """
    budget = _budget_arg(budget_gb, budget_bytes)
    _check_solver_options(solver, time_limit_s)
    return plan_for_profile(plan.profile, budget, plan.inputs, plan.structure_fingerprint,
                            solver=solver, time_limit_s=time_limit_s, sharding=plan.sharding,
                            host_budget_bytes=host_budget_arg(offload, host_budget_gb),
                            op_ranges=op_ranges)


def plan_for_schedule(prof: GraphProfile, schedule: Schedule, inputs: list[InputSpec],
                      structure: str, budget_bytes: int | None = None,
                      sharding: Sharding | None = None) -> Plan:
    """A plan that runs ``schedule`` (regions of ``prof``'s module calls), e.g. one made by
    hand or by another tool; its numbers come from ``simulate`` like every plan's."""
    problem = rank_problem(problem_from_profile(prof), sharding)
    timeline = simulate(problem, schedule)
    report = SolverReport(name="given", status=Status.FEASIBLE.value,
                          objective_ms=timeline.recompute_time_ms, bound_ms=None, gap=None,
                          solve_time_s=0.0)
    return _make_plan(prof, schedule,
                      timeline.peak_bytes if budget_bytes is None else budget_bytes, report,
                      inputs, structure, sharding=sharding, problem=problem)


def _infeasible(prof: GraphProfile, problem: Problem, budget_bytes: int, lowest: Solution,
                at_minimum: Plan, host_budget_bytes: int | None = None
                ) -> InfeasibleBudgetError:
    """The error for a budget no schedule met: the lowest peak of any schedule found (a
    budget that yields a plan, carried as ``.plan``) and, when proven, the bound no schedule
    goes below."""
    peak = at_minimum.predicted_peak_bytes
    floor = optimizer_step_peak(problem)
    bound = lowest.min_feasible_budget_bytes
    proof = ""
    if lowest.least_peak_bytes is not None and lowest.least_peak_space is not None:
        least, space = lowest.least_peak_bytes, lowest.least_peak_space
        proof = (f" It is the least peak of {space} (proven by CP-SAT)." if least == peak else
                 f" No plan of {space} peaks below {format_bytes(least)} (proven by CP-SAT).")
    if bound is not None and bound < peak:
        what = ("the optimizer's step" if bound == floor else
                "static memory plus the largest working set of one op")
        proof += (f" No schedule at all can peak below {format_bytes(bound)} ({what})"
                  + ("." if proof else "; plans between the two may exist that the solvers "
                     "did not find."))
    if floor and floor >= peak:
        proof += (f" It is the peak of the optimizer's step ({format_bytes(floor)}), the same "
                  "under every schedule: checkpointing cannot lower it.")
    return InfeasibleBudgetError(
        f"No checkpointing plan of {prof.model_name} fits {format_bytes(budget_bytes)}: the "
        f"lowest peak found is {format_bytes(peak, round_up=True)} ({peak} bytes, by "
        f"{lowest.solver}); that plan is error.plan, and optimize(..., "
        "budget_gb=error.min_budget_gb) returns it."
        f"{proof} Static memory alone (parameters, gradients, buffers, inputs, optimizer "
        f"state{', per rank' if at_minimum.sharding else ''}) is "
        f"{format_bytes(problem.static_bytes + sum(problem.param_grad_bytes))}."
        f"{_offload_hint(problem, host_budget_bytes)} Raise the "
        "budget, shrink the batch, use autocast=torch.bfloat16, or shard parameters and "
        "optimizer state.",
        peak, bound if bound is not None and bound <= peak else None, at_minimum)


def _offload_hint(problem: Problem, host_budget_bytes: int | None) -> str:
    """What offload could and could not do for an infeasible budget."""
    if problem.host_link is None:
        return ""
    if host_budget_bytes is None:  # on a CPU, "host" is the same memory: nothing to say
        return ("" if problem.host_link.synchronous else " offload=True may reach lower, "
                "moving saved activations to host memory.")
    chain = solvers_joint.offload_chain(problem)
    if not chain:
        return " Offload found no module call to move here."
    everything = solvers_joint.moved_bytes(problem, chain)
    if everything > host_budget_bytes:
        return (f" Offload was held back by the host budget ({format_bytes(host_budget_bytes)}"
                f"): offloading every candidate call would take "
                f"{format_bytes(everything, round_up=True)} of host memory; raise "
                "host_budget_gb.")
    return (f" Offloading every candidate call ({format_bytes(everything, round_up=True)} to "
            "host memory) does not reach it either.")


def _module_call_targets(profile: GraphProfile) -> dict[tuple[int, int], ModuleCall | OpRange]:
    """What each span of the profile checkpoints: the first (outermost) module call where
    several modules ran the same nodes (a wrapper and the module it wraps), else the op
    range of a traced forward."""
    targets: dict[tuple[int, int], ModuleCall | OpRange] = {}
    for call in profile.module_calls:
        targets.setdefault((call.start, call.stop), ModuleCall(path=call.path))
    for span, target in op_range_targets(profile).items():
        targets.setdefault(span, target)
    return targets


def _make_plan(profile: GraphProfile, schedule: Schedule, budget_bytes: int,
               report: SolverReport, inputs: list[InputSpec], structure: str,
               note: str = "", sharding: Sharding | None = None,
               problem: Problem | None = None, host_budget_bytes: int | None = None) -> Plan:
    """The plan of ``schedule``; each checkpoint's target is the module call of its span.
    ``problem``: the plan's own (``rank_problem`` of the profile), when already built."""
    targets = _module_call_targets(profile)
    missing = [r for r in [*schedule.recompute_regions(), *schedule.offloads]
               if (r.start, r.stop) not in targets]
    if missing:
        raise ValueError(f"the schedule checkpoints nodes [{missing[0].start}, "
                         f"{missing[0].stop}), which no module call or traced op range of "
                         "the profile ran")
    plan = Plan(structure_fingerprint=structure, budget_bytes=budget_bytes, note=note,
                solver=report, schedule=schedule.with_targets(targets), inputs=inputs,
                profile=profile, sharding=sharding, host_budget_bytes=host_budget_bytes)
    return plan.reusing(problem) if problem is not None else plan


# ----------------------------------------------------------------------------- apply


def region_specs(plan: Plan, strict: bool = False) -> list[RegionSpec]:
    """What to install on each checkpointed module: kept ops by (op, occurrence in the
    module's forward), the ops the forward is expected to run, buffers to restore."""
    nodes = plan.profile.nodes
    out = []
    for region in plan.schedule.recompute_regions():  # pre-order: outer before nested
        target = region.target
        path = target.path
        counter: Counter[str] = Counter()
        keep_ops = set()
        for k in range(region.start, region.stop):
            node = nodes[k]
            if node.target in _SAC_UNSEEN:  # never shown to a SAC policy
                continue
            if region.saves.get(k) is Save.KEEP:
                keep_ops.add((node.target, counter[node.target]))
            counter[node.target] += 1
        prefix = f"{path}." if path else ""
        ranged = isinstance(target, OpRange)
        out.append(RegionSpec(path, frozenset(keep_ops),
                              tuple(b.removeprefix(prefix)
                                    for b in _mutated_buffers(plan.profile, region)),
                              tuple(sorted(counter.items())), strict,
                              autocast_dtype=plan.autocast_dtype,
                              first=target.first if ranged else "",
                              last=target.last if ranged else ""))
    return out


def _mutated_buffers(profile: GraphProfile, region: Region) -> list[str]:
    """Buffers a region's rerun would update again: its module call's, or for an op range
    those of every call inside it and of its own ops."""
    a, b, target = region.start, region.stop, region.target
    if isinstance(target, ModuleCall):
        call = next((c for c in profile.module_calls
                     if (c.start, c.stop, c.path) == (a, b, target.path)), None)
        if call is None:
            raise PlanMismatchError(
                f"the plan checkpoints module {target.path!r} over nodes [{a}, {b}), which its "
                "profile never ran as one call of that module (an edited plan?). Run "
                "planner.optimize() again.")
        return call.mutated_buffers
    found = {name for c in profile.module_calls if a <= c.start and c.stop <= b
             for name in c.mutated_buffers}
    found |= {name for node in profile.nodes[a:b] for name in node.mutated_buffers}
    return sorted(found)


_SAC_UNSEEN = frozenset(str(op) for op in SAC_IGNORED_OPS)


def _guards(model: nn.Module) -> list[int]:
    return [key for key, hook in model._forward_pre_hooks.items()
            if isinstance(hook, PlanGuard)]


def apply(model: nn.Module, plan: Plan, *, strict: bool = False) -> nn.Module:
    """Checkpoint ``model``'s own modules as ``plan`` says, and return ``model``.

    The model keeps its class, module tree, parameters and ``state_dict``; compose it with
    autocast, FSDP2 (``fully_shard`` its blocks after this), DDP and ``torch.compile`` as
    usual. A guard (:class:`planner.guard.PlanGuard`) warns (``strict``: raises
    ``PlanMismatchError``) when a training step is not the one planned: larger inputs,
    other input dtypes or values, another autocast dtype, a changed model.
    :func:`remove` undoes it.

    A refused plan changes nothing: every check runs, and every traced forward is traced,
    before the plan already on the model (if any) is taken off.

    Raises:
        PlanMismatchError: the model's module tree or parameter shapes differ from the
            planned model's, or the plan names modules or ranges the model lacks.
    """
    _refuse_existing_checkpointing(model)
    actual = structure_fingerprint(model)
    if actual != plan.structure_fingerprint:
        raise PlanMismatchError(
            f"This plan was made for a {plan.model_name} with structure fingerprint "
            f"{plan.structure_fingerprint}, but this {type(model).__name__} has {actual}: its "
            "module tree, parameter or buffer shapes or dtypes differ. Run planner.optimize() "
            "on this model (apply the plan before sharding it with FSDP2).")
    _check_world_size(plan)
    offloaded = [o.target.path for o in plan.schedule.offloads]
    prefetch = [o.prefetch_target.path if o.prefetch_target else None
                for o in plan.schedule.offloads]
    missing = [path for path in offloaded + [p for p in prefetch if p is not None]
               if not _has_submodule(model, path)]
    if missing:
        raise PlanMismatchError(f"the plan offloads modules {missing[:3]} that "
                                f"{type(model).__name__} does not have")
    if not KEEPS_THROUGH_HOOKS and _offloads_keeps(plan.schedule):
        raise PlanMismatchError(
            f"the plan moves outputs its checkpoints keep to host memory, which needs torch "
            f">= 2.14 (checkpoint's respect_saved_tensors_hooks); this is torch "
            f"{torch.__version__}. Upgrade torch, or plan again here (optimize(..., "
            "offload=True) plans without it on this torch).")
    installation = prepare_checkpoints(model, region_specs(plan, strict))
    # nothing has changed so far; from here on the new plan replaces the old
    remove(model)
    installation.install()
    if offloaded:
        install_offload(model, offloaded, prefetch)
    configs = _cached_configs(model)
    if configs:
        log.info("%s: setting config.use_cache=False for training with checkpoints (a rerun "
                 "would find the cache already filled); planner.remove() restores it",
                 type(model).__name__)
        for config in configs:
            config.use_cache = False
    guard = PlanGuard(plan, model, _model_device(model).type, strict, configs,
                      checkpointed_modules(model))
    model.register_forward_pre_hook(guard, with_kwargs=True, prepend=True)
    return model


def _check_world_size(plan: Plan) -> None:
    """A per-rank plan holds for the world it was made for, a single-process plan for one
    process (under DDP or FSDP each rank also holds buckets or gathered parameters)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    parallel = plan.profile.parallel
    planned = parallel.world_size if parallel else \
        plan.sharding.world_size if plan.sharding else 1
    if world != planned:
        how = parallel.describe() if parallel else f"for {plan.sharding.kind} over " \
            f"{planned} ranks" if plan.sharding else "for one process"
        raise PlanMismatchError(
            f"This plan of {plan.model_name} is {how}, but this process group has "
            f"{world} ranks. Plan with optimize(..., parallelize=your_parallelize, "
            f"mesh_shape=...) for {world} ranks (or world_size={world}, sharding='ddp').")


def _has_submodule(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def remove(model: nn.Module) -> nn.Module:
    """Take a plan off ``model`` (checkpoints, offload hooks and guard); returns ``model``."""
    for key in _guards(model):
        guard = model._forward_pre_hooks.pop(key)
        model._forward_pre_hooks_with_kwargs.pop(key, None)
        for config in guard.restore_use_cache:
            config.use_cache = True
    remove_checkpoints(model)
    remove_offload(model)
    return model


# ----------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyReport:
    """Measured against predicted, for one training step."""

    device: str
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    unplanned_peak_bytes: int
    step_ms: float
    unplanned_step_ms: float
    losses_equal: bool
    grads_equal: bool

    @property
    def peak_error(self) -> float:
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def within_budget(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def overhead(self) -> float:
        return self.step_ms / self.unplanned_step_ms - 1.0

    def summary(self) -> str:
        return (f"measured peak {format_bytes(self.measured_peak_bytes)} vs predicted "
                f"{format_bytes(self.predicted_peak_bytes)} ({100 * self.peak_error:+.2f} %), "
                f"budget {format_bytes(self.budget_bytes)} "
                f"({'met' if self.within_budget else 'EXCEEDED'}); unplanned "
                f"{format_bytes(self.unplanned_peak_bytes)}; step {self.step_ms:.1f} ms vs "
                f"{self.unplanned_step_ms:.1f} ms ({100 * self.overhead:+.1f} %); losses "
                f"{'equal' if self.losses_equal else 'DIFFER'}, gradients "
                f"{'bit-identical' if self.grads_equal else 'DIFFER'}")


def _autocast(device_type: str, dtype: str | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, dtype))


def measure_step(module: nn.Module, args: tuple, kwargs: dict,
                 loss_fn: Callable[[Any], torch.Tensor],
                 autocast_dtype: str | None = None, *,
                 grads_at_start: bool = False) -> tuple[int, torch.Tensor, dict]:
    """Peak allocated bytes of one training step (the CUDA allocator, or on CPU
    :class:`planner.measure.PeakTracker`), the loss and the gradients. The step starts
    with no ``.grad``, or (``grads_at_start``) as a later micro-batch of gradient
    accumulation does: with the gradients one backward before it left, zeroed, laid out
    as that backward laid them out (AccumulateGrad keeps an incoming gradient, a slice of
    a larger one included); that backward's random draws and buffer updates are undone.
    Gradients are cleared afterwards."""
    device = _model_device(module)
    module.zero_grad(set_to_none=True)
    if grads_at_start:
        buffers = [b.detach().clone() for b in module.buffers()]
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with _autocast(device.type, autocast_dtype):
                loss = loss_fn(module(*args, **kwargs))
            loss.backward()
        del loss
        with torch.no_grad():
            for buffer, before in zip(module.buffers(), buffers, strict=True):
                buffer.copy_(before)
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.zero_()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        with _autocast(device.type, autocast_dtype):
            loss = loss_fn(module(*args, **kwargs))
        loss.backward()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        from planner.measure import PeakTracker

        static = [*module.parameters(), *module.buffers(),
                  *(p.grad for p in module.parameters() if p.grad is not None),
                  *[t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]]
        with PeakTracker(static) as tracker:
            with _autocast(device.type, autocast_dtype):
                loss = loss_fn(module(*args, **kwargs))
            loss.backward()
        peak = tracker.peak_bytes
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()
             if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return peak, loss.detach(), grads


def _time_step(module: nn.Module, args: tuple, kwargs: dict,
               loss_fn: Callable[[Any], torch.Tensor], repeats: int,
               autocast_dtype: str | None) -> float:
    device = _model_device(module)
    samples = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        with _autocast(device.type, autocast_dtype):
            loss = loss_fn(module(*args, **kwargs))
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            samples.append((time.perf_counter() - begin) * 1e3)
        module.zero_grad(set_to_none=True)
    return statistics.median(samples)


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Yields a function that puts the model's state and the RNG back as they were."""
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    rng = torch.get_rng_state()

    def restore() -> None:
        with torch.no_grad():
            for key, value in model.state_dict(keep_vars=True).items():
                value.copy_(state[key])
        torch.set_rng_state(rng)

    try:
        yield restore
    finally:
        restore()


@contextlib.contextmanager
def _grads_kept(model: nn.Module) -> Iterator[None]:
    """The user's ``.grad`` set aside, and put back after."""
    params = list(model.parameters())
    kept = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, grad in zip(params, kept, strict=True):
            p.grad = grad


def verify(model: nn.Module, plan: Plan, example_inputs: Any = None,
           loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
           repeats: int = 3) -> VerifyReport:
    """Run one step of the model without and with the plan; compare with the plan.

    Both steps start from the same state (parameters, buffers such as BatchNorm statistics,
    RNG); the model is left as it was given (planned or not) and in the state it had.

    Raises:
        ValueError: a per-rank plan (``parallelize=``): one process cannot run a rank's
            step; measure on each rank (``benchmarks/distributed.py`` shows how).
    """
    if plan.profile.parallel is not None:
        raise ValueError(
            f"this plan is {plan.profile.parallel.describe()}: verify() runs one process's "
            "step, not a rank's. Measure each rank's step where it trains (PeakTracker with "
            "follow_resizes=True on CPU, torch.cuda.max_memory_allocated on a GPU), as "
            "benchmarks/distributed.py does")
    args, kwargs = normalize_inputs(model, example_inputs)
    loss_fn = loss_fn or profiles.default_loss
    was_planned = bool(checkpointed_modules(model) or _guards(model) or offloaded_modules(model))
    dtype = plan.autocast_dtype
    accumulate = plan.profile.static.grads_at_start
    with _state_kept(model) as restore, _grads_kept(model), warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanMismatchWarning)
        remove(model)
        with _training_config(model):
            _, base_loss, base_grads = measure_step(model, args, kwargs, loss_fn, dtype,
                                                    grads_at_start=accumulate)
            restore()
            unplanned_ms = _time_step(model, args, kwargs, loss_fn, repeats, dtype)
            restore()
        apply(model, plan)
        peak, loss, grads = measure_step(model, args, kwargs, loss_fn, dtype,
                                         grads_at_start=accumulate)
        restore()
        step_ms = _time_step(model, args, kwargs, loss_fn, repeats, dtype)
        if not was_planned:
            remove(model)
    device = _model_device(model)
    return VerifyReport(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        budget_bytes=plan.budget_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_peak_bytes=peak,
        unplanned_peak_bytes=plan.unplanned_peak_bytes,
        step_ms=step_ms,
        unplanned_step_ms=unplanned_ms,
        losses_equal=bool(torch.equal(loss, base_loss)),
        grads_equal=base_grads.keys() == grads.keys()
        and all(torch.equal(base_grads[k], grads[k]) for k in grads),
    )
