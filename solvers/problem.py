"""The boundary type between profiling and solving: a `Problem` of nodes and storages.

A problem is pure data (no torch): nodes in topological order, each with forward/backward
time and transient memory, the activation storages it reads, allocates and saves for
backward, and the bytes of every storage and of its gradient. Units are in field names.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any, Literal

import networkx as nx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from solvers import lifetimes, span_views
from solvers.decision import RULES, Decision, DecisionCost, cost
from solvers.lifetimes import ACCUMULATION_COPIES, GradientEvents

logger = logging.getLogger(__name__)

__all__ = ["ACCUMULATION_COPIES", "LINEAR_KINDS", "MATMUL_KINDS", "GradientEvents", "HostLink",
           "ModuleSpan", "ObservedBackward", "Problem", "ProblemError", "TracedCall"]

MATMUL_KINDS = frozenset({
    "mm", "matmul", "bmm", "addmm", "baddbmm", "linear", "conv", "conv1d", "conv2d",
    "conv3d", "convolution", "einsum", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
})
# what `nn.Linear` (and HF's Conv1D) run: the outputs a "save linear" policy keeps
LINEAR_KINDS = frozenset({"mm", "addmm", "linear"})


class ProblemError(ValueError):
    """A problem's data is inconsistent; the message says which field and what to fix.

    Raised inside validation, so constructing a `Problem` surfaces it wrapped in pydantic's
    `ValidationError` (also a `ValueError`); `from_networkx` raises it directly.
    """


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ProblemError(msg)


class ObservedBackward(BaseModel):
    """Per node, what the backward holds (gradients and temporaries, as observed in one
    step): just before the node's backward, at its peak, once it is done, (`unpack`)
    when it first unpacks a saved tensor, which is when a checkpoint's rerun it starts
    begins (None: not observed; taken as `before`), and (`held`) at its peak while the node
    still holds its saved tensors: below `peak` where the most comes after the engine
    released them, summing the node's gradients into other buffers (None: not observed;
    taken as `peak`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    before: list[int]
    peak: list[int]
    after: list[int]
    unpack: list[int] | None = None
    held: list[int] | None = None


class ModuleSpan(BaseModel):
    """Nodes ``[start, stop)`` that one call of a module ran: a region the planner can emit
    as a checkpoint of that module. ``inputs`` are the activation storages passed to the
    call, which the checkpoint holds (even those the call never reads).

    ``kind="ops"``: a run of consecutive segments of one module's traced forward (its own
    ops and child calls, `profiles.traced`), emitted as a checkpoint inside a generated
    forward; ``inputs`` are what flows into the run. Such spans are top-level regions only
    (`spans_within` lists calls), never offloaded, and hold nothing in an unplanned step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: int
    stop: int
    name: str = ""
    inputs: tuple[int, ...] = ()
    kind: Literal["call", "ops"] = "call"  # "ops": a run of a traced forward's segments
    owner: tuple[int, int] | None = None  # "ops": the span of the call whose forward it cuts


class TracedCall(BaseModel):
    """A module call whose forward can run as its fx trace (`ModuleSpan.kind == "ops"`
    spans cut it): its span and its direct child calls' spans, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: int
    stop: int
    children: tuple[tuple[int, int], ...] = ()


class HostLink(BaseModel):
    """The copy path between device and host memory that offloaded activations take.

    ``synchronous``: a copy holds up the compute stream for its whole duration (a CPU, where
    host and device are one memory); otherwise each direction has its own copy queue that
    runs beside compute (a GPU's copy engines over PCIe). ``source`` says where the
    bandwidths come from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    d2h_gbps: float = Field(gt=0)
    h2d_gbps: float = Field(gt=0)
    synchronous: bool = False
    source: str = ""

    def copy_ms(self, nbytes: int, to_host: bool) -> float:
        """Time of one copy of ``nbytes`` in one direction (1 GB/s = 1e9 bytes/s)."""
        return nbytes / ((self.d2h_gbps if to_host else self.h2d_gbps) * 1e6)


class Problem(BaseModel):
    """One training step as a graph of nodes over activation storages.

    Nodes are in topological order and the last node produces the scalar loss. Storage ids
    index the per-storage lists (`storage_bytes`, `storage_producer`, `storage_grad_bytes`).
    Parameters, buffers and user inputs are not storages: they are in `static_bytes`.

    Optional `node_saves_static[i]` says node i's backward also saves a static tensor
    (a parameter or user input). Such saves are invisible in `node_saved` but still count
    for torch.utils.checkpoint's early stop and trigger the rerun; default: False.

    Optional `node_packs_before_running[i]` says node i packs all its saved tensors before
    it runs (they are its inputs: a matmul's operands). torch.utils.checkpoint's early stop
    raises inside the last pack of a rerun, so when that pack is such a node's the rerun
    stops before running it: the node is not recomputed, and if kept its SAC cache entry is
    never consumed (held until the frame dies). Default: False (the node runs, then packs).

    Optional `keepable[i]` says whether a RECOMPUTE region may keep node i (selective
    checkpointing); default: every recomputable node may be kept.

    Optional `node_grad_inputs[i]` lists the storages node i's backward sends gradients to
    (a subset of `node_inputs[i]`; default: all of them). A loss that only selects
    `output.loss` reads the logits but sends them no gradient.

    Optional `op_kind[i]` names node i's operation (e.g. "mm", "linear", "relu");
    `is_matmul(i)` says whether it is matmul-like (what save-matmuls policies keep).

    Optional `storage_release[s]` is the last forward node while which the program itself
    holds storage s (a local variable outlives its last reader); `n_nodes` means the caller
    holds it for the whole step (like the loss). Default: its producer (freed after its last
    reader). `uses` / `readers` combine it with the reads: what lifetimes follow.

    Optional `module_spans` are the only regions a schedule may recompute (top-level or
    nested): the calls of the model's modules that can be checkpointed. Default: any region.

    Checkpoint overhead (`checkpoint_overhead_ms`): host time a RECOMPUTE region costs beyond
    re-running its nodes, `checkpoint_region_ms` per region, `checkpoint_pack_ms` per saved
    tensor and `checkpoint_sac_op_ms` per aten op when it keeps nodes, plus
    `checkpoint_range_ms` when the region is an op range (a `kind="ops"` span that no module
    call also spans: its module's forward runs as its traced program), and once per step
    that reruns any region `checkpoint_step_ms` (`clock.step_overhead_ms`); all 0 by
    default (not modelled). Optional `node_ops[i]` counts the aten ops node i dispatches
    (default 1) and `node_packed[i]` the tensors its forward saves for backward (default:
    its saved storages, plus one if it saves a static tensor). `host_overlaps_device` (a
    GPU): that host time runs while the device works through kernels already queued, and
    costs only what exceeds the region's forward time.

    Optional `optimizer_step_bytes`: what an optimizer step after the backward allocates
    beyond its state (in `static_bytes`); the step's last event, the same under every
    schedule (`simulate.optimizer_step_peak`). Default 0: the budget covers forward and backward.

    Optional `node_skippable[i]` says a rerun may skip node i when nothing it runs needs
    node i's outputs (`solvers.frame` F9): a functional op that draws no random numbers,
    allocates nothing but its outputs (no forward temporaries), does not save its own output,
    and that the selective-checkpoint policy sees (one aten op). Skipped, it makes outputs of
    the same shape, uninitialized: the memory is the same, its time is not spent. Default:
    no node is skipped.

    Optional `host_link`: how fast saved activations move to host memory and back; a
    schedule may offload only on a problem that has one.

    Optional `fwd_runtime_bytes[i]`: what the step holds beside its state and activations
    while node i's forward first runs, the same under every schedule: a parallel runtime's
    (FSDP2's gathered parameters and collective buffers, as measured on one rank), and the
    last step's gradients where they are freed only after the forward (Lightning's order).
    A rerun of node i happens in the backward, where the runtime's bytes are in the observed
    backward instead (`fwd_event_bytes`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "problem"
    node_names: list[str]
    fwd_time_ms: list[float]
    bwd_time_ms: list[float]
    fwd_temp_bytes: list[int]
    bwd_temp_bytes: list[int]
    recomputable: list[bool]
    node_inputs: list[list[int]]
    node_outputs: list[list[int]]
    node_saved: list[list[int]]
    storage_bytes: list[int]
    storage_producer: list[int]
    storage_grad_bytes: list[int]
    static_bytes: int
    param_grad_bytes: list[int]
    optimizer_step_bytes: int = Field(0, ge=0)
    block_of_node: list[int] | None = None
    node_saves_static: list[bool] | None = None
    node_packs_before_running: list[bool] | None = None
    op_kind: list[str] | None = None
    node_grad_inputs: list[list[int]] | None = None
    keepable: list[bool] | None = None
    node_skippable: list[bool] | None = None
    checkpoint_region_ms: float = 0.0
    checkpoint_pack_ms: float = 0.0
    checkpoint_sac_op_ms: float = 0.0
    checkpoint_range_ms: float = 0.0
    checkpoint_step_ms: float = 0.0
    node_ops: list[int] | None = None
    node_packed: list[int] | None = None
    storage_release: list[int] | None = None
    module_spans: list[ModuleSpan] | None = None
    traced_calls: list[TracedCall] | None = None
    observed_backward: ObservedBackward | None = None
    host_link: HostLink | None = None
    host_overlaps_device: bool = False
    fwd_runtime_bytes: list[int] | None = None

    @model_validator(mode="after")
    def _validate(self) -> Problem:
        _check(len(self.node_names) >= 1,
               "Problem has no nodes: node_names must list at least the loss node.")
        self._check_lengths_and_signs()
        self._check_storage_graph()
        self._check_annotations()
        return self

    def _check_lengths_and_signs(self) -> None:
        """One entry per node / storage in every list; no negative bytes or times."""
        n = len(self.node_names)
        m = len(self.storage_bytes)
        per_node = {
            "fwd_time_ms": self.fwd_time_ms,
            "bwd_time_ms": self.bwd_time_ms,
            "fwd_temp_bytes": self.fwd_temp_bytes,
            "bwd_temp_bytes": self.bwd_temp_bytes,
            "recomputable": self.recomputable,
            "node_inputs": self.node_inputs,
            "node_outputs": self.node_outputs,
            "node_saved": self.node_saved,
            "param_grad_bytes": self.param_grad_bytes,
        }
        for optional in ("block_of_node", "node_saves_static", "node_packs_before_running",
                         "op_kind", "keepable", "node_skippable", "node_ops", "node_packed",
                         "node_grad_inputs", "fwd_runtime_bytes"):
            if getattr(self, optional) is not None:
                per_node[optional] = getattr(self, optional)
        if self.node_grad_inputs is not None:
            for i, targets in enumerate(self.node_grad_inputs):
                bad = [s for s in targets if s not in self.node_inputs[i]]
                _check(not bad, f"node_grad_inputs[{i}] has storages {bad[:5]} that node {i} "
                       "does not read; a node sends gradients only to its inputs.")
        for field, values in per_node.items():
            _check(
                len(values) == n,
                f"{field} has {len(values)} entries but node_names has {n}: "
                f"give one entry per node, in node order.",
            )
        for field, values in (
            ("storage_producer", self.storage_producer),
            ("storage_grad_bytes", self.storage_grad_bytes),
            *((("storage_release", self.storage_release),) if self.storage_release else ()),
        ):
            _check(
                len(values) == m,
                f"{field} has {len(values)} entries but storage_bytes has {m}: "
                f"give one entry per storage id.",
            )
        for field in ("fwd_time_ms", "bwd_time_ms", "fwd_temp_bytes", "bwd_temp_bytes",
                      "param_grad_bytes", "storage_bytes", "storage_grad_bytes", "node_ops",
                      "node_packed", "fwd_runtime_bytes"):
            bad = [i for i, v in enumerate(getattr(self, field) or ()) if v < 0]
            _check(not bad, f"{field} must be non-negative; negative at indices {bad[:5]}.")
        _check(self.static_bytes >= 0, "static_bytes must be non-negative.")
        for field in ("checkpoint_region_ms", "checkpoint_pack_ms", "checkpoint_sac_op_ms",
                      "checkpoint_range_ms", "checkpoint_step_ms"):
            _check(getattr(self, field) >= 0, f"{field} must be non-negative.")

    def _check_storage_graph(self) -> None:
        """Each storage has one producer that lists it; nodes read only earlier storages
        and save only what they read or make."""
        n = len(self.node_names)
        m = len(self.storage_bytes)
        owner: dict[int, int] = {}
        for i, outs in enumerate(self.node_outputs):
            for s in outs:
                _check(0 <= s < m, f"node_outputs[{i}] has storage id {s}, not in 0..{m - 1}.")
                _check(
                    s not in owner or owner[s] == i,
                    f"storage {s} is listed in node_outputs of nodes {owner.get(s)} and {i}; "
                    f"a storage is allocated by exactly one node (views allocate nothing).",
                )
                owner[s] = i
        for s in range(m):
            p = self.storage_producer[s]
            _check(
                owner.get(s) == p,
                f"storage_producer[{s}] = {p} but storage {s} appears in node_outputs of "
                f"node {owner.get(s)}; list each storage in its producer's node_outputs.",
            )
        for i in range(n):
            for s in self.node_inputs[i]:
                _check(0 <= s < m, f"node_inputs[{i}] has storage id {s}, not in 0..{m - 1}.")
                _check(
                    self.storage_producer[s] < i,
                    f"node {i} ({self.node_names[i]}) reads storage {s} produced by node "
                    f"{self.storage_producer[s]}; producers must come before consumers "
                    f"(is node_names in topological order?).",
                )
            allowed = set(self.node_inputs[i]) | set(self.node_outputs[i])
            for s in self.node_saved[i]:
                _check(
                    s in allowed,
                    f"node {i} ({self.node_names[i]}) saves storage {s} that it neither reads "
                    f"nor allocates; add it to node_inputs[{i}] or node_outputs[{i}].",
                )

    def _check_annotations(self) -> None:
        """The optional per-node and per-storage facts agree with the graph."""
        n = len(self.node_names)
        m = len(self.storage_bytes)
        for i, before in enumerate(self.node_packs_before_running or ()):
            _check(not before or not set(self.node_saved[i]) & set(self.node_outputs[i]),
                   f"node {i} ({self.node_names[i]}) saves its own output, which it can only "
                   f"pack after running: node_packs_before_running[{i}] must be False.")
        for i, skippable in enumerate(self.node_skippable or ()):
            _check(not skippable or (self.fwd_temp_bytes[i] == 0
                                     and not set(self.node_saved[i]) & set(self.node_outputs[i])),
                   f"node {i} ({self.node_names[i]}) saves its own output or allocates forward "
                   f"temporaries: a rerun cannot skip it, node_skippable[{i}] must be False.")
        if self.observed_backward is not None:
            obs = self.observed_backward
            _check(len(obs.before) == len(obs.peak) == len(obs.after) == n,
                   f"observed_backward needs {n} entries per list, one per node.")
            _check(all(0 <= b <= pk and a <= pk for b, pk, a in zip(
                obs.before, obs.peak, obs.after, strict=True)),
                "observed_backward: each peak must be at least its before and after.")
            _check(obs.held is None or (len(obs.held) == n and all(
                h <= pk for h, pk in zip(obs.held, obs.peak, strict=True))),
                f"observed_backward.held needs {n} entries, none above its peak.")
        if self.storage_release is not None:
            bad = [s for s in range(m)
                   if not self.storage_producer[s] <= self.storage_release[s] <= n]
            _check(not bad, f"storage_release must lie between each storage's producer and "
                   f"{n} (the caller holds it); wrong for storages {bad[:5]}.")
        for span in self.module_spans or ():
            _check(0 <= span.start < span.stop <= n, f"module span {span.name!r} "
                   f"[{span.start}, {span.stop}) is empty or outside the {n} nodes.")
            bad = [s for s in span.inputs if not 0 <= s < m or
                   self.storage_producer[s] >= span.start]
            _check(not bad, f"module span {span.name!r} has inputs {bad[:5]} that are not "
                   "storages made before it.")

    # ---------------------------------------------------------------- derived data

    @property
    def n_nodes(self) -> int:
        """Number of nodes."""
        return len(self.node_names)

    @property
    def n_storages(self) -> int:
        """Number of activation storages."""
        return len(self.storage_bytes)

    @cached_property
    def inputs(self) -> tuple[tuple[int, ...], ...]:
        """Deduplicated `node_inputs` in first-seen order."""
        return tuple(tuple(dict.fromkeys(x)) for x in self.node_inputs)

    @cached_property
    def saved(self) -> tuple[tuple[int, ...], ...]:
        """Deduplicated `node_saved` in first-seen order."""
        return tuple(tuple(dict.fromkeys(x)) for x in self.node_saved)

    @cached_property
    def outputs(self) -> tuple[tuple[int, ...], ...]:
        """Deduplicated `node_outputs` in first-seen order."""
        return tuple(tuple(dict.fromkeys(x)) for x in self.node_outputs)

    @cached_property
    def consumers(self) -> tuple[tuple[int, ...], ...]:
        """Per storage, the nodes reading it in forward, ascending."""
        return self.invert(self.inputs)

    @cached_property
    def uses(self) -> tuple[tuple[int, ...], ...]:
        """Per node, the storages it keeps alive up to itself (`lifetimes.uses`)."""
        return lifetimes.uses(self)

    def uses_traced(self, owners: Iterable[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
        """`uses` when the calls spanning ``owners`` run as their fx traces."""
        return self.traced_lives(owners)[0]

    def traced_lives(self, owners: Iterable[tuple[int, int]]
                     ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """`uses_traced` and per storage the nodes whose uses list it (`readers` then),
        worked out once per set of ``owners`` (a search replays many schedules that trace
        the same calls: on a GPT-2 of 8 layers, 5 % of the offload search's time)."""
        key = frozenset(owners)
        if not key:
            return self.uses, self.readers
        lives = self._traced_lives.get(key)
        if lives is None:
            uses = lifetimes.uses_traced(self, key)
            lives = self._traced_lives[key] = (uses, self.invert(uses))
        return lives

    @cached_property
    def _skip_needs_memo(self) -> dict[tuple[Any, int], dict[int, frozenset[int]]]:
        """`frame._skip_needs` per frame rules and start."""
        return {}

    @cached_property
    def _traced_lives(self) -> dict[frozenset[tuple[int, int]], tuple[tuple, tuple]]:
        return {}

    def storages_made(self, start: int, stop: int) -> list[int]:
        """The storages nodes ``[start, stop)`` make."""
        return lifetimes.storages_made(self, start, stop)

    @cached_property
    def readers(self) -> tuple[tuple[int, ...], ...]:
        """Per storage, the nodes that keep it alive in forward (`uses`), ascending."""
        return lifetimes.readers(self)

    @cached_property
    def last_read(self) -> tuple[int, ...]:
        """Per storage, the last node that keeps it alive in forward (-1: none does)."""
        return lifetimes.last_read(self)

    def rerun_read_end(self, s: int, i: int, stop: int) -> int:
        """`lifetimes.rerun_read_end`: what keeps storage s alive in a rerun up to `stop`."""
        return lifetimes.rerun_read_end(self, s, i, stop)

    @cached_property
    def caller_held(self) -> frozenset[int]:
        """Storages the caller holds for the whole step (`lifetimes.caller_held`)."""
        return lifetimes.caller_held(self)

    @cached_property
    def fwd_event_bytes(self) -> tuple[int, ...]:
        """What node i's first forward holds beyond activations (`lifetimes`)."""
        return lifetimes.fwd_event_bytes(self)

    @cached_property
    def gradient_events(self) -> GradientEvents:
        """The gradient bytes of each backward event (`lifetimes.gradient_events`)."""
        return lifetimes.gradient_events(self)

    @cached_property
    def span_table(self) -> dict[tuple[int, int], ModuleSpan]:
        """The module spans by `(start, stop)`."""
        return span_views.span_table(self)

    def emittable(self, start: int, stop: int) -> bool:
        """Whether `[start, stop)` can be a RECOMPUTE region (`span_views.emittable`)."""
        return span_views.emittable(self, start, stop)

    @cached_property
    def calls_in_order(self) -> tuple[list[int], list[ModuleSpan]]:
        """The module calls' starts, and their spans by start (longest first)."""
        return span_views.calls_in_order(self)

    def spans_within(self, start: int, stop: int) -> list[ModuleSpan]:
        """The largest module spans strictly inside `[start, stop)`, in order."""
        return span_views.spans_within(self, start, stop)

    def is_call(self, start: int, stop: int) -> bool:
        """Whether `[start, stop)` is one module call (`span_views.is_call`)."""
        return span_views.is_call(self, start, stop)

    def span(self, start: int, stop: int) -> ModuleSpan | None:
        """The module span `[start, stop)`, if there is one."""
        return span_views.span(self, start, stop)

    def region_inputs(self, start: int, stop: int) -> tuple[int, ...]:
        """What a checkpoint of `[start, stop)` holds (`span_views.region_inputs`)."""
        return span_views.region_inputs(self, start, stop)

    @cached_property
    def grad_inputs(self) -> tuple[tuple[int, ...], ...]:
        """Per node, the storages its backward sends gradients to (default: its inputs)."""
        if self.node_grad_inputs is None:
            return self.inputs
        return tuple(tuple(dict.fromkeys(x)) for x in self.node_grad_inputs)

    @cached_property
    def grad_consumers(self) -> tuple[tuple[int, ...], ...]:
        """Per storage, the nodes whose backward makes a gradient for it, ascending."""
        return self.invert(self.grad_inputs)

    def invert(self, per_node: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """Per storage, the nodes whose entry in ``per_node`` lists it, ascending."""
        nodes: list[list[int]] = [[] for _ in range(self.n_storages)]
        for i, storages in enumerate(per_node):
            for s in storages:
                nodes[s].append(i)
        return tuple(tuple(c) for c in nodes)

    @cached_property
    def packs(self) -> tuple[bool, ...]:
        """Whether node i's backward saves anything (so checkpoint packs a tensor for it)."""
        static = self.node_saves_static or [False] * self.n_nodes
        return tuple(bool(self.saved[i]) or bool(static[i]) for i in range(self.n_nodes))

    @cached_property
    def stops_before_running(self) -> tuple[bool, ...]:
        """Per node: a rerun whose last pack is this node's stops before running it
        (`node_packs_before_running`, for a node that packs)."""
        before = self.node_packs_before_running or [False] * self.n_nodes
        return tuple(bool(before[i]) and self.packs[i] for i in range(self.n_nodes))

    @cached_property
    def _overhead_prefix(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
        """Prefix sums of the saved tensors, of the aten ops and of the forward ms per node."""
        static = self.node_saves_static or [False] * self.n_nodes
        packed = self.node_packed or [len(self.saved[i]) + int(static[i])
                                      for i in range(self.n_nodes)]
        ops = self.node_ops or [1] * self.n_nodes
        return (tuple(itertools.accumulate(packed, initial=0)),
                tuple(itertools.accumulate(ops, initial=0)),
                tuple(itertools.accumulate(self.fwd_time_ms, initial=0.0)))

    @cached_property
    def _op_ranges(self) -> frozenset[tuple[int, int]]:
        """The spans a checkpoint can cover only as an op range (no module call spans them)."""
        spans = self.module_spans or ()
        calls = {(s.start, s.stop) for s in spans if s.kind == "call"}
        return frozenset((s.start, s.stop) for s in spans
                         if s.kind == "ops" and (s.start, s.stop) not in calls)

    def checkpoint_overhead_ms(self, start: int, rerun_stop: int,
                               keep: Iterable[int] = (), end: int | None = None) -> float:
        """Host time of one RECOMPUTE region beyond re-running its nodes.

        `start` is the region's first node, `rerun_stop` its early stop (exclusive: one past
        the last node that saves something; `<= start`: nothing packs, no rerun, 0 ms), `end`
        its end (None: not an op range).
        Over nodes `[start, rerun_stop)`, with P saved tensors and O aten ops::

            host = checkpoint_region_ms + checkpoint_pack_ms * P
                   + (checkpoint_sac_op_ms * O if a node of keep lies there else 0)
                   + (checkpoint_range_ms if [start, end) is an op range else 0)

        The SAC term covers the policy in the forward and in the rerun; ops after the early
        stop and kept nodes past it (they never pay off) are not counted. With
        `host_overlaps_device` (a GPU, whose kernels run while the host queues the next
        ones) the region costs ``max(0, host - F)``, F the forward time of those nodes:
        measured on an H100, GPT-2-medium under SAC save-linear recomputed for +13.0 % where
        the host time counted in full predicted +32.8 %. `simulate`, `accounting` (hence
        `cpsat`) and `dp` all charge exactly this per region.

        >>> p = Problem.chain([4, 4, 1], [1.0, 1.0, 1.0]).model_copy(update={
        ...     "checkpoint_region_ms": 0.5, "checkpoint_pack_ms": 0.1,
        ...     "checkpoint_sac_op_ms": 0.2})
        >>> round(p.checkpoint_overhead_ms(0, 2), 6), round(p.checkpoint_overhead_ms(0, 2, [0]), 6)
        (0.6, 1.0)
        >>> gpu = p.model_copy(update={"host_overlaps_device": True, "fwd_time_ms": [0.2] * 3})
        >>> [round(gpu.checkpoint_overhead_ms(0, 2, keep), 6) for keep in ((), [0])]
        [0.2, 0.6]
        """
        if rerun_stop <= start:
            return 0.0
        packed, ops, fwd = self._overhead_prefix
        ms = self.checkpoint_region_ms + self.checkpoint_pack_ms * (packed[rerun_stop]
                                                                    - packed[start])
        if self.checkpoint_sac_op_ms and any(start <= k < rerun_stop for k in keep):
            ms += self.checkpoint_sac_op_ms * (ops[rerun_stop] - ops[start])
        if self.checkpoint_range_ms and (start, end) in self._op_ranges:
            ms += self.checkpoint_range_ms
        if self.host_overlaps_device:
            return max(0.0, ms - (fwd[rerun_stop] - fwd[start]))
        return ms

    def output_bytes(self, i: int) -> int:
        """The bytes of node i's outputs: what keeping it holds."""
        return sum(self.storage_bytes[s] for s in self.outputs[i])

    def can_keep(self, i: int) -> bool:
        """Whether a RECOMPUTE region may keep node i: recomputable and `keepable` (default).

        Every solver and baseline picks kept nodes only among these; `simulate` rejects a
        schedule keeping any other (e.g. a node whose output an in-place op finishes).
        """
        return bool(self.recomputable[i]) and (self.keepable is None or bool(self.keepable[i]))

    def skippable(self, i: int) -> bool:
        """Whether a rerun may skip node i where nothing it runs needs its outputs
        (`node_skippable`; default: never)."""
        return self.node_skippable is not None and bool(self.node_skippable[i])

    def decision_costs(self, i: int) -> dict[Decision, DecisionCost]:
        """What each decision open to node i's outputs costs (`solvers.decision.cost`): KEEP;
        RECOMPUTE where it is recomputable (its rerun step, `fwd_time_ms`); OFFLOAD where the
        host link is known (`host_link`). The cost table of the problem, one node at a time.

        >>> p = Problem.chain([8, 4], [1.0, 2.0])
        >>> {d.value: (c.device_bytes, c.backward_ms) for d, c in p.decision_costs(1).items()}
        {'keep': (4, 0.0), 'recompute': (0, 2.0)}
        """
        nbytes = self.output_bytes(i)
        link = self.host_link
        costs = {}
        for decision, rule in RULES.items():
            if (rule.reruns and not self.recomputable[i]) or (rule.copies and link is None):
                continue
            out_ms, back_ms = (link.copy_ms(nbytes, True), link.copy_ms(nbytes, False)) \
                if link is not None else (0.0, 0.0)
            costs[decision] = cost(decision, nbytes, self.fwd_time_ms[i], out_ms, back_ms)
        return costs

    def matmul_keep(self, a: int, b: int) -> frozenset[int]:
        """The keepable matmul-like nodes of ``[a, b)``: the one non-empty keep most solvers
        try."""
        return frozenset(i for i in range(a, b) if self.is_matmul(i) and self.can_keep(i))

    def recomputable_runs(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Maximal runs ``(a, b)`` of recomputable nodes inside ``[start, stop)``."""
        runs: list[tuple[int, int]] = []
        first = None
        for i in range(start, stop + 1):
            ok = i < stop and self.recomputable[i]
            if ok and first is None:
                first = i
            elif not ok and first is not None:
                runs.append((first, i))
                first = None
        return runs

    def is_matmul(self, i: int) -> bool:
        """Whether node i is matmul-like per `op_kind` (False when op kinds are unknown)."""
        return self._kind(i) in MATMUL_KINDS

    def is_linear(self, i: int) -> bool:
        """Whether node i is a linear layer's matmul per `op_kind` (`LINEAR_KINDS`)."""
        return self._kind(i) in LINEAR_KINDS

    def _kind(self, i: int) -> str | None:
        return None if self.op_kind is None else self.op_kind[i].lower().rsplit(".", 1)[-1]

    @property
    def total_fwd_time_ms(self) -> float:
        """Forward time of the whole graph, no recomputation."""
        return float(sum(self.fwd_time_ms))

    @property
    def total_bwd_time_ms(self) -> float:
        """Backward time of the whole graph."""
        return float(sum(self.bwd_time_ms))

    def stages(self) -> list[tuple[int, int]]:
        """Blocks and the single nodes between them, in order: the candidate cut points of
        solvers that cut at block boundaries."""
        out: list[tuple[int, int]] = []
        pos = 0
        for a, b in self.blocks():
            out.extend((i, i + 1) for i in range(pos, a))
            out.append((a, b))
            pos = b
        out.extend((i, i + 1) for i in range(pos, self.n_nodes))
        return out

    def blocks(self) -> list[tuple[int, int]]:
        """Maximal runs `(start, stop)` of consecutive nodes sharing a block id >= 0."""
        if self.block_of_node is None:
            return []
        runs: list[tuple[int, int]] = []
        start = 0
        for i in range(1, self.n_nodes + 1):
            if i == self.n_nodes or self.block_of_node[i] != self.block_of_node[start]:
                if self.block_of_node[start] >= 0:
                    runs.append((start, i))
                start = i
        return runs

    # ---------------------------------------------------------------- builders

    @classmethod
    def chain(
        cls,
        act_bytes: Sequence[int],
        fwd_time_ms: Sequence[float],
        bwd_time_ms: Sequence[float] | None = None,
        *,
        static_bytes: int = 0,
        fwd_temp_bytes: Sequence[int] | None = None,
        bwd_temp_bytes: Sequence[int] | None = None,
        param_grad_bytes: Sequence[int] | None = None,
        recomputable: Sequence[bool] | None = None,
        block_of_node: Sequence[int] | None = None,
        name: str = "chain",
    ) -> Problem:
        """A chain: node i reads node i-1's output and saves it (like a linear layer).

        Node 0 reads only static inputs and saves nothing; node i allocates one storage of
        `act_bytes[i]` whose gradient has the same size. Backward time defaults to 2x forward.

        >>> p = Problem.chain([4, 4, 1], [1.0, 1.0, 1.0])
        >>> p.node_saved
        [[], [0], [1]]
        """
        n = len(act_bytes)
        bwd = list(bwd_time_ms) if bwd_time_ms is not None else [2.0 * t for t in fwd_time_ms]
        return cls(
            name=name,
            node_names=[f"n{i}" for i in range(n)],
            fwd_time_ms=list(fwd_time_ms),
            bwd_time_ms=bwd,
            fwd_temp_bytes=list(fwd_temp_bytes) if fwd_temp_bytes is not None else [0] * n,
            bwd_temp_bytes=list(bwd_temp_bytes) if bwd_temp_bytes is not None else [0] * n,
            recomputable=list(recomputable) if recomputable is not None else [True] * n,
            node_inputs=[[]] + [[i - 1] for i in range(1, n)],
            node_outputs=[[i] for i in range(n)],
            node_saved=[[]] + [[i - 1] for i in range(1, n)],
            storage_bytes=list(act_bytes),
            storage_producer=list(range(n)),
            storage_grad_bytes=list(act_bytes),
            static_bytes=static_bytes,
            param_grad_bytes=list(param_grad_bytes) if param_grad_bytes is not None else [0] * n,
            block_of_node=list(block_of_node) if block_of_node is not None else None,
        )

    @classmethod
    def from_networkx(cls, graph: nx.DiGraph, *, static_bytes: int = 0,
                      name: str = "graph") -> Problem:
        """Build from a DAG whose edges are data dependencies, one output storage per node.

        Node attributes: `output_bytes` (required), `fwd_time_ms` (required), and optional
        `bwd_time_ms` (default 2x forward), `fwd_temp_bytes`, `bwd_temp_bytes`,
        `param_grad_bytes` (default 0), `recomputable` (True), `saves_inputs` (True),
        `saves_output` (False), `grad_bytes` (default `output_bytes`), `block` (-1).
        Nodes are ordered topologically (ties by insertion order); the graph needs exactly
        one sink, the loss.
        """
        _check(nx.is_directed_acyclic_graph(graph), "graph has a cycle; pass a DAG.")
        order_key = {v: k for k, v in enumerate(graph.nodes)}
        order = list(nx.lexicographical_topological_sort(graph, key=lambda v: order_key[v]))
        sinks = [v for v in order if graph.out_degree(v) == 0]
        _check(len(sinks) == 1, f"graph must have exactly one sink (the loss); found {sinks}.")
        index = {v: k for k, v in enumerate(order)}
        attrs = [graph.nodes[v] for v in order]
        for v, a in zip(order, attrs, strict=True):
            for key in ("output_bytes", "fwd_time_ms"):
                _check(key in a, f"graph node {v!r} lacks attribute {key!r}.")
        inputs = [sorted(index[u] for u in graph.predecessors(v)) for v in order]
        saved = []
        for k, a in enumerate(attrs):
            s = list(inputs[k]) if a.get("saves_inputs", True) else []
            if a.get("saves_output", False):
                s.append(k)
            saved.append(s)
        blocks = [int(a.get("block", -1)) for a in attrs]
        return cls(
            name=name,
            node_names=[str(v) for v in order],
            fwd_time_ms=[float(a["fwd_time_ms"]) for a in attrs],
            bwd_time_ms=[float(a.get("bwd_time_ms", 2.0 * a["fwd_time_ms"])) for a in attrs],
            fwd_temp_bytes=[int(a.get("fwd_temp_bytes", 0)) for a in attrs],
            bwd_temp_bytes=[int(a.get("bwd_temp_bytes", 0)) for a in attrs],
            recomputable=[bool(a.get("recomputable", True)) for a in attrs],
            node_inputs=inputs,
            node_outputs=[[k] for k in range(len(order))],
            node_saved=saved,
            storage_bytes=[int(a["output_bytes"]) for a in attrs],
            storage_producer=list(range(len(order))),
            storage_grad_bytes=[int(a.get("grad_bytes", a["output_bytes"])) for a in attrs],
            static_bytes=static_bytes,
            param_grad_bytes=[int(a.get("param_grad_bytes", 0)) for a in attrs],
            block_of_node=blocks if any(b >= 0 for b in blocks) else None,
        )

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> Problem:
        """Copy, as pydantic does, but without the derived data cached from the old fields."""
        copied = super().model_copy(update=update, deep=deep)
        for name, attr in vars(Problem).items():
            if isinstance(attr, cached_property):
                copied.__dict__.pop(name, None)
        return copied

    def summary(self) -> dict[str, Any]:
        """A few headline numbers, for logs."""
        return {
            "name": self.name,
            "nodes": self.n_nodes,
            "storages": self.n_storages,
            "activation_bytes": sum(self.storage_bytes),
            "static_bytes": self.static_bytes,
            "fwd_time_ms": self.total_fwd_time_ms,
            "bwd_time_ms": self.total_bwd_time_ms,
        }
