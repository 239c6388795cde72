"""What a newcomer reads and runs first: the README's references and recipes, the ignores."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# what the README's first screen sends a reader on to
PAGES = [ROOT / "docs" / name for name in ("usage.md", "recipes.md", "how-it-works.md",
                                            "limitations.md")]
PAGES.append(ROOT / "benchmarks" / "results" / "README.md")
DOCS = {"README.md": README, **{str(p.relative_to(ROOT)): p.read_text() for p in PAGES}}
FRONT_PAGE_MAX_BYTES = 9 * 1024


@pytest.mark.parametrize("name", list(DOCS))
def test_docs_cite_only_files_in_the_repository(name: str) -> None:
    # paths are written from the repository's root, in every document
    cited = set(re.findall(r"[\w./-]+\.(?:md|py|ipynb|sh|json|png)\b", DOCS[name]))
    # documents anywhere, and paths into the repository
    cited = {path for path in cited if path.endswith(".md") or "/" in path}
    cited = {path for path in cited if not path.startswith("../")}  # the back links
    missing = sorted(path for path in cited if not (ROOT / path).exists())
    assert not missing, f"{name} cites {missing}, not in the repository"


def test_the_readme_is_a_front_page_that_reaches_every_page() -> None:
    assert len(README.encode()) <= FRONT_PAGE_MAX_BYTES, "README.md: keep it a front page"
    first_screen = "\n".join(README.splitlines()[:15])
    assert "scripts/bootstrap.sh && .venv/bin/python -m planner demo" in first_screen
    assert "scripts/bootstrap.sh && .venv/bin/python -m pytest -q -n 2" in first_screen
    unreached = [name for name in DOCS if name != "README.md" and name not in README]
    assert not unreached, f"README.md does not lead to {unreached}"
    for name in DOCS:  # and each page leads back
        assert name == "README.md" or "README.md)" in DOCS[name].split("\n", 4)[2], name


def test_the_readme_example_prints_what_the_readme_shows(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The front page's example is what users copy first: it runs, and prints the plan the
    README shows (all but the seconds the solver took)."""
    code = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    shown = re.findall(r"```text\n(.*?)```", README, re.S)[0]
    exec(compile(code, "README.md", "exec"), {})  # our own README's example
    printed = capsys.readouterr().out

    def seconds_masked(text: str) -> str:
        return re.sub(r"\d+\.\d+ s$", "<t> s", text.strip(), flags=re.M)

    assert seconds_masked(printed) == seconds_masked(shown)


def test_recipes_name_the_device_the_model_runs_on() -> None:
    # torch.autocast("cuda") around a CPU model disables itself: the step runs in fp32
    code = "\n".join(re.findall(r"```python\n(.*?)```", DOCS["docs/recipes.md"], re.S))
    assert "autocast(" in code
    assert not re.search(r"autocast\(\s*[\"'](cuda|cpu)[\"']", code)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout")
def test_files_the_cli_writes_by_default_are_ignored() -> None:
    written = ["plan.json", "profile.json", "demo-plan.json"]
    ignored = subprocess.run(["git", "check-ignore", *written], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert sorted(ignored) == sorted(written)
