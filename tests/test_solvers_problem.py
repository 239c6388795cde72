"""Problem validation and builders; Schedule construction."""

from __future__ import annotations

import networkx as nx
import pytest

from solvers import Decision, ModuleCall, Problem, Region, Schedule, ScheduleError, simulate


def test_chain_builder() -> None:
    p = Problem.chain([4, 4, 1], [1.0, 2.0, 3.0])
    assert p.node_saved == [[], [0], [1]]
    assert p.bwd_time_ms == [2.0, 4.0, 6.0]
    assert p.consumers == ((1,), (2,), ())


def test_length_mismatch_message() -> None:
    data = Problem.chain([4, 4, 1], [1.0, 1.0, 1.0]).model_dump()
    data["bwd_time_ms"] = [1.0]
    with pytest.raises(ValueError, match="bwd_time_ms has 1 entries"):
        Problem(**data)


def test_consumer_before_producer_rejected() -> None:
    data = Problem.chain([4, 4, 1], [1.0, 1.0, 1.0]).model_dump()
    data["node_inputs"] = [[1], [0], [1]]
    with pytest.raises(ValueError, match="topological order"):
        Problem(**data)


def test_saved_must_be_read_or_allocated() -> None:
    data = Problem.chain([4, 4, 1], [1.0, 1.0, 1.0]).model_dump()
    data["node_saved"] = [[], [0], [0]]
    with pytest.raises(ValueError, match="neither reads nor allocates"):
        Problem(**data)


def test_producer_mismatch_rejected() -> None:
    data = Problem.chain([4, 4, 1], [1.0, 1.0, 1.0]).model_dump()
    data["storage_producer"] = [0, 2, 2]
    with pytest.raises(ValueError, match="storage_producer"):
        Problem(**data)


def test_from_networkx_with_skip() -> None:
    g = nx.DiGraph()
    g.add_node("emb", output_bytes=8, fwd_time_ms=1.0)
    g.add_node("mlp", output_bytes=8, fwd_time_ms=2.0, block=0)
    g.add_node("add", output_bytes=8, fwd_time_ms=0.1, saves_inputs=False, block=0)
    g.add_node("loss", output_bytes=1, fwd_time_ms=0.1)
    g.add_edges_from([("emb", "mlp"), ("mlp", "add"), ("emb", "add"), ("add", "loss")])
    p = Problem.from_networkx(g, static_bytes=100)
    assert p.node_names == ["emb", "mlp", "add", "loss"]
    assert p.node_inputs[2] == [0, 1] and p.node_saved[2] == []
    assert p.blocks() == [(1, 3)]
    assert simulate(p, Schedule.store_all(4)).peak_bytes >= 100


def test_from_networkx_needs_single_sink() -> None:
    g = nx.DiGraph()
    g.add_node("a", output_bytes=1, fwd_time_ms=1.0)
    g.add_node("b", output_bytes=1, fwd_time_ms=1.0)
    with pytest.raises(ValueError, match="exactly one sink"):
        Problem.from_networkx(g)


def test_problem_json_round_trip() -> None:
    p = Problem.chain([4, 4, 1], [1.0, 1.0, 1.0], block_of_node=[0, 0, -1])
    assert Problem.model_validate_json(p.model_dump_json()) == p


def test_schedule_helpers_and_errors() -> None:
    s = Schedule.from_segments(6, [(1, 3)], keep=[2])
    assert s.describe() == "S[0:1] R[1:3 keep=2] S[3:6]"
    assert Schedule.model_validate_json(s.model_dump_json()) == s
    assert Schedule.from_modes(["store", "recompute", "recompute"]).describe() == "S[0:1] R[1:3]"
    with pytest.raises(ValueError, match="consecutive"):
        Schedule(regions=(Region(0, 2), Region(3, 4)))
    with pytest.raises(ValueError, match="outside region"):
        Region(0, 2, "recompute", keep={5})
    with pytest.raises(ScheduleError, match="not recomputed"):
        Schedule.from_segments(4, [(0, 2)], keep=[3])


def test_a_region_decides_per_saved_node_and_names_its_target() -> None:
    block = ModuleCall(path="h.0")
    region = Region(1, 4, "recompute", saves={2: Decision.KEEP}, target=block)
    assert region == Region(1, 4, "recompute", keep=[2], target=block)
    assert region.keep == {2} and region.saves == {2: Decision.KEEP}
    schedule = Schedule(regions=(Region(0, 1), region))
    text = schedule.model_dump_json()
    assert '"saves":{"2":"keep"}' in text and '"path":"h.0"' in text
    again = Schedule.model_validate_json(text)
    assert again == schedule and hash(again) == hash(schedule)
    assert {region, Region(1, 4, "recompute", keep=[3])} != {region}
    with pytest.raises(ValueError, match="saves"):  # a decision that does not exist
        Region(1, 4, "recompute", saves={2: "discard"})
    with pytest.raises(ValueError, match="only RECOMPUTE regions are checkpoints"):
        Region(0, 1, "store", target=block)
    with pytest.raises(ValueError, match="put it in that child"):
        Region(0, 4, "recompute", keep=[2], children=[Region(1, 3, "recompute")])
    untargeted = Schedule(regions=(Region(0, 1), Region(1, 4, "recompute", keep=[2])))
    assert untargeted.with_targets({(1, 4): block}) == schedule


def test_model_copy_drops_cached_derived_data() -> None:
    p = Problem.chain([4, 4, 1], [1.0] * 3)
    assert p.saved == ((), (0,), (1,)) and p.grad_inputs == ((), (0,), (1,))
    q = p.model_copy(update={"node_saved": [[], [], [1]], "node_grad_inputs": [[], [], []]})
    assert q.saved == ((), (), (1,)) and q.packs == (False, False, True)
    assert q.grad_inputs == ((), (), ()) and q.grad_consumers == ((), (), ())
    assert p.saved == ((), (0,), (1,))  # the original keeps its own


def test_can_keep_needs_recomputable_and_keepable() -> None:
    p = Problem.chain([4, 4, 4, 1], [1.0] * 4, recomputable=[True, True, False, True])
    assert [p.can_keep(i) for i in range(4)] == [True, True, False, True]  # default: keepable
    q = p.model_copy(update={"keepable": [False, True, True, True]})
    assert [q.can_keep(i) for i in range(4)] == [False, True, False, True]
    assert Problem.model_validate_json(q.model_dump_json()) == q
    with pytest.raises(ValueError, match="keepable has 2 entries"):
        Problem(**{**p.model_dump(), "keepable": [True, True]})
