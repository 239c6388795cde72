"""The tiny-op constants of ``torch.utils.checkpoint`` on this host, measured once and kept.

They are the host's and torch's, not a model's (`profiles.calibrate` measures them on chains
of tiny ops in about `CALIBRATION_S`), so a process measures them once per device, torch
version and thread count, and keeps them on disk per host (its CPU model and core count)
for the processes after it: each plan's first profile in a process used to pay 0.5 s for
them (issue 62: "kept per host and torch version"). The file is
``$XDG_CACHE_HOME/checkpoint-planner/host-checkpoint-costs.json`` (``~/.cache`` without
it); ``CHECKPOINT_PLANNER_CACHE`` names another directory, or ``off`` to measure in every
process. Delete the file to measure again (say, after the host was busy when it measured).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

from profiles.calibrate import calibrate_checkpoint_costs
from profiles.schema import CheckpointCosts

log = logging.getLogger(__name__)

__all__ = ["CACHE_ENV", "CALIBRATION_S", "host_checkpoint_costs"]

CALIBRATION_S = 0.5  # time spent measuring checkpoint overhead (timing="measure")
CACHE_ENV = "CHECKPOINT_PLANNER_CACHE"

_MEASURED: dict[str, CheckpointCosts] = {}  # this process's, by `_host_key`


def host_checkpoint_costs(device_type: str) -> CheckpointCosts:
    """The constants on this host for ``device_type``: this process's, else the disk's,
    else measured now (and kept in both)."""
    key = _host_key(device_type)
    if key not in _MEASURED:
        kept = _stored().get(key)
        _MEASURED[key] = CheckpointCosts.model_validate(kept) if kept is not None else \
            _measured_and_stored(key, device_type)
    return _MEASURED[key]


def _host_key(device_type: str) -> str:
    """What the constants follow: the device (a GPU's name), the CPU model and cores, the
    torch version and its thread count."""
    gpu = torch.cuda.get_device_name() if device_type == "cuda" else ""
    return "|".join((device_type, gpu, _cpu_model(), str(os.cpu_count()), torch.__version__,
                     str(torch.get_num_threads())))


@functools.cache
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_file() -> Path | None:
    where = os.environ.get(CACHE_ENV)
    if where == "off":
        return None
    base = Path(where) if where else \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "checkpoint-planner"
    return base / "host-checkpoint-costs.json"


def _stored() -> dict[str, dict]:
    """The file's constants by host key; {} without a file, or with one that cannot be read
    (it is then written anew)."""
    path = _cache_file()
    if path is None or not path.exists():
        return {}
    try:
        stored = json.loads(path.read_text())
        if isinstance(stored, dict):
            return {k: v for k, v in stored.items() if _valid(v)}
    except (OSError, ValueError) as error:
        log.debug("could not read %s (%s); measuring the host's constants", path, error)
    return {}


def _valid(value: object) -> bool:
    try:
        CheckpointCosts.model_validate(value)
    except ValueError:
        return False
    return True


def _measured_and_stored(key: str, device_type: str) -> CheckpointCosts:
    costs = calibrate_checkpoint_costs(device_type, budget_s=CALIBRATION_S)
    path = _cache_file()
    if path is None:
        return costs
    try:  # written whole, then renamed: a process reading it meanwhile sees old or new
        path.parent.mkdir(parents=True, exist_ok=True)
        stored = {**_stored(), key: costs.model_dump()}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         suffix=".tmp") as out:
            json.dump(stored, out, indent=1)
        os.replace(out.name, path)
    except OSError as error:  # a read-only home: measured again in the next process
        log.debug("could not keep the host's checkpoint constants in %s (%s)", path, error)
    return costs
