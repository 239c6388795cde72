"""Rooflines of named devices, for estimating op times without running on them.

Numbers are vendor peaks for dense math (no sparsity) and memory bandwidth; efficiencies
scale them to what eager PyTorch kernels typically reach. An op's estimated time is
``max(flops / (peak * compute_efficiency), bytes / (bandwidth * memory_efficiency))`` plus a
launch overhead. fp32 matmuls use the non-tensor-core peak because torch's default
``allow_tf32`` for matmul is False.

Checkpoint overhead for estimates (``checkpoint_costs``, see ``profiles.CheckpointCosts``):
host time of ``torch.utils.checkpoint`` per region, per saved tensor and per op of a
selective-checkpoint policy. The ``cpu`` entry is what ``profiles.calibrate`` measured on a
2-core x86 VM (torch 2.13, ``benchmarks/checkpoint_overhead.py``). GPU entries are an
assumption, not a measurement: the same host work runs while the GPU executes kernels queued
earlier, so on a GPU-bound step most of it is hidden; we charge small values (50 us per
region, 2 us per saved tensor, 5 us per SAC op, 8 to 24 times less than the CPU entry).
Profile with ``timing="measure"`` on the GPU to measure them instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from profiles.schema import CheckpointCosts


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_tflops: dict[str, float] = field(default_factory=dict)  # by torch dtype name
    memory_bandwidth_gbs: float = 100.0
    launch_overhead_us: float = 5.0
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    checkpoint_region_us: float = 50.0
    checkpoint_pack_us: float = 2.0
    checkpoint_sac_op_us: float = 5.0

    def op_time_ms(self, flops: int, traffic_bytes: int, dtype: str) -> float:
        peak = self.peak_tflops.get(dtype, self.peak_tflops.get("float32", 1.0)) * 1e12
        compute_s = flops / (peak * self.compute_efficiency)
        memory_s = traffic_bytes / (self.memory_bandwidth_gbs * 1e9 * self.memory_efficiency)
        return (max(compute_s, memory_s) + self.launch_overhead_us * 1e-6) * 1e3

    def checkpoint_costs(self) -> CheckpointCosts:
        """The assumed checkpoint overhead on this device (see the module docstring)."""
        return CheckpointCosts(region_ms=self.checkpoint_region_us * 1e-3,
                               pack_ms=self.checkpoint_pack_us * 1e-3,
                               sac_op_ms=self.checkpoint_sac_op_us * 1e-3,
                               source=f"default for {self.name} (profiles.devices)")


# measured by profiles.calibrate (benchmarks/checkpoint_overhead.py), rounded
CPU_REGION_US, CPU_PACK_US, CPU_SAC_OP_US = 400.0, 45.0, 120.0

DEVICES: dict[str, DeviceSpec] = {
    "H100": DeviceSpec("H100", {"float32": 67.0, "bfloat16": 989.0, "float16": 989.0},
                       memory_bandwidth_gbs=3350.0, launch_overhead_us=5.0),
    "H200": DeviceSpec("H200", {"float32": 67.0, "bfloat16": 989.0, "float16": 989.0},
                       memory_bandwidth_gbs=4800.0, launch_overhead_us=5.0),
    "A100": DeviceSpec("A100", {"float32": 19.5, "bfloat16": 312.0, "float16": 312.0},
                       memory_bandwidth_gbs=2039.0, launch_overhead_us=5.0),
    "cpu": DeviceSpec("cpu", {"float32": 0.1, "bfloat16": 0.05, "float16": 0.05},
                      memory_bandwidth_gbs=20.0, launch_overhead_us=10.0,
                      checkpoint_region_us=CPU_REGION_US, checkpoint_pack_us=CPU_PACK_US,
                      checkpoint_sac_op_us=CPU_SAC_OP_US),
}


def device_spec(name: str | DeviceSpec) -> DeviceSpec:
    """Look up a named device (case-insensitive) or pass a DeviceSpec through."""
    if isinstance(name, DeviceSpec):
        return name
    for key, spec in DEVICES.items():
        if key.lower() == str(name).lower():
            return spec
    raise KeyError(f"no roofline for device {name!r}; known: {sorted(DEVICES)}, or pass a "
                   "profiles.DeviceSpec(name, peak_tflops={'float32': ...}, "
                   "memory_bandwidth_gbs=...)")
