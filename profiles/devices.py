"""Rooflines of named devices, for estimating op times without running on them.

An aten op's estimated time (``DeviceSpec.estimate_ms``, the one function both profiler
passes call) depends on its class (``op_class``):

- ``view``: returns an alias of its input (schema ``Tensor(a)`` returns, ``_unsafe_view``,
  in-place metadata ops): no kernel, no bytes, no launch, 0 ms. ``empty*`` likewise.
- ``matmul`` and ``attention``: ``max(flops / (peak[dtype] * eff), bytes / (bw * eff_pw))``,
  with ``eff_pw`` the pointwise (streaming) efficiency for the operand traffic.
- ``pointwise``, ``reduction``, ``copy``, ``factory``: ``bytes / (bw * eff)``, bytes being
  what the kernel reads and writes: each input at most once per storage byte (a broadcast
  ``expand`` reads its storage, not its expanded size), a gather (embedding, index_select,
  nll_loss) at most as much of its source as it returns, and every output; a factory
  (zeros, fill_, arange, bernoulli_ with a scalar p, ...) writes its outputs only.

plus ``launch_overhead_us`` per op that runs a kernel. fp32 matmuls use the non-tensor-core
FP32 peak because torch's default ``allow_tf32`` for matmul is False. A dtype with no peak
listed (float64, integers) uses the float32 one.

Numbers and their sources (``DeviceSpec.sources`` holds the same per entry):

====================  ======  ======  ======  =====================================
entry                 H100    H200    A100    source
====================  ======  ======  ======  =====================================
FP32 TFLOPS           67      67      19.5    NVIDIA H100 / H200 / A100 datasheets
BF16/FP16 TFLOPS      989     989     312     same, dense (half the sparsity figure)
bandwidth GB/s        3350    4800    2039    same (HBM3 / HBM3e / HBM2e, 80 GB SXM)
matmul                0.75    0.75    0.75    cuBLAS large GEMMs 75-97 % of peak [1]
attention             0.35    0.35    0.50    FlashAttention-2 on H100 / A100 [2]
pointwise, factory    0.85    0.85    0.85    assumption [3]
reduction             0.60    0.60    0.60    LayerNorm kernels 30-80 % of peak [4]
copy                  0.70    0.70    0.70    assumption [5]
launch per kernel     5 us    5 us    5 us    assumption [6]
====================  ======  ======  ======  =====================================

[1] BF16 741-798 TFLOPS at n = 6144-8192 on H100 SXM (github.com/pranjalssh/fast.cu,
    README, kernel 0 = cuBLAS); SGEMM 18.9 of 19.5 TFLOPS on A100 (github.com/Yinghan-Li/
    YHs_Sample issue 4). Training GEMMs are smaller than those squares and lose some to tile
    and wave quantization (NVIDIA, "Matrix Multiplication Background User's Guide"), hence
    the low end of the range: an assumption within measured numbers.
[2] Shah et al. 2024, FlashAttention-3 (arXiv:2407.08608): FlashAttention-2 reaches 35 % of
    H100 peak, FlashAttention-3 75 % (740 TFLOPS FP16 forward). Eager PyTorch's flash
    backend is FlashAttention-2, so 0.35; on sm90 torch tries cuDNN attention first for
    fp16/bf16 (``profiles.kernels``), which can run faster, so 0.35 may be on the slow side
    there. Dao 2023, FlashAttention-2 (arXiv:2307.08691): 50-73 % of A100 peak in the
    forward pass, less in the backward: 0.5. The fp32 (memory-efficient) kernels use the
    same fraction of the FP32 peak: an assumption.
[3] Streaming kernels (STREAM-style copy and triad) typically reach 85-90 % of HBM peak; we
    have no published measurement of PyTorch's elementwise kernels on these GPUs.
[4] NVIDIA/apex PR 1037: LayerNorm on A100 moves 572-1,258 GB/s depending on the kernel
    (Apex fwd 896 / bwd 572, the tuned one 1,258 / 1,163); 0.6 for PyTorch's softmax, norm
    and loss kernels is an assumption inside that range.
[5] Contiguous copies stream like pointwise kernels, but this class also holds gathers,
    scatters and embedding backward (sort then scatter, pytorch/pytorch issue 24912),
    which do not stream.
[6] Host launch and dispatch of one eager op; on a GPU-bound step much of it overlaps
    earlier kernels, so this is an upper-side figure for small ops.

The ``cpu`` entry is a rough stand-in (0.1 TFLOPS, 20 GB/s, 10 us per op, 0.7 of peak for
matmul and attention and 0.8 of bandwidth for the rest, the earlier uniform defaults); none of
its roofline numbers is sourced.

Checkpoint overhead for estimates (``checkpoint_costs``, see ``profiles.CheckpointCosts``):
host time of ``torch.utils.checkpoint`` per region, per saved tensor and per op of a
selective-checkpoint policy. The ``cpu`` entry is MEASURED: what ``profiles.calibrate``
measured on a 2-core x86 VM (torch 2.13, ``benchmarks/checkpoint_overhead.py``). The GPU
entries are ASSUMED, not measured: the same host work runs while the GPU executes kernels
queued earlier, so on a GPU-bound step most of it is hidden; we charge small values (50 us
per region, 2 us per saved tensor, 5 us per SAC op, 8 to 24 times less than the CPU entry).
Profile with ``timing="measure"`` on the GPU to measure them instead.

A compiled graph's call (``compiled_graph_us`` and ``compiled_input_us`` per tensor it
takes, for ``profiles.compiled_time``): 50 and 3 us on the ``cpu`` entry, measured
(``benchmarks/compiled_call_cost.py``: compiled steps of 1-128 parameters against their
inputs, 47 and 2.7 us on the 2-core VM, one thread); the GPUs' entries assume the same host
work (their hosts run the same Python; on a GPU-bound step much of it overlaps kernels).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from profiles.schema import CheckpointCosts

# "transcendental": a fused kernel computing exp, a root and the like per element
# (``profiles.compiled_time``); an aten op is never of it
OP_CLASSES = ("view", "factory", "pointwise", "reduction", "copy", "matmul", "attention",
              "transcendental")
COMPUTE_CLASSES = frozenset({"matmul", "attention"})

# op names as in the schema, without namespace, overload or an in-place trailing underscore
_MATMUL = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "addr",
    "matmul", "linear", "_addmm_activation", "_scaled_mm", "_int_mm", "convolution",
    "_convolution", "convolution_backward", "cudnn_convolution", "mkldnn_convolution",
    "cudnn_convolution_transpose", "convolution_overrideable",
    "convolution_backward_overrideable"})
_ATTENTION = frozenset({  # and each one's ``*_backward``
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention",
    "_efficient_attention", "_flash_attention_forward", "_efficient_attention_forward"})
_REDUCTION = frozenset({
    "sum", "mean", "amax", "amin", "argmax", "argmin", "prod", "var", "std", "var_mean",
    "std_mean", "norm", "linalg_vector_norm", "logsumexp", "cumsum", "cumprod", "all", "any",
    "topk", "sort", "_softmax", "_log_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward",
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
    "_batch_norm_with_update", "_batch_norm_with_update_functional", "batch_norm_backward",
    "cudnn_batch_norm", "cudnn_batch_norm_backward", "native_group_norm",
    "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
    "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
    "mse_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits"})
_COPY = frozenset({  # and every ``*_copy`` and ``*_scatter``
    "_to_copy", "copy", "clone", "cat", "stack", "index", "_unsafe_index", "index_select",
    "gather", "scatter", "scatter_add", "scatter_reduce", "index_put", "_index_put_impl",
    "_unsafe_index_put", "index_add", "index_copy", "embedding", "embedding_dense_backward",
    "constant_pad_nd", "repeat", "repeat_interleave", "roll", "flip", "masked_scatter",
    "masked_select", "take", "select_backward", "slice_backward", "diagonal_backward"})
_FACTORY = frozenset({
    "zeros", "ones", "full", "arange", "scalar_tensor", "zeros_like", "ones_like",
    "full_like", "new_zeros", "new_ones", "new_full", "fill", "zero", "linspace", "logspace",
    "eye", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "normal",
    "uniform", "random", "exponential"})
_FACTORY_OVERLOADS = frozenset({"bernoulli_.float", "bernoulli.p"})  # scalar p: write only
_ALLOCATE_ONLY = frozenset({  # factories that write nothing and launch no kernel
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "empty_permuted"})
_GATHERS = frozenset({  # read no more of a source than they return
    "embedding", "index_select", "index", "_unsafe_index", "gather", "take", "masked_select",
    "nll_loss_forward", "nll_loss2d_forward"})
_METADATA_ONLY = frozenset({  # views whose schema does not say so, and in-place view ops
    "_unsafe_view", "set_", "resize_", "resize_as_", "as_strided_", "detach_", "squeeze_",
    "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_"})


def _op_name(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else str(func)


def _is_view(func: Any, name: str) -> bool:
    if name in _METADATA_ONLY:
        return True
    returns = getattr(getattr(func, "_schema", None), "returns", ())
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def op_class(func: Any) -> str:
    """The class of an aten op for the roofline: one of ``OP_CLASSES``."""
    name = _op_name(func)
    if _is_view(func, name):
        return "view"
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    if base in _ATTENTION or base.removesuffix("_backward") in _ATTENTION:
        return "attention"
    if base in _MATMUL:
        return "matmul"
    if base in _REDUCTION:
        return "reduction"
    if base in _COPY or base.endswith(("_copy", "_scatter")):
        return "copy"
    if base in _FACTORY or base in _ALLOCATE_ONLY or \
            f"{name}.{getattr(func, '_overloadname', '')}" in _FACTORY_OVERLOADS:
        return "factory"
    return "pointwise"


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def _read_bytes(tensor: Any) -> int:
    """Bytes a kernel reads of an input: its elements, but no more than its storage holds
    (an expanded tensor is read from its storage once); works on fake and meta tensors."""
    try:
        return min(_nbytes(tensor), tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, subclasses)
        return _nbytes(tensor)


def _traffic_bytes(kind: str, name: str, inputs: Sequence[Any], outputs: Sequence[Any]
                   ) -> int:
    written = sum(_nbytes(t) for t in outputs)
    if kind == "factory":
        return written
    reads = [_read_bytes(t) for t in inputs]
    if name in _GATHERS:
        reads = [min(r, written) for r in reads]
    return sum(reads) + written


def _dtype(kind: str, inputs: Sequence[Any], outputs: Sequence[Any]) -> str:
    """The dtype whose peak applies: a matmul's operand dtype, else its output's."""
    if kind in COMPUTE_CLASSES:
        floats = [t for t in inputs if t.is_floating_point()]
        if floats:
            return str(floats[0].dtype).removeprefix("torch.")
    return str(outputs[0].dtype).removeprefix("torch.") if outputs else "float32"


# assumptions for a DeviceSpec made without an efficiency table (the named ones carry theirs)
DEFAULT_EFFICIENCY: dict[str, float] = {
    "matmul": 0.7, "attention": 0.7, "pointwise": 0.8, "reduction": 0.8, "copy": 0.8,
    "factory": 0.8, "transcendental": 0.8}


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_tflops: dict[str, float] = field(default_factory=dict)  # by torch dtype name
    memory_bandwidth_gbs: float = 100.0
    launch_overhead_us: float = 5.0
    # per op class: fraction of peak FLOPs (matmul, attention) or of bandwidth (the rest)
    efficiency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    sources: dict[str, str] = field(default_factory=dict)  # where each number comes from
    checkpoint_region_us: float = 50.0
    checkpoint_pack_us: float = 2.0
    checkpoint_sac_op_us: float = 5.0
    # per compiled graph called: dynamo's guards, the AOT runtime wrapper, autograd's
    # function and the generated wrapper's own Python (``profiles.compiled_time``), and per
    # tensor it takes (a guard and a check each, a parameter's accumulation node)
    compiled_graph_us: float = 50.0
    compiled_input_us: float = 3.0
    # offload: GB/s each way between device and pinned host memory; synchronous: the copy
    # holds up compute (a CPU, where "host" and "device" are one memory)
    host_link_gbps: float | None = None
    host_link_synchronous: bool = False

    def estimate_ms(self, func: Any, inputs: Sequence[Any], outputs: Sequence[Any],
                    flops: int) -> float:
        """Estimated time of one aten op on this device, from its class, the bytes it reads
        and writes and its FLOPs (see the module docstring); 0 for views and ``empty``."""
        kind = op_class(func)
        name = _op_name(func)
        if kind == "view" or name in _ALLOCATE_ONLY:
            return 0.0
        return self.op_time_ms(flops, _traffic_bytes(kind, name, inputs, outputs),
                               _dtype(kind, inputs, outputs), kind)

    def op_time_ms(self, flops: int, traffic_bytes: int, dtype: str,
                   kind: str | None = None) -> float:
        """The roofline of one kernel of class ``kind`` (default: matmul if it has FLOPs,
        else pointwise) that moves ``traffic_bytes``; ``estimate_ms`` derives all three."""
        kind = kind or ("matmul" if flops else "pointwise")
        compute = kind if kind in COMPUTE_CLASSES else "matmul"
        memory = "pointwise" if kind in COMPUTE_CLASSES else kind
        peak = self.peak_tflops.get(dtype, self.peak_tflops.get("float32", 1.0)) * 1e12
        compute_s = flops / (peak * self._efficiency(compute))
        memory_s = traffic_bytes / (self.memory_bandwidth_gbs * 1e9 * self._efficiency(memory))
        return (max(compute_s, memory_s) + self.launch_overhead_us * 1e-6) * 1e3

    def _efficiency(self, kind: str) -> float:
        return self.efficiency.get(kind, DEFAULT_EFFICIENCY[kind])

    def checkpoint_costs(self) -> CheckpointCosts:
        """The assumed checkpoint overhead on this device (see the module docstring)."""
        return CheckpointCosts(region_ms=self.checkpoint_region_us * 1e-3,
                               pack_ms=self.checkpoint_pack_us * 1e-3,
                               sac_op_ms=self.checkpoint_sac_op_us * 1e-3,
                               source=f"default for {self.name} (profiles.devices)")


# measured by profiles.calibrate (benchmarks/checkpoint_overhead.py), rounded
CPU_REGION_US, CPU_PACK_US, CPU_SAC_OP_US = 400.0, 45.0, 120.0
# measured on the same VM (benchmarks/compiled_call_cost.py, one thread): 47 us a compiled
# graph called, 2.7 us a tensor it takes, rounded
CPU_GRAPH_US, CPU_INPUT_US = 50.0, 3.0

# efficiencies of eager PyTorch kernels on NVIDIA data-center GPUs; sources in the docstring
_GPU_EFFICIENCY = {"matmul": 0.75, "attention": 0.35, "pointwise": 0.85, "reduction": 0.6,
                   "copy": 0.7, "factory": 0.85, "transcendental": 0.85}
_GPU_SOURCES = {
    "matmul": "cuBLAS large GEMMs reach 75-97 % of peak (fast.cu README: 741-798 TFLOPS BF16 "
              "on H100 SXM; YHs_Sample issue 4: SGEMM 18.9 of 19.5 TFLOPS on A100); training "
              "shapes take the low end (NVIDIA Matrix Multiplication Background guide)",
    "attention": "FlashAttention-2, eager PyTorch's flash backend, reaches 35 % of H100 peak "
                 "(Shah et al. 2024, FlashAttention-3, arXiv:2407.08608; FA3 itself: 75 %)",
    "pointwise": "assumption: streaming kernels reach 85-90 % of HBM peak (STREAM-style "
                 "copy/triad); no published figure for PyTorch's own kernels at hand",
    "reduction": "NVIDIA/apex PR 1037: LayerNorm on A100 moves 572-1,258 GB/s (30-80 % of "
                 "peak) by kernel; 0.6 is an assumption inside that range",
    "copy": "assumption: copies stream like pointwise kernels, gathers, scatters and "
            "embedding backward (sort then scatter, pytorch/pytorch#24912) do not",
    "factory": "assumption: fills write at streaming speed, as pointwise kernels (0.85)",
    "transcendental": "assumption: a fused kernel's exp or root per element hides behind "
                      "its memory traffic on a GPU, as a pointwise kernel's (0.85)",
    "launch_overhead_us": "assumption: ~5 us host launch and dispatch per eager op that runs "
                          "a kernel (none for views and empty)",
}


_FA2_A100 = ("FlashAttention-2 reaches 50-73 % of A100 peak forward, less backward (Dao 2023, "
             "arXiv:2307.08691): the low end, 0.5")


# PCIe per direction, from the link's generation (x16): what pinned copies reach
_PCIE_GBPS = {4: 32.0, 5: 64.0}
_PCIE_EFFICIENCY = 0.8


def _gpu(name: str, fp32: float, half: float, bandwidth: float, datasheet: str,
         attention: tuple[float, str] | None = None, pcie: int = 5) -> DeviceSpec:
    """A data-center GPU: datasheet peaks (dense) and bandwidth, the shared efficiencies
    (``attention``: this GPU's own efficiency and source for that class)."""
    efficiency, sources = dict(_GPU_EFFICIENCY), {
        **_GPU_SOURCES,
        "peak_tflops": f"{datasheet}: FP32 {fp32} TFLOPS, BF16/FP16 Tensor Core {half} TFLOPS "
                       "dense (half the sparsity figure)",
        "memory_bandwidth_gbs": f"{datasheet}: memory bandwidth {bandwidth:g} GB/s",
        "host_link_gbps": f"{datasheet}: PCIe Gen{pcie} x16, {2 * _PCIE_GBPS[pcie]:g} GB/s "
                          f"both ways ({_PCIE_GBPS[pcie]:g} per direction); assumption: "
                          f"pinned copies reach {_PCIE_EFFICIENCY:.0%} of it, each direction "
                          "on its own copy engine beside compute"}
    if attention is not None:
        efficiency["attention"], sources["attention"] = attention
    return DeviceSpec(name, {"float32": fp32, "bfloat16": half, "float16": half},
                      memory_bandwidth_gbs=bandwidth, launch_overhead_us=5.0,
                      efficiency=efficiency, sources=sources,
                      host_link_gbps=_PCIE_GBPS[pcie] * _PCIE_EFFICIENCY)


DEVICES: dict[str, DeviceSpec] = {
    "H100": _gpu("H100", 67.0, 989.0, 3350.0, "NVIDIA H100 Tensor Core GPU datasheet, SXM5"),
    "H200": _gpu("H200", 67.0, 989.0, 4800.0, "NVIDIA H200 Tensor Core GPU datasheet, SXM"),
    "A100": _gpu("A100", 19.5, 312.0, 2039.0, "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM",
                 attention=(0.5, _FA2_A100), pcie=4),
    "cpu": DeviceSpec("cpu", {"float32": 0.1, "bfloat16": 0.05, "float16": 0.05},
                      memory_bandwidth_gbs=20.0, launch_overhead_us=10.0,
                      efficiency={**DEFAULT_EFFICIENCY},
                      sources={"all": "assumption: a rough host roofline, not sourced",
                               "host_link_gbps": "assumption: a copy within host memory, "
                                                 "half the memory bandwidth (it reads and "
                                                 "writes), holding up compute"},
                      checkpoint_region_us=CPU_REGION_US, checkpoint_pack_us=CPU_PACK_US,
                      checkpoint_sac_op_us=CPU_SAC_OP_US, compiled_graph_us=CPU_GRAPH_US,
                      compiled_input_us=CPU_INPUT_US,
                      host_link_gbps=10.0,
                      host_link_synchronous=True),
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
                   "memory_bandwidth_gbs=..., efficiency={'matmul': ..., ...})")
