"""Rewrite a captured graph so each RECOMPUTE region runs under non-reentrant checkpoint.

A region's compute nodes are outlined into their own GraphModule and called through
``torch.utils.checkpoint.checkpoint(region, *inputs, use_reentrant=False)``. Kept nodes
(selective checkpointing) are saved with a SAC policy: the policy sees aten ops, not fx
nodes, so each kept node is named by the ops that allocate its outputs, as (op, occurrence
of that op within the region) pairs from the profile.

The region modules are held by plain (non-Module) wrappers, so the rewritten module's
``state_dict()``, ``parameters()`` and ``named_modules()`` are the original model's.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from profiles.schema import GraphProfile
from solvers.schedule import Region, Schedule

HOISTED_OPS = ("placeholder", "get_attr", "output")


class RewriteError(ValueError):
    """The schedule cannot be emitted for this graph."""


@dataclass(eq=False)
class CheckpointedRegion:
    """One RECOMPUTE region: its outlined graph and the aten op calls to keep."""

    module: torch.fx.GraphModule
    keep_ops: frozenset[tuple[str, int]]  # (op name, occurrence in the region's forward)
    name: str
    restored_buffers: tuple[str, ...] = ()  # updated in forward (BatchNorm): not on rerun

    def body(self) -> Any:
        """The function checkpoint calls: the region, but on a rerun the buffers it updates
        (BatchNorm running statistics) are put back, so recomputing changes no state."""
        if not self.restored_buffers:
            return self.module
        calls = 0

        def run(*inputs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return self.module(*inputs)
            buffers = [self.module.get_buffer(name) for name in self.restored_buffers]
            # outside the dispatch modes: SAC's replay must see only the region's own ops
            with _disable_current_modes(), torch.no_grad():
                before = [b.clone() for b in buffers]
            try:
                return self.module(*inputs)
            finally:  # also when early stop interrupts the rerun
                with _disable_current_modes(), torch.no_grad():
                    for buffer, value in zip(buffers, before, strict=True):
                        buffer.copy_(value)

        return run

    def context_fn(self) -> Any:
        """Fresh SAC contexts per checkpoint call: counting restarts for every (re)run."""
        counters: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            counter = counters[ctx.is_recompute]
            name = str(func)
            occurrence = counter[name]
            counter[name] += 1
            if (name, occurrence) in self.keep_ops:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    def __repr__(self) -> str:
        return f"CheckpointedRegion({self.name}, keep {len(self.keep_ops)} ops)"


def run_region(region: CheckpointedRegion, *inputs: Any) -> Any:
    """Called from the rewritten graph: checkpoint the region when autograd records."""
    if not torch.is_grad_enabled():
        return region.module(*inputs)
    if region.keep_ops:
        return checkpoint(region.body(), *inputs, use_reentrant=False,
                          context_fn=region.context_fn)
    return checkpoint(region.body(), *inputs, use_reentrant=False)


def _keep_ops(profile: GraphProfile, region: Region) -> frozenset[tuple[str, int]]:
    """Name the kept nodes' output-allocating ops by their occurrence in the region."""
    for index in region.keep:
        if not profile.nodes[index].keepable:
            raise RewriteError(
                f"node {profile.nodes[index].name!r} cannot be kept by selective "
                "checkpointing: an in-place op finishes one of its outputs (a dropout mask), "
                "and in-place ops cannot be replayed from SAC's cache")
        saved = set(profile.nodes[index].new_storages)
        for later in range(index + 1, region.stop):
            if saved & set(profile.nodes[later].written_storages):
                raise RewriteError(
                    f"kept node {profile.nodes[index].name!r} has its output mutated in place "
                    f"by {profile.nodes[later].name!r} later in the region; selective "
                    "checkpointing cannot cache it. Plan without keeping it.")
    counter: Counter[str] = Counter()
    kept: set[tuple[str, int]] = set()
    for index in range(region.start, region.stop):
        node = profile.nodes[index]
        for position, op in enumerate(node.ops):
            if index in region.keep and position in node.output_ops:
                kept.add((op, counter[op]))
            counter[op] += 1
    return frozenset(kept)


class _Outliner:
    """Builds the rewritten graph, outlining regions recursively (children nest)."""

    def __init__(self, gm: torch.fx.GraphModule, profile: GraphProfile) -> None:
        self.gm = gm
        self.profile = profile
        self.nodes = list(gm.graph.nodes)
        self.index = {node: i for i, node in enumerate(self.nodes)}
        self.regions: dict[str, CheckpointedRegion] = {}

    def emit(self, nodes: Sequence[torch.fx.Node], regions: Sequence[Region],
             graph: torch.fx.Graph, env: dict[torch.fx.Node, torch.fx.Node]) -> None:
        """Copy ``nodes`` into ``graph``, replacing each RECOMPUTE region by a call."""
        starts = {r.start: r for r in regions if r.mode == "recompute"}
        position = 0
        while position < len(nodes):
            node = nodes[position]
            region = starts.get(self.index[node])
            if region is None:
                env[node] = graph.node_copy(node, lambda n: env[n])
                position += 1
                continue
            span = [n for n in nodes[position:] if self.index[n] < region.stop]
            self._outline(span, region, graph, env)
            position += len(span)

    def _outline(self, span: list[torch.fx.Node], region: Region, graph: torch.fx.Graph,
                 env: dict[torch.fx.Node, torch.fx.Node]) -> None:
        for node in span:  # params, constants: stay outside, enter as inputs
            if node.op in HOISTED_OPS:
                if node.op != "get_attr":
                    raise RewriteError(f"region {region.start}:{region.stop} contains "
                                       f"{node.op} node {node.name!r}; graph inputs and "
                                       "outputs cannot be recomputed")
                env[node] = graph.node_copy(node, lambda n: env[n])
        inner = [n for n in span if n.op not in HOISTED_OPS]
        members = set(inner)
        inputs: list[torch.fx.Node] = []
        attributes: list[torch.fx.Node] = []
        for node in inner:
            for arg in node.all_input_nodes:
                if arg in members or arg in inputs or arg in attributes:
                    continue
                # parameters are read inside the region, not passed in: a parameter passed
                # through checkpoint gets its gradient copied at accumulation (held longer)
                (attributes if arg.op == "get_attr" else inputs).append(arg)
        outputs = [n for n in inner if any(user not in members for user in n.users)]

        sub = torch.fx.Graph()
        sub_env = {arg: sub.placeholder(arg.name) for arg in inputs}
        for attr in attributes:
            sub_env[attr] = sub.get_attr(attr.target)
        self.emit(inner, region.children, sub, sub_env)
        sub.output(tuple(sub_env[n] for n in outputs))
        name = f"_planner_region_{len(self.regions)}"
        mutated = sorted({b for n in inner for b in self.profile.nodes[self.index[n]]
                          .mutated_buffers})
        wrapper = CheckpointedRegion(torch.fx.GraphModule(self.gm, sub, class_name=name),
                                     _keep_ops(self.profile, region), name, tuple(mutated))
        self.regions[name] = wrapper
        object.__setattr__(self.gm, name, wrapper)  # plain attribute: not a submodule
        call = graph.call_function(run_region, (graph.get_attr(name),
                                                *[env[a] for a in inputs]))
        call.meta["planner"] = {"region": name}
        for position, node in enumerate(outputs):
            env[node] = graph.call_function(operator.getitem, (call, position))


def rewrite(gm: torch.fx.GraphModule, profile: GraphProfile,
            schedule: Schedule) -> torch.fx.GraphModule:
    """A new GraphModule running ``schedule`` (node indices are the profile's)."""
    nodes = list(gm.graph.nodes)
    if len(profile.nodes) != len(nodes) + 1:  # + the loss
        raise RewriteError(f"the profile has {len(profile.nodes) - 1} graph nodes but the "
                           f"graph has {len(nodes)}; profile this graph again")
    loss_index = len(nodes)
    for region in schedule.regions:
        if region.mode == "recompute" and region.stop > loss_index:
            raise RewriteError("the loss is computed outside the module and cannot be inside "
                               "a RECOMPUTE region")
    outliner = _Outliner(gm, profile)
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen  # keeps export's pytree in/out handling
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    outliner.emit(nodes, [r for r in schedule.regions if r.start < loss_index], graph, env)
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    # GraphModule copies only what the outer graph references; modules used inside regions
    # must stay registered (in the original order) for state_dict, .to() and optimizers.
    new._modules = dict(gm._modules)
    new._parameters = dict(gm._parameters)
    new._buffers = dict(gm._buffers)
    new.meta.update(gm.meta)
    return new


def region_wrappers(gm: torch.fx.GraphModule) -> list[CheckpointedRegion]:
    """The checkpointed regions of a rewritten module, in graph order."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, CheckpointedRegion):
                found.append(value)
    return found

