"""Record measured profiles of the zoo models into profiles/recorded/.

Run on the machine whose timings you want (a GPU when you have one):

    python benchmarks/record_profiles.py            # CPU: small zoo sizes
    python benchmarks/record_profiles.py --cuda     # GPU: realistic sizes

Each file is named ``<model>.<device>.json``; ``profiles.load_recorded`` reads them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import profiles
from planner import zoo
from profiles.recorded import RECORDED_DIR

CPU_CASES = {
    "mlp": dict(),
    "resnet": dict(),
    "gpt-small": dict(name="gpt", size="small"),
}
CUDA_CASES = {
    "gpt2-medium": dict(name="gpt", size="gpt2-medium", batch=8),
    "resnet": dict(batch=64, image=64),
    "hf-gpt2": dict(name="hf-gpt2", n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                    batch=8, seq_len=1024),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cuda", action="store_true", help="record on the GPU")
    args = parser.parse_args()
    device = "cuda" if args.cuda else "cpu"
    cases = CUDA_CASES if args.cuda else CPU_CASES
    suffix = torch.cuda.get_device_name().split()[-1] if args.cuda else "cpu"
    for label, spec in cases.items():
        spec = dict(spec)
        name = spec.pop("name", label)
        if name not in zoo.names():
            print(f"skip {label}: needs transformers")
            continue
        model = zoo.get(name, device=device, **spec)
        inputs = model.example_inputs
        started = time.perf_counter()
        prof = profiles.profile(model.model, inputs, loss_fn=model.loss_fn, timing="measure",
                                progress=False)
        path = RECORDED_DIR / f"{label}.{suffix}.json"
        prof.save(path)
        elapsed = time.perf_counter() - started
        forward_ms, backward_ms = whole_step_ms(model, device)
        print(f"{label}: {len(prof.nodes)} nodes in {elapsed:.1f} s -> {path.name}\n"
              f"  sum of node times: forward {prof.fwd_time_ms:.2f} ms, backward "
              f"{prof.bwd_time_ms:.2f} ms\n"
              f"  whole step:        forward {forward_ms:.2f} ms, backward {backward_ms:.2f} ms"
              f"  (ratio {prof.fwd_time_ms / forward_ms:.2f}, "
              f"{prof.bwd_time_ms / backward_ms:.2f})")


def whole_step_ms(model: zoo.ZooModel, device: str, repeats: int = 7) -> tuple[float, float]:
    """Median forward and backward time of the unplanned model's whole training step."""
    loss_fn = model.loss_fn or profiles.default_loss
    args = model.example_inputs
    forward, backward = [], []
    for i in range(repeats + 2):
        begin = time.perf_counter()
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
