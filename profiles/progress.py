"""The profiler's progress bars: shown on a terminal or in a notebook, never in logs or CI."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm as _tqdm


def _bar(items: Any, desc: str, progress: bool) -> Any:
    """A progress bar over ``items`` on a terminal or in a notebook; plain iteration in
    logs and CI, where tqdm would write carriage returns."""
    shown = _in_notebook() or getattr(sys.stderr, "isatty", lambda: False)()
    return _tqdm(items, desc=desc, leave=False, disable=not (progress and shown))


def _in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (a module merely imported does not count)."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython else None
    return type(shell).__name__ == "ZMQInteractiveShell"
