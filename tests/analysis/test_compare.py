"""Prediction vs measurement errors on fabricated sweeps."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

import analysis
from analysis.compare import error_summary, prediction_error, relative_error


def test_prediction_error_matches_the_written_numbers(sweeps):
    err = prediction_error(analysis.load(sweeps.measure.path))
    for _, row in err[err["status"] == "ok"].iterrows():
        m = sweeps.measure.metrics[row["job"]]
        assert row["tau_rel_error"] == pytest.approx((m["predicted_tau"] - m["tau"]) / m["tau"])
        rel_speedup = (m["predicted_speedup"] - m["speedup"]) / m["speedup"]
        assert row["speedup_rel_error"] == pytest.approx(rel_speedup)
        assert row["tau_error"] == pytest.approx(m["predicted_tau"] - m["tau"])
        assert row["tau_abs_rel_error"] == pytest.approx(abs(row["tau_rel_error"]))
    assert err.loc[err["status"] != "ok", "tau_rel_error"].isna().all()


def test_simulate_runs_have_no_error(sweeps):
    err = prediction_error(analysis.load(sweeps.leviathan.path))
    assert err["tau_rel_error"].isna().all() and err["speedup_rel_error"].isna().all()
    assert len(error_summary(err)) == 0


def test_prediction_error_without_measured_columns():
    df = pd.DataFrame({"predicted_tau": [2.0], "method": ["vanilla"]})
    err = prediction_error(df)
    assert err["tau_rel_error"].isna().all() and "speedup_abs_rel_error" in err.columns
    assert "tau_rel_error" not in df.columns  # input untouched


def test_error_summary_by_method_and_tree(sweeps):
    df = analysis.load(sweeps.measure.path)
    summary = error_summary(df, by=("method", "tree"))
    ok = [m for m in sweeps.measure.metrics.values() if m is not None]
    assert len(summary) == len({(m["method"], m["tree"]) for m in ok})
    for _, row in summary.iterrows():
        group = [m for m in ok if (m["method"], m["tree"]) == (row["method"], row["tree"])]
        rel = np.array([(m["predicted_tau"] - m["tau"]) / m["tau"] for m in group])
        assert row["n"] == len(group)
        assert row["tau_bias"] == pytest.approx(rel.mean())
        assert row["tau_mape"] == pytest.approx(np.abs(rel).mean())
        assert row["tau_max_abs"] == pytest.approx(np.abs(rel).max())
    overall = error_summary(df, by=())
    assert len(overall) == 1 and overall["n"].iloc[0] == len(ok)


@given(measured=st.floats(0.1, 10), ratio=st.floats(0.2, 5))
def test_relative_error_sign_and_scale(measured, ratio):
    rel = relative_error(pd.Series([measured]), pd.Series([measured * ratio])).iloc[0]
    assert rel == pytest.approx(ratio - 1, abs=1e-9)


def test_relative_error_of_zero_measurement_is_nan():
    rel = relative_error(pd.Series([0.0, 2.0, None]), pd.Series([1.0, 3.0, 1.0]))
    assert np.isnan(rel.iloc[0]) and rel.iloc[1] == pytest.approx(0.5) and np.isnan(rel.iloc[2])
