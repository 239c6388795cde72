from __future__ import annotations

import pytest
import torch

from planner import zoo

# Small sizes keep the suite fast on 2 CPU cores; the zoo's defaults are already small.
ZOO_CASES = {
    "mlp": {},
    "resnet": {},
    "gpt": {"size": "tiny"},
    "hf-gpt2": {},
    "hf-llama": {},
}


def zoo_names() -> list[str]:
    return [name for name in ZOO_CASES if name in zoo.names()]


@pytest.fixture(params=zoo_names())
def zoo_model(request: pytest.FixtureRequest) -> zoo.ZooModel:
    return zoo.get(request.param, **ZOO_CASES[request.param])


@pytest.fixture(autouse=True)
def _quiet_threads() -> None:
    torch.set_num_threads(2)
