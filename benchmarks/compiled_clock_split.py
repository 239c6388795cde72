"""Where a compiled step's time goes on the CPU: the clock's prediction by kind against the
same step measured, seconds apart.

    python benchmarks/compiled_clock_split.py            # 5 models x whole / per block
    python benchmarks/compiled_clock_split.py --quick    # GPT tiny

For each model, compiled whole and per block (inductor's C++ backend), nothing checkpointed
and every block checkpointed: the step counted on fake tensors and timed by its clock
(`planner.compiled_fake.FakeCompiledStep` on this host's roofline, `profiles.compiled_time`:
its generated kernels and its compute and reduction ops run here), and at once the same
step compiled and run (`planner.compiled_step.CompiledStep`): its wall time (the least of
its timed steps) and, under torch's profiler with inductor's kernel profile on, the self
time of its fused kernels and of its aten ops (the extern matmuls and the eager ops between
graphs). The rest of the wall time is host work: the graphs' calls, the generated wrapper's
Python, dynamo's guards, autograd's engine, the eager ops' Python and dispatch. The clock
predicts it as its graph-call rule plus each aten op's per-call cost.

Why a split and seconds apart: on the 2-vCPU VM this was written on, the same 512-cubed
matmul ran in 1.66 ms for minutes and then in 2.3-2.9 ms for minutes (no steal counted), so
a prediction and a measure taken minutes apart compare two machines; the kinds measured in
one window say which of the clock's rules is short. One thread, freed memory kept.

Writes benchmarks/results/compiled-clock-split-cpu.{json,md} (``--quick``: ...-quick.*).
"""

from __future__ import annotations

import re
import sys
from typing import Any

import torch
from compiled_fake import drive, step_of

from planner import Plan, profile_model, zoo
from planner.compiled_fake import FakeCompiledStep
from planner.compiled_step import CompiledStep
from planner.solving import plan_for_schedule
from profiles.devices import DeviceSpec
from solvers.baselines import policy_schedule

PROFILED = 5  # steps under the profiler
KINDS = ("fused", "aten", "host")


class SplitStep(CompiledStep):
    """A measured compiled step that, after timing, profiles ``PROFILED`` more steps and
    keeps their mean self time per step by kind (``split``)."""

    split: dict[str, float]

    def _least_ms(self, steps: int) -> float:
        least = super()._least_ms(steps)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED):
                self._step(self.args, self.kwargs)
        self.split = {"fused": 0.0, "aten": 0.0}
        for event in prof.key_averages():
            kind = "fused" if re.match(r"graph_\d+_cpp_", event.key) else \
                "aten" if event.key.startswith("aten::") else None
            if kind is not None:
                self.split[kind] += event.self_cpu_time_total / 1e3 / PROFILED
        return least


def schedules(zm: zoo.ZooModel, autocast: str | None) -> list[tuple[str, Plan | None]]:
    dtype = getattr(torch, autocast) if autocast else None
    profiled = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                             autocast=dtype, timing="estimate", progress=False)
    schedule = policy_schedule("every-layer", profiled.problem())
    return [("no checkpoint", None),
            ("every block", plan_for_schedule(profiled.profile, schedule, profiled.inputs,
                                              profiled.structure))]


def run_model(name: str, zm: zoo.ZooModel, autocast: str | None, spec: DeviceSpec
              ) -> list[dict[str, Any]]:
    args, kwargs, blocks = step_of(zm)
    rows = []
    for label, plan in schedules(zm, autocast):
        for mode in ("model", "blocks"):
            counted = FakeCompiledStep(zm.model, args, kwargs, zm.loss_fn, mode, blocks,
                                       autocast_dtype=autocast, spec=spec)
            predicted_ms = counted.run(plan).step_ms
            measured = SplitStep(zm.model, args, kwargs, zm.loss_fn, mode, blocks,
                                 autocast_dtype=autocast)
            with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
                measured_ms = measured.run(plan).step_ms
            split = dict(measured.split)
            split["host"] = measured_ms - split["fused"] - split["aten"]
            by_kind = counted.step_ms_by_kind
            rows.append({"model": name, "mode": mode, "schedule": label,
                         "measured_ms": measured_ms, "predicted_ms": predicted_ms,
                         "measured": split,
                         "predicted": {"fused": by_kind.get("fused", 0.0),
                                       "aten": by_kind.get("aten", 0.0),
                                       "host": by_kind.get("graph", 0.0)}})
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict[str, Any]], meta: str) -> str:
    def ratio(row: dict[str, Any], kind: str) -> float:
        return row["predicted"][kind] / row["measured"][kind]

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    errors = [r["predicted_ms"] / r["measured_ms"] - 1 for r in rows]
    lines = ["# A compiled step's time by kind: predicted against measured, seconds apart",
             "", meta, "",
             f"Step: predicted {100 * min(errors):+.1f} to {100 * max(errors):+.1f} % of "
             f"the measured (median {100 * median(errors):+.1f} %). Predicted over measured, "
             "median (range): "
             + "; ".join(f"{kind} {median([ratio(r, kind) for r in rows]):.2f} "
                         f"({min(ratio(r, kind) for r in rows):.2f}-"
                         f"{max(ratio(r, kind) for r in rows):.2f})" for kind in KINDS)
             + ". Host: measured, the wall time less the kernels' and aten ops' self time "
             "(their profiler's own cost is in it); predicted, the graph calls' rule (the "
             "aten ops' per-call cost is in their column).", "",
             "| model | compiled | schedule | measured ms | predicted ms | error | "
             + " | ".join(f"{k} measured | {k} predicted" for k in KINDS) + " |",
             "|---" * 12 + "|"]
    for r in rows:
        cells = " | ".join(f"{r['measured'][k]:.2f} | {r['predicted'][k]:.2f}" for k in KINDS)
        lines.append(f"| {r['model']} | {r['mode']} | {r['schedule']} | "
                     f"{r['measured_ms']:.2f} | {r['predicted_ms']:.2f} | "
                     f"{100 * (r['predicted_ms'] / r['measured_ms'] - 1):+.1f} % | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    drive(__doc__.splitlines()[0], "compiled-clock-split-cpu", run_model, report)


if __name__ == "__main__":
    main()
