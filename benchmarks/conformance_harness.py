"""Conformance: plans on real models nobody here wrote must run and hold their budget.

Each case builds a random-init model offline (torchvision, timm, Hugging Face transformers,
and a few hand-written models that reproduce known failure classes) small enough for a
2-core CPU, with inputs and a loss. :func:`check_case` then does what a user does, at
several budgets: ``optimize`` (profile once, ``replan`` per budget), ``apply``, one training
step; and checks, against the unplanned model from the same state:

* ``apply`` returns the model itself, with its module tree and parameters;
* the measured peak (:class:`planner.measure.PeakTracker`, MemTracker's count) is within
  the budget, and the prediction within 1 % of it, never low by more than 0.1 %;
* loss and every gradient are bit-identical, and buffers (BatchNorm statistics, step
  counters) end the step as the unplanned step leaves them;
* planning (profile, solve, apply) changed no parameter, buffer or RNG state;
* a budget below the minimum raises ``InfeasibleBudgetError`` whose named minimum, asked
  for, gives a plan that holds;
* solving took at most ``time_limit_s`` (profiling comes on top), a quarter more for a
  budget no plan meets (the search for the lowest peak, `planner.solving`).

``benchmarks/conformance.py`` runs every case; the test suite runs one per failure class.
``conformance_workflows.py`` beside this file runs the same cases as users train: re-planned,
planned after a backward, with gradient accumulation, with an optimizer, planned in eval.
The harness uses the planner's public API only (``profile_model`` / ``solve``), as a user
would.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from model_snapshot import ModelSnapshot
from torch import nn

import profiles
from planner import ProfiledStep, apply, measure_step, profile_model, remove, solve, zoo
from planner.plan import InfeasibleBudgetError, Plan, format_bytes
from planner.solving import LOWEST_PEAK_SHARE
from profiles.inputs import normalize_inputs

log = logging.getLogger(__name__)

__all__ = ["CASES", "Case", "Row", "cache_off", "check_case", "judge", "markdown_table",
           "model_state", "quiet", "same_state"]


@dataclass(frozen=True)
class Case:
    """A real model to plan: ``build()`` returns a fresh ZooModel (model, inputs, loss)."""

    name: str
    family: str
    build: Callable[[], zoo.ZooModel]
    covers: tuple[str, ...] = ()  # issue-11 failure classes it reproduces
    needs: str = ""  # module it imports (skipped when missing)


@dataclass
class Row:
    """One budget of one case."""

    model: str
    family: str
    budget: str  # "30 %", "50 %", "80 %", "minimum"
    precision: str = "fp32"  # or the autocast dtype the step runs under ("bf16")
    workflow: str = "fresh"  # or how the user got there (conformance_workflows.WORKFLOWS)
    same_profile: bool | None = None  # the step profiled as on a fresh object (None: n/a)
    same_plan: bool | None = None  # the fresh object's schedule at this budget (None: n/a)
    budget_bytes: int = 0
    outcome: str = ""  # "ok", or what went wrong
    predicted_bytes: int = 0
    measured_bytes: int = 0
    unplanned_bytes: int = 0
    error_pct: float = 0.0
    losses_equal: bool = False
    grads_equal: bool = False
    buffers_equal: bool = False
    state_kept: bool = False  # profiling left the model and the RNG exactly as they were
    solver: str = ""
    recompute_ms: float | None = None  # the plan's predicted recompute time
    gap: float | None = None  # its proven gap over its solver's space (None: no bound)
    regions: int = 0
    offloads: int = 0  # offloaded module calls (planned with offload=True)
    offloaded_bytes: int = 0
    solve_s: float = 0.0
    profile_s: float = 0.0
    named_minimum_bytes: int | None = None
    note: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


# ----------------------------------------------------------------------------- cases


def _images(batch: int, size: int, classes: int = 10, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, size, size, generator=gen),
            torch.randint(0, classes, (batch,), generator=gen))


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, dict):
        return output["out"]
    return getattr(output, "logits", output)


def _classifier(name: str, model: nn.Module, batch: int, size: int,
                classes: int = 10) -> zoo.ZooModel:
    x, y = _images(batch, size, classes)
    return zoo.ZooModel(name, model, (x,), lambda out: F.cross_entropy(_logits(out), y))


def _segmenter(name: str, model: nn.Module, batch: int, size: int,
               classes: int = 3) -> zoo.ZooModel:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=gen)
    y = torch.randint(0, classes, (batch, size, size), generator=gen)

    def loss(out: dict) -> torch.Tensor:
        total = F.cross_entropy(out["out"], y)
        if "aux" in out:
            total = total + 0.5 * F.cross_entropy(out["aux"], y)
        return total

    return zoo.ZooModel(name, model, (x,), loss)


def _tv(builder: str, size: int = 64, batch: int = 2, **kwargs: Any) -> Callable[[],
                                                                                   zoo.ZooModel]:
    def build() -> zoo.ZooModel:
        import torchvision

        torch.manual_seed(0)
        model = getattr(torchvision.models, builder)(weights=None, **kwargs)
        return _classifier(f"torchvision {builder}", model, batch, size,
                           kwargs.get("num_classes", 1000))
    return build


def _tv_seg(builder: str, size: int = 64, batch: int = 2) -> Callable[[], zoo.ZooModel]:
    def build() -> zoo.ZooModel:
        import torchvision

        torch.manual_seed(0)
        model = getattr(torchvision.models.segmentation, builder)(
            weights=None, weights_backbone=None, num_classes=3, aux_loss=True)
        return _segmenter(f"torchvision {builder}", model, batch, size)
    return build


def _timm(name: str, size: int = 64, batch: int = 2, **kwargs: Any) -> Callable[[],
                                                                                  zoo.ZooModel]:
    def build() -> zoo.ZooModel:
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        return _classifier(f"timm {name}", model, batch, size)
    return build


def _hf_model(config_name: str, model_name: str, **config: Any) -> tuple[Any, nn.Module]:
    """A random-init transformers model from its config class, seeded, quietly."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(**config)
    return cfg, getattr(transformers, model_name)(cfg)


def _hf_lm(config_name: str, model_name: str, batch: int = 4, seq: int = 64,
           **config: Any) -> Callable[[], zoo.ZooModel]:
    """A causal or masked LM with its default config (``use_cache`` as it comes)."""
    def build() -> zoo.ZooModel:
        cfg, model = _hf_model(config_name, model_name, **config)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq),
                            generator=torch.Generator().manual_seed(0))
        return zoo.ZooModel(f"HF {model_name}", model, {"input_ids": ids, "labels": ids}, None)
    return build


def _hf_seq2seq(config_name: str, model_name: str, batch: int = 4, seq: int = 32,
                **config: Any) -> Callable[[], zoo.ZooModel]:
    def build() -> zoo.ZooModel:
        cfg, model = _hf_model(config_name, model_name, **config)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
        return zoo.ZooModel(f"HF {model_name}", model, {"input_ids": ids, "labels": labels},
                            None)
    return build


def _hf_whisper() -> zoo.ZooModel:
    _, model = _hf_model("WhisperConfig", "WhisperForConditionalGeneration", vocab_size=512,
                         num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
                         encoder_attention_heads=4, decoder_attention_heads=4,
                         encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=32,
                         max_target_positions=32, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, decoder_start_token_id=1)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(2, 16, 64, generator=gen)
    labels = torch.randint(0, 512, (2, 12), generator=gen)
    return zoo.ZooModel("HF WhisperForConditionalGeneration", model,
                        {"input_features": features, "labels": labels}, None)


def _hf_vit() -> zoo.ZooModel:
    _, model = _hf_model("ViTConfig", "ViTForImageClassification", image_size=32,
                         patch_size=8, hidden_size=64, num_hidden_layers=3,
                         num_attention_heads=4, intermediate_size=128, num_labels=10)
    x, y = _images(2, 32)
    return zoo.ZooModel("HF ViTForImageClassification", model,
                        {"pixel_values": x, "labels": y}, None)


_DECODER = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64)


# hand-written models for failure classes real models showed


class UNet(nn.Module):
    """A small U-Net: BatchNorm, ReLU(inplace=True), concatenated skips (not a chain)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout),
                                 nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, padding=1),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.down1, self.down2 = block(3, width), block(width, 2 * width)
        self.bottom = block(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = block(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = block(2 * width, width)
        self.head = nn.Conv2d(width, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        b = self.bottom(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(b), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.head(u1)


class InPlaceBlock(nn.Module):
    """A residual MLP block that updates tensors in place (``relu_``, ``add_``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h.relu_()
        out = self.fc2(h)
        out.add_(x)
        return out


class InPlaceNet(nn.Module):
    """Residual blocks whose forward updates tensors in place."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(InPlaceBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(torch.relu_(x))


class LossInside(nn.Module):
    """Computes its own loss and returns ``(loss, logits)``, as many training scripts do."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                                    for _ in range(4)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.body(x))
        return F.cross_entropy(logits, y), logits


class Counted(nn.Module):
    """BatchNorm without momentum (a running mean over all steps) and a step counter."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width, momentum=None),
                          nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(width, 10)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps.add_(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _custom(name: str, model: Callable[[], nn.Module], x: Callable[[], Any],
            loss: Callable[[Any], torch.Tensor] | None = None) -> Callable[[], zoo.ZooModel]:
    def build() -> zoo.ZooModel:
        torch.manual_seed(0)
        return zoo.ZooModel(name, model(), x(), loss)
    return build


def _labels(batch: int) -> torch.Tensor:
    return torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1))


CASES: list[Case] = [
    Case("torchvision resnet18", "torchvision", _tv("resnet18", batch=16, num_classes=10),
         ("1 in-place ReLU at a region boundary",), "torchvision"),
    Case("torchvision resnet50", "torchvision", _tv("resnet50", batch=12, num_classes=10),
         ("1", "3 minimum"), "torchvision"),
    Case("torchvision densenet121", "torchvision", _tv("densenet121", batch=8, num_classes=10),
         ("4 concatenations",), "torchvision"),
    Case("torchvision inception_v3", "torchvision",
         _tv("inception_v3", size=96, batch=8, num_classes=10, aux_logits=False,
             init_weights=True),
         ("1", "7 time limit"), "torchvision"),
    Case("torchvision efficientnet_b0", "torchvision",
         _tv("efficientnet_b0", batch=16, num_classes=10), (), "torchvision"),
    Case("torchvision mobilenet_v3_small", "torchvision",
         _tv("mobilenet_v3_small", batch=32, num_classes=10), (), "torchvision"),
    Case("torchvision regnet_y_400mf", "torchvision",
         _tv("regnet_y_400mf", batch=16, num_classes=10), ("7 time limit",), "torchvision"),
    Case("torchvision convnext_tiny", "torchvision",
         _tv("convnext_tiny", size=96, batch=8, num_classes=10), (), "torchvision"),
    Case("torchvision swin_t", "torchvision", _tv("swin_t", batch=8, num_classes=10), (),
         "torchvision"),
    Case("torchvision vit_b_16", "torchvision",
         _tv("vit_b_16", size=224, batch=4, num_classes=10), ("3 bound", "7 time limit"),
         "torchvision"),
    Case("torchvision maxvit_t", "torchvision",
         _tv("maxvit_t", size=224, batch=2, num_classes=10), ("5 stable fingerprint",),
         "torchvision"),
    Case("torchvision fcn_resnet50", "torchvision", _tv_seg("fcn_resnet50", batch=4),
         ("4 joins", "dict outputs"), "torchvision"),
    Case("torchvision deeplabv3_mobilenet_v3_large", "torchvision",
         _tv_seg("deeplabv3_mobilenet_v3_large", batch=8), ("4 joins", "dict outputs"),
         "torchvision"),
    Case("timm resnet18d", "timm", _timm("resnet18d", batch=16), ("1", "3 bound"), "timm"),
    Case("timm efficientnet_b0", "timm", _timm("efficientnet_b0", batch=16),
         ("2 kept output mutated (squeeze-excite)",), "timm"),
    Case("timm vit_tiny_patch16_224", "timm",
         _timm("vit_tiny_patch16_224", batch=32, img_size=64), (), "timm"),
    Case("timm convnext_atto", "timm", _timm("convnext_atto", batch=32), (), "timm"),
    Case("timm mobilenetv3_small_050", "timm", _timm("mobilenetv3_small_050", batch=32), (),
         "timm"),
    Case("timm regnetx_002", "timm", _timm("regnetx_002", batch=32), (), "timm"),
    Case("HF GPT2LMHeadModel", "transformers",
         _hf_lm("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=64, n_head=4,
                vocab_size=512, n_positions=64), ("5 use_cache",), "transformers"),
    Case("HF BertForMaskedLM", "transformers",
         _hf_lm("BertConfig", "BertForMaskedLM", vocab_size=512, hidden_size=64,
                num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=64), (), "transformers"),
    Case("HF T5ForConditionalGeneration", "transformers",
         _hf_seq2seq("T5Config", "T5ForConditionalGeneration", vocab_size=512, d_model=64,
                     d_kv=16, d_ff=128, num_layers=2, num_heads=4, pad_token_id=0,
                     decoder_start_token_id=0, eos_token_id=1),
         ("5 lifted constants", "7 in-place op on a stored input"), "transformers"),
    Case("HF GPTNeoXForCausalLM", "transformers",
         _hf_lm("GPTNeoXConfig", "GPTNeoXForCausalLM", **_DECODER), (), "transformers"),
    Case("HF LlamaForCausalLM (GQA)", "transformers",
         _hf_lm("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_DECODER),
         ("5 use_cache", "GQA gradients"), "transformers"),
    Case("HF MistralForCausalLM", "transformers",
         _hf_lm("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, **_DECODER),
         (), "transformers"),
    Case("HF Qwen2ForCausalLM", "transformers",
         _hf_lm("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **_DECODER),
         (), "transformers"),
    Case("HF MixtralForCausalLM (MoE)", "transformers",
         _hf_lm("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2,
                num_local_experts=4, num_experts_per_tok=2, **_DECODER),
         ("data-dependent routing",), "transformers"),
    Case("HF ViTForImageClassification", "transformers", _hf_vit, (), "transformers"),
    Case("HF WhisperForConditionalGeneration", "transformers", _hf_whisper,
         ("5 lifted constants", "7 time limit"), "transformers"),
    Case("U-Net (BatchNorm, concatenated skips)", "custom",
         _custom("U-Net", UNet, lambda: (torch.randn(2, 3, 32, 32),),
                 lambda out: out.square().mean()), ("4 concatenations", "1")),
    Case("in-place add_/relu_ in blocks", "custom",
         _custom("InPlaceNet", InPlaceNet, lambda: (torch.randn(256, 64),),
                 lambda out: F.cross_entropy(out, _labels(256))), ("4 in-place",)),
    Case("loss inside forward, (loss, logits)", "custom",
         _custom("LossInside", LossInside,
                 lambda: (torch.randn(256, 64), _labels(256))), ("4 loss inside",)),
    Case("BatchNorm(momentum=None) and a step counter", "custom",
         _custom("Counted", Counted, lambda: (torch.randn(64, 32),),
                 lambda out: F.cross_entropy(out, _labels(64))), ("6 state",)),
]


# ----------------------------------------------------------------------------- checking


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@contextlib.contextmanager
def cache_off(model: nn.Module) -> Iterator[None]:
    """Hugging Face's key/value cache off, as a planned model trains (``apply`` turns it off),
    so that the unplanned reference runs the same step."""
    configs = {id(m.config): m.config for m in model.modules()
               if getattr(getattr(m, "config", None), "use_cache", False) is True}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _reference_step(zm: zoo.ZooModel, args: tuple, kwargs: dict, state: dict,
                    autocast_dtype: str | None) -> tuple[int, torch.Tensor, dict, dict]:
    """One unplanned step from ``state`` (HF cache off, as training with a plan runs)."""
    zm.model.load_state_dict(state)
    torch.manual_seed(0)
    with cache_off(zm.model):
        peak, loss, grads = measure_step(zm.model, args, kwargs,
                                         zm.loss_fn or profiles.default_loss, autocast_dtype)
    return peak, loss, grads, model_state(zm.model)


def _planned_step(zm: zoo.ZooModel, plan: Plan, args: tuple, kwargs: dict, state: dict,
                  row: Row, reference: tuple) -> None:
    """Apply ``plan`` (checking it changes nothing), run one step, compare, remove."""
    zm.model.load_state_dict(state)
    rng = torch.get_rng_state()
    tree = [(name, type(m)) for name, m in zm.model.named_modules()]
    params = [id(p) for p in zm.model.parameters()]
    if apply(zm.model, plan) is not zm.model:
        row.failures.append("apply returned another object than the model")
    if not (same_state(state, model_state(zm.model)) and torch.equal(rng, torch.get_rng_state())):
        row.failures.append("apply changed the model's state or the RNG")
    if (tree != [(name, type(m)) for name, m in zm.model.named_modules()]
            or params != [id(p) for p in zm.model.parameters()]):
        row.failures.append("apply changed the model's module tree or parameters")
    torch.manual_seed(0)
    try:
        peak, loss, grads = measure_step(zm.model, args, kwargs,
                                         zm.loss_fn or profiles.default_loss,
                                         plan.autocast_dtype)
    finally:
        after = model_state(zm.model)
        remove(zm.model)
        zm.model.load_state_dict(state)
    _, base_loss, base_grads, base_after = reference
    row.measured_bytes = peak
    row.predicted_bytes = plan.predicted_peak_bytes
    row.error_pct = 100 * (plan.predicted_peak_bytes - peak) / peak
    row.losses_equal = bool(torch.equal(loss, base_loss))
    row.grads_equal = base_grads.keys() == grads.keys() and all(
        torch.equal(base_grads[k], grads[k]) for k in grads)
    row.buffers_equal = same_state(after, base_after)
    row.solver = f"{plan.solver.name} ({plan.solver.status})"
    row.recompute_ms, row.gap = plan.recompute_ms, plan.solver.gap
    row.regions = len(plan.schedule.recompute_regions())
    row.offloads = len(plan.schedule.offloads)
    row.offloaded_bytes = plan.offloaded_bytes
    judge(row, plan.budget_bytes)


def judge(row: Row, budget_bytes: int) -> None:
    """The conformance rule, once: within budget, prediction within -0.1 .. +1 % of the
    measured peak, losses, gradients and state (buffers; weights after optimizer steps)
    equal to the unplanned model's."""
    if row.measured_bytes > budget_bytes:
        row.failures.append(f"measured {format_bytes(row.measured_bytes)} over the budget "
                            f"{format_bytes(budget_bytes)}")
    if not -0.1 <= row.error_pct <= 1.0:
        row.failures.append(f"predicted {row.error_pct:+.2f} % off the measured peak")
    if not (row.losses_equal and row.grads_equal):
        row.failures.append("losses or gradients differ from the unplanned model's")
    if not row.buffers_equal:
        row.failures.append("buffers (or weights after optimizer steps) differ from the "
                            "unplanned model's")


def check_case(case: Case, fractions: tuple[float, ...] = (0.3, 0.5, 0.8), *,
               time_limit_s: float = 20.0, timing: str = "estimate",
               autocast: torch.dtype | None = None,
               enforce_time_limit: bool = True, offload: bool = False,
               device: str | None = None) -> list[Row]:
    """Plan, apply and measure ``case`` at static + each fraction of its activations,
    profiled, planned and run under ``autocast`` (None: full precision), with ``offload``
    allowed. A solve over ``time_limit_s`` is a failure when ``enforce_time_limit``
    (benchmarks; tests on a shared machine do not judge wall time). ``device``: the device
    the times are estimated for (None: the profiler's default)."""
    precision = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[autocast]
    try:
        zm = case.build()
    except Exception as error:
        return [Row(case.name, case.family, "all", precision,
                    outcome=f"build failed: {error}",
                    failures=[f"the case could not be built: {type(error).__name__}: "
                              f"{error}"])]
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    state = model_state(zm.model)
    snapshot = ModelSnapshot.of(zm.model)
    rng = torch.get_rng_state()
    rows: list[Row] = []
    base = Row(case.name, case.family, "", precision)
    try:
        started = time.perf_counter()
        with quiet():
            profiled = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                                     timing=timing, autocast=autocast, progress=False,
                                     device=device)
        base.profile_s = time.perf_counter() - started
    except Exception as error:  # a crash is a finding, not the end of the run
        base.budget, base.outcome = "all", f"profile crashed: {type(error).__name__}: {error}"
        base.failures.append(base.outcome)
        return [base]
    if not (same_state(state, model_state(zm.model)) and torch.equal(rng, torch.get_rng_state())):
        base.failures.append("profiling changed the model's state or the RNG")
    base.failures += [f"profiling changed the model: {line}"
                      for line in snapshot.differences(zm.model)[:3]]
    base.state_kept = not base.failures  # same parameter objects, bits, buffers and RNG
    try:
        reference = _reference_step(zm, args, kwargs, state, profiled.profile.autocast_dtype)
    except Exception as error:
        base.budget, base.outcome = "all", f"the unplanned step fails: {error}"
        base.failures.append(base.outcome)
        return [base]
    unplanned = profiled.unplanned_peak_bytes
    base.unplanned_bytes = unplanned
    static = profiled.profile.static.total_bytes
    for fraction in fractions:
        row = Row(**{**asdict(base), "failures": list(base.failures)})
        row.budget = f"{100 * fraction:.0f} %"
        row.budget_bytes = int(static + fraction * (unplanned - static))
        rows.append(row)
        try:
            plan = _solve(profiled, row.budget_bytes, time_limit_s, row, enforce_time_limit,
                          offload)
        except InfeasibleBudgetError as error:
            row.named_minimum_bytes = error.min_budget_bytes
            row.note = f"minimum {format_bytes(error.min_budget_bytes)}"
            minimum = Row(**{**asdict(row), "budget": "minimum", "failures": []})
            minimum.budget_bytes = error.min_budget_bytes
            rows.append(minimum)
            row.outcome = "infeasible"
            row = minimum
            try:
                plan = _solve(profiled, error.min_budget_bytes, time_limit_s, row,
                              enforce_time_limit, offload)
            except InfeasibleBudgetError as again:
                row.failures.append(f"the named minimum is infeasible too: {again}")
                row.outcome = "minimum refused"
                continue
        except Exception as error:
            row.failures.append(f"optimize crashed: {type(error).__name__}: {error}")
            row.outcome = "crash"
            continue
        try:
            with quiet():
                _planned_step(zm, plan, args, kwargs, state, row, reference)
        except Exception as error:
            row.failures.append(f"planned step crashed: {type(error).__name__}: {error}")
            row.outcome = "crash"
            zm.model.load_state_dict(state)
            continue
        row.outcome = row.outcome or ("ok" if row.ok else "FAILED")
        if row.budget == "minimum":
            row.outcome = "ok" if row.ok else "FAILED"
    if not (same_state(state, model_state(zm.model))):
        rows[-1].failures.append("the model's state changed over the run")
    return rows


def _solve(profiled: ProfiledStep, budget: int, time_limit_s: float, row: Row,
           enforce_time_limit: bool = True, offload: bool = False) -> Plan:
    started = time.perf_counter()
    allowed = time_limit_s
    try:
        return solve(profiled, budget_bytes=budget, time_limit_s=time_limit_s,
                     offload=offload)
    except InfeasibleBudgetError:  # its search for the lowest peak may take a share more
        allowed = time_limit_s * (1 + LOWEST_PEAK_SHARE)
        raise
    finally:
        row.solve_s = time.perf_counter() - started
        if enforce_time_limit and row.solve_s > allowed:
            row.failures.append(f"solving took {row.solve_s:.1f} s, over the "
                                f"{allowed:.0f} s limit")


def markdown_table(rows: list[Row]) -> str:
    """One line per (model, budget); an "offloaded" column when some plan offloads."""
    offloading = any(r.offloads for r in rows)
    lines = ["| model | precision | budget | outcome | budget | predicted | measured | error | "
             "grads | buffers | solver | regions | "
             + ("offloaded | " if offloading else "") + "profile s | solve s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
             + ("---|" if offloading else "")]

    def same(ran: bool, equal: bool) -> str:
        return "-" if not ran else "=" if equal else "DIFF"

    for r in rows:
        ran = bool(r.measured_bytes)
        lines.append(
            f"| {r.model} | {r.precision} | {r.budget} | "
            f"{r.outcome}{'' if r.ok else ': ' + '; '.join(r.failures)} "
            f"| {format_bytes(r.budget_bytes)} | "
            f"{format_bytes(r.predicted_bytes) if r.predicted_bytes else '-'} | "
            f"{format_bytes(r.measured_bytes) if ran else '-'} | "
            f"{f'{r.error_pct:+.3f} %' if ran else '-'} | "
            f"{same(ran, r.losses_equal and r.grads_equal)} | "
            f"{same(ran, r.buffers_equal)} | {r.solver} | {r.regions} | "
            + (f"{r.offloads} calls, {format_bytes(r.offloaded_bytes)} | " if offloading
               else "")
            + f"{r.profile_s:.1f} | {r.solve_s:.1f} |")
    return "\n".join(lines)


def model_table(rows: list[Row]) -> str:
    """One line per model: each asked budget's outcome (an infeasible one names the minimum
    that was then planned and measured), the unplanned peak and the worst prediction error."""
    asked = ["fp32 30 %", "fp32 50 %", "fp32 80 %", "bf16 50 %"]
    lines = ["| model | unplanned peak (fp32) | " + " | ".join(f"{a}" for a in asked)
             + " | worst error |", "|---|---|" + "---|" * len(asked) + "---|"]
    by_model: dict[str, list[Row]] = {}
    for r in rows:
        by_model.setdefault(r.model, []).append(r)
    for model, model_rows in by_model.items():
        cells = {}
        for i, r in enumerate(model_rows):
            if r.budget == "minimum":
                continue
            follow = model_rows[i + 1] if i + 1 < len(model_rows) else None
            if r.outcome == "infeasible" and follow is not None and follow.budget == "minimum":
                cell = (f"min {format_bytes(follow.budget_bytes)}: "
                        f"{'holds' if follow.ok else 'FAILED'}")
            else:
                cell = "holds" if r.ok else "FAILED"
            cells[f"{r.precision} {r.budget}"] = cell
        measured = [r for r in model_rows if r.measured_bytes]
        worst = max((r.error_pct for r in measured), key=abs, default=None)
        unplanned = max((r.unplanned_bytes for r in model_rows), default=0)
        lines.append(f"| {model} | {format_bytes(unplanned) if unplanned else '-'} | "
                     + " | ".join(cells.get(a, "-") for a in asked)
                     + f" | {'-' if worst is None else f'{worst:+.3f} %'} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> dict[str, Any]:
    """Counts and extremes over ``rows``."""
    measured = [r for r in rows if r.measured_bytes]
    worst = max(measured, key=lambda r: abs(r.error_pct), default=None)
    lowest = min(measured, key=lambda r: r.error_pct, default=None)
    return {
        "models": len({r.model for r in rows}),
        "rows": len(rows),
        "ok": sum(r.ok for r in rows),
        "failed": [f"{r.model} @ {r.budget}: {'; '.join(r.failures)}" for r in rows
                   if not r.ok],
        "worst_error_pct": None if worst is None else worst.error_pct,
        "worst_error_model": None if worst is None else worst.model,
        "lowest_error_pct": None if lowest is None else lowest.error_pct,
        "max_solve_s": max((r.solve_s for r in rows), default=0.0),
        # budgets planned below the unplanned peak: how many answers are proven optimal
        # over their space, or within 1 % of that optimum
        "proven": sum(r.gap is not None and r.gap == 0 for r in rows if r.solver),
        "within_1pct": sum(r.gap is not None and r.gap <= 0.01 for r in rows if r.solver),
        "planned": sum(bool(r.solver) for r in rows),
        "all_within_budget": all(r.measured_bytes <= r.budget_bytes for r in measured),
    }
