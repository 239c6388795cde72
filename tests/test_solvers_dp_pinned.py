"""The DP's lower bound with pinned storages held as every schedule holds them
(`solvers.dp_pinned`): still a bound over the space, and tight where a region freeing them
reruns more than the answer costs."""

from __future__ import annotations

import itertools
import math

from solvers import dp
from solvers.accounting import Context
from solvers.problem import ModuleSpan, Problem
from solvers.result import Status
from solvers.schedule import Region, Schedule
from solvers.simulate import simulate
from solvers.testing import MiB, transformer


def _rotary_model(table_mib: int) -> Problem:
    """Three rotary blocks in one container call (`body`, as timm's `blocks` or a
    decoder's layer list): the table made before the first block is read and saved by
    every block, so the DP pins it; only `body` holds its producer and a block."""
    p = transformer(3, width=1, rotary=True)
    blocks: dict[int, list[int]] = {}
    for i, b in enumerate(p.block_of_node or ()):
        if b >= 0:
            blocks.setdefault(b, []).append(i)
    spans = [ModuleSpan(start=nodes[0], stop=nodes[-1] + 1, name=f"blocks.{b}",
                        inputs=p.region_inputs(nodes[0], nodes[-1] + 1))
             for b, nodes in sorted(blocks.items())]
    spans.append(ModuleSpan(start=0, stop=spans[-1].stop + 1, name="body"))
    data = p.model_dump()
    data["storage_bytes"][0] = table_mib * MiB
    return Problem.model_validate({**data, "module_spans": spans})


def _schedules(p: Problem) -> list[Schedule]:
    """Every block stored or recomputed keeping nothing or its matmuls, and `body`
    recomputed keeping nothing or its matmuls, or nesting every block: all in the DP's
    space (`keep_front=False`)."""
    spans = p.module_spans or []
    blocks, body = [(s.start, s.stop) for s in spans[:-1]], spans[-1]

    def region(a: int, b: int, keep: bool, children: tuple[Region, ...] = ()) -> Region:
        matmuls = [i for i in range(a, b) if p.is_matmul(i) and p.can_keep(i)]
        return Region(a, b, "recompute", keep=matmuls if keep else [], children=children)

    out = [Schedule.from_segments(p.n_nodes, [region(body.start, body.stop, keep)])
           for keep in (False, True)]
    for choice in itertools.product([None, False, True], repeat=len(blocks)):
        chosen = [region(a, b, k)
                  for (a, b), k in zip(blocks, choice, strict=True) if k is not None]
        out.append(Schedule.from_segments(p.n_nodes, chosen))
        if len(chosen) == len(blocks):
            out.append(Schedule.from_segments(
                p.n_nodes, [region(body.start, body.stop, False, tuple(chosen))]))
    return out


def test_the_table_is_held_down_to_the_first_block_unless_body_reruns() -> None:
    p = _rotary_model(300)
    lay = dp._layout(Context(p))
    assert lay.pinned == frozenset({0})
    (hold,) = lay.holds
    first_block = (p.module_spans or [])[0]
    assert first_block.start < hold.holder < first_block.stop and 0 in p.saved[hold.holder]
    # body reruns everything up to its last pack but the matmuls it keeps
    assert 1.0 < hold.cover_ms < sum(p.fwd_time_ms)


def test_the_bound_holds_over_the_space_and_proves_what_it_could_not() -> None:
    """At every budget the bound is at most the best enumerated schedule; at the budgets
    where rerunning `body` costs more than the answer, the answer is proven (before the
    pinned table's sure life, the bound left it at 0 ms: the table was counted in no
    backward)."""
    p = _rotary_model(300)
    cover_ms = dp._layout(Context(p)).holds[0].cover_ms
    sims = [simulate(p, s) for s in _schedules(p)]
    proven = 0
    for budget in sorted({t.peak_bytes for t in sims}):
        best = min(t.recompute_time_ms for t in sims if t.peak_bytes <= budget)
        sol = dp.solve(p, budget, math.inf, keep_front=False)
        if not sol.feasible:
            continue
        assert sol.bound_ms is not None and sol.bound_ms <= best + 1e-9, (budget, sol, best)
        if sol.status == Status.OPTIMAL:  # the space holds the enumerated best
            assert sol.objective_ms <= best + 1e-9, (budget, sol, best)
            proven += 0 < best < cover_ms
    assert proven >= 3
