"""Run and sweep layout on disk: which directories are runs, which runs are done, failed or unfinished.

A run directory is a Hydra run dir holding ``metrics.json`` (the completion marker, written last and
atomically), ``samples.jsonl`` and ``.hydra/``. A failed run holds ``failed.json`` instead of metrics. A
sweep directory (``multirun/<timestamp>/``) holds ``multirun.yaml`` and one run dir per job. ``run.py``
calls :func:`completed` to skip finished jobs when an interrupted sweep is re-run.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specsim.io import atomic_write_json

METRICS = "metrics.json"
SAMPLES = "samples.jsonl"
FAILED = "failed.json"
HYDRA_DIR = ".hydra"
SWEEP_MARKER = "multirun.yaml"
# keys every metrics.json carries (the run-output contract, docs/architecture.md); without them: not a result
REQUIRED_KEYS = ("task", "method", "tree", "hardware", "workload", "model", "seed")


class Status:
    """Values of the ``status`` column: one per run directory."""

    ok = "ok"  # metrics.json parses and has the contract keys
    failed = "failed"  # failed.json written (or metrics.json says status=failed)
    corrupt = "corrupt"  # metrics.json unreadable, not an object, or missing contract keys
    missing = "missing"  # a run dir with neither file: still running, or killed before it finished


@dataclass(frozen=True)
class RunStatus:
    status: str
    error: str | None = None
    metrics: dict[str, Any] | None = None  # the parsed metrics.json when status is ok


def read_status(run_dir: str | os.PathLike) -> RunStatus:
    """Classify one run dir. A valid metrics.json wins over a stale failed.json: metrics is written last."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS
    if metrics_path.is_file():
        try:
            metrics = json.loads(metrics_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            return RunStatus(Status.corrupt, f"{METRICS}: {type(e).__name__}: {e}")
        if not isinstance(metrics, dict):
            kind = type(metrics).__name__
            return RunStatus(Status.corrupt, f"{METRICS}: expected a JSON object, got {kind}")
        if metrics.get("status", Status.ok) != Status.ok:
            return RunStatus(Status.failed, str(metrics.get("error", f"status={metrics['status']}")))
        absent = [k for k in REQUIRED_KEYS if k not in metrics]
        if absent:
            return RunStatus(Status.corrupt, f"{METRICS}: missing keys {', '.join(absent)}")
        return RunStatus(Status.ok, None, metrics)
    if (run_dir / FAILED).is_file():
        return RunStatus(Status.failed, _failure_message(run_dir / FAILED))
    return RunStatus(Status.missing, f"no {METRICS} or {FAILED}")


def completed(run_dir: str | os.PathLike) -> bool:
    """True when ``run_dir`` holds a valid metrics.json: re-running its job would only duplicate it.

    Failed, corrupt (e.g. cut off by a kill) and unfinished runs are not completed: a re-run retries them.
    """
    return read_status(run_dir).status == Status.ok


def record_failure(run_dir: str | os.PathLike, error: BaseException) -> Path:
    """Write ``failed.json`` (type, message, traceback, time) atomically; the sweep goes on."""
    payload = {
        "status": Status.failed,
        "error_type": type(error).__name__,
        "error": f"{type(error).__name__}: {error}",
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return write_json_atomic(Path(run_dir) / FAILED, payload)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write JSON atomically (temp file + fsync + rename): the one writer of run outputs, specsim.io's."""
    return atomic_write_json(path, obj)


def is_run_dir(path: Path) -> bool:
    markers = (path / METRICS, path / FAILED, path / HYDRA_DIR / "config.yaml")
    return any(m.is_file() for m in markers)


def find_runs(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Run dirs at or below each path (a run, a sweep, a parent of sweeps), sorted, without duplicates.

    Runs do not nest, so the walk stops at the first run dir on each branch; hidden dirs are skipped.
    """
    roots = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    found: dict[Path, None] = {}
    for root in roots:
        root = Path(root).resolve()
        if not root.exists():
            raise FileNotFoundError(f"no run or sweep directory at {root}")
        for run in _walk(root):
            found.setdefault(run, None)
    return sorted(found)


def _walk(path: Path) -> Iterable[Path]:
    if is_run_dir(path):
        yield path
        return
    for child in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
        yield from _walk(child)


def sweep_root(run_dir: Path) -> Path:
    """The nearest ancestor holding multirun.yaml, else the run's parent directory."""
    for parent in run_dir.parents:
        if (parent / SWEEP_MARKER).is_file():
            return parent
    return run_dir.parent


def read_overrides(run_dir: Path) -> list[str]:
    """The job's command-line overrides (``.hydra/overrides.yaml``), or [] when absent or unreadable."""
    try:
        data = yaml.safe_load((run_dir / HYDRA_DIR / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(x) for x in data] if isinstance(data, list) else []


def job_status(sweep_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """One record per job dir of a sweep: ``job`` (path relative to the sweep), ``overrides``, ``status``,
    ``error``, ``run_dir``. ``pandas.DataFrame(job_status(d))`` gives the table; see also :func:`summary`."""
    sweep_dir = Path(sweep_dir).resolve()
    records = []
    for run in find_runs(sweep_dir):
        st = read_status(run)
        records.append(
            {
                "job": str(run.relative_to(sweep_dir)) if run != sweep_dir else ".",
                "overrides": ",".join(read_overrides(run)),
                "status": st.status,
                "error": st.error,
                "run_dir": str(run),
            }
        )
    return records


def summary(sweep_dir: str | os.PathLike) -> dict[str, int]:
    """Counts of jobs per status, e.g. ``{"ok": 6, "failed": 1, "corrupt": 0, "missing": 1}``."""
    counts = {s: 0 for s in (Status.ok, Status.failed, Status.corrupt, Status.missing)}
    for rec in job_status(sweep_dir):
        counts[rec["status"]] += 1
    return counts


def list_sweeps(root: str | os.PathLike = "multirun") -> list[Path]:
    """Sweep dirs (holding multirun.yaml) at or below ``root``, newest first by the marker's mtime."""
    markers = sorted(Path(root).rglob(SWEEP_MARKER), key=lambda p: (p.stat().st_mtime, str(p)), reverse=True)
    return [m.parent.resolve() for m in markers]


def latest_sweep(root: str | os.PathLike = "multirun") -> Path:
    """The most recently started sweep under ``root``: newest multirun.yaml, else newest child dir."""
    root = Path(root)
    sweeps = list_sweeps(root) if root.is_dir() else []
    if sweeps:
        return sweeps[0]
    children = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: (p.stat().st_mtime, p.name)) \
        if root.is_dir() else []
    if not children:
        raise FileNotFoundError(f"no sweep under {root.resolve()}")
    return children[-1].resolve()


def _failure_message(path: Path) -> str:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{FAILED} unreadable: {type(e).__name__}"
    return str(data.get("error", "failed")) if isinstance(data, dict) else "failed"


