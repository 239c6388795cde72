"""A compiled step's time from its kernels (`profiles.compiled_time`, the host's roofline in
`profiles.host_roofline`) and its use by the count and the compiled fit."""

from __future__ import annotations

import pytest
import torch

from planner import zoo
from planner.compiled_fake import FakeCompiledStep
from planner.solving import plan_for_schedule
from profiles import compiled_time, default_loss
from profiles import host_roofline as roofline
from profiles.compiled_time import KernelClock
from profiles.devices import device_spec
from profiles.inputs import normalize_inputs
from solvers.baselines import policy_schedule

H100 = device_spec("H100")


def _running(clock: KernelClock) -> KernelClock:
    clock.running = True
    return clock


def test_a_fused_kernel_costs_the_roofline_of_each_buffer_it_takes_once() -> None:
    """A fused kernel reads and writes each buffer it is passed once, however often it is
    passed (an in-out buffer), at the device's streaming rate, plus one launch; a clock
    not running charges nothing."""
    clock = _running(KernelClock(H100))
    x, out = torch.empty(1024), torch.empty(4096)
    clock.fused((x, out, out, 3, 1.5))
    expected = H100.op_time_ms(0, 4 * (1024 + 4096), "float32", "pointwise")
    assert clock.ms == pytest.approx(expected) and clock.kernels == 1
    clock.running = False
    clock.fused((x, out))
    assert clock.ms == pytest.approx(expected)


def test_a_fused_kernel_is_transcendental_by_the_ops_its_name_lists() -> None:
    """Inductor names a kernel by the aten ops it fused: a softmax, a layer norm or a GELU
    is computed per element, a transpose's copy or a logical and streams."""
    from profiles.compiled_time import fused_class

    for name in ("cpp_fused__softmax_masked_fill_mul_view_2",
                 "cpp_fused_native_layer_norm_backward_view_0", "triton_poi_fused_gelu_3"):
        assert fused_class(name) == "transcendental", name
    for name in ("cpp_fused_clone_split_transpose_view_1", "cpp_fused_logical_and_0"):
        assert fused_class(name) == "pointwise", name


def test_an_op_that_returns_no_tensor_runs_no_kernel() -> None:
    """A query the wrapper dispatches (``prim.device``: 204 a step in GPT small's compiled
    graphs) is not a kernel (before: each was charged a read of its tensor, 6 of GPT
    small's 29 ms); an ``out=`` op charges its matmul once, its output not read."""
    clock = _running(KernelClock(H100))
    a, b, out = torch.empty(64, 32), torch.empty(32, 16), torch.empty(64, 16)
    clock.aten(torch.ops.prim.device.default, (a,), {}, a.device)
    assert clock.ms == 0 and clock.kernels == 0
    clock.aten(torch.ops.aten.mm.out, (a, b), {"out": out}, out)
    assert clock.ms == pytest.approx(H100.op_time_ms(2 * 64 * 32 * 16, 4 * (64 * 32 + 32 * 16
                                                                            + 64 * 16),
                                                     "float32", "matmul"))


def test_on_the_host_a_matmul_is_timed_once_per_shape(monkeypatch) -> None:
    """On the host a compute or reduction op is timed on real tensors of its shapes, once
    per shape and strides (the cache), and a pointwise op is not timed (the roofline)."""

    timed: list[float] = []

    def least_ms(run) -> float:
        run()
        timed.append(0.25)
        return 0.25

    monkeypatch.setattr(compiled_time, "_least_ms", least_ms)
    clock = _running(KernelClock(roofline.host_roofline(), on_host=True))
    a, b = torch.empty(8, 4), torch.empty(4, 2)
    for _ in range(3):
        clock.aten(torch.ops.aten.mm.default, (a, b), {}, torch.empty(8, 2))
    clock.aten(torch.ops.aten.mm.default, (a.t().contiguous().t(), b), {}, torch.empty(8, 2))
    assert timed == [0.25, 0.25] and clock.ms == pytest.approx(4 * 0.25)
    clock.aten(torch.ops.aten.add.Tensor, (a, a), {}, torch.empty(8, 4))
    assert len(timed) == 2 and clock.ms > 1.0
    # a reduction is timed too (an eager loss's log-softmax: 7 x its roofline on GPT small)
    clock.aten(torch.ops.aten._log_softmax.default, (a, 1, False), {}, torch.empty(8, 4))
    assert len(timed) == 3
    # a product too long to time on the host runs at the fitted rate
    big = torch.empty(4096, 4096)
    before = clock.ms
    clock.aten(torch.ops.aten.mm.default, (big, big), {}, big)
    assert len(timed) == 3 and clock.ms - before > compiled_time.HOST_TIMED_MAX_MS


def test_the_host_rate_is_fitted_per_call_and_per_unit_of_work() -> None:
    """``seconds = per call + work / rate``: recovered from exact samples; a negative
    per-call cost (noise) is none, the rate then the samples' total."""
    rate, per_call = roofline._fit([(w, 2e-6 + w / 5e10) for w in (1e5, 1e6, 1e7, 1e8)])
    assert rate == pytest.approx(5e10, rel=1e-6) and per_call == pytest.approx(2e-6, rel=1e-6)
    rate, per_call = roofline._fit([(1e6, 1e-4), (2e6, 3e-4), (4e6, 7e-4)])
    assert per_call == 0 and rate == pytest.approx(7e6 / 1.1e-3)


def test_a_compiled_step_counted_with_a_roofline_predicts_its_recompute() -> None:
    """GPT tiny compiled whole, counted on fake tensors: with a device's roofline the step
    is timed from the kernels its generated code calls (before: None), and every block
    checkpointed predicts a slower step than nothing checkpointed (the forward's matmuls
    again), at the peak counted without a clock."""
    zm = zoo.get("gpt", size="tiny", dropout=0.0)
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    from planner import profile_model

    profiled = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                             timing="estimate", progress=False)
    every = plan_for_schedule(profiled.profile,
                              policy_schedule("every-layer", profiled.problem()),
                              profiled.inputs, profiled.structure)
    step = FakeCompiledStep(zm.model, args, kwargs, zm.loss_fn, "model", [], spec=H100)
    plain, rerun = step.run(None), step.run(every)
    assert plain.step_ms == step.run(None).step_ms  # H100's: nothing timed on this host
    assert 0 < plain.step_ms < rerun.step_ms
    assert "predicted" in step.measure and "H100" in step.measure
    untimed = FakeCompiledStep(zm.model, args, kwargs, zm.loss_fn, "model", []).run(every)
    assert untimed.step_ms is None and untimed.peak_bytes == rerun.peak_bytes


def test_a_graph_call_costs_its_call_and_each_tensor_it_takes() -> None:
    """Rule 3: a compiled graph's call is host work, per call and per tensor it takes
    (guards, checks, a parameter's accumulation): a graph of 200 tensors costs more than one
    of 2 by 198 of the per-tensor cost."""
    clock = _running(KernelClock(H100))
    clock.graph(2)
    small = clock.ms
    clock.graph(200)
    assert clock.graphs == 2 and small == pytest.approx((H100.compiled_graph_us
                                                         + 2 * H100.compiled_input_us) / 1e3)
    assert clock.ms - 2 * small == pytest.approx(198 * H100.compiled_input_us / 1e3)


def test_on_the_host_a_generated_kernel_runs_on_real_buffers_laid_out_as_its_own() -> None:
    """Rule 1 on the host: the kernel is called on real tensors of its arguments' shapes,
    strides and offsets, one real storage per storage they share (an in-out buffer stays
    one; as far as they reach into it), integers zero (an index in range), floats drawn without touching the process's
    RNG; once per kernel and layout; a kernel that raises on them keeps its roofline."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    seen: list[tuple] = []

    def kernel(*args):
        seen.append(args)

    mode = FakeTensorMode()
    with mode:
        buffer = torch.empty(64)
        view = torch.as_strided(buffer, (4, 8), (8, 1), 16)
        index = torch.empty(32, dtype=torch.int64)
    clock = _running(KernelClock(roofline.host_roofline(), on_host=True))
    rng = torch.random.get_rng_state()
    for _ in range(2):
        clock.fused((buffer, view, index, 7), "cpp_fused_add_0", kernel)
    assert torch.equal(torch.random.get_rng_state(), rng)
    calls = len(seen)
    assert calls == 1 + compiled_time.REPEATS  # one warm run, then the timed ones, once
    real_buffer, real_view, real_index, scalar = seen[0]
    assert not any(isinstance(t, FakeTensor) for t in seen[0])
    assert real_view.untyped_storage().data_ptr() == real_buffer.untyped_storage().data_ptr()
    assert (real_view.shape, real_view.stride(), real_view.storage_offset()) == \
        ((4, 8), (8, 1), 16) and scalar == 7
    assert int(real_index.abs().sum()) == 0 and float(real_buffer.abs().sum()) > 0
    with mode:  # a slice of a large buffer: its storage as far as the slice reaches
        large = torch.empty(1 << 20)
    clock.fused((large[8:16],), "cpp_fused_copy_2", kernel)
    assert seen[-1][0].untyped_storage().nbytes() == 16 * 4

    def failing(*args):
        raise RuntimeError("index out of bounds")

    before = clock.ms
    clock.fused((buffer,), "cpp_fused_gather_1", failing)
    assert clock.ms - before == pytest.approx(roofline.host_roofline().op_time_ms(
        0, 4 * 64, "float32", "pointwise"))


def test_on_the_host_a_compiled_steps_kernels_are_the_ones_timed(monkeypatch) -> None:
    """HF GPT-2 (dropout on: inductor draws its random numbers in the kernels, which a
    roofline per byte put 13 x short) compiled whole and counted with the host's clock:
    every fused kernel its graphs call is run on real buffers, and none raises (none falls
    back to its roofline)."""
    runs: list[str] = []

    def least_ms(run) -> float:
        try:
            run()
        except Exception as error:  # recorded, then the clock's own fallback
            runs.append(f"raised {error}")
            raise
        runs.append(run.__qualname__)
        return 0.01

    monkeypatch.setattr(compiled_time, "_least_ms", least_ms)
    zm = zoo.get("hf-gpt2", n_layer=1)
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    names: set[str] = set()
    fused = KernelClock.fused

    def noted(self, args, name="", kernel=None):
        if self.running and kernel is not None:
            names.add(name)
        fused(self, args, name, kernel)

    monkeypatch.setattr(KernelClock, "fused", noted)
    step = FakeCompiledStep(zm.model, args, kwargs, zm.loss_fn or default_loss, "model", [],
                            spec=roofline.host_roofline())
    assert step.run(None).step_ms > 0
    kernels_run = [r for r in runs if "_kernel_ms" in r]
    assert any("dropout" in name for name in names)
    assert len(kernels_run) >= len(names) > 0 and not [r for r in runs if "raised" in r]
