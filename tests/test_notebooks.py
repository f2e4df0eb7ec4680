"""Every notebooks/*.ipynb is stored without outputs and executes top to bottom without an error.

The kernel is this interpreter (a kernelspec written to a temporary JUPYTER_PATH, which Jupyter searches
first), so a fresh venv with ipykernel installed but no kernel registered works, and a system-wide
`python3` kernel can never run the notebooks with another Python. Notebooks that read sweeps get small
ones made by run.py (fixtures in conftest.py) through their SPECSIM_* environment variables; everything
they write goes to tmp."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
KERNEL = "specsim-test"


def test_there_are_notebooks():
    assert any(p.name.startswith("01_") for p in NOTEBOOKS), "notebooks/01_simulator.ipynb is missing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_without_outputs(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{path.name} cell {i} has stored outputs"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


def _kernelspec(root: Path) -> Path:
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec_json = {"argv": argv, "display_name": KERNEL, "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(spec_json))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_executes(path, tmp_path, monkeypatch, request):
    import nbformat
    from nbclient import NotebookClient

    jupyter = _kernelspec(tmp_path / "jupyter")
    env = {
        "JUPYTER_PATH": os.pathsep.join([str(jupyter), os.environ.get("JUPYTER_PATH", "")]),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "MPLBACKEND": "Agg",
        # where notebooks write (figures, tables): never into the repository
        "SPECSIM_FIGURES_DIR": str(tmp_path / "figures"),
        "SPECSIM_TABLES_DIR": str(tmp_path / "tables"),
    }
    if path.name.startswith("04_"):  # online / multi-draft runs: fabricated run dirs
        env["SPECSIM_RUNS_DIR"] = str(request.getfixturevalue("online_runs"))
    elif path.name.startswith("05_"):  # the validation sweep: the committed small sweep of real micro runs
        env["SPECSIM_VALIDATION_DIR"] = str(REPO / "tests" / "data" / "validation_micro")
    elif not path.name.startswith("01_"):  # the analysis notebooks read sweeps
        env["SPECSIM_SWEEP_DIR"] = str(request.getfixturevalue("simulate_sweep"))
        env["SPECSIM_MULTIRUN_DIR"] = str(request.getfixturevalue("experiment_sweeps"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=600, allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert ran and all(c.execution_count for c in ran), "every code cell ran"


@pytest.fixture
def online_runs(tmp_path) -> Path:
    """Measure runs as run.py writes them (metrics.json only): an online run and its static control over 64
    requests, and one run each of vanilla, specinfer, lookahead and staged."""
    import random

    rng = random.Random(0)
    root = tmp_path / "runs"

    def write(name: str, method: str, tree: str, workload: str, **extra) -> None:
        run = root / name
        run.mkdir(parents=True)
        metrics = {"task": "measure", "method": method, "tree": tree, "hardware": "cpu", "workload": workload,
                   "model": "zoo", "seed": 0, "tau": 2.0 + rng.random(), "speedup": 1 + rng.random(),
                   "predicted_tau": 2.5, "predicted_speedup": 1.4, "tree_size": 5, **extra}
        (run / "metrics.json").write_text(json.dumps(metrics))

    for every, slope in ((8, 0.004), (0, 0.0)):
        acc = [min(1.0, 0.3 + slope * i + 0.05 * rng.random()) for i in range(64)]
        ups = [{"after_request": r + 1, "after_measured_request": r} for r in range(8, 64, 8)]
        updates = ups if every else []
        write(f"online_{every}", "online", "chain", "stream", per_request_acceptance=acc,
              per_request_tau=[1 + 4 * a for a in acc], drafter_updates=updates,
              **{"method.params.update_every": every})
    for method, tree in (("vanilla", "chain"), ("vanilla", "specinfer"), ("specinfer", "specinfer"),
                         ("lookahead", "chain"), ("staged", "chain")):
        write(f"{method}_{tree}", method, tree, "code")
    return root
