"""Errors raised while profiling; torch-free so solvers and tools can catch them."""

from __future__ import annotations


class ProfileError(RuntimeError):
    """One training step of the model could not be profiled (it fails to run, say)."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
