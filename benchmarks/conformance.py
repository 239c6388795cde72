"""Conformance on real models nobody here wrote: plan, apply, measure, compare.

    python benchmarks/conformance.py                 # every case, fp32 and bf16 autocast
    python benchmarks/conformance.py --models resnet18 T5   # a subset (substring match)

Each case (``conformance_harness.CASES``: torchvision, timm, Hugging Face transformers and
hand-written failure-class models, random-init, CPU-sized) is profiled once and planned at
static memory + 30, 50 and 80 % of its activations (and at the named minimum when a budget
is infeasible), applied, and one training step measured (``planner.measure.PeakTracker``)
against the unplanned model from the same state; then again profiled, planned and run under
bf16 autocast at + 50 %. Prints one table and writes
``benchmarks/results/conformance-cpu.{json,md}``. Every number is measured in that run.

    python benchmarks/conformance.py --offload       # OFFLOAD_MODELS, offload=True, + 50 %

plans with offload allowed (`solvers.joint`) at + 50 %, fp32 and bf16 autocast, on the
models of `OFFLOAD_MODELS`, and writes ``conformance-offload-cpu.{json,md}``. On the CPU
"host" and "device" are one memory: what this measures is the mechanics (the tracker
counts the hooks' host copies apart, the device peak must equal the prediction, gradients
bit-identical), not a saving.

    python benchmarks/conformance.py --functions     # autograd Functions in every block

runs every case whose model has repeated blocks with activations in them with a
straight-through estimator and a fused op written as autograd Functions around the first
activation of each block (`custom_functions`), at the same budgets and precisions, and
writes ``conformance-functions-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch
from conformance_harness import (
    CASES,
    Row,
    check_case,
    markdown_table,
    model_table,
    summary,
)
from custom_functions import with_functions

RESULTS = Path(__file__).resolve().parent / "results"
# ten conformance models for --offload: transformers, convnets, a U-Net, in-place ops
OFFLOAD_MODELS = ("torchvision resnet18", "torchvision convnext_tiny", "torchvision swin_t",
                  "timm vit_tiny_patch16_224", "HF GPT2LMHeadModel", "HF BertForMaskedLM",
                  "HF LlamaForCausalLM", "HF MixtralForCausalLM", "U-Net",
                  "in-place add_/relu_")


def render_markdown(result: dict, offload: bool = False, functions: bool = False) -> str:
    """The results file: the summary, one line per model, then every planned budget."""
    rows = [Row(**r) for r in result["rows"]]
    s = result["summary"]
    title = ("Conformance with offload=True (CPU: host and device are one memory; the "
             "tracker counts the hooks' host copies apart)" if offload
             else "Conformance with autograd Functions in every block (CPU): a "
             "straight-through estimator and a fused SiLU around each block's first "
             "activation (custom_functions.py)" if functions
             else "Conformance on real models (CPU)")
    skipped = "".join(f"\n- skipped: {line}" for line in result.get("skipped", []))
    return (
        f"# {title}\n\n{result['date']}, {result['machine']}, "
        f"{result['seconds']} s. {s['models']} models, {s['rows']} planned budgets, "
        f"{s['ok']} fully conformant. Worst prediction error {s['worst_error_pct']:+.3f} %"
        f" ({s['worst_error_model']}); longest solve {s['max_solve_s']:.1f} s."
        f"{_proofs(s)}{skipped}\n\n"
        f"## Per model\n\n\"holds\": measured peak within budget, losses, gradients and "
        f"buffers equal to the unplanned model. \"min X\": the budget was infeasible and "
        f"the error named X, which was then asked for and held.\n\n"
        f"{model_table(rows)}\n\n## Every planned budget\n\n{markdown_table(rows)}\n")


def _proofs(s: dict) -> str:
    if "planned" not in s:
        return ""
    return (f" Of {s['planned']} plans, {s['proven']} proven optimal over their solver's "
            f"space and {s['within_1pct']} within 1 % of it.")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=None,
                        help="run the cases whose name contains any of these")
    parser.add_argument("--time-limit", type=float, default=20.0, help="solver seconds")
    parser.add_argument("--no-autocast", action="store_true",
                        help="skip the bf16 autocast pass")
    parser.add_argument("--offload", action="store_true",
                        help="plan OFFLOAD_MODELS with offload=True at + 50 %% instead")
    parser.add_argument("--functions", action="store_true",
                        help="the cases with autograd Functions in their blocks")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the .md from the recorded .json")
    args = parser.parse_args(argv)
    stem = "conformance-offload-cpu" if args.offload else \
        "conformance-functions-cpu" if args.functions else "conformance-cpu"
    if args.render:
        result = json.loads((args.out / f"{stem}.json").read_text())
        (args.out / f"{stem}.md").write_text(render_markdown(result, args.offload,
                                                             args.functions))
        return result
    torch.set_num_threads(2)
    wanted = args.models or (OFFLOAD_MODELS if args.offload else None)
    cases = [c for c in CASES if not wanted or any(m.lower() in c.name.lower()
                                                    for m in wanted)]
    rows, skipped = [], []
    started = time.perf_counter()
    for case in cases:
        if case.needs and importlib.util.find_spec(case.needs) is None:
            skipped.append(f"{case.name}: needs {case.needs}")
            continue
        if args.functions:
            found = with_functions(case)
            if found is None:
                skipped.append(f"{case.name}: no activation module inside repeated blocks")
                continue
            case = found
        t0 = time.perf_counter()
        fractions = (0.5,) if args.offload else (0.3, 0.5, 0.8)
        # offload on the CPU: times estimated for it, whose copies are synchronous as the
        # hooks' are here (an H100 estimate would free device memory later than they do)
        device = "cpu" if args.offload else None
        case_rows = check_case(case, fractions, time_limit_s=args.time_limit,
                               offload=args.offload, device=device)
        if not args.no_autocast:
            case_rows += check_case(case, (0.5,), time_limit_s=args.time_limit,
                                    autocast=torch.bfloat16, offload=args.offload,
                                    device=device)
        rows += case_rows
        status = "ok" if all(r.ok for r in case_rows) else "FAILED"
        print(f"{case.name}: {status} in {time.perf_counter() - t0:.1f} s", flush=True)
        for r in case_rows:
            if not r.ok:
                print(f"    {r.precision} {r.budget}: {'; '.join(r.failures)}", flush=True)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary(rows),
        "skipped": skipped,
        "rows": [asdict(r) for r in rows],
    }
    print("\n" + markdown_table(rows))
    print(json.dumps(result["summary"], indent=1))
    if not args.models:  # a subset does not overwrite the full record
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"{stem}.md").write_text(render_markdown(result, args.offload,
                                                             args.functions))
    return result


if __name__ == "__main__":
    main()
