"""Errors raised while capturing and profiling; torch-free so solvers and tools can catch them."""

from __future__ import annotations


class CaptureError(RuntimeError):
    """The model could not be captured as an fx graph by any method we try."""


class ProfileError(RuntimeError):
    """A captured graph could not be profiled (an op failed under fake tensors, say)."""
