"""Where a benchmark's result goes: ``benchmarks/results/<stem>.{json,md}``, and the table
on the terminal."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def write_results(stem: str, result: dict[str, Any],
                  render: Callable[[dict[str, Any]], str]) -> None:
    """``result`` as JSON and ``render(result)`` as markdown, both under `RESULTS`."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    report = render(result)
    (RESULTS / f"{stem}.md").write_text(report + "\n")
    print(report)
