"""profiles.host_costs: the host's checkpoint constants, measured once per process and kept
on disk per host and torch version."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import profiles
from planner import zoo
from profiles import host_costs


def _counted(monkeypatch: pytest.MonkeyPatch, where: str) -> list[str]:
    """Measurements counted (each gives other constants), in a fresh process's state, with
    the disk cache at ``where`` ("off": none)."""
    calls: list[str] = []

    def counted(device_type: str, budget_s: float) -> profiles.CheckpointCosts:
        calls.append(device_type)
        return profiles.CheckpointCosts(region_ms=0.3, pack_ms=0.01, sac_op_ms=0.02,
                                        source=f"measured {len(calls)}")

    monkeypatch.setattr(host_costs, "calibrate_checkpoint_costs", counted)
    monkeypatch.setattr(host_costs, "_MEASURED", {})
    monkeypatch.setenv(host_costs.CACHE_ENV, where)
    return calls


def _profile() -> profiles.GraphProfile:
    zm = zoo.get("mlp", batch=8, width=32, depth=2)
    return profiles.profile(zm.model, zm.example_inputs, loss_fn=zm.loss_fn,
                            timing="measure", repeats=1, warmup=0, progress=False)


def test_the_hosts_checkpoint_constants_are_measured_once_per_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A second profile in the process takes them as measured (each used to pay 0.5 s for
    them); another thread count is another host."""
    calls = _counted(monkeypatch, "off")
    first, second = _profile(), _profile()
    assert calls == ["cpu"] and first.checkpoint_costs == second.checkpoint_costs
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        third = _profile()
    finally:
        torch.set_num_threads(threads)
    assert calls == ["cpu", "cpu"] and third.checkpoint_costs.source == "measured 2"


def test_the_next_process_on_the_host_reads_them_from_disk(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _counted(monkeypatch, str(tmp_path))
    first = host_costs.host_checkpoint_costs("cpu")
    monkeypatch.setattr(host_costs, "_MEASURED", {})  # another process
    assert host_costs.host_checkpoint_costs("cpu") == first and calls == ["cpu"]
    monkeypatch.setattr(host_costs, "_MEASURED", {})
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another torch: measured again
    assert host_costs.host_checkpoint_costs("cpu").source == "measured 2"
    assert len((tmp_path / "host-checkpoint-costs.json").read_text().split('"region_ms"')) == 3


@pytest.mark.parametrize("content", ["{not json", '{"cpu|x": {"region_ms": -1}}', "[]"])
def test_a_file_that_cannot_be_read_is_measured_again_and_rewritten(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str) -> None:
    (tmp_path / "host-checkpoint-costs.json").write_text(content)
    calls = _counted(monkeypatch, str(tmp_path))
    assert host_costs.host_checkpoint_costs("cpu").source == "measured 1"
    monkeypatch.setattr(host_costs, "_MEASURED", {})
    assert host_costs.host_checkpoint_costs("cpu").source == "measured 1" and calls == ["cpu"]


def test_a_cache_it_cannot_write_only_costs_a_measurement(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    calls = _counted(monkeypatch, str(blocked))  # its "directory" is a file
    assert host_costs.host_checkpoint_costs("cpu").source == "measured 1"
    monkeypatch.setattr(host_costs, "_MEASURED", {})
    assert host_costs.host_checkpoint_costs("cpu").source == "measured 2"
    assert calls == ["cpu", "cpu"]
