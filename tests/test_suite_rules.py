"""Rules of this test suite that a new test could break without noticing.

Tests assert behaviour, never wall time: CI runs on a shared 2-core machine, where a step
that takes 60 s today takes 61 s tomorrow (benchmarks measure time). Markers declared in
``pyproject.toml`` are used: a marker nothing carries selects nothing.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CLOCKS = {"perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic", "monotonic_ns",
          "process_time"}


def _reads_clock(node: ast.AST) -> bool:
    """Whether ``node`` calls a clock of the ``time`` module (``time.perf_counter()`` or a
    ``perf_counter()`` imported from it)."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
                    func.value.id == "time" and func.attr in CLOCKS:
                return True
            if isinstance(func, ast.Name) and func.id in CLOCKS - {"time"}:
                return True
    return False


def _wall_time_asserts(tree: ast.Module) -> list[int]:
    """Lines of asserts on a clock reading, or on a name bound to one (``elapsed``)."""
    timed: set[str] = set()
    for _ in range(2):  # began = perf_counter(); elapsed = perf_counter() - began
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and (_reads_clock(node.value) or any(
                    isinstance(n, ast.Name) and n.id in timed for n in ast.walk(node.value))):
                timed |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert) and (
        _reads_clock(node.test) or any(isinstance(n, ast.Name) and n.id in timed
                                       for n in ast.walk(node.test)))]


def test_no_test_asserts_wall_time() -> None:
    found = {path.name: lines for path in sorted(TESTS.glob("test_*.py"))
             if (lines := _wall_time_asserts(ast.parse(path.read_text())))}
    assert not found, f"tests asserting wall time (file: lines): {found}"


def test_the_rule_sees_an_elapsed_time() -> None:
    source = ("import time\nbegan = time.perf_counter()\nrun()\n"
              "elapsed = time.perf_counter() - began\nassert elapsed < 60\n")
    assert _wall_time_asserts(ast.parse(source)) == [5]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_declared_markers_are_used() -> None:
    import tomllib

    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    declared = [m.split(":")[0].strip() for m in
                config["tool"]["pytest"]["ini_options"].get("markers", [])]
    used = {m for path in TESTS.glob("*.py")
            for m in re.findall(r"pytest\.mark\.(\w+)", path.read_text())}
    assert set(declared) <= used, f"declared in pyproject.toml, used by no test: " \
        f"{sorted(set(declared) - used)}"


def test_every_library_module_has_its_tests_findable() -> None:
    """A newcomer finds a module's tests by its name: ``test_<module>.py``
    (``test_solvers_<module>.py``), or the module's line in ``tests/README.md``."""
    root = TESTS.parent
    index = (TESTS / "README.md").read_text().replace("\\_", "_")
    missing = []
    for package in ("planner", "profiles", "solvers"):
        for module in sorted((root / package).glob("*.py")):
            if module.name == "__init__.py":
                continue
            stem = f"solvers_{module.stem}" if package == "solvers" else module.stem
            if not (TESTS / f"test_{stem}.py").exists() and \
                    f"| {package}/{module.name} |" not in index:
                missing.append(f"{package}/{module.name}")
    assert not missing, f"modules whose tests a newcomer cannot find: {missing}"
