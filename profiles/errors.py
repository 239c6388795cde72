"""Errors raised while profiling; torch-free so solvers and tools can catch them."""

from __future__ import annotations


class ProfileError(RuntimeError):
    """A captured graph could not be profiled (an op failed under fake tensors, say)."""
