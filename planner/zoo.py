"""Reference models for tests, demos and benchmarks.

Each entry builds a fresh random-init model with example inputs and a loss function, so a
planner run needs nothing from the network. ``get(name, **overrides)`` returns a
:class:`ZooModel`; ``names()`` lists what is available (HF entries only when transformers is
installed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ZooModel:
    """A model, inputs to call it with, and a loss over its output."""

    name: str
    model: nn.Module
    example_inputs: Any
    loss_fn: Callable[[Any], torch.Tensor] | None
    block_prefix: str | None = None  # module path of the repeated blocks, e.g. "blocks"
    config: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 6, in_features: int = 64, classes: int = 10):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# --------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small residual CNN with BatchNorm (CIFAR-style ResNet)."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), blocks_per_stage: int = 2,
                 classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks: list[nn.Module] = []
        channels = widths[0]
        for stage, width in enumerate(widths):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


# --------------------------------------------------------------------------- GPT


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.d_model, self.n_head, self.head_dim = d_model, n_head, d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # sizes come from the module, not the tensor, so torch.fx traces this without export
        batch, seq = x.size(0), x.size(1)
        q, k, v = self.qkv(x).split(self.d_model, dim=2)
        q = q.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        mask = x.new_ones((seq, seq), dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        attn = self.attn_drop(torch.softmax(scores, dim=-1))
        y = (attn @ v).transpose(1, 2).reshape(batch, seq, self.d_model)
        return self.resid_drop(self.proj(y))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        h = F.gelu(self.fc(self.ln_2(x)), approximate="tanh")
        return x + self.drop(self.proj(h))


class GPT(nn.Module):
    """A GPT-2-style decoder in plain torch (explicit attention, so it traces with torch.fx)."""

    def __init__(self, vocab_size: int = 50257, seq_len: int = 1024, d_model: int = 1024,
                 n_layer: int = 24, n_head: int = 16, dropout: float = 0.1):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied, as in GPT-2
        for module in self.modules():  # GPT-2's init keeps the initial loss near log(vocab)
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------------- builders

GPT_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=512, seq_len=64, d_model=64, n_layer=2, n_head=4),
    "small": dict(vocab_size=2048, seq_len=128, d_model=128, n_layer=4, n_head=4),
    "gpt2": dict(vocab_size=50257, seq_len=1024, d_model=768, n_layer=12, n_head=12),
    "gpt2-medium": dict(vocab_size=50257, seq_len=1024, d_model=1024, n_layer=24, n_head=16),
}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mlp(batch: int = 32, width: int = 256, depth: int = 6, seed: int = 0,
        device: str | torch.device = "cpu") -> ZooModel:
    torch.manual_seed(seed)
    with torch.device(device):
        model = MLP(width=width, depth=depth)
    gen = _generator(seed)
    x = torch.randn(batch, 64, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    return ZooModel("mlp", model, (x,), lambda out: F.cross_entropy(out, y), "layers",
                    dict(batch=batch, width=width, depth=depth))


def resnet(batch: int = 8, image: int = 32, blocks_per_stage: int = 2, seed: int = 0,
           device: str | torch.device = "cpu") -> ZooModel:
    torch.manual_seed(seed)
    with torch.device(device):
        model = ResNet(blocks_per_stage=blocks_per_stage)
    gen = _generator(seed)
    x = torch.randn(batch, 3, image, image, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    return ZooModel("resnet", model, (x,), lambda out: F.cross_entropy(out, y), "blocks",
                    dict(batch=batch, image=image, blocks_per_stage=blocks_per_stage))


def gpt(size: str = "small", batch: int = 2, seq_len: int | None = None, dropout: float = 0.1,
        seed: int = 0, device: str | torch.device = "cpu", **overrides: int) -> ZooModel:
    cfg = {**GPT_SIZES[size], **overrides}
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(dropout=dropout, **cfg)
    seq = seq_len or cfg["seq_len"]
    gen = _generator(seed)
    idx = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=gen).to(device)
    inputs, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    return ZooModel(f"gpt-{size}", model, (inputs,),
                    lambda logits: next_token_loss(logits, targets), "blocks",
                    {**cfg, "size": size, "batch": batch, "seq_len": seq, "dropout": dropout})


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("HF zoo models need transformers: pip install 'checkpoint-planner[dev]'"
                          ) from error
    transformers.logging.set_verbosity_error()
    return transformers


def hf_gpt2(n_layer: int = 2, n_embd: int = 128, n_head: int = 4, vocab_size: int = 1024,
            batch: int = 2, seq_len: int = 64, seed: int = 0,
            device: str | torch.device = "cpu") -> ZooModel:
    transformers = _require_transformers()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                     vocab_size=vocab_size, n_positions=max(seq_len, 64),
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device(device):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=_generator(seed)).to(device)
    return ZooModel("hf-gpt2", model, {"input_ids": ids, "labels": ids}, None,
                    "transformer.h", dict(n_layer=n_layer, n_embd=n_embd, batch=batch,
                                          seq_len=seq_len))


LLAMA_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, vocab_size=1024),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    # Llama 3: grouped-query attention, a 128k vocabulary
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                 num_attention_heads=128, num_key_value_heads=8, vocab_size=128256),
}


def hf_llama(size: str = "tiny", batch: int = 2, seq_len: int = 64, seed: int = 0,
             device: str | torch.device = "cpu", **overrides: int) -> ZooModel:
    """HF Llama, random init; ``device="meta"`` builds even 7B shapes without memory."""
    transformers = _require_transformers()
    cfg = {**LLAMA_SIZES[size], **overrides}
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**cfg, max_position_embeddings=max(seq_len, 128),
                                      use_cache=False, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq_len), generator=_generator(seed))
    ids = ids.to(device)
    return ZooModel(f"hf-llama-{size}", model, {"input_ids": ids, "labels": ids}, None,
                    "model.layers", {**cfg, "size": size, "batch": batch, "seq_len": seq_len})


BUILDERS: dict[str, Callable[..., ZooModel]] = {
    "mlp": mlp,
    "resnet": resnet,
    "gpt": gpt,
    "hf-gpt2": hf_gpt2,
    "hf-llama": hf_llama,
}


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def names() -> list[str]:
    """Zoo entries usable in this environment."""
    return [n for n in BUILDERS if not n.startswith("hf-") or has_transformers()]


def get(name: str, **overrides: Any) -> ZooModel:
    """Build zoo model ``name`` (see :data:`BUILDERS`), forwarding keyword overrides."""
    if name not in BUILDERS:
        raise KeyError(f"unknown zoo model {name!r}; choose one of {sorted(BUILDERS)}")
    if name.startswith("hf-") and not has_transformers():
        raise ImportError(f"zoo model {name!r} needs transformers: pip install transformers")
    return BUILDERS[name](**overrides)
