"""notebooks/01_simulator.ipynb is stored without outputs and runs top to bottom."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "01_simulator.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # α^d, k̄ vs γ, heat map, Sequoia scaling, per-hardware (+ t(n))
