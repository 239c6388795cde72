"""benchmarks/kept_memory.py: CPU steps timed on memory the allocator keeps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# steps that each take 4 MiB from malloc in 100 KiB blocks (each under glibc's mmap
# threshold, so from the heap), touch them and free them, the last first, as a backward
# frees a forward's activations; prints the page faults of ten steps after three warm ones
_STEPS = f"""
import ctypes, resource, sys
sys.path.insert(0, {str(BENCHMARKS)!r})
if sys.argv[1] == "kept":
    from kept_memory import keep_freed_memory
    print(keep_freed_memory())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
BLOCK = 100 * 1024
def step():
    blocks = [libc.malloc(BLOCK) for _ in range(40)]
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)
    for b in reversed(blocks):
        libc.free(b)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    return " ".join(out[:-1]), int(out[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_steps_on_kept_memory_fault_no_pages_in_where_the_default_faults_each_step() -> None:
    default = _faults("default")[1]
    said, kept = _faults("kept")
    assert "keeping freed memory" in said
    # the default trims the freed heap top after each step: its 4 MiB faulted in again
    assert default > 10 * 1024 // 2, default
    assert kept < 100, f"{kept} page faults in ten steps on kept memory"
