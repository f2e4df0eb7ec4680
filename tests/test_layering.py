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


# ---- methods' floors (methods/__init__.py): nothing imports from a floor above its own -----------------
FLOORS = {
    "methods.core": 0,
    "methods.data": 1,
    "methods.zoo": 2,
    "methods.models": 2,
    "methods.heads": 3,
    "methods.drafters": 4,
    "methods.measurement": 5,
}
METHODS_IMPORT = re.compile(r"^\s*(?:from|import)\s+(methods(?:\.\w+)*)", re.MULTILINE)


def floor_of(module: str) -> int:
    """The floor of a dotted module name (the longest FLOORS prefix); methods' own __init__ has none."""
    hits = [floor for prefix, floor in FLOORS.items() if module == prefix or module.startswith(prefix + ".")]
    assert hits, f"{module} belongs to no floor: add it to FLOORS and to methods/__init__.py"
    return max(hits)


def test_every_methods_module_has_a_floor():
    for path in _sources("methods"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        if module != "methods":
            floor_of(module)


def test_no_import_climbs_a_floor():
    """Lazy imports inside functions count: a floor may use its own floor and those below, never above."""
    climbs = []
    for path in _sources("methods"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        if module == "methods":
            continue
        for imported in METHODS_IMPORT.findall(path.read_text(encoding="utf-8")):
            if imported != "methods" and floor_of(imported) > floor_of(module):
                climbs.append(f"{module} (floor {floor_of(module)}) imports {imported}")
    assert not climbs, "imports that climb a floor:\n" + "\n".join(climbs)


def test_floor_checker_catches_a_climb():
    """The checker itself: the decode core importing a drafter is a climb."""
    assert floor_of("methods.core.loop") < floor_of("methods.drafters.vanilla")
    assert floor_of("methods.zoo.build") == floor_of("methods.models")


def test_no_import_cycle_between_modules():
    """The import graph of methods/ modules (lazy imports inside functions included) has no cycle."""
    graph = {}
    for path in _sources("methods"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = {m for m in METHODS_IMPORT.findall(path.read_text(encoding="utf-8")) if m != module}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack + [node, nxt]))
            if nxt in graph and not state.get(nxt):
                visit(nxt, stack + [node])
        state[node] = 2

    for node in graph:
        if not state.get(node):
            visit(node, [])


def test_the_repository_explains_itself():
    """No file cites documents outside the repository (the old design notes, the workplace's shared folder):
    docs/architecture.md holds the architecture and contracts."""
    skip = {".git", ".venv", ".venv-vllm", "outputs", "multirun", "__pycache__"}
    suffixes = {".py", ".md", ".yaml", ".ipynb", ".toml", ".cfg", ".txt"}
    files = [p for p in REPO.rglob("*") if p.is_file() and p.suffix in suffixes
             and not skip & set(p.relative_to(REPO).parts)]
    assert (REPO / "docs" / "architecture.md").is_file()
    outside = re.compile(r"DESIGN\.md|\.\./shared|shared/reference")
    cited = [str(p.relative_to(REPO)) for p in files if p.name != "test_layering.py"
             and outside.search(p.read_text(encoding="utf-8", errors="replace"))]
    assert not cited, f"files citing documents outside the repository: {cited}"
