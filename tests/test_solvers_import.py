"""`solvers` must import and work with torch unavailable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import solvers
from solvers import baselines, bruteforce, Problem, Schedule, simulate
p = Problem.chain([4, 4, 1], [1.0, 1.0, 1.0])
assert simulate(p, Schedule.store_all(3)).peak_bytes > 0
assert bruteforce.solve(p, 10**9, 5.0).feasible
loaded = [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
assert sys.modules["torch"] is None and loaded == ["torch"], loaded
print("ok")
"""


def test_solvers_import_without_torch() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
