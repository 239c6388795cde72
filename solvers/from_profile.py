"""Build a solver `Problem` from a `profiles.GraphProfile` (pure data, no torch).

Node indices are kept one-to-one with the profile's nodes (the aten ops of the step, then
the loss pseudo-node), so a schedule's regions name profile nodes directly. Storages are the
profile's activation and internal storages, renumbered; params, buffers, inputs and
constants are static.

Module spans (`Problem.module_spans`): the calls of the model's modules that `planner.apply`
can checkpoint. A call is left out when checkpointing it would change what the step computes
or crash (`unemittable_calls` says why): a module called more than once (its checkpoint
wrapper would apply to every call), a call that runs no op, a call whose inputs are written
in place after it starts (checkpoint saves its inputs and checks their version when it
reruns: torch raises "modified by an inplace operation"), or a call that writes in place a
tensor made before it other than a buffer (the rerun would write it twice; buffers, such as
BatchNorm's running statistics, are restored after a rerun), or a call that holds part of a
custom autograd Function's call (a module its forward calls runs without autograd, so a
checkpoint there does nothing; the Function's call is one unit).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator

from profiles.devices import DEVICES
from profiles.schema import STATIC_KINDS, GraphProfile, ModuleCall, NodeProfile
from solvers.problem import (
    MATMUL_KINDS,
    HostLink,
    ModuleSpan,
    ObservedBackward,
    Problem,
    TracedCall,
)
from solvers.schedule import ModuleCall as CallTarget
from solvers.schedule import OpRange

__all__ = [
    "block_calls",
    "detect_block_prefix",
    "op_kind",
    "op_range_name",
    "problem_from_profile",
    "span_targets",
    "unemittable_calls",
]

_NEVER_RECOMPUTED = frozenset({"placeholder", "output", "loss"})
_INDEXED = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)(?:\.|$)")
_NUMBERED = re.compile(r"^(?P<stem>.*?)(?P<number>\d+)$")


def detect_block_prefix(profile: GraphProfile) -> str | None:
    """The module path of the repeated blocks (``blocks``, ``model.layers``), if any.

    The prefix before the first numeric path component that covers the most nodes and has
    at least two distinct indices.
    """
    counts: Counter[str] = Counter()
    indices: dict[str, set[int]] = {}
    for node in profile.nodes:
        match = _INDEXED.match(node.module)
        if match:
            counts[match["prefix"]] += 1
            indices.setdefault(match["prefix"], set()).add(int(match["index"]))
    candidates = [p for p, _ in counts.most_common() if len(indices[p]) >= 2]
    return candidates[0] if candidates else None


def block_calls(profile: GraphProfile, block_prefix: str | None = None) -> list[ModuleCall]:
    """The repeated blocks of the model: calls of numbered siblings of one type.

    Siblings are calls whose paths differ only in a trailing number (``h.0``, ``h.1``;
    ``denselayer1``, ``denselayer2``; ``encoder_layer_0``), each called once, each calling
    submodules of its own, all of one module type (so ConvNeXt's mixed ``features.N`` are
    not blocks but its ``CNBlock``s are). Groups with more members win; a group that
    overlaps a chosen one is dropped. ``block_prefix`` keeps only blocks under that path.
    """
    calls = profile.module_calls
    has_children = {c.parent for c in calls if c.parent is not None}
    groups: dict[tuple[str, str], list[ModuleCall]] = defaultdict(list)
    for call in calls:
        parent, _, last = call.path.rpartition(".")
        match = _NUMBERED.match(last)
        if match is None or call.calls != 1 or call.index not in has_children \
                or call.stop <= call.start:
            continue
        if block_prefix is not None and parent != block_prefix:
            continue
        groups[(parent, match["stem"])].append(call)
    usable = [g for g in groups.values()
              if len(g) >= 2 and len({c.module_type for c in g}) == 1]
    usable.sort(key=lambda g: (-len(g), -sum(c.stop - c.start for c in g)))
    chosen: list[ModuleCall] = []
    for group in usable:
        if any(c.start < o.stop and o.start < c.stop for c in group for o in chosen):
            continue
        chosen.extend(group)
    return sorted(chosen, key=lambda c: c.start)


def _skippable(nodes: list[NodeProfile], saved: list[list[int]],
               outputs: list[list[int]]) -> list[bool] | None:
    """`Problem.node_skippable`: the one-op nodes the profile says a rerun may skip, with
    no forward temporaries and not saving their own output; None where there are none
    (profiles recorded before Dec 2026)."""
    flags = [nd.skippable and len(nd.ops) == 1 and not nd.fwd_temp_bytes
             and not set(saved[i]) & set(outputs[i]) for i, nd in enumerate(nodes)]
    return flags if any(flags) else None


def op_kind(ops: list[str], fx_op: str) -> str:
    """A node's kind for op policies: its first matmul-like aten op, else its last op."""
    names = [op.split(".")[1] if op.count(".") >= 2 else op for op in ops]
    for name in names:
        if name in MATMUL_KINDS:
            return name
    return names[-1] if names else fx_op


class _Writes:
    """What the step writes in place, for the rules of `unemittable_calls`."""

    def __init__(self, profile: GraphProfile) -> None:
        nodes, storages = profile.nodes, profile.storages
        self.profile = profile
        self.last_write: dict[int, int] = {}
        for node in nodes:
            for sid in node.written_storages:
                self.last_write[sid] = node.index
        param_names = {s.name for s in storages if s.kind == "param"}
        self.state_writes = {node.index for node in nodes
                             if any(storages[s].kind in ("input", "constant")
                                    for s in node.written_storages)
                             or set(node.mutated_buffers) & param_names}

    def reason(self, a: int, b: int, inputs: Iterable[int], calls: int = 1) -> str:
        """Why nodes ``[a, b)`` holding ``inputs`` cannot be a checkpoint ('' when they can)."""
        nodes, storages = self.profile.nodes, self.profile.storages
        if b <= a:
            return "runs no op"
        if calls > 1:
            return f"called {calls} times per step"
        if any(self.last_write.get(s, -1) >= a for s in inputs):
            return "an input is written in place after the call starts"
        if any(storages[s].producer is not None and storages[s].producer < a
               and storages[s].kind not in STATIC_KINDS
               for i in range(a, b) for s in nodes[i].written_storages):
            return "writes in place a tensor made before it"
        if any(i in self.state_writes for i in range(a, b)):
            return "writes a parameter or an input in place"
        if any(nodes[i].runtime_ops_before for i in range(a + 1, b)):
            return ("the parallel runtime runs inside it (an FSDP2 unit's all-gather): a "
                    "rerun would run it again")
        cut = next((f for f in self.profile.function_calls
                    if a < f.stop and f.start < b and not (a <= f.start and f.stop <= b)), None)
        if cut is not None:
            return (f"it holds part of a call of autograd Function {cut.name} (a Function's "
                    "forward runs without autograd, and its backward is its own)")
        return ""


def unemittable_calls(profile: GraphProfile) -> dict[int, str]:
    """Module calls a plan cannot checkpoint, with the reason (see the module docstring)."""
    writes = _Writes(profile)
    reasons = {call.index: writes.reason(call.start, call.stop, call.input_storages,
                                         call.calls) for call in profile.module_calls}
    return {index: why for index, why in reasons.items() if why}


def _module_spans(profile: GraphProfile, new_id: dict[int, int],
                  op_ranges: bool = True) -> list[ModuleSpan]:
    """One span per emittable call (the outermost when several share one span), then with
    ``op_ranges`` one per emittable op range of a traced forward not already a call's."""
    reasons = unemittable_calls(profile)
    spans: dict[tuple[int, int], ModuleSpan] = {}
    for call in profile.module_calls:
        key = (call.start, call.stop)
        if call.index in reasons or key in spans:
            continue
        spans[key] = ModuleSpan(start=call.start, stop=call.stop, name=call.path,
                                inputs=tuple(sorted({new_id[s] for s in call.input_storages
                                                     if s in new_id})))
    if op_ranges:
        for _, span in _op_ranges(profile, new_id):
            spans.setdefault((span.start, span.stop), span)
    return list(spans.values())


def op_range_name(path: str, first: str, last: str) -> str:
    """How an op range of a traced forward is named in spans, plans and reports."""
    return f"{path or '<model>'}[{first}..{last}]"


def op_range_targets(profile: GraphProfile) -> dict[tuple[int, int], OpRange]:
    """The op range each ops span of ``profile`` checkpoints (`Problem.module_spans`)."""
    return {(span.start, span.stop): target for target, span in _op_ranges(profile, {})}


def span_targets(profile: GraphProfile) -> dict[tuple[int, int], CallTarget | OpRange]:
    """What each span of the profile checkpoints: the first (outermost) module call where
    several modules ran the same nodes (a wrapper and the module it wraps), else the op
    range of a traced forward."""
    targets: dict[tuple[int, int], CallTarget | OpRange] = {}
    for call in profile.module_calls:
        targets.setdefault((call.start, call.stop), CallTarget(path=call.path))
    for span, target in op_range_targets(profile).items():
        targets.setdefault(span, target)
    return targets


def _op_ranges(profile: GraphProfile, new_id: dict[int, int]
               ) -> Iterator[tuple[OpRange, ModuleSpan]]:
    """Every run of consecutive segments of a traced forward that may be a checkpoint: it
    starts and ends with a segment that runs ops and passes `_Writes.reason`."""
    writes = _Writes(profile)
    nodes, storages = profile.nodes, profile.storages
    for call in profile.module_calls:
        segments = [seg for seg in call.traced if seg.stop > seg.start]
        children = [c for c in profile.module_calls if c.parent == call.index] \
            if segments else []
        for i, first in enumerate(segments):
            for last in segments[i:]:
                a, b = first.start, last.stop
                read = {s for k in range(a, b) for s in nodes[k].read_storages}
                read |= {s for c in children if a <= c.start and c.stop <= b
                         for s in c.input_storages}
                inputs = sorted(s for s in read if storages[s].producer is None
                                or storages[s].producer < a)
                if writes.reason(a, b, inputs):
                    continue
                target = OpRange(path=call.path, first=first.first, last=last.last)
                yield target, ModuleSpan(
                    start=a, stop=b, name=op_range_name(call.path, first.first, last.last),
                    inputs=tuple(sorted(new_id[s] for s in inputs if s in new_id)),
                    kind="ops", owner=(call.start, call.stop))


def problem_from_profile(profile: GraphProfile, block_prefix: str | None = None,
                         *, detect_blocks: bool = True, module_spans: bool = True,
                         op_ranges: bool = True) -> Problem:
    """The solver's view of one training step of ``profile``.

    Args:
        profile: from ``profiles.profile``.
        block_prefix: module path of repeated blocks; default: detected (`block_calls`).
        detect_blocks: set False to leave ``block_of_node`` empty.
        module_spans: restrict regions to what `planner.apply` can emit (the default); False
            lets solvers cut the op order anywhere (to measure what the restriction costs).
        op_ranges: with module spans, also offer runs of a traced forward's segments
            (`profiles.traced`); False: module calls only.
    """
    storages = profile.storages
    nodes = profile.nodes
    activation = [s.id for s in storages if s.kind not in STATIC_KINDS]
    new_id = {sid: i for i, sid in enumerate(activation)}
    node_inputs, node_outputs, node_saved, saves_static, grad_inputs = _node_storages(
        profile, new_id)
    blocks = _blocks(profile, block_prefix) if detect_blocks else None
    static = profile.static
    accumulating = static.grads_at_start
    param_grads = _param_grad_bytes(profile)
    costs = profile.checkpoint_costs
    saved = [nd.saved_tensors for nd in nodes]
    observed = None
    if all(nd.bwd_peak_bytes is not None for nd in nodes):
        observed = ObservedBackward(
            before=[nd.bwd_live_before_bytes for nd in nodes],
            peak=[nd.bwd_peak_bytes for nd in nodes],
            after=[nd.bwd_live_after_bytes for nd in nodes],
            unpack=[nd.bwd_unpack_bytes for nd in nodes]
            if all(nd.bwd_unpack_bytes is not None for nd in nodes) else None,
            held=[nd.bwd_held_peak_bytes for nd in nodes]
            if all(nd.bwd_held_peak_bytes is not None for nd in nodes) else None)
    return Problem(
        name=profile.model_name,
        node_names=[nd.name for nd in nodes],
        fwd_time_ms=[nd.fwd_time_ms for nd in nodes],
        bwd_time_ms=[nd.bwd_time_ms for nd in nodes],
        fwd_temp_bytes=[nd.fwd_temp_bytes for nd in nodes],
        # observed backward peaks include the temporaries (and, with gradients allocated at
        # the start, the fresh gradient each parameter's .grad adds in place)
        bwd_temp_bytes=[0 if observed else nd.bwd_temp_bytes + (grads if accumulating else 0)
                        for nd, grads in zip(nodes, param_grads, strict=True)],
        # the loss runs outside the model: it is never inside a checkpoint
        recomputable=[nd.op not in _NEVER_RECOMPUTED for nd in nodes],
        node_inputs=node_inputs,
        node_outputs=node_outputs,
        node_saved=node_saved,
        storage_bytes=[storages[sid].nbytes for sid in activation],
        storage_producer=[storages[sid].producer for sid in activation],
        storage_grad_bytes=_activation_grad_bytes(profile, new_id),
        # parameter .grad is static when the step starts with it allocated; else it
        # appears during backward (param_grad_bytes)
        static_bytes=static.total_bytes - (0 if accumulating else static.grad_bytes),
        param_grad_bytes=[0] * len(nodes) if accumulating else param_grads,
        optimizer_step_bytes=static.optimizer_step_bytes,
        block_of_node=blocks,
        node_saves_static=saves_static,
        # recorded since Nov 2026 (optional field); older profiles: unknown, nodes run first
        node_packs_before_running=[nd.packs_after_running is False for nd in nodes]
        if any(nd.packs_after_running is not None for nd in nodes) else None,
        node_grad_inputs=grad_inputs,
        op_kind=[op_kind(nd.ops, nd.op) for nd in nodes],
        keepable=[nd.keepable for nd in nodes],
        node_skippable=_skippable(nodes, node_saved, node_outputs),
        # checkpoint overhead: not modelled (0) for profiles recorded without it
        checkpoint_region_ms=costs.region_ms if costs else 0.0,
        checkpoint_pack_ms=costs.pack_ms if costs else 0.0,
        checkpoint_sac_op_ms=costs.sac_op_ms if costs else 0.0,
        checkpoint_range_ms=costs.range_ms if costs else 0.0,
        checkpoint_step_ms=costs.step_ms if costs else 0.0,
        node_ops=[len(nd.ops) for nd in nodes],
        node_packed=None if None in saved else saved,
        storage_release=_releases(profile, activation, new_id),
        module_spans=_module_spans(profile, new_id, op_ranges) if module_spans else None,
        traced_calls=[TracedCall(start=c.start, stop=c.stop, children=tuple(
            (seg.start, seg.stop) for seg in c.traced if seg.child))
            for c in profile.module_calls if c.traced] if module_spans and op_ranges else None,
        observed_backward=observed,
        host_link=host_link(profile.device),
        host_overlaps_device=profile.for_gpu,
        fwd_runtime_bytes=_forward_held(profile),
    )


def _forward_held(profile: GraphProfile) -> list[int] | None:
    """What each node's first forward holds beside the activations, the same under every
    schedule: a parallel runtime's buffers, and the last step's gradients where the step
    frees them only after its forward (``StaticMemory.grads_in_forward``)."""
    grads = profile.static.grad_bytes if profile.static.grads_in_forward else 0
    if profile.parallel is None and not grads:
        return None
    runtime = profile.parallel is not None
    return [((nd.fwd_runtime_bytes or 0) if runtime else 0) + grads for nd in profile.nodes]


def host_link(device: str) -> HostLink | None:
    """The copy path to host memory of a device named in `profiles.devices` (a recorded GPU
    profile's name contains it, e.g. "NVIDIA H100 80GB HBM3"); None for an unknown device."""
    for key in sorted(DEVICES, key=len, reverse=True):
        spec = DEVICES[key]
        if key.lower() in device.lower() and spec.host_link_gbps:
            return HostLink(d2h_gbps=spec.host_link_gbps, h2d_gbps=spec.host_link_gbps,
                            synchronous=spec.host_link_synchronous,
                            source=spec.sources.get("host_link_gbps", ""))
    return None


def _activation_grad_bytes(profile: GraphProfile, new_id: dict[int, int]) -> list[int]:
    """Per activation storage, the bytes of its gradient (0 if none flows to it)."""
    storages = profile.storages
    grad_bytes = [0] * len(new_id)
    for node in profile.nodes:
        for tensor in node.outputs:
            sid = new_id.get(tensor.storage)
            if sid is not None and tensor.requires_grad and \
                    storages[tensor.storage].producer == node.index:
                grad_bytes[sid] = storages[tensor.storage].nbytes
    return grad_bytes


def _node_storages(profile: GraphProfile, new_id: dict[int, int]) -> tuple[list, ...]:
    """Per node: activation storages read, made, saved; whether it saves a static one;
    which read storages receive a gradient from it."""
    storages = profile.storages
    node_inputs, node_outputs, node_saved, saves_static, grad_inputs = [], [], [], [], []
    for node in profile.nodes:
        reads = sorted({new_id[s] for s in node.read_storages if s in new_id})
        node_inputs.append(reads)
        grad_inputs.append(sorted({new_id[s] for s in node.grad_storages if s in new_id}
                                  & set(reads)))
        node_outputs.append([new_id[s] for s in node.new_storages if s in new_id])
        node_saved.append(sorted({new_id[s] for s in node.saved_storages if s in new_id}))
        saves_static.append(any(storages[s].kind in STATIC_KINDS for s in node.saved_storages))
    return node_inputs, node_outputs, node_saved, saves_static, grad_inputs


def _param_grad_bytes(profile: GraphProfile) -> list[int]:
    """A parameter's .grad appears at the backward of its last reader in forward order."""
    last_reader: dict[str, int] = {}
    for node in profile.nodes:
        for name in node.params:
            last_reader[name] = node.index
    param_storage = {s.name: s for s in profile.storages if s.kind == "param"}
    param_grad = [0] * len(profile.nodes)
    for name, index in last_reader.items():
        param_grad[index] += param_storage[name].nbytes
    return param_grad


def _releases(profile: GraphProfile, activation: list[int], new_id: dict[int, int]
              ) -> list[int]:
    """Per activation storage, the node after which the program drops its own reference;
    held for the whole step (n): what the loss reads (the caller keeps it), and what is
    still alive when the forward and loss end (release at the loss pseudo-node: the model
    keeps it, a module attribute such as RAFT's correlation pyramid)."""
    storages, nodes = profile.storages, profile.nodes
    n = len(nodes)
    held_by_caller = {new_id[s] for s in nodes[-1].read_storages if s in new_id} \
        if nodes[-1].op == "loss" else set()
    outlive = n - 1 if nodes[-1].op == "loss" else n
    return [n if i in held_by_caller or (storages[sid].release or 0) >= outlive
            else max(storages[sid].release if storages[sid].release is not None
                     else storages[sid].producer or 0, storages[sid].producer or 0)
            for i, sid in enumerate(activation)]


def _blocks(profile: GraphProfile, block_prefix: str | None) -> list[int] | None:
    """Per node, the number of the repeated block call it runs in (-1: none)."""
    found = block_calls(profile, block_prefix)
    if not found:
        return None
    blocks = [-1] * len(profile.nodes)
    for number, call in enumerate(found):
        for i in range(call.start, call.stop):
            blocks[i] = number
    return blocks
