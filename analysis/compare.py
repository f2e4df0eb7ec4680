"""Prediction vs measurement: how far the simulator's τ (k̄, accepted tokens per target forward, bonus
included) and speedup are from what the real decoding loop measured in the same run.

Relative error = (predicted − measured) / measured, so a positive value means the simulator is optimistic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

# (measured column, predicted column, output prefix)
PAIRS = (("tau", "predicted_tau", "tau"), ("speedup", "predicted_speedup", "speedup"))


def relative_error(measured: pd.Series, predicted: pd.Series) -> pd.Series:
    """(predicted − measured) / measured; NaN where either is missing or the measurement is 0."""
    m = pd.to_numeric(measured, errors="coerce")
    p = pd.to_numeric(predicted, errors="coerce")
    return (p - m) / m.where(m != 0)


def prediction_error(df: pd.DataFrame) -> pd.DataFrame:
    """Copy of ``df`` with ``<x>_error`` (predicted − measured), ``<x>_rel_error`` and ``<x>_abs_rel_error``
    for x in tau, speedup. Rows without a measurement (simulate runs, failures) get NaN."""
    out = df.copy()
    for measured, predicted, name in PAIRS:
        if measured not in out.columns or predicted not in out.columns:
            out[f"{name}_error"] = np.nan
            out[f"{name}_rel_error"] = np.nan
            out[f"{name}_abs_rel_error"] = np.nan
            continue
        m = pd.to_numeric(out[measured], errors="coerce")
        p = pd.to_numeric(out[predicted], errors="coerce")
        out[f"{name}_error"] = p - m
        out[f"{name}_rel_error"] = relative_error(m, p)
        out[f"{name}_abs_rel_error"] = out[f"{name}_rel_error"].abs()
    return out


def error_summary(df: pd.DataFrame, by: Sequence[str] = ("method", "tree")) -> pd.DataFrame:
    """Per group: number of measured runs, mean signed relative error (bias) and mean absolute relative
    error (MAPE) of τ and speedup, plus the worst absolute relative error. One row per group."""
    err = df if "tau_rel_error" in df.columns else prediction_error(df)
    by = [c for c in by if c in err.columns]
    measured = err[err["tau_rel_error"].notna() | err["speedup_rel_error"].notna()]
    aggs = {"n": ("tau_rel_error", "size")}
    for _, _, name in PAIRS:
        aggs[f"{name}_bias"] = (f"{name}_rel_error", "mean")
        aggs[f"{name}_mape"] = (f"{name}_abs_rel_error", "mean")
        aggs[f"{name}_max_abs"] = (f"{name}_abs_rel_error", "max")
    if not by:
        return measured.assign(_all="all").groupby("_all").agg(**aggs).reset_index(drop=True)
    return measured.groupby(by, dropna=False, sort=True).agg(**aggs).reset_index()
