"""Baselines and brute force on a small block chain."""

from __future__ import annotations

import math

import pytest

from solvers import Problem, Status, baselines, bruteforce, memory_lower_bound, min_feasible_budget


def blocks6() -> Problem:
    return Problem.chain([10] * 5 + [1], [1.0] * 6, block_of_node=[0, 0, 1, 1, 2, 2])


def blocks5() -> Problem:
    return Problem.chain([10] * 4 + [1], [1.0] * 5, block_of_node=[0, 0, 1, 1, -1])


def test_baseline_schedules() -> None:
    p = blocks6()
    big = 10**9
    assert baselines.none(p, big, 1.0).schedule.describe() == "S[0:6]"
    assert baselines.every_block(p, big, 1.0).schedule.describe() == "R[0:2] R[2:4] R[4:6]"
    # the 2nd block of 3 (every_k_blocks counts from 1, as torchtitan's ac_freq does)
    assert baselines.every_k(2)(p, big, 1.0).schedule.describe() == "S[0:2] R[2:4] S[4:6]"
    assert baselines.chen_sqrt(p, big, 1.0).schedule.describe() == "R[0:4] S[4:6]"
    sol = baselines.none(p, big, 1.0)
    assert sol.status == Status.FEASIBLE and sol.objective_ms == 0.0 and sol.gap == 0.0


def test_hand_written_policies_over_block_indices() -> None:
    assert baselines.every_k_blocks(6, 2) == [1, 3, 5]
    assert baselines.every_k_blocks(24, 4) == [3, 7, 11, 15, 19, 23]
    assert baselines.every_k_blocks(3, 4) == []
    with pytest.raises(ValueError):
        baselines.every_k_blocks(4, 0)
    # segments of ceil(sqrt(n)) blocks, the last one stored
    assert baselines.chen_segments(24) == [(0, 5), (5, 10), (10, 15), (15, 20)]
    assert baselines.chen_segments(12) == [(0, 4), (4, 8)]
    assert baselines.chen_segments(16) == [(0, 4), (4, 8), (8, 12)]
    assert baselines.chen_segments(2) == [] and baselines.chen_segments(0) == []
    assert baselines.policy_segments("every-layer", 3) == [(0, 1), (1, 2), (2, 3)]
    assert baselines.policy_segments("none", 3) == []


def test_policy_schedule_is_its_baseline() -> None:
    """The schedule a hand-written policy replays is the one its baseline solver scores."""
    p = blocks6()
    for name, policy in baselines.POLICIES.items():
        sol = baselines.BASELINES[policy.solver](p, 10**9, 1.0)
        assert sol.schedule == baselines.policy_schedule(name, p), name


def test_baselines_skip_stateful_nodes() -> None:
    p = Problem.chain([10] * 3 + [1], [1.0] * 4, block_of_node=[0, 0, 0, -1],
                      recomputable=[True, False, True, True])
    assert baselines.every_block(p, 10**9, 1.0).schedule.describe() == "R[0:1] S[1:2] R[2:3] S[3:4]"


def test_infeasible_result_names_minimum_budget() -> None:
    p = blocks5()
    sol = baselines.none(p, 5, 1.0)
    assert sol.status == Status.INFEASIBLE and sol.objective_ms is None
    assert sol.min_feasible_budget_bytes == memory_lower_bound(p)
    best = bruteforce.solve(p, 5, math.inf)
    assert best.status == Status.INFEASIBLE and best.min_feasible_budget_exact
    assert best.min_feasible_budget_bytes == min_feasible_budget(p)[0]


def test_bruteforce_beats_every_block_at_its_peak() -> None:
    p = blocks5()
    hf = baselines.every_block(p, 10**9, 1.0)
    best = bruteforce.solve(p, hf.peak_bytes, math.inf)
    assert best.status == Status.OPTIMAL
    assert best.objective_ms < hf.objective_ms


def test_min_feasible_budget_exact_and_bound() -> None:
    p = blocks5()
    exact, is_exact = min_feasible_budget(p)
    bound, bound_exact = min_feasible_budget(p, exact_max_nodes=0)
    assert is_exact and not bound_exact
    assert bound <= exact


def test_bruteforce_refuses_big_problems() -> None:
    with pytest.raises(ValueError, match="over its limit"):
        bruteforce.solve(Problem.chain([1] * 12, [1.0] * 12), 10**9, 1.0)


def test_chen_greedy_answers_even_without_time() -> None:
    from solvers import Problem, baselines

    problem = Problem.chain([8] * 6, [1.0] * 6)
    solution = baselines.chen_greedy(problem, 10**9, time_limit_s=0.0)
    assert solution.feasible and solution.schedule is not None
