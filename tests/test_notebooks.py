"""Every notebook executes, at a reduced size (SIMADMIT_NOTEBOOK_SCALE), so none of them rots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the test extra (nbformat, nbclient)")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the test extra (nbformat, nbclient)")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"p99_vs_utilization.ipynb", "article_claims.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every cell in a fresh kernel; an exception in any cell fails the test. Figures must come out."""
    monkeypatch.setenv("SIMADMIT_NOTEBOOK_SCALE", os.environ.get("SIMADMIT_NOTEBOOK_SCALE", "0.1"))
    monkeypatch.setenv("SIMADMIT_NOTEBOOK_OUT", str(tmp_path))
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    images = [
        o
        for c in notebook.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 2
