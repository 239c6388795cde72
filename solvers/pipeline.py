"""A pipeline stage's step: the order torch's schedules run its microbatches in, and the
stage's peak, replayed from one microbatch's timelines.

What ``torch.distributed.pipelining`` (torch 2.14: ``schedules.py``, ``stage.py``) does on
stage ``r`` of ``p``, for one step of ``m`` microbatches:

- Order. ``GPipe`` runs every forward, then every backward, in microbatch order.
  ``1F1B`` runs ``min(m, p - r)`` forwards, then one backward and one forward in turn, then
  the backwards left (``Schedule1F1B._step_microbatches``). The last stage computes each
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
- Gradients of the parameters exist from the stage's first backward on: forwards before it
  replay the timeline of a step that starts without them, everything after it the
  timeline of one that starts with them.
- ``Interleaved1F1B`` gives rank ``r`` of ``p`` several model chunks (``num_chunks`` = v,
  torch's local stages): chunk ``c`` is the pipeline's stage ``c·p + r`` of ``v·p``, a
  stage of its own (buffers, outputs, gradients as above). With ``q`` the microbatches per
  round (``m // max(1, m // p)``), the rank runs ``w = min((v − 1)·q + 2(p − 1 − r), m·v)``
  forwards, then one forward and one backward in turn, then the backwards left; its
  ``k``-th forward runs chunk ``(k // q) mod v``, its ``k``-th backward chunk
  ``v − 1 − (k // q) mod v``, each on that chunk's next microbatch
  (``ScheduleInterleaved1F1B._calculate_single_rank_operations``, whose order
  ``tests/test_pipeline.py`` compares with this one). A chunk idle during another's pass
  holds its parameters, its gradients once its first backward ran, and its buffers and
  in-flight microbatches.

Measured (`benchmarks/results/pipeline-stages-cpu.md`: gloo, 2 and 3 stages, 2 to 8
microbatches, GPipe and 1F1B, unplanned and with a plan per stage): 54 stage peaks, 37 to
64 bytes, none more than 4 bytes above the prediction, the worst 1.20 % below it (one
stage-boundary activation the replay counts and the stage had let go of).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from solvers.simulate import OPTIMIZER_STEP, Timeline

__all__ = ["STAGE_SCHEDULES", "ChunkReplay", "StageBoundary", "StageSpec", "held_after_forward",
           "rank_peak", "stage_peak"]

# torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B
STAGE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")

Action = tuple[Literal["F", "B"], int]
ChunkAction = tuple[Literal["F", "B"], int, int]  # pass, the rank's chunk, microbatch
RUNTIME_SCHEDULES = ("Interleaved1F1B",)  # torch's _PipelineScheduleRuntime subclasses
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


class StageSpec(BaseModel):
    """One stage of a pipeline, in torch's names; under ``Interleaved1F1B`` one rank
    (``stage_index`` its rank in the pipeline's group, ``num_stages`` the ranks) running
    ``num_chunks`` stages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: Literal["GPipe", "1F1B", "Interleaved1F1B"]
    stage_index: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    n_microbatches: int = Field(ge=1)
    return_outputs: bool = True  # ``schedule.step(..., return_outputs=...)``
    num_chunks: int = Field(default=1, ge=1)  # model chunks on this rank (local stages)

    @model_validator(mode="before")
    @classmethod
    def _schedule_planned(cls, fields: Any) -> Any:
        schedule = fields.get("schedule") if isinstance(fields, dict) else None
        if schedule in SPLIT_BACKWARD_SCHEDULES:
            raise ValueError(
                f"{schedule} is not planned yet: it splits each backward into the input's "
                "gradient and, later, the weights' (what a stage keeps between the two is "
                "not profiled, and torch reruns a checkpointed region once more for each "
                "parameter group in it when the weights' pass runs). Plan with GPipe, "
                "1F1B or Interleaved1F1B")
        return fields

    @model_validator(mode="after")
    def _stage_in_range(self) -> StageSpec:
        if self.stage_index >= self.num_stages:
            raise ValueError(f"stage_index {self.stage_index} is not below num_stages "
                             f"{self.num_stages}")
        if self.schedule == "1F1B" and self.n_microbatches < self.num_stages:
            raise ValueError(f"1F1B needs at least as many microbatches as stages (torch's "
                             f"Schedule1F1B refuses {self.n_microbatches} for "
                             f"{self.num_stages})")
        if self.num_chunks > 1 and self.schedule != "Interleaved1F1B":
            raise ValueError(f"{self.schedule} runs one stage per rank: num_chunks "
                             f"{self.num_chunks} needs schedule='Interleaved1F1B'")
        if self.schedule == "Interleaved1F1B" and \
                self.n_microbatches % max(1, self.n_microbatches // self.num_stages):
            raise ValueError(f"Interleaved1F1B needs the microbatches to be a multiple of its "
                             f"rounds (torch refuses {self.n_microbatches} over "
                             f"{self.num_stages} ranks)")
        return self

    @property
    def first(self) -> bool:
        """This rank holds the pipeline's first stage."""
        return self.chunk_first(0)

    @property
    def last(self) -> bool:
        """This rank holds the pipeline's last stage."""
        return self.chunk_last(self.num_chunks - 1)

    def chunk_stage(self, chunk: int) -> int:
        """The pipeline's stage index of this rank's ``chunk`` (of ``num_chunks`` · ranks)."""
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
        """The rank's forwards ("F") and backwards ("B"), each on a chunk and a microbatch,
        in run order (module docstring)."""
        m = self.n_microbatches
        if self.schedule == "GPipe":
            return [("F", 0, j) for j in range(m)] + [("B", 0, j) for j in range(m)]
        if self.schedule == "1F1B":
            warmup = min(m, self.num_stages - self.stage_index)
            actions: list[ChunkAction] = [("F", 0, j) for j in range(warmup)]
            for j in range(m):
                actions.append(("B", 0, j))
                if warmup + j < m:
                    actions.append(("F", 0, warmup + j))
            return actions
        return self._interleaved_actions()

    def _interleaved_actions(self) -> list[ChunkAction]:
        m, v, p = self.n_microbatches, self.num_chunks, self.num_stages
        per_round = m // max(1, m // p)
        total = m * v
        warmup = min((v - 1) * per_round + 2 * (p - 1 - self.stage_index), total)
        forwards, backwards = [0] * v, [0] * v

        def forward(k: int) -> ChunkAction:
            chunk = (k // per_round) % v
            forwards[chunk] += 1
            return ("F", chunk, forwards[chunk] - 1)

        def backward(k: int) -> ChunkAction:
            chunk = v - 1 - (k // per_round) % v
            backwards[chunk] += 1
            return ("B", chunk, backwards[chunk] - 1)

        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        return actions + [backward(k) for k in range(total - warmup, total)]

    def in_flight(self) -> int:
        """The most microbatches between their forward and their backward at once (on a
        rank of several chunks, counted over its chunks)."""
        most = held = 0
        for kind, _, _ in self.actions():
            held += 1 if kind == "F" else -1
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


class ChunkReplay(NamedTuple):
    """One chunk of a rank: its timelines for one microbatch (before and from its first
    backward), its boundary bytes, and what each timeline counts as static (parameters,
    one input, and in the second the gradients): an idle chunk holds that beside another's
    pass."""

    before_grads: Timeline
    with_grads: Timeline
    boundary: StageBoundary
    static_before: int = 0
    static_with: int = 0


class _Chunk:
    """A chunk's state during the replay: its microbatches in flight, the outputs and losses
    it keeps, whether its first backward ran; the bytes around each of its passes."""

    def __init__(self, spec: StageSpec, chunk: int, replay: ChunkReplay) -> None:
        b, m = replay.boundary, spec.n_microbatches
        self.replay, self.last = replay, spec.chunk_last(chunk)
        self.persistent = (m - 1) * b.input_bytes + (
            (m - 1) * b.target_bytes if self.last else m * b.output_bytes)
        self.own_output = 0 if b.output_in_timeline or self.last else b.output_bytes
        self.outputs_kept = b.output_bytes if self.last and spec.return_outputs else 0
        self.last_input_grad = 0 if spec.chunk_first(chunk) else b.input_bytes
        self.loss_bytes = b.loss_bytes if self.last else 0
        # torch's runtime schedules (Interleaved1F1B) keep each send until the step ends
        self.sends_kept = spec.schedule in RUNTIME_SCHEDULES
        self.held: set[int] = set()
        self.kept, self.backwards = 0, 0  # forwards and backwards run so far
        self.pass_peaks = {(kind, grads): max(
            (e.peak_bytes for e in timeline.events if e.label != OPTIMIZER_STEP
             and (e.phase == "forward") == (kind == "F")), default=0)
            for kind in "FB" for grads, timeline in ((False, replay.before_grads),
                                                     (True, replay.with_grads))}

    def around(self, kind: str | None, step_over: bool = False) -> int:
        """What the chunk holds beside its timeline during a pass of ``kind`` (None: while
        another chunk runs, its static memory included; ``step_over``: once the step's
        sends are done)."""
        b = self.replay.boundary
        static = 0 if kind else (self.replay.static_with if self.backward_done
                                 else self.replay.static_before)
        return (static + self.persistent + len(self.held) * b.held_bytes
                + self._outputs(kind, step_over) + self._input_grads(step_over)
                + self.kept * self.outputs_kept + (self.kept - (kind == "B")) * self.loss_bytes)

    def _outputs(self, kind: str | None, step_over: bool) -> int:
        """The outputs it holds outside its timeline: those of its microbatches in flight
        (and of the one whose backward runs), or under a runtime schedule every one sent."""
        in_flight = len(self.held) + (kind == "B")
        if not self.sends_kept or step_over or self.last:
            return in_flight * self.own_output
        b = self.replay.boundary
        return (self.kept - (in_flight if b.output_in_timeline else 0)) * b.output_bytes

    def _input_grads(self, step_over: bool) -> int:
        """The input gradients it sent and still holds: the last one (until the next
        backward's send is waited), or under a runtime schedule every one."""
        if step_over or not self.backward_done:
            return 0
        return self.last_input_grad * (self.backwards if self.sends_kept else 1)

    @property
    def backward_done(self) -> bool:
        """Its first backward ran: its gradients exist."""
        return self.backwards > 0

    def run(self, kind: str, microbatch: int) -> int:
        """The chunk's peak during this pass, beside what it holds; then its state after."""
        if kind == "B":
            self.held.discard(microbatch)
        peak = self.around(kind) + self.pass_peaks[kind, self.backward_done]
        if kind == "F":
            self.held.add(microbatch)
            self.kept += 1
        else:
            self.backwards += 1
        return peak

    def end_of_step(self, m: int) -> int:
        """The last stage concatenates its outputs after the backwards: its live memory
        then, less the input's gradient (sent, then let go)."""
        end = [e.live_bytes for e in self.replay.with_grads.events
               if e.label != OPTIMIZER_STEP][-1] - self.last_input_grad
        b = self.replay.boundary
        return end + self.persistent + (m - 1) * b.loss_bytes + 2 * m * b.output_bytes


def rank_peak(spec: StageSpec, chunks: list[ChunkReplay]) -> int:
    """The rank's peak over one step of ``spec``: each pass replays its chunk's timeline
    (``before_grads`` until the chunk's first backward, ``with_grads`` after it) beside what
    that chunk and the rank's other chunks hold (module docstring)."""
    if len(chunks) != spec.num_chunks:
        raise ValueError(f"{len(chunks)} chunks replayed for a rank of {spec.num_chunks}")
    states = [_Chunk(spec, c, replay) for c, replay in enumerate(chunks)]
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


def stage_peak(spec: StageSpec, before_grads: Timeline, with_grads: Timeline,
               boundary: StageBoundary) -> int:
    """The stage's peak over one step of ``spec`` (one chunk per rank): :func:`rank_peak`
    of its one chunk."""
    return rank_peak(spec, [ChunkReplay(before_grads, with_grads, boundary)])
