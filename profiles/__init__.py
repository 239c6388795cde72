"""Profile one training step of a model as it runs eagerly, op by op.

``profiles.schema`` (GraphProfile and friends) is importable without torch, so solvers can
read profiles; ``profile`` imports torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from profiles.errors import ProfileError
from profiles.schema import (
    SCHEMA_VERSION,
    CheckpointCosts,
    GraphProfile,
    ModuleCall,
    NodeProfile,
    StaticMemory,
    StepTiming,
    StorageInfo,
)

if TYPE_CHECKING:
    from profiles.devices import DEVICES, DeviceSpec
    from profiles.inputs import normalize_inputs
    from profiles.profiler import default_loss, profile
    from profiles.recorded import load_recorded, recorded_names

_LAZY = {
    "normalize_inputs": "profiles.inputs",
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
    "CheckpointCosts",
    "DeviceSpec",
    "GraphProfile",
    "ModuleCall",
    "NodeProfile",
    "ProfileError",
    "StaticMemory",
    "StepTiming",
    "StorageInfo",
    "default_loss",
    "load_recorded",
    "normalize_inputs",
    "profile",
    "recorded_names",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'profiles' has no attribute {name!r}")
