"""GraphProfile: what one training step of a model allocates, saves and costs, op by op.

Pure pydantic (no torch import), so ``solvers`` can read profiles without torch. Units are in
the field names: ``*_bytes`` are bytes, ``*_ms`` milliseconds.

The step is observed as it runs eagerly (``profiles.profile``): every aten op the forward and
the loss dispatch is a node, in call order, followed by a ``loss`` pseudo-node; every call of
one of the model's modules is a ``ModuleCall`` spanning a run of nodes. Those spans are what a
plan can checkpoint on the model's own module tree.

Memory model: every tensor lives in a *storage*; views share their base's storage, so a
storage is the unit that is allocated and freed. Each storage has a kind: ``activation`` (an
output of a node), ``internal`` (allocated inside a node, not an output, but kept by autograd),
or static (``param``, ``buffer``, ``input``: never activations). ``release`` is the last node
of the forward while which Python still held it (a local variable outlives its last reader).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import stat
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

SCHEMA_VERSION = 2

# Bounds on every number a profile or a plan holds. Files are data a user can edit: past
# these a number is a typo, not a training step, and would overflow or never compare true
# where it is used (a budget of 10**400 bytes, a shape guard against 10**30 rows).
MAX_BYTES = 2**62  # 4 EiB
MAX_MS = 1e9  # about 11.6 days, for one op or one step
MAX_SECONDS = MAX_MS / 1000
MAX_FLOPS = 2**80
MAX_DIM = 2**40  # one dimension of a tensor
MAX_NUMEL = 2**62  # elements of one tensor
MAX_COUNT = 2**40  # ids, indices, calls, tensors saved by one op
MAX_SCALE = 1e6  # measured whole step / sum of isolated op times


def _integer(value: Any) -> Any:
    """Bytes, sizes and counts are integers: refuse JSON's 4096.0 and true, not round them."""
    if isinstance(value, (bool, float)):
        raise ValueError(f"must be an integer, got {value!r}")
    return value


def _plausible_numel(shape: list[int]) -> list[int]:
    numel = 1
    for size in shape:
        numel *= size
    if numel > MAX_NUMEL:
        raise ValueError(f"shape {shape} has {numel} elements, more than {MAX_NUMEL}")
    return shape


Bytes = Annotated[int, BeforeValidator(_integer), Field(ge=0, le=MAX_BYTES)]
SignedBytes = Annotated[int, BeforeValidator(_integer), Field(ge=-MAX_BYTES, le=MAX_BYTES)]
Count = Annotated[int, BeforeValidator(_integer), Field(ge=0, le=MAX_COUNT)]
Flops = Annotated[int, BeforeValidator(_integer), Field(ge=0, le=MAX_FLOPS)]
Dim = Annotated[int, BeforeValidator(_integer), Field(ge=0, le=MAX_DIM)]
Shape = Annotated[list[Dim], AfterValidator(_plausible_numel)]
Ms = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]
SignedMs = Annotated[float, Field(ge=-MAX_MS, le=MAX_MS, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Scale = Annotated[float, Field(gt=0, le=MAX_SCALE, allow_inf_nan=False)]

StorageKind = Literal["activation", "internal", "param", "buffer", "input", "constant",
                      "runtime"]
# held for the whole step by the model or the caller; "constant": a tensor the step reads
# that no op made (a plain module attribute)
# "runtime": held by a parallel runtime (FSDP2's gathered parameters), whose bytes are its
# nodes' ``fwd_runtime_bytes`` and the observed backward's, not a storage's
STATIC_KINDS: frozenset[str] = frozenset({"param", "buffer", "input", "constant", "runtime"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorMeta(_Strict):
    """One tensor a node outputs."""

    shape: Shape
    dtype: str
    nbytes: Bytes = Field(description="numel * itemsize of this tensor (not its storage)")
    storage: Count = Field(description="id of the storage it lives in")
    requires_grad: bool


class StorageInfo(_Strict):
    id: Count
    nbytes: Bytes
    kind: StorageKind
    producer: Count | None = Field(None, description="index of the node that allocated it")
    name: str = Field("", description="parameter/buffer/input name for static storages")
    release: Count | None = Field(None, description="activations: the last forward node while "
                                "which Python held it (>= producer); None: static")


class NodeProfile(_Strict):
    index: Count = Field(description="topological position")
    name: str
    op: str = Field(description="'aten' for an op of the step, 'loss' for the loss pseudo-node")
    target: str = Field(description="the aten op, e.g. aten.addmm.default")
    module: str = Field("", description="innermost module call running it, '' outside any")
    args: list[str] = Field(default_factory=list, description="names of the nodes that made "
                            "the activations it reads")
    read_storages: list[int] = Field(default_factory=list,
                                     description="storages of the tensors it reads")
    users: list[str] = Field(default_factory=list)
    outputs: list[TensorMeta] = Field(default_factory=list)
    new_storages: list[int] = Field(
        default_factory=list, description="storages allocated by this node that outlive it"
    )
    saved_storages: list[int] = Field(
        default_factory=list, description="storages autograd saves when this node runs"
    )
    params: list[str] = Field(default_factory=list, description="parameters the node reads")
    fwd_time_ms: Ms = 0.0
    bwd_time_ms: Ms = 0.0
    fwd_flops: Flops = 0
    bwd_flops: Flops = 0
    fwd_temp_bytes: Bytes = Field(0, description="transient peak beyond outputs, forward")
    bwd_temp_bytes: Bytes = Field(0, description="transient peak beyond grads, backward")
    stateful: bool = Field(False, description="mutates module state (BatchNorm running stats)")
    mutated_buffers: list[str] = Field(default_factory=list,
                                       description="buffers/params it updates in place")
    random: bool = Field(False, description="draws random numbers (dropout)")
    ops: list[str] = Field(default_factory=list,
                           description="aten ops the forward dispatches, in call order")
    output_ops: list[int] = Field(default_factory=list,
                                  description="positions in ops that allocate new_storages")
    keepable: bool = Field(True, description="a SAC policy can save its outputs (no output "
                           "is finished by an in-place op)")
    skippable: bool = Field(False, description="a checkpoint's rerun may answer it with "
                            "uninitialized outputs where nothing needs their values: one "
                            "functional op a SAC policy sees, drawing no random numbers, "
                            "writing nothing in place, every output a new storage it does "
                            "not save")
    saved_tensors: Count | None = Field(
        None, description="tensors autograd saves when this node runs (pack-hook calls,"
        " parameters included); None in older profiles")
    written_storages: list[int] = Field(
        default_factory=list, description="earlier activations this node mutates in place")
    packs_after_running: bool | None = Field(
        None, description="observed: whether autograd packed a saved tensor after the op ran "
        "(one of its outputs); False: it packs its inputs only, before running, so a rerun "
        "whose last pack is this node's stops before running it; None: no packs, or unknown")
    grad_storages: list[int] = Field(
        default_factory=list, description="storages whose gradient this node's backward makes")
    bwd_live_before_bytes: Bytes | None = Field(
        None, description="observed: bytes the backward holds (gradients) just before "
        "this node's backward, the same under every schedule")
    bwd_peak_bytes: Bytes | None = Field(None, description="observed: the most the "
                                       "backward holds during it (temporaries included)")
    bwd_live_after_bytes: Bytes | None = Field(None, description="observed: what it "
                                             "holds once this node's backward is done")
    bwd_held_peak_bytes: Bytes | None = Field(
        None, description="observed: the most the backward holds during this node's work "
        "while the node still holds its saved tensors; below bwd_peak_bytes where the most "
        "comes after it released them (the engine then sums its gradients into buffers of "
        "other nodes' inputs), so that moment runs without them; None: not observed (profiles "
        "before it: the whole peak is taken as held)")
    bwd_unpack_bytes: Bytes | None = Field(
        None, description="observed: what the backward holds when this node's backward "
        "first unpacks a saved tensor, where a checkpoint's rerun it starts begins (above "
        "bwd_live_before_bytes where the backward allocates first: an in-place op on a "
        "view's CopySlices); None: not observed (profiles before it: as before)")
    fwd_runtime_bytes: Bytes | None = Field(
        None, description="parallel profiles: what the parallel runtime (FSDP2's gathered "
        "parameters, collective buffers) holds while this node's forward runs, at most "
        "since the node before it; None: one process, no runtime")
    runtime_ops_before: Count = Field(0, description="ops the parallel runtime ran just "
                                      "before this node (an FSDP2 unit's all-gather)")


class TracedSegment(_Strict):
    """A piece of a module's own forward, traced with torch.fx (children as leaves): one
    child-module call, or the module's own ops between two of them. Consecutive segments
    form the op-range regions a plan may checkpoint inside the module's forward."""

    first: str = Field(description="name of the segment's first fx node")
    last: str = Field(description="name of the segment's last fx node")
    start: Count = Field(description="first profile node the segment ran")
    stop: Count = Field(description="one past its last profile node (start: runs no op)")
    child: bool = Field(False, description="the segment is one call of a child module")


class ModuleCall(_Strict):
    """One call of one of the model's modules: nodes ``[start, stop)`` ran inside it."""

    index: Count
    path: str = Field(description="module path in the model ('' for the model itself)")
    module_type: str
    start: Count
    stop: Count
    parent: Count | None = Field(None, description="index of the enclosing call")
    call_number: Count = Field(0, description="calls of this module before this one")
    calls: Count = Field(1, ge=1, description="calls of this module in the whole step")
    input_storages: list[int] = Field(
        default_factory=list, description="storages of the tensors passed in (args and "
        "kwargs): what a checkpoint of this call holds until its backward")
    mutated_buffers: list[str] = Field(default_factory=list,
                                       description="buffers updated in place during the call")
    traced: list[TracedSegment] = Field(
        default_factory=list, description="its forward traced with torch.fx, in order (empty: "
        "not traced, `untraced` says why)")
    untraced: str = Field("", description="why its forward offers no op ranges")


class FunctionSpan(_Strict):
    """One call of a custom ``torch.autograd.Function`` (``profiles.functions``): nodes
    ``[start, stop)`` ran in its forward, without autograd, and its own backward stands for
    theirs (booked to node ``stop - 1``, where it packs what it saves). A plan's region
    holds the whole call or none of it."""

    name: str = Field(description="the Function's class, module.QualName")
    start: Count
    stop: Count


class StaticMemory(_Strict):
    param_bytes: Bytes
    grad_bytes: Bytes = Field(description="parameter .grad, present after backward")
    buffer_bytes: Bytes = Field(description="buffers and constant tensors the step reads")
    input_bytes: Bytes
    optimizer_state_bytes: Bytes = 0
    optimizer_step_bytes: Bytes = Field(0, description="what ``optimizer.step()`` "
                                      "allocates beyond its state while it runs (foreach "
                                      "buffers, per-parameter temporaries)")
    resident_input_bytes: Bytes = Field(0, description="the other batches the device "
                                        "holds through the step (a trainer's resident "
                                        "micro-batches of gradient accumulation)")
    grads_at_start: bool = Field(False, description="the step starts with every .grad "
                                 "allocated (gradient accumulation, zero_grad(set_to_none="
                                 "False)); False: with none, as zero_grad() leaves them")
    grads_in_forward: bool = Field(False, description="the step starts with the .grad one "
                                   "backward left and frees them after its forward and "
                                   "loss, before its own backward (zero_grad() between the "
                                   "two, Lightning's order): they count in the forward only")

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.grad_bytes + self.buffer_bytes + self.input_bytes
                + self.resident_input_bytes + self.optimizer_state_bytes)


class StepTiming(_Strict):
    """The unplanned step timed whole, and the factors applied to isolated node times."""

    fwd_ms: Ms = Field(description="forward + loss, measured whole")
    bwd_ms: Ms = Field(description="backward, measured whole")
    fwd_scale: Scale = Field(description="whole forward / sum of isolated node times")
    bwd_scale: Scale = Field(description="whole backward / sum of isolated node times")


class CheckpointCosts(_Strict):
    """Host time ``torch.utils.checkpoint`` adds per RECOMPUTE region beyond re-running it.

    Measured with tiny ops (``profiles.calibrate``) or per-device defaults
    (``profiles.devices``). A region that reruns (something in it saves a tensor) costs
    ``region_ms + pack_ms * saved tensors + (sac_op_ms * aten ops if it keeps nodes)``
    (``+ range_ms`` for an op range),
    counted over the nodes up to its early stop (``solvers.Problem.checkpoint_overhead_ms``).
    """

    region_ms: Ms = Field(description="per region: frame, RNG stash/restore, hooks, "
                             "the unpack that starts the rerun, early stop")
    pack_ms: Ms = Field(description="per saved tensor: pack in forward, unpack in "
                           "backward, repack and check in the rerun")
    sac_op_ms: Ms = Field(description="per aten op of a region with kept nodes: the "
                             "selective-checkpoint policy in forward and in the rerun")
    range_ms: Ms = Field(0.0, description="per op range, beyond region_ms: its module's "
                         "forward runs as its traced program, and so does the rerun")
    step_ms: Ms = Field(0.0, description="once per step that reruns any region, beyond its "
                        "regions' costs: the first checkpoint of a step pays for the "
                        "machinery's code and data coming back into the host's caches")
    guard_ms: Ms = Field(0.0, description="per step of a planned model, whatever its "
                         "schedule: the checks its guard runs at the start of the step, "
                         "timed inside the calibration's steps")
    source: str = Field("", description="how they were obtained")


class ParallelLayout(_Strict):
    """The parallelism a profile's step ran under (``profiles.parallel``): the mesh, and
    what the user's ``parallelize`` made of the model, for the planned model to check."""

    mesh_shape: list[Count]
    mesh_dim_names: list[str] | None = None
    fsdp_units: list[str] = Field(default_factory=list, description="modules fully_shard "
                                  "was called on, '' for the model itself")
    param_dtype: str | None = Field(None, description="MixedPrecisionPolicy.param_dtype")
    reduce_dtype: str | None = Field(None, description="MixedPrecisionPolicy.reduce_dtype")
    unit_dtypes: list[list[str | None]] = Field(
        default_factory=list, description="per FSDP2 unit: its MixedPrecisionPolicy's "
        "(param_dtype, reduce_dtype); param_dtype and reduce_dtype say them only when every "
        "unit has the same policy")
    reshard_after_forward: list[bool | int] = Field(default_factory=list,
                                                    description="per FSDP2 unit")
    cpu_offload: bool = Field(False, description="FSDP2's CPUOffloadPolicy")
    backend: str | None = Field(None, description="the collectives' backend the step was "
                                "profiled for: 'nccl' (reduce-scatters in place) or 'gloo' "
                                "(on a copy of the input); None: files before it (NCCL)")
    placements: dict[str, str] = Field(default_factory=dict, description="each DTensor "
                                       "parameter's placements on the mesh")

    @property
    def world_size(self) -> int:
        size = 1
        for n in self.mesh_shape:
            size *= n
        return size

    def describe(self) -> str:
        """One line for plan summaries."""
        mesh = " x ".join(str(n) for n in self.mesh_shape)
        if len(self.mesh_shape) == 1:
            mesh += "-rank"
        if self.mesh_dim_names:
            mesh += f" ({', '.join(self.mesh_dim_names)})"
        parts = []
        if self.fsdp_units:
            dtype = f", params in {self.param_dtype}" if self.param_dtype else \
                ", mixed precision policies per unit" if any(
                    param for param, _ in self.unit_dtypes) else ""
            parts.append(f"FSDP2 over {len(self.fsdp_units)} units{dtype}")
        tp = len([p for p in self.placements.values() if "Shard" in p])
        if tp and not self.fsdp_units:
            parts.append(f"{tp} sharded parameters")
        over = f" over {self.backend}" if self.backend else ""
        return f"per rank of a {mesh} mesh{over} ({'; '.join(parts) or 'replicated'})"


class GraphProfile(_Strict):
    """Per-node memory and time of one training step, with a fingerprint of the graph."""

    schema_version: int = SCHEMA_VERSION
    model_name: str
    execution: Literal["fake", "real"] = Field(
        description="fake: observed under FakeTensorMode (no memory used); real: on real "
        "tensors, because the forward branches on tensor values")
    timing: Literal["measure", "estimate"]
    device: str = Field(description="device the times are for, e.g. 'cpu', 'H100'")
    torch_version: str
    fingerprint: str
    autocast_dtype: str | None = Field(None, description="the step ran under torch.autocast "
                                       "with this dtype (e.g. 'bfloat16'); None: no autocast")
    nodes: list[NodeProfile]
    storages: list[StorageInfo]
    module_calls: list[ModuleCall] = Field(default_factory=list)
    function_calls: list[FunctionSpan] = Field(
        default_factory=list, description="calls of custom autograd Functions that ran ops")
    static: StaticMemory
    step: StepTiming | None = Field(None, description="measured whole step (measure only)")
    checkpoint_costs: CheckpointCosts | None = Field(
        None, description="checkpoint overhead on this device; None: not modelled (profiles "
        "recorded before it was)")
    parallel: ParallelLayout | None = Field(
        None, description="one rank of this parallel step; None: one process")

    @model_validator(mode="after")
    def _check(self) -> GraphProfile:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version} is not {SCHEMA_VERSION}; "
                             "re-run profiles.profile() with this version of the planner")
        for i, node in enumerate(self.nodes):
            if node.index != i:
                raise ValueError(f"nodes[{i}].index is {node.index}; nodes must be in order")
        for i, storage in enumerate(self.storages):
            if storage.id != i:
                raise ValueError(f"storages[{i}].id is {storage.id}; ids must be positions")
        n_storages, n_nodes = len(self.storages), len(self.nodes)
        for node in self.nodes:
            for sid in [*node.new_storages, *node.saved_storages, *node.grad_storages,
                        *node.written_storages,
                        *(t.storage for t in node.outputs)]:
                if not 0 <= sid < n_storages:
                    raise ValueError(f"node {node.name!r} refers to storage {sid}, which does "
                                     f"not exist (there are {n_storages})")
        for storage in self.storages:
            if storage.producer is not None and not 0 <= storage.producer < n_nodes:
                raise ValueError(f"storage {storage.id} has producer {storage.producer}, "
                                 f"out of range")
            if storage.release is not None and not (storage.producer or 0) <= storage.release \
                    < n_nodes:
                raise ValueError(f"storage {storage.id} has release {storage.release}, before "
                                 f"its producer or past the last node")
        for i, call in enumerate(self.module_calls):
            if call.index != i or not 0 <= call.start <= call.stop <= n_nodes:
                raise ValueError(f"module_calls[{i}] ({call.path!r}) has index {call.index} "
                                 f"and span [{call.start}, {call.stop}); calls must be in "
                                 f"order with spans inside the {n_nodes} nodes")
            if call.parent is not None and not 0 <= call.parent < i:
                raise ValueError(f"module_calls[{i}] has parent {call.parent}; a parent call "
                                 "comes before its children")
            for sid in call.input_storages:
                if not 0 <= sid < n_storages:
                    raise ValueError(f"module_calls[{i}] refers to storage {sid}, which does "
                                     f"not exist")
        for i, function in enumerate(self.function_calls):
            if not 0 <= function.start < function.stop <= n_nodes:
                raise ValueError(f"function_calls[{i}] ({function.name}) spans "
                                 f"[{function.start}, {function.stop}), which is empty or "
                                 f"outside the {n_nodes} nodes")
        return self

    # ------------------------------------------------------------------ queries
    @property
    def for_gpu(self) -> bool:
        """Whether the times are for a GPU (any device but the CPU): its kernels run
        asynchronously to the host, and the planned model runs there."""
        return self.device.lower() != "cpu"

    def node(self, name: str) -> NodeProfile:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node named {name!r} in the profile of {self.model_name}")

    def saved_activation_storages(self) -> set[int]:
        """Storages autograd keeps for backward that are activations (not params/inputs)."""
        return {sid for node in self.nodes for sid in node.saved_storages
                if self.storages[sid].kind not in STATIC_KINDS}

    def saved_activation_bytes(self) -> int:
        """Bytes autograd keeps for backward with no checkpointing, each storage once."""
        return sum(self.storages[sid].nbytes for sid in self.saved_activation_storages())

    @property
    def fwd_time_ms(self) -> float:
        return sum(n.fwd_time_ms for n in self.nodes)

    @property
    def bwd_time_ms(self) -> float:
        return sum(n.bwd_time_ms for n in self.nodes)

    def summary(self) -> str:
        """A few readable lines about the profile."""
        static = self.static
        return "\n".join([
            f"{self.model_name}: {len(self.nodes)} ops, {len(self.module_calls)} module calls "
            f"({self.execution} tensors"
            f"{', autocast ' + self.autocast_dtype if self.autocast_dtype else ''}), "
            f"fingerprint {self.fingerprint}",
            f"  static {format_bytes(static.total_bytes)} (params "
            f"{format_bytes(static.param_bytes)}, grads {format_bytes(static.grad_bytes)}, "
            f"buffers {format_bytes(static.buffer_bytes)}, inputs "
            f"{format_bytes(static.input_bytes)}"
            + (f" + {format_bytes(static.resident_input_bytes)} resident"
               if static.resident_input_bytes else "") + ", optimizer "
            f"{format_bytes(static.optimizer_state_bytes)})",
            f"  saved activations {format_bytes(self.saved_activation_bytes())}",
            f"  time ({self.timing} on {self.device}): forward {self.fwd_time_ms:.2f} ms, "
            f"backward {self.bwd_time_ms:.2f} ms"
            + (f" (node times scaled by {self.step.fwd_scale:.2f} / {self.step.bwd_scale:.2f} "
               "to the measured whole step)" if self.step else ""),
        ])

    # ------------------------------------------------------------------ files
    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str) -> GraphProfile:
        return cls.model_validate_json(text)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON, atomically (``write_atomic``)."""
        write_atomic(path, self.to_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> GraphProfile:
        """Read a profile; a file that is not one raises ``FileFormatError`` naming the file
        and the field."""
        return read_model(cls, path, "profile")


class FileFormatError(ValueError):
    """A plan or profile file that cannot be read as one (not text, not JSON, truncated,
    another kind of file, a field out of bounds): the message names the file and the field."""


Model = TypeVar("Model", bound=BaseModel)
ERRORS_NAMED = 5  # a file with more invalid fields names these and counts the rest


def read_model(cls: type[Model], path: str | Path, what: str) -> Model:
    """``cls`` read from the JSON file at ``path`` (a ``what``: "plan", "profile"). A missing
    or unreadable file raises ``OSError`` (naming it); any content that is not a valid
    ``what`` raises ``FileFormatError`` naming the file and each invalid field."""
    raw = Path(path).read_bytes()
    if not raw.strip():
        raise FileFormatError(f"{path}: not a {what} file: the file is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FileFormatError(f"{path}: not a {what} file: byte {error.start} is not UTF-8 "
                              "text (a binary file?)") from None
    try:
        model = cls.model_validate_json(text)
    except ValidationError as error:
        raise FileFormatError(f"{path}: {_describe(error, cls, what)}") from error
    if "schema_version" in cls.model_fields and "schema_version" not in model.model_fields_set:
        raise FileFormatError(f"{path}: not a {what} file of this planner: it has no "
                              "schema_version (written by hand, or edited), so nothing says "
                              "which version of the planner wrote it. Make it again with "
                              "this version.")
    return model


def _describe(error: ValidationError, cls: type[BaseModel], what: str) -> str:
    """A pydantic ``ValidationError`` of a ``what`` file on one line, field by field."""
    errors = error.errors()
    broken = [e for e in errors if e["type"] == "json_invalid"]
    if broken:
        return (f"not a {what} file: {broken[0]['msg']} (the file is truncated or is not "
                "JSON)")
    if any(e["loc"] == () and e["type"] == "model_type" for e in errors):
        return f"not a {what} file: the JSON is not an object"
    missing = [str(e["loc"][0]) for e in errors if e["type"] == "missing" and len(e["loc"]) == 1]
    extra = [str(e["loc"][0]) for e in errors
             if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
    required = sum(field.is_required() for field in cls.model_fields.values())
    if missing and (extra or 2 * len(missing) >= required):  # another kind of file
        return (f"not a {what} file: it lacks the fields {', '.join(missing)} of a {what}"
                + (f" and has fields a {what} does not: {', '.join(extra[:ERRORS_NAMED])}"
                   if extra else "")
                + (" (it looks like a profile: `python -m planner profile` writes those)"
                   if what != "profile" and {"nodes", "storages"} <= set(extra) else ""))
    version = [e for e in errors if e["loc"] == ("schema_version",)]
    errors = version or errors  # another version's file: its other errors follow from it
    named = "; ".join(_field_error(e) for e in errors[:ERRORS_NAMED])
    more = len(errors) - ERRORS_NAMED
    return (f"{len(errors)} invalid field{'s' if len(errors) > 1 else ''} of a {what}: "
            f"{named}{f' (and {more} more)' if more > 0 else ''}")


def _field_error(error: Any) -> str:
    """`field.path: problem (got value)`; a value only where it is short."""
    msg = str(error["msg"]).removeprefix("Value error, ")
    value = error.get("input")
    short = (isinstance(value, (float, bool)) or (isinstance(value, str) and len(value) < 40)
             or (isinstance(value, int) and value.bit_length() < 128))
    got = repr(value) if short else ""
    where = ".".join(map(str, error["loc"]))
    return (f"{where + ': ' if where else ''}{msg}"
            f"{f' (got {got})' if got and len(got) <= 40 else ''}")


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a crash or an error part-way leaves the old file
    whole: a temporary file beside it, flushed to disk, renamed onto it (``os.replace``); the
    temporary file is removed on an error. A symbolic link is followed; a path that is not a
    regular file (``/dev/null``, a pipe) is written in place. ``OSError`` names ``path``."""
    target = Path(os.path.realpath(path))
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with open(target, "w", encoding="utf-8") as stream:
            stream.write(text)
        return
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
    except OSError as error:
        raise _naming(error, path) from error
    try:
        with os.fdopen(fd, "wb") as stream:
            if mode is not None:
                os.chmod(temporary, stat.S_IMODE(mode))  # the file keeps its permissions
            stream.write(text.encode("utf-8"))
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise _naming(error, path) from error
        raise


def _naming(error: OSError, path: str | Path) -> OSError:
    """``error`` naming ``path`` (not the temporary file beside it)."""
    if error.errno is None:
        return error
    return type(error)(error.errno, error.strerror, str(path))


def format_bytes(nbytes: float, *, round_up: bool = False) -> str:
    """Bytes in the unit that fits (GiB, MiB, KiB or B), 4 significant digits; with
    ``round_up`` the printed number is never below the exact one."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            value = nbytes / size
            digits = max(0, 3 - math.floor(math.log10(abs(value))))
            if round_up:
                value = math.ceil(value * 10**digits) / 10**digits
            return f"{value:.{digits}f} {unit}"
    return f"{math.ceil(nbytes) if round_up else int(nbytes)} B"


def fingerprint(structure: list[object]) -> str:
    """Short stable hash of JSON-serialisable structure (graph, shapes, dtypes)."""
    text = json.dumps(structure, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
