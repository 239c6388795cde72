"""The per-op time estimate on a named device: op classes, bytes moved, sourced efficiencies."""

from __future__ import annotations

import pytest
import torch

import profiles
from planner import zoo
from profiles.backward import ALONE
from profiles.devices import DEVICES, OP_CLASSES, DeviceSpec, op_class

aten = torch.ops.aten
H100 = DEVICES["H100"]


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


def _launch_ms(spec: DeviceSpec) -> float:
    return spec.launch_overhead_us * 1e-3


@pytest.mark.parametrize("func, args", [
    (aten.view.default, ([64, 64],)),
    (aten._unsafe_view.default, ([64, 64],)),
    (aten.t.default, ()),
    (aten.transpose.int, (0, 1)),
    (aten.expand.default, ([8, 4096, 1],)),
    (aten.detach.default, ()),
    (aten.slice.Tensor, (0, 0, 2048)),
])
def test_view_ops_cost_nothing(func, args) -> None:
    x = _meta(4096, 1)
    out = func(x, *args)
    assert op_class(func) == "view"
    assert H100.estimate_ms(func, [x], [out], 0) == 0.0


def test_empty_writes_nothing_and_launches_nothing() -> None:
    out = aten.empty.memory_format([1 << 20], device="meta")
    assert op_class(aten.empty.memory_format) == "factory"
    assert H100.estimate_ms(aten.empty.memory_format, [], [out], 0) == 0.0
    zeros = aten.zeros.default([1 << 20], device="meta")
    expected = 4 * (1 << 20) / (H100.memory_bandwidth_gbs * 1e9
                                * H100.efficiency["factory"]) * 1e3 + _launch_ms(H100)
    assert H100.estimate_ms(aten.zeros.default, [], [zeros], 0) == pytest.approx(expected)


def test_big_fp32_matmul_is_compute_bound_at_the_matmul_efficiency() -> None:
    n = 8192
    a, b = _meta(n, n), _meta(n, n)
    out = aten.mm.default(a, b)
    flops = 2 * n ** 3
    compute_ms = flops / (H100.peak_tflops["float32"] * 1e12 * H100.efficiency["matmul"]) * 1e3
    memory_ms = 3 * n * n * 4 / (H100.memory_bandwidth_gbs * 1e9) * 1e3
    assert compute_ms > 10 * memory_ms
    assert H100.estimate_ms(aten.mm.default, [a, b], [out], flops) == pytest.approx(
        compute_ms + _launch_ms(H100))


def test_bf16_matmul_uses_the_bf16_peak() -> None:
    n = 8192
    a = torch.empty(n, n, device="meta", dtype=torch.bfloat16)
    out = aten.mm.default(a, a)
    fp32 = H100.estimate_ms(aten.mm.default, [_meta(n, n)] * 2, [_meta(n, n)], 2 * n ** 3)
    bf16 = H100.estimate_ms(aten.mm.default, [a, a], [out], 2 * n ** 3)
    assert bf16 < fp32 / 10


def test_broadcast_input_is_read_at_its_storage_size() -> None:
    x = _meta(4096, 4096)
    row = _meta(1, 4096).expand(4096, 4096)  # 16 KiB of storage, 64 MiB as a view
    out = aten.add.Tensor(x, row)
    moved = 4096 * 4096 * 4 + 4096 * 4 + 4096 * 4 * 4096
    expected = moved / (H100.memory_bandwidth_gbs * 1e9 * H100.efficiency["pointwise"]) * 1e3
    assert op_class(aten.add.Tensor) == "pointwise"
    assert H100.estimate_ms(aten.add.Tensor, [x, row], [out], 0) == pytest.approx(
        expected + _launch_ms(H100))
    full = _meta(4096, 4096)
    assert H100.estimate_ms(aten.add.Tensor, [x, full], [out], 0) > \
        H100.estimate_ms(aten.add.Tensor, [x, row], [out], 0) * 1.4


def test_memory_bound_classes_use_their_own_efficiency() -> None:
    x = _meta(8192, 4096)
    out = aten._softmax.default(x, -1, False)
    moved = 2 * 8192 * 4096 * 4
    expected = moved / (H100.memory_bandwidth_gbs * 1e9 * H100.efficiency["reduction"]) * 1e3
    assert op_class(aten._softmax.default) == "reduction"
    assert H100.estimate_ms(aten._softmax.default, [x], [out], 0) == pytest.approx(
        expected + _launch_ms(H100))


def test_a_gather_reads_no_more_of_its_table_than_it_returns() -> None:
    table, ids = _meta(50257, 1024), torch.empty(8, 1024, dtype=torch.long, device="meta")
    out = aten.embedding.default(table, ids)
    moved = 2 * out.numel() * 4 + ids.numel() * 8
    expected = moved / (H100.memory_bandwidth_gbs * 1e9 * H100.efficiency["copy"]) * 1e3
    assert H100.estimate_ms(aten.embedding.default, [table, ids], [out], 0) == pytest.approx(
        expected + _launch_ms(H100))


@pytest.mark.parametrize("func, kind", [
    (aten.addmm.default, "matmul"),
    (aten.bmm.default, "matmul"),
    (aten.convolution_backward.default, "matmul"),
    (aten._scaled_dot_product_flash_attention.default, "attention"),
    (aten._scaled_dot_product_efficient_attention_backward.default, "attention"),
    (aten._scaled_dot_product_cudnn_attention.default, "attention"),
    (aten.native_layer_norm_backward.default, "reduction"),
    (aten._log_softmax_backward_data.default, "reduction"),
    (aten.sum.dim_IntList, "reduction"),
    (aten.nll_loss_forward.default, "reduction"),
    (aten.embedding_dense_backward.default, "copy"),
    (aten._to_copy.default, "copy"),
    (aten.copy_.default, "copy"),
    (aten.cat.default, "copy"),
    (aten.zeros.default, "factory"),
    (aten.fill_.Scalar, "factory"),
    (aten.bernoulli_.float, "factory"),  # a scalar p: writes self, reads nothing
    (aten.bernoulli_.Tensor, "pointwise"),  # reads its probabilities
    (aten.add_.Tensor, "pointwise"),
    (aten.gelu.default, "pointwise"),
    (aten.native_dropout.default, "pointwise"),
])
def test_op_classes(func, kind) -> None:
    assert op_class(func) == kind


@pytest.mark.parametrize("name", ["H100", "H200", "A100"])
def test_every_gpu_number_names_its_source(name: str) -> None:
    spec = DEVICES[name]
    assert set(spec.efficiency) == set(OP_CLASSES) - {"view"}
    assert all(0 < e <= 1 for e in spec.efficiency.values())
    for key in (*spec.efficiency, "peak_tflops", "memory_bandwidth_gbs", "launch_overhead_us"):
        assert len(spec.sources.get(key, "")) > 10, f"{name}: no source for {key}"


def test_cpu_stays_a_rough_device_with_every_class() -> None:
    assert set(DEVICES["cpu"].efficiency) == set(OP_CLASSES) - {"view"}


def test_both_profiler_call_sites_go_through_estimate_ms(monkeypatch) -> None:
    """Every forward and backward time of an estimated profile is `estimate_ms`'s: with it
    doubled, both double (an op's backward is estimated once per distinct layout, so the
    calls are fewer than the ops)."""
    model = zoo.get("mlp", batch=4, width=16, depth=2)

    def profile() -> profiles.GraphProfile:
        return profiles.profile(model.model, model.example_inputs, loss_fn=model.loss_fn,
                                device="H100", timing="estimate", progress=False)

    plain = profile()
    original = DeviceSpec.estimate_ms
    monkeypatch.setattr(DeviceSpec, "estimate_ms",
                        lambda self, *args: 2 * original(self, *args))
    ALONE.clear()  # a backward alone runs once a process, by the device's fields
    doubled = profile()
    assert plain.fwd_time_ms > 0 and plain.bwd_time_ms > 0
    assert doubled.fwd_time_ms == pytest.approx(2 * plain.fwd_time_ms)
    assert doubled.bwd_time_ms == pytest.approx(2 * plain.bwd_time_ms)
