"""Smoke test of benchmarks/gpu_suite.py --tiny: the GPU suite's code path, run on the CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from profiles.schema import GraphProfile

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


def _load_suite() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_suite_bench", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tiny_suite_writes_measures_and_plans(tmp_path: Path) -> None:
    """One run of ``gpu_suite.py --tiny`` (23 s here), checked part by part below: one test,
    so that the two processes of the README's test command do not each run it."""
    run = _suite_run(tmp_path)
    _files_written(run)
    for precision in ("fp32", "bf16"):
        _rows_measured_and_planned(run, precision)
        _compile_peer(run, precision)
    _rows_carry_their_host_and_device_split(run)
    _bf16_ran_under_autocast(run)
    _offload_part_measures_our_offload_plans(run)


def _suite_run(out: Path) -> tuple[Path, dict[str, Any]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only wait on each other
    try:
        done = _load_suite().main(["--tiny", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    return out, done


def _rows(out: Path, precision: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    result = json.loads((out / f"frontier-cpu-tiny-{precision}.json").read_text())
    return result, result["rows"]


def _files_written(suite_run: tuple[Path, dict[str, Any]]) -> None:
    out, done = suite_run
    for precision in ("fp32", "bf16"):
        assert (out / f"frontier-cpu-tiny-{precision}.md").read_text().startswith("# Frontier")
        assert (out / f"frontier-cpu-tiny-{precision}.png").stat().st_size > 0
        result, _ = _rows(out, precision)
        assert result["precision"] == precision and result["suite"]["compile_budgets"]
    # the record part wrote loadable per-op profiles into --out, not profiles/recorded/
    assert sorted(p.name for p in done["record"]) == ["gpt-tiny-bf16.cpu.json",
                                                     "gpt-tiny.cpu.json"]
    for path in done["record"]:
        assert path.parent == out and GraphProfile.load(path).nodes


def _rows_measured_and_planned(suite_run: tuple[Path, dict[str, Any]],
                                   precision: str) -> None:
    _, rows = _rows(suite_run[0], precision)
    assert all(r["status"].startswith(("ok", "not run", "failed", "infeasible")) for r in rows)
    measured = [r for r in rows if r["status"] == "ok"]
    for r in measured:
        assert r["peak_bytes"] > 0 and r["step_ms"] > 0, r["strategy"]
    eager = [r for r in measured if r["kind"] == "peer" and "grads_close" not in r]
    ours = [r for r in measured if r["kind"] == "ours"]
    assert {r["strategy"] for r in eager} == {"none", "every-layer", "sac-linear"}
    assert ours, "no plan of ours was measured"
    # gradients bit-identical to the no-checkpointing step of the same precision
    for r in eager + ours:
        assert r["grads_equal"], f"{precision} {r['strategy']}: gradients differ"
    for r in ours:
        assert r["peak_bytes"] <= r["budget_bytes"], r["strategy"]


def _rows_carry_their_host_and_device_split(suite_run: tuple[Path, dict[str, Any]]
                                               ) -> None:
    """Each timed row: the host's ms until backward returned (on a CPU the host runs all of
    it, so a step's host time is its time), and for ours the clock's host part of the
    predicted overhead, below the whole of it; the Markdown has the split's table."""
    out, _ = suite_run
    _, rows = _rows(out, "fp32")
    timed = [r for r in rows if r["status"] == "ok" and "compile_s" not in r]
    assert timed and all(0 < r["host_ms"] and 0 < r["base_host_ms"] for r in timed)
    ours = [r for r in timed if r["kind"] == "ours"]
    assert all(0 <= r["predicted_host_overhead"] <= r["predicted_overhead"] for r in ours)
    assert any(r["predicted_host_overhead"] > 0 for r in ours)  # regions cost the host
    assert "| model | strategy | step ms | host ms | host share |" in (
        out / "frontier-cpu-tiny-fp32.md").read_text()


def _compile_peer(suite_run: tuple[Path, dict[str, Any]], precision: str) -> None:
    _, rows = _rows(suite_run[0], precision)
    compiled = [r for r in rows if r["strategy"].startswith("torch.compile")]
    assert len(compiled) == 1, "one compile budget in --tiny"
    row = compiled[0]
    assert row["status"].startswith(("ok", "failed", "not run")), row["status"]
    if row["status"] != "ok":
        return  # a failing compile is a recorded result
    assert row["activation_memory_budget"] == 0.5
    assert row["backend"] == "aot_eager_decomp_partition"
    assert row["grad_rel_error"] <= row["grad_tolerance"] and row["grads_close"]
    # the compiled code ran while measured: its partition keeps less than eager does
    none = next(r for r in rows if r["strategy"] == "none")
    assert row["peak_bytes"] < none["peak_bytes"]
    # and our planner planned at its peak like at any other peer's
    assert any(r["kind"] == "ours" and "compile@0.5" in r["strategy"] for r in rows)


def _bf16_ran_under_autocast(suite_run: tuple[Path, dict[str, Any]]) -> None:
    fp32, fp32_rows = _rows(suite_run[0], "fp32")
    bf16, bf16_rows = _rows(suite_run[0], "bf16")
    assert fp32["autocast"] is None and bf16["autocast"] == "bfloat16"
    assert all(r["autocast_dtype"] == "bfloat16" for r in bf16_rows
               if r["kind"] == "ours" and r["status"] == "ok")
    assert all(r["autocast_dtype"] is None for r in fp32_rows
               if r["kind"] == "ours" and r["status"] == "ok")
    # bf16 activations: the no-checkpointing step holds less than in fp32
    peak = {name: next(r["peak_bytes"] for r in rows if r["strategy"] == "none")
            for name, rows in (("fp32", fp32_rows), ("bf16", bf16_rows))}
    assert peak["bf16"] < peak["fp32"]


def _offload_part_measures_our_offload_plans(suite_run: tuple[Path, dict[str, Any]]
                                                 ) -> None:
    out, done = suite_run
    rows = done["offload"]["rows"]
    assert (out / "offload-cpu-tiny.md").read_text().startswith("# Offload, measured")
    measured = [r for r in rows if r.get("status", "ok") == "ok"]
    assert all(r["grads_equal"] for r in measured)
    ours = [r for r in measured if r["label"].startswith("ours") and r["offloaded_bytes"]]
    assert ours, "an offload plan was measured"
    # on the CPU the hooks copy synchronously, as the plan (timed for the CPU) predicts
    assert all(r["peak_bytes"] == r["predicted_peak_bytes"] <= r["budget_bytes"] for r in ours)
    assert any(r["label"].startswith("save_on_cpu") for r in measured)


def test_peak_gaps_part_runs_on_the_cpu_where_the_simulator_is_exact(tmp_path: Path) -> None:
    """benchmarks/gpu_peak_gaps.py (the lease's first part) on the CPU at a small size: its
    files are written, and the unplanned step, first and second, peaks where the simulator
    says (the CPU's `PeakTracker` counts the loss target the step reads, as it does)."""
    spec = importlib.util.spec_from_file_location(
        "gpu_peak_gaps_bench", SUITE.parent / "gpu_peak_gaps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--device", "cpu", "--size", "small", "--batch", "2",
                          "--out", str(tmp_path)])
    assert result["gap_unplanned_first"] == 0 and result["gap_unplanned_second"] == 0
    assert (tmp_path / "gpu-peak-gaps-cpu.md").read_text().startswith("# Where the GPU")
    assert json.loads((tmp_path / "gpu-peak-gaps-cpu.json").read_text())["batch"] == 2


def test_plan_gap_part_runs_on_the_cpu_where_plan_and_step_agree(tmp_path: Path) -> None:
    """benchmarks/gpu_plan_gap.py on the CPU under bf16 autocast: a plan of no region adds
    nothing to the step's peak, on its first step after apply or later, and the step peaks
    where the plan predicts (`PeakTracker` counts tensors, as the simulator does)."""
    spec = importlib.util.spec_from_file_location(
        "gpu_plan_gap_bench", SUITE.parent / "gpu_plan_gap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--device", "cpu", "--size", "tiny", "--batch", "2",
                          "--autocast", "bfloat16", "--out", str(tmp_path)])
    assert result["planned_minus_predicted"] == result["plain_minus_predicted"] == 0
    assert result["first_planned_peak_bytes"] == result["planned_peak_bytes"]
    assert (tmp_path / "gpu-plan-gap-cpu-bfloat16.md").read_text().startswith("# What an")
