"""One self-contained HTML page for a plan: its table and its plots as embedded PNGs.

>>> from planner.reports.report import write_html_report  # doctest: +SKIP
>>> write_html_report(plan, "report.html")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import html
import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from planner.plan import GIB, Plan
from planner.plan_table import PlanTable
from planner.reports import viz

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

__all__ = ["figure_to_data_uri", "html_report", "write_html_report"]

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1150px; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f2f2f2; }
img { max-width: 100%; height: auto; border: 1px solid #e4e4e4; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
"""


def figure_to_data_uri(fig: Figure, dpi: int = 100) -> str:
    """The figure as a ``data:image/png;base64,...`` URI."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _breakdown(plan: Plan) -> str:
    rows = "".join(f"<tr><td>{html.escape(k.replace('_', ' '))}</td>"
                   f"<td>{v / GIB:.4g}</td></tr>" for k, v in plan.peak_breakdown.items())
    return (f"<table><tr><th>at the peak ({html.escape(plan.peak_at)})</th><th>GiB</th></tr>"
            f"{rows}</table>")


def html_report(plan: Plan | PlanTable, *,
                measured: Sequence[tuple[float, float]] | None = None,
                block: str | None = None, frontier_time_limit_s: float = 1.0,
                n_budgets: int = 8) -> str:
    """The HTML text of the report: summary, plan table, graph, timeline, frontier.

    ``block`` also draws that block's nodes (default: the first recomputed block, if the
    graph is collapsed). A plan table: its buckets, then its longest plan as a plan's.
    """
    table, buckets = None, ""
    if isinstance(plan, PlanTable):
        table, plan = plan, plan.plans[-1]
        buckets = (f"<pre>{html.escape(table.summary())}</pre><h2>Plans per bucket</h2>"
                   f"{table._repr_html_()}<img alt='buckets' "
                   f"src='{figure_to_data_uri(viz.plot_buckets(table))}'>"
                   f"<h2>The longest bucket's plan ({html.escape(table.entries[-1].label)})"
                   "</h2>")
    sections: list[tuple[str, Figure]] = [("Graph", viz.plot_graph(plan))]
    if block is None:
        block = _first_recomputed_block(plan)
    if block is not None:
        sections.append((f"Graph of {block}", viz.plot_graph(plan, block=block)))
    sections.append(("Memory timeline", viz.plot_timeline(plan, measured)))
    sections.append(("Memory / time trade-off",
                     viz.plot_frontier(plan, n_budgets=n_budgets,
                                       time_limit_s=frontier_time_limit_s)))
    parts = [f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
             f"src='{figure_to_data_uri(fig)}'>" for title, fig in sections]
    title = f"Checkpoint plan{'s' if table else ''}: {plan.model_name}"
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{buckets}"
        f"<pre>{html.escape(plan.summary())}</pre>"
        f"<h2>Plan</h2>{plan._repr_html_()}{_breakdown(plan)}"
        + "".join(parts)
        + "<p><small>All memory and time numbers come from solvers.simulate() on the plan's "
        "profile.</small></p></body></html>\n")


def _first_recomputed_block(plan: Plan) -> str | None:
    if len(plan.profile.nodes) <= 60:
        return None
    status = viz.node_status(len(plan.profile.nodes), plan.schedule)
    for group in viz.module_groups(plan.profile):
        if group.key and any(status[i] != viz.STORED for i in group.nodes):
            return group.key
    return None


def write_html_report(plan: Plan | PlanTable, path: str | Path, **kwargs: object) -> Path:
    """Write :func:`html_report` to ``path`` (one file, images embedded); returns the path."""
    path = Path(path)
    path.write_text(html_report(plan, **kwargs), encoding="utf-8")  # type: ignore[arg-type]
    log.info("report written to %s (%.0f KiB)", path, path.stat().st_size / 1024)
    return path
