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

Measured (`benchmarks/results/pipeline-stages-cpu.md`: gloo, 2 and 3 stages, 2 to 8
microbatches, GPipe and 1F1B, unplanned and with a plan per stage): 54 stage peaks, 37 to
64 bytes, none more than 4 bytes above the prediction, the worst 1.20 % below it (one
stage-boundary activation the replay counts and the stage had let go of).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from solvers.simulate import OPTIMIZER_STEP, Timeline

__all__ = ["STAGE_SCHEDULES", "StageBoundary", "StageSpec", "held_after_forward", "stage_peak"]

STAGE_SCHEDULES = ("GPipe", "1F1B")  # torch's ScheduleGPipe, Schedule1F1B

Action = tuple[Literal["F", "B"], int]


class StageSpec(BaseModel):
    """One stage of a pipeline, in torch's names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: Literal["GPipe", "1F1B"]
    stage_index: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    n_microbatches: int = Field(ge=1)
    return_outputs: bool = True  # ``schedule.step(..., return_outputs=...)``

    @model_validator(mode="after")
    def _stage_in_range(self) -> StageSpec:
        if self.stage_index >= self.num_stages:
            raise ValueError(f"stage_index {self.stage_index} is not below num_stages "
                             f"{self.num_stages}")
        if self.schedule == "1F1B" and self.n_microbatches < self.num_stages:
            raise ValueError(f"1F1B needs at least as many microbatches as stages (torch's "
                             f"Schedule1F1B refuses {self.n_microbatches} for "
                             f"{self.num_stages})")
        return self

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def order(self) -> list[Action]:
        """The stage's forwards ("F") and backwards ("B") by microbatch, in run order."""
        m = self.n_microbatches
        if self.schedule == "GPipe":
            return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
        warmup = self.in_flight()
        actions: list[Action] = [("F", j) for j in range(warmup)]
        for j in range(m):
            actions.append(("B", j))
            if warmup + j < m:
                actions.append(("F", warmup + j))
        return actions

    def in_flight(self) -> int:
        """The most microbatches between their forward and their backward at once."""
        m = self.n_microbatches
        return m if self.schedule == "GPipe" else min(m, self.num_stages - self.stage_index)


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


def stage_peak(spec: StageSpec, before_grads: Timeline, with_grads: Timeline,
               boundary: StageBoundary) -> int:
    """The stage's peak over one step of ``spec``: each microbatch replays one timeline's
    forward or backward events (``before_grads`` until the stage's first backward,
    ``with_grads`` after it), beside what the others hold (module docstring)."""
    m = spec.n_microbatches
    persistent = (m - 1) * boundary.input_bytes + (
        (m - 1) * boundary.target_bytes if spec.last else m * boundary.output_bytes)
    own_output = 0 if boundary.output_in_timeline or spec.last else boundary.output_bytes
    outputs_kept = boundary.output_bytes if spec.last and spec.return_outputs else 0
    last_input_grad = 0 if spec.first else boundary.input_bytes
    held: set[int] = set()
    kept, backward_done, peak = 0, False, 0
    for kind, j in spec.order():
        timeline = with_grads if backward_done else before_grads
        if kind == "B":
            held.discard(j)
        losses_kept = (kept - (kind == "B")) * boundary.loss_bytes if spec.last else 0
        beside = (persistent + len(held) * (boundary.held_bytes + own_output)
                  + kept * outputs_kept + losses_kept
                  + (last_input_grad if backward_done else 0)
                  + (own_output if kind == "B" else 0))
        events = [e.peak_bytes for e in timeline.events if e.label != OPTIMIZER_STEP
                  and (e.phase == "forward") == (kind == "F")]
        peak = max(peak, beside + max(events, default=0))
        if kind == "F":
            held.add(j)
            kept += 1
        else:
            backward_done = True
    if spec.last and spec.return_outputs:  # the step returns the outputs concatenated
        # after the backwards, less the input's gradient (sent, then let go)
        end = [e.live_bytes for e in with_grads.events if e.label != OPTIMIZER_STEP][-1] \
            - last_input_grad
        peak = max(peak, end + persistent + (m - 1) * boundary.loss_bytes
                   + 2 * m * boundary.output_bytes)
    return peak
