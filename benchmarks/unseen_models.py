"""The architectures of the unseen sweep (`unseen_sweep.py`), in the waves they were tried.

``FIRST``: 19 models (issue 33): Hugging Face Phi-3, Gemma-2, Qwen3-MoE, OLMo-2, Starcoder2,
GPT-J, Pegasus, Electra, MobileBERT, DINOv2, ConvNeXt-V2, CLIP, Mamba; timm CoaT-Lite,
ResNeSt, PoolFormer; torchvision MNASNet, R3D-18 (video), ResNeXt-50.

``SECOND``: 17 models (issue 60), each chosen for what it brings: Hugging Face Mixtral and
DeepSeek-V3 (routed experts), Jamba (Mamba and attention layers, no repeated block), Whisper
(audio encoder-decoder), ModernBERT, GPT-NeoX with one layer (no repeated block), Bloom (its
GeLU is an autograd Function), LED (Longformer attention), ViTMAE (random masking), Swin-V2;
timm EfficientNet-B0, EVA-02, NFNet-L0 (standardized weights), HRNet-W18-small (branches
that exchange lists); torchvision RAFT (optical flow, iterated updates) and Faster R-CNN in
training mode (losses from the model, sampled proposals); and a user's MLP with a
straight-through estimator written as an autograd Function before a TransformerEncoder.

Every model is random-init from its config (no downloads) and small enough for a step of a
few seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from conformance_harness import (
    Case,
    _hf_lm,
    _hf_model,
    _hf_seq2seq,
    _hf_whisper,
    _images,
    _labels,
    _timm,
    _tv,
)
from custom_functions import StraightThrough
from torch import nn

from planner import zoo

__all__ = ["FIRST", "SECOND", "WAVES"]

_LM = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, max_position_embeddings=64)
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _hf_images(config_name: str, model_name: str, size: int = 32, batch: int = 2,
               **config: Any) -> Callable[[], zoo.ZooModel]:
    """An image classifier with ``labels`` (its output carries the loss)."""
    def build() -> zoo.ZooModel:
        _, model = _hf_model(config_name, model_name, num_labels=10, **config)
        x, y = _images(batch, size)
        return zoo.ZooModel(f"HF {model_name}", model, {"pixel_values": x, "labels": y}, None)
    return build


def _hf_clip() -> zoo.ZooModel:
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=32, projection_dim=32)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    _, model = _hf_model("CLIPConfig", "CLIPModel", text_config=text, vision_config=vision,
                         projection_dim=32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (4, 16), generator=gen)
    pixels = torch.randn(4, 3, 32, 32, generator=gen)
    return zoo.ZooModel("HF CLIPModel", model,
                        {"input_ids": ids, "pixel_values": pixels, "return_loss": True}, None)


def _r3d() -> zoo.ZooModel:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.video.r3d_18(weights=None, num_classes=10)
    gen = torch.Generator().manual_seed(0)
    clip = torch.randn(2, 3, 4, 32, 32, generator=gen)  # batch x 3 x frames x H x W
    y = torch.randint(0, 10, (2,), generator=gen)
    return zoo.ZooModel("torchvision r3d_18", model, (clip,),
                        lambda out: F.cross_entropy(out, y))


def _hf(name: str, build: Callable[[], zoo.ZooModel], cls: str) -> Case:
    return Case(name, "transformers", build, (cls,), "transformers")


FIRST: list[Case] = [
    _hf("HF Phi3ForCausalLM", _hf_lm("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2,
                                     **_TOKENS, **_LM), "Phi3ForCausalLM"),
    _hf("HF Gemma2ForCausalLM", _hf_lm("Gemma2Config", "Gemma2ForCausalLM",
                                       num_key_value_heads=2, head_dim=16, **_TOKENS, **_LM),
        "Gemma2ForCausalLM"),
    _hf("HF Qwen3MoeForCausalLM (MoE)",
        _hf_lm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_key_value_heads=2, head_dim=16,
               moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **_LM),
        "Qwen3MoeForCausalLM"),
    _hf("HF Olmo2ForCausalLM", _hf_lm("Olmo2Config", "Olmo2ForCausalLM", num_key_value_heads=2,
                                      **_TOKENS, **_LM), "Olmo2ForCausalLM"),
    _hf("HF Starcoder2ForCausalLM", _hf_lm("Starcoder2Config", "Starcoder2ForCausalLM",
                                           num_key_value_heads=2, **_TOKENS, **_LM),
        "Starcoder2ForCausalLM"),
    _hf("HF GPTJForCausalLM", _hf_lm("GPTJConfig", "GPTJForCausalLM", vocab_size=512,
                                     n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                     n_positions=64, **_TOKENS), "GPTJForCausalLM"),
    _hf("HF PegasusForConditionalGeneration",
        _hf_seq2seq("PegasusConfig", "PegasusForConditionalGeneration", vocab_size=512,
                    d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                    max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                    decoder_start_token_id=0), "PegasusForConditionalGeneration"),
    _hf("HF ElectraForMaskedLM", _hf_lm("ElectraConfig", "ElectraForMaskedLM",
                                        embedding_size=32, **_LM), "ElectraForMaskedLM"),
    _hf("HF MobileBertForMaskedLM",
        _hf_lm("MobileBertConfig", "MobileBertForMaskedLM", vocab_size=512, hidden_size=64,
               embedding_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, intra_bottleneck_size=32, true_hidden_size=32,
               num_feedforward_networks=2, max_position_embeddings=64),
        "MobileBertForMaskedLM"),
    _hf("HF Dinov2ForImageClassification",
        _hf_images("Dinov2Config", "Dinov2ForImageClassification", image_size=32,
                   patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   mlp_ratio=2), "Dinov2ForImageClassification"),
    _hf("HF ConvNextV2ForImageClassification",
        _hf_images("ConvNextV2Config", "ConvNextV2ForImageClassification", size=64,
                   hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1]),
        "ConvNextV2ForImageClassification"),
    _hf("HF CLIPModel", _hf_clip, "CLIPModel"),
    _hf("HF MambaForCausalLM", _hf_lm("MambaConfig", "MambaForCausalLM", vocab_size=512,
                                      hidden_size=64, state_size=8, num_hidden_layers=2,
                                      **_TOKENS), "MambaForCausalLM"),
    Case("timm coat_lite_tiny", "timm", _timm("coat_lite_tiny", batch=4, img_size=64),
         needs="timm"),
    Case("timm resnest14d", "timm", _timm("resnest14d", batch=4), needs="timm"),
    Case("timm poolformer_s12", "timm", _timm("poolformer_s12", batch=4), needs="timm"),
    Case("torchvision mnasnet0_5", "torchvision", _tv("mnasnet0_5", batch=8, num_classes=10),
         needs="torchvision"),
    Case("torchvision r3d_18 (video)", "torchvision", _r3d, needs="torchvision"),
    Case("torchvision resnext50_32x4d", "torchvision",
         _tv("resnext50_32x4d", batch=2, num_classes=10), needs="torchvision"),
]


# ----------------------------------------------------------------------------- the second wave


def _hf_pretraining_images(config_name: str, model_name: str, batch: int = 2,
                           size: int = 32, **config: Any) -> Callable[[], zoo.ZooModel]:
    """A self-supervised image model whose output carries its own loss (ViTMAE)."""
    def build() -> zoo.ZooModel:
        _, model = _hf_model(config_name, model_name, **config)
        x, _ = _images(batch, size)
        return zoo.ZooModel(f"HF {model_name}", model, {"pixel_values": x}, None)
    return build


def _raft() -> zoo.ZooModel:
    """RAFT on a pair of frames, two refinement steps, L1 loss on every prediction."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.optical_flow.raft_small(weights=None)
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randn(2, 1, 3, 128, 128, generator=gen)  # its least size
    flow = torch.randn(1, 2, 128, 128, generator=gen)

    def loss(predictions: list[torch.Tensor]) -> torch.Tensor:
        return sum((p - flow).abs().mean() for p in predictions)

    return zoo.ZooModel("torchvision raft_small", model,
                        {"image1": first, "image2": second, "num_flow_updates": 2}, loss)


def _faster_rcnn() -> zoo.ZooModel:
    """Faster R-CNN in training mode: images and boxes in, its losses out, summed."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=96, max_size=96)
    gen = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 96, 96, generator=gen) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[8.0, 8.0, 48.0, 56.0], [30.0, 20.0, 90.0, 80.0]]),
                "labels": torch.tensor([1, 2])} for _ in range(2)]
    return zoo.ZooModel("torchvision fasterrcnn_mobilenet_v3_large_fpn (training)", model,
                        (images, targets), lambda losses: sum(losses.values()))


class QuantizedEncoder(nn.Module):
    """A user's model: an MLP whose hidden units are quantized by a straight-through
    estimator, then a TransformerEncoder."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = StraightThrough.apply(torch.relu(self.up(x)))
        return self.head(self.encoder(self.down(h))).mean(1)


def _quantized_encoder() -> zoo.ZooModel:
    torch.manual_seed(0)
    model = QuantizedEncoder()
    x = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(0))
    y = _labels(8)
    return zoo.ZooModel("MLP with an autograd Function + TransformerEncoder", model, (x,),
                        lambda out: F.cross_entropy(out, y))


SECOND: list[Case] = [
    _hf("HF MixtralForCausalLM (MoE)",
        _hf_lm("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2, **_TOKENS, **_LM),
        "MixtralForCausalLM"),
    _hf("HF DeepseekV3ForCausalLM (MoE, MLA)",
        _hf_lm("DeepseekV3Config", "DeepseekV3ForCausalLM", num_key_value_heads=4,
               moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
               n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
               kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
               v_head_dim=16, **_TOKENS, **_LM), "DeepseekV3ForCausalLM"),
    _hf("HF JambaForCausalLM (Mamba + attention)",
        _hf_lm("JambaConfig", "JambaForCausalLM", num_key_value_heads=2, num_experts=2,
               num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
               attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
               mamba_expand=2, use_mamba_kernels=False, **_TOKENS, **_LM),
        "JambaForCausalLM"),
    _hf("HF WhisperForConditionalGeneration", _hf_whisper,
        "WhisperForConditionalGeneration"),
    _hf("HF ModernBertForMaskedLM",
        _hf_lm("ModernBertConfig", "ModernBertForMaskedLM", pad_token_id=0, bos_token_id=1,
               eos_token_id=2, cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2,
               local_attention=16, **_LM), "ModernBertForMaskedLM"),
    _hf("HF GPTNeoXForCausalLM (one layer)",
        _hf_lm("GPTNeoXConfig", "GPTNeoXForCausalLM",
               **{**_LM, "num_hidden_layers": 1}, **_TOKENS), "GPTNeoXForCausalLM"),
    _hf("HF BloomForCausalLM (GeLU as an autograd Function)",
        _hf_lm("BloomConfig", "BloomForCausalLM", vocab_size=512, hidden_size=64, n_layer=2,
               n_head=4, **_TOKENS), "BloomForCausalLM"),
    _hf("HF LEDForConditionalGeneration",
        _hf_seq2seq("LEDConfig", "LEDForConditionalGeneration", vocab_size=512, d_model=64,
                    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                    max_encoder_position_embeddings=64, max_decoder_position_embeddings=64,
                    attention_window=8, pad_token_id=0, eos_token_id=1,
                    decoder_start_token_id=0), "LEDForConditionalGeneration"),
    _hf("HF ViTMAEForPreTraining (random masking)",
        _hf_pretraining_images("ViTMAEConfig", "ViTMAEForPreTraining", image_size=32,
                               patch_size=8, hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=128,
                               decoder_hidden_size=32, decoder_num_hidden_layers=1,
                               decoder_num_attention_heads=4, decoder_intermediate_size=64),
        "ViTMAEForPreTraining"),
    _hf("HF Swinv2ForImageClassification",
        _hf_images("Swinv2Config", "Swinv2ForImageClassification", image_size=32,
                   patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4),
        "Swinv2ForImageClassification"),
    Case("timm efficientnet_b0", "timm", _timm("efficientnet_b0", batch=8), needs="timm"),
    Case("timm eva02_tiny_patch14_224", "timm",
         _timm("eva02_tiny_patch14_224", size=56, batch=4, img_size=56), needs="timm"),
    Case("timm nfnet_l0", "timm", _timm("nfnet_l0", batch=4), needs="timm"),
    Case("timm hrnet_w18_small", "timm", _timm("hrnet_w18_small", batch=12), needs="timm"),
    Case("torchvision raft_small (optical flow)", "torchvision", _raft, needs="torchvision"),
    Case("torchvision fasterrcnn_mobilenet_v3_large_fpn (training)", "torchvision",
         _faster_rcnn, needs="torchvision"),
    Case("MLP with an autograd Function + TransformerEncoder", "custom", _quantized_encoder),
]

WAVES = {"first": FIRST, "second": SECOND}
