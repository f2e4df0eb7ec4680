"""Load runs and sweeps into one tidy pandas DataFrame: one row per run, config columns + metric columns.

Columns come from ``metrics.json`` (flat; dotted keys such as ``method.draft_cost_ratio`` are config inputs,
undotted ones are identity and results; lists/dicts such as ``accept_hist`` stay Python objects) and from
``.hydra/config.yaml`` flattened to dotted keys (metrics.json wins where both have a key). Every row has
``status`` (see :class:`analysis.sweep.Status`), ``error``, ``run_dir``, ``sweep_dir``, ``job`` and
``overrides``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from omegaconf import OmegaConf

from analysis.sweep import HYDRA_DIR, SAMPLES, Status, find_runs, read_overrides, read_status, sweep_root

IDENTITY = ("task", "method", "tree", "hardware", "workload", "model", "seed")
BOOKKEEPING = ("status", "error", "job", "overrides", "sweep_dir", "run_dir")
# config group -> field that names the preset when neither metrics.json nor Hydra's choices say
_NAME_FIELD = {"method": "name", "tree": "kind", "hardware": "name", "workload": "name", "model": "name"}

PathArg = str | os.PathLike | Iterable[str | os.PathLike]


def load(path: PathArg, *, include_failed: bool = True, config: bool = True) -> pd.DataFrame:
    """Tidy table of every run at or below ``path`` (a run dir, a sweep dir, a parent of sweeps, or a list).

    Runs that failed, were cut off, or whose metrics.json is corrupt are kept with ``status`` != "ok" and
    NaN metrics (``include_failed=False`` drops them). ``config=False`` skips reading ``.hydra`` yaml.
    """
    rows = [_row(run, config=config) for run in find_runs(path)]
    if not include_failed:
        rows = [r for r in rows if r["status"] == Status.ok]
    df = pd.DataFrame.from_records(rows) if rows else pd.DataFrame(columns=[*IDENTITY, *BOOKKEEPING])
    return df[_column_order(df.columns)]


def load_samples(path: PathArg) -> pd.DataFrame:
    """Per-prompt records of every run's ``samples.jsonl``, with a ``run_dir`` column; bad lines skipped."""
    records = []
    for run in find_runs(path):
        try:
            lines = (run / SAMPLES).read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by a kill; the rest of the file is still good
            if isinstance(rec, dict):
                records.append({**rec, "run_dir": str(run)})
    return pd.DataFrame.from_records(records)


def sweep_axes(df: pd.DataFrame) -> list[str]:
    """Columns a sweep varies: the keys of the jobs' overrides (``method``, ``tree.gamma``, …) that take
    more than one value among the finished runs, in the order they were first given on the command line."""
    ok = df[df["status"] == Status.ok] if "status" in df.columns else df
    keys: dict[str, None] = {}
    for overrides in ok.get("overrides", pd.Series(dtype=str)).dropna():
        for item in str(overrides).split(","):
            key = item.split("=", 1)[0].lstrip("+~")
            if "=" in item and key in ok.columns:
                keys.setdefault(key, None)
    return [k for k in keys if ok[k].map(repr).nunique() > 1]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> dotted keys; lists and other leaves are kept as they are."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``.hydra/config.yaml`` as dotted keys, interpolations resolved where they resolve without Hydra."""
    cfg = _read_yaml(Path(run_dir) / HYDRA_DIR / "config.yaml")
    if not isinstance(cfg, dict):
        return {}
    try:
        cfg = OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)
    except Exception:  # noqa: BLE001 - ${hydra:...} and custom resolvers need Hydra; keep the raw strings
        pass
    return flatten(cfg)


def read_choices(run_dir: str | os.PathLike) -> dict[str, str]:
    """Hydra's chosen preset per config group (``hydra.runtime.choices`` in ``.hydra/hydra.yaml``)."""
    data = _read_yaml(Path(run_dir) / HYDRA_DIR / "hydra.yaml")
    try:
        choices = data["hydra"]["runtime"]["choices"]
    except (KeyError, TypeError):
        return {}
    return {k: str(v) for k, v in choices.items() if not k.startswith("hydra") and v is not None}


def _row(run: Path, *, config: bool) -> dict[str, Any]:
    st = read_status(run)
    row: dict[str, Any] = {}
    if config:
        row.update(read_config(run))
        choices = read_choices(run)
        for group, field in _NAME_FIELD.items():
            name = choices.get(group, row.get(f"{group}.{field}"))
            if name is not None:
                row[group] = name
    row.update(st.metrics or {})
    sweep = sweep_root(run)
    row.update(
        status=st.status,
        error=st.error,
        job=str(run.relative_to(sweep)),
        overrides=",".join(read_overrides(run)),
        sweep_dir=str(sweep),
        run_dir=str(run),
    )
    return row


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None


def _column_order(columns: Iterable[str]) -> list[str]:
    """Identity first, then results (undotted), then config inputs (dotted, sorted), then bookkeeping."""
    cols = list(columns)
    head = [c for c in IDENTITY if c in cols]
    tail = [c for c in BOOKKEEPING if c in cols]
    rest = [c for c in cols if c not in head and c not in tail]
    results = [c for c in rest if "." not in c]
    inputs = sorted(c for c in rest if "." in c)
    return head + results + inputs + tail
