"""Record measured profiles of the zoo models into profiles/recorded/.

Run on the machine whose timings you want (a GPU when you have one):

    python benchmarks/record_profiles.py            # CPU: small zoo sizes
    python benchmarks/record_profiles.py --cuda     # GPU: realistic sizes

Each file is named ``<model>.<device>.json`` (``<device>``: ``cpu``, or a short name of the
GPU such as ``h100``); ``profiles.load_recorded`` reads them. ``record()`` is what
``benchmarks/gpu_suite.py --part record`` calls.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import profiles
from planner import zoo
from profiles.recorded import RECORDED_DIR

CPU_CASES: dict[str, dict[str, Any]] = {
    "mlp": dict(),
    "resnet": dict(),
    "gpt-small": dict(name="gpt", size="small"),
}
CUDA_CASES: dict[str, dict[str, Any]] = {
    "gpt2-medium": dict(name="gpt", size="gpt2-medium", batch=8),
    "gpt2-medium-bf16": dict(name="gpt", size="gpt2-medium", batch=8, autocast=torch.bfloat16),
    "resnet": dict(batch=64, image=64),
    "hf-gpt2": dict(name="hf-gpt2", n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                    batch=8, seq_len=1024),
}
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct"}


def gpu_slug(name: str) -> str:
    """A short file-name part for a GPU: "NVIDIA H100 80GB HBM3" -> "h100",
    "NVIDIA A100-SXM4-80GB" -> "a100", "NVIDIA GeForce RTX 4090" -> "rtx-4090"."""
    words = [w for w in re.split(r"\s+", name.strip()) if w.lower() not in _VENDOR_WORDS]
    kept: list[str] = []
    for word in words:
        kept.append(word.split("-")[0])
        if any(c.isdigit() for c in word):
            break
    slug = re.sub(r"[^a-z0-9]+", "-", "-".join(kept).lower()).strip("-")
    return slug or "gpu"


def record(cases: dict[str, dict[str, Any]], device: str, suffix: str,
           out_dir: Path = RECORDED_DIR, *, timing: str = "measure",
           deadline: float | None = None, repeats: int = 7) -> list[Path]:
    """Profile each case (zoo name and overrides; ``autocast``: a dtype to profile under)
    into ``out_dir/<label>.<suffix>.json``; print how the profile's times compare with the
    whole step's (median of ``repeats``). Past ``deadline`` (a ``time.perf_counter()``
    value) the rest is skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for label, spec in cases.items():
        spec = dict(spec)
        name, autocast = spec.pop("name", label), spec.pop("autocast", None)
        if name not in zoo.names():
            print(f"skip {label}: needs transformers", flush=True)
            continue
        if deadline is not None and time.perf_counter() > deadline:
            print(f"skip {label}: the run's time limit was reached", flush=True)
            continue
        model = zoo.get(name, device=device, **spec)
        started = time.perf_counter()
        prof = profiles.profile(model.model, model.example_inputs, loss_fn=model.loss_fn,
                                autocast=autocast, timing=timing, progress=False)
        path = out_dir / f"{label}.{suffix}.json"
        prof.save(path)
        written.append(path)
        elapsed = time.perf_counter() - started
        forward_ms, backward_ms = whole_step_ms(model, device, repeats, autocast)
        print(f"{label}: {len(prof.nodes)} nodes in {elapsed:.1f} s -> {path}\n"
              f"  sum of node times: forward {prof.fwd_time_ms:.2f} ms, backward "
              f"{prof.bwd_time_ms:.2f} ms\n"
              f"  whole step:        forward {forward_ms:.2f} ms, backward {backward_ms:.2f} ms"
              f"  (ratio {prof.fwd_time_ms / forward_ms:.2f}, "
              f"{prof.bwd_time_ms / backward_ms:.2f})", flush=True)
        del model, prof
        if device == "cuda":
            torch.cuda.empty_cache()
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true", help="record on the GPU")
    parser.add_argument("--out", type=Path, default=RECORDED_DIR,
                        help="folder to write to (default: profiles/recorded)")
    args = parser.parse_args(argv)
    device = "cuda" if args.cuda else "cpu"
    suffix = gpu_slug(torch.cuda.get_device_name()) if args.cuda else "cpu"
    record(CUDA_CASES if args.cuda else CPU_CASES, device, suffix, args.out)


def whole_step_ms(model: zoo.ZooModel, device: str, repeats: int = 7,
                  autocast: torch.dtype | None = None) -> tuple[float, float]:
    """Median forward and backward time of the unplanned model's whole training step."""
    loss_fn = model.loss_fn or profiles.default_loss
    args = model.example_inputs
    forward, backward = [], []
    for i in range(repeats + 2):
        begin = time.perf_counter()
        with (contextlib.nullcontext() if autocast is None
              else torch.autocast(device, dtype=autocast)):
            out = model.model(**args) if isinstance(args, dict) else model.model(*args)
            loss = loss_fn(out)
        if device == "cuda":
            torch.cuda.synchronize()
        middle = time.perf_counter()
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            forward.append((middle - begin) * 1e3)
            backward.append((time.perf_counter() - middle) * 1e3)
        model.model.zero_grad(set_to_none=True)
    return statistics.median(forward), statistics.median(backward)


if __name__ == "__main__":
    main()
