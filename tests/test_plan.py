"""Plan files are data a user can edit: every number in one is bounded and finite, and a
region that checkpoints another module than the one profiled is caught when it first runs."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import stat
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from planner import Plan, PlanMismatchError, apply, optimize, remove, replan, zoo
from planner.api import region_specs
from planner.plan import FileFormatError, InfeasibleBudgetError, format_bytes
from planner.runtime.emit import (
    OpStreamWarning,
    checkpointed_modules,
    install_checkpoints,
    remove_checkpoints,
)
from profiles import GraphProfile
from solvers import ModuleCall


@pytest.fixture(scope="module")
def model() -> zoo.ZooModel:
    return zoo.get("gpt", size="tiny", batch=4)  # unplanned: 6.0 MiB


@pytest.fixture(scope="module")
def plan(model: zoo.ZooModel) -> Plan:
    # module calls only: the edits below relabel which module a call's checkpoint wraps
    planned = optimize(model.model, model.example_inputs, budget_gb=4.5 / 1024,
                       loss_fn=model.loss_fn, timing="estimate", progress=False,
                       op_ranges=False)
    assert planned.checkpointing
    return planned


def _edited(tmp_path: Path, plan: Plan, edit: Callable[[dict[str, Any]], object]) -> Path:
    data = json.loads(plan.model_dump_json())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))  # inf and nan as JSON's Infinity and NaN
    return path


def _stored_node(plan: Plan) -> int:
    """A node no region recomputes: editing its time changes no number the plan checks."""
    recomputed = {i for r in plan.regions if r.mode == "recompute"
                  for i in range(r.start, r.stop)}
    return next(i for i in range(len(plan.profile.nodes)) if i not in recomputed)


def _activation(plan: Plan) -> int:
    return next(s.id for s in plan.profile.storages if s.kind == "activation")


# (the field as pydantic names it, the edit of a plan's JSON)
EDITS: list[tuple[str, Callable[[Plan], Callable[[dict[str, Any]], object]]]] = [
    ("budget_bytes", lambda p: lambda d: d.update(budget_bytes=10**400)),
    ("unplanned_peak_bytes", lambda p: lambda d: d.update(unplanned_peak_bytes=4096.0)),
    ("baseline_step_ms", lambda p: lambda d: d.update(baseline_step_ms=float("inf"))),
    ("peak_breakdown", lambda p: lambda d: d.update(peak_breakdown={"static": 10**30})),
    ("schedule.regions.0.stop", lambda p: lambda d: d["schedule"]["regions"][0].update(
        stop=float("inf"))),
    ("solver.solve_time_s", lambda p: lambda d: d["solver"].update(solve_time_s=float("nan"))),
    ("solver.gap", lambda p: lambda d: d["solver"].update(gap=float("inf"))),
    ("solver.objective_ms", lambda p: lambda d: d["solver"].update(objective_ms=float("nan"))),
    ("inputs.0.shape.0", lambda p: lambda d: d["inputs"][0].update(shape=[4.0, 64])),
    ("inputs.0.shape.0", lambda p: lambda d: d["inputs"][0].update(shape=[10**30, 10**30])),
    ("inputs.0.shape", lambda p: lambda d: d["inputs"][0].update(shape=[2**40, 2**40])),
    ("profile.nodes.{node}.fwd_time_ms", lambda p: lambda d: d["profile"]["nodes"][
        _stored_node(p)].update(fwd_time_ms=1e308)),
    ("profile.nodes.{node}.fwd_flops", lambda p: lambda d: d["profile"]["nodes"][
        _stored_node(p)].update(fwd_flops=10**40)),
    ("profile.storages.{storage}.nbytes", lambda p: lambda d: d["profile"]["storages"][
        _activation(p)].update(nbytes=10**30)),
    ("profile.static.param_bytes", lambda p: lambda d: d["profile"]["static"].update(
        param_bytes=2**70)),
    ("profile.checkpoint_costs.region_ms", lambda p: lambda d: d["profile"][
        "checkpoint_costs"].update(region_ms=float("inf"))),
    ("profile.step.fwd_scale", lambda p: lambda d: d["profile"].update(step={
        "fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_scale": float("inf"), "bwd_scale": 1.0})),
    ("profile.nodes.0.outputs.0.shape.0", lambda p: lambda d: d["profile"]["nodes"][0][
        "outputs"][0].update(shape=[10**30])),
]


@pytest.mark.parametrize("case", range(len(EDITS)), ids=[f"{k}-{field}" for k, (field, _)
                                                         in enumerate(EDITS)])
def test_numbers_out_of_bounds_are_refused_naming_the_field(plan: Plan, tmp_path: Path,
                                                            case: int) -> None:
    field, edit = EDITS[case]
    assert Plan.load(_edited(tmp_path, plan, lambda data: None)) == plan
    path = _edited(tmp_path, plan, edit(plan))
    named = field.format(node=_stored_node(plan), storage=_activation(plan))
    with pytest.raises(ValueError, match=re.escape(named)):
        Plan.load(path)


def _checkpoint_another_module(plan: Plan, other: str) -> Callable[[dict[str, Any]], None]:
    """The first checkpointed call relabelled as ``other`` (and ``other``'s call as it):
    the plan stays consistent with itself, but its region now wraps another module."""
    region = next(r for r in plan.schedule.recompute_regions()
                  if isinstance(r.target, ModuleCall) and not r.keep)
    path = region.target.path

    def edit(data: dict[str, Any]) -> None:
        calls = data["profile"]["module_calls"]
        mine = next(c for c in calls if (c["start"], c["stop"]) == (region.start, region.stop))
        theirs = next(c for c in calls if c["path"] == other)
        mine["path"], theirs["path"] = other, mine["path"]
        def relabel(regions: list[dict[str, Any]]) -> None:
            for r in regions:
                if r.get("target") and r["target"] == {"kind": "module", "path": path}:
                    r["target"]["path"] = other
                relabel(r["children"])

        relabel(data["schedule"]["regions"])

    return edit


def _step(model: zoo.ZooModel) -> None:
    torch.manual_seed(0)
    model.loss_fn(model.model(*model.example_inputs)).backward()
    model.model.zero_grad(set_to_none=True)


def test_a_region_on_another_module_is_caught_on_the_first_step(
        model: zoo.ZooModel, plan: Plan, tmp_path: Path) -> None:
    edited = Plan.load(_edited(tmp_path, plan, _checkpoint_another_module(plan, "ln_f")))
    try:
        apply(model.model, plan, strict=True)  # the modules profiled: nothing to say
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _step(model)
        apply(model.model, edited)
        with pytest.warns(OpStreamWarning, match="'ln_f'"):
            _step(model)
        with warnings.catch_warnings():  # checked once: later steps pay nothing
            warnings.simplefilter("error")
            _step(model)
        apply(model.model, edited, strict=True)
        with pytest.raises(PlanMismatchError, match="'ln_f'"):
            _step(model)
    finally:
        remove(model.model)


def test_the_op_stream_is_compared_in_the_step_planned(model: zoo.ZooModel,
                                                       plan: Plan) -> None:
    """A step under another precision runs other casts (the plan's guard reports it), an
    eval() forward runs no dropout: neither is the training step planned, so the op-stream
    check waits for one instead of warning once per checkpointed module."""
    specs = [replace(spec, autocast_dtype=plan.autocast_dtype) for spec in region_specs(plan)]
    install_checkpoints(model.model, specs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _step(model)
            model.model.eval()
            try:
                _step(model)
            finally:
                model.model.train()
            assert not any(w.checked for w in checkpointed_modules(model.model).values())
            _step(model)  # the step planned: compared, and equal
        assert all(w.checked for w in checkpointed_modules(model.model).values())
    finally:
        remove_checkpoints(model.model)


@contextmanager
def _disk_full_after(nbytes: int) -> Iterator[None]:
    """Writes past ``nbytes`` of any file fail part-way (EFBIG), as on a full disk."""
    resource = pytest.importorskip("resource")
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("what", ["plan", "profile"])
def test_a_save_that_fails_part_way_leaves_the_old_file(plan: Plan, tmp_path: Path,
                                                        what: str) -> None:
    saved = plan if what == "plan" else plan.profile
    path = tmp_path / f"{what}.json"
    saved.save(path)
    before = path.read_bytes()
    with _disk_full_after(len(before) // 2), pytest.raises(OSError) as caught:
        saved.save(path)
    assert path.read_bytes() == before  # the old file, whole
    assert os.listdir(tmp_path) == [path.name]  # and no temporary file beside it
    assert str(path) in str(caught.value)  # the error names the file, not the temporary one


def test_saving_follows_links_and_keeps_permissions(plan: Plan, tmp_path: Path) -> None:
    target, link = tmp_path / "plan.json", tmp_path / "link.json"
    target.write_text("old")
    target.chmod(0o640)
    link.symlink_to(target)
    plan.save(link)
    assert link.is_symlink() and Plan.load(link) == plan
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    plan.save(os.devnull)  # not a regular file: written in place, not replaced
    assert sorted(os.listdir(tmp_path)) == ["link.json", "plan.json"]


# (what the file holds, what the error says besides the file's name)
BAD_FILES: list[tuple[str, Callable[[Plan], bytes], str]] = [
    ("binary", lambda p: bytes(range(256)), "not UTF-8"),
    ("truncated", lambda p: p.model_dump_json(indent=1)[:5000].encode(), "truncated"),
    ("empty", lambda p: b"", "the file is empty"),
    ("another JSON", lambda p: b'{"hello": 1}', "hello"),
    ("a list", lambda p: b"[1, 2]", "not an object"),
    ("a profile", lambda p: p.profile.model_dump_json().encode(), "looks like a profile"),
    ("an old version", lambda p: json.dumps({**json.loads(p.model_dump_json()),
                                             "schema_version": 2}).encode(), "schema_version"),
    ("a field out of bounds", lambda p: json.dumps({**json.loads(p.model_dump_json()),
                                                    "budget_bytes": -1}).encode(),
     "budget_bytes: Input should be greater than or equal to 0 (got -1)"),
    ("a checkpoint the profile did not run", lambda p: _retargeted(p), "schedule: checkpoint"),
    ("no schema_version", lambda p: json.dumps({k: v for k, v in json.loads(
        p.model_dump_json()).items() if k != "schema_version"}).encode(), "no schema_version"),
    ("a budget below its own peak", lambda p: json.dumps({**json.loads(p.model_dump_json()),
                                                         "budget_bytes": 0}).encode(),
     "budget_bytes: 0 B is below the plan's own predicted peak"),
    ("a budget halved", lambda p: json.dumps({**json.loads(p.model_dump_json()),
                                             "budget_bytes": p.budget_bytes // 2}).encode(),
     "is below the plan's own predicted peak"),
]


def _retargeted(plan: Plan) -> bytes:
    """The plan's first checkpoint aimed at a module the profile never called."""
    data = json.loads(plan.model_dump_json())
    region = next(r for r in data["schedule"]["regions"] if r["mode"] == "recompute")
    region["target"]["path"] = "no.such.module"
    return json.dumps(data).encode()


@pytest.mark.parametrize("case", range(len(BAD_FILES)), ids=[c[0] for c in BAD_FILES])
def test_a_file_that_is_not_a_plan_is_one_error_naming_the_file_and_field(
        plan: Plan, tmp_path: Path, case: int) -> None:
    _, content, says = BAD_FILES[case]
    path = tmp_path / "plan.json"
    path.write_bytes(content(plan))
    with pytest.raises(FileFormatError) as caught:
        Plan.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and says in message, message
    assert "\n" not in message, message


def test_a_profile_file_that_is_not_one_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(FileFormatError, match=re.escape(f"{path}: not a profile file")):
        GraphProfile.load(path)
    path.write_text('{"nodes": []}')
    with pytest.raises(FileFormatError, match=re.escape(f"{path}: not a profile file")):
        GraphProfile.load(path)


def test_a_plan_allowed_to_offload_says_why_it_offloads_nothing(plan: Plan,
                                                                tmp_path: Path) -> None:
    assert not plan.offloads and plan.checkpointing
    assert "offload:" not in plan.summary()  # not allowed: no offload line
    allowed = plan.model_copy(update={"host_budget_bytes": 2**30})
    assert ("offload: allowed (host budget 1.000 GiB), but no call is offloaded"
            in allowed.summary()), allowed.summary()
    allowed.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == allowed
    # files from before the field load as plans that were not allowed to offload
    data = json.loads(plan.model_dump_json())
    del data["host_budget_bytes"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "old.json") == plan


def test_the_summary_says_what_to_try_next_in_the_simulators_numbers(
        plan: Plan, model: zoo.ZooModel) -> None:
    """A tight plan names the budget that needs no recompute, how low every block
    checkpointed and any schedule go, and offload; a loose one the budget left unused."""
    from solvers.baselines import policy_schedule
    from solvers.bounds import memory_lower_bound
    from solvers.simulate import simulate

    problem = plan.problem()
    every = simulate(problem, policy_schedule("every-layer", problem)).peak_bytes
    line = next(x for x in plan.summary().splitlines() if x.strip().startswith("next:"))
    assert format_bytes(plan.unplanned_peak_bytes) in line
    assert format_bytes(memory_lower_bound(problem)) in line
    assert (format_bytes(every) in line) == (every < plan.predicted_peak_bytes)
    assert "offload=True" in line  # an H100 has a host link
    loose = replan(plan, budget_bytes=plan.unplanned_peak_bytes + 2**20)
    spare = format_bytes(loose.budget_bytes - loose.unplanned_peak_bytes)
    assert f"next: {spare} of the budget is unused" in loose.summary()


def test_a_plan_file_checkpointing_both_calls_of_one_module_is_refused_by_name(
        tmp_path: Path) -> None:
    """One forward runs both calls of a module used twice: it carries one checkpoint, so a
    plan (an edited file) that checkpoints both is refused on load, naming the module."""
    from planner.api import plan_for_schedule, structure_fingerprint
    from planner.arguments import _input_specs
    from profiles import profile
    from solvers import Schedule

    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh())
    x = torch.randn(64, 32)
    prof = profile(model, (x,), loss_fn=lambda o: o.square().mean(), timing="estimate",
                   progress=False)
    calls = [(c.start, c.stop) for c in prof.module_calls if c.path == "0"]
    assert len(calls) == 2
    plan = plan_for_schedule(prof, Schedule.from_segments(len(prof.nodes), calls),
                             _input_specs((x,), {}), structure_fingerprint(model))
    path = tmp_path / "plan.json"
    plan.save(path)
    with pytest.raises(ValueError, match="module '0' is checkpointed by checkpoint 0 too"):
        Plan.load(path)


def test_a_search_stopped_by_its_limit_says_what_a_longer_limit_could_buy(
        plan: Plan, tmp_path: Path) -> None:
    """No silent cliff at the time limit: a plan whose search the limit stopped short of a
    proof says so, and how much a longer limit could save at most (its proven gap); a
    search that ended by itself says nothing of the limit."""
    def solved(**update: object) -> Plan:
        base = dict(status="feasible", objective_ms=2.0, bound_ms=1.5, gap=0.25,
                    space="module calls", solve_time_s=59.5, time_limit_s=60.0)
        return plan.model_copy(update={"solver": plan.solver.model_copy(
            update={**base, **update})})

    stopped = solved()
    # the space in one short line: the field that states it
    assert ("feasible, within 25.00 % of the optimum over its search space "
            "(plan.solver.space)") in stopped.summary()
    assert ("the search stopped at its 60 s limit: a longer time_limit_s can save at most "
            "0.5 ms more recompute (the proven gap)") in stopped.summary(), stopped.summary()
    unbounded = solved(gap=None, bound_ms=None, space="").summary()
    assert "stopped at its 60 s limit with no proven bound" in unbounded
    for ended in (solved(solve_time_s=1.0), solved(status="optimal", gap=0.0, bound_ms=2.0)):
        assert "limit" not in ended.summary(), ended.summary()
    stopped.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == stopped
    data = json.loads(plan.model_dump_json())  # files from before the field still load
    del data["solver"]["time_limit_s"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "old.json").solver.time_limit_s is None


def test_an_edited_plan_is_refused_by_apply_before_anything_is_installed(
        plan: Plan, model: zoo.ZooModel) -> None:
    lowered = plan.model_copy(update={"budget_bytes": plan.predicted_peak_bytes - 1})
    with pytest.raises(PlanMismatchError, match="below the plan's own predicted peak"):
        apply(model.model, lowered)
    assert not checkpointed_modules(model.model)


def _one_layer() -> zoo.ZooModel:
    """A model without repeated blocks: no "every block" to compare a plan with."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                        nn.Linear(256, 4))
    x = torch.randn(64, 32)
    return zoo.ZooModel("one layer", net, (x,), lambda out: out.pow(2).mean())


def test_the_summary_of_a_model_without_repeated_blocks_says_what_it_can(
        caplog: pytest.LogCaptureFixture) -> None:
    one = _one_layer()
    options = dict(loss_fn=one.loss_fn, timing="estimate", progress=False)
    with pytest.raises(InfeasibleBudgetError) as lowest:
        optimize(one.model, one.example_inputs, budget_gb=2**-20, **options)
    unplanned = lowest.value.plan.unplanned_peak_bytes
    plan = optimize(one.model, one.example_inputs, **options,
                    budget_gb=(lowest.value.min_budget_bytes + unplanned) / 2 / 2**30)
    assert plan.checkpointing and not plan.problem().blocks()
    line = next(x for x in plan.summary().splitlines() if x.strip().startswith("next:"))
    assert "every block" not in line and format_bytes(plan.unplanned_peak_bytes) in line
    log = logging.getLogger("planner.test")
    with caplog.at_level(logging.INFO, logger="planner.test"):
        plan.log_summary(log)
    assert "Plan for" in caplog.text


def test_a_report_that_fails_is_a_warning_never_an_error(
        plan: Plan, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    log = logging.getLogger("planner.test")

    def broken(self: Plan) -> str:
        raise RuntimeError("broken report")

    monkeypatch.setattr(Plan, "summary", broken)
    with caplog.at_level(logging.WARNING, logger="planner.test"):
        plan.log_summary(log)  # INFO off: the summary is not even made
    assert not caplog.text
    with caplog.at_level(logging.INFO, logger="planner.test"):
        plan.log_summary(log)
    assert "could not summarize the plan" in caplog.text and "broken report" in caplog.text
