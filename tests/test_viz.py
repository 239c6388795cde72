"""Plots of a plan render to legible PNGs; the HTML report opens in headless Chromium."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest

from planner import Plan, zoo
from planner.__main__ import main as cli_main
from planner.api import optimize, replan
from planner.plan import format_bytes
from planner.reports import viz
from solvers import Schedule, simulate
from solvers.from_profile import problem_from_profile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def plan() -> Plan:
    """gpt tiny (146 ops), planned at static + half the activations: checkpointing bites."""
    model = zoo.get("gpt", size="tiny")
    first = optimize(model.model, model.example_inputs, budget_gb=1e6, loss_fn=model.loss_fn,
                     timing="estimate", progress=False)
    static = first.profile.static.total_bytes
    budget = int(static + 0.5 * (first.unplanned_peak_bytes - static))
    planned = replan(first, budget_bytes=budget, time_limit_s=5.0, op_ranges=False)
    assert planned.checkpointing and planned.predicted_peak_bytes <= planned.budget_bytes
    return planned


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert path.stat().st_size > 10_000, f"{path} is suspiciously small"
    return width, height


def _texts(fig) -> str:
    parts = []
    for ax in fig.axes:
        parts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        parts += [t.get_text() for t in ax.texts]
        if ax.get_legend():
            parts += [t.get_text() for t in ax.get_legend().get_texts()]
    for legend in fig.legends:
        parts += [t.get_text() for t in legend.get_texts()]
    return "\n".join(parts)


def _render(fig, path: Path) -> tuple[int, int]:
    fig.savefig(path)
    width, height = _png_size(path)
    assert 600 <= width <= 3000 and 300 <= height <= 3000, (width, height)
    return width, height


def test_timeline(plan: Plan, tmp_path: Path) -> None:
    measured = [(0.0, plan.profile.static.total_bytes), (1.0, plan.predicted_peak_bytes)]
    fig = viz.plot_timeline(plan, measured=measured)
    _render(fig, tmp_path / "timeline.png")
    text = _texts(fig)
    for word in ("Memory timeline", "allocated memory (MiB)", "(ms)", "budget", "peak",
                 "forward", "backward", "recompute", "measured", "no checkpointing"):
        assert word in text, word  # a 2 MiB model is drawn in MiB, not 0.002 GiB
    # the marked peak is simulate()'s peak
    timeline = simulate(problem_from_profile(plan.profile), plan.schedule)
    assert format_bytes(timeline.peak_bytes) in text
    fig = viz.plot_timeline(plan, x="event")
    _render(fig, tmp_path / "timeline-events.png")
    assert "event index" in _texts(fig)


def test_a_data_parallel_plan_is_drawn_per_rank() -> None:
    """DDP's gradient buckets are part of a rank's memory: the timeline, the baselines and
    the frontier of a DDP plan replay the plan's own per-rank problem, as its numbers do."""
    model = zoo.get("gpt", size="tiny", dropout=0.0)
    first = optimize(model.model, model.example_inputs, budget_gb=1e3, loss_fn=model.loss_fn,
                     timing="estimate", world_size=2, sharding="ddp", progress=False)
    static = first.problem().static_bytes
    plan = replan(first, budget_bytes=static + (first.unplanned_peak_bytes - static) * 3 // 4,
                  time_limit_s=5.0, op_ranges=False)
    assert plan.checkpointing and plan.sharding is not None
    text = _texts(viz.plot_timeline(plan))
    assert f"peak {format_bytes(plan.predicted_peak_bytes)}" in text, text
    assert f"(peak {format_bytes(plan.unplanned_peak_bytes)})" in text, text  # no checkpoints
    none, = viz.baseline_points(plan, ["none"])
    assert none.peak_bytes == plan.unplanned_peak_bytes
    point, = viz.frontier_points(plan, [plan.budget_bytes], time_limit_s=5.0)
    assert point.peak_bytes == plan.predicted_peak_bytes


def test_graph_collapsed_and_expanded(plan: Plan, tmp_path: Path) -> None:
    fig = viz.plot_graph(plan)
    _render(fig, tmp_path / "graph.png")
    text = _texts(fig)
    assert "collapsed" in text and "blocks.0" in text and "blocks.1" in text
    assert "recomputed" in text and "stored" in text
    status = viz.node_status(len(plan.profile.nodes), plan.schedule)
    recomputed = next(g.key for g in viz.module_groups(plan.profile)
                      if g.key and any(status[i] != viz.STORED for i in g.nodes))
    fig = viz.plot_graph(plan, block=recomputed)
    _render(fig, tmp_path / "block.png")
    text = _texts(fig)
    assert recomputed in text and "recomputed in backward" in text
    assert "ln_1: 1 op" in text and "attn" in text  # submodule calls are drawn one by one
    # legends sit outside the axes (never over the data)
    for legend in fig.legends:
        assert legend.get_window_extent().y1 <= fig.axes[0].get_window_extent().y0 + 1
    with pytest.raises(ValueError, match="choose one of"):
        viz.plot_graph(plan, block="blocks.99")


def test_node_status_marks_sac(plan: Plan) -> None:
    status = viz.node_status(len(plan.profile.nodes), plan.schedule)
    kept = {i for r in plan.schedule.regions for i in r.keep}
    assert {i for i, s in enumerate(status) if s == viz.SAVED} == kept
    assert viz.node_status(3, Schedule.store_all(3)) == [viz.STORED] * 3


def test_frontier(plan: Plan, tmp_path: Path) -> None:
    fig = viz.plot_frontier(plan, n_budgets=3, time_limit_s=1.0)
    _render(fig, tmp_path / "frontier.png")
    text = _texts(fig)
    for word in ("trade-off", "peak memory", "MiB", "overhead (%)", "Pareto frontier",
                 "this plan", "every_block", "every_2", "every_4", "chen_sqrt",
                 "save_matmuls", "none"):
        assert word in text, word


def test_frontier_points_are_simulated_and_pareto(plan: Plan) -> None:
    problem = problem_from_profile(plan.profile)
    unplanned = simulate(problem, Schedule.store_all(problem.n_nodes))
    budgets = [plan.budget_bytes, unplanned.peak_bytes, 1]  # 1 byte: infeasible, skipped
    points = viz.frontier_points(plan, budgets, time_limit_s=0.5)
    assert [p.budget_bytes for p in points] == [plan.budget_bytes, unplanned.peak_bytes]
    assert all(p.peak_bytes <= p.budget_bytes for p in points)
    assert points[-1].overhead_pct == 0.0
    front = viz.pareto(points + viz.baseline_points(plan))
    peaks = [p.peak_bytes for p in front]
    overheads = [p.overhead_pct for p in front]
    assert peaks == sorted(peaks) and overheads == sorted(overheads, reverse=True)


def test_show_html_opens_in_chromium(plan: Plan, tmp_path: Path) -> None:
    plan_path, report = tmp_path / "plan.json", tmp_path / "report.html"
    plan.save(plan_path)
    assert cli_main(["-q", "show", str(plan_path), "--html", str(report)]) == 0
    text = report.read_text()
    assert text.count("data:image/png;base64,") == 4  # graph, one block, timeline, frontier
    assert "<table>" in text and "src='http" not in text and "src=\"http" not in text
    if not CHROMIUM.exists():
        pytest.skip("chromium not installed: apt-get install chromium "
                    "(needed to check the HTML report opens in a browser)")
    shot = tmp_path / "shot.png"
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}",
           "--window-size=1200,2400", f"--screenshot={shot}", report.resolve().as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _png_size(shot) == (1200, 2400)



def test_a_plan_table_is_drawn_and_reported(tmp_path: Path) -> None:
    """A table's buckets: one bar per plan in each panel, the budget line, and the HTML
    report leads with the table before its longest plan's plots."""
    pytest.importorskip("transformers")
    import torch

    from planner import Envelope
    from planner.reports.report import html_report

    model = zoo.get("hf-llama", batch=2, seq_len=32).model
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    table = optimize(model, batch, budget_gb=1.0, timing="estimate", progress=False,
                     envelope=Envelope(max_length=32, min_length=8, buckets="pow2"))
    fig = viz.plot_buckets(table)
    peaks, times = fig.axes
    assert len(peaks.patches) == len(times.patches) == len(table.entries) == 6
    assert {"unpadded", "padded", "budget"} <= set(_texts(fig).split("\n"))
    width, height = _render(fig, tmp_path / "buckets.png")
    assert width > 800 and height > 300
    page = html_report(table, frontier_time_limit_s=0.2, n_budgets=3)
    assert page.index("Plans per bucket") < page.index("The longest bucket's plan")
    assert page.count("<img") >= 4
