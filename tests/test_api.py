"""optimize / apply / verify on the zoo: budgets honoured, predictions measured, errors clear."""

from __future__ import annotations

import json
import math
import sys
import warnings

import pytest
import torch
from torch import nn

import profiles
from planner import (
    InfeasibleBudgetError,
    Plan,
    PlanMismatchError,
    ProfileError,
    apply,
    optimize,
    remove,
    verify,
    zoo,
)
from planner.api import (
    PlanMismatchWarning,
    plan_for_profile,
    profile_model,
    solve,
    structure_fingerprint,
)
from planner.arguments import SolveOptions, _input_specs
from planner.solution_memo import ANSWERS
from profiles.inputs import normalize_inputs
from solvers import Solution, Status

GIB = 2**30


def _profile(model: zoo.ZooModel) -> tuple[profiles.GraphProfile, list, str]:
    prof = profiles.profile(model.model, model.example_inputs, loss_fn=model.loss_fn,
                            timing="estimate", progress=False)
    return (prof, _input_specs(*normalize_inputs(model.model, model.example_inputs)),
            structure_fingerprint(model.model))


# each zoo model's profile (`ZOO_CASES`, estimated times: the same every run), made once
# for its three budgets; each budget's plan then runs on a fresh instance of the model
_ZOO_PROFILES: dict[str, tuple[profiles.GraphProfile, list, str]] = {}


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.8])
def test_plans_honour_budgets_measured_on_cpu(zoo_model: zoo.ZooModel, fraction: float
                                              ) -> None:
    if zoo_model.name == "mlp" and fraction == 0.3:
        pytest.skip("the MLP's least plannable peak is above 50 %: 30 % plans what 50 % does")
    if zoo_model.name not in _ZOO_PROFILES:
        _ZOO_PROFILES[zoo_model.name] = _profile(zoo_model)
    prof, inputs, structure = _ZOO_PROFILES[zoo_model.name]
    unplanned = plan_for_profile(prof, inputs, structure, SolveOptions(2**62)).unplanned_peak_bytes
    static = prof.static.total_bytes
    budget = int(static + fraction * (unplanned - static))
    try:
        plan = plan_for_profile(prof, inputs, structure, SolveOptions(budget, time_limit_s=5))
    except InfeasibleBudgetError as error:
        # the named minimum is a budget that yields a plan, which then holds (below)
        assert error.min_budget_bytes > budget
        plan = plan_for_profile(prof, inputs, structure,
                                SolveOptions(error.min_budget_bytes, time_limit_s=5))
        assert plan.predicted_peak_bytes <= error.min_budget_bytes
    report = verify(zoo_model.model, plan, zoo_model.example_inputs, zoo_model.loss_fn,
                    repeats=1)
    assert report.within_budget, report.summary()
    assert -0.001 <= report.peak_error <= 0.005, report.summary()
    assert report.losses_equal and report.grads_equal, report.summary()
    assert plan.predicted_peak_bytes <= plan.budget_bytes < unplanned


def test_optimize_apply_round_trip_and_batchnorm_state(tmp_path: object) -> None:
    model = zoo.get("resnet", batch=16)
    first = optimize(model.model, model.example_inputs, budget_gb=1e3, loss_fn=model.loss_fn,
                     progress=False, deterministic=True)
    assert not first.checkpointing and "No checkpointing needed" in first.note
    static = first.profile.static.total_bytes
    budget = static + 0.7 * (first.unplanned_peak_bytes - static)
    plan = optimize(model.model, model.example_inputs, budget_gb=budget / GIB,
                    loss_fn=model.loss_fn, timing="estimate", progress=False,
                    deterministic=True)
    assert plan.checkpointing and plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.solver.space  # says what it is optimal over
    path = f"{tmp_path}/plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    params = list(model.model.parameters())
    planned = apply(model.model, again)
    assert planned is model.model and list(planned.parameters()) == params
    # one step of each from the same state: BatchNorm statistics end up identical
    state = {k: v.clone() for k, v in model.model.state_dict().items()}
    x, = model.example_inputs
    model.loss_fn(planned(x)).backward()
    after_planned = {k: v.clone() for k, v in model.model.state_dict().items()}
    remove(model.model)
    model.model.load_state_dict(state)
    model.loss_fn(model.model(x)).backward()
    assert all(torch.equal(after_planned[k], v) for k, v in model.model.state_dict().items())
    assert "recompute" in again.summary() and "<table>" in again._repr_html_()


def test_budget_below_minimum_names_a_minimum_that_works() -> None:
    model = zoo.get("gpt", size="tiny")
    with pytest.raises(InfeasibleBudgetError, match=r"lowest peak found is [\d.]+ MiB") as info:
        optimize(model.model, model.example_inputs, budget_gb=1e-4, loss_fn=model.loss_fn,
                 progress=False, time_limit_s=10, deterministic=True)
    error = info.value
    assert error.min_budget_bytes > 1e-4 * GIB
    assert error.lower_bound_bytes is None or error.lower_bound_bytes <= error.min_budget_bytes
    plan = optimize(model.model, model.example_inputs, budget_gb=error.min_budget_gb,
                    loss_fn=model.loss_fn, progress=False, deterministic=True)
    assert plan.predicted_peak_bytes <= error.min_budget_bytes
    report = verify(model.model, plan, model.example_inputs, model.loss_fn, repeats=1)
    assert report.within_budget, report.summary()


def test_a_search_its_time_limit_stopped_says_so_and_proves_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A solver stopped by its time limit before it found a plan within the budget: the
    error says the search stopped and how to search longer, and claims no proof from it;
    where the lowest-peak search then meets the budget, that is the plan."""
    import planner.solving as solving

    zm = zoo.get("gpt", size="tiny")
    prof, inputs, structure = _profile(zm)

    def stopped(problem: object, budget_bytes: int, limit_s: float) -> Solution:
        return Solution(solver="auto", status=Status.TIMED_OUT, schedule=None,
                        budget_bytes=budget_bytes, objective_ms=None)

    monkeypatch.setitem(solving.SOLVERS, "auto", stopped)
    with pytest.raises(InfeasibleBudgetError) as caught:
        plan_for_profile(prof, inputs, structure,
                         SolveOptions(prof.static.total_bytes + 1, time_limit_s=5,
                                      deterministic=True))
    message, shell = str(caught.value), caught.value.shell_message
    assert "stopped at its time limit (5 s)" in message and "time_limit_s" in message
    assert "a longer one (--time-limit)" in shell
    ANSWERS.clear()
    plan = plan_for_profile(prof, inputs, structure,
                            SolveOptions(caught.value.min_budget_bytes, time_limit_s=5,
                                         deterministic=True))
    assert plan.schedule == caught.value.plan.schedule
    assert plan.solver.status == "feasible"  # the lowest-peak search's: nothing proven


def test_the_named_minimum_returns_the_errors_plan_when_a_new_search_misses_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The error promises that its minimum returns its plan: a search at that budget that
    its time limit stops before it finds one as low (CI, the zoo GPT at 30 %: named
    2.65 MiB, then found only 2.72) gives the error's plan; one that finds a plan keeps
    its own answer (and its proof)."""
    import planner.solving as solving

    zm = zoo.get("gpt", size="tiny")
    prof, inputs, structure = _profile(zm)
    with pytest.raises(InfeasibleBudgetError) as caught:
        plan_for_profile(prof, inputs, structure,
                         SolveOptions(prof.static.total_bytes + 1, time_limit_s=5,
                                      deterministic=True))
    named = caught.value.min_budget_bytes
    searched = solving._searched

    def finds_nothing_as_low(*args: object, **kwargs: object) -> tuple[Solution, bool]:
        found, _ = searched(*args, **kwargs)
        return found.model_copy(update={"status": Status.INFEASIBLE,
                                        "peak_bytes": named + 1}), True

    monkeypatch.setattr(solving, "_searched", finds_nothing_as_low)
    plan = plan_for_profile(prof, inputs, structure,
                            SolveOptions(named, time_limit_s=5, deterministic=True))
    assert plan.schedule == caught.value.plan.schedule
    assert plan.predicted_peak_bytes == named == plan.budget_bytes
    assert plan.solver.status == "feasible"
    ANSWERS.clear()  # no answer given yet: a search that meets the budget keeps its own
    with pytest.raises(InfeasibleBudgetError):
        plan_for_profile(prof, inputs, structure,
                         SolveOptions(prof.static.total_bytes + 1, time_limit_s=5,
                                      deterministic=True))

    def proves_one(*args: object, **kwargs: object) -> tuple[Solution, bool]:
        return Solution(solver="fresh", status=Status.OPTIMAL, schedule=plan.schedule,
                        budget_bytes=named, objective_ms=1.0, bound_ms=1.0, gap=0.0,
                        peak_bytes=named), False

    monkeypatch.setattr(solving, "_searched", proves_one)
    again = plan_for_profile(prof, inputs, structure,
                             SolveOptions(named, time_limit_s=5, deterministic=True))
    assert (again.solver.name, again.solver.status) == ("fresh", "optimal")


def test_a_search_that_took_the_whole_limit_leaves_the_lowest_peak_its_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The minimum an infeasible budget's error names comes from a search of its own: when
    the search at the budget used the whole limit, it still gets a quarter of it (with what
    was left, Inception-v3's named 200.4 MiB where 5 s find 187.2)."""
    import planner.solving as solving

    zm = zoo.get("gpt", size="tiny")
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, progress=False)
    clock = [0.0]
    monkeypatch.setattr(solving, "perf_counter", lambda: clock[0])

    def search_to_the_limit(problem: object, options: object, limit_s: float) -> Solution:
        clock[0] += limit_s
        return Solution(solver="auto", status=Status.INFEASIBLE, schedule=None,
                        budget_bytes=options.budget_bytes, objective_ms=None)

    given: list[float] = []
    real = solving.lowest_peak
    monkeypatch.setattr(solving, "_solve", search_to_the_limit)
    monkeypatch.setattr(solving, "lowest_peak",
                        lambda problem, limit_s, **kwargs: given.append(limit_s)
                        or real(problem, limit_s, **kwargs))
    with pytest.raises(InfeasibleBudgetError):
        solve(step, budget_bytes=step.profile.static.total_bytes + 1, time_limit_s=20)
    assert given == [pytest.approx(5.0)]


@pytest.mark.parametrize("budget", [math.nan, math.inf, -1.0, 0, "8", True, None])
def test_bad_budgets_are_refused_clearly(budget: object) -> None:
    model = zoo.get("mlp", depth=1)
    with pytest.raises((TypeError, ValueError), match="budget_gb"):
        optimize(model.model, model.example_inputs, budget_gb=budget,  # type: ignore[arg-type]
                 loss_fn=model.loss_fn, progress=False)


def test_a_model_that_cannot_run_raises_profile_error() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.view(3, 5))

    with pytest.raises(ProfileError, match="example_inputs"):
        optimize(Broken(), torch.randn(2, 4), budget_gb=1, loss_fn=lambda y: y.sum(),
                 progress=False)


def test_plan_for_another_model_is_refused_and_larger_inputs_warn() -> None:
    model = zoo.get("mlp", batch=8)
    plan = optimize(model.model, model.example_inputs, budget_gb=1, loss_fn=model.loss_fn,
                    progress=False)
    with pytest.raises(PlanMismatchError, match="optimize"):
        apply(zoo.get("mlp", batch=8, width=128).model, plan)
    apply(model.model, plan)
    x, = model.example_inputs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.model(x[:4]).sum().backward()  # smaller: within what is planned
    with pytest.warns(PlanMismatchWarning, match="larger than the planned"):
        model.model(torch.cat([x, x]))
    with pytest.warns(PlanMismatchWarning, match="autocast"), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model.model(x)
    apply(model.model, plan, strict=True)
    with pytest.raises(PlanMismatchError, match="larger than the planned"):
        model.model(torch.cat([x, x]))
    with torch.no_grad():  # inference is not planned: no complaint
        model.model(torch.cat([x, x]))
    remove(model.model)


def _edited(tmp_path: object, plan: Plan, edit) -> str:
    data = json.loads(plan.model_dump_json())
    edit(data)
    path = f"{tmp_path}/edited.json"
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def test_corrupt_or_edited_plan_files_name_the_field(tmp_path: object) -> None:
    model = zoo.get("gpt", size="tiny", batch=4)  # unplanned: 6.0 MiB
    plan = optimize(model.model, model.example_inputs, budget_gb=4.5 / 1024,
                    loss_fn=model.loss_fn, progress=False)
    assert plan.checkpointing
    path = f"{tmp_path}/plan.json"
    plan.save(path)
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"plan\.json"):
        Plan.load(path)
    recompute = next(i for i, r in enumerate(plan.schedule.regions) if r.is_recompute)

    def region(data: dict, k: int = recompute) -> dict:
        return data["schedule"]["regions"][k]

    edits = {
        "budget_bytes": lambda d: d.update(budget_bytes="lots"),
        "mode": lambda d: region(d, 0).update(mode="sometimes"),
        "dtype": lambda d: d["inputs"][0].update(dtype="float33"),
        "shape": lambda d: d["inputs"][0].update(shape=[-1, 4]),
        "saves": lambda d: region(d).update(saves={str(region(d)["start"]): "discard"}),
        "saved node": lambda d: region(d).update(saves={"100000": "keep"}),
        "target": lambda d: region(d)["target"].update(path="no.such.module"),
        "STORE region": lambda d: region(d).update(mode="store"),
        # the numbers are derived from the schedule: a file cannot state its own
        "predicted_peak_bytes": lambda d: d.update(predicted_peak_bytes=1),
    }
    for field, edit in edits.items():
        with pytest.raises(ValueError, match=field):
            Plan.load(_edited(tmp_path, plan, edit))


def test_missing_loss_is_a_clear_error() -> None:
    model = zoo.get("mlp")
    with pytest.raises(ValueError, match="loss_fn"):
        optimize(model.model, model.example_inputs, budget_gb=1, progress=False)


def test_an_empty_batch_is_refused_before_profiling() -> None:
    model = zoo.get("mlp", batch=8)
    with pytest.raises(ValueError, match=r"input has shape \[0, 64\], with no elements"):
        optimize(model.model, torch.zeros(0, 64), budget_gb=1, loss_fn=model.loss_fn,
                 progress=False)


def test_optimize_replays_the_unplanned_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The solvers and the plan score the unplanned step from one replay (on a 70B profile
    each replay takes seconds), traced op ranges and all; also where the plan is copied to
    carry the profile's notes (estimated for an H100 on CPU tensors: a note says so)."""
    zm = zoo.get("gpt", size="small", batch=2)
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate")
    budget = (step.profile.static.total_bytes + step.unplanned_peak_bytes) // 2
    replay = sys.modules["solvers.simulate"]
    unplanned: list[str] = []
    original = replay._replayed

    def counting(problem: object, schedule: object) -> object:
        if not schedule.recompute_regions() and not schedule.offloads:
            unplanned.append(problem.name)
        return original(problem, schedule)

    monkeypatch.setattr(replay, "_replayed", counting)
    plan = optimize(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                    budget_gb=budget / GIB, time_limit_s=5)
    assert plan.schedule.recompute_regions() and plan.unplanned_peak_bytes > budget
    assert len(unplanned) == 1


def _alternating_solver(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The auto solver made to answer every other call with another feasible schedule
    (every block checkpointed), as a search stopped by its time limit, or choosing among
    ties, may; returns the budgets it was called with."""
    import planner.solving as solving
    from solvers import baselines

    calls: list[int] = []
    real = solving.SOLVERS["auto"]

    def alternating(problem: object, budget_bytes: int, limit_s: float) -> Solution:
        calls.append(budget_bytes)
        if len(calls) % 2 == 0:
            return baselines.every_block(problem, budget_bytes)
        return real(problem, budget_bytes, limit_s)

    monkeypatch.setitem(solving.SOLVERS, "auto", alternating)
    return calls


def test_identical_calls_get_identical_plans_without_a_second_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning the same step twice at the same budget and options gives the same plan,
    though the search would answer otherwise the second time; another budget or a longer
    time limit searches anew."""
    zm = zoo.get("gpt", size="tiny")
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                         progress=False)
    budget = (step.profile.static.total_bytes + step.unplanned_peak_bytes) // 2
    calls = _alternating_solver(monkeypatch)
    first = solve(step, budget_bytes=budget, time_limit_s=5, deterministic=True)
    again = optimize(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, budget_gb=budget / GIB,
                     timing="estimate", time_limit_s=5, deterministic=True,
                     progress=False)  # profiled again
    assert again.schedule == first.schedule and again.solver == first.solver
    assert calls == [budget]
    solve(step, budget_bytes=budget + 1, time_limit_s=5, deterministic=True)
    solve(step, budget_bytes=budget, time_limit_s=6, deterministic=True)
    assert calls == [budget, budget + 1, budget]


def test_a_deterministic_plan_is_the_same_on_a_loaded_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """deterministic=True: the plan, its status and its bound do not depend on the clock (a
    machine so loaded that a second passes at every read of it); the search that counts
    seconds finds nothing there, and its error says why."""
    import itertools
    import time

    import planner.solving as solving

    zm = zoo.get("gpt", size="tiny")
    step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn, timing="estimate",
                         progress=False)
    static = step.profile.static.total_bytes
    budget = static + (_unplanned(step) - static) * 2 // 5
    quiet = solve(step, budget_bytes=budget, time_limit_s=5, deterministic=True)
    ANSWERS.clear()
    seconds = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(seconds)))
    monkeypatch.setattr(solving, "perf_counter", time.perf_counter)
    loaded = solve(step, budget_bytes=budget, time_limit_s=5, deterministic=True)
    assert loaded.schedule == quiet.schedule
    assert (loaded.solver.status, loaded.solver.bound_ms) == (quiet.solver.status,
                                                             quiet.solver.bound_ms)
    ANSWERS.clear()  # counting seconds, the search stops before it finds a plan
    with pytest.raises(InfeasibleBudgetError, match="stopped at its time limit") as caught:
        solve(step, budget_bytes=budget, time_limit_s=5)
    # and names the search that does not count them
    assert "deterministic=True" in str(caught.value)
    assert "--deterministic" in caught.value.shell_message


def _unplanned(step: object) -> int:
    from solvers import Schedule, simulate

    problem = step.problem()
    return simulate(problem, Schedule.store_all(problem.n_nodes)).peak_bytes
