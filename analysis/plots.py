"""Seaborn figures of tidy run tables, saved as PNG and PDF.

Figures are built on ``matplotlib.figure.Figure`` directly, never through pyplot: no global figure
registry, no backend to select, nothing to close, and they render headless (Agg for PNG, the PDF backend
for PDF). τ = mean accepted tokens per target forward (bonus included); speedup = tokens/s over the
autoregressive baseline of the same run. Bars prefer the measured column and fall back to the prediction.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.compare import PAIRS, prediction_error
from analysis.tables import DASH, ok_runs, pivot

STYLE = "whitegrid"
SYMBOLS = {"tau": "τ"}
LABELS = {"tau": "τ (tokens / target forward)", "speedup": "speedup over autoregressive",
          "predicted_tau": "predicted τ", "predicted_speedup": "predicted speedup"}


def save(fig: Figure, path_without_ext: str | os.PathLike, formats: Sequence[str] = ("png", "pdf"),
         dpi: int = 150) -> list[Path]:
    """Write ``<path>.png`` and ``<path>.pdf`` (parents created); returns the paths written."""
    base = str(path_without_ext)
    for fmt in formats:  # tolerate "fig.png": strip a suffix that is one of the formats
        if base.endswith("." + fmt):
            base = base[: -len(fmt) - 1]
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = Path(f"{base}.{fmt}")
        # no creation date in the PDF, so re-running a notebook does not churn unchanged figures
        meta = {"CreationDate": None} if fmt == "pdf" else None
        fig.savefig(path, format=fmt, dpi=dpi, bbox_inches="tight", metadata=meta)
        paths.append(path)
    return paths


def speedup_bars(df: pd.DataFrame, x: str = "method", hue: str | None = "tree", col: str | None = "workload",
                 y: str | None = None) -> Figure:
    """Mean speedup (± sd over seeds) per ``x`` and ``hue``, one panel per ``col``; dashed line at 1×."""
    fig = _bars(df, _pick(df, y, "speedup"), x, hue, col)
    for ax in fig.axes:
        ax.axhline(1.0, color="0.3", lw=1, ls="--", zorder=0)
    return fig


def tau_bars(df: pd.DataFrame, x: str = "method", hue: str | None = "tree", col: str | None = "workload",
             y: str | None = None) -> Figure:
    """Mean τ (± sd over seeds) per ``x`` and ``hue``, one panel per ``col``; dashed line at τ = 1 (AR)."""
    fig = _bars(df, _pick(df, y, "tau"), x, hue, col)
    for ax in fig.axes:
        ax.axhline(1.0, color="0.3", lw=1, ls="--", zorder=0)
    return fig


def predicted_vs_measured(df: pd.DataFrame, metrics: Sequence[str] = ("tau", "speedup"),
                          hue: str | None = "method", style: str | None = "tree",
                          bands: Sequence[float] = (0.1, 0.2)) -> Figure:
    """Scatter of predicted against measured τ and speedup, y = x line and shaded ±``bands`` relative error.

    Each panel's title gives the mean absolute relative error (MAPE) over the runs it shows.
    """
    data = prediction_error(ok_runs(df))
    pairs = [p for p in PAIRS if p[2] in metrics]
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(4.8 * len(pairs), 4.4), layout="constrained")
        axes = fig.subplots(1, len(pairs), squeeze=False)[0]
        for ax, (measured, predicted, name) in zip(axes, pairs):
            sub = data[data[f"{name}_rel_error"].notna()]
            if sub.empty:
                raise ValueError(f"no finished run has both {measured} and {predicted}")
            _diagonal(ax, sub[measured], sub[predicted], bands)
            sns.scatterplot(data=_categorical(sub, hue, style), x=measured, y=predicted, hue=_has(sub, hue),
                            style=_has(sub, style), ax=ax, s=50, zorder=3)
            mape, symbol = sub[f"{name}_abs_rel_error"].mean(), SYMBOLS.get(name, name)
            ax.set(xlabel=f"measured {symbol}", ylabel=f"predicted {symbol}",
                   title=f"{symbol}: MAPE {mape:.1%} (n={len(sub)})")
            ax.legend(fontsize="small")
    return fig


def heatmap(df: pd.DataFrame, x: str, y: str, value: str, agg: str = "mean", fmt: str = ".2f",
            cmap: str = "viridis") -> Figure:
    """Annotated heatmap of ``agg(value)`` over finished runs, ``y`` rows × ``x`` columns."""
    table = pivot(df, index=y, columns=x, values=value, agg=agg)
    if table.empty:
        raise ValueError(f"no finished run has {value}")
    with sns.axes_style("white"):
        fig = Figure(figsize=(1.1 * table.shape[1] + 2.5, 0.5 * table.shape[0] + 1.8), layout="constrained")
        ax = fig.subplots()
        sns.heatmap(table, annot=True, fmt=fmt, cmap=cmap, ax=ax,
                    cbar_kws={"label": LABELS.get(value, value)})
        ax.set(xlabel=x, ylabel=y)
        ax.tick_params(axis="y", labelrotation=0)
    return fig


def lines(df: pd.DataFrame, x: str, y: str, hue: str | None = None, style: str | None = None,
          col: str | None = None) -> Figure:
    """Mean ``y`` against numeric ``x`` (± sd over seeds), one line per ``hue``/``style``, panels by ``col``
    (e.g. Sequoia scaling: tree size vs τ per hardware)."""
    data = _categorical(ok_runs(df), hue, style, col)
    data = data.assign(**{c: pd.to_numeric(data[c], errors="coerce") for c in (x, y)})
    data = data.dropna(subset=[x, y])
    panels = _panels(data, col)
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(4.8 * len(panels), 3.8), layout="constrained")
        axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
        for ax, (title, sub) in zip(axes, panels):
            sns.lineplot(data=sub, x=x, y=y, hue=_has(sub, hue), style=_has(sub, style), marker="o",
                         errorbar="sd", ax=ax, hue_order=_order(data, hue), style_order=_order(data, style))
            ax.set(title=title, ylabel=LABELS.get(y, y))
        _one_legend(axes)
    return fig


# ---- helpers ---------------------------------------------------------------------------------------
def _bars(df: pd.DataFrame, y: str, x: str, hue: str | None, col: str | None) -> Figure:
    data = _categorical(ok_runs(df), x, hue, col)
    data = data.assign(**{y: pd.to_numeric(data[y], errors="coerce")}).dropna(subset=[y])
    if data.empty:
        raise ValueError(f"no finished run has {y}")
    panels = _panels(data, col)
    width = 1.0 + 0.9 * data[x].nunique() * max(1, data[hue].nunique() if _has(data, hue) else 1) ** 0.5
    with sns.axes_style(STYLE):
        fig = Figure(figsize=(max(4.0, width) * len(panels), 3.8), layout="constrained")
        axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
        for ax, (title, sub) in zip(axes, panels):
            # errorbar="sd" is deterministic (seaborn's default bootstrap CI is random)
            sns.barplot(data=sub, x=x, y=y, hue=_has(sub, hue), errorbar="sd", ax=ax, order=_order(data, x),
                        hue_order=_order(data, hue))
            ax.set(title=title, ylabel=LABELS.get(y, y), xlabel=x)
            ax.tick_params(axis="x", labelrotation=30)
        _one_legend(axes)
    return fig


def _pick(df: pd.DataFrame, y: str | None, measured: str) -> str:
    """The column to draw: ``y`` if given, else the measured one if any run has it, else the prediction."""
    if y is not None:
        return y
    if measured in df.columns and pd.to_numeric(ok_runs(df)[measured], errors="coerce").notna().any():
        return measured
    return f"predicted_{measured}"


def _has(df: pd.DataFrame, column: str | None) -> str | None:
    """``column`` if it exists with at least one value, else None (seaborn then draws no hue/style)."""
    return column if column is not None and column in df.columns and df[column].notna().any() else None


def _categorical(df: pd.DataFrame, *columns: str | None) -> pd.DataFrame:
    """Grouping columns as strings, so numbers (γ, budgets) get a categorical palette and ordering."""
    keep = [c for c in columns if _has(df, c)]
    return df.assign(**{c: df[c].map(lambda v: DASH if pd.isna(v) else str(v)) for c in keep})


def _order(df: pd.DataFrame, column: str | None) -> list[str] | None:
    if not _has(df, column):
        return None
    values = df[column].dropna().unique().tolist()
    return sorted(values, key=_natural)


def _natural(value: str) -> tuple:
    # "2" < "10", and numbers before words
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def _panels(df: pd.DataFrame, col: str | None) -> list[tuple[str, pd.DataFrame]]:
    if not _has(df, col):
        return [("", df)]
    return [(f"{col} = {v}", df[df[col] == v]) for v in _order(df, col)]


def _one_legend(axes: Sequence[Axes]) -> None:
    """Keep one legend, outside the last panel, so bars are not hidden."""
    for ax in axes[:-1]:
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    if axes[-1].get_legend() is not None:
        sns.move_legend(axes[-1], "upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _diagonal(ax: Axes, measured: pd.Series, predicted: pd.Series, bands: Sequence[float]) -> None:
    both = np.concatenate([measured.to_numpy(float), predicted.to_numpy(float)])
    lo, hi = both.min(), both.max()
    pad = 0.08 * (hi - lo) if hi > lo else 0.1 * max(abs(hi), 1.0)
    lo, hi = lo - pad, hi + pad
    xs = np.linspace(lo, hi, 100)
    for b in sorted(bands, reverse=True):  # widest first, so narrower bands draw darker on top
        ax.fill_between(xs, xs * (1 - b), xs * (1 + b), color="tab:blue", alpha=0.10, lw=0, label=f"±{b:.0%}")
    ax.plot(xs, xs, color="0.2", lw=1, ls="--", label="y = x")
    ax.set(xlim=(lo, hi), ylim=(lo, hi), aspect="equal")
