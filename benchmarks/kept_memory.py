"""CPU steps timed on memory the allocator keeps, as a GPU's caching allocator keeps it.

glibc's malloc hands freed memory back to the system (blocks above its mmap threshold;
the heap's top once it exceeds the trim threshold), so a CPU step page-faults part of its
activations in afresh, and how much depends on the allocator's state and on what the plan
keeps: ResNet b16 on 2 cores measured 0-1,152 faults a step, its plain step 14.4-20.5 ms
in one process. A GPU step pays none of that (the caching allocator keeps its blocks),
nor does a CPU step on jemalloc or tcmalloc, which PyTorch's CPU performance guide advises;
the clock (`solvers.clock`) prices host work, not page faults. So the CPU benchmarks that
set predicted against measured time keep freed memory in their process
(`keep_freed_memory`: no faults a step after the first), every row and peer alike, and
say so in their results. Measured with `benchmarks/few_regions.py` (2026-12-04, three
repeats of each plan): ResNet's repeats spread a median 1.7 points on kept memory against
3.7 (its median error 1.8 against 4.2); GPT small's and HF Llama's no narrower (2.4 / 5.2
against 2.3 / 3.2).
"""

from __future__ import annotations

import argparse
import ctypes
import sys

__all__ = ["DEFAULT_MALLOC", "add_allocator_flag", "chosen_allocator", "keep_freed_memory"]

DEFAULT_MALLOC = "glibc's malloc as it is"

# mallopt's parameters (malloc.h) and glibc's ceiling for the mmap threshold on 64 bits
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 << 20
TRIM_NEVER = 2**31 - 1


def keep_freed_memory() -> str:
    """Make glibc's malloc keep what the process frees (never trim its heap; allocate up
    to 32 MiB from the heap); returns what the process's allocator now is, for a results
    file. Elsewhere than Linux with glibc it changes nothing and says so."""
    if not sys.platform.startswith("linux"):
        return f"the system's allocator ({sys.platform}), as it is"
    try:
        libc = ctypes.CDLL("libc.so.6")
        kept = libc.mallopt(M_TRIM_THRESHOLD, TRIM_NEVER) and \
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    except (OSError, AttributeError):
        return "the system's allocator (no glibc mallopt), as it is"
    if not kept:
        return "glibc malloc with its defaults (mallopt refused the settings)"
    return ("glibc malloc keeping freed memory (M_TRIM_THRESHOLD 2 GiB, M_MMAP_THRESHOLD "
            "32 MiB: `benchmarks/kept_memory.py`)")


def add_allocator_flag(parser: argparse.ArgumentParser) -> None:
    """``--default-malloc``: time on glibc's defaults, to compare (`chosen_allocator`)."""
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc as it is (default: keep freed memory, "
                             "as the frontier times its rows)")


def chosen_allocator(args: argparse.Namespace) -> str:
    """Freed memory kept unless ``args`` asked for glibc's defaults; what the process's
    allocator is, in words."""
    return DEFAULT_MALLOC if args.default_malloc else keep_freed_memory()
