"""Activation-checkpointing planner: profile a model's graph, solve, rewrite.

Today this package holds the reference model zoo (:mod:`planner.zoo`) and the demo CLI;
``optimize``/``apply``/``verify`` land with the solver layer.
"""

from __future__ import annotations

from profiles.errors import CaptureError

__all__ = ["CaptureError"]
