"""A module's traced forward cut into op ranges, as Python code: what a planned
``TracedForward`` runs (:mod:`planner.runtime.emit`).

The forward outside its ranges and each range are generated from the fx graph by torch.fx's
own code generator (as a ``GraphModule``'s forward is), so a planned call pays per op what
the module's own forward pays, not an interpreter's walk over its nodes: GPT small's root
forward with one range of two blocks, run node by node, took 0.2-0.4 ms more than the eager
forward on 2 CPU cores (13 nodes), and a rerun interpreted its range again. The generated
code frees each value after its last use, as fx's code does, and looks parameters and
children up on the module at each call (FSDP2 may have replaced them).
"""

from __future__ import annotations

import linecache
import operator
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from typing import Any

import torch.fx as fx

from planner.plan import PlanMismatchError

__all__ = ["Program", "Range"]

RunRange = Callable[[str, tuple], tuple]  # (range name, its inputs) -> its outputs


@dataclass(frozen=True)
class Range:
    """One op range of a traced forward: ``run(module, *inputs)`` returns its outputs."""

    name: str  # its first node's
    run: Callable[..., tuple]


@dataclass(frozen=True)
class Program:
    """A traced forward cut into its ranges: ``forward(module, run_range, *inputs)`` runs
    the nodes outside the ranges and calls ``run_range(name, inputs)`` for each range."""

    forward: Callable[..., Any]
    ranges: dict[str, Range]
    code: str  # the traced graph's Python: equal code, equal program

    @classmethod
    def cut(cls, graph: fx.Graph, spans: list[tuple[str, str, str]]) -> Program:
        """``graph`` cut into the ranges ``spans`` (label, first node, last node)."""
        order = list(graph.nodes)
        names = [n.name for n in order]
        ranges: dict[fx.Node, list[fx.Node]] = {}
        for label, first, last in spans:
            if first not in names or last not in names or \
                    names.index(first) > names.index(last):
                raise PlanMismatchError(
                    f"module {label}: its traced forward has no nodes {first}..{last} (its "
                    "code changed since it was planned). Run planner.optimize() again.")
            nodes = order[names.index(first):names.index(last) + 1]
            ranges[nodes[0]] = nodes
        runs = {first.name: Range(first.name, _range_function(nodes))
                for first, nodes in ranges.items()}
        return cls(_outer_function(order, ranges), runs, graph.python_code("self").src)


def _call_range(run_range: RunRange, name: str, *inputs: Any) -> tuple:
    """What the generated forward calls for a range (a global of its code)."""
    return run_range(name, inputs)


def _flowing_in(nodes: list[fx.Node]) -> list[fx.Node]:
    inside = set(nodes)
    return list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))


def _flowing_out(nodes: list[fx.Node]) -> list[fx.Node]:
    inside = set(nodes)
    return [n for n in nodes if any(u not in inside for u in n.users)]


def _range_function(nodes: list[fx.Node]) -> Callable[..., tuple]:
    """``f(module, *inputs)``: the range's nodes, returning its outputs as a tuple.
    Parameters and buffers it reads are looked up inside (again on a rerun), not passed."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in _flowing_in(nodes):
        env[a] = graph.node_copy(a, env.__getitem__) if a.op == "get_attr" else \
            graph.placeholder(a.name)
    # a get_attr read inside (copied above) is not an input
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in _flowing_out(nodes)))
    return _compiled(graph, f"range {nodes[0].name}")


def _outer_function(order: list[fx.Node], ranges: dict[fx.Node, list[fx.Node]]
                    ) -> Callable[..., Any]:
    """``f(module, run_range, *inputs)``: the nodes outside ``ranges``, each range a call."""
    graph = fx.Graph()
    run_range = graph.placeholder("run_range")
    env: dict[fx.Node, fx.Node] = {}
    inside = {n for nodes in ranges.values() for n in nodes[1:]}
    for node in order:
        if node in ranges:
            nodes = ranges[node]
            call = graph.call_function(_call_range, (
                run_range, node.name, *(env[a] for a in _flowing_in(nodes)
                                        if a.op != "get_attr")))
            for k, out in enumerate(_flowing_out(nodes)):
                env[out] = graph.call_function(operator.getitem, (call, k))
        elif node not in inside:
            env[node] = graph.node_copy(node, env.__getitem__)
    return _compiled(graph, "forward")


_SOURCES = count()


def _compiled(graph: fx.Graph, what: str) -> Callable[..., Any]:
    """The function fx's code generator writes for ``graph`` (first argument: the module),
    its source kept in ``linecache`` so that a traceback shows the line that failed."""
    code = graph.python_code("self")
    filename = f"<planned {what} #{next(_SOURCES)}>"
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(True), filename)
    scope = dict(code.globals)
    exec(compile(code.src, filename, "exec"), scope)  # fx's own generated code
    return scope["forward"]
