"""Import direction is one-way: specsim (pure math) ← methods (torch) ← run.py (Hydra); analysis and the
notebooks read outputs and use specsim. Checked twice: by importing every module in a fresh interpreter
and looking at sys.modules, and by reading the sources (a lazy import inside a function counts too)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("specsim", "methods", "analysis")
IMPORT = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_][\w]*)", re.MULTILINE)
# package -> top-level modules it must never import
FORBIDDEN = {
    "specsim": {"torch", "transformers", "hydra", "omegaconf", "methods", "analysis", "run"},
    "methods": {"hydra", "omegaconf", "analysis", "run"},
    # analysis may read .hydra/*.yaml with OmegaConf (a yaml library, not the Hydra app)
    "analysis": {"torch", "transformers", "hydra", "methods", "run"},
}


def _import_all(package: str) -> dict:
    """Import every module of ``package`` in a fresh interpreter; report what ended up in sys.modules."""
    code = (
        "import importlib, json, pkgutil, sys\n"
        f"pkg = importlib.import_module({package!r})\n"
        "names = [pkg.__name__] + [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps({'modules': names, 'loaded': sorted({m.split('.')[0] for m in sys.modules})}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"importing {package} failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_a_package_loads_nothing_forbidden(package):
    report = _import_all(package)
    assert len(report["modules"]) >= 2, f"{package}: no modules found"
    leaked = FORBIDDEN[package] & set(report["loaded"])
    assert not leaked, f"importing every {package} module loaded {sorted(leaked)}"


def _sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_sources_import_nothing_forbidden(package):
    for path in _sources(package):
        imported = set(IMPORT.findall(path.read_text(encoding="utf-8")))
        bad = FORBIDDEN[package] & imported
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_only_run_py_imports_hydra():
    """Every Python file of the repository except run.py and the tests is free of hydra."""
    skip = ("tests", "outputs", "multirun")
    tops = [p for p in REPO.iterdir() if not p.name.startswith(".") and p.name not in skip]
    files = [p for top in tops for p in ([top] if top.is_file() else top.rglob("*.py")) if p.suffix == ".py"]
    offenders = [str(p.relative_to(REPO)) for p in files
                 if p != REPO / "run.py" and "hydra" in IMPORT.findall(p.read_text(encoding="utf-8"))]
    assert not offenders, f"only run.py may import hydra: {offenders}"
    assert {"hydra"} <= set(IMPORT.findall((REPO / "run.py").read_text()))


def test_notebooks_use_analysis_and_specsim_only():
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        bad = {"hydra", "torch", "methods"} & set(IMPORT.findall(code))
        assert not bad, f"{nb.name} imports {sorted(bad)}: notebooks use analysis and specsim only"
