"""What a newcomer reads and runs first: the README's references and recipes, the ignores."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_cites_only_files_in_the_repository() -> None:
    cited = set(re.findall(r"[\w./-]+\.(?:md|py|ipynb|sh)\b", README))
    # documents anywhere, and paths into the repository
    cited = {path for path in cited if path.endswith(".md") or "/" in path}
    missing = sorted(path for path in cited if not (ROOT / path).exists())
    assert not missing, f"README.md cites {missing}, not in the repository"


def test_recipes_name_the_device_the_model_runs_on() -> None:
    # torch.autocast("cuda") around a CPU model disables itself: the step runs in fp32
    code = "\n".join(re.findall(r"```python\n(.*?)```", README, re.S))
    assert "autocast(" in code
    assert not re.search(r"autocast\(\s*[\"'](cuda|cpu)[\"']", code)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout")
def test_files_the_cli_writes_by_default_are_ignored() -> None:
    written = ["plan.json", "profile.json", "demo-plan.json"]
    ignored = subprocess.run(["git", "check-ignore", *written], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert sorted(ignored) == sorted(written)
