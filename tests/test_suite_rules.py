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
        for module in sorted((root / package).rglob("*.py")):
            if module.name == "__init__.py":
                continue
            stem = f"solvers_{module.stem}" if package == "solvers" else module.stem
            path = module.relative_to(root).as_posix()
            if not (TESTS / f"test_{stem}.py").exists() and f"| {path} |" not in index:
                missing.append(path)
    assert not missing, f"modules whose tests a newcomer cannot find: {missing}"


# calls that search with a limit in seconds (``optimize`` and friends default to 60 s)
SEARCHES = {"solve", "min_peak", "lowest_peak", "min_feasible_budget", "optimize", "replan",
            "plan_for_profile", "solve_profiled", "plan_rank"}
EXACT = {"auto", "cpsat", "milp", "dp", "bruteforce"}  # the solvers a limit may stop
DEFAULT_LIMITED = {"optimize", "replan", "plan_for_profile", "solve_profiled", "plan_rank"}
# what only a search run to its end may claim: a status, a bound, a proof, a space
VERDICTS = {"status", "gap", "bound_ms", "proven", "optimal_over", "space",
            "least_peak_bytes", "least_peak_space", "min_feasible_budget_exact",
            "lower_bound_bytes"}
# what a search's answer equals depends on where its limit stopped it: the schedule it
# returns, the least peak an infeasible budget's error names
STOPPED_AT = {"schedule", "min_budget_bytes"}


def _limit(call: ast.Call) -> ast.expr | None:
    """The seconds a search call is given (None: its default)."""
    for keyword in call.keywords:
        if keyword.arg == "time_limit_s":
            return keyword.value
    name = call.func.attr if isinstance(call.func, ast.Attribute) else \
        getattr(call.func, "id", None)
    position = {"min_peak": 1, "lowest_peak": 1}.get(name, 2)  # solve(p, budget, limit)
    if name in SEARCHES - DEFAULT_LIMITED or isinstance(call.func, ast.Subscript):
        return call.args[position] if len(call.args) > position else None
    return None


def _deterministic(node: ast.AST) -> bool:
    """Whether ``node`` passes ``deterministic=`` anything but False (`SolveOptions`' too)."""
    return any(isinstance(k, ast.keyword) and k.arg == "deterministic"
               and ast.unparse(k.value) != "False" for k in ast.walk(node))


def _counts_seconds(call: ast.Call, deterministic_names: frozenset[str] = frozenset()) -> bool:
    """Whether ``call`` is a search its time limit may stop: not ``deterministic=True``
    (nor given a name bound to options that say so: ``config=config``), not unlimited
    (``math.inf``), not a zero limit (which stops it always)."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else \
        getattr(call.func, "id", None)
    if isinstance(call.func, ast.Subscript):  # SOLVERS[name]: a baseline reads no clock
        key = call.func.slice
        if ast.unparse(call.func.value) != "SOLVERS" or (
                isinstance(key, ast.Constant) and key.value not in EXACT):
            return False
    elif name not in SEARCHES:
        return False
    if _deterministic(call) or any(isinstance(n, ast.Name) and n.id in deterministic_names
                                   for n in ast.walk(call)):
        return False
    limit = _limit(call)
    if limit is None:
        return name in DEFAULT_LIMITED or name in ("lowest_peak", "min_peak")
    text = ast.unparse(limit)
    return "inf" not in text and text not in ("0", "0.0")


def _is_verdict(node: ast.Assert) -> bool:
    for n in ast.walk(node.test):
        if isinstance(n, ast.Compare) and any(isinstance(op, ast.Eq) for op in n.ops) and any(
                isinstance(side, ast.Attribute) and side.attr in STOPPED_AT
                for side in (n.left, *n.comparators)):
            return True
        if isinstance(n, ast.Attribute) and (n.attr in VERDICTS or (
                isinstance(n.value, ast.Name) and n.value.id == "Status")):
            return True
        if isinstance(n, ast.Constant) and n.value in ("optimal", "infeasible"):
            return True
    return False


def _baseline_names(node: ast.AST) -> set[str]:
    """Names a loop over the baselines binds (``for name, solve in BASELINES.items()``):
    the baselines read no clock that decides."""
    return {n.id for loop in ast.walk(node) if isinstance(loop, ast.For)
            and "BASELINES" in ast.unparse(loop.iter)
            for n in ast.walk(loop.target) if isinstance(n, ast.Name)}


def _timed_verdicts(tree: ast.Module) -> list[str]:
    """Functions that assert a status, bound or proof and run a search that counts
    seconds: on a loaded machine the search may stop before it proves what they assert."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        baselines = _baseline_names(node)
        options = frozenset(t.id for a in ast.walk(node) if isinstance(a, ast.Assign)
                            and _deterministic(a.value)
                            for t in a.targets if isinstance(t, ast.Name))
        if any(isinstance(c, ast.Call) and _counts_seconds(c, options) and not (
                isinstance(c.func, ast.Name) and c.func.id in baselines)
               for c in ast.walk(node)) and any(isinstance(a, ast.Assert) and _is_verdict(a)
                                                for a in ast.walk(node)):
            found.append(node.name)
    return found


# tests whose point is a search that counts seconds, on a clock they drive themselves
ON_PURPOSE = {
    "test_api.py::test_a_deterministic_plan_is_the_same_on_a_loaded_machine",
    "test_api.py::test_a_search_its_time_limit_stopped_says_so_and_proves_nothing",
    "test_solvers_auto.py::test_a_deterministic_search_answers_alike_on_a_loaded_machine",
    "test_solvers_dp_pinned.py::"
    "test_a_bounded_answer_searches_on_for_its_proof_until_its_own_limit",
}
# asserting a verdict after a search that counts seconds, not yet made deterministic (issue
# 63): the list only shrinks
TIMED_VERDICTS_LEFT: set[str] = set()


def test_no_new_test_asserts_a_verdict_of_a_search_that_counts_seconds() -> None:
    found = {f"{path.name}::{name}" for path in sorted(TESTS.glob("test_*.py"))
             for name in _timed_verdicts(ast.parse(path.read_text()))} - ON_PURPOSE
    assert not found - TIMED_VERDICTS_LEFT, (
        "tests asserting a status, bound or proof after a search its time limit may stop "
        "(pass deterministic=True, or math.inf to the DP and brute force): "
        f"{sorted(found - TIMED_VERDICTS_LEFT)}")
    assert not TIMED_VERDICTS_LEFT - found, (
        "made deterministic: remove from TIMED_VERDICTS_LEFT "
        f"{sorted(TIMED_VERDICTS_LEFT - found)}")


def test_the_rule_sees_a_verdict_after_a_timed_search() -> None:
    source = ("def test_a():\n    sol = cpsat.solve(p, b, 10.0)\n"
              "    assert sol.status == Status.OPTIMAL\n"
              "def test_b():\n    sol = cpsat.solve(p, b, 10.0, deterministic=True)\n"
              "    assert sol.status == Status.OPTIMAL\n"
              "def test_c():\n    sol = SOLVERS['dp'](p, b, math.inf)\n    assert sol.gap == 0\n"
              "def test_d():\n    plan = optimize(m, x, budget_gb=1)\n"
              "    assert plan.solver.status == 'optimal'\n"
              "def test_e():\n    plan = optimize(m, x, budget_gb=1, time_limit_s=5)\n"
              "    assert plan.schedule == first.schedule\n"
              "def test_f():\n    config = PlanConfig(deterministic=True)\n"
              "    plan = optimize(m, x, budget_gb=1, config=config)\n"
              "    assert plan.schedule == first.schedule\n"
              "    assert simulate(p, plan.schedule).peak_bytes == plan.predicted_peak_bytes\n")
    assert _timed_verdicts(ast.parse(source)) == ["test_a", "test_d", "test_e"]


PACKAGES = ("profiles", "solvers", "planner")
# import cycles between modules that run (lazy imports included, type-only ones not):
# none; the list only shrinks
IMPORT_CYCLES_LEFT: set[frozenset[str]] = set()


def _type_only(tree: ast.Module) -> set[ast.AST]:
    """The imports under ``if TYPE_CHECKING:``: never run, so they close no cycle."""
    return {node for block in ast.walk(tree) if isinstance(block, ast.If)
            and ast.unparse(block.test).endswith("TYPE_CHECKING")
            for stmt in block.body for node in ast.walk(stmt)}


def _imports(path: Path, module: str) -> set[str]:
    """The library modules ``module`` imports when it runs, anywhere in it (a lazy import
    inside a function closes a cycle as surely as one at the top, only later)."""
    out = set()
    tree = ast.parse(path.read_text())
    skipped = _type_only(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] in PACKAGES:
            package = (TESTS.parent / node.module.replace(".", "/")).is_dir()
            out |= ({f"{node.module}.{a.name}" for a in node.names}
                    if package else {node.module})
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
    return out - set(PACKAGES) - {module}


def _import_cycles() -> set[frozenset[str]]:
    import networkx as nx

    graph = nx.DiGraph()
    for package in PACKAGES:
        for path in (TESTS.parent / package).rglob("*.py"):
            if path.stem != "__init__":
                module = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)
                graph.add_edges_from((module, m) for m in _imports(path, module))
    return {frozenset(cycle) for cycle in nx.simple_cycles(graph)}


def test_no_new_import_cycle() -> None:
    """Imports go one way (profiles -> solvers -> planner, and inside a package from the
    lower module up). Broken so far: `solvers.spaces` <-> `solvers.dp.search` (the DP's space got
    its own module, `solvers.dp.space`) and `planner.runtime.install` ->
    `planner.runtime.table_install` -> ... -> `planner.runtime.install` (five cycles:
    `apply` of a plan or a table is `planner.runtime.applying`, above both installers)."""
    cycles = _import_cycles()
    assert not cycles - IMPORT_CYCLES_LEFT, f"new import cycles: {cycles - IMPORT_CYCLES_LEFT}"
    assert not IMPORT_CYCLES_LEFT - cycles, (
        f"broken: remove from IMPORT_CYCLES_LEFT {IMPORT_CYCLES_LEFT - cycles}")
