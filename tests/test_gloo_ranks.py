"""The ranks the gloo tests and benchmarks fork (`benchmarks/gloo_ranks.py`): from a server
whose preloaded heap is frozen, so that collecting a rank's garbage before a measured step
leaves the imports out, and whose preload makes no tensor a measure could miss."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from gloo_ranks import PRELOAD, spawn_ranks


def _report_heap(rank: int, out: str) -> None:
    Path(out).write_text(json.dumps({"frozen": gc.get_freeze_count(),
                                     "young": len(gc.get_objects())}))


def test_a_rank_starts_with_the_servers_heap_frozen_and_the_caller_keeps_its_own(
        tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    frozen_here = gc.get_freeze_count()  # the suite's own (conftest), not the ranks' server's
    spawn_ranks(_report_heap, (str(out),), 1)
    heap = json.loads(out.read_text())
    # torch and the planner, frozen; what the rank made since, a small part of it
    assert heap["frozen"] > 100_000 and heap["young"] < heap["frozen"] / 2
    assert gc.get_freeze_count() == frozen_here


def test_the_preload_makes_no_tensor() -> None:
    """A frozen tensor is one `PeakTracker` would never list: the preload makes none."""
    modules = [m for m in PRELOAD if not m.endswith("forkserver_heap")]
    code = (f"import gc, torch\nfor m in {modules!r}: __import__(m)\n"
            "gc.collect()\n"
            "print(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, cwd=Path(__file__).resolve().parents[1])
    assert found.stdout.split() == ["0"]


def _wait_forever(rank: int) -> None:
    threading.Event().wait()


def test_ranks_that_never_end_fail_their_caller_and_are_killed() -> None:
    """A hung rank (py-spy's tracer once held an ended one for 19 minutes) is an error
    naming the ranks and the function, not a suite held to CI's limit."""
    with pytest.raises(TimeoutError, match=r"gloo ranks \[0, 1\] of _wait_forever still ran"):
        spawn_ranks(_wait_forever, (), 2, timeout_s=1.0)
