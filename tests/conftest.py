"""Shared fixtures: the real config composed through Hydra's compose API, and run.py as a subprocess.

run.py lives at the repository root (it is an entry point, not a package module), so the root goes on
sys.path here; tests then `import run` to reach its schema registration and helpers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def presets(group: str) -> list[str]:
    """Names of the yaml presets of a config group (e.g. 'hardware' -> ['a100', 'a100_40gb', …])."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(scope="session")
def run_module():
    """run.py imported as a module, with the dataclass schemas registered in Hydra's ConfigStore."""
    import run

    run.register_configs()
    return run


@pytest.fixture
def compose_config(run_module) -> Callable:
    """compose_config(*overrides, hydra=False) -> DictConfig of conf/config.yaml with the overrides.

    The same composition `python run.py <overrides>` does; `hydra=True` keeps the `hydra` node."""
    from hydra import compose, initialize_config_dir

    def _compose(*overrides: str, hydra: bool = False):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("config", overrides=list(overrides), return_hydra_config=hydra)

    return _compose


@pytest.fixture
def run_config(compose_config, run_module) -> Callable:
    """run_config(*overrides) -> validated specsim.config.RunConfig (what run.py hands to the task)."""

    def _run_config(*overrides: str):
        return run_module.to_run_config(compose_config(*overrides))

    return _run_config


def run_cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python run.py ARGS` from ``cwd`` (a tmp dir, so that nothing lands in the repository)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("HYDRA_FULL_ERROR", None)  # the user-facing error format is under test
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def cli() -> Callable:
    return run_cli


@pytest.fixture(scope="session")
def simulate_sweep(tmp_path_factory) -> Path:
    """A small 2 x 2 x 2 task=simulate sweep (method x tree x workload), for notebooks and analysis."""
    root = tmp_path_factory.mktemp("sweep")
    sweep = root / "multirun" / "small"
    proc = run_cli(
        ["-m", "task=simulate", "method=vanilla,medusa", "tree=chain,sequoia", "workload=code,grounded",
         f"hydra.sweep.dir={sweep}"],
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep


@pytest.fixture(scope="session")
def experiment_sweeps(tmp_path_factory) -> Path:
    """Reduced `experiment=` sweeps under <root>/multirun/<experiment>/<stamp>/ (the layout of the
    experiment presets); command-line sweeps replace the presets' hydra.sweeper.params grids."""
    root = tmp_path_factory.mktemp("experiments")
    grids = {
        "leviathan_table": ["tree.gamma=1,2,4", "method.acceptance.alpha=0.6,0.8",
                            "method.draft_cost_ratio=0.05"],
        "sequoia_scaling": ["hardware=a100,l40_offload", "tree.budgets=[4],[16],[64]"],
    }
    for name, grid in grids.items():
        sweep = root / "multirun" / name / "test"
        proc = run_cli(["-m", f"experiment={name}", *grid, f"hydra.sweep.dir={sweep}"], cwd=root)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "multirun"
