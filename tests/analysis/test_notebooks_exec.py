"""The notebooks are stored without outputs and execute top to bottom on fabricated sweeps (nbclient,
kernel python3), writing their figures and tables where the environment variables point.

Every notebook in notebooks/ (a glob: a new one is picked up without editing this file) is checked for its
stored form here and executed top to bottom by tests/test_notebooks.py; the two analysis notebooks are also
executed here on fabricated sweeps whose numbers their outputs must show."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
NAMES = ("02_sweep_analysis.ipynb", "03_paper_tables.ipynb")  # the content checks below
ENV = ("SPECSIM_SWEEP_DIR", "SPECSIM_FIGURES_DIR", "SPECSIM_LEVIATHAN_DIR", "SPECSIM_SEQUOIA_DIR",
       "SPECSIM_SPECBENCH_DIR", "SPECSIM_MULTIRUN_DIR", "SPECSIM_TABLES_DIR")


def _execute(name: str, monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    """Run a notebook in a fresh kernel from notebooks/ (as Jupyter would); return its text outputs."""
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    cwd = {"metadata": {"path": str(NOTEBOOKS)}}
    NotebookClient(nb, timeout=300, kernel_name="python3", resources=cwd).execute()
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", ""))
            texts.extend(str(out.get("data", {}).get(k, "")) for k in ("text/markdown", "text/plain"))
    return "\n".join(texts)


def test_the_glob_finds_the_notebooks_with_content_checks():
    assert set(NAMES) <= set(ALL), (NAMES, ALL)


@pytest.mark.parametrize("name", ALL)
def test_notebook_is_stored_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.mark.slow
def test_sweep_analysis_notebook(sweeps, tmp_path, monkeypatch):
    figures = tmp_path / "figures"
    text = _execute(NAMES[0], monkeypatch, SPECSIM_SWEEP_DIR=str(sweeps.measure.path),
                    SPECSIM_FIGURES_DIR=str(figures))
    n_ok, n_all = len(sweeps.measure.ok_jobs()), len(sweeps.measure.status)
    assert f"{n_ok} finished runs of {n_all}; measured: True" in text
    assert "RuntimeError: no heads" in text  # the failed job is listed
    for stem in ("speedup_bars", "tau_bars", "predicted_vs_measured", "speedup_heatmap_code",
                 "speedup_heatmap_grounded"):
        for ext in ("png", "pdf"):
            assert (figures / f"{stem}.{ext}").stat().st_size > 0, f"{stem}.{ext}"
    assert "| method | tree | n | tau_bias | tau_mape |" in text


@pytest.mark.slow
def test_paper_tables_notebook_from_sweeps(sweeps, fabricate, tmp_path, monkeypatch):
    out = tmp_path / "tables"
    text = _execute(NAMES[1], monkeypatch, SPECSIM_LEVIATHAN_DIR=str(sweeps.leviathan.path),
                    SPECSIM_SEQUOIA_DIR=str(sweeps.sequoia.path),
                    SPECSIM_SPECBENCH_DIR=str(sweeps.measure.path), SPECSIM_TABLES_DIR=str(out))
    for stem in ("leviathan_tokens", "leviathan_speedup", "leviathan_best_gamma", "sequoia_tau",
                 "sequoia_speedup", "sequoia_best_size", "specbench_speedup", "specbench_tau"):
        assert (out / f"{stem}.md").is_file() and (out / f"{stem}.tex").is_file(), stem
    for stem in ("leviathan_speedup", "sequoia_tau", "sequoia_speedup", "specbench_speedup"):
        assert (out / f"{stem}.png").is_file() and (out / f"{stem}.pdf").is_file(), stem
    tokens = (out / "leviathan_tokens.md").read_text()
    tau = fabricate.chain_tau
    assert f"| 0.80 | {tau(0.8, 2):.2f} | {tau(0.8, 4):.2f} |" in tokens
    for hw in {m["hardware"] for m in sweeps.sequoia.metrics.values()}:
        runs = [m for m in sweeps.sequoia.metrics.values() if m["hardware"] == hw]
        top = max(runs, key=lambda m: m["predicted_speedup"])
        assert f"| {hw} | {top['tree_size']} |" in (out / "sequoia_best_size.md").read_text()
    bench = (out / "specbench_speedup.md").read_text()
    assert bench.splitlines()[0] == "| method | tree | code | grounded | overall |"
    assert "medusa" not in bench  # failed and corrupt jobs do not enter the table
    assert "Simulator error on these runs" in text


@pytest.mark.slow
def test_paper_tables_notebook_fallbacks(fabricate, tmp_path, monkeypatch):
    # the newest experiment=leviathan_table sweep is found under SPECSIM_MULTIRUN_DIR; the others are absent
    multirun = tmp_path / "multirun"
    fabricate.leviathan(multirun / "leviathan_table")
    out = tmp_path / "tables"
    text = _execute(NAMES[1], monkeypatch, SPECSIM_MULTIRUN_DIR=str(multirun), SPECSIM_TABLES_DIR=str(out))
    assert "leviathan_table: " + str((multirun / "leviathan_table").resolve()) in text
    assert "sequoia_scaling: no sweep" in text and "specbench: no sweep" in text
    assert not (out / "sequoia_tau.md").exists() and not (out / "specbench_speedup.md").exists()
    # no sweep at all: the Leviathan table comes straight from specsim on Leviathan's grid
    empty = tmp_path / "empty"
    empty.mkdir()
    text = _execute(NAMES[1], monkeypatch, SPECSIM_MULTIRUN_DIR=str(empty), SPECSIM_TABLES_DIR=str(out))
    assert "computed with specsim: 160" in text
    row = "| 0.90 | " + " | ".join(f"{fabricate.chain_tau(0.9, g):.2f}" for g in range(1, 9)) + " |"
    assert row in (out / "leviathan_tokens.md").read_text()
