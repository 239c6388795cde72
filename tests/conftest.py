from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from planner import zoo
from planner.solution_memo import ANSWERS

# Property tests search the same examples on every run: CI on a shared machine gives the
# same verdict twice (a failure found by a random search is reproduced, not luck).
settings.register_profile("repeatable", derandomize=True)
settings.load_profile("repeatable")

# the host's checkpoint constants are measured in each test process, not read from the
# user's cache (profiles.host_costs; its own tests give it a directory)
os.environ["CHECKPOINT_PLANNER_CACHE"] = "off"

# the conformance harness lives beside the benchmarks that run it, not in the library
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# The modules holding the suite's longest tests (a notebook, processes over gloo, trainers,
# whole searches) run first: the two workers take tests in collection order, and a long one
# collected late runs alone at the end while the other worker waits (longest first balances
# them). Scheduling only: every test runs, in its own module's order.
FIRST = ("test_notebook.py", "test_hf_trainer.py", "test_hf_accelerate.py", "test_offload.py",
         "test_distributed.py", "test_api.py", "test_gpu_suite_smoke.py", "test_pipeline.py",
         "test_parallel.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Each test process freezes the heap its imports and collection made (torch,
    transformers, the test modules: ~785,000 objects), as `benchmarks/forkserver_heap.py`
    does for gloo ranks. A measure that lists every tensor alive (`PeakTracker` with
    ``follow_resizes``) then collects and lists the young objects only (0.5 s a measure
    less), and so do the interpreter's own full collections. A frozen object is still freed
    by its count; a frozen tensor is one no measure lists, so only a few KiB of constants
    (libraries' and parameters of tests) may be alive here."""
    gc.collect()
    # types, not isinstance: deprecated objects warn on __class__ (`planner.measure`)
    alive = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    made = sum(t.untyped_storage().nbytes() for t in alive if t.device.type != "meta")
    if made > FROZEN_TENSOR_BYTES:
        raise pytest.UsageError(
            f"{len(alive)} tensors ({made / 2**20:.1f} MiB) are alive after collection: make "
            "a test's tensors and models inside the test (or a fixture), not at import or in "
            "parametrize, so that no frozen tensor hides from PeakTracker")
    gc.freeze()


FROZEN_TENSOR_BYTES = 2**20


# Small sizes keep the suite fast on 2 CPU cores, with batches large enough that
# activations, not parameters and their gradients, dominate memory (so budgets bite).
ZOO_CASES = {
    "mlp": {"batch": 1024, "width": 128, "depth": 4},
    "resnet": {"batch": 16},
    "gpt": {"size": "tiny", "batch": 4},
    "hf-gpt2": {"batch": 4},
    "hf-llama": {"batch": 4},
}


def zoo_names() -> list[str]:
    return [name for name in ZOO_CASES if name in zoo.names()]


@pytest.fixture(params=zoo_names())
def zoo_model(request: pytest.FixtureRequest) -> zoo.ZooModel:
    return zoo.get(request.param, **ZOO_CASES[request.param])


@pytest.fixture(autouse=True)
def _no_remembered_plans() -> None:
    """Each test searches for itself: no answer remembered from another test's identical
    call (`planner.solution_memo`), which would hide what a test patches in the solvers."""
    ANSWERS.clear()


@pytest.fixture(autouse=True)
def _quiet_threads() -> None:
    """One torch thread per test process where the suite runs in two (``pytest -n 2``, the
    README's command: 357 to 365 s on 2 cores, 760 s in one process with two threads), else
    two."""
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
