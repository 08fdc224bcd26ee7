"""Every notebook in notebooks/ runs top to bottom offline and asserts its findings, each its own case.

Budgets: the SmolLM2 notebooks scan 600 tokens with KVMEM_NOTEBOOK_FAST=1 (fewer layers and samples);
geva2021 draws from the saved million-token reference results (data/geva2021), which is where its
findings can be asserted (its compute path is tested on a tiny model by test_experiments_forward).
Cell timeouts are generous (a busy machine may be several times slower); no test times itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
COMPUTED = [path for path in NOTEBOOKS if path.stem != "geva2021"]
REFERENCE_RESULTS = ROOT / "data" / "geva2021"
CELL_TIMEOUT = 900  # seconds per cell: far above what a quiet machine needs (a few seconds)


def _execute(path: Path, tmp_path: Path, monkeypatch, env: dict[str, str]):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for name, value in {"KVMEM_NOTEBOOK_OUT": str(tmp_path / "out"), **env}.items():
        monkeypatch.setenv(name, value)
    notebook = nbformat.read(path, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        f"{path.name} is committed with outputs; clear them (python notebooks/make_*.py)"
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [output for cell in notebook.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert not errors
    return notebook


def test_every_notebook_asserts_something():
    """Each notebook's code holds assert statements (parsed, not grepped), so running it checks findings."""
    nbformat = pytest.importorskip("nbformat")
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        asserts = 0
        for cell in notebook.cells:
            if cell.cell_type == "code":
                source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
                asserts += sum(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(source)))
        assert asserts >= 2, f"{path.name} asserts {asserts} things"


@pytest.mark.slow
@pytest.mark.parametrize("path", COMPUTED, ids=[path.stem for path in COMPUTED])
def test_notebook_runs_and_its_assertions_hold(path, tmp_path, monkeypatch):
    _execute(path, tmp_path, monkeypatch, {"KVMEM_NOTEBOOK_TOKENS": "600", "KVMEM_NOTEBOOK_FAST": "1"})


@pytest.mark.slow
def test_geva2021_from_the_saved_reference_results(tmp_path, monkeypatch):
    """The notebook redraws every figure of docs/geva2021.md from the committed reference results
    (no model, no atlas) and asserts the findings there: upper-layer agreement above its null."""
    notebook = _execute(ROOT / "notebooks" / "geva2021.ipynb", tmp_path, monkeypatch,
                        {"KVMEM_GEVA2021_RESULTS": str(REFERENCE_RESULTS),
                         "KVMEM_GEVA2021_FIGURES": str(tmp_path / "figures")})
    text = "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    assert "1,000,000 tokens" in text and "trigger kind top_doc" in text
    assert "upper-layer agreement" in text and "against a null of" in text  # the asserted branch ran
    figures = sorted(p.name for p in (tmp_path / "figures").glob("*.png"))
    committed = sorted(p.name for p in (ROOT / "docs" / "figures").glob("geva2021_*.png"))
    assert figures == committed and len(figures) == 8
