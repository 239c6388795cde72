"""Profiles recorded on real hardware, shipped with the package.

``benchmarks/record_profiles.py`` writes them (measured timings on the machine it runs on);
CPU-only tests and benchmarks load them so planning uses real timings without a GPU.
"""

from __future__ import annotations

from pathlib import Path

from profiles.schema import GraphProfile

RECORDED_DIR = Path(__file__).parent / "recorded"


def recorded_names() -> list[str]:
    """Names of the recorded profiles, e.g. ``gpt-small.cpu``."""
    return sorted(p.name.removesuffix(".json") for p in RECORDED_DIR.glob("*.json"))


def load_recorded(name: str) -> GraphProfile:
    """Load a recorded profile by name (see :func:`recorded_names`)."""
    path = RECORDED_DIR / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no recorded profile {name!r}; available: {recorded_names()}")
    return GraphProfile.load(path)
