"""``python -m planner``: errors are one line and exit code 2, output is what a user needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner import Plan
from planner.__main__ import main
from planner.plan import format_bytes
from profiles import GraphProfile

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = ["--model", "gpt", "--set", "size=tiny"]


def _run(argv: list[str]) -> int:
    """``main``'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("budget", ["-1", "nan", "0", "inf", "-inf", "lots"])
def test_budgets_that_are_not_a_positive_number_are_one_line(
        budget: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status = _run(["optimize", *TINY_GPT, "--budget-gb", budget, "--out",
                   str(tmp_path / "plan.json")])
    assert status == 2
    assert "--budget-gb" in _one_line(capsys.readouterr().err)


def test_a_budget_below_one_kib_is_refused(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    status = _run(["optimize", *TINY_GPT, "--budget-gb", "1e-30", "--out",
                   str(tmp_path / "plan.json")])
    assert status == 2
    assert "below one KiB" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "plan.json").exists()


def test_errors_of_the_library_are_one_line(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    assert _run(["show", str(missing)]) == 2
    assert str(missing) in _one_line(capsys.readouterr().err)

    assert _run(["optimize", "--model", "no-such-model", "--budget-gb", "1"]) == 2
    assert "no-such-model" in _one_line(capsys.readouterr().err)

    # a budget no schedule meets: the lowest one that works, in one line
    assert _run(["-q", "optimize", *TINY_GPT, "--budget-gb", str(1.5 / 1024), "--out",
                 str(tmp_path / "plan.json")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--budget-gb 0.00" in line and "returns that plan" in line
    # remedies as the shell's flags, not optimize's arguments
    assert "--offload may reach lower" in line, line
    assert not any(python in line for python in ("optimize(..., budget_gb", "offload=True",
                                                 "error.plan")), line

    assert _run(["-q", "optimize", *TINY_GPT, "--budget-gb", "1", "--out",
                 str(tmp_path / "plan.json")]) == 0
    data = json.loads((tmp_path / "plan.json").read_text())
    data["budget_bytes"] = 10**400
    (tmp_path / "edited.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert _run(["show", str(tmp_path / "edited.json")]) == 2
    assert "budget_bytes" in _one_line(capsys.readouterr().err)


def test_profile_prints_sizes_in_units_that_fit(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert _run(["-q", "profile", *TINY_GPT]) == 0
    assert not (tmp_path / "plan.json").exists()  # a profile goes to profile.json
    out = capsys.readouterr().out
    static = GraphProfile.load(tmp_path / "profile.json").static.total_bytes
    assert f"static {format_bytes(static)} (params" in out, out
    assert "GiB" not in out, out  # a 1 MiB model in MiB, not "0.001 GiB"


def test_demo_says_only_what_it_plans_and_no_solver_internals() -> None:
    """Run as a user does (a fresh process: logging as the CLI sets it up)."""
    done = subprocess.run([sys.executable, "-m", "planner", "demo", "--size", "tiny",
                           "--out", "/dev/null"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "No checkpointing needed" not in done.stdout + done.stderr
    assert "recompute" in done.stdout and "measured peak" in done.stdout
    # the planner says what it does; the solvers' internals stay quiet
    assert "solving with auto" in done.stderr
    for chatter in ("dp:", "cpsat:", "merged"):
        assert chatter not in done.stderr, done.stderr


def test_optimize_plans_gradient_accumulation_and_says_things_once(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-m", "planner", "optimize", "--model", "mlp",
                           "--set", "batch=64", "--budget-gb", "1", "--grad-accumulation",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["profile"]["static"]["grads_at_start"] is True
    said = done.stdout + done.stderr
    assert said.count("No checkpointing needed") == 1, said


# (the model's arguments, what the one line says)
BAD_MODELS = [
    (["--model", "no_such_module_xyz:build"], "cannot import 'no_such_module_xyz'"),
    (["--model", "math:pi"], "--model math:pi is a float"),
    (["--model", "os:getcwd"], "--model os:getcwd built a str"),
    (["--model", "torch.nn:Linear"], "--model torch.nn:Linear: Linear.__init__() missing"),
    (["--model", "mlp", "--set", "batch=0"], "--set batch=0: the example input[0] has shape "
     "[0, 64], with no elements"),
    (["--model", "mlp", "--set", "batch=-1"], "--set batch=-1: Trying to create tensor with "
     "negative dimension"),
    (["--model", "mlp", "--set", "batch"], "--set batch: expected KEY=VALUE"),
]


@pytest.mark.parametrize("case", range(len(BAD_MODELS)), ids=[" ".join(argv[1:]) for argv, _
                                                               in BAD_MODELS])
def test_a_model_that_cannot_be_planned_is_one_line(case: int, capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    argv, says = BAD_MODELS[case]
    out = tmp_path / "plan.json"
    assert _run(["-q", "optimize", *argv, "--budget-gb", "1", "--out", str(out)]) == 2
    assert says in _one_line(capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.parametrize("content", [bytes(range(256)), b'{"nodes": [], "storages": []}'],
                         ids=["binary", "a profile"])
def test_show_names_the_file_that_is_not_a_plan(content: bytes,
                                                capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    assert _run(["show", str(path)]) == 2
    assert f"error: {path}: not a plan file" in _one_line(capsys.readouterr().err)


def test_an_out_in_no_directory_is_refused_before_profiling(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def profiled(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled before checking --out")

    monkeypatch.setattr("planner.optimize", profiled)
    out = tmp_path / "no-such-dir" / "plan.json"
    assert _run(["-q", "optimize", "--model", "mlp", "--budget-gb", "1", "--out", str(out)]) == 2
    assert f"--out {out}: the directory" in _one_line(capsys.readouterr().err)


def test_the_cli_says_the_device_and_timing_it_planned_for(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    """Its defaults (estimate, H100) are not optimize()'s (auto, the model's device)."""
    assert _run(["optimize", "--help"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "optimize() in Python defaults to auto" in said, said
    assert "here: H100; optimize() in Python defaults to None" in said, said
    assert _run(["-q", "optimize", "--model", "mlp", "--set", "batch=4", "--budget-gb", "1",
                 "--offload", "--out", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "planned for H100 (estimated timing; --device/--timing to change)" in out, out
    # offload was allowed and nothing is offloaded: the summary says so, and why
    assert "offload: allowed, none needed" in out, out
    assert Plan.load(tmp_path / "plan.json").host_budget_bytes


def test_optimize_plans_a_users_own_model_from_a_build_function(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--model pkg.mod:build`` where ``build()`` returns the model, a batch and the loss,
    as the docs show it; ``--set`` passes build's arguments."""
    (tmp_path / "my_model.py").write_text(
        "import torch\n"
        "from torch import nn\n\n\n"
        "def build(batch=256):\n"
        "    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU())\n"
        "                            for _ in range(6)])\n"
        "    return model, torch.randn(batch, 256), lambda out: out.square().mean()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plan.json"
    assert _run(["optimize", "--model", "my_model:build", "--set", "batch=512",
                 "--budget-gb", str(7 / 1024), "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.checkpointing and plan.predicted_peak_bytes <= 7 * 2**20
    assert plan.inputs[0].shape == [512, 256]


def test_a_model_whose_output_has_no_loss_is_told_what_the_cli_takes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--model mod:attr`` naming a Hugging Face model alone: its dummy batch has no labels,
    so its output carries no loss; the CLI takes no loss_fn=, so it says what it takes."""
    pytest.importorskip("transformers")
    (tmp_path / "bare_model.py").write_text(
        "import transformers\n\n"
        "model = transformers.GPT2LMHeadModel(transformers.GPT2Config(\n"
        "    n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _run(["-q", "optimize", "--model", "bare_model:model", "--budget-gb", "1",
                 "--out", str(tmp_path / "plan.json")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "Cannot tell the training loss" in line and "(model, batch, loss_fn)" in line, line
    assert "pass loss_fn" not in line, line


def test_optimize_plans_an_envelope_and_show_reads_the_table(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--max-length plans every batch up to it (a plan table, saved and shown); a model
    whose loss holds the example's targets says why its envelope cannot be planned."""
    pytest.importorskip("transformers")
    out = tmp_path / "plans.json"
    assert _run(["-q", "optimize", "--model", "hf-llama", "--set", "seq_len=32",
                 "--budget-gb", "1", "--max-length", "64", "--buckets", "pow2",
                 "--resident-batches", "2", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "Plans for LlamaForCausalLM over the example's rows of 1-64 tokens, 2 batches " \
        "resident" in said and "plans written to" in said
    assert _run(["show", str(out)]) == 0
    assert "<= 64 tokens" in capsys.readouterr().out
    assert _run(["-q", "optimize", *TINY_GPT, "--budget-gb", "1", "--max-length", "64",
                 "--out", str(tmp_path / "gpt.json")]) == 2
    assert "put the targets in the batch" in _one_line(capsys.readouterr().err)
    assert _run(["optimize", *TINY_GPT, "--budget-gb", "1", "--buckets", "pow2"]) == 2
