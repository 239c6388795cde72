"""Capture a model as an fx graph and profile one training step of it.

``profiles.schema`` (GraphProfile and friends) is importable without torch, so solvers can
read profiles; ``capture``/``profile`` import torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from profiles.errors import CaptureError, ProfileError
from profiles.schema import (
    SCHEMA_VERSION,
    CheckpointCosts,
    GraphProfile,
    NodeProfile,
    StaticMemory,
    StepTiming,
    StorageInfo,
)

if TYPE_CHECKING:
    from profiles.devices import DEVICES, DeviceSpec
    from profiles.profiler import default_loss, profile
    from profiles.recorded import load_recorded, recorded_names
    from profiles.tracing import capture

_LAZY = {
    "capture": "profiles.tracing",
    "profile": "profiles.profiler",
    "default_loss": "profiles.profiler",
    "DeviceSpec": "profiles.devices",
    "DEVICES": "profiles.devices",
    "load_recorded": "profiles.recorded",
    "recorded_names": "profiles.recorded",
}

__all__ = [
    "DEVICES",
    "SCHEMA_VERSION",
    "CaptureError",
    "CheckpointCosts",
    "DeviceSpec",
    "GraphProfile",
    "NodeProfile",
    "ProfileError",
    "StaticMemory",
    "StepTiming",
    "StorageInfo",
    "capture",
    "default_loss",
    "load_recorded",
    "profile",
    "recorded_names",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'profiles' has no attribute {name!r}")
