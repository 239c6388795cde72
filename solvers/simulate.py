"""Replay one training step of a schedule: the single source of truth for memory and time.

Execution model (what `torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False)`
does in torch/utils/checkpoint.py; decisions where the brief was open are marked *):

Forward, in node order. Live bytes = static + live activation storages + gradients + the
running node's temporaries. A node's event peak is live-before + its new outputs + its
forward temp. A storage instance is freed as soon as nothing holds it:
- a later node of the same pass still reads it;
- a STORE node saved it for backward (held until that node's backward has run);
- a top-level RECOMPUTE region's frame holds its inputs (`_CheckpointFrame.saved_args`,
  storages produced before the region and read inside it) until the frame dies;
- selective checkpointing: a kept (MUST_SAVE) node's outputs sit in the SAC cache until the
  rerun consumes them, or until the frame dies if early stop never reaches that node;
- the outputs of the last node (the loss) are held by the caller for the whole step,
  except the tensors its own backward saves (log-softmax of a cross entropy), which are
  freed with its backward like any saved tensor.*
Saved tensors of nodes inside a RECOMPUTE region are packed as holders: nothing is held.

* Frame death: `solvers.frame` F7 (the frame's packs, its children's deaths).

Backward, nodes in reverse order. The first backward of a node that packed into frame F
(`solvers.frame` F1) unpacks a holder (on top of what that backward holds by then,
`GradientEvents.at_rerun`: the gradient buffers an in-place op on a view's backward makes
before it unpacks) and reruns F's forward from its first node
(`_checkpoint_hook.unpack_hook`), up to its early stop (F2), without running the last
node when the stop raises in a pack made before it runs (F3: it allocates and costs
nothing, and a kept one's SAC entry is never consumed, held until the frame dies). Kept
nodes are not re-run (the SAC cache returns the stored tensor: no time, no new memory) but
their saves still count. Rerun-regenerated saved tensors are new storages (memory is counted
again if the original is still held elsewhere) and live until the backward node that saves
them has run (torch's checkpoint.py "Rule 4"); other rerun tensors are freed after their last
reader inside the rerun or when the rerun stops.

* Nested regions: during a parent's rerun a child runs as a fresh checkpoint whose own
  saves are not kept; its inputs and its kept outputs live until that rerun ends. A child's
  rerun first needs its inputs unpacked from the parent, which reruns the parent first.

Time (`solvers.clock`, the one place each step's cost is said): forward and backward events
cost the nodes' `fwd_time_ms` / `bwd_time_ms`; a rerun costs the `fwd_time_ms` of the
nodes it runs (kept nodes are free) plus, once per frame that reruns (nested ones each on
their own), `clock.rerun_overhead_ms(start, rerun stop, keep, end)`: the host time of the
checkpoint itself (frame, RNG, pack/unpack hooks, SAC policy), charged to the rerun's first
event, and with the step's first rerun `clock.step_overhead_ms` once. Forward-side parts
of that overhead are counted there too, so `recompute_time_ms` is everything
checkpointing adds to the step.

Gradients (`Problem.gradient_events`, the same under every schedule): the gradient of a
storage appears during the backward of its last forward reader and is freed after its
producer's backward, except the loss's seed, which the caller's ``backward()`` holds to the
end; unread outputs of other nodes get no gradient.* Every earlier reader (in backward
order, a later one) makes a fresh gradient that autograd adds into the existing buffer once
the reader's work is done: the engine releases the node's saved tensors first
(`release_variables`, then `InputBuffer::add`), so that moment (`GradientEvents.releases`)
holds the summed gradients without what only that node saved, and frames that died with
it; a backward event's peak is the larger of the two moments. Parameter gradients appear
at the backward of `param_grad_bytes`' node and stay.

Offload (`Schedule.offloads`, moved storages and fetch times from `solvers.offload`): a
moved storage's saves hold nothing on the device; its first save copies it to the host
(from the end of that node on the device-to-host queue; a checkpoint's input save, before
its first node runs). At the end of the call the offload's `release` names (by default the
offloaded call itself, after its last node) compute waits until every copy the offloaded
call issued has ended (a stall), and their device storages are freed unless something else
holds them: the device memory does not depend on how fast the copies run. In the backward a
call's copies come back all at once when its prefetch is issued: each allocated from that
event on, held until its savers' backward has run (a checkpoint's inputs: until its frame
dies; its rerun reads them; a top-level checkpoint's kept outputs: until its rerun takes
them from the SAC cache, or the frame dies), and copied on the host-to-device queue (after
its own copy out). A prefetch issued at a node comes before that node reruns its checkpoint
(the gradient hook runs first). The backward node that needs them waits for the last (a
stall). Each direction is one queue, copies in issue order, beside compute; on a
`synchronous` link every copy stalls compute for its whole duration instead, and a copy out
frees the device storage at once. The host holds every moved storage from its copy out to
the end of the backward.

Optimizer step (`Problem.optimizer_step_bytes` > 0): one last event after the backward,
live bytes plus the step's temporaries.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import count
from typing import NamedTuple

from solvers.clock import rerun_overhead_ms, rerun_step_ms, step_overhead_ms
from solvers.copy_queues import CopyQueues
from solvers.frame import (
    ChildFrame,
    FrameRules,
    frame_end,
    frame_rules,
    own_packs,
    region_skips,
)
from solvers.offload import OffloadGroup, offload_groups
from solvers.problem import Problem
from solvers.schedule import Region, Schedule

logger = logging.getLogger(__name__)

__all__ = ["OPTIMIZER_STEP", "Event", "PeakBreakdown", "SimulationError", "Timeline",
           "optimizer_step_peak", "simulate"]

OPTIMIZER_STEP = "optimizer.step()"  # the label of the optimizer step's event


class SimulationError(ValueError):
    """The schedule cannot run on this problem (wrong size, recomputes or keeps a bad node)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One step of the replay: a forward, recompute or backward of one node.

    `cached`: a rerun step that does no work (a kept node's output comes from the SAC
    cache, or the rerun stops in the node's pack before running it).
    """

    label: str
    phase: str
    node: int
    time_ms: float
    live_bytes: int
    peak_bytes: int
    cached: bool = False


@dataclass(frozen=True, slots=True)
class PeakBreakdown:
    """What the live bytes are made of at the peak."""

    static_bytes: int = 0
    kept_activation_bytes: int = 0
    recomputed_activation_bytes: int = 0
    gradient_bytes: int = 0
    temp_bytes: int = 0
    prefetched_activation_bytes: int = 0  # offloaded activations back on the device

    @property
    def total_bytes(self) -> int:
        """Sum of the parts, equal to the peak."""
        return (self.static_bytes + self.kept_activation_bytes
                + self.recomputed_activation_bytes + self.gradient_bytes + self.temp_bytes
                + self.prefetched_activation_bytes)


@dataclass(frozen=True, slots=True)
class Timeline:
    """Result of `simulate`: events, peak memory and step time.

    Offload: `stall_time_ms` is the time compute waits for copies (on a synchronous link,
    every copy), `transfer_time_ms` the time both copy queues are busy, `offloaded_bytes` what
    goes to the host and comes back (the host's peak: all of it is there when the forward
    ends)."""

    events: tuple[Event, ...]
    peak_bytes: int
    peak_event: int
    forward_time_ms: float
    backward_time_ms: float
    recompute_time_ms: float
    breakdown: PeakBreakdown = field(default_factory=PeakBreakdown)
    stall_time_ms: float = 0.0
    transfer_time_ms: float = 0.0
    offloaded_bytes: int = 0

    @property
    def total_time_ms(self) -> float:
        """Forward + recompute + backward time of the step, and the stalls on copies."""
        return (self.forward_time_ms + self.recompute_time_ms + self.backward_time_ms
                + self.stall_time_ms)

    @property
    def added_time_ms(self) -> float:
        """What the schedule adds to the unplanned step: recompute and copy stalls."""
        return self.recompute_time_ms + self.stall_time_ms

    @property
    def peak_label(self) -> str:
        """Label of the event where the peak happens."""
        return self.events[self.peak_event].label


@dataclass(eq=False)
class _Frame:
    uid: int
    region: Region
    parent: _Frame | None
    children: list[_Frame]
    inputs: tuple[int, ...]
    rules: FrameRules  # where its rerun stops, whether its last step runs, when it dies
    keep: frozenset[int] = frozenset()  # `region.keep`, read at each step of its reruns
    skipped: frozenset[int] = frozenset()  # F9: rerun steps made uninitialized, in no time
    alive: bool = True
    recomputed: bool = False
    child_inputs: dict[int, tuple[int, int]] = field(default_factory=dict)


Inst = tuple[int, int]  # (storage id, generation: 0 = original forward, k = k-th rerun)


class Hold(IntEnum):
    """Why a storage instance is alive; it is freed when nothing holds it. (An IntEnum:
    tokens are hashed on every hold and release.)"""

    READ = 1  # a later node of the same pass reads it (key: the pass's generation)
    RERUN_END = 2  # a rerun needs it until the rerun ends (key: generation)
    FRAME = 3  # a checkpoint frame saved it as an input (key: frame)
    SAC = 4  # a frame's selective policy cached it (key: frame)
    CHILD_INPUT = 5  # a nested frame's input, saved into its parent's rerun (key: child)
    BACKWARD = 6  # autograd saved it for a node's backward (key: node)
    CALLER = 7  # the caller holds it all step: the loss, what the program keeps
    COPY = 8  # an offload copy to the host reads it (key: storage)


class Token(NamedTuple):
    """One hold on storage instances: released all at once (`_Replay._release`)."""

    why: Hold
    key: int = 0


def _bucket(inst: Inst) -> int:
    """Where an instance's bytes count: 0 the original forward's, 1 a rerun's (generation
    k > 0), 2 brought back from the host (generation -1)."""
    return 0 if inst[1] == 0 else 1 if inst[1] > 0 else 2


@dataclass(slots=True)
class _PassRun:
    """One forward pass of `_Replay._pass`: its environment (storage -> instance), the rerun
    frame (None: the original forward), where it stops, its generation and hold tokens,
    each storage's last reader in it and the children's inputs it makes."""

    env: dict[int, Inst]
    root: _Frame | None
    stop: int
    gen: int
    read_tok: Token
    end_tok: Token
    last_read: dict[int, int]
    child_args: set[int]


class _Replay:
    """Mutable state of one replay; `simulate` builds one per call."""

    def __init__(self, p: Problem, schedule: Schedule) -> None:
        self.p = p
        self.n = p.n_nodes
        self.holds: dict[Inst, set[Token]] = {}
        self.by_token: dict[Token, set[Inst]] = defaultdict(set)
        self.live_act = [0, 0, 0]  # [original, recomputed, prefetched] activation bytes
        self.live_grad = 0
        self.events: list[Event] = []
        self.peak = -1
        self.peak_event = 0
        self.breakdown = PeakBreakdown()
        self.times = {"forward": 0.0, "recompute": 0.0, "backward": 0.0}
        self.reran = False  # a region reran (the step pays `clock.step_overhead_ms`)
        self.gens = count(1)
        self.frames: list[_Frame] = []
        self.innermost: list[_Frame | None] = [None] * self.n
        self.top_entries: dict[int, list[_Frame]] = defaultdict(list)
        self.deaths: dict[int, list[_Frame]] = defaultdict(list)
        self.end_of_forward: dict[int, list[_Frame]] = defaultdict(list)
        for r in schedule.regions:
            if r.is_recompute:
                self._build_frame(r, None)
        for f in self.frames:
            end = frame_end(f.rules, f.region.stop)
            (self.deaths if end.backward else self.end_of_forward)[end.node].append(f)
        self.copies = CopyQueues(p, offload_groups(p, schedule))
        # a call with checkpointed op ranges runs as its fx trace: its values' lifetimes
        self.uses, self.readers = p.traced_lives(_traced_owners(p, schedule))

    # ------------------------------------------------------------ structure

    def _build_frame(self, r: Region, parent: _Frame | None) -> _Frame:
        p = self.p
        inputs = p.region_inputs(r.start, r.stop)
        f = _Frame(len(self.frames), r, parent, [], inputs, FrameRules(0, False, None), r.keep)
        self.frames.append(f)
        if parent is None:
            self.top_entries[r.start].append(f)
        for i in range(r.start, r.stop):
            self.innermost[i] = f
        f.children = [self._build_frame(c, f) for c in r.children]
        own = own_packs(p, r.start, r.stop, [(c.start, c.stop) for c in r.children])
        f.rules = frame_rules(p, own, [ChildFrame(c.region.start, c.rules)
                                       for c in f.children if c.inputs])
        if parent is None:
            f.skipped = region_skips(p, r)
        return f

    # ------------------------------------------------------------ memory

    def _alloc(self, inst: Inst) -> None:
        self.holds[inst] = set()
        self.live_act[_bucket(inst)] += self.p.storage_bytes[inst[0]]

    def _hold(self, inst: Inst, tok: Token) -> None:
        self.holds[inst].add(tok)
        self.by_token[tok].add(inst)

    def _free_if_unheld(self, inst: Inst) -> None:
        if inst in self.holds and not self.holds[inst]:
            del self.holds[inst]
            self.live_act[_bucket(inst)] -= self.p.storage_bytes[inst[0]]

    def _release(self, tok: Token) -> None:
        for inst in self.by_token.pop(tok, ()):
            self.holds[inst].discard(tok)
            self._free_if_unheld(inst)

    def _release_one(self, inst: Inst, tok: Token) -> None:
        if inst in self.holds and tok in self.holds[inst]:
            self.holds[inst].discard(tok)
            self.by_token[tok].discard(inst)
            self._free_if_unheld(inst)

    def _live(self) -> int:
        return self.p.static_bytes + sum(self.live_act) + self.live_grad

    def _parts(self, grad: int, temp: int) -> tuple[int, int, int, int, int]:
        """What the live bytes are made of now, for `_record`'s `PeakBreakdown` (built only
        for an event that raises the peak)."""
        live = self.live_act
        return live[0], live[1], grad, temp, live[2]

    def _record(self, label: str, phase: str, node: int, time_ms: float, peak: int,
                parts: tuple[int, int, int, int, int], cached: bool = False) -> None:
        if peak > self.peak:
            self.peak, self.peak_event = peak, len(self.events)
            self.breakdown = PeakBreakdown(self.p.static_bytes, *parts)
        self.events.append(Event(label, phase, node, time_ms, self._live(), peak, cached))
        self.times[phase] += time_ms
        self.copies.clock += time_ms

    # ------------------------------------------------------------ offload

    def _release_copies(self, i: int) -> None:
        """After node i, the end of the call that releases some offloaded calls: their
        copies to the host end (compute waits for them) and their device side is freed."""
        for g in self.copies.drains.get(i, ()):
            for s in self.copies.drain(g):
                self._release_one((s, 0), Token(Hold.COPY, s))

    def _copy_out(self, i: int, env: dict[int, Inst], time_ms: float) -> None:
        """Node i's saves that start a copy to the host (after node i has run)."""
        for s in self.copies.out_at.get(i, ()):
            if self.copies.start_out(s, time_ms):  # synchronous: done already
                self._release_one(env[s], Token(Hold.COPY, s))

    def _bring_back(self, groups: list[OffloadGroup]) -> None:
        """Issue the copies back of `groups` (those not issued yet)."""
        for g in groups:
            if self.copies.start_in(g):
                for s in g.moved:
                    self._alloc((s, -1))
                    for k in g.savers.get(s, ()):
                        self._hold((s, -1), Token(Hold.BACKWARD, k))
                    for why, held in ((Hold.FRAME, g.frames), (Hold.SAC, g.cached)):
                        for start in held.get(s, ()):
                            for f in self.top_entries[start]:
                                self._hold((s, -1), Token(why, f.uid))
                    self._free_if_unheld((s, -1))

    # ------------------------------------------------------------ passes

    def _pass(self, start: int, stop: int, env: dict[int, Inst], root: _Frame | None,
              overhead_ms: float = 0.0, last_not_run: bool = False) -> None:
        """Run nodes start..stop-1 forward (root None: the original forward; else a rerun).

        `overhead_ms` (a rerun's checkpoint overhead) is added to the first event's time;
        `last_not_run`: the rerun stops in node stop-1's pack, before running it.
        """
        gen = 0 if root is None else next(self.gens)
        last_read: dict[int, int] = {}  # within this pass, what keeps each storage alive
        for i in range(start, stop):
            for s in self.uses[i]:
                last_read[s] = i
        child_args = set() if root is None else {
            s for c in root.children if c.region.start <= stop for s in c.inputs}
        run = _PassRun(env, root, stop, gen, Token(Hold.READ, gen), Token(Hold.RERUN_END, gen),
                       last_read, child_args)
        for s, inst in env.items():
            if s in last_read:
                self._hold(inst, run.read_tok)
            if root is not None:
                self._hold(inst, run.end_tok)
        for i in range(start, stop):
            self._step(run, i, overhead_ms if i == start else 0.0,
                       last_not_run and i == stop - 1)
        if root is not None:  # early stop may fall on a child's entry (its inputs' save)
            self._enter_children(root, stop, env, run.end_tok)
        self._release(run.read_tok)
        self._release(run.end_tok)

    def _step(self, run: _PassRun, i: int, overhead_ms: float, not_run: bool) -> None:
        """Node i of a pass: checkpoint entries, its outputs, holds, frees, its event.
        `not_run`: it packs its inputs only; its outputs (a kept one's too) stay unmade."""
        p, root, env = self.p, run.root, run.env
        inner = self.innermost[i]
        # checkpoint entries at i: inputs saved by the frame (top-level) or the parent
        if root is None:
            for f in self.top_entries.get(i, ()):
                to_host = self.copies.frame_inputs.get(i, ())
                for s in f.inputs:
                    if s not in to_host:
                        self._hold(env[s], Token(Hold.FRAME, f.uid))
            for s in self.copies.entry_out_at.get(i, ()):  # saved before node i runs
                self._hold(env[s], Token(Hold.COPY, s))
                if self.copies.start_out(s, 0.0):
                    self._release_one(env[s], Token(Hold.COPY, s))
        else:
            self._enter_children(root, i, env, run.end_tok)
        cached = root is not None and inner is root and i in root.keep
        before = self._live()
        new: list[Inst] = []
        if cached and not not_run:
            on_host = self.copies.frame_keeps.get(root.region.start, ()) if root.parent is None \
                else ()
            for s in p.outputs[i]:
                env[s] = (s, -1) if s in on_host else (s, 0)
        elif not not_run:
            for s in p.outputs[i]:
                env[s] = (s, run.gen)
                self._alloc((s, run.gen))
                new.append((s, run.gen))
        alloc = sum(p.storage_bytes[s] for s, _ in new)
        temp = 0 if cached or not_run else \
            p.fwd_event_bytes[i] if root is None else p.fwd_temp_bytes[i]
        parts = self._parts(self.live_grad, temp)
        self._hold_made(run, i, inner, not_run)
        # frees after this node
        if cached and not not_run:
            for s in p.outputs[i]:
                self._release_one(env[s], Token(Hold.SAC, root.uid))
        for s in self.uses[i]:
            if run.last_read.get(s) == i and s in env:
                self._release_one(env[s], run.read_tok)
        for inst in new:
            self._free_if_unheld(inst)
        if root is None:
            for f in self.end_of_forward.get(i, ()):
                self._kill(f)
        skipped = root is not None and i in root.skipped
        label = _event_label(p.node_names[i], root is None, not_run, skipped)
        time = rerun_step_ms(p, i, cached or not_run or skipped, overhead_ms)
        if root is None:
            self._copy_out(i, env, time)
        self._record(label, "forward" if root is None else "recompute", i, time,
                     before + alloc + temp, parts, cached or not_run)
        if root is None:
            self._release_copies(i)

    def _hold_made(self, run: _PassRun, i: int, inner: _Frame | None, not_run: bool) -> None:
        """The holds node i makes: later readers and a rerun's end (unless `not_run`), the
        caller, its saves (outside checkpoints, or in the rerun's own frame: a node that
        stops the rerun in its pack still saves) and SAC caches."""
        p, root, env = self.p, run.root, run.env
        for s in () if not_run else p.outputs[i]:
            later = [c for c in self.readers[s] if c > i]
            if any(c < run.stop for c in later):
                self._hold(env[s], run.read_tok)
            # a rerun's value needed past its early stop: held until the rerun ends
            if s in run.child_args or (root is not None and later and later[-1] >= run.stop):
                self._hold(env[s], run.end_tok)
        if root is None:
            for s in p.outputs[i]:  # the loss tensor (not its internals: those go with
                if s in p.caller_held:  # its backward) and what the caller keeps
                    self._hold(env[s], Token(Hold.CALLER))
            if inner is None:
                to_host = self.copies.to_host.get(i, ())
                for s in p.saved[i]:
                    if s not in to_host:
                        self._hold(env[s], Token(Hold.BACKWARD, i))
                    elif self.copies.out_of.get(s) == i:
                        self._hold(env[s], Token(Hold.COPY, s))
            elif i in inner.keep:
                on_host = self.copies.frame_keeps.get(inner.region.start, ()) \
                    if inner.parent is None else ()
                for s in p.outputs[i]:
                    if s not in on_host:
                        self._hold(env[s], Token(Hold.SAC, inner.uid))
                    elif self.copies.out_of.get(s) == i:
                        self._hold(env[s], Token(Hold.COPY, s))
        elif inner is root:
            if p.packs[i]:
                for s in p.saved[i]:
                    self._hold(env[s], Token(Hold.BACKWARD, i))
        elif i in inner.keep:
            for s in p.outputs[i]:
                self._hold(env[s], run.end_tok)

    def _enter_children(self, root: _Frame, i: int, env: dict[int, Inst], end_tok: Token) -> None:
        """During root's rerun, a child entered at node i saves its inputs into root."""
        for c in root.children:
            if c.region.start == i and c.inputs:
                for s in (s for s in c.inputs if s in env):
                    self._hold(env[s], end_tok)
                    if c.alive:
                        self._hold(env[s], Token(Hold.CHILD_INPUT, c.uid))
                        c.child_inputs[s] = env[s]

    def _kill(self, f: _Frame) -> None:
        f.alive = False
        for why in (Hold.FRAME, Hold.SAC, Hold.CHILD_INPUT):
            self._release(Token(why, f.uid))

    def _ensure_recomputed(self, f: _Frame) -> None:
        if f.recomputed:
            return
        if f.parent is not None and f.inputs:
            self._ensure_recomputed(f.parent)
        if f.parent is None:  # its inputs, or the copies of those it saved to the host
            needed = self.copies.rerun_need.get(f.region.start, [])
            self._bring_back(needed)
            for g in needed:
                self.copies.wait_for(g)
            moved = self.copies.frame_inputs.get(f.region.start, set())
            env = {s: (s, -1) if s in moved else (s, 0) for s in f.inputs}
        else:
            env = dict(f.child_inputs)
        f.recomputed = True
        logger.debug("rerun of region [%d, %d) up to node %d", f.region.start,
                     f.region.stop, f.rules.rerun_stop)
        overhead = rerun_overhead_ms(self.p, f.region.start, f.rules.rerun_stop, f.keep,
                                     f.region.stop)
        if f.rules.rerun_stop > f.region.start and not self.reran:
            self.reran = True  # the step's first rerun
            overhead += step_overhead_ms(self.p)
        self._pass(f.region.start, f.rules.rerun_stop, env, f, overhead, f.rules.last_not_run)
        self._release(Token(Hold.CHILD_INPUT, f.uid))

    def forward(self) -> None:
        """The original forward pass."""
        self._pass(0, self.n, {}, None)

    def backward(self) -> None:
        """Backward in reverse node order, with reruns on first unpack."""
        p = self.p
        for j in range(self.n - 1, -1, -1):
            f = self.innermost[j]
            # the gradient hook on a call's output prefetches before the node unpacks (which
            # reruns its checkpoint, or fetches the offloaded calls it needs and waits)
            self._bring_back(self.copies.fetch_at.get(j, []))
            grads = p.gradient_events
            if f is not None and p.packs[j]:
                # the rerun starts at j's first unpack, on top of what j's backward holds
                self.live_grad = grads.at_rerun[j]
                self._ensure_recomputed(f)
            needed = self.copies.need_at.get(j, [])
            self._bring_back(needed)
            for g in needed:
                self.copies.wait_for(g)
            self.live_grad = grads.before[j]
            peak = self._live() + grads.added[j] + p.bwd_temp_bytes[j]
            parts = self._parts(self.live_grad + grads.added[j], p.bwd_temp_bytes[j])
            self.live_grad = grads.after[j]
            self._release(Token(Hold.BACKWARD, j))
            for fr in self.deaths.get(j, ()):
                self._kill(fr)
            if grads.releases(j):  # its gradients summed once its saved tensors are gone
                summed = self._live() - grads.after[j] + grads.released[j]
                if summed > peak:
                    peak, parts = summed, self._parts(grads.released[j], 0)
            self._record(f"bwd:{p.node_names[j]}", "backward", j, p.bwd_time_ms[j], peak,
                         parts)

    def optimizer_step(self) -> None:
        """The optimizer's step after the backward, when the budget covers it: what is
        still live (static, gradients, what the caller holds) plus its temporaries. Its
        time is not modelled (the same under every schedule)."""
        p = self.p
        if not p.optimizer_step_bytes:
            return
        parts = self._parts(self.live_grad, p.optimizer_step_bytes)
        self._record(OPTIMIZER_STEP, "backward", 0, 0.0,
                     self._live() + p.optimizer_step_bytes, parts)


def _event_label(name: str, forward: bool, not_run: bool, skipped: bool) -> str:
    """How the timeline names a node's forward or rerun step."""
    return (f"fwd:{name}" if forward else f"recompute:{name}") + (
        " (stops in its pack)" if not_run else "") + (
        " (skipped: nothing needs it)" if skipped else "")


def _traced_owners(problem: Problem, schedule: Schedule) -> set[tuple[int, int]]:
    """The calls whose forward runs as its fx trace: those an op-range region cuts."""
    owners = set()
    for region in schedule.regions:
        for r in region.walk():
            span = problem.span(r.start, r.stop) if r.is_recompute else None
            if span is not None and span.owner is not None:
                owners.add(span.owner)
    return owners


def check_schedule(problem: Problem, schedule: Schedule) -> None:
    """Raise `SimulationError` if `schedule` does not fit `problem`."""
    if schedule.n_nodes != problem.n_nodes:
        raise SimulationError(
            f"schedule covers {schedule.n_nodes} nodes but problem {problem.name!r} has "
            f"{problem.n_nodes}; build the schedule for this problem."
        )
    for r in schedule.recompute_regions():
        if not problem.emittable(r.start, r.stop):
            raise SimulationError(
                f"RECOMPUTE region [{r.start}, {r.stop}) is not one of problem "
                f"{problem.name!r}'s module spans: the planner can only checkpoint calls of "
                f"the model's modules; choose regions from problem.module_spans."
            )
        for i in range(r.start, r.stop):
            if not problem.recomputable[i]:
                raise SimulationError(
                    f"node {i} ({problem.node_names[i]}) is not recomputable (stateful, e.g. "
                    f"BatchNorm in training) but lies in RECOMPUTE region "
                    f"[{r.start}, {r.stop}); put it in a STORE region."
                )
        _check_keeps(problem, r)
    _check_offloads(problem, schedule)


def _check_keeps(problem: Problem, r: Region) -> None:
    for k in sorted(r.keep):
        if not problem.can_keep(k):
            raise SimulationError(
                f"node {k} ({problem.node_names[k]}) is kept in RECOMPUTE region "
                f"[{r.start}, {r.stop}) but keepable[{k}] is False (its output cannot be "
                f"saved by selective checkpointing, e.g. an in-place op finishes it); "
                f"remove it from the region's keep."
            )


def _check_offloads(problem: Problem, schedule: Schedule) -> None:
    if schedule.offloads and problem.host_link is None:
        raise SimulationError(
            f"the schedule offloads but problem {problem.name!r} has no host_link (how fast "
            "the device copies to host memory); build the problem from a profile of a "
            "device with one, or set Problem.host_link.")
    for o in schedule.offloads:
        if o.stop > problem.n_nodes or (problem.module_spans is not None
                                        and not problem.is_call(o.start, o.stop)):
            raise SimulationError(
                f"offload [{o.start}, {o.stop}) is not one of problem {problem.name!r}'s "
                "module spans: only a call of one of the model's modules can be offloaded.")
        if o.release is not None and problem.module_spans is not None \
                and not problem.is_call(*o.release):
            raise SimulationError(
                f"offload [{o.start}, {o.stop}) is released at the end of {list(o.release)}, "
                f"not one of problem {problem.name!r}'s module spans: a module's forward "
                "hook waits for the copies.")


def simulate(problem: Problem, schedule: Schedule) -> Timeline:
    """Replay one step (forward, loss, backward) of `schedule` on `problem`.

    >>> from solvers.problem import Problem
    >>> p = Problem.chain([10, 10, 1], [1.0, 1.0, 1.0])
    >>> simulate(p, Schedule.store_all(3)).peak_bytes  # 21 forward + loss seed + grad of s1
    32
    """
    check_schedule(problem, schedule)
    if not schedule.recompute_regions() and not schedule.offloads:
        return _unplanned(problem)
    return _replayed(problem, schedule)


# The unplanned step of each live problem, replayed once: every solver scores it and the
# planner reports it, and on a 70B-parameter profile one replay takes seconds. Keyed by the
# object (problems are immutable; a changed copy is another object), dropped with it.
_UNPLANNED: dict[int, Timeline] = {}


def _unplanned(problem: Problem) -> Timeline:
    key = id(problem)
    timeline = _UNPLANNED.get(key)
    if timeline is None:
        timeline = _UNPLANNED[key] = _replayed(problem, Schedule.store_all(problem.n_nodes))
        weakref.finalize(problem, _UNPLANNED.pop, key, None)
    return timeline


def share_unplanned(original: Problem, copy: Problem) -> Problem:
    """`copy`, a copy of `original` that changes nothing its unplanned step depends on
    (`solvers.auto.calls_only`: fewer regions to choose from), answering that step from
    `original`'s replay."""
    key = id(copy)
    if key not in _UNPLANNED:
        _UNPLANNED[key] = _unplanned(original)
        weakref.finalize(copy, _UNPLANNED.pop, key, None)
    return copy


def _replayed(problem: Problem, schedule: Schedule) -> Timeline:
    replay = _Replay(problem, schedule)
    replay.forward()
    replay.backward()
    replay.optimizer_step()
    return Timeline(
        events=tuple(replay.events),
        peak_bytes=replay.peak,
        peak_event=replay.peak_event,
        forward_time_ms=replay.times["forward"],
        backward_time_ms=replay.times["backward"],
        recompute_time_ms=replay.times["recompute"],
        breakdown=replay.breakdown,
        stall_time_ms=replay.copies.stall_ms,
        transfer_time_ms=replay.copies.transfer_ms,
        offloaded_bytes=replay.copies.moved_bytes,
    )


def optimizer_step_peak(problem: Problem) -> int:
    """The peak of the optimizer step after the backward, the same under every schedule (all
    frames have died, every gradient is made): a floor under any schedule's peak. 0 when
    the problem has no optimizer step."""
    if not problem.optimizer_step_bytes:
        return 0
    return simulate(problem, Schedule.store_all(problem.n_nodes)).events[-1].peak_bytes
