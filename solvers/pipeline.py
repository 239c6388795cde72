"""A pipeline stage's step: the order torch's schedules run its microbatches in, and the
stage's peak, replayed from one microbatch's timelines.

What ``torch.distributed.pipelining`` (torch 2.14: ``schedules.py``, ``stage.py``) does on
stage ``r`` of ``p``, for one step of ``m`` microbatches:

- Order (:mod:`solvers.pipeline_orders`). ``GPipe`` runs every forward, then every
  backward, in microbatch order. ``1F1B`` runs ``min(m, p - r)`` forwards, then one
  backward and one forward in turn, then the backwards left. The last stage computes each
  microbatch's loss right after its forward.
- Between its forward and its backward a microbatch holds what its forward saved and its
  output (``fwd_cache``): ``held_bytes``; its own backward keeps the output referenced.
- Buffers made once per microbatch and kept: the received activations (non-first stages;
  on the first, the chunks of the user's batch) and the received gradients (non-last
  stages; the timelines must not make the output's gradient themselves).
- The last stage keeps each microbatch's output until the next step (``output_chunks``,
  ``return_outputs=True``) and, at the end, concatenates them (``_merge_outputs``); it
  keeps each loss until the step ends (``_internal_losses``), and one target per
  microbatch.
- A non-first stage keeps the input gradient of its last backward (``grads_input``) until
  the next backward replaces it.
- A send's work keeps the tensor it sent (measured over gloo). ``GPipe`` keeps every
  send's work until the step ends (``fwd_sends_to_wait``, ``bwd_sends_to_wait``), as the
  runtime schedules below do; ``1F1B`` keeps the work of its warm-up's last send fired,
  microbatch ``w − 2``'s output, until its phase of one backward and one forward ends
  (``send_work``).
- Gradients of the parameters exist from the stage's first backward on: forwards before it
  replay the timeline of a step that starts without them, everything after it the
  timeline of one that starts with them.
- ``Interleaved1F1B`` gives rank ``r`` of ``p`` several model chunks (``num_chunks`` = v,
  torch's local stages): chunk ``c`` is the pipeline's stage ``c·p + r`` of ``v·p``, a
  stage of its own (buffers, outputs, gradients as above), run in the order of
  :func:`solvers.pipeline_orders.interleaved`. A chunk idle during another's pass holds
  its parameters, its gradients once its first backward ran, and its buffers and
  in-flight microbatches. Torch's runtime schedules keep every send until the step ends.
- Zero-bubble schedules split a backward into the input's gradient ("I") and, later, the
  weights' ("W"): ``InterleavedZeroBubble`` (chunks as ``Interleaved1F1B``),
  ``ZBVZeroBubble`` and ``DualPipeV`` (two chunks in a V: stages ``r`` and ``2p − 1 − r``;
  DualPipeV also runs full backwards). From its "I" to its "W" a microbatch holds what
  its forward saved and the gradients captured for the weights' pass
  (``SplitBackward.held``, measured by ``planner.pipeline.split_backward``); each pass peaks as
  measured above the live bytes before it. The pipeline's first stage runs no "I" and a
  full backward as its "W". The last stage keeps its output, a view, and with it what the
  weights' pass does not free, until the step ends (``SplitBackward.finished``).
- Two neighbouring stages on one rank (the turn of a V) hand their tensors over: the
  later one's input is the earlier one's output, the earlier one's output gradient the
  later one's input gradient; each replaces the receive buffer made for it, freed then.

Measured (`benchmarks/results/pipeline-stages-cpu.md`: gloo, 2 to 4 ranks, 2 to 8
microbatches, every schedule above, unplanned and planned): 332 rank peaks, 318 within 64
bytes of the prediction, none more than 4 bytes above it, the worst 0.01 % below it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from solvers import pipeline_orders as orders
from solvers.pipeline_orders import ChunkAction, Pass
from solvers.simulate import OPTIMIZER_STEP, Timeline

__all__ = ["STAGE_SCHEDULES", "ChunkReplay", "SplitBackward", "StageBoundary", "StageSpec",
           "held_after_forward", "rank_peak"]

# torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
# ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV
STAGE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble",
                   "ZBVZeroBubble", "DualPipeV")
ScheduleName = Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble",
                   "ZBVZeroBubble", "DualPipeV"]
Action = tuple[Pass, int]
# torch's _PipelineScheduleRuntime subclasses: several chunks (local stages) per rank
RUNTIME_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # two chunks, stages r and 2p - 1 - r
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


class StageSpec(BaseModel):
    """One stage of a pipeline, in torch's names; under a schedule of several stages per
    rank (``Interleaved1F1B``, ``InterleavedZeroBubble``: ``num_chunks``; ``ZBVZeroBubble``,
    ``DualPipeV``: two) one rank (``stage_index`` its rank in the pipeline's group,
    ``num_stages`` the ranks) running ``num_chunks`` stages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: ScheduleName
    # strict: True is no stage index, 1.5 no count (pydantic would take both as 1)
    stage_index: StrictInt = Field(ge=0)
    num_stages: StrictInt = Field(ge=1)
    n_microbatches: StrictInt = Field(ge=1)
    return_outputs: StrictBool = True  # ``schedule.step(..., return_outputs=...)``
    num_chunks: StrictInt = Field(default=1, ge=1)  # model chunks on this rank (local stages)

    @model_validator(mode="after")
    def _stage_in_range(self) -> StageSpec:
        m, p, schedule = self.n_microbatches, self.num_stages, self.schedule
        if self.stage_index >= p:
            raise ValueError(f"stage_index {self.stage_index} is not below num_stages {p}")
        if schedule == "1F1B" and m < p:
            raise ValueError(f"1F1B needs at least as many microbatches as stages (torch's "
                             f"Schedule1F1B refuses {m} for {p})")
        if schedule in V_SCHEDULES and self.num_chunks != 2:
            raise ValueError(f"{schedule} runs exactly two stages per rank (stages r and "
                             f"2p - 1 - r): give num_chunks=2, not {self.num_chunks}")
        if schedule == "DualPipeV" and m < 2 * p:
            raise ValueError(f"DualPipeV needs at least as many microbatches as stages "
                             f"(torch refuses {m} for {2 * p} stages on {p} ranks)")
        if self.num_chunks > 1 and schedule not in RUNTIME_SCHEDULES:
            raise ValueError(f"{schedule} runs one stage per rank: num_chunks "
                             f"{self.num_chunks} needs schedule='Interleaved1F1B' or "
                             "'InterleavedZeroBubble'")
        if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // p):
            raise ValueError(f"{schedule} needs the microbatches to be a multiple of its "
                             f"rounds (torch refuses {m} over {p} ranks)")
        return self

    @property
    def splits_backward(self) -> bool:
        """Backwards may run as two passes: the input's gradient ("I"), and later the
        weights' ("W")."""
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    @property
    def first(self) -> bool:
        """This rank holds the pipeline's first stage."""
        return self.chunk_first(0)

    @property
    def last(self) -> bool:
        """This rank holds the pipeline's last stage."""
        return any(self.chunk_last(c) for c in range(self.num_chunks))

    def chunk_stage(self, chunk: int) -> int:
        """The pipeline's stage index of this rank's ``chunk`` (of ``num_chunks`` · ranks):
        ``chunk · p + r``, or in a V ``r`` and ``2p − 1 − r``."""
        if self.schedule in V_SCHEDULES and chunk == 1:
            return 2 * self.num_stages - 1 - self.stage_index
        return chunk * self.num_stages + self.stage_index

    def chunk_first(self, chunk: int) -> bool:
        return self.chunk_stage(chunk) == 0

    def chunk_last(self, chunk: int) -> bool:
        return self.chunk_stage(chunk) == self.num_chunks * self.num_stages - 1

    def order(self) -> list[Action]:
        """The stage's forwards ("F") and backwards ("B") by microbatch, in run order (one
        chunk per rank; :meth:`actions` for any)."""
        if self.num_chunks > 1:
            raise ValueError("a rank of several chunks: use actions()")
        return [(kind, j) for kind, _, j in self.actions()]

    def actions(self) -> list[ChunkAction]:
        """The rank's passes, each on a chunk and a microbatch, in run order
        (:mod:`solvers.pipeline_orders`)."""
        m, p, r = self.n_microbatches, self.num_stages, self.stage_index
        if self.schedule == "GPipe":
            return orders.gpipe(m)
        if self.schedule == "1F1B":
            return orders.one_f_one_b(m, p, r)
        if self.schedule == "ZBVZeroBubble":
            return orders.zbv(m, p, r)
        if self.schedule == "DualPipeV":
            return orders.dualpipev(m, p, r)
        return orders.interleaved(m, p, r, self.num_chunks,
                                  split=self.schedule == "InterleavedZeroBubble")

    def in_flight(self) -> int:
        """The most microbatches between their forward and the end of their backward (the
        weights' pass, where it is split) at once (on a rank of several chunks, counted
        over its chunks)."""
        most = held = 0
        for kind, _, _ in self.actions():
            held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
            most = max(most, held)
        return most


class StageBoundary(NamedTuple):
    """One microbatch's bytes at the stage's edges, and what it holds between passes."""

    held_bytes: int  # what its forward leaves live in the timeline, until its backward
    input_bytes: int  # the stage's input (received activation or batch chunk)
    output_bytes: int  # the stage's output
    target_bytes: int = 0  # the last stage's loss target
    loss_bytes: int = 0  # the last stage's loss
    output_in_timeline: bool = False  # the timeline keeps the output through the backward


def held_after_forward(timeline: Timeline, static_bytes: int) -> int:
    """What one microbatch's forward leaves live: the live bytes after its last forward
    event, less the static memory."""
    forward = [e for e in timeline.events if e.phase == "forward"]
    return forward[-1].live_bytes - static_bytes if forward else 0


class SplitBackward(NamedTuple):
    """A split backward ("I", then "W") of one microbatch of a stage after the first, as
    measured (``planner.pipeline.split_backward``): each pass's peak above the live bytes before it,
    before the stage's first weights' pass and after it; what the microbatch holds from
    its "I" to its "W" beyond what its forward left; and what it holds from its "W" to the
    step's end beyond what a full backward leaves (the last stage keeps its output, and
    with a view the graph's saved tensors that the weights' pass does not free)."""

    input_rise: tuple[int, int]
    held: int
    weight_rise: tuple[int, int]
    finished: int = 0


class ChunkReplay(NamedTuple):
    """One chunk of a rank: its timelines for one microbatch (before and from its first
    backward), its boundary bytes, and what each timeline counts as static (parameters,
    one input, and in the second the gradients): an idle chunk holds that beside another's
    pass. ``split``: its split backward, where the schedule splits it and the chunk is not
    the pipeline's first stage (whose "I" does nothing and whose "W" is the full backward)."""

    before_grads: Timeline
    with_grads: Timeline
    boundary: StageBoundary
    static_before: int = 0
    static_with: int = 0
    split: SplitBackward | None = None


class _Chunk:
    """A chunk's state during the replay: its microbatches in flight (between their forward
    and their backward, or between a split backward's two passes), the outputs and losses
    it keeps, how many backwards (full or the input's) and weights' passes it ran; the bytes
    around each of its passes."""

    def __init__(self, spec: StageSpec, chunk: int, replay: ChunkReplay) -> None:
        b, m = replay.boundary, spec.n_microbatches
        self.replay, self.last = replay, spec.chunk_last(chunk)
        # a neighbouring stage on the same rank hands its tensors over: the input is that
        # stage's output (which it keeps), the output's gradient that stage's input
        # gradient (likewise); each replaces the receive buffer made for it, freed then
        self.feeder: _Chunk | None = None  # the chunk whose output is this one's input
        self.grad_feeder: _Chunk | None = None  # whose input gradient is its output's
        stages = [spec.chunk_stage(c) for c in range(spec.num_chunks)]
        local_input = stages[chunk] - 1 in stages
        local_grad = stages[chunk] + 1 in stages
        self.static_shift = -b.input_bytes if local_input else 0  # the timelines' input
        self.persistent = (0 if local_input else (m - 1) * b.input_bytes) + (
            (m - 1) * b.target_bytes if self.last else 0 if local_grad else m * b.output_bytes)
        self.microbatches = m
        self.own_output = 0 if b.output_in_timeline or self.last else b.output_bytes
        self.outputs_kept = b.output_bytes if self.last and spec.return_outputs else 0
        self.last_input_grad = 0 if spec.chunk_first(chunk) else b.input_bytes
        self.loss_bytes = b.loss_bytes if self.last else 0
        # torch's GPipe and runtime schedules (Interleaved1F1B, ...) keep each send's work,
        # and with it the tensor sent, until the step ends
        self.sends_kept = spec.schedule == "GPipe" or spec.schedule in RUNTIME_SCHEDULES
        # 1F1B keeps the work of its warmup's last send fired (microbatch w - 2) until the
        # phase of one backward and one forward ends
        warmup = min(m, spec.num_stages - spec.stage_index)
        self.pinned = warmup - 2 if spec.schedule == "1F1B" and warmup >= 2 else None
        self.cooling = False  # every forward ran, and a backward after the last
        self.held: set[int] = set()  # forward done, backward (full or the input's) not
        self.waiting: set[int] = set()  # the input's pass done, the weights' not
        self.waiting_bytes = b.held_bytes + (replay.split.held if replay.split else 0)
        self.finished_bytes = replay.split.finished if replay.split else 0  # per "W" run
        self.kept, self.backwards, self.weights, self.finished = 0, 0, 0, 0  # passes run
        self.pass_peaks = {key: peak + self.static_shift
                           for key, peak in _pass_peaks(spec, chunk, replay).items()}

    def around(self, kind: str | None, step_over: bool = False) -> int:
        """What the chunk holds beside its timeline during a pass of ``kind`` (None: while
        another chunk runs, its static memory included; ``step_over``: once the step's
        sends are done)."""
        b = self.replay.boundary
        static = 0 if kind else self.static_shift + (
            self.replay.static_with if self.weights else self.replay.static_before)
        running = kind in ("B", "I", "W")  # its own loss is in the pass's timeline
        return (static + self.persistent + self._receive_buffers() + len(self.held) * b.held_bytes
                + len(self.waiting) * self.waiting_bytes + self.finished * self.finished_bytes
                + self._outputs(kind, step_over) + self._input_grads(step_over)
                + self.kept * self.outputs_kept + (self.kept - running) * self.loss_bytes)

    def _receive_buffers(self) -> int:
        """The receive buffers a neighbour on the rank has not replaced yet."""
        b = self.replay.boundary
        inputs = (self.microbatches - self.feeder.kept) * b.input_bytes if self.feeder else 0
        grads = (self.microbatches - self.grad_feeder.backwards) * b.output_bytes \
            if self.grad_feeder else 0
        return inputs + grads

    def _outputs(self, kind: str | None, step_over: bool) -> int:
        """The outputs it holds outside its timeline: those of its microbatches in flight
        (and of the one whose backward runs), or under a runtime schedule every one sent."""
        in_flight = len(self.held) + len(self.waiting) + (kind in ("B", "I", "W"))
        if not self.sends_kept or step_over or self.last:
            pinned = self.pinned is not None and self.backwards > self.pinned and \
                not self.cooling and not self.last
            return in_flight * self.own_output + pinned * self.replay.boundary.output_bytes
        b = self.replay.boundary
        return (self.kept - (in_flight if b.output_in_timeline else 0)) * b.output_bytes

    def _input_grads(self, step_over: bool) -> int:
        """The input gradients it sent and still holds: the last one (until the next
        backward's send is waited), or under a runtime schedule every one."""
        if step_over or not self.backwards:
            return 0
        return self.last_input_grad * (self.backwards if self.sends_kept else 1)

    def run(self, kind: str, microbatch: int) -> int:
        """The chunk's peak during this pass, beside what it holds; then its state after."""
        (self.waiting if kind == "W" else self.held).discard(microbatch)
        peak = self.around(kind) + self.pass_peaks[kind, self.weights > 0]
        if kind == "F":
            self.held.add(microbatch)
            self.kept += 1
        if kind == "I":
            self.waiting.add(microbatch)
        self.backwards += kind in ("B", "I")
        self.weights += kind in ("B", "W")
        self.cooling = self.cooling or (kind == "B" and self.kept == self.microbatches)
        self.finished += kind == "W"
        return peak

    def end_of_step(self, m: int) -> int:
        """The last stage concatenates its outputs after the backwards: its live memory
        then, less the input's gradient (sent, then let go)."""
        end = [e.live_bytes for e in self.replay.with_grads.events
               if e.label != OPTIMIZER_STEP][-1] - self.last_input_grad
        b = self.replay.boundary
        return (end + self.static_shift + self.persistent + (m - 1) * b.loss_bytes
                + 2 * m * b.output_bytes + self.finished * self.finished_bytes)


def _pass_peaks(spec: StageSpec, chunk: int, replay: ChunkReplay) -> dict[tuple[str, bool], int]:
    """The peak of each pass of one microbatch, by pass and whether the chunk's gradients
    exist: the timelines' forward and backward; a split backward's passes from the full
    backward's (module docstring)."""
    peaks = {(kind, grads): max(
        (e.peak_bytes for e in timeline.events if e.label != OPTIMIZER_STEP
         and (e.phase == "forward") == (kind == "F")), default=0)
        for kind in "FB" for grads, timeline in ((False, replay.before_grads),
                                                 (True, replay.with_grads))}
    if not spec.splits_backward:
        return peaks
    split = replay.split
    if split is None and not spec.chunk_first(chunk):
        raise ValueError(f"{spec.schedule} splits the backward of chunk {chunk} (stage "
                         f"{spec.chunk_stage(chunk)}): its replay needs the split backward "
                         "measured (ChunkReplay.split)")
    for grads, static in ((False, replay.static_before), (True, replay.static_with)):
        held = static + replay.boundary.held_bytes  # live before its backward's first pass
        if split is None:  # the first stage: "I" does nothing, "W" is "B"
            peaks["I", grads], peaks["W", grads] = held, peaks["B", grads]
        else:
            peaks["I", grads] = held + split.input_rise[grads]
            peaks["W", grads] = held + split.held + split.weight_rise[grads]
    return peaks


def rank_peak(spec: StageSpec, chunks: list[ChunkReplay]) -> int:
    """The rank's peak over one step of ``spec``: each pass replays its chunk's timeline
    (``before_grads`` until the chunk's first backward, ``with_grads`` after it) beside what
    that chunk and the rank's other chunks hold (module docstring)."""
    if len(chunks) != spec.num_chunks:
        raise ValueError(f"{len(chunks)} chunks replayed for a rank of {spec.num_chunks}")
    states = [_Chunk(spec, c, replay) for c, replay in enumerate(chunks)]
    by_stage = {spec.chunk_stage(c): state for c, state in enumerate(states)}
    for c, state in enumerate(states):
        state.feeder = by_stage.get(spec.chunk_stage(c) - 1)
        state.grad_feeder = by_stage.get(spec.chunk_stage(c) + 1)
    peak = 0
    for kind, c, j in spec.actions():
        others = sum(state.around(None) for state in states if state is not states[c])
        peak = max(peak, others + states[c].run(kind, j))
    for state in states:
        if state.last and spec.return_outputs:  # the step returns the outputs concatenated
            others = sum(other.around(None, step_over=True) for other in states
                         if other is not state)
            peak = max(peak, others + state.end_of_step(spec.n_microbatches))
    return peak
