"""The GPU suite: the memory/time frontier in fp32 and in bf16 autocast, a torch.compile peer,
and per-op CUDA profiles, in parts meant to fit in 10 minutes each on an H100.

    python benchmarks/gpu_suite.py --part record   # profiles/recorded/<model>.<gpu>.json
    python benchmarks/gpu_suite.py --part fp32     # benchmarks/results/frontier-<gpu>-fp32.*
    python benchmarks/gpu_suite.py --part bf16     # benchmarks/results/frontier-<gpu>-bf16.*
    python benchmarks/gpu_suite.py --part offload  # benchmarks/results/offload-<gpu>.*
    python benchmarks/gpu_suite.py --part all      # every part in one process
    python benchmarks/gpu_suite.py --tiny --out DIR  # CPU, tiny GPT, every part: the smoke test

``<gpu>`` is a short name of ``torch.cuda.get_device_name()`` (``h100``). A frontier part is
``benchmarks/frontier.py``'s measurement (its functions, not a copy) of zoo ``gpt`` at
``gpt2-medium`` (24 layers, width 1024, 1024 tokens), batch 8, every strategy interleaved in
one process: the peers none, every-layer, every-2nd, every-4th, chen-sqrt-n, sac-matmuls,
sac-linear, torch.compile at each ``--compile-budgets`` (inductor; gradients compared within a
tolerance), torch's auto-SAC, then our plans at each peer's measured peak (planned under the
part's autocast). Peak: ``torch.cuda.max_memory_allocated`` of one step, less what the
process held besides the model when it began (``planner.verification.measure_step``); time:
the median of ``--steps`` steps. Dropout is 0 (``--dropout``): compiled code draws other
dropout masks than eager code (see frontier_compile.py), so its gradients could not be
compared otherwise. A part starts no measurement after ``--time-limit`` seconds (480: the
first plan's profiling, the longest single step, must still end within 10 minutes); what is
left is recorded as "not run", and its files are written all the same. 3 timed steps: a
GPT-2-medium fp32 step is 0.53 s on an H100, and a part measures some 30 strategies, each
1 + 2 x (2 warm-up + 3 timed) steps, plus two compiles and torch's estimators (not yet timed
on a GPU). ``benchmarks/gpu_lease.sh`` cuts the suite to one short call.

The offload part (``benchmarks/offload_measured.py``) measures our plans with
``offload=True`` at the H100 anchors against offloading every block (torchtune-style) and
``torch.autograd.graph.save_on_cpu``.

With ``--tiny`` the same code runs on the CPU at zoo size "tiny", with fewer peers, one
compile budget on ``aot_eager_decomp_partition`` (the min-cut partitioner honouring
``activation_memory_budget`` without code generation), and profiles written into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

# the wheels the planner and torch's auto-SAC need beyond what the device image has
WHEELS = ("ortools==9.15.6755 protobuf==6.33.6 immutabledict==4.3.1 pydantic==2.14.3 "
          "pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 "
          "typing-extensions==4.16.0 pulp==3.3.2 pwlf==2.7.0")
PARTS = ("record", "fp32", "bf16", "offload")
_DEVICE_RUN = ("python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
               "PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py "
               "--part {part} --out $OUT --profiles-dir $OUT 2>&1 | tee $OUT/{part}.log")


def setup_text() -> str:
    """The commands that run the suite on a fresh GPU machine (printed at the start)."""
    local = "".join(f"    .venv/bin/python benchmarks/gpu_suite.py --part {part}\n"
                    for part in PARTS)
    device = "".join(f"       {_DEVICE_RUN.format(part=part)}\n" for part in PARTS)
    return f"""\
How to run the suite on a fresh GPU machine (each part meant to end within 10 minutes):
  with network access, in the repo root:
    TORCH_INDEX_URL=<PyTorch's CUDA wheel index> bash scripts/bootstrap.sh
{local}  on a device machine without network (its python3 has torch with CUDA, transformers and
  matplotlib, but not ortools, pydantic, pulp, pwlf, so bootstrap.sh cannot install there):
    1. on a machine with network, in the repo root (.whl/ is git-ignored; 48 MB):
       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
         --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \\
         -d .whl {WHEELS}
    2. on the device, in a copy of the repo with .whl/ in it, one command (call) per part,
       OUT being a folder whose files come back:
{device}    3. back here: the frontier-* files into benchmarks/results/, the other .json files
       (profiles) into profiles/recorded/.
"""


GPU_PEERS = ("none", "every-layer", "every-2nd", "every-4th", "chen-sqrt-n", "sac-matmuls",
             "sac-linear", "compile", "auto-sac-milp")
TINY_PEERS = ("none", "every-layer", "sac-linear", "compile")


def _load(name: str) -> ModuleType:
    """A sibling benchmark script as a module (benchmarks/ is no package)."""
    key = f"gpu_suite_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__ + "\n" + setup_text(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="all", choices=[*PARTS, "all"])
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, zoo gpt 'tiny', few peers: the smoke test's run")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default benchmarks/results)")
    parser.add_argument("--profiles-dir", type=Path, default=None,
                        help="where --part record writes (default profiles/recorded; "
                             "with --tiny: --out)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (3; --tiny 1)")
    parser.add_argument("--time-limit", type=float, default=480.0,
                        help="seconds per part after which nothing new is started")
    parser.add_argument("--compile-budgets", type=float, nargs="*", default=None,
                        help="activation_memory_budget values (0.5 0.1; --tiny 0.5)")
    parser.add_argument("--peers", nargs="*", default=None,
                        help="peers to run ('none' always runs)")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--solve-time-limit", type=float, default=60.0,
                        help="seconds each of our solves may take (replan's time_limit_s)")
    parser.add_argument("--timing", default=None, choices=["measure", "estimate"],
                        help="how profiles time the ops (measure; --tiny and the offload part: "
                             "estimate)")
    opts = parser.parse_args(argv)
    if not opts.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device visible to torch (--tiny runs the suite on the CPU)")
    opts.out = opts.out or _load("frontier").RESULTS
    opts.profiles_dir = opts.profiles_dir or (opts.out if opts.tiny else None)
    opts.steps = opts.steps or (1 if opts.tiny else 3)
    opts.compile_budgets = tuple(opts.compile_budgets or ((0.5,) if opts.tiny else (0.5, 0.1)))
    opts.peers = opts.peers or list(TINY_PEERS if opts.tiny else GPU_PEERS)
    return opts


def _frontier_timing(opts: argparse.Namespace) -> str:
    return opts.timing or ("estimate" if opts.tiny else "measure")


def record_part(opts: argparse.Namespace, slug: str, deadline: float) -> list[Path]:
    """Per-op profiles (measured timings) of the recorded cases, into ``--profiles-dir``."""
    record_profiles = _load("record_profiles")
    if opts.tiny:
        cases: dict[str, dict[str, Any]] = {
            "gpt-tiny": dict(name="gpt", size="tiny", batch=4),
            "gpt-tiny-bf16": dict(name="gpt", size="tiny", batch=4, autocast=torch.bfloat16)}
    else:
        cases = record_profiles.CUDA_CASES
    out = opts.profiles_dir or record_profiles.RECORDED_DIR
    return record_profiles.record(cases, "cpu" if opts.tiny else "cuda", slug, out,
                                  timing=_frontier_timing(opts), deadline=deadline,
                                  repeats=1 if opts.tiny else 7)


def frontier_part(opts: argparse.Namespace, slug: str, precision: str,
                  deadline: float) -> dict[str, Any]:
    """One frontier of GPT-2 (medium; tiny on CPU) at ``precision``: its result document,
    written to ``--out/frontier-<slug>-<precision>.{json,md,png}``."""
    frontier = _load("frontier")
    device = "cpu" if opts.tiny else "cuda"
    autocast = frontier.AUTOCAST.get(precision)
    kwargs = dict(size="tiny" if opts.tiny else "gpt2-medium", batch=4 if opts.tiny else 8,
                  dropout=opts.dropout, device=device)
    started = time.perf_counter()
    timing = _frontier_timing(opts)
    rows = frontier.bench_model("gpt", kwargs, device, opts.steps, False, timing,
                                opts.peers, autocast=autocast, deadline=deadline,
                                compile_budgets=opts.compile_budgets,
                                warmup=0 if opts.tiny else 2, op_ranges=not opts.tiny,
                                solve_time_limit_s=opts.solve_time_limit)
    result = frontier.make_result(device, "tiny" if opts.tiny else "gpu-suite", opts.steps,
                                  timing, autocast, started, rows)
    result["suite"] = dict(
        model=kwargs, peers=opts.peers, compile_budgets=opts.compile_budgets,
        compile_backend=frontier.compile_backend(device), time_limit_s=opts.time_limit,
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32, command=" ".join(sys.argv))
    frontier.write_result(result, opts.out, f"frontier-{slug}-{precision}")
    return result


def offload_part(opts: argparse.Namespace, slug: str, deadline: float) -> dict[str, Any]:
    """Offload plans against offloading everything, written to ``--out/offload-<slug>.*``."""
    offload = _load("offload_measured")
    device = "cpu" if opts.tiny else "cuda"
    result = offload.bench(device, opts.tiny, opts.steps, opts.timing or "estimate", deadline,
                           opts.solve_time_limit)
    result.update(when=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv),
                  device_name=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    offload.write(result, opts.out, f"offload-{slug}")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the selected parts; returns {"record": paths, "fp32": result, "bf16": result,
    "offload": result}."""
    print(setup_text(), flush=True)
    opts = parse(argv)
    slug = "cpu" if opts.tiny else _load("record_profiles").gpu_slug(
        torch.cuda.get_device_name())
    began = time.perf_counter()
    done: dict[str, Any] = {}
    for part in PARTS if opts.part == "all" else (opts.part,):
        print(f"== part {part} ({slug}{', tiny' if opts.tiny else ''}) at "
              f"+{time.perf_counter() - began:.0f} s", flush=True)
        deadline = time.perf_counter() + opts.time_limit
        if part == "record":
            done[part] = record_part(opts, slug, deadline)
        elif part == "offload":
            done[part] = offload_part(opts, f"{slug}-tiny" if opts.tiny else slug, deadline)
        else:
            done[part] = frontier_part(opts, f"{slug}-tiny" if opts.tiny else slug, part,
                                       deadline)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"== part {part} done at +{time.perf_counter() - began:.0f} s", flush=True)
    return done


if __name__ == "__main__":
    main()
