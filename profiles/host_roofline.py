"""This host's roofline, measured: what a matmul and a streaming kernel cost on its CPU.

The ``cpu`` entry of ``profiles.devices`` is a rough stand-in (0.1 TFLOPS, 20 GB/s, none of
it sourced). :func:`host_roofline` measures the same numbers on the process's own threads,
in about a second: the matmul rate of each float dtype and the rate of a pointwise kernel,
each fitted as ``time = cost per call + work / rate`` (least relative error) over sizes
from a training step's small GEMMs to ones past the caches, and the cost per call. It is
what times a compiled step counted on fake tensors on the CPU (``profiles.compiled_time``),
where every kernel is host work. Measured once per process and thread count.

A CPU's pointwise kernels are not bound by memory alone: an add streams at 50-80 GB/s on
the 2-core VM where ``exp`` reaches 10 and a tanh GELU 5, per byte moved. Inductor's fused
kernels in a transformer's step (softmax, GELU or SiLU, norms: a transcendental or a
reciprocal root per element) moved 12-16 GB/s there. So two rates are measured: an add's
(the bandwidth) and ``exp``'s (the ``transcendental`` class's efficiency, its share of it).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import numpy as np
import torch

from profiles.devices import DEVICES, DeviceSpec

__all__ = ["HOST", "host_roofline"]

HOST = "cpu (measured)"  # the name of the roofline measured here

# (m, k, n) of the matmuls timed; elements of the streaming adds timed
GEMMS = ((128, 64, 192), (256, 256, 256), (512, 512, 512), (512, 1024, 1024))
STREAMS = (2**12, 2**16, 2**20, 2**22)
DTYPES = (torch.float32, torch.bfloat16)
REPEATS = 7  # per size: the least is kept (a busy host only adds)


@functools.cache
def _measured(threads: int) -> DeviceSpec:
    peaks, calls = {}, []
    for dtype in DTYPES:
        rate, call_s = _fit([(2 * m * k * n, _least_s(_matmul(m, k, n, dtype)))
                             for m, k, n in GEMMS])
        peaks[str(dtype).removeprefix("torch.")] = rate / 1e12
        calls.append(call_s)
    bandwidth, call_s = _fit([(3 * 4 * size, _least_s(_stream(size))) for size in STREAMS])
    calls.append(call_s)
    transcendental, call_s = _fit([(2 * 4 * size, _least_s(_exp(size))) for size in STREAMS])
    calls.append(call_s)
    base = DEVICES["cpu"]
    source = (f"measured on this host ({threads} threads): matmul "
              + ", ".join(f"{d} {v * 1e3:.0f} GFLOPS" for d, v in peaks.items())
              + f", streaming (add) {bandwidth / 1e9:.1f} GB/s, exp "
              f"{transcendental / 1e9:.1f} GB/s (profiles.host_roofline)")
    return dataclasses.replace(
        base, name=HOST, peak_tflops=peaks, memory_bandwidth_gbs=bandwidth / 1e9,
        launch_overhead_us=max(1e6 * float(np.median(calls)), 1.0),
        efficiency={**{kind: 1.0 for kind in base.efficiency},
                    "transcendental": min(transcendental / bandwidth, 1.0)},
        sources={**base.sources, "all": source})


def host_roofline() -> DeviceSpec:
    """The ``cpu`` entry with its matmul peaks, bandwidth and per-kernel cost measured on
    this host (efficiencies 1: the rates are what kernels reach, not a datasheet's)."""
    return _measured(torch.get_num_threads())


def _fit(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """``(rate, seconds per call)`` of ``seconds = per call + work / rate`` by least
    relative squares (small kernels weigh as much as large ones); a negative per-call cost
    (noise) is taken as 0, the rate then from the sums."""
    work = np.array([w for w, _ in samples], dtype=float)
    seconds = np.array([s for _, s in samples], dtype=float)
    slope, intercept = np.polyfit(work, seconds, 1, w=1 / seconds)
    if intercept < 0 or slope <= 0:
        return float(work.sum() / seconds.sum()), 0.0
    return float(1 / slope), float(intercept)


def _least_s(run: Callable[[], object]) -> float:
    run()  # warm: first-call allocation and the kernel's dispatch caches
    times = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return min(times)


def _matmul(m: int, k: int, n: int, dtype: torch.dtype) -> Callable[[], object]:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def _stream(size: int) -> Callable[[], object]:
    x, y, out = torch.randn(size), torch.randn(size), torch.empty(size)
    return lambda: torch.add(x, y, out=out)


def _exp(size: int) -> Callable[[], object]:
    x, out = torch.randn(size), torch.empty(size)
    return lambda: torch.exp(x, out=out)
