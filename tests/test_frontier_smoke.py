"""Smoke test of benchmarks/frontier.py --quick: it runs, measures, and our plans fit."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

FRONTIER = Path(__file__).resolve().parents[1] / "benchmarks" / "frontier.py"


def _load_frontier():
    spec = importlib.util.spec_from_file_location("frontier_bench", FRONTIER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_frontier_quick(tmp_path: Path) -> None:
    frontier = _load_frontier()
    frontier.main(["--quick", "--out", str(tmp_path)])

    result = json.loads((tmp_path / "frontier-cpu-quick.json").read_text())
    assert result["torch"] and result["device_name"] and result["date"]
    assert (tmp_path / "frontier-cpu-quick.md").read_text().startswith("# Frontier")
    assert (tmp_path / "frontier-cpu-quick.png").stat().st_size > 0

    measured = [r for r in result["rows"] if r.get("status") == "ok"]
    peers = [r for r in measured if r["kind"] == "peer"]
    ours = [r for r in measured if r["kind"] == "ours"]
    assert {r["strategy"] for r in peers} >= {"none", "every-layer", "sac-matmuls"}
    assert ours, "no plan of ours was measured"
    for r in measured:
        assert r["peak_bytes"] > 0 and r["step_ms"] > 0
        assert r["grads_equal"], f"{r['strategy']}: gradients differ from no checkpointing"
    for r in ours:
        assert r["peak_bytes"] <= r["budget_bytes"], (
            f"{r['strategy']}: measured {r['peak_bytes']} B over budget {r['budget_bytes']} B")
    # our simulator replays the hand-written peers on our profile; where our plan is a
    # peer's own schedule (no checkpointing at the unplanned peak) the pair is a tie
    every_layer = next(r for r in peers if r["strategy"] == "every-layer")
    assert every_layer["schedule"].count("R[") == 2 and every_layer["predicted_overhead"] > 0
    at_none = [r for r in ours if "none" in r["strategy"].removeprefix("ours @ ").split("/")]
    assert at_none and all("none" in r["same_plan_as"] for r in at_none)
    assert {p["peer"] for p in result["pairings"]} >= {"every-layer", "sac-matmuls"}
    assert "Ours against each peer" in (tmp_path / "frontier-cpu-quick.md").read_text()
    # strategies that cannot run here are recorded with a reason, not dropped
    assert all(r["status"].startswith(("ok", "not run", "failed", "infeasible"))
               for r in result["rows"])
    # torch's auto-SAC has rows (measured, or why not: e.g. pulp not installed)
    assert any(r["strategy"].startswith(frontier.AUTO_SAC) for r in result["rows"])
