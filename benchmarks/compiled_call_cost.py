"""The host's cost of calling a compiled graph, per call and per tensor it takes.

    python benchmarks/compiled_call_cost.py

A module of ``n`` parameters multiplied into its input one after another, compiled
(inductor) and stepped (forward, ``sum``, backward) on a 4-element input, against the same
eager: its kernels cost next to nothing, so a compiled step's time is its two graphs' calls
(dynamo's guards, the AOT runtime wrapper, autograd's function, the wrapper's own Python)
and what grows with the tensors they take (a guard and a check per input, an accumulation
node per parameter). The fit ``step = 2 * per graph + inputs * per input`` (inputs: the
forward's ``n + 1``, the backward's about as many) gives the ``cpu`` entry's
``compiled_graph_us`` and ``compiled_input_us`` (``profiles.devices``). One thread, the
tenth percentile of 300 steps each.
"""

from __future__ import annotations

import platform
import time
import warnings

import numpy as np
import torch

SIZES = (1, 16, 64, 128)


class Chain(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.factors = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4))
                                              for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for factor in self.factors:
            x = x * factor
        return x.sum()


def step_us(model: torch.nn.Module, run: torch.nn.Module, x: torch.Tensor) -> float:
    def step() -> None:
        run(x).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(20):
        step()
    times = []
    for _ in range(300):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 10] * 1e6


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    x = torch.randn(4)
    rows = []
    for n in SIZES:
        model = Chain(n)
        rows.append((n, step_us(model, model, x), step_us(model, torch.compile(model), x)))
        print(f"{n:4d} parameters: eager {rows[-1][1]:7.0f} us, compiled {rows[-1][2]:7.0f} us",
              flush=True)
    inputs = np.array([2 * (n + 1) for n, _, _ in rows], dtype=float)
    per_input, fixed = np.polyfit(inputs, [c for _, _, c in rows], 1)
    print(f"{platform.machine()}, torch {torch.__version__}, 1 thread: per graph "
          f"{fixed / 2:.0f} us, per input {per_input:.1f} us")


if __name__ == "__main__":
    main()
