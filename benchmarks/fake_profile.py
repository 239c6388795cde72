"""Plan a GPU run from a machine without one: the fake profile against the real program.

    python benchmarks/fake_profile.py            # all three parts (about 5 minutes, 2 cores)
    python benchmarks/fake_profile.py --quick    # the small Llama only

1. HF Llama (2 layers x 512, seq 2048, SDPA): activation storage bytes of the real-CPU
   profile, the meta profile for the CPU, and the meta profile for an H100, with the
   attention kernel each ran.
2. A Llama-3-8B shape (32 x 4096, GQA 8 kv heads, vocab 128,256), batch 1 x 8192, bf16
   autocast, meta device, for an H100: the unplanned peak, the plan at 78 GiB and its
   predicted overhead, with the attention kernel torch would pick there, against the same
   profile forced to the math kernel (``sdpa_kernel(MATH)``, what the meta device used to
   run), and a hand count of what the fused kernel saves per layer.
3. GPT-2-medium (zoo ``gpt``, eager attention, batch 8 x 1024, fp32) unplanned step time
   estimated for an H100, against the step measured on one (573 ms, DESIGN.md).

Every number is from ``profiles.profile`` and ``solvers.simulate`` (through ``Plan``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import resource
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import profiles
from planner import solve, zoo
from planner.api import profile_model
from profiles.kernels import ATTENTION_OPS, attention_kernels

GIB = 2**30
RESULTS = Path(__file__).parent / "results" / "fake-profile-cpu.json"
H100_GPT2_MEDIUM_MEASURED_MS = 573.0  # DESIGN.md, HF GPT-2-medium, batch 8 x 1024, fp32
SMALL_LLAMA = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)


def _kernels(prof: profiles.GraphProfile) -> str:
    return ", ".join(f"{k} x{n}" for k, n in attention_kernels(
        [node.target for node in prof.nodes]).items()) or "none"


def small_llama() -> list[dict[str, Any]]:
    rows = []
    for label, device, target in [("real CPU", "cpu", "cpu"), ("meta, for the CPU", "meta",
                                  "cpu"), ("meta, for an H100", "meta", "H100")]:
        m = zoo.get("hf-llama", size="tiny", batch=1, seq_len=2048, device=device,
                    **SMALL_LLAMA)
        prof = profiles.profile(m.model, m.example_inputs, device=target, timing="estimate",
                                progress=False)
        rows.append(dict(profile=label, execution=prof.execution,
                         saved_bytes=prof.saved_activation_bytes(), attention=_kernels(prof)))
    real = rows[0]["saved_bytes"]
    print("\n1. HF Llama 2 x 512, seq 2048: activation storages autograd saves")
    print(f"{'profile':<20} {'tensors':<8} {'saved MB':>10} {'vs real':>9}  attention kernel")
    for row in rows:
        row["vs_real"] = row["saved_bytes"] / real - 1
        print(f"{row['profile']:<20} {row['execution']:<8} {row['saved_bytes'] / 1e6:>10.3f} "
              f"{row['vs_real']:>+9.4%}  {row['attention']}")
    return rows


def _fused_saves_per_layer(cfg: dict[str, int], tokens: int) -> int:
    """Hand count: a fused attention saves q, k, v and its output (bf16) and the
    log-sum-exp (fp32, one per head and token); math saves the scores' softmax instead of
    the log-sum-exp, a (heads x tokens x tokens) matrix, and more."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // heads
    q_out = 2 * tokens * heads * head_dim * 2
    k_v = 2 * tokens * kv * head_dim * 2
    return q_out + k_v + 4 * tokens * heads


def llama3_8b(seq_len: int, budget_gb: float) -> list[dict[str, Any]]:
    rows = []
    for label, backend in [("kernel H100 selects", None), ("math (forced)", SDPBackend.MATH)]:
        m = zoo.get("hf-llama", size="tiny", batch=1, seq_len=seq_len, device="meta",
                    **LLAMA3_8B)
        started = time.perf_counter()
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            profiled = profile_model(m.model, m.example_inputs, autocast=torch.bfloat16,
                                     timing="estimate", device="H100", progress=False)
        profile_s = time.perf_counter() - started
        prof = profiled.profile
        attention_nodes = [n for n in prof.nodes if n.target in ATTENTION_OPS.values()]
        attention_saves = {sid for n in attention_nodes for sid in n.saved_storages
                           if prof.storages[sid].kind == "activation"}
        row = dict(attention=label, kernels=_kernels(prof), ops=len(prof.nodes),
                   attention_saved_per_layer=sum(prof.storages[sid].nbytes
                                                 for sid in attention_saves)
                   / LLAMA3_8B["num_hidden_layers"],
                   profile_s=profile_s, unplanned_peak_gib=profiled.unplanned_peak_bytes / GIB,
                   saved_gib=prof.saved_activation_bytes() / GIB,
                   step_ms=prof.fwd_time_ms + prof.bwd_time_ms)
        try:
            plan = solve(profiled, budget_gb=budget_gb, time_limit_s=60)
            row.update(plan_peak_gib=plan.predicted_peak_bytes / GIB,
                       overhead=plan.predicted_overhead, regions=len(plan.regions),
                       solver=plan.solver.name, status=plan.solver.status,
                       gap=plan.solver.gap)
        except Exception as error:  # an infeasible budget says its minimum
            row.update(plan=str(error).splitlines()[0])
        rows.append(row)
    per_layer = _fused_saves_per_layer(LLAMA3_8B, seq_len)
    print(f"\n2. Llama-3-8B shape, batch 1 x {seq_len}, bf16 autocast, meta, H100; plan at "
          f"{budget_gb:g} GiB")
    for row in rows:
        gap = f", gap {row['gap']:.1%}" if row.get("gap") is not None else ""
        plan = (f"plan peak {row['plan_peak_gib']:.2f} GiB, recompute +{row['overhead']:.1%}"
                f", {row['regions']} regions ({row['solver']}: {row['status']}{gap})"
                if "overhead" in row else row.get("plan", ""))
        print(f"  {row['attention']:<20} [{row['kernels']}] {row['ops']} ops in "
              f"{row['profile_s']:.0f} s: unplanned peak {row['unplanned_peak_gib']:.1f} GiB,"
              f" saved activations {row['saved_gib']:.1f} GiB, step {row['step_ms']:.0f} ms;"
              f" {plan}")
    print(f"  hand count: a fused attention keeps q, k, v, its output and the log-sum-exp = "
          f"{per_layer / 2**20:.1f} MiB per layer; the profile's fused attention nodes save "
          f"{rows[0]['attention_saved_per_layer'] / 2**20:.1f} MiB per layer; math keeps the "
          f"{LLAMA3_8B['num_attention_heads']} x {seq_len}^2 probabilities besides "
          f"(>= {LLAMA3_8B['num_attention_heads'] * seq_len**2 * 2 / GIB:.0f} GiB per layer)")
    return rows


def gpt2_medium() -> dict[str, Any]:
    m = zoo.get("gpt", size="gpt2-medium", batch=8, device="meta")
    prof = profiles.profile(m.model, m.example_inputs, loss_fn=m.loss_fn, device="H100",
                            timing="estimate", progress=False)
    step = prof.fwd_time_ms + prof.bwd_time_ms
    print(f"\n3. GPT-2-medium 24 x 1024, batch 8 x 1024, fp32, eager attention, H100 estimate: "
          f"forward {prof.fwd_time_ms:.0f} ms + backward {prof.bwd_time_ms:.0f} ms = "
          f"{step:.0f} ms; measured {H100_GPT2_MEDIUM_MEASURED_MS:.0f} ms "
          f"({step / H100_GPT2_MEDIUM_MEASURED_MS - 1:+.1%})")
    return dict(estimate_ms=step, measured_ms=H100_GPT2_MEDIUM_MEASURED_MS)


def _write(results: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"\nwrote {out}; peak RSS {results['peak_rss_gib']:.2f} GiB")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small Llama only")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--budget-gb", type=float, default=78.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, Any] = {"torch": torch.__version__, "small_llama": small_llama()}
    if not args.quick:
        results["llama3_8b"] = llama3_8b(args.seq_len, args.budget_gb)
        results["gpt2_medium"] = gpt2_medium()
    results["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if not args.quick:
        _write(results, args.out)


if __name__ == "__main__":
    main()
