"""Fixtures that FABRICATE run and sweep directories laid out as run.py writes them (metrics.json,
samples.jsonl, .hydra/{config,hydra,overrides}.yaml, multirun.yaml) — no model runs, no Hydra.

Numbers follow the chain closed form k̄ = (1 − α^{γ+1}) / (1 − α) with a slightly optimistic simulator
(α_pred = α + 0.03) and seeded noise on measurements, so prediction errors are small but non-zero.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import zlib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import yaml

from specsim.config import RunConfig, flat

MEASURE_GRID = {"method": ["vanilla", "prompt_lookup"], "tree": ["chain", "sequoia"],
                "workload": ["code", "grounded"], "seed": [0, 1]}
ALPHA = {("vanilla", "code"): 0.70, ("vanilla", "grounded"): 0.62,
         ("prompt_lookup", "code"): 0.50, ("prompt_lookup", "grounded"): 0.78}
RHO = {"vanilla": 0.05, "prompt_lookup": 0.0}
LEVIATHAN_GRID = {"alpha": [0.6, 0.8], "gamma": [2, 4], "rho": [0.0, 0.1]}
SEQUOIA_GRID = {"hardware": ["cpu", "a100"], "budget": [4, 8, 16, 32]}
VERIFY_SLOPE = {"cpu": 0.02, "a100": 0.002}  # t(n)/t(1) − 1 per extra tree token


@dataclass
class Sweep:
    """A fabricated sweep: its directory and, per job dir name, the metrics written (None = no metrics)."""

    path: Path
    metrics: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)  # job -> expected status

    def ok_jobs(self) -> list[str]:
        return sorted(j for j, s in self.status.items() if s == "ok")


def chain_tau(alpha: float, gamma: int) -> float:
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def _plain(obj: Any) -> Any:
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def write_run(run_dir: Path, cfg: RunConfig, choices: dict[str, str], overrides: list[str],
              metrics: dict[str, Any] | None) -> None:
    """One Hydra run dir; metrics=None leaves a run that was killed before it wrote results."""
    hydra = run_dir / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "config.yaml").write_text(yaml.safe_dump(_plain(dataclasses.asdict(cfg)), sort_keys=False))
    (hydra / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    hydra_yaml = {"hydra": {"mode": "MULTIRUN", "output_subdir": ".hydra",
                            "run": {"dir": "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"},
                            "runtime": {"output_dir": str(run_dir),
                                        "choices": {**choices, "hydra/launcher": "joblib"}},
                            "overrides": {"task": overrides}}}
    (hydra / "hydra.yaml").write_text(yaml.safe_dump(hydra_yaml))
    if metrics is None:
        return
    if metrics.get("task") == "measure":
        steps = [[int(x) for x in row] for row in np.clip(np.round(np.full((2, 5), metrics["tau"])), 1, 9)]
        lines = [json.dumps({"prompt_id": i, "token_ids": [1, 2, 3], "text": "def f(): pass",
                             "accepted_lengths": steps[i]}) for i in range(2)]
        (run_dir / "samples.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))


def _config(method: str, tree: str, workload: str, hardware: str, seed: int) -> RunConfig:
    cfg = RunConfig(seed=seed)
    cfg.method.name = cfg.method.drafter = method
    cfg.method.draft_cost_ratio = RHO.get(method, 0.0)
    cfg.tree.kind = tree
    cfg.workload.name = cfg.workload.kind = workload
    cfg.hardware.name = hardware
    return cfg


def _identity(cfg: RunConfig, task: str, tree: str) -> dict[str, Any]:
    return {"task": task, "method": cfg.method.name, "tree": tree, "hardware": cfg.hardware.name,
            "workload": cfg.workload.name, "model": cfg.model.name, "seed": cfg.seed}


def measure_metrics(method: str, tree: str, workload: str, seed: int) -> tuple[RunConfig, dict[str, Any]]:
    cfg = _config(method, tree, workload, "cpu", seed)
    cfg.task = "measure"
    rng = np.random.default_rng(zlib.crc32(f"{method},{tree},{workload},{seed}".encode()))  # stable seed
    alpha, gamma = ALPHA[(method, workload)], 4 if tree == "chain" else 6
    size = gamma + 1 if tree == "chain" else 16
    boost = 1.0 if tree == "chain" else 1.15  # a tree accepts more than a chain of the same depth
    cost = 1 + VERIFY_SLOPE["cpu"] * (size - 1) + gamma * RHO[method]
    tau_pred = boost * chain_tau(alpha + 0.03, gamma)
    tau = boost * chain_tau(alpha, gamma) * (1 + rng.normal(0, 0.02))
    base = 200.0 * (1 + rng.normal(0, 0.03))
    speedup = tau / cost * (1 + rng.normal(0, 0.03))
    tokens = cfg.workload.num_prompts * cfg.workload.max_new_tokens
    hist = rng.multinomial(math.ceil(tokens / tau), np.full(gamma + 1, 1 / (gamma + 1))).tolist()
    metrics = {**_identity(cfg, "measure", tree), **flat(cfg),
               "tau": tau, "tokens_per_s": base * speedup, "baseline_tokens_per_s": base, "speedup": speedup,
               "accept_hist": hist, "acceptance_by_depth": [alpha**d for d in range(1, gamma + 1)],
               "acceptance_by_rank": [alpha, alpha * (1 - alpha)],
               "n_target_forwards": math.ceil(tokens / tau), "time_draft_s": 0.1 * gamma * RHO[method],
               "time_verify_s": tokens / base / speedup, "predicted_tau": tau_pred,
               "predicted_speedup": tau_pred / cost, "tree_size": size, "tree_depth": gamma}
    return cfg, metrics


def _sweep_root(base: Path, name: str, params: list[str]) -> Path:
    root = base / name
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text(yaml.safe_dump(
        {"hydra": {"mode": "MULTIRUN", "sweep": {"dir": str(root), "subdir": "${hydra.job.override_dirname}"},
                   "overrides": {"task": params}}}))
    return root


def _job_name(overrides: list[str]) -> str:
    return ",".join(sorted(overrides))


def build_measure_sweep(base: Path) -> Sweep:
    """2×2×2 (method × tree × workload) × 2 seeds, plus a failed, a killed and a corrupt job."""
    params = [f"{k}={','.join(map(str, v))}" for k, v in MEASURE_GRID.items()]
    sweep = Sweep(_sweep_root(base, "2026-01-02/10-00-00", params))
    for method, tree, workload, seed in itertools.product(*MEASURE_GRID.values()):
        overrides = [f"method={method}", f"tree={tree}", f"workload={workload}", f"seed={seed}"]
        cfg, metrics = measure_metrics(method, tree, workload, seed)
        name = _job_name(overrides)
        write_run(sweep.path / name, cfg, {"method": method, "tree": tree, "workload": workload,
                                           "hardware": "cpu", "model": "zoo"}, overrides, metrics)
        sweep.metrics[name], sweep.status[name] = metrics, "ok"
    extra = {"failed": ["method=medusa", "tree=chain", "workload=code", "seed=0"],
             "missing": ["method=medusa", "tree=chain", "workload=grounded", "seed=0"],
             "corrupt": ["method=medusa", "tree=sequoia", "workload=code", "seed=0"]}
    for status, overrides in extra.items():
        name = _job_name(overrides)
        run_dir = sweep.path / name
        cfg = _config("medusa", overrides[1][5:], overrides[2][9:], "cpu", 0)
        cfg.task = "measure"
        choices = {"method": "medusa", "tree": cfg.tree.kind, "workload": cfg.workload.name}
        write_run(run_dir, cfg, choices, overrides, None)
        if status == "failed":
            failure = {"status": "failed", "error_type": "RuntimeError", "error": "RuntimeError: no heads"}
            (run_dir / "failed.json").write_text(json.dumps(failure))
        if status == "corrupt":
            (run_dir / "metrics.json").write_text('{"task": "measure", "tau": 2.3')  # cut off by a kill
        sweep.metrics[name], sweep.status[name] = None, status
    return sweep


def build_leviathan_sweep(base: Path) -> Sweep:
    """task=simulate over α × γ × ρ for a chain (Leviathan et al., 2023, Table/Fig. of k̄ and speedup)."""
    params = [f"method.acceptance.alpha={','.join(map(str, LEVIATHAN_GRID['alpha']))}",
              f"tree.gamma={','.join(map(str, LEVIATHAN_GRID['gamma']))}",
              f"method.draft_cost_ratio={','.join(map(str, LEVIATHAN_GRID['rho']))}"]
    sweep = Sweep(_sweep_root(base, "2026-01-03/09-00-00", params))
    for alpha, gamma, rho in itertools.product(*LEVIATHAN_GRID.values()):
        cfg = _config("vanilla", "chain", "code", "cpu", 0)
        cfg.method.acceptance.alpha, cfg.tree.gamma, cfg.method.draft_cost_ratio = alpha, gamma, rho
        tau = chain_tau(alpha, gamma)
        metrics = {**_identity(cfg, "simulate", "chain"), **flat(cfg), "predicted_tau": tau,
                   "predicted_speedup": tau / (1 + gamma * rho), "tree_size": gamma + 1, "tree_depth": gamma}
        overrides = [f"method.acceptance.alpha={alpha}", f"tree.gamma={gamma}",
                     f"method.draft_cost_ratio={rho}"]
        name = _job_name(overrides)
        write_run(sweep.path / name, cfg, {"method": "vanilla", "tree": "chain"}, overrides, metrics)
        sweep.metrics[name], sweep.status[name] = metrics, "ok"
    return sweep


def build_sequoia_sweep(base: Path) -> Sweep:
    """task=simulate, Sequoia trees of growing budget on two hardware profiles (τ vs tree size)."""
    params = ["hardware=cpu,a100", "tree.budgets=[4],[8],[16],[32]"]
    sweep = Sweep(_sweep_root(base, "2026-01-03/11-00-00", params))
    for hardware, budget in itertools.product(*SEQUOIA_GRID.values()):
        cfg = _config("sequoia", "sequoia", "code", hardware, 0)
        cfg.tree.budgets = [budget]
        tau = 1 + 3.2 * (1 - math.exp(-budget / 12))  # concave in the budget, as Sequoia's optimal trees are
        depth = int(math.log2(budget)) + 1
        metrics = {**_identity(cfg, "simulate", "sequoia"), **flat(cfg), "predicted_tau": tau,
                   "predicted_speedup": tau / (1 + VERIFY_SLOPE[hardware] * (budget - 1) + 0.05 * depth),
                   "tree_size": budget, "tree_depth": depth}
        overrides = [f"hardware={hardware}", f"tree.budgets=[{budget}]"]
        name = _job_name(overrides)
        write_run(sweep.path / name, cfg, {"method": "sequoia", "tree": "sequoia", "hardware": hardware},
                  overrides, metrics)
        sweep.metrics[name], sweep.status[name] = metrics, "ok"
    return sweep


@dataclass
class Sweeps:
    root: Path  # the parent "multirun/" holding all three
    measure: Sweep
    leviathan: Sweep
    sequoia: Sweep


@pytest.fixture(scope="session")
def sweeps(tmp_path_factory: pytest.TempPathFactory) -> Sweeps:
    """Read-only: three fabricated sweeps under one multirun/ dir. Tests that modify files build their own."""
    root = tmp_path_factory.mktemp("fabricated") / "multirun"
    return Sweeps(root, build_measure_sweep(root), build_leviathan_sweep(root), build_sequoia_sweep(root))


@pytest.fixture
def measure_sweep(tmp_path: Path) -> Sweep:
    """A private, writable copy of the measure sweep."""
    return build_measure_sweep(tmp_path / "multirun")


@pytest.fixture(scope="session")
def fabricate() -> SimpleNamespace:
    """Builders and the closed form, for tests that lay out their own sweeps: ``fabricate.leviathan(dir)``."""
    return SimpleNamespace(measure=build_measure_sweep, leviathan=build_leviathan_sweep,
                           sequoia=build_sequoia_sweep, chain_tau=chain_tau)
