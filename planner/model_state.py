"""The model as planning finds it: its device, the ambient autocast, its structure
fingerprint, and the state a training step is planned in (``train()`` mode, no key/value
cache, no Hugging Face checkpointing of its own)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from profiles.schema import fingerprint


def _model_device(model: nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


def _ambient_autocast(device_type: str) -> torch.dtype | None:
    if device_type in ("meta",) or not torch.amp.is_autocast_available(device_type):
        return None
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def structure_fingerprint(model: nn.Module) -> str:
    """Hash of the module tree (paths and classes) and every parameter's and buffer's
    name, shape and dtype: what a plan needs of the model it is applied to."""
    structure: list[object] = [(name, type(m).__name__) for name, m in model.named_modules()]
    structure += [(name, list(t.shape), str(t.dtype)) for name, t in
                  [*model.named_parameters(remove_duplicate=False),
                   *model.named_buffers(remove_duplicate=False)]]
    return fingerprint(structure)


def _cached_configs(model: nn.Module) -> list[Any]:
    """Configs in the module tree that turn on a key/value cache (HF ``use_cache``): the
    model's and the copies its submodules keep (T5's decoder has its own)."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False) is True:
            found.setdefault(id(config), config)
    return list(found.values())


@contextlib.contextmanager
def _training_config(model: nn.Module) -> Iterator[bool]:
    """Hugging Face models cache keys and values (``use_cache``) unless told not to; a
    training step does not need them, and a checkpoint's rerun would find the cache filled
    by the forward (a cross-attention then skips its projections, a self-attention extends
    the cache twice), so HF itself turns the cache off under gradient checkpointing.
    Planning does the same while it profiles, on every config of the module tree; yields
    whether it had to."""
    configs = _cached_configs(model)
    for config in configs:
        config.use_cache = False
    try:
        yield bool(configs)
    finally:
        for config in configs:
            config.use_cache = True


@contextlib.contextmanager
def _training_mode(model: nn.Module) -> Iterator[bool]:
    """The model in ``train()`` mode while profiling when it is in ``eval()`` (planning
    the eval step would leave out dropout's masks); each module's own mode is put back.
    A model in training mode is left as it is (a frozen submodule may be in eval on
    purpose). Yields whether it was in eval mode."""
    if model.training:
        yield False
        return
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield True
    finally:
        for module, training in modes:
            module.training = training


def _refuse_existing_checkpointing(model: nn.Module) -> None:
    """HF's own checkpointing on the model or a wrapped one (PEFT), or torch's
    ``checkpoint_wrapper`` (torchtitan's ``FullAC``/``SelectiveAC``, FSDP's and Lightning's
    policies), would nest with a plan."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            ActivationWrapper,
        )
    except ImportError:  # torch built without distributed
        ActivationWrapper = ()
    for path, module in model.named_modules():
        cls = type(module)
        if isinstance(module, ActivationWrapper):
            raise ValueError(
                f"{path or 'the model'} is already wrapped by torch's {cls.__name__} "
                "(checkpoint_wrapper: torchtitan's FullAC or SelectiveAC, an FSDP or Lightning "
                "activation_checkpointing_policy); a plan replaces it. Build the model without "
                "that checkpointing (activation_checkpoint=None in torchtitan), then plan.")
        flag = ("is_activation_checkpointing" if hasattr(cls, "is_activation_checkpointing")
                else "is_gradient_checkpointing" if hasattr(cls, "is_gradient_checkpointing")
                else None)  # transformers 5 renamed it
        if flag is not None and getattr(module, flag, False):
            off = flag.replace("is_", "", 1) + "_disable"
            raise ValueError(
                f"{cls.__name__} already has Hugging Face gradient checkpointing on; a plan "
                f"replaces it. Call model.{off}() first.")
