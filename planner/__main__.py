"""Command line: ``python -m planner {demo,optimize,show,profile} ...``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("planner")


def _load_model(spec: str, overrides: list[str]) -> Any:
    """A zoo name (``gpt``) or ``module:attr`` naming a ZooModel factory or an nn.Module."""
    from planner import zoo

    kwargs: dict[str, Any] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        kwargs[key] = int(value) if value.lstrip("-").isdigit() else value
    if ":" not in spec:
        return zoo.get(spec, **kwargs)
    module_name, _, attr = spec.partition(":")
    target = getattr(importlib.import_module(module_name), attr)
    built = target(**kwargs) if callable(target) and not hasattr(target, "forward") else target
    if isinstance(built, zoo.ZooModel):
        return built
    return zoo.ZooModel(spec, built, None, None)


def _profile(model: Any, args: argparse.Namespace) -> Any:
    import profiles

    started = time.perf_counter()
    prof = profiles.profile(model.model, model.example_inputs, loss_fn=model.loss_fn,
                            timing=args.timing, device=args.device, progress=not args.quiet)
    log.info("profiled %s in %.1f s: %d ops, %d module calls", model.name,
             time.perf_counter() - started, len(prof.nodes), len(prof.module_calls))
    return prof


def _print_profile(prof: Any, top: int) -> None:
    print(prof.summary())
    saved: dict[int, int] = {}
    for node in prof.nodes:
        for sid in node.saved_storages:
            storage = prof.storages[sid]
            if storage.kind in ("activation", "internal"):
                saved[storage.producer] = saved.get(storage.producer, 0) + storage.nbytes
    print(f"\n  largest saved activations (top {top}), by producing op:")
    print(f"  {'op':<32} {'module':<28} {'saved MiB':>10} {'fwd ms':>8} {'bwd ms':>8}")
    for index, nbytes in sorted(saved.items(), key=lambda kv: -kv[1])[:top]:
        node = prof.nodes[index]
        print(f"  {node.name[:32]:<32} {node.module[:28]:<28} {nbytes / 2**20:>10.2f} "
              f"{node.fwd_time_ms:>8.3f} {node.bwd_time_ms:>8.3f}")


def cmd_profile(args: argparse.Namespace) -> int:
    model = _load_model(args.model, args.set)
    prof = _profile(model, args)
    _print_profile(prof, args.top)
    prof.save(args.out)
    print(f"\nprofile written to {args.out}")
    return 0


def _print_and_save(plan: Any, out: Path) -> int:
    print(plan.summary())
    plan.save(out)
    print(f"\nplan written to {out}")
    return 0


def cmd_optimize(args: argparse.Namespace) -> int:
    from planner import optimize

    model = _load_model(args.model, args.set)
    plan = optimize(model.model, model.example_inputs, budget_gb=args.budget_gb,
                    loss_fn=model.loss_fn, solver=args.solver, time_limit_s=args.time_limit,
                    timing=args.timing, device=args.device, progress=not args.quiet)
    return _print_and_save(plan, args.out)


def cmd_show(args: argparse.Namespace) -> int:
    from planner import Plan

    plan = Plan.load(args.plan)
    print(plan.summary())
    if args.html is not None:
        from planner.report import write_html_report

        write_html_report(plan, args.html)
        print(f"\nHTML report written to {args.html}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Plan the zoo's GPT-style model at a budget that forces checkpointing, apply the plan
    to the model and measure one training step of it."""
    from planner import optimize, replan, verify
    from planner.plan import format_bytes

    model = _load_model("gpt", [f"size={args.size}"])
    unplanned = optimize(model.model, model.example_inputs, budget_gb=1e6,
                         loss_fn=model.loss_fn, timing=args.timing, device=args.device,
                         progress=not args.quiet)
    static = unplanned.profile.static.total_bytes
    budget = int(static + args.fraction * (unplanned.unplanned_peak_bytes - static))
    print(f"{model.name}: unplanned peak {format_bytes(unplanned.unplanned_peak_bytes)}, "
          f"static {format_bytes(static)}; planning at static + {100 * args.fraction:.0f} % "
          f"of the activations = {format_bytes(budget)}\n")
    plan = replan(unplanned, budget_bytes=budget, solver=args.solver,
                  time_limit_s=args.time_limit)
    status = _print_and_save(plan, args.out)
    report = verify(model.model, plan, model.example_inputs, model.loss_fn)
    print(f"\none measured training step of the planned model ({report.device}):\n  "
          f"{report.summary()}")
    return status if report.within_budget and report.grads_equal else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m planner",
                                     description="Activation-checkpointing planner.")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", required=True)

    def timing_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--timing", default="estimate", choices=["auto", "measure", "estimate"],
                       help="measure on this machine, or estimate from FLOPs (default)")
        p.add_argument("--device", default="H100",
                       help="roofline for estimates: H100, H200, A100, cpu (default H100)")
        p.add_argument("--top", type=int, default=10, help="rows in the table")
        p.add_argument("--out", type=Path, default=Path("plan.json"),
                       help="write the JSON here")

    def solver_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--solver", default="auto", help="auto, cpsat, dp or a baseline name")
        p.add_argument("--time-limit", type=float, default=60.0, help="solver seconds")

    demo = sub.add_parser("demo", help="plan the built-in GPT-style model")
    demo.add_argument("--size", default="small", help="zoo GPT size: tiny, small, gpt2, "
                      "gpt2-medium")
    demo.add_argument("--fraction", type=float, default=0.5,
                      help="budget = static + this fraction of the unplanned activations")
    timing_options(demo)
    solver_options(demo)
    demo.set_defaults(func=cmd_demo, out=Path("demo-plan.json"))

    opt = sub.add_parser("optimize", help="plan a model under a memory budget")
    opt.add_argument("--model", required=True,
                     help="zoo name (mlp, resnet, gpt, hf-gpt2, hf-llama) or module:attr")
    opt.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="zoo builder argument, e.g. --set batch=4 (repeatable)")
    opt.add_argument("--budget-gb", type=float, required=True, help="peak GiB of one step")
    timing_options(opt)
    solver_options(opt)
    opt.set_defaults(func=cmd_optimize)

    show = sub.add_parser("show", help="print a saved plan")
    show.add_argument("plan", type=Path)
    show.add_argument("--html", type=Path, default=None, metavar="PATH",
                      help="also write a self-contained HTML report (plan table and plots)")
    show.set_defaults(func=cmd_show)

    prof = sub.add_parser("profile", help="profile a model's training step")
    prof.add_argument("--model", required=True,
                      help="zoo name (mlp, resnet, gpt, hf-gpt2, hf-llama) or module:attr")
    prof.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="zoo builder argument, e.g. --set batch=4 (repeatable)")
    timing_options(prof)
    prof.set_defaults(func=cmd_profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
