"""Baselines and brute force on a small block chain."""

from __future__ import annotations

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
    assert baselines.every_k(2)(p, big, 1.0).schedule.describe() == "R[0:2] S[2:4] R[4:6]"
    assert baselines.chen_sqrt(p, big, 1.0).schedule.describe() == "R[0:4] S[4:6]"
    sol = baselines.none(p, big, 1.0)
    assert sol.status == Status.FEASIBLE and sol.objective_ms == 0.0 and sol.gap == 0.0


def test_baselines_skip_stateful_nodes() -> None:
    p = Problem.chain([10] * 3 + [1], [1.0] * 4, block_of_node=[0, 0, 0, -1],
                      recomputable=[True, False, True, True])
    assert baselines.every_block(p, 10**9, 1.0).schedule.describe() == "R[0:1] S[1:2] R[2:3] S[3:4]"


def test_infeasible_result_names_minimum_budget() -> None:
    p = blocks5()
    sol = baselines.none(p, 5, 1.0)
    assert sol.status == Status.INFEASIBLE and sol.objective_ms is None
    assert sol.min_feasible_budget_bytes == memory_lower_bound(p)
    best = bruteforce.solve(p, 5, 30.0)
    assert best.status == Status.INFEASIBLE and best.min_feasible_budget_exact
    assert best.min_feasible_budget_bytes == min_feasible_budget(p)[0]


def test_bruteforce_beats_every_block_at_its_peak() -> None:
    p = blocks5()
    hf = baselines.every_block(p, 10**9, 1.0)
    best = bruteforce.solve(p, hf.peak_bytes, 30.0)
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
