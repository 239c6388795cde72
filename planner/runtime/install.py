"""apply / remove: install a plan on the model's own modules (checkpoints, offload hooks,
the guard; for a compiled plan the partitioner's budget it was measured under), take it
off, and set it aside while the model is profiled again."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS

from planner.model_state import (
    _cached_configs,
    _model_device,
    _refuse_existing_checkpointing,
    structure_fingerprint,
)
from planner.plan import Plan, PlanMismatchError, PlanMismatchWarning
from planner.runtime.emit import (
    Installation,
    RegionSpec,
    checkpointed_modules,
    prepare_checkpoints,
    remove_checkpoints,
)
from planner.runtime.guard import PlanGuard
from planner.runtime.offload import (
    KEEPS_THROUGH_HOOKS,
    install_offload,
    offloaded_modules,
    remove_offload,
    suspended_offload,
)
from planner.runtime.partitioner import set_partitioner_budget
from profiles.schema import GraphProfile
from solvers import Decision, ModuleCall, OpRange, Problem, Region, Schedule
from solvers.frame import region_skips

log = logging.getLogger(__name__)


_SAC_UNSEEN = frozenset(str(op) for op in SAC_IGNORED_OPS)


def region_specs(plan: Plan, strict: bool = False) -> list[RegionSpec]:
    """What to install on each checkpointed module: the decisions of the ops it does not
    recompute, by (op, occurrence in the module's forward), the ops the forward is expected
    to run, buffers to restore."""
    return schedule_specs(plan.profile, plan.schedule, plan.autocast_dtype, strict,
                          plan.problem())


def schedule_specs(profile: GraphProfile, schedule: Schedule, autocast_dtype: str | None,
                   strict: bool = False, problem: Problem | None = None) -> list[RegionSpec]:
    """`region_specs` of ``schedule`` (its regions' targets set) on ``profile``; with the
    ``problem`` it was planned on, the ops each top-level region's rerun skips (F9)."""
    nodes = profile.nodes
    top = {id(r) for r in schedule.regions}
    out = []
    for region in schedule.recompute_regions():  # pre-order: outer before nested
        target = region.target
        path = target.path
        skips = region_skips(problem, region) if problem is not None and id(region) in top \
            else frozenset()
        counter: Counter[str] = Counter()
        rerun: Counter[str] = Counter()  # the ops of each name the rerun recomputes
        saved_ops: dict[tuple[str, int], Decision] = {}
        skipped_ops: set[tuple[str, int]] = set()
        for k in range(region.start, region.stop):
            node = nodes[k]
            if node.target in _SAC_UNSEEN:  # never shown to a SAC policy
                continue
            if k in region.saves:
                saved_ops[(node.target, counter[node.target])] = region.saves[k]
            else:
                if k in skips:
                    skipped_ops.add((node.target, rerun[node.target]))
                rerun[node.target] += 1
            counter[node.target] += 1
        prefix = f"{path}." if path else ""
        ranged = isinstance(target, OpRange)
        out.append(RegionSpec(path, saved_ops,
                              tuple(b.removeprefix(prefix)
                                    for b in _mutated_buffers(profile, region)),
                              tuple(sorted(counter.items())), strict,
                              autocast_dtype=autocast_dtype,
                              first=target.first if ranged else "",
                              last=target.last if ranged else "",
                              skipped_ops=frozenset(skipped_ops)))
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


def _guards(model: nn.Module) -> list[int]:
    return [key for key, hook in model._forward_pre_hooks.items()
            if isinstance(hook, PlanGuard)]


def apply_plan(model: nn.Module, plan: Plan, *, strict: bool = False) -> nn.Module:
    """`planner.apply` of one plan (a table's plans: `planner.runtime.table_install`)."""
    installation = prepared(model, plan, strict)
    # nothing has changed so far; from here on the new plan replaces the old
    remove(model)
    installation.install()
    offloads = plan.schedule.offloads
    if offloads:
        install_offload(model, [o.target.path for o in offloads],
                        [o.prefetch_target.path if o.prefetch_target else None
                         for o in offloads],
                        [o.release_target.path if o.release_target else None
                         for o in offloads])
    configs = use_cache_off(model)
    guard = PlanGuard(plan, model, _model_device(model).type, strict, configs,
                      checkpointed_modules(model))
    model.register_forward_pre_hook(guard, with_kwargs=True, prepend=True)
    if guard.partitioner_budget is not None:
        guard.restore_partitioner_budget = set_partitioner_budget(guard.partitioner_budget)
    return model


def use_cache_off(model: nn.Module) -> list[Any]:
    """Turn off the model's configs' ``use_cache`` (returns them, for :func:`remove`)."""
    configs = _cached_configs(model)
    if configs:
        log.info("%s: setting config.use_cache=False for training with checkpoints (a rerun "
                 "would find the cache already filled); planner.remove() restores it",
                 type(model).__name__)
        for config in configs:
            config.use_cache = False
    return configs


def prepared(model: nn.Module, plan: Plan, strict: bool) -> Installation:
    """``plan``'s checkpoints checked and traced against ``model``, not yet installed."""
    _refuse_existing_checkpointing(model)
    actual = structure_fingerprint(model)
    if actual != plan.structure_fingerprint:
        raise PlanMismatchError(
            f"This plan was made for a {plan.model_name} with structure fingerprint "
            f"{plan.structure_fingerprint}, but this {type(model).__name__} has {actual}: its "
            "module tree, parameter or buffer shapes or dtypes differ. Run planner.optimize() "
            "on this model (apply the plan before sharding it with FSDP2).")
    try:
        plan.check()  # an edited plan: a schedule its profile did not run, a lowered budget
    except ValueError as error:
        raise PlanMismatchError(f"this plan of {plan.model_name} does not hold together: "
                                f"{error}") from None
    _check_world_size(plan)
    offloads = plan.schedule.offloads
    named = [o.target.path for o in offloads] + [
        target.path for o in offloads for target in (o.prefetch_target, o.release_target)
        if target is not None]
    missing = [path for path in named if not _has_submodule(model, path)]
    if missing:
        raise PlanMismatchError(f"the plan offloads modules {missing[:3]} that "
                                f"{type(model).__name__} does not have")
    if not KEEPS_THROUGH_HOOKS and _offloads_keeps(plan.schedule):
        raise PlanMismatchError(
            f"the plan moves outputs its checkpoints keep to host memory, which needs torch "
            f">= 2.14 (checkpoint's respect_saved_tensors_hooks); this is torch "
            f"{torch.__version__}. Upgrade torch, or plan again here (optimize(..., "
            "offload=True) plans without it on this torch).")
    return prepare_checkpoints(model, region_specs(plan, strict))


def _offloads_keeps(schedule: Schedule) -> bool:
    """Whether a checkpoint moves outputs it saves to the host (`Region.offloaded`; only a
    top-level one inside an offloaded call can)."""
    return any(r.offloaded() for r in schedule.regions)


def _check_world_size(plan: Plan) -> None:
    """A per-rank plan holds for the world it was made for, a single-process plan for one
    process (under DDP or FSDP each rank also holds buckets or gathered parameters)."""
    import torch.distributed as dist

    stage = plan.pipeline.spec if plan.pipeline else None
    if not (dist.is_available() and dist.is_initialized()):
        if stage is not None:
            warnings.warn(
                f"This plan of {plan.model_name} is for stage {stage.stage_index} of a "
                f"{stage.num_stages}-stage pipeline ({stage.schedule}, {stage.n_microbatches} "
                "microbatches): its budget holds for that stage under that schedule, and its "
                "numbers are one microbatch's. No process group runs here, so nothing checks "
                "that this model is trained as that stage.", PlanMismatchWarning, stacklevel=3)
        return
    world = dist.get_world_size()
    if stage is not None:  # one stage per rank of the pipeline's dimension
        if world % stage.num_stages:
            raise PlanMismatchError(
                f"This plan of {plan.model_name} is for stage {stage.stage_index} of a "
                f"{stage.num_stages}-stage pipeline, but this process group has {world} "
                "ranks, not a multiple of the stages. Plan the stages of this pipeline.")
        return
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
        # a table's guard, or one pickled before it, has set no partitioner budget
        restore_budget = getattr(guard, "restore_partitioner_budget", None)
        if restore_budget is not None:
            set_partitioner_budget(restore_budget)
    remove_checkpoints(model)
    remove_offload(model)
    return model


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
        if getattr(guard, "restore_partitioner_budget", None) is not None:
            set_partitioner_budget(guard.partitioner_budget)
