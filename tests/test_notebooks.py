"""The notebooks under ``notebooks/`` execute top to bottom on CPU, and are committed without outputs.

Each notebook runs in a fresh ``python3`` kernel (nbclient) with ``notebooks/`` as its working directory, as
Jupyter would start it; the repository root is put on ``PYTHONPATH`` so an uninstalled checkout imports too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # the [notebooks] extra; GPU machines run `pytest -m gpu` without it
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
REQUIRED = ("quickstart.ipynb", "parity.ipynb", "memory_planner.ipynb")


def test_required_notebooks_exist() -> None:
    assert set(REQUIRED) <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_without_outputs(path: Path) -> None:
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    for i, cell in enumerate(book.cells):
        if cell.cell_type == "code":
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count: strip outputs"
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: strip outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pythonpath = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + (os.pathsep + pythonpath if pythonpath else ""))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(
        book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK_DIR)}}
    )
    client.execute()  # raises CellExecutionError with the failing cell and its traceback
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
