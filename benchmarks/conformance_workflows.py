"""Conformance in every workflow: the conformance cases trained the way users train them.

    python benchmarks/conformance_workflows.py                   # every case, every workflow
    python benchmarks/conformance_workflows.py --models resnet18 T5 --workflows replan

Per case, at static + 30, 50 and 80 % of the fresh step's activations (a budget found
infeasible is replaced by the minimum the error names, which must then hold):

- ``replan``: a plan is already applied to the object (the fresh plan at another budget);
  ``optimize`` runs on it again, and its plan is applied in place of the old one.
- ``after-backward``: a backward ran just before planning (``.grad`` populated).
- ``accumulate``: planned with ``grad_accumulation=True``, trained on two micro-batches.
- ``optimizer``: planned with ``optimizer=AdamW(...)``; three steps of forward, backward,
  ``optimizer.step()``, ``zero_grad()``.
- ``eval``: planned while the model is in ``eval()`` mode, trained after ``model.train()``.
- ``data``: planned with ``envelope=`` and trained on a stream of batches of other lengths,
  padded, two resident per step, with metadata (``conformance_data``).

Each holds when the peak measured over the whole loop (``PeakTracker``) is within the
budget and losses, gradients, weights after the optimizer's steps and buffers are
bit-identical to the unplanned model run through the same loop from the same state; for
``replan``, ``after-backward`` and ``eval`` the plan must also be the plan a fresh object
gets at that budget (the same schedule and numbers). Writes
``results/conformance-workflows-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from conformance_data import check_data
from conformance_harness import (
    CASES,
    Case,
    Row,
    cache_off,
    judge,
    model_state,
    quiet,
    same_state,
)
from torch.utils._pytree import tree_leaves

import profiles
from planner import (
    InfeasibleBudgetError,
    Plan,
    ProfiledStep,
    apply,
    optimize,
    profile_model,
    remove,
    solve,
    zoo,
)
from planner.measure import PeakTracker
from planner.plan import GIB, format_bytes
from profiles.inputs import normalize_inputs

RESULTS = Path(__file__).resolve().parent / "results"
WORKFLOWS = ("replan", "after-backward", "accumulate", "optimizer", "eval", "data")


@dataclass(frozen=True)
class Loop:
    """How a workflow trains: micro-batches per step, steps, an optimizer or not."""

    micro_batches: int = 1
    steps: int = 1
    optimizer: bool = False


LOOPS = {"replan": Loop(), "after-backward": Loop(), "accumulate": Loop(micro_batches=2),
         "optimizer": Loop(steps=3, optimizer=True), "eval": Loop()}


@dataclass
class Trained:
    """What one training loop did: its peak and everything that must match the reference."""

    peak: int
    losses: list[float]
    grads: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]  # parameters and buffers after the loop


@dataclass
class _Run:
    """One case under way: the model, its inputs and state, the fresh plans to compare."""

    case: Case
    zm: zoo.ZooModel
    args: tuple
    kwargs: dict
    state: dict[str, torch.Tensor]
    fractions: tuple[float, ...]
    time_limit_s: float
    fresh: dict[str, Plan] = field(default_factory=dict)  # budget label -> fresh plan


Planned = dict[str, tuple[Plan, int]]  # budget label -> (plan, the budget it was made for)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def train(run: _Run, plan: Plan | None, loop: Loop) -> Trained:
    """``loop`` from ``run.state`` (the unplanned model when ``plan`` is None), measured."""
    model, zm = run.zm.model, run.zm
    model.load_state_dict(run.state)
    model.zero_grad(set_to_none=True)
    optimizer = _adamw(model) if loop.optimizer else None
    if plan is not None:
        apply(model, plan)
    loss_fn = zm.loss_fn or profiles.default_loss
    static = [*model.parameters(), *model.buffers(),
              *[t for t in tree_leaves((run.args, run.kwargs)) if isinstance(t, torch.Tensor)]]
    losses = []
    torch.manual_seed(0)
    try:
        with cache_off(model), PeakTracker(static) as tracker:
            for _ in range(loop.steps):
                for _ in range(loop.micro_batches):
                    loss = loss_fn(model(*run.args, **run.kwargs))
                    loss.backward()
                    losses.append(loss.item())  # not a tensor: it would stay allocated
                    del loss
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return Trained(tracker.peak_bytes, losses, grads, model_state(model))
    finally:
        remove(model)
        model.zero_grad(set_to_none=True)
        model.load_state_dict(run.state)


def _budgets(step: ProfiledStep, fractions: tuple[float, ...]) -> dict[str, int]:
    static = step.profile.static.total_bytes
    unplanned = step.unplanned_peak_bytes
    return {f"{100 * f:.0f} %": int(static + f * (unplanned - static)) for f in fractions}


def _solve(run: _Run, step: ProfiledStep, budget: int) -> tuple[Plan, int]:
    """The plan at ``budget``, or at the minimum its error names; and that budget."""
    try:
        return solve(step, budget_bytes=budget, time_limit_s=run.time_limit_s), budget
    except InfeasibleBudgetError as error:
        minimum = error.min_budget_bytes
        return solve(step, budget_bytes=minimum, time_limit_s=run.time_limit_s), minimum


def _profile(run: _Run, **options: Any) -> ProfiledStep:
    return profile_model(run.zm.model, run.zm.example_inputs, loss_fn=run.zm.loss_fn,
                         timing="estimate", progress=False, **options)


# ----------------------------------------------------------------------------- planning
# Each workflow's planner: the object in the state the workflow leaves it, then plans at
# every budget. Returns {budget label: (plan, budget)}.


def _plan_replanned(run: _Run, budgets: dict[str, int]) -> Planned:
    """``optimize`` on the object with another budget's fresh plan applied; the new plan
    replaces it."""
    labels = list(budgets)
    out = {}
    for k, label in enumerate(labels):
        old = run.fresh[labels[k - 1]]  # the previous budget's plan (the last for the first)
        model = run.zm.model
        apply(model, old)
        try:
            try:
                plan = optimize(model, run.zm.example_inputs, budget_gb=budgets[label] / GIB,
                                loss_fn=run.zm.loss_fn, timing="estimate", progress=False,
                                time_limit_s=run.time_limit_s)
                out[label] = (plan, budgets[label])
            except InfeasibleBudgetError as error:
                out[label] = (optimize(model, run.zm.example_inputs,
                                       budget_gb=error.min_budget_gb, loss_fn=run.zm.loss_fn,
                                       timing="estimate", progress=False,
                                       time_limit_s=run.time_limit_s), error.min_budget_bytes)
        finally:
            remove(model)
    return out


def _plan_after_backward(run: _Run, budgets: dict[str, int]) -> Planned:
    model = run.zm.model
    model.load_state_dict(run.state)
    with cache_off(model):
        loss = (run.zm.loss_fn or profiles.default_loss)(model(*run.args, **run.kwargs))
    loss.backward()
    del loss
    try:
        step = _profile(run)
    finally:
        model.zero_grad(set_to_none=True)
        model.load_state_dict(run.state)
    return {label: _solve(run, step, budget) for label, budget in budgets.items()}


def _plan_in_eval(run: _Run, budgets: dict[str, int]) -> Planned:
    model = run.zm.model
    model.eval()
    try:
        step = _profile(run)
    finally:
        model.train()
    if "eval mode" not in " ".join(step.notes):
        raise AssertionError("planning in eval mode said nothing about it")
    return {label: _solve(run, step, budget) for label, budget in budgets.items()}


def _plan_with(**options: Any) -> Callable[[_Run, dict[str, int]], Planned]:
    """Workflows whose step differs from the fresh one: budgets from their own profile."""
    def plan(run: _Run, _: dict[str, int]) -> Planned:
        made = {"optimizer": _adamw(run.zm.model)} if options.get("optimizer") else {}
        step = _profile(run, **{**options, **made})
        own = _budgets(step, run.fractions)
        return {label: _solve(run, step, budget) for label, budget in own.items()}
    return plan


PLANNERS = {"replan": _plan_replanned, "after-backward": _plan_after_backward,
            "accumulate": _plan_with(grad_accumulation=True),
            "optimizer": _plan_with(optimizer=True), "eval": _plan_in_eval}
SAME_AS_FRESH = {"replan", "after-backward", "eval"}


# ----------------------------------------------------------------------------- checking


def _compare(row: Row, got: Trained, reference: Trained) -> None:
    row.measured_bytes = got.peak
    row.error_pct = 100 * (row.predicted_bytes - got.peak) / got.peak
    row.losses_equal = got.losses == reference.losses
    row.grads_equal = got.grads.keys() == reference.grads.keys() and all(
        torch.equal(got.grads[k], reference.grads[k]) for k in got.grads)
    row.buffers_equal = same_state(got.state, reference.state)
    judge(row, row.budget_bytes)


def _compare_with_fresh(row: Row, plan: Plan, fresh: Plan) -> None:
    """The step must be profiled exactly as on a fresh object; then the plan is the fresh
    one, up to CP-SAT's choice among equally good schedules (its parallel search is not
    deterministic): when both are proven optimal, the recompute time must be the same."""
    row.same_profile = plan.profile == fresh.profile
    row.same_plan = plan.schedule == fresh.schedule
    if not row.same_profile:
        row.failures.append("not the step a fresh object profiles")
    proven = plan.solver.status == fresh.solver.status == "optimal"
    if proven and not math.isclose(plan.recompute_ms, fresh.recompute_ms, rel_tol=1e-9):
        row.failures.append(f"recomputes {plan.recompute_ms:.4f} ms where the fresh object's "
                            f"optimal plan recomputes {fresh.recompute_ms:.4f} ms")
    if not row.same_plan:
        row.note = (row.note + "; " if row.note else "") + (
            "another schedule of equal cost" if proven else "another schedule")


def _fresh_plans(run: _Run) -> dict[str, int]:
    step = _profile(run)
    budgets = _budgets(step, run.fractions)
    for label, budget in budgets.items():
        run.fresh[label], _ = _solve(run, step, budget)
    return budgets


def check_workflows(case: Case, fractions: tuple[float, ...] = (0.3, 0.5, 0.8), *,
                    workflows: tuple[str, ...] = WORKFLOWS,
                    time_limit_s: float = 20.0) -> list[Row]:
    """Plan and train ``case`` in each workflow at each budget; one Row per budget."""
    zm = case.build()
    args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
    run = _Run(case, zm, args, kwargs, model_state(zm.model), fractions, time_limit_s)
    with quiet():
        budgets = _fresh_plans(run)
        rows = []
        for name in workflows:
            rows += _check_workflow(run, name, budgets)
    if not same_state(run.state, model_state(zm.model)):
        rows[-1].failures.append("the model's state changed over the run")
    return rows


def _check_workflow(run: _Run, name: str, budgets: dict[str, int]) -> list[Row]:
    base = Row(run.case.name, run.case.family, "all", workflow=name)
    started = time.perf_counter()
    try:
        if name == "data":  # a stream of batches, planned with an envelope
            return check_data(run)
        plans = PLANNERS[name](run, budgets)
    except Exception as error:  # a crash is a finding, not the end of the run
        base.outcome = f"planning crashed: {type(error).__name__}: {error}"
        base.failures.append(base.outcome)
        return [base]
    base.solve_s = time.perf_counter() - started
    reference = train(run, None, LOOPS[name])
    rows = []
    for label, (plan, budget) in plans.items():
        row = Row(run.case.name, run.case.family, label, workflow=name, budget_bytes=budget,
                  predicted_bytes=plan.predicted_peak_bytes,
                  unplanned_bytes=plan.unplanned_peak_bytes, solve_s=base.solve_s,
                  solver=f"{plan.solver.name} ({plan.solver.status})",
                  regions=len(plan.schedule.recompute_regions()))
        if plan.budget_bytes != budget or (budget != budgets[label] and name in SAME_AS_FRESH):
            row.note = f"infeasible; planned at the named minimum {format_bytes(budget)}"
        if name in SAME_AS_FRESH:
            _compare_with_fresh(row, plan, run.fresh[label])
        try:
            _compare(row, train(run, plan, LOOPS[name]), reference)
        except Exception as error:
            row.failures.append(f"training crashed: {type(error).__name__}: {error}")
        row.outcome = "ok" if row.ok else "FAILED"
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- reporting


def workflow_table(rows: list[Row]) -> str:
    """One line per model, one column per workflow: holds at every budget, or what failed."""
    lines = ["| model | " + " | ".join(WORKFLOWS) + " |", "|---|" + "---|" * len(WORKFLOWS)]
    by_model: dict[str, list[Row]] = {}
    for r in rows:
        by_model.setdefault(r.model, []).append(r)
    for model, model_rows in by_model.items():
        cells = []
        for name in WORKFLOWS:
            done = [r for r in model_rows if r.workflow == name]
            failed = [r for r in done if not r.ok]
            cells.append("-" if not done else f"holds ({len(done)})" if not failed
                         else f"FAILED {len(failed)}/{len(done)}")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def workflow_summary(rows: list[Row]) -> dict[str, Any]:
    measured = [r for r in rows if r.measured_bytes]
    exact = [r for r in measured if r.workflow != "data"]  # data: a bound over a stream
    compared = [r for r in rows if r.same_plan is not None]
    profiled = [r for r in rows if r.same_profile is not None]
    return {
        "models": len({r.model for r in rows}),
        "rows": len(rows),
        "ok": sum(r.ok for r in rows),
        "over_budget": sum(r.measured_bytes > r.budget_bytes for r in measured),
        "silent": sum(any(f.startswith("SILENT") for f in r.failures) for r in rows),
        "crashes": sum(any("crashed" in f for f in r.failures) for r in rows),
        "same_profile": f"{sum(bool(r.same_profile) for r in profiled)} of {len(profiled)}",
        "same_plan": f"{sum(bool(r.same_plan) for r in compared)} of {len(compared)}",
        "tie_of_equal_cost": sum(r.note.endswith("of equal cost") for r in compared),
        "unproven_other": sum(r.note.endswith("another schedule") for r in compared),
        "worst_error_pct": max((r.error_pct for r in exact), default=None),
        "lowest_error_pct": min((r.error_pct for r in exact), default=None),
        "data_margin_pct": [min((r.error_pct for r in measured if r.workflow == "data"),
                                default=None),
                            max((r.error_pct for r in measured if r.workflow == "data"),
                                default=None)],
        "at_minimum": sum("named minimum" in r.note for r in rows),
        "failed": [f"{r.model} / {r.workflow} @ {r.budget}: {'; '.join(r.failures)}"
                   for r in rows if not r.ok],
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f} %"


def render_markdown(result: dict) -> str:
    s = result["summary"]
    rows = [Row(**r) for r in result["rows"]]
    lines = [f"| {r.model} | {r.workflow} | {r.budget} | {r.outcome} | "
             f"{format_bytes(r.budget_bytes)} | {format_bytes(r.predicted_bytes)} | "
             f"{format_bytes(r.measured_bytes) if r.measured_bytes else '-'} | "
             f"{'-' if r.same_plan is None else 'yes' if r.same_plan else 'no'} | "
             f"{'; '.join(r.failures) or r.note} |" for r in rows]
    return (
        f"# Conformance in every workflow (CPU)\n\n{result['date']}, {result['machine']}, "
        f"{result['seconds']} s, solver limit {result['time_limit_s']:g} s. {s['models']} of "
        f"{result['cases']} models, {s['rows']} planned budgets, {s['ok']} "
        f"hold; {s['over_budget']} over budget ({s.get('silent', 0)} without a warning), "
        f"{s['crashes']} crashes; prediction error "
        f"{_pct(s['lowest_error_pct'])} to {_pct(s['worst_error_pct'])} of the measured peak "
        f"(data: the table's highest prediction is {_pct(s['data_margin_pct'][0])} to "
        f"{_pct(s['data_margin_pct'][1])} above the stream's highest step) "
        f"(budgets found infeasible were planned at the minimum the error named: "
        f"{s['at_minimum']} rows). Re-planned, planned "
        f"after a backward or in eval: the step profiled as on a fresh object "
        f"{s['same_profile']}, the very same schedule {s['same_plan']}; the others: "
        f"{s['tie_of_equal_cost']} of equal cost (both proven optimal: CP-SAT's parallel "
        f"search picks among ties), {s['unproven_other']} where the time limit stopped a "
        "search that had not proven its answer.\n\n"
        f"{workflow_table(rows)}\n\n## Every budget\n\n"
        "| model | workflow | budget | outcome | budget | predicted | measured | same schedule |"
        " failures or notes |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=None,
                        help="run the cases whose name contains any of these, in this order "
                        "(the results file then says how many of all cases it covers)")
    parser.add_argument("--workflows", nargs="*", default=list(WORKFLOWS), choices=WORKFLOWS)
    parser.add_argument("--time-limit", type=float, default=20.0, help="solver seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the .md from the recorded .json")
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads((args.out / "conformance-workflows-cpu.json").read_text())
        result["summary"] = workflow_summary([Row(**r) for r in result["rows"]])
        _write(result, args.out)
        return result
    torch.set_num_threads(2)
    cases = list(CASES) if not args.models else list(dict.fromkeys(
        c for m in args.models for c in CASES if m.lower() in c.name.lower()))
    rows: list[Row] = []
    started = time.perf_counter()
    every_workflow = tuple(args.workflows) == WORKFLOWS
    result: dict = {}
    for case in cases:
        if case.needs and importlib.util.find_spec(case.needs) is None:
            print(f"{case.name}: skipped (needs {case.needs})", flush=True)
            continue
        t0 = time.perf_counter()
        case_rows = check_workflows(case, workflows=tuple(args.workflows),
                                    time_limit_s=args.time_limit)
        rows += case_rows
        print(f"{case.name}: {'ok' if all(r.ok for r in case_rows) else 'FAILED'} in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        for r in case_rows:
            if not r.ok:
                print(f"    {r.workflow} {r.budget}: {'; '.join(r.failures)}", flush=True)
        result = _result(rows, started, args.time_limit, len(CASES))
        if every_workflow:  # after every case: a long run that stops keeps what it measured
            _write(result, args.out)
    print("\n" + workflow_table(rows))
    print(json.dumps(result.get("summary"), indent=1))
    return result


def _result(rows: list[Row], started: float, time_limit_s: float, cases: int) -> dict:
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "seconds": round(time.perf_counter() - started, 1),
        "time_limit_s": time_limit_s,
        "cases": cases,
        "summary": workflow_summary(rows),
        "rows": [asdict(r) for r in rows],
    }


def _write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "conformance-workflows-cpu.json").write_text(json.dumps(result, indent=1))
    (out / "conformance-workflows-cpu.md").write_text(render_markdown(result))


if __name__ == "__main__":
    main()
