"""The DP's bound under bf16 autocast: the cast weights autocast's cache holds to the end
of the forward are pinned, yet only their own stage holds them after it; counted in that
stage's residue (`solvers.dp.pinned.one_stage_holders`), torchvision's MobileNetV3-small
is proven at half its activations, where its bound was 4.8 % under the answer before."""

from __future__ import annotations

import math

import torch
import torchvision

from planner import profile_model
from solvers.accounting import Context
from solvers.dp import search as dp
from solvers.result import Status


def test_cast_weights_held_by_one_stage_prove_the_answer() -> None:
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    step = profile_model(model, (torch.randn(8, 3, 64, 64),),
                         loss_fn=lambda out: out.float().square().mean(), timing="estimate",
                         autocast=torch.bfloat16, progress=False)
    p = step.problem()
    lay = dp._layout(Context(p))
    casts = {s for s in lay.one_stage if p.node_names[p.storage_producer[s]].endswith(
        "_to_copy")}
    assert len(casts) >= 8, sorted(p.node_names[p.storage_producer[s]] for s in lay.pinned)
    static = step.profile.static.total_bytes
    budget = int(static + 0.5 * (step.unplanned_peak_bytes - static))
    sol = dp.solve(p, budget, math.inf)
    assert sol.feasible and sol.peak_bytes <= budget
    assert sol.status == Status.OPTIMAL, (sol.objective_ms, sol.bound_ms)
