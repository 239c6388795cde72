"""Training steps measured by the CPU allocator's events, on batches of every length: what
the compiled-trainer benchmarks (`compile_trainer.py`, `compile_lightning.py`) share, their
command line and report included.

A compiled step's buffers are allocated by inductor's generated code, which no dispatch
mode sees; the profiler records every allocation and free of the CPU allocator. One
profiler runs from training's start (after the switch planned) to its end, and each step is
marked by a ``record_function``: replayed in time order, the events give what every tensor
made since holds (gradients, the optimizer's state, batches, activations, compiled code's
buffers, what a step leaves to the next) at most within each step, plus the parameters and
buffers made before. The peaks are absolute, as a plan's budget is; nothing is left out for
a block allocated before a step and freed in it (``planner.measure.allocator_peak``
measures one call).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

MARK = "measured training_step "
MIB = 2**20


def random_rows(vocab: int, count: int, shortest: int, longest: int) -> list[dict]:
    """``count`` rows of token ids of random lengths (the first is ``longest``: the set's
    longest row is the envelope's)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=gen)
    lengths[0] = longest
    return [{"input_ids": torch.randint(0, vocab, (int(n),), generator=gen)} for n in lengths]


def pad_to_longest(rows: list[dict]) -> dict[str, torch.Tensor]:
    """A batch padded to its longest row: ids 0, mask 0 and labels -100 at the pads."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row["input_ids"])] = row["input_ids"]
        mask[i, :len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


class AllocatorSteps:
    """``start(tensors)`` (those made before training: parameters, buffers), a ``step(i)``
    context around each measured step, ``stop()``: each step's absolute peak (module doc)."""

    def __init__(self) -> None:
        self.prof: torch.profiler.profile | None = None
        self.static = 0

    def start(self, tensors: Iterable[torch.Tensor]) -> None:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors}
        self.static = sum(storages.values())
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                           profile_memory=True)
        self.prof.start()

    @staticmethod
    def step(index: int) -> contextlib.AbstractContextManager:
        return torch.profiler.record_function(f"{MARK}{index}")

    def stop(self) -> list[int]:
        """Each marked step's peak, in the order of their indices."""
        from torch._C._profiler import _EventType

        assert self.prof is not None, "start() first"
        self.prof.stop()
        events, windows = [], {}
        stack = list(self.prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.name.startswith(MARK):
                windows[int(node.name[len(MARK):])] = (node.start_time_ns, node.end_time_ns)
            elif node.typed[0] == _EventType.Allocation and \
                    str(node.typed[1].device) == "cpu":
                events.append((node.start_time_ns, node.typed[1].alloc_size,
                               node.typed[1].ptr))
            stack.extend(node.children)
        return [self.static + most_within(sorted(events), *windows[i]) for i in sorted(windows)]


def most_within(events: list[tuple[int, int, int]], start: int, end: int) -> int:
    """The most the blocks allocated since the events began hold within [start, end]."""
    allocated: dict[int, int] = {}
    live = most = 0
    for when, size, ptr in events:
        if when > end:
            break
        if size < 0 and allocated.pop(ptr, None) is None:
            continue  # allocated before the events began
        if size > 0:
            allocated[ptr] = size
        live += size
        if when >= start:
            most = max(most, live)
    return most


def arguments(description: str, models: list[str], argv: list[str]) -> argparse.Namespace:
    """The benchmarks' command line: models, steps, the rows' lengths, the budget's share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", nargs="+", default=models, choices=models)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--shortest", type=int, default=8)
    parser.add_argument("--longest", type=int, default=64)
    parser.add_argument("--share", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def command(script: str, argv: list[str]) -> str:
    """The command that reproduces a run, as its results' heading says it: ``argv`` without
    ``--out`` (where the files went is not how they were measured)."""
    kept = [a for i, a in enumerate(argv) if a != "--out" and (i == 0 or argv[i - 1] != "--out")]
    return " ".join(["python", f"benchmarks/{script}", *kept])


def run_and_write(args: argparse.Namespace, run: Callable[[str], dict], stem: str,
                  heading: list[str]) -> None:
    """``run`` each model ``args`` names, saying each verdict, then write ``stem``'s json
    and markdown (:func:`report`) under ``args.out``."""
    rows = []
    for name in args.models:
        rows.append(run(name))
        print(f"{name}: {rows[-1]['within']} of {rows[-1]['measured']} steps within budget, "
              f"{rows[-1]['seconds']} s", flush=True)
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (args.out / f"{stem}.md").write_text(report(heading, rows))


def report(heading: list[str], rows: list[dict]) -> str:
    """``heading``'s lines, then per model its budget, peaks and verdict, and each step's
    tokens, padding, compile and peak, planned and plain, with both runs' losses."""
    lines = [*heading, "",
             "| model | budget | unplanned compiled (largest step) | plan's measured peak | "
             "steps within budget | planned on | seconds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        batches = "; ".join(f"{label} {peak / MIB:.3f}" for label, peak in r["plan_batches"])
        lines.append(f"| {r['model']} | {r['budget_bytes'] / MIB:.3f} | "
                     f"{r['unplanned_peak_bytes'] / MIB:.3f} | "
                     f"{r['plan_peak_bytes'] / MIB:.3f} ({r['source']}) | "
                     f"{r['within']} of {r['measured']} | {batches} | {r['seconds']} |")
    lines += ["", "Each step: tokens, padded, compiled in it, peak MiB (planned; plain).", ""]
    for r in rows:
        lines.append(f"- {r['model']}: " + ", ".join(
            f"{n}{'p' if pad else ''}{'*' if comp else ''} {peak / MIB:.3f}"
            for n, pad, comp, peak in r["steps_planned"]) + " (plain: " + ", ".join(
            f"{n}{'*' if comp else ''} {peak / MIB:.3f}"
            for n, _, comp, peak in r["steps_plain"]) + ")")
        lines.append(f"  losses planned / plain: {r['losses'][1]} / {r['losses'][0]}")
    return "\n".join(lines) + "\n"
