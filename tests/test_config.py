"""planner.config: every option of planning declared once, used by the API, the command
line and the trainer switches."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import planner
from planner import zoo
from planner.__main__ import build_parser
from planner.config import SEARCH, PlanConfig, cli_flags

FIELDS = [f.name for f in dataclasses.fields(PlanConfig)]


def test_the_apis_options_are_the_configs_fields() -> None:
    """optimize shows every field as a keyword with its default; profile_model and solve
    those of their groups; nothing is declared beside them."""
    shown = inspect.signature(planner.optimize).parameters
    for f in dataclasses.fields(PlanConfig):
        assert shown[f.name].default == f.default, f.name
    assert set(shown) == {"model", "example_inputs", "budget_gb", "config", *FIELDS}
    searched = {f.name for f in dataclasses.fields(PlanConfig)
                if f.metadata["option"].group == SEARCH}
    assert set(inspect.signature(planner.solve).parameters) == {
        "profiled", "budget_gb", "budget_bytes", "config", *searched}
    assert set(inspect.signature(planner.profile_model).parameters) == {
        "model", "example_inputs", "config", "bound_routing", *(set(FIELDS) - searched
                                                                - {"pipeline", "envelope",
                                                                   "compiled",
                                                                   "compile_garbage_collected"})}


def test_an_unknown_option_is_refused_naming_the_one_meant() -> None:
    zm = zoo.get("mlp", batch=2)
    with pytest.raises(TypeError, match=r"unexpected option time_limit=; did you mean "
                                        r"time_limit_s=\?"):
        planner.optimize(zm.model, zm.example_inputs, budget_gb=1, time_limit=5)
    with pytest.raises(TypeError, match=r"profile_model\(\) does not take solver= \(the "
                                        r"search\): optimize\(\) or solve\(\)/replan\(\)"):
        planner.profile_model(zm.model, zm.example_inputs, solver="dp")
    with pytest.raises(TypeError, match=r"does not take envelope= \(batches\): optimize\(\) "
                                        r"takes it"):
        planner.profile_model(zm.model, zm.example_inputs, envelope={"max_length": 8})
    with pytest.raises(TypeError, match=r"takes config=planner\.PlanConfig"):
        planner.optimize(zm.model, zm.example_inputs, budget_gb=1, config={"solver": "dp"})


def test_a_config_is_checked_when_it_is_made() -> None:
    with pytest.raises(ValueError, match="unknown solver 'nope'"):
        PlanConfig(solver="nope")
    with pytest.raises(ValueError, match="time_limit_s must be a positive number"):
        PlanConfig(time_limit_s=0)
    with pytest.raises(ValueError, match="host_budget_gb is given but offload is False"):
        PlanConfig(host_budget_gb=4)
    with pytest.raises(ValueError, match=r"timing must be one of \['auto', 'measure'"):
        PlanConfig(timing="measured")
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        PlanConfig(deterministic="yes")
    with pytest.raises(ValueError, match="world_size must be a whole number"):
        PlanConfig(world_size=0)
    assert PlanConfig(envelope={"max_length": 64}).envelope == planner.Envelope(max_length=64)


def test_a_config_plans_as_its_keywords_do_and_keywords_override_it() -> None:
    zm = zoo.get("gpt", size="tiny", batch=2)
    config = PlanConfig(loss_fn=zm.loss_fn, timing="estimate", solver="dp", progress=False,
                        deterministic=True)
    step = planner.profile_model(zm.model, zm.example_inputs, config=config)
    static = step.profile.static.total_bytes
    budget_gb = (static + (step.unplanned_peak_bytes - static) // 2) / 2**30
    by_config = planner.optimize(zm.model, zm.example_inputs, budget_gb=budget_gb,
                                 config=config)
    by_keywords = planner.optimize(zm.model, zm.example_inputs, budget_gb=budget_gb,
                                   loss_fn=zm.loss_fn, timing="estimate", solver="dp",
                                   deterministic=True, progress=False)
    assert by_config.checkpointing and by_config.schedule == by_keywords.schedule
    assert by_config.solver.name == "dp"
    assert planner.optimize(zm.model, zm.example_inputs, budget_gb=budget_gb, config=config,
                            solver="cpsat").solver.name == "cpsat"


def test_the_command_lines_flags_are_the_configs() -> None:
    """Each field with a flag is on `optimize`'s command line, with the field's help."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    optimize = sub.choices["optimize"]
    flags = {a.dest: a for a in optimize._actions}
    for f in dataclasses.fields(PlanConfig):
        meta = f.metadata["option"]
        if meta.flag is not None:
            assert flags[f.name].option_strings == [meta.flag]
            assert flags[f.name].help.startswith(meta.help)
    parser = build_parser()
    args = parser.parse_args(["optimize", "--model", "mlp", "--budget-gb", "1",
                              "--time-limit", "5", "--deterministic"])
    assert (args.time_limit_s, args.deterministic, args.timing) == (5.0, True, "estimate")
    with pytest.raises(Exception, match="unknown solver"):
        PlanConfig(solver=parser.parse_args(["optimize", "--model", "mlp", "--budget-gb", "1",
                                             "--solver", "nope"]).solver)
    assert cli_flags.__doc__


def test_a_switch_says_a_wrong_option_when_it_is_made() -> None:
    """Before, options went through to optimize() and were said when training started."""
    hf = pytest.importorskip("planner.switches.hf_trainer")
    with pytest.raises(ValueError, match="unknown solver 'nope'"):
        hf.PlannedCheckpointing(budget_gb=1.0, solver="nope")
    with pytest.raises(TypeError, match="did you mean time_limit_s="):
        hf.PlannedCheckpointing(budget_gb=1.0, time_limit=5)
    with pytest.raises(TypeError, match=r"takes \['autocast'\] from the Trainer"):
        hf.PlannedCheckpointing(budget_gb=1.0, config=PlanConfig(autocast=torch.bfloat16))
    made = hf.PlannedCheckpointing(budget_gb=1.0, config=PlanConfig(solver="dp"),
                                   time_limit_s=5)
    assert (made.config.solver, made.config.time_limit_s, made.config.progress) == \
        ("dp", 5, False)
