"""Every notebook in notebooks/ runs top to bottom (offline, small token budget), each its own case."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("KVMEM_NOTEBOOK_TOKENS", "800")
    monkeypatch.setenv("KVMEM_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("KVMEM_NOTEBOOK_OUT", str(tmp_path / "out"))
    notebook = nbformat.read(path, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        f"{path.name} is committed with outputs; clear them (python notebooks/make_notebooks.py)"
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [output for cell in notebook.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert not errors


REFERENCE_RESULTS = Path(__file__).resolve().parent.parent / "data" / "geva2021"


@pytest.mark.slow
def test_geva2021_figures_from_the_saved_reference_results(tmp_path, monkeypatch):
    """The notebook redraws every figure of docs/geva2021.md from the committed reference results
    (no model, no atlas), and the summary it prints reads those results."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("KVMEM_GEVA2021_RESULTS", str(REFERENCE_RESULTS))
    monkeypatch.setenv("KVMEM_GEVA2021_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setenv("KVMEM_NOTEBOOK_OUT", str(tmp_path / "out"))
    notebook = nbformat.read(NOTEBOOKS[[p.stem for p in NOTEBOOKS].index("geva2021")], as_version=4)
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    assert "1,000,000 tokens" in text and "trigger kind top_doc" in text
    figures = sorted(p.name for p in (tmp_path / "figures").glob("*.png"))
    committed = sorted(p.name for p in (REFERENCE_RESULTS.parent.parent / "docs" / "figures").glob("geva2021_*.png"))
    assert figures == committed and len(figures) == 8
