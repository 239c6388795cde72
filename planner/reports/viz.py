"""Plots that let a person judge a plan: its graph, its memory timeline, its trade-off curve.

Every number plotted comes from ``solvers.simulate`` on the plan's embedded profile (the
single source of truth), never from a solver's internal model. matplotlib is imported
lazily, inside the functions; figures are plain ``matplotlib.figure.Figure`` objects (no
pyplot state), so they render with any backend, display in Jupyter, and save with
``fig.savefig("x.png")``.

>>> from planner.reports import viz  # doctest: +SKIP
>>> viz.plot_timeline(plan).savefig("timeline.png")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from planner.plan import GIB, Plan, format_bytes
from profiles.schema import GraphProfile
from solvers import SOLVERS, Decision, Schedule, Timeline, front, simulate
from solvers.baselines import BASELINES
from solvers.bounds import memory_lower_bound
from solvers.from_profile import detect_block_prefix, problem_from_profile
from solvers.problem import Problem

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from planner.plan_table import PlanTable

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BASELINES",
    "FrontierPoint",
    "ModuleGroup",
    "baseline_points",
    "frontier_points",
    "module_groups",
    "node_status",
    "pareto",
    "plot_buckets",
    "plot_frontier",
    "plot_graph",
    "plot_timeline",
]

DEFAULT_BASELINES = ("none", "every_block", "every_2", "every_4", "chen_sqrt", "save_matmuls",
                     "save_linear")

# colour-blind-safe (Okabe-Ito) colours, one meaning each across all plots
STORED = "stored"
RECOMPUTED = "recomputed"
SAVED = "saved (SAC)"
OFFLOADED = "offloaded to host"
MIXED = "mixed"
STATUS_COLORS = {STORED: "#56B4E9", RECOMPUTED: "#E69F00", SAVED: "#009E73",
                 OFFLOADED: "#0072B2", MIXED: "#CC79A7"}
PHASE_COLORS = {"forward": "#56B4E9", "backward": "#009E73", "recompute": "#E69F00"}
BUDGET_COLOR = "#D55E00"
FONT = {"font.size": 11, "axes.titlesize": 13, "axes.labelsize": 12, "legend.fontsize": 10,
        "xtick.labelsize": 10, "ytick.labelsize": 10}


# ---------------------------------------------------------------- matplotlib set-up


def _figure(width: float, height: float) -> Figure:
    """A pyplot-free Figure; picks Agg first when nothing else chose a backend headless."""
    import matplotlib

    headless = sys.platform.startswith("linux") and not (
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    if headless and "matplotlib.pyplot" not in sys.modules and not os.environ.get(
            "MPLBACKEND"):
        matplotlib.use("Agg")
    from matplotlib.figure import Figure

    matplotlib.rcParams.update(FONT)
    return Figure(figsize=(width, height), layout="constrained", dpi=100)


def _gib_axis(ax: Axes, axis: Literal["x", "y"]) -> None:
    from matplotlib.ticker import FuncFormatter

    def fmt(value: float, _pos: int) -> str:
        return f"{value:.4g}"

    getattr(ax, f"{axis}axis").set_major_formatter(FuncFormatter(fmt))


def _gib(nbytes: float) -> str:
    return format_bytes(nbytes)


def _unit(largest: float) -> tuple[str, int]:
    """The byte unit an axis up to ``largest`` bytes reads best in."""
    for name, size in (("GiB", GIB), ("MiB", 2**20)):
        if largest >= size:
            return name, size
    return "KiB", 2**10


# ---------------------------------------------------------------- shared data


def _problem(source: Plan | GraphProfile) -> tuple[Problem, GraphProfile]:
    """The step a plan's numbers replay (per rank for DDP/FSDP: ``Plan.problem``), or a
    profile's step as one process runs it."""
    if isinstance(source, Plan):
        return source.problem(), source.profile
    return problem_from_profile(source), source


def node_status(n_nodes: int, schedule: Schedule) -> list[str]:
    """Per node, its decision (`Schedule.decisions`) as reports name it: ``"stored"`` (kept,
    no checkpoint), ``"saved (SAC)"`` (kept inside a checkpoint by its selective policy),
    ``"recomputed"`` or ``"offloaded to host"`` (what it saves goes to host memory: a stored
    node of an offloaded call, or one a top-level checkpoint inside it keeps)."""
    if n_nodes != schedule.n_nodes:
        raise ValueError(f"the schedule covers {schedule.n_nodes} nodes, not {n_nodes}: "
                         "it was made for another profile")
    checkpointed = schedule.recomputed_nodes()
    named = {Decision.RECOMPUTE: RECOMPUTED, Decision.OFFLOAD: OFFLOADED}
    return [named.get(d) or (SAVED if i in checkpointed else STORED)
            for i, d in enumerate(schedule.decisions())]


# ---------------------------------------------------------------- timeline


def _runs(phases: Sequence[str]) -> list[tuple[str, int, int]]:
    """Maximal runs ``(phase, first, last + 1)`` of equal phases."""
    runs: list[tuple[str, int, int]] = []
    for i, phase in enumerate(phases):
        if runs and runs[-1][0] == phase:
            runs[-1] = (phase, runs[-1][1], i + 1)
        else:
            runs.append((phase, i, i + 1))
    return runs


def _curve(timeline: Timeline, x: str, size: int = GIB
           ) -> tuple[list[float], list[float], list[float]]:
    """Per event its start and end on the x axis and its peak in units of ``size`` bytes."""
    starts, ends, ys = [], [], []
    clock = 0.0
    for i, event in enumerate(timeline.events):
        if x == "time":
            starts.append(clock)
            clock += event.time_ms
            ends.append(clock)
        else:
            starts.append(float(i))
            ends.append(float(i + 1))
        ys.append(event.peak_bytes / size)
    return starts, ends, ys


def _steps(starts: list[float], ends: list[float], ys: list[float],
           idx: Iterable[int]) -> tuple[list[float], list[float]]:
    xs_out: list[float] = []
    ys_out: list[float] = []
    for i in idx:
        xs_out += [starts[i], ends[i]]
        ys_out += [ys[i], ys[i]]
    return xs_out, ys_out


def plot_timeline(plan: Plan, measured: Sequence[tuple[float, float]] | None = None, *,
                  x: Literal["time", "event"] = "time", show_unplanned: bool = True) -> Figure:
    """Memory over one training step of ``plan``, replayed by ``simulate()``.

    Args:
        plan: the plan to show.
        measured: optional measured curve, ``(x, bytes)`` pairs in the same x units.
        x: ``"time"`` (cumulative predicted ms) or ``"event"`` (event index).
        show_unplanned: also draw the no-checkpointing step, thin and grey.

    Forward, recompute and backward phases are shaded; recompute bursts are drawn in
    orange on the curve; the peak is marked and labelled; the budget is a dashed line.
    """
    from matplotlib.patches import Patch

    problem, _ = _problem(plan)
    unit, size = _unit(max(plan.unplanned_peak_bytes, plan.budget_bytes))
    timeline = simulate(problem, plan.schedule)
    starts, ends, ys = _curve(timeline, x, size)
    fig = _figure(11, 5.6)
    ax = fig.add_subplot()
    handles: list[Any] = []

    phases = [e.phase for e in timeline.events]
    shaded: set[str] = set()
    for phase, a, b in _runs(phases):
        if ends[b - 1] > starts[a]:
            ax.axvspan(starts[a], ends[b - 1], color=PHASE_COLORS[phase],
                       alpha=0.35 if phase == "recompute" else 0.12, lw=0, zorder=0)
            shaded.add(phase)
    bursts = [r for r in _runs(phases) if r[0] == "recompute"]
    for phase in ("forward", "recompute", "backward"):
        if phase not in shaded:
            continue
        label = phase
        if phase == "recompute":
            label = (f"recompute ({len(bursts)} burst{'s' * (len(bursts) != 1)}, "
                     f"{timeline.recompute_time_ms:.3g} ms)")
        handles.append(Patch(color=PHASE_COLORS[phase],
                             alpha=0.5 if phase == "recompute" else 0.25, label=label))

    if show_unplanned and plan.checkpointing:
        base = simulate(problem, Schedule.store_all(problem.n_nodes))
        bs, be, by = _curve(base, x, size)
        handles += ax.plot(*_steps(bs, be, by, range(len(by))), color="0.55", lw=1.2,
                           ls=(0, (4, 2)), zorder=2,
                           label=f"no checkpointing (peak {_gib(base.peak_bytes)})")
    handles += ax.plot(*_steps(starts, ends, ys, range(len(ys))), color="#222222", lw=1.6,
                       zorder=3, label="this plan, simulated")
    for _, a, b in bursts:
        ax.plot(*_steps(starts, ends, ys, range(a, b)), color=PHASE_COLORS["recompute"],
                lw=2.6, zorder=4)
    if measured:
        mx, my = zip(*measured, strict=True)
        handles += ax.plot(mx, [v / size for v in my], color="#7B3294", lw=1.6, zorder=5,
                           label="measured")
    handles.append(ax.axhline(plan.budget_bytes / size, color=BUDGET_COLOR, ls="--", lw=1.6,
                              zorder=4, label=f"budget {_gib(plan.budget_bytes)}"))
    static = problem.static_bytes / size
    handles.append(ax.axhline(static, color="0.35", ls=":", lw=1.2, zorder=1,
                              label="static (params, buffers, inputs) "
                              f"{_gib(problem.static_bytes)}"))

    k = timeline.peak_event
    px, py = starts[k], ys[k]
    ax.plot([px], [py], marker="v", ms=11, color=BUDGET_COLOR, mec="white", zorder=6)
    right = px < (starts[0] + ends[-1]) / 2
    ax.annotate(f"peak {_gib(timeline.peak_bytes)}\nat {timeline.peak_label}",
                xy=(px, py), xytext=(40 if right else -40, 14), textcoords="offset points",
                ha="left" if right else "right", va="bottom", fontsize=10,
                bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "0.6", "alpha": 0.9},
                arrowprops={"arrowstyle": "->", "color": "0.3"}, zorder=7)

    top = max([*ys, plan.budget_bytes / size, plan.unplanned_peak_bytes / size]
              + ([v / size for _, v in measured] if measured else []))
    ax.set_ylim(0, top * 1.22)
    ax.set_xlim(starts[0], ends[-1])
    _gib_axis(ax, "y")
    ax.set_xlabel("predicted time in the step (ms)" if x == "time" else "event index")
    ax.set_ylabel(f"allocated memory ({unit})")
    ax.set_title(f"Memory timeline of one training step: {plan.model_name}\n"
                 f"peak {_gib(timeline.peak_bytes)} of {_gib(plan.budget_bytes)} budget, "
                 f"overhead {100 * plan.predicted_overhead:.1f} % "
                 f"({plan.profile.timing} on {plan.profile.device})")
    ax.grid(True, axis="y", alpha=0.3)
    fig.legend(handles=handles, loc="outside lower center", ncol=3, frameon=False)
    return fig


# ---------------------------------------------------------------- graph


@dataclass(frozen=True)
class ModuleGroup:
    """Consecutive nodes of one top-level module (``key``, e.g. ``blocks.3``; ``""`` for
    top-level nodes), with a readable ``label``."""

    key: str
    label: str
    nodes: tuple[int, ...]


def _group_key(module: str, prefix: str | None) -> str:
    if prefix and module.startswith(prefix + "."):
        head = module[len(prefix) + 1:].split(".", 1)[0]
        if head.isdigit():
            return f"{prefix}.{head}"
    return module.split(".", 1)[0] if module else ""


def module_groups(profile: GraphProfile) -> list[ModuleGroup]:
    """Consecutive nodes of one top-level module (one per block) form a group."""
    prefix = detect_block_prefix(profile)
    runs: list[tuple[str, list[int]]] = []
    for node in profile.nodes:
        key = _group_key(node.module, prefix)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(node.index)
        else:
            runs.append((key, [node.index]))
    groups = []
    for key, members in runs:
        names = [profile.nodes[i].name for i in members]
        label = key or (names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}")
        groups.append(ModuleGroup(key, label, tuple(members)))
    return groups


def _group_status(statuses: list[str]) -> str:
    kinds = set(statuses)
    if len(kinds) == 1 and kinds <= {STORED, OFFLOADED}:
        return kinds.pop()
    if STORED not in kinds and OFFLOADED not in kinds:
        return SAVED if SAVED in kinds else RECOMPUTED
    return MIXED


def _snake(n: int, ncols: int) -> list[tuple[float, float]]:
    pos = []
    for k in range(n):
        row, col = divmod(k, ncols)
        pos.append((float(col if row % 2 == 0 else ncols - 1 - col), -1.3 * row))
    return pos


def _layers(graph: Any) -> dict[Any, int]:
    """Longest-path depth of each node of a DAG."""
    import networkx as nx

    depth: dict[Any, int] = {}
    for v in nx.topological_sort(graph):
        depth[v] = max((depth[u] + 1 for u in graph.predecessors(v)), default=0)
    return depth


def _draw(ax: Axes, graph: Any, pos: dict[Any, tuple[float, float]], fontsize: float) -> None:
    """Nodes as labelled boxes, edges as arrows clipped at the boxes' borders."""
    from matplotlib.patches import FancyArrowPatch

    boxes = {}
    for v, data in graph.nodes(data=True):
        x, y = pos[v]
        boxes[v] = ax.text(x, y, data["label"], ha="center", va="center", fontsize=fontsize,
                           zorder=3, bbox={"boxstyle": "round,pad=0.35", "fc": data["color"],
                                           "ec": data.get("edge", "0.25"),
                                           "ls": data.get("ls", "-"), "lw": 0.8})
    for u, v in graph.edges:
        (x0, y0), (x1, y1) = pos[u], pos[v]
        depth = graph.graph.get("depth")
        if depth is not None:  # layered drawing: edges skipping layers bend around
            near = abs(depth[u] - depth[v]) <= 1
        else:  # snake drawing: neighbours in a row or a column
            near = (y0 == y1 and abs(x0 - x1) <= 1.01) or (x0 == x1 and abs(y0 - y1) <= 1.31)
        ax.add_patch(FancyArrowPatch(
            (x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=12, color="0.4", lw=0.9,
            patchA=boxes[u].get_bbox_patch(), patchB=boxes[v].get_bbox_patch(),
            shrinkA=1, shrinkB=1, zorder=2,
            connectionstyle="arc3" if near else "arc3,rad=0.2"))
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_ylim(min(ys) - 0.7, max(ys) + 0.7)
    ax.set_axis_off()


def _order_layers(graph: Any, by_layer: dict[int, list[Any]]) -> None:
    """Barycentre heuristic: order each layer by its predecessors' mean position."""
    for _ in range(2):
        rank: dict[Any, float] = {}
        for d in sorted(by_layer):
            layer = by_layer[d]
            for k, v in enumerate(layer):
                preds = [rank[u] for u in graph.predecessors(v) if u in rank]
                rank[v] = sum(preds) / len(preds) if preds else float(k)
            layer.sort(key=lambda v: rank[v])
            for k, v in enumerate(layer):
                rank[v] = k - (len(layer) - 1) / 2


def _legend(fig: Figure, kinds: Iterable[str], extra: Sequence[Any] = ()) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(fc=STATUS_COLORS[k], ec="0.25", label=_KIND_LABELS[k])
               for k in (STORED, RECOMPUTED, SAVED, OFFLOADED, MIXED) if k in set(kinds)]
    entries = [*handles, *extra]
    per_row = max(1, min(len(entries), int(fig.get_size_inches()[0] // 3.7)))
    fig.legend(handles=entries, loc="outside lower center", ncol=per_row, frameon=False)


_KIND_LABELS = {STORED: "stored (autograd keeps its activations)",
                RECOMPUTED: "recomputed in backward",
                SAVED: "selectively saved (SAC keeps the output)",
                OFFLOADED: "offloaded (its saves go to host memory and back)",
                MIXED: "mixed (stored and recomputed nodes)"}


def plot_graph(plan: Plan, block: str | None = None, *, max_nodes: int = 60) -> Figure:
    """The graph with stored, recomputed, selectively saved and offloaded nodes coloured.

    Graphs with more than ``max_nodes`` nodes are collapsed to one box per top-level module
    (one per repeated block, e.g. ``blocks.3``), labelled with its node counts; ``block=``
    names one group (``"blocks.3"``, ``"lm_head"``) to draw its nodes one by one.
    """
    import networkx as nx

    profile = plan.profile
    status = node_status(len(profile.nodes), plan.schedule)
    index_of = {node.name: node.index for node in profile.nodes}
    groups = module_groups(profile)
    if block is None and len(profile.nodes) <= max_nodes:
        members = list(range(len(profile.nodes)))
        return _plot_nodes(plan, members, status, index_of, f"all {len(members)} ops")
    if block is not None:
        chosen = [g for g in groups if block in (g.key, g.label)]
        if not chosen:
            names = sorted({g.key or g.label for g in groups})
            raise ValueError(f"no block {block!r} in the graph of {plan.model_name}; "
                             f"choose one of {names}")
        members = sorted(i for g in chosen for i in g.nodes)
        key = chosen[0].key or None
        return _plot_nodes(plan, members, status, index_of,
                           f"{block}, {len(members)} ops by submodule call", key)

    graph = nx.DiGraph()
    owner = {i: k for k, g in enumerate(groups) for i in g.nodes}
    for k, g in enumerate(groups):
        counts = {s: sum(status[i] == s for i in g.nodes)
                  for s in (STORED, RECOMPUTED, SAVED, OFFLOADED)}
        parts = [f"{c} {s.split()[0]}" for s, c in counts.items() if c]
        kind = _group_status([status[i] for i in g.nodes])
        graph.add_node(k, label=f"{g.label}\n{len(g.nodes)} op{'s' * (len(g.nodes) > 1)}: "
                       + ", ".join(parts),
                       color=STATUS_COLORS[kind], kind=kind)
    for node in profile.nodes:
        for arg in node.args:
            a, b = owner[index_of[arg]], owner[node.index]
            if a != b:
                graph.add_edge(a, b)
    ncols = max(2, min(len(groups), math.ceil(math.sqrt(len(groups) * 1.6))))
    pos = dict(enumerate(_snake(len(groups), ncols)))
    rows = math.ceil(len(groups) / ncols)
    fig = _figure(max(9.0, 2.3 * ncols), 1.3 + 1.15 * rows)
    ax = fig.add_subplot()
    _draw(ax, graph, pos, fontsize=9)
    ax.set_title(f"Checkpoint plan of {plan.model_name}: {len(profile.nodes)} ops "
                 f"collapsed to {len(groups)} modules (read left to right, snaking down)")
    _legend(fig, [d["kind"] for _, d in graph.nodes(data=True)])
    return fig


def _units(profile: GraphProfile, members: list[int], block: str | None
           ) -> list[tuple[str, list[int]]]:
    """Boxes to draw for ``members``: inside ``block``, each call of a submodule one level
    below it is one box (``attn: 24 ops``), the block's own ops one box each; without a
    block, every op is a box."""
    units: list[tuple[str, list[int]]] = []
    for i in members:
        module = profile.nodes[i].module
        key = f"op{i}"
        if block is not None and module.startswith(block + "."):
            key = block + "." + module[len(block) + 1:].split(".", 1)[0]
        if units and units[-1][0] == key and not key.startswith("op"):
            units[-1][1].append(i)
        else:
            units.append((key, [i]))
    out = []
    for key, nodes in units:
        if key.startswith("op"):
            name = profile.nodes[nodes[0]].name
            label = name.split("/", 1)[1] if "/" in name else name
        else:
            label = f"{key[len(block) + 1:]}: {len(nodes)} op{'s' * (len(nodes) > 1)}"
        out.append((label, nodes))
    return out


def _plot_nodes(plan: Plan, members: list[int], status: list[str], index_of: dict[str, int],
                what: str, block: str | None = None) -> Figure:
    import networkx as nx
    from matplotlib.patches import Patch

    profile = plan.profile
    units = _units(profile, members, block)
    owner = {i: k for k, (_, nodes) in enumerate(units) for i in nodes}
    graph = nx.DiGraph()
    for k, (label, nodes) in enumerate(units):
        graph.add_node(k, label=label,
                       color=STATUS_COLORS[_group_status([status[i] for i in nodes])])
    outside = False
    for i in members:
        for arg in profile.nodes[i].args:
            j = index_of[arg]
            if j in owner:
                if owner[j] != owner[i]:
                    graph.add_edge(owner[j], owner[i])
                continue
            outside = True
            source = ("in", j)
            graph.add_node(source, label=f"in: {arg}", color="white", edge="0.5", ls="--")
            graph.add_edge(source, owner[i])
    depth = _layers(graph)
    graph.graph["depth"] = depth
    by_layer: dict[int, list[Any]] = {}
    for v in sorted(graph.nodes, key=str):
        by_layer.setdefault(depth[v], []).append(v)
    _order_layers(graph, by_layer)
    width = max(len(vs) for vs in by_layer.values())
    pos = {v: ((k - (len(vs) - 1) / 2) * 1.6, -0.55 * d)
           for d, vs in by_layer.items() for k, v in enumerate(vs)}
    n_layers = len(by_layer)
    vertical = n_layers > 12
    if not vertical:  # short graphs read better left to right
        pos = {v: (-y / 0.55 * 1.4, x / 1.6 * 0.8) for v, (x, y) in pos.items()}
        fig = _figure(max(9.0, min(28.0, 1.5 * n_layers)), max(3.5, 2.0 + 0.8 * width))
    else:
        fig = _figure(max(8.0, min(28.0, 2.4 * width)), 1.6 + 0.36 * n_layers)
    ax = fig.add_subplot()
    _draw(ax, graph, pos, fontsize=8)
    ax.set_ylim(min(p[1] for p in pos.values()) - 0.4, max(p[1] for p in pos.values()) + 0.4)
    ax.set_title(f"Checkpoint plan of {plan.model_name}: {what}"
                 + (" (top to bottom)" if vertical else ""))
    extra = [Patch(fc="white", ec="0.5", ls="--", label="input from outside")] if outside else []
    _legend(fig, [status[i] for i in members], extra)
    return fig


# ---------------------------------------------------------------- frontier


@dataclass(frozen=True)
class FrontierPoint:
    """One schedule scored by ``simulate()``: its peak and predicted overhead."""

    name: str
    budget_bytes: int | None
    peak_bytes: int
    recompute_ms: float
    overhead_pct: float


def _score(problem: Problem, schedule: Schedule, base_ms: float, name: str,
           budget: int | None) -> FrontierPoint:
    tl = simulate(problem, schedule)
    pct = 100 * tl.recompute_time_ms / base_ms if base_ms else 0.0
    return FrontierPoint(name, budget, tl.peak_bytes, tl.recompute_time_ms, pct)


def frontier_points(source: Plan | GraphProfile, budgets: Sequence[int] | None = None, *,
                    n_budgets: int = 8, solver: str = "auto",
                    time_limit_s: float = 1.0) -> list[FrontierPoint]:
    """Solve at each budget (default: ``n_budgets`` from the memory lower bound to the
    no-checkpointing peak) and score each schedule with ``simulate()``; infeasible budgets
    (or ones the solver cannot fit in ``time_limit_s``) are skipped."""
    problem, _ = _problem(source)
    store_all = Schedule.store_all(problem.n_nodes)
    unplanned = simulate(problem, store_all)
    base_ms = unplanned.total_time_ms
    if budgets is None:
        lo, hi = memory_lower_bound(problem), unplanned.peak_bytes
        budgets = sorted({int(lo + (hi - lo) * k / max(1, n_budgets - 1))
                          for k in range(n_budgets)})
    points = []
    # from the top down: stop after two budgets in a row do not fit (smaller ones won't)
    ordered = sorted({int(b) for b in budgets}, reverse=True)
    misses = 0
    for k, budget in enumerate(ordered):
        if budget >= unplanned.peak_bytes:
            points.append(_score(problem, store_all, base_ms, "no checkpointing", budget))
            continue
        solution = SOLVERS[solver](problem, budget, time_limit_s)
        if not solution.feasible or solution.schedule is None:
            misses += 1
            log.info("budget %.4g GiB: %s within %.3g s, skipped", budget / GIB,
                     solution.status.value, time_limit_s)
            if misses == 2:
                log.info("skipping the %d smaller budgets (raise time_limit_s if the solver "
                         "ran out of time)", len(ordered) - k - 1)
                break
            continue
        misses = 0
        point = _score(problem, solution.schedule, base_ms, solution.solver, budget)
        if point.peak_bytes > budget:  # never plot a point the simulator says does not fit
            log.warning("%s exceeds budget %d in simulate(); skipped", solution.solver, budget)
            continue
        points.append(point)
    points.reverse()
    return points


def baseline_points(source: Plan | GraphProfile,
                    names: Sequence[str] = DEFAULT_BASELINES) -> list[FrontierPoint]:
    """Each baseline's schedule scored by ``simulate()`` (whatever the budget)."""
    problem, _ = _problem(source)
    unplanned = simulate(problem, Schedule.store_all(problem.n_nodes))
    points = []
    for name in names:
        solution = BASELINES[name](problem, unplanned.peak_bytes, 1.0)
        if solution.schedule is not None:
            points.append(_score(problem, solution.schedule, unplanned.total_time_ms, name,
                                 None))
    return points


def pareto(points: Iterable[FrontierPoint]) -> list[FrontierPoint]:
    """The non-dominated points, by increasing peak (decreasing overhead)."""
    return front.pareto(points, cost=lambda p: p.peak_bytes, loss=lambda p: p.overhead_pct,
                        tol=1e-12)


_MARKERS = "osD^Pv<>Xh"


def plot_frontier(profile_or_plan: Plan | GraphProfile, budgets: Sequence[int] | None = None,
                  baselines: Sequence[str] = DEFAULT_BASELINES, *, n_budgets: int = 8,
                  solver: str = "auto", time_limit_s: float = 1.0,
                  points: Sequence[FrontierPoint] | None = None) -> Figure:
    """Predicted overhead (%) against peak memory (GiB) over a sweep of budgets.

    The optimal solver's answers at each budget (``frontier_points``) give the Pareto
    frontier, drawn as a staircase (the best overhead reachable at that peak or more); the
    ``baselines`` are labelled points; a plan, when given, is starred. All numbers come from
    ``simulate()``. ``points`` from :func:`frontier_points` skips the solving.
    """
    from matplotlib.lines import Line2D

    plan = profile_or_plan if isinstance(profile_or_plan, Plan) else None
    profile = plan.profile if plan else profile_or_plan
    base = baseline_points(profile_or_plan, baselines)
    if points is not None:
        budgets = [p.budget_bytes or p.peak_bytes for p in points]
    elif budgets is None:  # the default sweep, plus each baseline's peak and the plan's budget
        problem, _ = _problem(profile_or_plan)
        lo = memory_lower_bound(problem)
        hi = simulate(problem, Schedule.store_all(problem.n_nodes)).peak_bytes
        budgets = sorted({int(lo + (hi - lo) * k / max(1, n_budgets - 1))
                          for k in range(n_budgets)}
                         | {p.peak_bytes for p in base}
                         | ({plan.budget_bytes} if plan else set()))
    if points is None:
        points = frontier_points(profile_or_plan, budgets, solver=solver,
                                 time_limit_s=time_limit_s)
    front = pareto(points)
    unit, size = _unit(max([p.peak_bytes for p in [*points, *base]] or [GIB]))
    fig = _figure(10.5, 6.2)
    ax = fig.add_subplot()
    handles: list[Any] = []
    if front:
        xs = [p.peak_bytes / size for p in front]
        ys = [p.overhead_pct for p in front]
        handles += ax.plot(xs, ys, drawstyle="steps-post", color="#0072B2", lw=2, zorder=2,
                           label=f"Pareto frontier ({solver} solver, {len(front)} points)")
        ax.plot(xs, ys, "o", color="#0072B2", ms=6, zorder=3)
        rest = [p for p in points if p not in front]
        if rest:
            handles += ax.plot([p.peak_bytes / size for p in rest],
                               [p.overhead_pct for p in rest], "o", mfc="none", mec="#0072B2",
                               ms=6, zorder=2, label="dominated solver answers")
    # baselines with the same schedule score land on one point: label them together
    merged: dict[tuple[int, float], list[str]] = {}
    for p in base:
        merged.setdefault((p.peak_bytes, round(p.overhead_pct, 9)), []).append(p.name)
    for k, ((peak, pct), names) in enumerate(sorted(merged.items())):
        label = " = ".join(names)
        handles.append(ax.scatter([peak / size], [pct], marker=_MARKERS[k % len(_MARKERS)],
                                  s=70, color=f"C{(k + 1) % 10}", edgecolor="black",
                                  lw=0.6, zorder=5, label=f"baseline: {label}"))
        ax.annotate(label, (peak / size, pct), xytext=(8, 8 if k % 2 == 0 else -14),
                    textcoords="offset points", fontsize=9, zorder=6,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                          "alpha": 0.8})
    if plan is not None:
        handles.append(ax.scatter([plan.predicted_peak_bytes / size],
                                  [100 * plan.predicted_overhead], marker="*", s=260,
                                  color="#D55E00", edgecolor="black", zorder=7,
                                  label=f"this plan ({_gib(plan.predicted_peak_bytes)}, "
                                        f"{100 * plan.predicted_overhead:.1f} %)"))
        handles.append(ax.axvline(plan.budget_bytes / size, color=BUDGET_COLOR, ls="--", lw=1.2,
                                  zorder=1, label=f"plan budget {_gib(plan.budget_bytes)}"))
    if not front and not base:
        ax.text(0.5, 0.5, "no feasible budget in the sweep", transform=ax.transAxes,
                ha="center")
    else:
        handles.append(Line2D([], [], ls="none", label=f"{len(points)} of "
                              f"{len(set(budgets))} "
                              "budgets feasible"))
    ax.margins(x=0.08, y=0.12)
    ax.set_ylim(bottom=min(-2.0, ax.get_ylim()[0]))
    _gib_axis(ax, "x")
    ax.set_xlabel(f"peak memory of the step ({unit})")
    ax.set_ylabel("predicted step overhead (%)\nrecompute / step without checkpointing")
    ax.set_title(f"Memory / time trade-off of {profile.model_name} "
                 f"({profile.timing} on {profile.device})")
    ax.grid(True, alpha=0.3)
    fig.legend(handles=handles, loc="outside right upper", frameon=False)
    return fig


# ---------------------------------------------------------------- plan tables


def plot_buckets(table: PlanTable) -> Figure:
    """A plan table's buckets: each plan's predicted peak against the budget (left) and
    its predicted recompute time (right), unpadded and padded branches side by side."""
    labels = sorted({e.length or 0 for e in table.entries})
    branches = sorted({e.padded for e in table.entries}, key=lambda p: (p is not None, p))
    unit, size = _unit(max(table.budget_bytes, *(p.predicted_peak_bytes
                                                for p in table.plans)))
    fig = _figure(11, 4.2)
    peak_ax, time_ax = fig.subplots(1, 2)
    width = 0.8 / len(branches)
    colors = {None: "#56B4E9", False: "#56B4E9", True: "#CC79A7"}  # padded: another hue
    for k, branch in enumerate(branches):
        entries = {e.length or 0: e for e in table.entries if e.padded == branch}
        xs = [i + (k - (len(branches) - 1) / 2) * width for i, length in enumerate(labels)
              if length in entries]
        name = "no mask" if branch is None else "padded" if branch else "unpadded"
        peak_ax.bar(xs, [entries[n].plan.predicted_peak_bytes / size for n in labels
                         if n in entries], width, color=colors[branch], label=name)
        time_ax.bar(xs, [entries[n].plan.recompute_ms for n in labels if n in entries],
                    width, color=colors[branch], label=name)
    peak_ax.axhline(table.budget_bytes / size, color=BUDGET_COLOR, ls="--", lw=1.2,
                    label="budget")
    peak_ax.set_ylim(0, 1.25 * peak_ax.get_ylim()[1])  # room for the legend
    for ax, ylabel in ((peak_ax, f"predicted peak ({unit})"),
                       (time_ax, "predicted recompute (ms)")):
        ax.set_xticks(range(len(labels)), [f"<= {n}" if n else "all" for n in labels])
        ax.set_xlabel("bucket (tokens per row)")
        ax.set_ylabel(ylabel)
        ax.legend(frameon=False, fontsize=8)
    fig.suptitle(f"{table.model_name}: {len(table.entries)} plans over "
                 f"{table.describe()}", fontsize=10)
    return fig
