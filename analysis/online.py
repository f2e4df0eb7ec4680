"""Per-request curves of measure runs (Online speculative decoding, Liu et al. 2023: the draft q learns from
the target p between requests) and the method comparison table of the multi-draft / lookahead / staged runs.

A measure run's metrics.json holds ``per_request_acceptance`` (token acceptance rate: accepted children over
accepted nodes that had children), ``per_request_tau`` (tokens per target forward, bonus included) and
``per_request_time_offline_s`` in serving order, and ``drafter_updates`` for a drafter that learns.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.plots import save

SERIES = ("acceptance", "tau")
COMPARED = ("tau", "speedup", "predicted_tau", "predicted_speedup")


def run_label(row: pd.Series) -> str:
    """method, marked static when an online drafter never updates (the control), with its tree."""
    label = str(row.get("method", "?"))
    every = row.get("method.params.update_every")
    if label == "online" and every is not None and not pd.isna(every) and int(every) == 0:
        label = "online (static control)"
    return label


def per_request(runs: pd.DataFrame) -> pd.DataFrame:
    """Long table: one row per (run, request) with ``label``, ``request`` (1-based), acceptance and tau, for
    the runs that have per-request series."""
    rows = []
    for _, run in runs.iterrows():
        acc = run.get("per_request_acceptance")
        if not isinstance(acc, list) or not acc:
            continue
        taus = run.get("per_request_tau") or [np.nan] * len(acc)
        for i, (a, t) in enumerate(zip(acc, taus), 1):
            rows.append({"label": run_label(run), "workload": run.get("workload"),
                         "run_dir": run.get("run_dir"), "request": i, "acceptance": a, "tau": t})
    return pd.DataFrame(rows, columns=["label", "workload", "run_dir", "request", *SERIES])


def first_last(long: pd.DataFrame, n: int = 16) -> pd.DataFrame:
    """Mean acceptance and τ over the first and the last ``n`` requests of each run."""
    out = []
    for (label, _), g in long.groupby(["label", "run_dir"], sort=False):
        g = g.sort_values("request")
        row = {"label": label, "requests": len(g)}
        for s in SERIES:
            row[f"{s}_first{n}"] = g[s].head(n).mean()
            row[f"{s}_last{n}"] = g[s].tail(n).mean()
        out.append(row)
    return pd.DataFrame(out)


def curve(long: pd.DataFrame, window: int = 8, updates: Sequence[int] = ()) -> Figure:
    """Acceptance and τ per request (points) with their running mean over ``window`` requests (lines), one
    colour per run; dotted verticals after the requests that were followed by a distillation update."""
    fig = Figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 2)
    for ax, s in zip(axes, SERIES):
        for (label, _), g in long.groupby(["label", "run_dir"], sort=False):
            g = g.sort_values("request")
            line = ax.plot(g["request"], g[s].rolling(window, min_periods=1).mean(), label=label)[0]
            ax.scatter(g["request"], g[s], s=8, alpha=0.35, color=line.get_color())
        for u in updates:
            ax.axvline(u + 0.5, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("request (serving order)")
        ax.set_ylabel({"acceptance": "token acceptance rate", "tau": "τ (tokens / target forward)"}[s])
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def save_run_curve(run_dir: str | os.PathLike, metrics: dict, window: int = 8) -> list[Path]:
    """``per_request.png`` of one run (run.py writes it for a drafter that learns while serving)."""
    row = pd.Series({**metrics, "run_dir": str(run_dir)})
    long = per_request(pd.DataFrame([row]))
    updates = [u.get("after_measured_request", u["after_request"])
               for u in metrics.get("drafter_updates", [])]
    return save(curve(long, window, updates), Path(run_dir) / "per_request", formats=("png",))


def comparison(runs: pd.DataFrame, methods: Sequence[str] | None = None) -> pd.DataFrame:
    """τ, speedup and their predictions per (method, tree, workload), plus the mean tree size and the draft
    forwards per step where a run reports them."""
    df = runs if methods is None else runs[runs["method"].isin(list(methods))]
    if not df.empty:  # the online drafter's static control under its own name
        df = df.assign(method=df.apply(run_label, axis=1))
    keep = [c for c in ("method", "tree", "workload", *COMPARED, "tree_size", "draft_forwards_per_step")
            if c in df.columns]
    order = [c for c in ("workload", "method", "tree") if c in keep]
    return df[keep].sort_values(order).reset_index(drop=True)
