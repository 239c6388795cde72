"""Docstring examples in `solvers` run."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["solvers.problem", "solvers.schedule", "solvers.simulate", "solvers.bruteforce",
           "solvers.frame", "solvers.front", "solvers.keep"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0, f"{name} has no examples in its docstrings"
    assert result.failed == 0
