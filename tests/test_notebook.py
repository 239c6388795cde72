"""notebooks/inspect_plan.ipynb runs top to bottom in a fresh kernel, on CPU, fast."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "inspect_plan.ipynb"


def test_notebook_is_committed_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                "clear the notebook's outputs before committing (Cell > All Output > Clear)")


def test_notebook_executes(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # the kernel must be this interpreter (the venv): jupyter_client runs kernel.json's
    # "python" as sys.executable; check it rather than trust it
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    # timeout: per cell, a guard against a hung kernel, not a speed requirement
    client = NotebookClient(nb, kernel_name="python3", timeout=600, allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except Exception as error:  # CellExecutionError names the cell and the traceback
        pytest.fail(f"notebook cell failed:\n{error}")
    kernel_python = nb.cells[-1].outputs[0]["text"].strip()
    assert Path(kernel_python).resolve() == Path(sys.executable).resolve()
    images = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
              if "image/png" in out.get("data", {})]
    assert len(images) == 6, ("graph, expanded block, timeline, frontier, the offload "
                              "plan's graph and a plan table's buckets are displayed")
    tables = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
              if "Plan for" in out.get("data", {}).get("text/html", "")]
    assert tables, "the plan's _repr_html_ table is displayed"
    buckets = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
               if "Plans for" in out.get("data", {}).get("text/html", "")]
    assert buckets, "a plan table's _repr_html_ is displayed"
