"""Pivot tidy run tables and render them as Markdown (notes, README) or LaTeX booktabs (papers).

The renderers are small and local on purpose: pandas' own ``to_markdown`` needs ``tabulate`` and
``to_latex`` needs jinja2, neither of which specsim depends on. Only runs with ``status == "ok"`` enter a
pivot; NaN renders as an en dash.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

Keys = str | Sequence[str]
DASH = "–"
_LATEX_SPECIAL = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
                  "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}"}


def ok_runs(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of finished runs only (all rows when there is no ``status`` column)."""
    return df[df["status"] == "ok"] if "status" in df.columns else df


def pivot(df: pd.DataFrame, index: Keys, columns: Keys | None = None, values: Keys = "speedup",
          agg: str = "mean") -> pd.DataFrame:
    """``index`` × ``columns`` table of ``agg(values)`` over the finished runs (seeds are averaged).

    With several ``values`` the columns are (value, column) pairs; without ``columns`` it is a group-by.
    """
    data = ok_runs(df)
    index, values = _as_list(index), _as_list(values)
    data = data.assign(**{v: pd.to_numeric(data[v], errors="coerce") for v in values})
    if columns is None:
        table = data.groupby(index, sort=True)[values].agg(agg)
    else:
        table = data.pivot_table(index=index, columns=_as_list(columns), values=values, aggfunc=agg,
                                 observed=True, sort=True)
        if len(values) == 1:
            table = table.droplevel(0, axis=1)
        else:  # pivot_table sorts the values alphabetically; keep the order asked for
            table = table.reindex(columns=values, level=0)
    return table


def mean_std(df: pd.DataFrame, index: Keys, columns: Keys | None = None, values: str = "speedup",
             floatfmt: str = ".2f") -> pd.DataFrame:
    """Like :func:`pivot` but each cell is the string "mean ± std" over seeds (just "mean" for one run)."""
    mean = pivot(df, index, columns, values, "mean")
    # pivot_table drops all-NaN columns (std of single runs): align to the mean's shape
    std = pivot(df, index, columns, values, "std").reindex(index=mean.index, columns=mean.columns)
    count = pivot(df, index, columns, values, "count").reindex(index=mean.index, columns=mean.columns)
    cells = mean.copy().astype(object)
    for key in mean.index:
        for col in mean.columns:
            m, s, n = mean.at[key, col], std.at[key, col], count.at[key, col]
            text = _fmt(m, floatfmt)
            cells.at[key, col] = text + (f" ± {_fmt(s, floatfmt)}" if n > 1 and not pd.isna(s) else "")
    return cells


def to_markdown(df: pd.DataFrame, index: Keys | None = None, columns: Keys | None = None,
                values: Keys | None = None, *, agg: str = "mean", floatfmt: str = ".3f") -> str:
    """Markdown pipe table. With ``index`` the runs are pivoted first (see :func:`pivot`); else ``df`` is
    rendered as it is (its named index becomes leading columns)."""
    table = _table(df, index, columns, values, agg)
    header, rows, numeric = _cells(table, floatfmt)
    esc = [[c.replace("|", r"\|") for c in r] for r in [header, *rows]]
    align = ["---:" if n else ":---" for n in numeric]
    lines = ["| " + " | ".join(esc[0]) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines) + "\n"


def to_latex(df: pd.DataFrame, index: Keys | None = None, columns: Keys | None = None,
             values: Keys | None = None, *, agg: str = "mean", floatfmt: str = ".3f",
             caption: str | None = None, label: str | None = None) -> str:
    """LaTeX ``tabular`` with booktabs rules, wrapped in a ``table`` float when given a caption or label."""
    table = _table(df, index, columns, values, agg)
    header, rows, numeric = _cells(table, floatfmt)
    spec = "".join("r" if n else "l" for n in numeric)
    body = [" & ".join(_latex_escape(c) for c in r) + r" \\" for r in rows]
    lines = [rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(_latex_escape(c) for c in header) + r" \\", r"\midrule", *body,
             r"\bottomrule", r"\end{tabular}"]
    if caption is None and label is None:
        return "\n".join(lines) + "\n"
    extra = ([rf"\caption{{{_latex_escape(caption)}}}"] if caption else []) + (
        [rf"\label{{{label}}}"] if label else [])
    return "\n".join([r"\begin{table}[t]", r"\centering", *lines, *extra, r"\end{table}"]) + "\n"


def save_table(table: pd.DataFrame, path_without_ext: str | os.PathLike, *, floatfmt: str = ".3f",
               caption: str | None = None, label: str | None = None) -> list[Path]:
    """Write ``<path>.md`` and ``<path>.tex`` of an already pivoted table; returns both paths."""
    base = Path(path_without_ext)
    base.parent.mkdir(parents=True, exist_ok=True)
    md, tex = Path(f"{base}.md"), Path(f"{base}.tex")
    md.write_text(to_markdown(table, floatfmt=floatfmt))
    tex.write_text(to_latex(table, floatfmt=floatfmt, caption=caption, label=label))
    return [md, tex]


# ---- rendering helpers -----------------------------------------------------------------------------
def _table(df: pd.DataFrame, index: Keys | None, columns: Keys | None, values: Keys | None,
           agg: str) -> pd.DataFrame:
    if index is None:
        assert columns is None and values is None, "columns/values need an index to pivot on"
        return df
    return pivot(df, index, columns, values if values is not None else "speedup", agg)


def _cells(table: pd.DataFrame, floatfmt: str) -> tuple[list[str], list[list[str]], list[bool]]:
    """Header, body strings and per-column "is numeric" flags; named index levels become columns."""
    named_index = any(n is not None for n in table.index.names)
    flat = table.reset_index() if named_index else table
    names = list(table.columns.names)
    labels = [_label(c, names) if c in table.columns else _label(c, []) for c in flat.columns]
    numeric = [pd.api.types.is_numeric_dtype(flat[c]) and not pd.api.types.is_bool_dtype(flat[c])
               for c in flat.columns]
    rows = [[_fmt(v, floatfmt) for v in rec] for rec in flat.itertuples(index=False, name=None)]
    return labels, rows, numeric


def _label(col: Any, names: Sequence[Any]) -> str:
    """A column header; a pivot's named column levels read "name=value" (e.g. "ρ=0.1")."""
    parts = col if isinstance(col, tuple) else (col,)
    names = list(names) if len(names) == len(parts) else [None] * len(parts)
    return " / ".join(str(p) if n is None else f"{n}={p}" for p, n in zip(parts, names) if p != "")


def _fmt(value: Any, floatfmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return DASH
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return format(float(value), floatfmt)
    return str(value)


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def _as_list(keys: Keys) -> list[str]:
    return [keys] if isinstance(keys, str) else list(keys)
