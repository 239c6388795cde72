"""Profile a Llama-2-7B-shaped model on the meta device; print the time.

Acceptance (issue 3): under 60 s on a 2-core, 24 GiB machine. No weights, no GPU: the
model is built on the meta device and its step observed under FakeTensorMode.
"""

from __future__ import annotations

import argparse
import resource
import time

import profiles
from planner import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    started = time.perf_counter()
    model = zoo.get("hf-llama", size="7b", batch=args.batch, seq_len=args.seq_len,
                    device="meta")
    built = time.perf_counter()
    prof = profiles.profile(model.model, model.example_inputs, device="H100", progress=False)
    done = time.perf_counter()
    print(prof.summary())
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"build {built - started:.1f} s, profile ({len(prof.nodes)} ops, "
          f"{len(prof.module_calls)} module calls) {done - built:.1f} s (limit 60 s), peak "
          f"RSS {peak_rss_gib:.2f} GiB")


if __name__ == "__main__":
    main()
