"""Why a zero-bubble schedule's stages after the first run unplanned
(`planner.pipeline.stage.StageSteps.plannable`, `solvers.pipeline.SPLIT_BACKWARD_SCHEDULES`):
what torch's split backward does to a checkpointed stage, measured. If torch changes this,
the reason must be revisited."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import checkpoint

from planner.measure import PeakTracker


class _Block(nn.Module):
    """A residual MLP block, checkpointed as a whole; counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)
        self.runs = 0

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.down(torch.nn.functional.gelu(self.up(x))) + x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._body, x, use_reentrant=False)


def _step(split: bool) -> tuple[list[int], int, int]:
    """The blocks' forward runs over one step of a non-first stage, the input's gradient
    and the weights' passes split as torch's zero-bubble schedules run them or not, the
    step's peak and what it holds between the two passes (above the static memory)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    x = torch.randn(128, 64, requires_grad=True)  # the received activation
    received = torch.randn(128, 64)  # the next stage's gradient
    params = list(model.parameters())
    with PeakTracker([*params, x, received]) as tracker:
        static = tracker.static_bytes
        y = model(x)
        if split:
            _, groups = stage_backward_input([y], [received], [x], iter(params))
            between = tracker.live_bytes - static
            stage_backward_weight(iter(params), groups)
        else:
            y.backward(received)
            between = 0
        peak = tracker.peak_bytes - static
    return [b.runs for b in model], peak, between


def test_split_backward_reruns_a_checkpoint_once_more_per_parameter_group() -> None:
    """Under the split backward each checkpointed block runs four times, not twice: its
    forward, a rerun in the input's pass, and one rerun in the weights' pass for each of
    its two Linears (each a parameter group, each pass a new graph task whose unpack
    reruns the frame). Those reruns' other tensors are kept until the weights' pass ends,
    so the step peaks higher than the full backward of the same checkpoints; between the
    passes a microbatch holds its captured gradients."""
    runs, peak, _ = _step(split=False)
    assert runs == [2, 2]
    split_runs, split_peak, between = _step(split=True)
    assert split_runs == [4, 4]
    assert split_peak > peak
    assert between > 0
