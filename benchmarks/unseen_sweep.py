"""The sweep of architectures nobody here wrote, as a user would try them.

    python benchmarks/unseen_sweep.py                       # the first wave: 19 models
    python benchmarks/unseen_sweep.py --wave second         # the second: 17 models
    python benchmarks/unseen_sweep.py --models Phi3 mnasnet --out /tmp/sweep

Models none of the conformance cases cover, random-init from their configs (no downloads),
tiny enough for a step of a few seconds on a CPU, in the waves they were tried
(`unseen_models`: what each brings).

Seven cases per model, budgets as static memory + a share of the profiled activations (a
budget found infeasible is replaced by the minimum ``InfeasibleBudgetError`` names, and the
row says so):

- ``plain 30 %`` / ``plain 70 %``: ``profile_model`` once, ``solve`` at each budget;
- ``offload 30 %`` / ``offload 70 %``: profiled with ``device="H100"`` estimates (a host
  link exists), solved with ``offload=True`` (on a CPU it may offload nothing);
- ``accumulate 30 %``: profiled with ``grad_accumulation=True``; a real two-micro-batch loop
  (``zero_grad(set_to_none=True)``, two backwards), the second micro-batch measured;
- ``replanned 30 %``: ``optimize`` at 70 %, ``apply``, ``optimize`` again on the same object
  at 30 %, and the second plan applied in place of the first;
- ``saved+loaded 30 %``: the plain plan through ``plan.save`` / ``Plan.load``, the loaded
  one applied.

A case holds when planning left the model untouched (``ModelSnapshot``, RNG state), the
measured peak (``PeakTracker``) is within the budget, losses, gradients and buffers are
bit-identical to the unplanned model's from the same state and seed, and nothing crashed.
The prediction error is recorded, not judged. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import platform
import sys
import tempfile
import time
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from conformance_harness import (
    Case,
    Row,
    _planned_step,
    _reference_step,
    cache_off,
    judge,
    model_state,
    quiet,
)
from model_snapshot import ModelSnapshot
from torch.utils._pytree import tree_leaves
from tqdm import tqdm
from unseen_models import WAVES

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
TIME_LIMIT_S = 10.0
KINDS = (("plain", 0.3), ("plain", 0.7), ("offload", 0.3), ("offload", 0.7),
         ("accumulate", 0.3), ("replanned", 0.3), ("saved+loaded", 0.3))
_SOLVE = {"timing": "estimate", "progress": False}

def missing(case: Case) -> str | None:
    """Why ``case`` cannot run here (a package, or a class the installed transformers
    lacks), or None."""
    if case.needs and importlib.util.find_spec(case.needs) is None:
        return f"{case.needs} is not installed"
    if case.family == "transformers":
        import transformers

        if not hasattr(transformers, case.covers[0]):
            return f"transformers {transformers.__version__} has no {case.covers[0]}"
    return None


# ----------------------------------------------------------------------------- cases


@dataclass
class _Model:
    """One model under way: its inputs, its state and the unplanned step from that state."""

    case: Case
    zm: zoo.ZooModel
    args: tuple
    kwargs: dict
    state: dict[str, torch.Tensor]
    reference: tuple  # _reference_step: peak, loss, gradients, state after
    steps: dict[str, Any] = field(default_factory=dict)  # profiles (or their error) by kind


def _row(m: _Model, kind: str, fraction: float) -> Row:
    return Row(m.case.name, m.case.family, f"{100 * fraction:.0f} %", workflow=kind)


PROFILES = {"plain": {}, "H100": {"device": "H100"}, "accumulate": {"grad_accumulation": True}}


def _budget(step: ProfiledStep, fraction: float) -> int:
    static = step.profile.static.total_bytes
    return int(static + fraction * (step.unplanned_peak_bytes - static))


_PARTS = ("object", "class", "mode", "instance forward")


def _which(before: tuple, after: tuple) -> str:
    """Which part of a module's ``ModelSnapshot`` record changed, in words."""
    parts = [name for name, a, b in zip(_PARTS, before, after, strict=False) if a != b]
    hooks_before, hooks_after = dict(before[-1]), dict(after[-1])
    for table in hooks_before:
        old, new = dict(hooks_before[table]), dict(hooks_after.get(table, ()))
        if old == new:
            continue
        same_objects = [id(h) for h in old.values()] == [id(h) for h in new.values()]
        parts.append(f"{table}: " + (f"the same hooks under other keys ({list(old)} -> "
                                     f"{list(new)})" if same_objects else "other hooks"))
    return ", ".join(parts)


def _untouched(m: _Model, snapshot: ModelSnapshot, rng: torch.Tensor, what: str) -> list[str]:
    """What planning changed on the model (nothing, when it held)."""
    found = [f"{what} changed the model: {line}"
             for line in snapshot.differences(m.zm.model)[:3]]
    now = ModelSnapshot.of(m.zm.model).modules
    found += [f"(module {name or '<model>'!r}: {_which(record, now[name])})"
              for name, record in snapshot.modules.items()
              if name in now and record != now[name]][:3]
    if not torch.equal(rng, torch.get_rng_state()):
        found.append(f"{what} changed the RNG state")
    return found


def _profile(m: _Model, kind: str, row: Row) -> ProfiledStep:
    """``profile_model`` as a user calls it (``PROFILES[kind]``), once per model and kind;
    what it changed on the model goes to ``row``; a crash is raised again for every case
    that needs the profile."""
    if kind not in m.steps:
        snapshot, rng = ModelSnapshot.of(m.zm.model), torch.get_rng_state()
        started = time.perf_counter()
        try:
            with quiet():
                step = profile_model(m.zm.model, m.zm.example_inputs, loss_fn=m.zm.loss_fn,
                                     **_SOLVE, **PROFILES[kind])
            m.steps[kind] = (step, _untouched(m, snapshot, rng, "profile_model"),
                             time.perf_counter() - started)
        except Exception as error:
            m.steps[kind] = error
    if isinstance(m.steps[kind], Exception):
        raise m.steps[kind]
    step, found, seconds = m.steps[kind]
    row.failures += found
    row.profile_s = seconds
    return step


def _at_minimum(row: Row, error: InfeasibleBudgetError) -> None:
    row.named_minimum_bytes = error.min_budget_bytes
    row.note = (f"{format_bytes(row.budget_bytes)} infeasible: planned at the named minimum "
                f"{format_bytes(error.min_budget_bytes)}")
    row.budget_bytes = error.min_budget_bytes


def _solve_at(step: ProfiledStep, row: Row, offload: bool = False) -> Plan:
    """``solve`` at ``row.budget_bytes``, or at the minimum an infeasible budget names."""
    started = time.perf_counter()
    try:
        try:
            return solve(step, budget_bytes=row.budget_bytes, time_limit_s=TIME_LIMIT_S,
                         offload=offload)
        except InfeasibleBudgetError as error:
            _at_minimum(row, error)
            return solve(step, budget_bytes=row.budget_bytes, time_limit_s=TIME_LIMIT_S,
                         offload=offload)
    finally:
        row.solve_s += time.perf_counter() - started


def _optimize(m: _Model, row: Row) -> Plan:
    """``optimize`` at ``row.budget_bytes`` (the named minimum when infeasible), checked to
    leave the model as it found it (failures go to ``row``)."""
    snapshot, rng = ModelSnapshot.of(m.zm.model), torch.get_rng_state()
    options = dict(loss_fn=m.zm.loss_fn, time_limit_s=TIME_LIMIT_S, **_SOLVE)
    started = time.perf_counter()
    with quiet():
        try:
            plan = optimize(m.zm.model, m.zm.example_inputs,
                            budget_gb=row.budget_bytes / GIB, **options)
        except InfeasibleBudgetError as error:
            _at_minimum(row, error)
            plan = optimize(m.zm.model, m.zm.example_inputs, budget_gb=error.min_budget_gb,
                            **options)
    row.solve_s += time.perf_counter() - started
    row.failures += _untouched(m, snapshot, rng, "optimize")
    return plan


def _noted_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """The planner's own warnings during a planned step (the plan noticed a mismatch)."""
    return sorted({f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught
                   if w.category.__module__.split(".")[0] in ("planner", "profiles")})


def _judged(row: Row, budget_bytes: int) -> None:
    """The conformance rule without its prediction bound (recorded here, not judged)."""
    judge(row, budget_bytes)
    row.failures = [f for f in row.failures if not f.startswith("predicted ")]


def _measure(m: _Model, plan: Plan, row: Row) -> None:
    """Apply ``plan``, one step from the model's state, compared with the unplanned one."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _planned_step(m.zm, plan, m.args, m.kwargs, m.state, row, m.reference)
    row.failures = [f for f in row.failures if not f.startswith("predicted ")]
    row.unplanned_bytes = plan.unplanned_peak_bytes
    row.note = "; ".join(filter(None, [row.note, *_noted_warnings(caught)]))


def _plain(m: _Model, row: Row, fraction: float, offload: bool = False) -> None:
    """Solve the profiled step at static + ``fraction`` of its activations; measure."""
    step = _profile(m, "H100" if offload else "plain", row)
    row.budget_bytes = _budget(step, fraction)
    plan = _solve_at(step, row, offload)
    _measure(m, plan, row)
    if offload and not plan.schedule.offloads:
        row.note = "; ".join(filter(None, [row.note, "offloads nothing"]))


def _offload(m: _Model, row: Row, fraction: float) -> None:
    _plain(m, row, fraction, offload=True)


def _saved_loaded(m: _Model, row: Row, fraction: float) -> None:
    """The plain plan through a file: the loaded plan must be the saved one, and hold."""
    step = _profile(m, "plain", row)
    row.budget_bytes = _budget(step, fraction)
    plan = _solve_at(step, row)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        plan.save(path)
        loaded = Plan.load(path)
    if loaded.schedule != plan.schedule or (loaded.predicted_peak_bytes
                                            != plan.predicted_peak_bytes):
        row.failures.append("the loaded plan is not the saved one")
    _measure(m, loaded, row)


def _replanned(m: _Model, row: Row, fraction: float) -> None:
    """``optimize`` at 70 %, ``apply``; ``optimize`` the planned object again at
    ``fraction``; apply the second plan in place of the first and measure. Budgets from the
    plain profile."""
    step = _profile(m, "plain", Row(row.model, row.family, ""))
    first = _row(m, "replanned", 0.7)
    first.budget_bytes = _budget(step, 0.7)
    row.budget_bytes = _budget(step, fraction)
    model = m.zm.model
    apply(model, _optimize(m, first))
    try:
        plan = _optimize(m, row)
    finally:
        remove(model)
    row.failures += [f"first optimize: {f}" for f in first.failures]
    _measure(m, plan, row)


def _backward(m: _Model) -> torch.Tensor:
    loss = (m.zm.loss_fn or profiles.default_loss)(m.zm.model(*m.args, **m.kwargs))
    loss.backward()
    return loss.detach()


def _two_micro_batches(m: _Model, plan: Plan | None) -> tuple[int, list, dict, dict]:
    """Gradient accumulation from ``m.state``: ``zero_grad(set_to_none=True)``, two
    backwards; the second measured with the gradients the first left counted as static
    (as ``measure_step(grads_at_start=True)`` counts them). Peak, losses, grads, state."""
    model = m.zm.model
    model.load_state_dict(m.state)
    model.zero_grad(set_to_none=True)
    if plan is not None:
        apply(model, plan)
    torch.manual_seed(0)
    try:
        with cache_off(model):
            losses = [_backward(m)]
            static = [*model.parameters(), *model.buffers(),
                      *(p.grad for p in model.parameters() if p.grad is not None),
                      *[t for t in tree_leaves((m.args, m.kwargs))
                        if isinstance(t, torch.Tensor)]]
            with PeakTracker(static) as tracker:
                losses.append(_backward(m))
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return tracker.peak_bytes, losses, grads, model_state(model)
    finally:
        if plan is not None:
            remove(model)
        model.zero_grad(set_to_none=True)
        model.load_state_dict(m.state)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _accumulated(m: _Model, row: Row, fraction: float) -> None:
    """Planned with ``grad_accumulation=True`` at its own profile's budget; the second
    micro-batch measured; losses, gradients and state against the unplanned loop."""
    step = _profile(m, "accumulate", row)
    row.budget_bytes = _budget(step, fraction)
    plan = _solve_at(step, row)
    row.predicted_bytes, row.unplanned_bytes = (plan.predicted_peak_bytes,
                                                step.unplanned_peak_bytes)
    row.solver = f"{plan.solver.name} ({plan.solver.status})"
    row.regions = len(plan.schedule.recompute_regions())
    reference = _two_micro_batches(m, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peak, losses, grads, state = _two_micro_batches(m, plan)
    row.measured_bytes = peak
    row.error_pct = 100 * (row.predicted_bytes - peak) / peak
    row.losses_equal = all(torch.equal(a, b) for a, b in zip(losses, reference[1], strict=True))
    row.grads_equal = _equal(grads, reference[2])
    row.buffers_equal = _equal(state, reference[3])
    _judged(row, row.budget_bytes)
    row.note = "; ".join(filter(None, [row.note, *_noted_warnings(caught)]))


CASES = {"plain": _plain, "offload": _offload, "accumulate": _accumulated,
         "replanned": _replanned, "saved+loaded": _saved_loaded}


def _case(m: _Model, kind: str, fraction: float) -> Row:
    """One case; a crash is a finding, recorded, and the model put back as it was."""
    row = _row(m, kind, fraction)
    try:
        CASES[kind](m, row, fraction)
    except Exception as error:
        row.failures.append(f"crashed: {type(error).__name__}: {str(error)[:300]}")
        row.outcome = "crash"
        remove(m.zm.model)
        m.zm.model.zero_grad(set_to_none=True)
        m.zm.model.load_state_dict(m.state)
    row.outcome = row.outcome or ("held" if row.ok else "FAILED")
    return row


def _state(model: torch.nn.Module) -> OrderedDict[str, torch.Tensor]:
    """``model_state`` with the state dict's ``_metadata`` (module versions), which
    ``load_state_dict`` of some modules needs (torchvision's MNASNet)."""
    state = OrderedDict(model_state(model))
    state._metadata = model.state_dict()._metadata  # type: ignore[attr-defined]
    return state


def sweep_model(case: Case) -> list[Row]:
    """Every case of ``KINDS`` on one model, from one state, against one unplanned step."""
    try:
        zm = case.build()
        args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
        state = _state(zm.model)
        with quiet():
            reference = _reference_step(zm, args, kwargs, state, None)
    except Exception as error:
        row = Row(case.name, case.family, "all", workflow="all", outcome="crash")
        row.failures.append(f"the unplanned model failed: {type(error).__name__}: {error}")
        return [row]
    m = _Model(case, zm, args, kwargs, state, reference)
    rows = [_case(m, kind, fraction) for kind, fraction in KINDS]
    if not _equal(state, model_state(zm.model)):
        rows[-1].failures.append("the model's state changed over the run")
        rows[-1].outcome = "FAILED"
    return rows


# ----------------------------------------------------------------------------- reporting


def _label(kind: str, fraction: float) -> str:
    return f"{kind} {100 * fraction:.0f} %"


def _cell(r: Row) -> str:
    if not r.ok:
        return "FAILED: " + "; ".join(r.failures)
    minimum = f" at min {format_bytes(r.budget_bytes)}" if r.named_minimum_bytes else ""
    return f"held{minimum} ({r.error_pct:+.3f} %)"


def model_table(rows: list[Row]) -> str:
    """One line per model, one column per case: held (prediction error) or what failed."""
    labels = [_label(k, f) for k, f in KINDS]
    lines = ["| model | unplanned peak | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    by_model: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_model.setdefault(r.model, {})[f"{r.workflow} {r.budget}"] = r
    for model, cases in by_model.items():
        unplanned = max((r.unplanned_bytes for r in cases.values()), default=0)
        cells = [_cell(cases[lb]) if lb in cases else "-" for lb in labels]
        if "all all" in cases:
            cells = [_cell(cases["all all"])] + ["-"] * (len(labels) - 1)
        lines.append(f"| {model} | {format_bytes(unplanned) if unplanned else '-'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(rows: list[Row]) -> str:
    """One line per case: budget, predicted and measured peak, error, solver, notes."""
    lines = ["| model | case | outcome | budget | predicted | measured | error | solver | "
             "regions | offloaded | profile s | solve s | failures or notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ran = bool(r.measured_bytes)
        lines.append(
            f"| {r.model} | {r.workflow} {r.budget} | {r.outcome} | "
            f"{format_bytes(r.budget_bytes) if r.budget_bytes else '-'} | "
            f"{format_bytes(r.predicted_bytes) if r.predicted_bytes else '-'} | "
            f"{format_bytes(r.measured_bytes) if ran else '-'} | "
            f"{f'{r.error_pct:+.3f} %' if ran else '-'} | {r.solver or '-'} | {r.regions} | "
            f"{f'{r.offloads} ({format_bytes(r.offloaded_bytes)})' if r.offloads else '-'} | "
            f"{r.profile_s:.1f} | {r.solve_s:.1f} | "
            f"{'; '.join(r.failures) or r.note} |".replace("\n", " "))
    return "\n".join(lines)


def summary(rows: list[Row]) -> dict[str, Any]:
    measured = [r for r in rows if r.measured_bytes]
    return {
        "models": len({r.model for r in rows}),
        "cases": len(rows),
        "held": sum(r.ok for r in rows),
        "crashes": sum(r.outcome == "crash" for r in rows),
        "over_budget": sum(r.measured_bytes > r.budget_bytes for r in measured),
        "measured": len(measured),
        "prediction_exact": sum(r.predicted_bytes == r.measured_bytes for r in measured),
        "prediction_within_1pct": sum(abs(r.error_pct) <= 1.0 for r in measured),
        "prediction_low": sum(r.error_pct < 0 for r in measured),
        "worst_error_pct": max((r.error_pct for r in measured), key=abs, default=None),
        "at_minimum": sum(bool(r.named_minimum_bytes) for r in rows),
        "offloading_plans": sum(bool(r.offloads) for r in rows),
        "failed": [f"{r.model} / {r.workflow} {r.budget}: {'; '.join(r.failures)}"
                   for r in rows if not r.ok],
    }


def render_markdown(result: dict) -> str:
    s = result["summary"]
    rows = [Row(**r) for r in result["rows"]]
    skipped = "".join(f"\n- {name}: skipped, {why}" for name, why in result["skipped"].items())
    worst = "-" if s["worst_error_pct"] is None else f"{s['worst_error_pct']:+.3f} %"
    wave = result.get("wave", "first")
    command = "python benchmarks/unseen_sweep.py" + ("" if wave == "first" else f" --wave {wave}")
    return (
        f"# Unseen architectures, {wave} wave: {s['models']} models nobody here wrote (CPU)\n\n"
        f"{result['date']}, {result['machine']}, {result['seconds']} s, solver limit "
        f"{result['time_limit_s']:g} s. `{command}`.\n\n"
        f"**{s['held']} of {s['cases']} cases hold** over {s['models']} models "
        f"({s['crashes']} crashes, {s['over_budget']} over budget). Prediction of the "
        f"measured peak: exact in {s['prediction_exact']} of {s['measured']} measured cases, "
        f"within 1 % in {s['prediction_within_1pct']}, low in {s['prediction_low']}, worst "
        f"{worst}. {s['at_minimum']} asked budgets were infeasible and planned at the "
        f"minimum the error named; {s['offloading_plans']} plans offload.{skipped}\n\n"
        "Cases: plain at static + 30 / 70 % of the activations; offload (H100 estimates) at "
        "30 / 70 %; gradient accumulation at 30 % of its own profile (second micro-batch "
        "measured); re-planned (optimize at 70 %, apply, optimize at 30 %, apply); saved and "
        "loaded at 30 %. A case holds when planning left the model untouched, the measured "
        "peak is within the budget, and losses, gradients and buffers are bit-identical to "
        "the unplanned model's. Cells: held (prediction error, predicted vs measured).\n\n"
        f"{model_table(rows)}\n\n## Every case\n\n{detail_table(rows)}\n")


# ----------------------------------------------------------------------------- main


def _write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(render_markdown(result))


def _result(rows: list[Row], skipped: dict[str, str], seconds: dict[str, float],
            started: float, wave: str) -> dict:
    return {
        "wave": wave,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "seconds": round(time.perf_counter() - started, 1),
        "model_seconds": seconds,
        "time_limit_s": TIME_LIMIT_S,
        "skipped": skipped,
        "summary": summary(rows),
        "rows": [asdict(r) for r in rows],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wave", choices=sorted(WAVES), default="first",
                        help="which wave of models (unseen_models.py)")
    parser.add_argument("--models", nargs="*", default=None,
                        help="only the models whose name contains one of these")
    parser.add_argument("--out", type=Path, default=None,
                        help="results path without suffix (.json and .md are written); "
                        "default: results/unseen-sweep-cpu (first wave), "
                        "results/unseen-sweep-<wave>-cpu (others)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(2)
    out = args.out or RESULTS / ("unseen-sweep-cpu" if args.wave == "first"
                                 else f"unseen-sweep-{args.wave}-cpu")
    cases = [c for c in WAVES[args.wave] if not args.models
             or any(m.lower() in c.name.lower() for m in args.models)]
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    bar = tqdm(cases, unit="model", disable=not sys.stderr.isatty())
    for case in bar:
        bar.set_description(case.name)
        why = missing(case)
        if why is not None:
            skipped[case.name] = why
            bar.write(f"{case.name}: skipped ({why})")
            continue
        t0 = time.perf_counter()
        case_rows = sweep_model(case)
        seconds[case.name] = round(time.perf_counter() - t0, 1)
        rows += case_rows
        held = sum(r.ok for r in case_rows)
        bar.write(f"{case.name}: {held} of {len(case_rows)} held in {seconds[case.name]} s")
        _write(_result(rows, skipped, seconds, started, args.wave), out)
    result = _result(rows, skipped, seconds, started, args.wave)
    _write(result, out)
    s = result["summary"]
    print(f"{s['held']} of {s['cases']} cases held; prediction exact {s['prediction_exact']}"
          f", within 1 % {s['prediction_within_1pct']} of {s['measured']}; "
          f"{result['seconds']} s")
    return result


if __name__ == "__main__":
    main()
