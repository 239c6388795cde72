"""A fake profile runs what the device runs: its fused attention kernel, autocast on meta
models, and the branches libraries take on real values (``profiles.kernels``,
``profiles.fake``)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import profiles
from planner import apply, profile_model, remove, solve, zoo
from planner.plan import InfeasibleBudgetError
from planner.runtime.emit import OpStreamWarning
from profiles.devices import device_spec
from profiles.kernels import (
    ATTENTION_OPS,
    AttentionCall,
    FusedKernels,
    attention_rules,
    choose_attention,
)

pytestmark = pytest.mark.skipif(not zoo.has_transformers(), reason="needs transformers")

LLAMA = dict(size="tiny", batch=2, seq_len=64)


def _llama(device: str) -> zoo.ZooModel:
    return zoo.get("hf-llama", device=device, **LLAMA)


def _profile(model: zoo.ZooModel, device: str, **kwargs: object) -> profiles.GraphProfile:
    return profiles.profile(model.model, model.example_inputs, loss_fn=model.loss_fn,
                            device=device, timing="estimate", progress=False, **kwargs)


def _targets(prof: profiles.GraphProfile) -> list[str]:
    return [node.target for node in prof.nodes]


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_meta_profile_for_the_cpu_is_the_real_cpu_profile(autocast: torch.dtype | None
                                                          ) -> None:
    real = _profile(_llama("cpu"), "cpu", autocast=autocast)
    meta = _profile(_llama("meta"), "cpu", autocast=autocast)
    assert (real.execution, meta.execution) == ("real", "fake")
    # same kernels in the same order (autocast casts included), same storages, same saves
    assert _targets(meta) == _targets(real)
    assert [(s.nbytes, s.kind, s.producer, s.release) for s in meta.storages] == \
        [(s.nbytes, s.kind, s.producer, s.release) for s in real.storages]
    assert [n.saved_storages for n in meta.nodes] == [n.saved_storages for n in real.nodes]


@pytest.mark.parametrize(("recorded", "name", "options"), [
    ("gpt-small.cpu", "gpt", {"size": "small"}), ("resnet.cpu", "resnet", {})])
def test_recorded_cpu_profile_and_meta_profile_agree(recorded: str, name: str,
                                                     options: dict) -> None:
    """A profile measured on real CPU tensors (benchmarks/record_profiles.py) and the meta
    model's fake profile for the CPU: the same kernels and the same storages."""
    real = profiles.load_recorded(recorded)
    meta = _profile(zoo.get(name, device="meta", **options), "cpu")
    assert (real.execution, meta.execution) == ("real", "fake")
    assert meta.fingerprint == real.fingerprint
    assert _targets(meta) == _targets(real)
    assert [(s.nbytes, s.kind, s.producer, s.release) for s in meta.storages] == \
        [(s.nbytes, s.kind, s.producer, s.release) for s in real.storages]
    for field in ("saved_storages", "grad_storages", "bwd_temp_bytes"):
        assert [getattr(n, field) for n in meta.nodes] == [getattr(n, field) for n in real.nodes]


@pytest.mark.parametrize(("autocast", "kernel"), [(None, "efficient"),
                                                  (torch.bfloat16, "cudnn")])
def test_meta_profile_for_an_h100_runs_its_fused_attention(autocast: torch.dtype | None,
                                                           kernel: str) -> None:
    prof = _profile(_llama("meta"), "H100", autocast=autocast)
    targets = _targets(prof)
    assert targets.count(ATTENTION_OPS[kernel]) == 2  # one per layer
    assert "aten._safe_softmax.default" not in targets  # no math decomposition
    # the fused kernel keeps no (heads x tokens x tokens) matrix: the step saves about
    # what the CPU's fused kernel saves
    cpu = _profile(_llama("cpu"), "cpu", autocast=autocast)
    assert prof.saved_activation_bytes() == pytest.approx(cpu.saved_activation_bytes(),
                                                          rel=0.01)


def test_meta_profile_for_an_h100_runs_fused_dropout() -> None:
    gpt = zoo.get("gpt", size="tiny", batch=2, device="meta")  # dropout 0.1
    targets = {device: _targets(_profile(gpt, device)) for device in ("cpu", "H100")}
    # the CPU draws float noise and multiplies (saving the noise); a GPU runs one
    # native_dropout that saves a boolean mask
    assert "aten.bernoulli_.float" in targets["cpu"]
    assert "aten.native_dropout.default" not in targets["cpu"]
    assert targets["H100"].count("aten.native_dropout.default") == \
        targets["cpu"].count("aten.bernoulli_.float")
    assert "aten.bernoulli_.float" not in targets["H100"]


def _call(dtype: torch.dtype = torch.bfloat16, head_dim: int = 64, **kwargs: object
          ) -> AttentionCall:
    q = torch.empty(2, 8, 128, head_dim, dtype=dtype, device="meta", requires_grad=True)
    return AttentionCall(q, q, q, **kwargs)


def test_attention_selection_follows_torchs_rules() -> None:
    h100, a100, cpu = (attention_rules(device_spec(n)) for n in ("H100", "A100", "cpu"))
    mask = torch.ones(128, 128, dtype=torch.bool, device="meta")
    assert choose_attention(h100, _call()) == "cudnn"
    assert choose_attention(h100, _call(dropout_p=0)) == "cudnn"  # an int, as users write it
    assert choose_attention(a100, _call()) == "flash"
    assert choose_attention(h100, _call(torch.float32)) == "efficient"
    assert choose_attention(a100, _call(attn_mask=mask)) == "efficient"  # flash: no mask
    assert choose_attention(h100, _call(head_dim=6)) == "flash"  # padded to 8
    assert choose_attention(h100, _call(torch.float64)) == "math"
    assert choose_attention(cpu, _call(torch.float32)) == "flash_cpu"
    assert choose_attention(cpu, _call(torch.float32, dropout_p=0.1)) == "math"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):  # the user's choice
        assert choose_attention(h100, _call()) == "flash"


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_fake_cuda_tensors_run_the_fused_kernel_without_a_gpu() -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
        with FusedKernels(device_spec("H100")), _OpNames() as seen:
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert ATTENTION_OPS["cudnn"] in seen.names
    assert out.shape == q.shape and out.device.type == "cuda"


class _BranchOnPositions(nn.Module):
    """Branches on values computed from the input's shape, as HF's mask code does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        if bool((torch.diff(positions) == 1).all()):  # one sequence, not packed
            return self.linear(x)
        return self.linear(x) * 2


def test_a_branch_on_computable_values_stays_on_fake_tensors() -> None:
    model = _BranchOnPositions()
    prof = profiles.profile(model, (torch.randn(2, 8, 16),), loss_fn=lambda y: y.sum(),
                            execution="fake", timing="estimate", device="cpu",
                            progress=False)
    assert prof.execution == "fake"  # answered from known values, not redone on real ones
    assert "aten.mul.Tensor" not in _targets(prof)  # the branch the real step takes


def test_plan_names_its_attention_kernel_and_the_model_warns_when_another_runs() -> None:
    meta = zoo.get("hf-llama", device="meta", size="tiny", batch=2, seq_len=256)
    profiled = profile_model(meta.model, meta.example_inputs, device="H100",
                             timing="estimate", progress=False)
    with pytest.raises(InfeasibleBudgetError) as lowest:  # its lowest peak: every layer
        solve(profiled, budget_bytes=int(0.3 * profiled.unplanned_peak_bytes))
    plan = lowest.value.plan
    assert "model.layers.0" in {r.module for r in plan.regions if r.mode == "recompute"}
    assert plan.attention_kernels() == {"efficient": 2}
    assert "attention kernel assumed: efficient x2" in plan.summary()
    real = zoo.get("hf-llama", device="cpu", size="tiny", batch=2, seq_len=256)  # flash_cpu
    apply(real.model, plan)
    try:
        with pytest.warns(OpStreamWarning, match="attention kernel flash_cpu where the plan "
                          "assumed efficient"), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("always", OpStreamWarning)
            real.model(**real.example_inputs).loss.backward()
    finally:
        remove(real.model)


def test_a_real_cpu_profile_for_a_gpu_says_its_kernels_are_the_cpus() -> None:
    gpt = zoo.get("hf-gpt2", device="cpu")  # SDPA with dropout: math on the CPU
    profiled = profile_model(gpt.model, gpt.example_inputs, device="H100", timing="estimate",
                             progress=False)
    assert profiled.profile.execution == "real"
    (note,) = [n for n in profiled.notes if "real CPU tensors" in n]
    assert "math" in note and "meta device" in note
    meta = zoo.get("hf-gpt2", device="meta")
    assert not any("real CPU tensors" in n for n in profile_model(
        meta.model, meta.example_inputs, device="H100", progress=False).notes)


def test_meta_kernels_that_refuse_their_arguments_print_no_tracebacks(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """Qwen3-MoE's experts run ``_grouped_mm``, whose meta kernel refuses float32: fake
    mode logs each refusal with its traceback at ERROR; the profile says once per op what
    it counts instead and keeps the tracebacks at DEBUG (``profiles.fake``)."""
    import transformers

    if not hasattr(transformers, "Qwen3MoeForCausalLM"):
        pytest.skip("transformers has no Qwen3-MoE")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    # the DEBUG records are caught here, not propagated: a handler another test left on
    # the root logger (the CLI's) must not print what a user at default verbosity never sees
    debug: list[logging.LogRecord] = []
    catcher = logging.Handler(logging.DEBUG)
    catcher.emit = debug.append
    fake_log = logging.getLogger("profiles.fake")
    fake_log.addHandler(catcher)
    try:
        with _logger_level(fake_log, logging.DEBUG, propagate=False):
            profiles.profile(model, {"input_ids": ids, "labels": ids}, timing="estimate",
                             progress=False)
    finally:
        fake_log.removeHandler(catcher)
    shown = capfd.readouterr()
    assert "Traceback" not in shown.err + shown.out
    assert not [r for r in caplog.records if r.levelno >= 40]
    told = [r.getMessage() for r in caplog.records if r.name == "profiles.backward"
            and r.getMessage().startswith("could not profile the backward")]
    assert len(told) == len({message.split(" alone")[0] for message in told})
    if any("_grouped_mm" in message for message in told):
        assert any(r.levelno == logging.DEBUG and r.exc_info for r in debug)


@contextlib.contextmanager
def _logger_level(logger: logging.Logger, level: int, propagate: bool) -> Iterator[None]:
    before = (logger.level, logger.propagate)
    logger.setLevel(level)
    logger.propagate = propagate
    try:
        yield
    finally:
        logger.setLevel(before[0])
        logger.propagate = before[1]


class _Received(torch.autograd.Function):
    """A loss whose backward hands the output a gradient made before the step."""

    @staticmethod
    def forward(ctx: object, output: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        ctx.received = received  # type: ignore[attr-defined]
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.received, None  # type: ignore[attr-defined]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_gradient_from_before_the_step_is_not_the_backwards_memory(device: str) -> None:
    """A pipeline stage's backward starts from the gradient it received, a buffer made
    before the step. The observed backward (a fake step) converts it when an op first
    reads it; a view of it (``t()`` in a Linear's backward) is no allocation: the
    backward holds the weight's and the bias's gradients only (it read 131,072 bytes
    more, one received gradient, on the CPU; on the meta device from the start)."""
    model = nn.Linear(64, 64).to(device)
    x, received = (torch.randn(512, 64, device=device) for _ in range(2))
    prof = profiles.profile(model, (x,), loss_fn=lambda out: _Received.apply(out, received),
                            device="cpu", timing="estimate", progress=False)
    grads = sum(p.numel() * 4 for p in model.parameters())
    loss = 4  # the scalar the backward's seed is made from
    assert {node.name: node.bwd_peak_bytes for node in prof.nodes}["addmm"] == grads + loss


def test_a_fake_profile_asks_for_a_gpu_once_not_per_op(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Under ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (importing Lightning sets it) each
    ``torch.cuda.is_available()`` loads NVML; torch's fake mode asks it per op, so a profile
    asked it ~1,350 times for a tiny GPT (``profiles.fake.fake_mode`` asks once per mode)."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    asked = []
    available = torch.cuda.is_available
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or available())
    model = zoo.get("gpt", size="tiny", batch=2)
    profile_model(model.model, model.example_inputs, loss_fn=model.loss_fn,
                  timing="estimate", progress=False)
    assert 0 < len(asked) <= 5, f"asked {len(asked)} times"
