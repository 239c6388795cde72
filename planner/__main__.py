"""Command line: ``python -m planner {demo,optimize,show,profile} ...``.

An error a user can act on (a bad budget, a missing or edited file, a budget no plan meets,
a model that cannot run) is one line on stderr and exit code 2; ``-v`` adds its traceback.
The planner says what it profiles and solves; solver internals speak only with ``-vv``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from planner.config import COMPILING, PROFILING, SEARCH, STEP, cli_flags, from_cli, positive
from profiles.errors import ProfileError

log = logging.getLogger("planner")

GIB = 2**30
# the command line plans for an H100 from any machine; optimize() plans for the model's device
CLI_DEFAULTS = {"timing": "estimate", "device": "H100"}
# errors that describe the user's input, not a bug: one line, exit code 2
USER_ERRORS = (ValueError, TypeError, KeyError, OSError, ImportError, ProfileError)


MODEL_HELP = ("zoo name (mlp, resnet, gpt, hf-gpt2, hf-llama), or module:attr for your own "
              "model: a function returning (model, batch, loss_fn) (--set passes its "
              "arguments), a planner.zoo.ZooModel(name, model, example_inputs, loss_fn) or a "
              "function or class that returns one; an nn.Module alone plans its own example "
              "batch (HF dummy_inputs)")


def _load_model(spec: str, overrides: list[str]) -> Any:
    """A zoo name (``gpt``) or ``module:attr`` naming a ZooModel, an nn.Module, or a
    function or class that ``--set`` arguments build one with. Whatever goes wrong in
    importing or building it is a ``ValueError`` naming ``--model`` (and ``--set``)."""
    from torch import nn

    from planner import zoo

    kwargs = _overrides(overrides)
    where = " ".join([f"--model {spec}", *(f"--set {item}" for item in overrides)])
    if ":" not in spec:
        built = _build(where, zoo.get, spec, **kwargs)
    else:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as error:
            raise ValueError(f"--model {spec}: cannot import {module_name!r}: "
                             f"{_one_line(error)}") from error
        target = getattr(module, attr, None)
        if target is None:
            raise ValueError(f"--model {spec}: module {module_name!r} has no attribute "
                             f"{attr!r}")
        if isinstance(target, (zoo.ZooModel, nn.Module)):
            if kwargs:
                raise ValueError(f"{where}: {attr} is a model already; --set needs a "
                                 "function or class to build one with")
            built = target
        elif callable(target):
            built = _build(where, target, **kwargs)
        else:
            raise ValueError(f"--model {spec} is a {type(target).__name__}; name an "
                             "nn.Module, a planner.zoo.ZooModel, or a function or class "
                             "that builds one")
    if isinstance(built, nn.Module):
        built = zoo.ZooModel(spec, built, None, None)
    elif isinstance(built, tuple) and 2 <= len(built) <= 3 and isinstance(built[0], nn.Module):
        built = zoo.ZooModel(spec, *built, *[None] * (3 - len(built)))  # (model, batch[, loss])
    if not isinstance(built, zoo.ZooModel):
        raise ValueError(f"{where} built a {type(built).__name__}, not (model, batch, "
                         "loss_fn), an nn.Module or a planner.zoo.ZooModel")
    from profiles.inputs import empty_input

    empty = empty_input(built.example_inputs)
    if empty:
        raise ValueError(f"{where}: the example {empty}, with no elements; a training step "
                         "needs at least one sample (sizes must be positive)")
    return built


def _overrides(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as keyword arguments; numbers as numbers."""
    kwargs: dict[str, Any] = {}
    for item in items:
        key, equals, text = item.partition("=")
        if not equals or not key.isidentifier():
            raise ValueError(f"--set {item}: expected KEY=VALUE, e.g. --set batch=4")
        value: Any = text
        for number in (int, float):
            try:
                value = number(text)
                break
            except ValueError:
                pass
        kwargs[key] = value if not isinstance(value, float) or math.isfinite(value) else text
    return kwargs


def _build(where: str, builder: Any, *args: Any, **kwargs: Any) -> Any:
    """``builder(*args, **kwargs)``; an error in it is a ``ValueError`` naming ``where``."""
    try:
        return builder(*args, **kwargs)
    except Exception as error:
        raise ValueError(f"{where}: {_one_line(error)}") from error


def _planned_for(prof: Any, verb: str = "planned") -> str:
    """The device and timing the CLI planned for: its defaults are not ``optimize``'s."""
    timing = "estimated" if prof.timing == "estimate" else "measured"
    return f"{verb} for {prof.device} ({timing} timing; --device/--timing to change)"


def _profile(model: Any, args: argparse.Namespace) -> Any:
    """The model's training step profiled as ``optimize`` profiles it."""
    from planner import profile_model

    started = time.perf_counter()
    step = profile_model(model.model, model.example_inputs, loss_fn=model.loss_fn,
                         progress=not args.quiet, **from_cli(args, (PROFILING,)))
    prof = step.profile
    log.info("profiled %s in %.1f s: %d ops, %d module calls", model.name,
             time.perf_counter() - started, len(prof.nodes), len(prof.module_calls))
    return step


def _print_profile(prof: Any, top: int) -> None:
    from planner.plan import format_bytes

    print(prof.summary())
    saved: dict[int, int] = {}
    for node in prof.nodes:
        for sid in node.saved_storages:
            storage = prof.storages[sid]
            if storage.kind in ("activation", "internal"):
                saved[storage.producer] = saved.get(storage.producer, 0) + storage.nbytes
    print(f"\n  largest saved activations (top {top}), by producing op:")
    print(f"  {'op':<32} {'module':<28} {'saved':>10} {'fwd ms':>8} {'bwd ms':>8}")
    for index, nbytes in sorted(saved.items(), key=lambda kv: -kv[1])[:top]:
        node = prof.nodes[index]
        print(f"  {node.name[:32]:<32} {node.module[:28]:<28} {format_bytes(nbytes):>10} "
              f"{node.fwd_time_ms:>8.3f} {node.bwd_time_ms:>8.3f}")


def cmd_profile(args: argparse.Namespace) -> int:
    model = _load_model(args.model, args.set)
    prof = _profile(model, args).profile
    _print_profile(prof, args.top)
    prof.save(args.out)
    print(f"\n{_planned_for(prof, 'profiled')}\nprofile written to {args.out}")
    return 0


def _print_and_save(plan: Any, out: Path) -> int:
    """A plan's or a plan table's summary, and the file it is saved to."""
    print(plan.summary())
    plan.save(out)
    profile = plan.plans[-1].profile if hasattr(plan, "entries") else plan.profile
    print(f"\n{_planned_for(profile)}\n{'plans' if hasattr(plan, 'entries') else 'plan'} "
          f"written to {out}")
    return 0


def _envelope(args: argparse.Namespace) -> Any:
    """The batches ``--max-length``, ``--buckets`` and ``--resident-batches`` name (None:
    the example batch's shape only)."""
    if args.max_length is None and args.resident_batches == 1:
        if args.buckets != "one":
            raise ValueError("--buckets needs --max-length: buckets are of lengths")
        return None
    from planner import Envelope

    return Envelope(max_length=args.max_length, buckets=args.buckets,
                    resident_batches=args.resident_batches)


def cmd_optimize(args: argparse.Namespace) -> int:
    from planner import optimize

    model = _load_model(args.model, args.set)
    plan = optimize(model.model, model.example_inputs, budget_gb=args.budget_gb,
                    loss_fn=model.loss_fn, progress=not args.quiet, envelope=_envelope(args),
                    **from_cli(args))
    return _print_and_save(plan, args.out)


def cmd_show(args: argparse.Namespace) -> int:
    from planner import Plan, PlanTable

    with open(args.plan, "rb") as file:  # a table names its envelope first
        head = file.read(256)
    plan = PlanTable.load(args.plan) if b'"envelope"' in head else Plan.load(args.plan)
    print(plan.summary())
    if args.html is not None:
        from planner.reports.report import write_html_report

        write_html_report(plan, args.html)
        print(f"\nHTML report written to {args.html}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Plan the zoo's GPT-style model at a budget that forces checkpointing, apply the plan
    to the model and measure one training step of it."""
    from planner import solve, verify
    from planner.plan import format_bytes

    model = _load_model("gpt", [f"size={args.size}"])
    step = _profile(model, args)
    unplanned = step.unplanned_peak_bytes
    static = step.profile.static.total_bytes
    budget = int(static + args.fraction * (unplanned - static))
    print(f"{model.name}: unplanned peak {format_bytes(unplanned)}, static "
          f"{format_bytes(static)}; planning at static + {100 * args.fraction:.0f} % of the "
          f"activations = {format_bytes(budget)}\n")
    plan = solve(step, budget_bytes=budget, **from_cli(args, (SEARCH,)))
    status = _print_and_save(plan, args.out)
    report = verify(model.model, plan, model.example_inputs, model.loss_fn)
    print(f"\none measured training step of the planned model ({report.device}):\n  "
          f"{report.summary()}")
    return status if report.within_budget and report.grads_equal else 1


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (``--help`` has the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _budget_gb(text: str) -> float:
    """``--budget-gb``: a positive, finite number of GiB, at least a KiB and at most what
    ``optimize`` accepts."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of GiB "
                                         f"(2**30 bytes), got {text!r}")
    from planner.api import MAX_BUDGET_BYTES, MIN_BUDGET_BYTES

    if value * GIB < MIN_BUDGET_BYTES:
        raise argparse.ArgumentTypeError(f"{text} GiB is below one KiB, which no training "
                                         "step fits; the budget is in GiB, e.g. --budget-gb 8")
    if value * GIB > MAX_BUDGET_BYTES:
        raise argparse.ArgumentTypeError(f"{text} GiB is more than 2**60 bytes; give a "
                                         "budget a device could have")
    return value


def _fraction(text: str) -> float:
    value = positive(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m planner", description="Activation-checkpointing planner.")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bars and no progress messages")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="-v: every library's messages and tracebacks of errors; "
                        "-vv: solver internals too")
    sub = parser.add_subparsers(dest="command", required=True)

    def timing_options(p: argparse.ArgumentParser, out: str) -> None:
        cli_flags(p, CLI_DEFAULTS, (PROFILING,))
        p.add_argument("--top", type=_count, default=10, help="rows in the table")
        p.add_argument("--out", type=Path, default=Path(out),
                       help=f"write the JSON here (default {out})")

    def solver_options(p: argparse.ArgumentParser) -> None:
        cli_flags(p, CLI_DEFAULTS, (SEARCH,))

    demo = sub.add_parser("demo", help="plan the built-in GPT-style model")
    demo.add_argument("--size", default="small", help="zoo GPT size: tiny, small, gpt2, "
                      "gpt2-medium")
    demo.add_argument("--fraction", type=_fraction, default=0.5,
                      help="budget = static + this fraction of the unplanned activations")
    timing_options(demo, "demo-plan.json")
    solver_options(demo)
    demo.set_defaults(func=cmd_demo)

    opt = sub.add_parser("optimize", help="plan a model under a memory budget")
    opt.add_argument("--model", required=True,
                     help=MODEL_HELP)
    opt.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="zoo builder argument, e.g. --set batch=4 (repeatable)")
    opt.add_argument("--budget-gb", type=_budget_gb, required=True,
                     help="peak GiB (2**30 bytes) of one training step")
    cli_flags(opt, CLI_DEFAULTS, (STEP, COMPILING))
    opt.add_argument("--max-length", type=_count, default=None, metavar="TOKENS",
                     help="plan every batch of up to this many tokens per row, padded or "
                     "not (a plan table; default: the example batch's shape only)")
    opt.add_argument("--buckets", default="one", choices=["one", "pow2"],
                     help="with --max-length: one plan for the longest batch, or one per "
                     "power of two (short batches recompute less)")
    opt.add_argument("--resident-batches", type=_count, default=1, metavar="K",
                     help="batches on the device during a step (Hugging Face Trainer: its "
                     "gradient_accumulation_steps)")
    timing_options(opt, "plan.json")
    solver_options(opt)
    opt.set_defaults(func=cmd_optimize)

    show = sub.add_parser("show", help="print a saved plan")
    show.add_argument("plan", type=Path)
    show.add_argument("--html", type=Path, default=None, metavar="PATH",
                      help="also write a self-contained HTML report (plan table and plots)")
    show.set_defaults(func=cmd_show)

    prof = sub.add_parser("profile", help="profile a model's training step")
    prof.add_argument("--model", required=True,
                      help=MODEL_HELP)
    prof.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="zoo builder argument, e.g. --set batch=4 (repeatable)")
    timing_options(prof, "profile.json")
    prof.set_defaults(func=cmd_profile)
    return parser


class _Stderr(logging.StreamHandler):
    """Messages to ``sys.stderr`` as it is when they come (tests and notebooks swap it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


_HANDLER = _Stderr()


def _configure_logging(verbose: int, quiet: bool) -> None:
    """Warnings from everything; the planner's own progress messages unless ``quiet``;
    ``-v`` every library's INFO, ``-vv`` DEBUG (solver internals)."""
    root = logging.getLogger()
    if _HANDLER not in root.handlers:
        root.addHandler(_HANDLER)
    root.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO if verbose
                  else logging.WARNING)
    logging.getLogger("planner").setLevel(logging.WARNING if quiet else logging.NOTSET
                                          if verbose else logging.INFO)


def _one_line(error: BaseException) -> str:
    """The error's message on one line; pydantic's as ``field: problem; ...``."""
    from pydantic import ValidationError

    from planner.plan import InfeasibleBudgetError
    from profiles.errors import LossNotFoundError

    if isinstance(error, ValidationError):
        return f"{error.title}: " + "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    if isinstance(error, LossNotFoundError):  # the CLI takes no loss_fn= of its own
        text = str(error.with_remedy(
            "give --model a function returning (model, batch, loss_fn), or a "
            "planner.zoo.ZooModel with its loss_fn (for Hugging Face models, a batch with "
            "`labels` makes the output carry its loss)."))
    if isinstance(error, InfeasibleBudgetError):
        text = error.shell_message or f"{text} From the shell: --budget-gb " \
            f"{error.min_budget_gb!r}."
    return " ".join(text.split()) or type(error).__name__


def _check_out(args: argparse.Namespace) -> None:
    """An ``--out`` that cannot be written is refused before profiling, not after."""
    out = getattr(args, "out", None)
    if out is not None and not out.parent.is_dir():
        raise FileNotFoundError(f"--out {out}: the directory {out.parent} does not exist")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose, args.quiet)
    try:
        _check_out(args)
        return args.func(args)
    except USER_ERRORS as error:
        if args.verbose:
            traceback.print_exc()
        print(f"{parser.prog}: error: {_one_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
