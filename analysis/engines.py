"""The two decoding engines side by side (issue 18): specsim's own loop and vLLM (Kwon et al. 2023) running
the same methods on the same checkpoints and prompts, each beside the simulator's prediction priced for that
engine (vLLM's profile: its own t(1) and drafting cost inside speculation).

τ = tokens per target forward (bonus included); speedup = tokens/s over the same engine's plain decoding in
the same run. A run's engine is its ``engine.name`` (config) or ``engine`` (metrics.json); runs written
before the engine group existed are specsim's.

    python run.py -m engine=specsim,vllm method=vanilla      # in .venv-vllm (README, "vLLM")
    python -m analysis.engines multirun/DATE/TIME             # the table, and DIR/engines.{png,pdf}
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from analysis.compare import prediction_error
from analysis.plots import LABELS, STYLE, save
from analysis.tables import ok_runs

DEFAULT_ENGINE = "specsim"
TABLE_COLUMNS = ("engine", "method", "workload", "batch_size", "tau", "predicted_tau", "tau_rel_error",
                 "speedup", "predicted_speedup", "speedup_rel_error", "tokens_per_s", "baseline_tokens_per_s")


def engine_of(df: pd.DataFrame) -> pd.Series:
    """Each run's engine: ``engine.name`` from its config, else metrics.json's ``engine``, else specsim."""
    out = pd.Series(DEFAULT_ENGINE, index=df.index, dtype=object)
    for column in ("engine", "engine.name"):  # the config's name wins: it is what the run was asked for
        if column in df.columns:
            out = df[column].where(df[column].notna(), out)
    return out.astype(str)


def engine_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per finished measure run: its engine, method, workload, batch, measured and predicted τ and
    speedup with the relative errors ((predicted − measured) / measured), tokens/s of the method and of the
    engine's plain decoding. Sorted by method then engine."""
    runs = ok_runs(df)
    measured = pd.to_numeric(runs["tau"], errors="coerce").notna() if "tau" in runs.columns else False
    runs = runs[measured] if "tau" in runs.columns else runs[:0]
    err = prediction_error(runs).assign(engine=engine_of(runs))
    config_batch = err["workload.batch_size"] if "workload.batch_size" in err.columns else 1
    measured = err["batch_size"] if "batch_size" in err.columns else pd.Series(np.nan, index=err.index)
    err["batch_size"] = measured.fillna(config_batch)
    cols = [c for c in TABLE_COLUMNS if c in err.columns]
    return err[cols].sort_values(["method", "engine"], kind="stable").reset_index(drop=True)


def engines_figure(df: pd.DataFrame, x: str = "method", metrics: Sequence[str] = ("tau", "speedup")
                   ) -> Figure:
    """One panel per metric (τ, speedup): per ``x`` value, one bar per engine (the measured mean) and a
    black diamond on it at the simulator's predicted mean for that engine; the panel title gives each
    engine's mean absolute relative error."""
    table = engine_table(df)
    if table.empty:
        raise ValueError("no finished task=measure run with a measured tau")
    engines = sorted(table["engine"].unique(), key=lambda e: (e != DEFAULT_ENGINE, e))
    groups = sorted(table[x].astype(str).unique())
    colors = dict(zip(engines, sns.color_palette(n_colors=len(engines))))
    width = 0.8 / len(engines)
    with sns.axes_style(STYLE):
        panel = max(3.4, 1.5 + 1.4 * len(groups) * len(engines) ** 0.5)
        fig = Figure(figsize=(panel * len(metrics), 3.8), layout="constrained")
        axes = fig.subplots(1, len(metrics), squeeze=False)[0]
        for ax, metric in zip(axes, metrics):
            mean = table.assign(**{x: table[x].astype(str)}).groupby([x, "engine"])[
                [metric, f"predicted_{metric}", f"{metric}_rel_error"]].mean()
            for j, engine in enumerate(engines):
                at = [(i + (j - (len(engines) - 1) / 2) * width, g) for i, g in enumerate(groups)
                      if (g, engine) in mean.index]
                xs = np.array([p for p, _ in at])
                rows = mean.loc[[(g, engine) for _, g in at]]
                ax.bar(xs, rows[metric].to_numpy(float), width * 0.95, color=colors[engine],
                       label=f"{engine} measured")
                ax.scatter(xs, rows[f"predicted_{metric}"].to_numpy(float), marker="D", color="black",
                           s=28, zorder=3, label="predicted" if j == 0 else None)
            ax.axhline(1.0, color="0.3", lw=1, ls="--", zorder=0)
            ax.set_xticks(range(len(groups)), groups)
            ax.set(xlabel=x, ylabel=LABELS.get(metric, metric), title=_title(table, metric, engines))
        axes[-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize="small")
    return fig


def _title(table: pd.DataFrame, metric: str, engines: list[str]) -> str:
    """``metric`` and, a line each, every engine's mean |relative error| of the prediction (engines without a
    prediction left out)."""
    mape = table.groupby("engine")[f"{metric}_rel_error"].apply(lambda s: s.abs().mean())
    parts = [f"{e}: {mape[e]:.1%} off" for e in engines if pd.notna(mape.get(e))]
    name = "τ" if metric == "tau" else metric
    return "\n".join([name, *parts])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.engines", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a sweep dir (or any dir of runs) with both engines' runs")
    ap.add_argument("--out", type=Path, help="figure path without extension (default DIR/engines)")
    args = ap.parse_args(argv)
    from analysis.load import load

    df = load(args.dir)
    table = engine_table(df)
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.precision", 3):
        print(table.to_string(index=False))
    paths = save(engines_figure(df), args.out or args.dir / "engines")
    print("figure:", *map(str, paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
