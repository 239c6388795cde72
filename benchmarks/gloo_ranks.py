"""Gloo ranks for the tests and benchmarks that run a step over several processes.

``torch.multiprocessing.spawn`` starts each rank as a fresh interpreter, which imports torch
and the planner again: about 3 s of a 2-core machine per rank, a third of a two-rank test.
Ranks here fork from a server process that imported them once (``forkserver``, preloaded),
so a rank starts in a fraction of a second and shares nothing else with the caller (no
threads, no CUDA state, no tensors: the server never ran a step). A rank's environment is
the server's, taken when the first ranks started: a rank sets what it needs itself
(``MASTER_ADDR``, ``MASTER_PORT``) rather than inherit later changes of the caller's.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# what the ranks import; the server imports it once, before forking the first rank. Hugging
# Face's models too (6-10 s a rank on 2 cores where each imported them), but not its Trainer:
# importing `transformers.trainer` makes two tensors, which a frozen heap would hide from a
# rank measuring all its process (`tests/test_gloo_ranks.py` checks the preload makes none)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "planner", "profiles", "solvers",
           "transformers", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.llama.modeling_llama",
           "benchmarks.forkserver_heap"]  # last: freezes the server's heap (its doc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A rank that never ends (a deadlock in a collective, a dead rank its parent never reaps)
# fails its caller after this long instead of holding the suite to CI's limit: a
# two-process step here takes under a minute, beside a loaded machine's other work too.
RANKS_TIMEOUT_S = 900.0


def spawn_ranks(fn: Callable[..., Any], args: tuple, nprocs: int,
                timeout_s: float = RANKS_TIMEOUT_S) -> None:
    """``fn(rank, *args)`` on ``nprocs`` processes forked from the preloaded server; raises
    what a rank raised, as ``torch.multiprocessing.spawn`` does, and `TimeoutError` (the
    ranks killed) where they have not all ended after ``timeout_s``."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    ranks = mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver",
                               join=False)
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            running = [rank for rank, p in enumerate(ranks.processes) if p.is_alive()]
            for p in ranks.processes:
                p.kill()
            raise TimeoutError(
                f"gloo ranks {running} of {getattr(fn, '__name__', fn)} still ran after "
                f"{timeout_s:.0f} s (killed): a rank waits on a collective another never "
                "reached, or a tracer (py-spy without --nonblocking) holds an ended rank")
