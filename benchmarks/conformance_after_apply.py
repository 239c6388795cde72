"""Conformance after apply: what users do to a planned model, on every conformance model.

    python benchmarks/conformance_after_apply.py              # every case
    python benchmarks/conformance_after_apply.py --models U-Net GPT2

Each case of ``conformance_harness.CASES`` is planned once at static memory + 50 % of its
activations (op ranges allowed), then, on a copy with the plan applied and on an unplanned
copy, the same change is made and one training step measured:

- (a) ``.to(torch.float64)`` (inputs too);
- (b) a submodule (a Linear or Conv2d inside a checkpointed module) replaced by a wider one;
- (c) an attribute that a traced forward reads flipped (a flag, or a float halved);
- (d) a traced submodule (else a checkpointed one) put in ``eval()`` during training;
- (e) an instance-level forward set on a checkpointed module;
- (f) a KeyboardInterrupt inside the forward, then a normal step.

A change *holds* when the planned step's loss and gradients are bit-identical to the
unplanned copy's under the same change and its measured peak is within the budget; else it
must *warn* (``PlanMismatchWarning`` or ``OpStreamWarning``) naming the change. Anything
else is *SILENT*: a failure. Writes ``benchmarks/results/conformance-after-apply-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import importlib.util
import json
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from conformance_harness import CASES, Case, cache_off, quiet
from torch import nn
from torch.utils._pytree import tree_map

import profiles
from planner import InfeasibleBudgetError, apply, profile_model, solve
from planner.api import measure_step
from planner.plan import Plan, PlanMismatchWarning, format_bytes
from planner.runtime.emit import OpStreamWarning, TracedForward, checkpointed_modules
from profiles.inputs import normalize_inputs
from profiles.traced import trace_inputs

RESULTS = Path(__file__).resolve().parent / "results"
STEM = "conformance-after-apply-cpu"


class NotApplicable(Exception):
    """The change has nothing to act on in this model or plan."""


@dataclass
class ChangeRow:
    model: str
    change: str
    outcome: str = ""  # held / held, warned / warned / n/a / SILENT / crash
    identical: bool = False
    measured_bytes: int = 0
    budget_bytes: int = 0
    warning: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome not in ("SILENT", "crash")


# ----------------------------------------------------------------------------- the changes


def _planned_paths(model: nn.Module) -> list[tuple[str, Any]]:
    return sorted(checkpointed_modules(model).items())


def _traced_path(model: nn.Module) -> str:
    for path, wrapper in _planned_paths(model):
        while not isinstance(wrapper, TracedForward) and getattr(wrapper, "inner", None):
            wrapper = wrapper.inner
        if isinstance(wrapper, TracedForward):
            return path
    raise NotApplicable("the plan has no traced forward")


def _first_planned(model: nn.Module) -> str:
    paths = _planned_paths(model)
    if not paths:
        raise NotApplicable("the plan checkpoints nothing")
    return paths[0][0]


def _widened(module: nn.Module) -> nn.Module | None:
    if isinstance(module, nn.Linear):
        wide = 4 * module.out_features
        return nn.Sequential(nn.Linear(module.in_features, wide),
                             nn.Linear(wide, module.out_features))
    if isinstance(module, nn.Conv2d) and module.groups == 1:
        wide = 4 * module.out_channels
        return nn.Sequential(nn.Conv2d(module.in_channels, wide, module.kernel_size,
                                       module.stride, module.padding, module.dilation),
                             nn.Conv2d(wide, module.out_channels, 1))
    return None


def _widen(model: nn.Module, where: str) -> str:
    under = model.get_submodule(where)
    prefix = f"{where}." if where else ""
    for name, module in under.named_modules():
        wide = _widened(module)
        if wide is not None and name:
            parent, _, leaf = (prefix + name).rpartition(".")
            setattr(model.get_submodule(parent), leaf, wide.to(
                next(module.parameters()).dtype))
            return prefix + name
    raise NotApplicable(f"no Linear or Conv2d inside {where or '<model>'!r}")


def _flip(model: nn.Module, where: str) -> str:
    module = model.get_submodule(where)
    for name, _ in trace_inputs(module)[2]:
        value = getattr(module, name)
        if isinstance(value, bool):
            setattr(module, name, not value)
            return f"{where}.{name} = {not value}"
    for name, _ in trace_inputs(module)[2]:
        value = getattr(module, name)
        if isinstance(value, float) and value:
            setattr(module, name, value / 2)
            return f"{where}.{name} = {value / 2}"
    raise NotApplicable(f"{where!r} has no flag or float attribute")


def _in_eval(model: nn.Module, where: str) -> str:
    model.get_submodule(where).eval()
    return f"{where or '<model>'}.eval()"


def _instance_forward(model: nn.Module, where: str) -> str:
    module = model.get_submodule(where)
    module.forward = functools.partial(type(module).forward, module)
    return f"{where or '<model>'}.forward = partial(...)"


# each change: where it acts (found on the planned copy), and what it does to a model
CHANGES: dict[str, tuple[Callable[[nn.Module], str], Callable[[nn.Module, str], str]]] = {
    "a .to(float64)": (lambda m: "", lambda m, _: m.to(torch.float64) and "float64"),
    "b wider submodule": (_first_planned, _widen),
    "c traced attribute flipped": (_traced_path, _flip),
    "d traced module in eval()": (
        lambda m: _traced_path(m) if _has_traced(m) else _first_planned(m), _in_eval),
    "e instance forward": (_first_planned, _instance_forward),
    "f KeyboardInterrupt, then a step": (_first_planned, lambda m, _: "interrupted"),
}


def _has_traced(model: nn.Module) -> bool:
    try:
        _traced_path(model)
    except NotApplicable:
        return False
    return True


# ----------------------------------------------------------------------------- one change


def _interrupt_once(model: nn.Module, where: str, args: tuple, kwargs: dict) -> None:
    """A training forward interrupted (Ctrl-C) inside ``where``."""

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    handle = model.get_submodule(where).register_forward_hook(stop)
    try:
        model(*args, **kwargs)
    except KeyboardInterrupt:
        pass
    finally:
        handle.remove()


def _step(model: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable) -> tuple:
    torch.manual_seed(0)
    with cache_off(model):
        return measure_step(model, args, kwargs, loss_fn)


def check_change(name: str, model: nn.Module, plan: Plan, args: tuple, kwargs: dict,
                 loss_fn: Callable) -> ChangeRow:
    """One change made to a planned and an unplanned copy of ``model``, judged."""
    row = ChangeRow(model="", change=name, budget_bytes=plan.budget_bytes)
    locate, change = CHANGES[name]
    reference, planned = copy.deepcopy(model), copy.deepcopy(model)
    try:
        apply(planned, plan)
        where = locate(planned)
        for copy_ in (reference, planned):
            torch.manual_seed(1)  # a new module's weights alike in both
            row.detail = change(copy_, where)
    except NotApplicable as why:
        row.outcome, row.detail = "n/a", str(why)
        return row
    if name.startswith("a"):
        args, kwargs = tree_map(lambda t: t.double() if isinstance(t, torch.Tensor)
                                and t.is_floating_point() else t, (args, kwargs))
    try:
        _, base_loss, base_grads = _step(reference, args, kwargs, loss_fn)
    except Exception as error:  # the change breaks the model itself
        row.outcome, row.detail = "n/a", f"the unplanned model fails too: {error}"[:120]
        return row
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if name.startswith("f"):
                _interrupt_once(planned, where, args, kwargs)
            peak, loss, grads = _step(planned, args, kwargs, loss_fn)
        except Exception as error:
            row.outcome, row.detail = "crash", f"{type(error).__name__}: {error}"[:160]
            return row
    told = [str(w.message) for w in caught
            if issubclass(w.category, PlanMismatchWarning | OpStreamWarning)]
    row.measured_bytes, row.warning = peak, (told[0][:160] if told else "")
    row.identical = torch.equal(loss, base_loss) and base_grads.keys() == grads.keys() and \
        all(torch.equal(base_grads[k], grads[k]) for k in grads)
    held = row.identical and peak <= plan.budget_bytes
    row.outcome = ("held, warned" if told else "held") if held else \
        ("warned" if told else "SILENT")
    return row


def check_case(case: Case, time_limit_s: float = 20.0) -> list[ChangeRow]:
    """``case`` planned at + 50 % of its activations, then every change of `CHANGES`."""
    try:
        zm = case.build()
        args, kwargs = normalize_inputs(zm.model, zm.example_inputs)
        with quiet():
            step = profile_model(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                                 timing="estimate", progress=False)
            static = step.profile.static.total_bytes
            budget = int(static + 0.5 * (step.unplanned_peak_bytes - static))
            try:
                plan = solve(step, budget_bytes=budget, time_limit_s=time_limit_s)
            except InfeasibleBudgetError as error:
                plan = error.plan
    except Exception as error:
        return [ChangeRow(case.name, "all", "crash", detail=f"planning failed: {error}"[:160])]
    loss_fn = zm.loss_fn or profiles.default_loss
    rows = []
    for name in CHANGES:
        row = check_change(name, zm.model, plan, args, kwargs, loss_fn)
        row.model = case.name
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report


def render_markdown(result: dict) -> str:
    rows = [ChangeRow(**r) for r in result["rows"]]
    names = list(CHANGES)
    by_model: dict[str, dict[str, ChangeRow]] = {}
    for r in rows:
        by_model.setdefault(r.model, {})[r.change] = r
    lines = ["| model | " + " | ".join(n.split(" ", 1)[0] for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for model, changes in by_model.items():
        cells = [changes[n].outcome if n in changes else "" for n in names]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    counts = {k: sum(r.outcome == k for r in rows)
              for k in ("held", "held, warned", "warned", "n/a", "SILENT", "crash")}
    details = [f"- {r.model}, {r.change}: {r.outcome}; {r.detail}; "
               f"{format_bytes(r.measured_bytes)} of {format_bytes(r.budget_bytes)}"
               + (f"; warned: {r.warning}" if r.warning else "")
               for r in rows if r.outcome not in ("n/a",)]
    return (f"# Conformance after apply (CPU)\n\n{result['date']}, {result['machine']}, "
            f"{result['seconds']} s. {len(by_model)} models, {len(rows)} changes: "
            + ", ".join(f"{v} {k}" for k, v in counts.items()) + ".\n\n"
            + "Changes: " + "; ".join(names) + ".\n\n" + "\n".join(lines)
            + "\n\n## Each change\n\n" + "\n".join(details) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=None,
                        help="run the cases whose name contains any of these")
    parser.add_argument("--time-limit", type=float, default=20.0, help="solver seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    cases = [c for c in CASES if (not args.models or any(
        m.lower() in c.name.lower() for m in args.models))
        and not (c.needs and importlib.util.find_spec(c.needs) is None)]
    rows: list[ChangeRow] = []
    started = time.perf_counter()
    for case in cases:
        t0 = time.perf_counter()
        case_rows = check_case(case, args.time_limit)
        rows += case_rows
        bad = [r for r in case_rows if not r.ok]
        print(f"{case.name}: {'ok' if not bad else 'FAILED'} in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        for r in bad:
            print(f"    {r.change}: {r.outcome}: {r.detail}", flush=True)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [asdict(r) for r in rows],
    }
    if not args.models:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{STEM}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"{STEM}.md").write_text(render_markdown(result))
    print(render_markdown(result))
    return result


if __name__ == "__main__":
    main()
