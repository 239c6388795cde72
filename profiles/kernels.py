"""The fused kernels a device runs, so that a step profiled elsewhere runs them too.

``F.scaled_dot_product_attention`` picks its kernel inside C++ from the tensors' device:
a GPU runs a fused kernel (cuDNN, flash or memory-efficient attention: they save the
output and the log-sum-exp), while the meta device, and fake ``cuda`` tensors on a
machine without a GPU, fall back to the math decomposition, which saves the whole
attention matrix. A profile taken on the meta device for an H100 would then describe
another program. :class:`FusedKernels` intercepts the call on fake and meta tensors and
runs the fused op that the target device selects, with the same preprocessing torch's
composite does (``aten/src/ATen/native/transformers/attention.cpp``).

The selection mirrors torch's ``sdp::select_sdp_backend``
(``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` and ``sdp_utils_cpp.cpp``);
its constraints, as numbered here and cited in the code:

1. Every fused kernel: 4-D dense query/key/value of one dtype with unit last stride,
   non-empty sequences, equal batch sizes, and either equal head counts or grouped-query
   attention (``enable_gqa=True``, query heads a multiple of key heads).
2. cuDNN (first on sm90/sm100 in torch builds with cuDNN > 9.15, the CUDA 13 wheels):
   fp16/bf16; head dims multiples of 8 and at most 256 (128 for a backward unless
   192/128 or 256/256); dropout a multiple of 1/16; batch and heads at most 65535; key
   length not 1; not under ``torch.use_deterministic_algorithms`` (without warn_only).
3. Flash: fp16/bf16; no ``attn_mask``; one head dim for q, k and v, at most 256 (padded
   to a multiple of 8); ``is_causal`` only with equal query and key lengths.
4. Memory-efficient: fp16/bf16/fp32; q and k share a head dim; head dims aligned to the
   GEMM (8 elements for fp16/bf16, 4 for fp32 on sm80+). Takes any mask.
5. CPU: the flash kernel for CPU unless dropout is on (then math).
6. A backend the user turned off (``torch.backends.cuda.enable_*_sdp(False)`` or
   ``torch.nn.attention.sdpa_kernel``) is skipped, as torch does.

7. Dropout (``aten/src/ATen/native/Dropout.cpp``): out of place, in training, with
   0 < p < 1 on a CUDA tensor it is one fused ``native_dropout``, which saves a boolean
   mask; elsewhere (the CPU) it is ``bernoulli_`` noise of the input's dtype and a
   multiply, which saves that noise: 4 bytes per element in fp32 instead of 1.

Memory of the fused kernels differs from the decompositions by the attention matrix per
layer and the dropout masks; their times come from the roofline (``profiles.devices``).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from profiles.devices import DeviceSpec

MATH = "math"
ATTENTION_OPS: dict[str, str] = {
    "cudnn": "aten._scaled_dot_product_cudnn_attention.default",
    "flash": "aten._scaled_dot_product_flash_attention.default",
    "efficient": "aten._scaled_dot_product_efficient_attention.default",
    "flash_cpu": "aten._scaled_dot_product_flash_attention_for_cpu.default",
}
MATH_ATTENTION_OPS = frozenset({"aten._safe_softmax.default"})  # only SDPA's math path


@dataclass(frozen=True)
class AttentionRules:
    """How one device picks its attention kernel: the order tried and its limits."""

    platform: str  # "cuda" or "cpu"
    order: tuple[str, ...]
    cudnn_head_dim: int = 256  # sm90 with cuDNN >= 9.22 (rule 2); 128 before


_CUDA_SM90 = AttentionRules("cuda", ("cudnn", "flash", "efficient", MATH))
_CUDA_SM80 = AttentionRules("cuda", ("flash", "efficient", MATH), cudnn_head_dim=128)
_CPU = AttentionRules("cpu", ("flash_cpu", MATH))
_RULES = {"h100": _CUDA_SM90, "h200": _CUDA_SM90, "a100": _CUDA_SM80, "cpu": _CPU}


def attention_rules(device: DeviceSpec) -> AttentionRules:
    """The rules of a named device; an unnamed GPU is taken as sm80 (flash first)."""
    return _RULES.get(device.name.lower(), _CUDA_SM80)


@dataclass(frozen=True)
class AttentionCall:
    """The arguments of one ``F.scaled_dot_product_attention`` call."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    @classmethod
    def bind(cls, args: tuple, kwargs: dict) -> AttentionCall:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                 "enable_gqa")
        return cls(**dict(zip(names, args, strict=False)), **kwargs)

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            t.requires_grad for t in (self.query, self.key, self.value))


def _dense_ok(call: AttentionCall) -> bool:
    """Rule 1."""
    q, k, v = call.query, call.key, call.value
    if not all(t.dim() == 4 and t.stride(-1) == 1 for t in (q, k, v)):
        return False
    if not q.dtype == k.dtype == v.dtype or q.size(0) != k.size(0) or q.size(0) != v.size(0):
        return False
    if min(q.size(2), k.size(2)) == 0 or k.size(1) != v.size(1):
        return False
    heads_q, heads_k = q.size(1), k.size(1)
    return heads_q == heads_k or (call.enable_gqa and heads_q % heads_k == 0)


def _cudnn_ok(call: AttentionCall, rules: AttentionRules) -> bool:
    """Rule 2."""
    q, k, v = call.query, call.key, call.value
    d_qk, d_v = q.size(-1), v.size(-1)
    if q.dtype not in (torch.float16, torch.bfloat16) \
            or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if torch.are_deterministic_algorithms_enabled() and \
            not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if max(d_qk, d_v) > rules.cudnn_head_dim or d_qk % 8 or d_v % 8:
        return False
    if call.needs_grad and not (max(d_qk, d_v) <= 128 or (d_qk, d_v) in ((192, 128), (256, 256))):
        return False
    return float(call.dropout_p * 16).is_integer() and max(q.size(0), q.size(1)) <= 65535 \
        and k.size(2) != 1


def _flash_ok(call: AttentionCall) -> bool:
    """Rule 3."""
    q, k, v = call.query, call.key, call.value
    return (q.dtype in (torch.float16, torch.bfloat16) and call.attn_mask is None
            and q.size(-1) == k.size(-1) == v.size(-1) <= 256
            and (not call.is_causal or q.size(2) == k.size(2))
            and torch.backends.cuda.flash_sdp_enabled())


def _efficient_ok(call: AttentionCall) -> bool:
    """Rule 4."""
    q, k, v = call.query, call.key, call.value
    align = 4 if q.dtype == torch.float32 else 8
    return (q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and q.size(-1) == k.size(-1) and q.size(-1) % align == 0 and v.size(-1) % align == 0
            and torch.backends.cuda.mem_efficient_sdp_enabled())


def choose_attention(rules: AttentionRules, call: AttentionCall) -> str:
    """The kernel the device runs for this call: a key of ``ATTENTION_OPS``, or ``MATH``."""
    if not _dense_ok(call):
        return MATH
    checks = {"cudnn": lambda: _cudnn_ok(call, rules), "flash": lambda: _flash_ok(call),
              "efficient": lambda: _efficient_ok(call),
              "flash_cpu": lambda: call.dropout_p == 0.0
              and torch.backends.cuda.flash_sdp_enabled()}  # rules 5 and 6
    for kernel in rules.order:
        if kernel == MATH or checks[kernel]():
            return kernel
    return MATH


def _float_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A boolean mask as the additive float mask the fused kernels take."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=like.dtype, device=like.device)
    minus_inf = torch.scalar_tensor(-math.inf, dtype=like.dtype, device=like.device)
    return torch.where(mask, zero, minus_inf)


def _efficient_mask(mask: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """The memory-efficient kernel's bias: rows aligned to 16 elements (padded), 4-D."""
    if not (all(s % 16 == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1):
        length = mask.size(-1)
        mask = F.pad(mask, (0, 16 - length % 16))[..., :length]
    q, k = call.query, call.key
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def run_attention(kernel: str, call: AttentionCall) -> torch.Tensor:
    """What torch's composite runs for ``kernel``: its fused op and the preprocessing."""
    aten = torch.ops.aten
    q, k, v = call.query, call.key, call.value
    mask = _float_mask(call.attn_mask, q)
    lse = call.needs_grad
    if kernel == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(
            q, k, v, mask, lse, call.dropout_p, call.is_causal, False, scale=call.scale)[0]
    if kernel == "efficient":
        mask = _efficient_mask(mask, call) if mask is not None else None
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, lse, call.dropout_p, call.is_causal, scale=call.scale)[0]
    if kernel == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, call.dropout_p, call.is_causal, attn_mask=mask, scale=call.scale)[0]
    head_dim = q.size(-1)
    scale = call.scale if call.scale is not None else 1.0 / math.sqrt(head_dim)
    if head_dim % 8:
        q, k, v = (F.pad(t, (0, 8 - head_dim % 8)) for t in (q, k, v))
    out = aten._scaled_dot_product_flash_attention(
        q, k, v, call.dropout_p, call.is_causal, False, scale=scale)[0]
    return out[..., :head_dim] if head_dim % 8 else out


def _autocast(call: AttentionCall) -> AttentionCall:
    """Under autocast, attention runs in the low precision (its inputs are cast), as on
    the GPU: the fused ops are called directly here, below autocast's own casts."""
    device_type = call.query.device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return call
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype \
            else t

    return AttentionCall(cast(call.query), cast(call.key), cast(call.value),
                         cast(call.attn_mask), call.dropout_p, call.is_causal, call.scale,
                         call.enable_gqa)


def _abstract(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, torch.Tensor) and (tensor.is_meta or isinstance(tensor, FakeTensor))


class FusedKernels(TorchFunctionMode):
    """On fake and meta tensors, attention and dropout run the fused kernels ``device``
    selects (rules 1-7).

    Where torch itself selects as the device would, nothing is changed: a CPU target on
    fake CPU tensors, and fake CUDA tensors on a machine with a GPU (torch asks the GPU).
    What was run is counted in ``chosen`` (kernel -> calls).
    """

    def _stands_in(self, tensor: Any) -> bool:
        """Whether ``tensor`` stands in for one of the target device that it is not."""
        if not _abstract(tensor):
            return False
        device_type = tensor.device.type
        if device_type == "cuda" and torch.cuda.is_available():
            return False
        return not (self.rules.platform == "cpu" and device_type == "cpu")

    def __init__(self, device: DeviceSpec) -> None:
        super().__init__()
        self.rules = attention_rules(device)
        self.chosen: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not args or not self._stands_in(args[0]):
            return func(*args, **kwargs)
        if func in (F.dropout, torch.dropout) and self.rules.platform == "cuda":
            return _dropout(func, args, kwargs)
        if func is not torch._C._nn.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = _autocast(AttentionCall.bind(args, kwargs))
        kernel = choose_attention(self.rules, call)
        self.chosen[kernel] += 1
        if kernel == MATH:
            return func(*args, **kwargs)
        device_type = call.query.device.type
        with torch.autocast(device_type, enabled=False) if device_type != "meta" \
                else contextlib.nullcontext():
            return run_attention(kernel, call)


def _dropout(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """Rule 7: dropout as a CUDA device runs it."""
    names = ("input", "p", "training", "inplace") if func is F.dropout else \
        ("input", "p", "train")
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    p = bound.get("p", 0.5)
    train = bound.get("training", bound.get("train", True))
    if bound.get("inplace", False) or not train or not 0 < p < 1 \
            or bound["input"].numel() == 0:
        return func(*args, **kwargs)
    return torch.ops.aten.native_dropout(bound["input"], p, True)[0]


def attention_kernels(targets: list[str]) -> dict[str, int]:
    """Which attention kernels a profile's ops ran (kernel -> calls), from op names."""
    by_op = {op: kernel for kernel, op in ATTENTION_OPS.items()}
    counts: Counter[str] = Counter()
    for target in targets:
        if target in by_op:
            counts[by_op[target]] += 1
        elif target in MATH_ATTENTION_OPS:
            counts[MATH] += 1
    return dict(counts)
