"""Build a solver `Problem` from a `profiles.GraphProfile` (pure data, no torch).

Node indices are kept one-to-one with the profile's nodes (placeholders, get_attr and the
output node are free no-ops), so a schedule's regions name profile nodes directly. Storages
are the profile's activation and internal storages, renumbered; params, buffers and inputs
are static.
"""

from __future__ import annotations

import re
from collections import Counter

from profiles.schema import STATIC_KINDS, GraphProfile
from solvers.problem import MATMUL_KINDS, Problem

__all__ = ["detect_block_prefix", "op_kind", "problem_from_profile"]

_NEVER_RECOMPUTED = frozenset({"placeholder", "output", "loss"})
_INDEXED = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)(?:\.|$)")


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


def op_kind(ops: list[str], fx_op: str) -> str:
    """A node's kind for op policies: its first matmul-like aten op, else its last op."""
    names = [op.split(".")[1] if op.count(".") >= 2 else op for op in ops]
    for name in names:
        if name in MATMUL_KINDS:
            return name
    return names[-1] if names else fx_op


def _block_of(module: str, prefix: str) -> int:
    if module == prefix or not module.startswith(prefix + "."):
        return -1
    head = module[len(prefix) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def problem_from_profile(profile: GraphProfile, block_prefix: str | None = None,
                         *, detect_blocks: bool = True) -> Problem:
    """The solver's view of one training step of ``profile``.

    Args:
        profile: from ``profiles.profile``.
        block_prefix: module path of repeated blocks; default: detected.
        detect_blocks: set False to leave ``block_of_node`` empty.
    """
    storages = profile.storages
    activation = [s.id for s in storages if s.kind not in STATIC_KINDS]
    new_id = {sid: i for i, sid in enumerate(activation)}
    index_of = {node.name: node.index for node in profile.nodes}

    grad_bytes = [0] * len(activation)
    for node in profile.nodes:
        for tensor in node.outputs:
            sid = new_id.get(tensor.storage)
            if sid is not None and tensor.requires_grad and storages[tensor.storage].producer \
                    == node.index:
                grad_bytes[sid] = storages[tensor.storage].nbytes

    node_inputs, node_outputs, node_saved, saves_static, grad_inputs = [], [], [], [], []
    for node in profile.nodes:
        reads = {new_id[t.storage] for arg in node.args
                 for t in profile.nodes[index_of[arg]].outputs if t.storage in new_id}
        node_inputs.append(sorted(reads))
        grad_inputs.append(sorted({new_id[s] for s in node.grad_storages if s in new_id}
                                  & reads))
        node_outputs.append([new_id[s] for s in node.new_storages if s in new_id])
        node_saved.append(sorted({new_id[s] for s in node.saved_storages if s in new_id}))
        saves_static.append(any(storages[s].kind in STATIC_KINDS for s in node.saved_storages))

    # A parameter's .grad appears at the backward of its last reader in forward order.
    last_reader: dict[str, int] = {}
    for node in profile.nodes:
        for name in node.params:
            last_reader[name] = node.index
    param_storage = {s.name: s for s in storages if s.kind == "param"}
    param_grad = [0] * len(profile.nodes)
    for name, index in last_reader.items():
        param_grad[index] += param_storage[name].nbytes

    blocks = None
    if detect_blocks:
        prefix = block_prefix or detect_block_prefix(profile)
        if prefix is not None:
            blocks = [_block_of(node.module, prefix) for node in profile.nodes]

    static = profile.static
    costs = profile.checkpoint_costs
    saved = [n.saved_tensors for n in profile.nodes]
    return Problem(
        name=profile.model_name,
        node_names=[n.name for n in profile.nodes],
        fwd_time_ms=[n.fwd_time_ms for n in profile.nodes],
        bwd_time_ms=[n.bwd_time_ms for n in profile.nodes],
        fwd_temp_bytes=[n.fwd_temp_bytes for n in profile.nodes],
        bwd_temp_bytes=[n.bwd_temp_bytes for n in profile.nodes],
        # the loss and the graph's inputs/outputs live outside any checkpoint region; stateful
        # nodes (BatchNorm) are recomputable: the rewrite restores the buffers they update
        recomputable=[n.op not in _NEVER_RECOMPUTED for n in profile.nodes],
        node_inputs=node_inputs,
        node_outputs=node_outputs,
        node_saved=node_saved,
        storage_bytes=[storages[sid].nbytes for sid in activation],
        storage_producer=[storages[sid].producer for sid in activation],
        storage_grad_bytes=grad_bytes,
        # parameter .grad is not static: it appears during backward (param_grad_bytes)
        static_bytes=static.total_bytes - static.grad_bytes,
        param_grad_bytes=param_grad,
        block_of_node=blocks,
        node_saves_static=saves_static,
        node_grad_inputs=grad_inputs,
        op_kind=[op_kind(n.ops, n.op) for n in profile.nodes],
        keepable=[n.keepable for n in profile.nodes],
        # checkpoint overhead: not modelled (0) for profiles recorded without it
        checkpoint_region_ms=costs.region_ms if costs else 0.0,
        checkpoint_pack_ms=costs.pack_ms if costs else 0.0,
        checkpoint_sac_op_ms=costs.sac_op_ms if costs else 0.0,
        node_ops=[len(n.ops) for n in profile.nodes],
        node_packed=None if None in saved else saved,
    )
