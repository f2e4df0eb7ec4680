"""analysis.batch on a FABRICATED batch sweep (method=autoregressive,vanilla × workload.batch_size=1..32):
the table per method × B, the measured B*, and the speedup-vs-batch figure with the predicted curve."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.lines import Line2D

from analysis import load
from analysis.batch import batch_table, measured_break_even, speedup_vs_batch
from analysis.plots import save
from specsim.config import RunConfig, flat
from tests.analysis.conftest import _identity, _job_name, _sweep_root, write_run

BATCHES = [1, 2, 4, 8, 16, 32]
TRUE_B_STAR = 6.0  # the fabricated measured speedup crosses 1 here: S(B) = 1.6 · (B* / B)^(log 1.6 / log B*)


def fabricated_speedup(b: int) -> float:
    return 1.6 ** (1 - math.log(b) / math.log(TRUE_B_STAR))


def build_batch_sweep(base: Path, with_predictions: bool) -> Path:
    params = ["method=autoregressive,vanilla", f"workload.batch_size={','.join(map(str, BATCHES))}"]
    root = _sweep_root(base, "2026-02-01/10-00-00", params)
    rng = np.random.default_rng(0)
    for method in ("autoregressive", "vanilla"):
        for b in BATCHES:
            cfg = RunConfig()
            cfg.task, cfg.method.name = "measure", method
            cfg.method.drafter = "draft_model" if method == "vanilla" else method
            cfg.workload.batch_size = b
            base_tps = 300.0 * b ** 0.8 * (1 + rng.normal(0, 0.02))
            s = 1.0 if method == "autoregressive" else fabricated_speedup(b) * (1 + rng.normal(0, 0.01))
            metrics = {**_identity(cfg, "measure", "chain"), **flat(cfg), "tau": 1.0 if s == 1 else 2.8,
                       "speedup": s, "tokens_per_s": base_tps * s, "baseline_tokens_per_s": base_tps,
                       "batch_size": b}
            if with_predictions:
                metrics.update(predicted_speedup=1.1 * fabricated_speedup(b), prediction_batch_size=b,
                               break_even_batch=7.5, ar_tokens_per_s=320.0 * b ** 0.85)
            else:  # the one-sequence prediction: not S(B), must not be drawn as the curve
                metrics.update(predicted_speedup=1.7, prediction_batch_size=1)
            overrides = [f"method={method}", f"workload.batch_size={b}"]
            write_run(root / _job_name(overrides), cfg, {"method": method}, overrides, metrics)
    return root


@pytest.mark.parametrize("with_predictions", [True, False])
def test_batch_table_and_measured_break_even(tmp_path, with_predictions):
    df = load(build_batch_sweep(tmp_path, with_predictions))
    table = batch_table(df)
    assert set(table["method"]) == {"autoregressive", "vanilla"}
    assert sorted(table["workload.batch_size"].unique()) == BATCHES
    van = table[table["method"] == "vanilla"].set_index("workload.batch_size")["predicted_at_batch"]
    assert van[1] == pytest.approx(1.1 * fabricated_speedup(1) if with_predictions else 1.7)
    assert van[BATCHES[1:]].notna().all() == with_predictions  # a one-sequence prediction is S(1) only
    assert van[BATCHES[1:]].isna().all() != with_predictions
    b_star = measured_break_even(table, "vanilla")
    assert b_star == pytest.approx(TRUE_B_STAR, rel=0.1)
    assert measured_break_even(table, "autoregressive") is None  # S = 1 never falls below 1
    # another column: the same crossing read off a column scaled by 1.2 moves later; a missing column: None
    scaled = table.assign(other=table["speedup"] * 1.2)
    assert measured_break_even(scaled, "vanilla", column="other") > b_star * 1.5
    assert measured_break_even(table, "vanilla", column="no_such_column") is None


def _vlines(ax) -> dict[str, float]:
    return {line.get_label(): float(line.get_xdata()[0]) for line in ax.get_lines()
            if isinstance(line, Line2D) and len(set(line.get_xdata())) == 1 and "B*" in line.get_label()}


def test_speedup_vs_batch_draws_measured_predicted_and_both_break_evens(tmp_path):
    df = load(build_batch_sweep(tmp_path, with_predictions=True))
    fig = speedup_vs_batch(df)
    left, right = fig.axes
    labels = [line.get_label() for line in left.get_lines()]
    assert "vanilla predicted" in labels
    curve = next(line for line in left.get_lines() if line.get_label() == "vanilla predicted")
    np.testing.assert_allclose(curve.get_ydata(), [1.1 * fabricated_speedup(b) for b in BATCHES])
    stars = _vlines(left)
    assert stars["vanilla predicted B* = 7.5"] == 7.5
    measured = next(v for k, v in stars.items() if k.startswith("vanilla measured B*"))
    assert measured == pytest.approx(TRUE_B_STAR, rel=0.1)
    right_labels = [line.get_label() for line in right.get_lines()]
    assert "batched AR, measured" in right_labels and "cost model B / t(B, 1)" in right_labels
    assert all(p.stat().st_size > 0 for p in save(fig, tmp_path / "fig" / "speedup_vs_batch"))


def test_speedup_vs_batch_takes_a_prediction_frame(tmp_path):
    df = load(build_batch_sweep(tmp_path, with_predictions=False))
    pred = pd.DataFrame({"batch_size": BATCHES, "predicted_speedup": [2, 1.8, 1.4, 1.0, 0.7, 0.5],
                         "break_even_batch": 8.0, "ar_tokens_per_s": [100 * b for b in BATCHES],
                         "roofline_ar_tokens_per_s": [900 * b for b in BATCHES]})
    left, right = speedup_vs_batch(df, prediction=pred).axes
    assert "vanilla predicted B* = 8.0" in _vlines(left)
    model = next(line for line in right.get_lines() if line.get_label().startswith("cost model"))
    np.testing.assert_allclose(model.get_ydata(), [100 * b for b in BATCHES])
    roof = next(line for line in right.get_lines() if line.get_label().startswith("datasheet roofline"))
    np.testing.assert_allclose(roof.get_ydata(), [900 * b for b in BATCHES])


def test_speedup_vs_batch_draws_a_one_sequence_prediction_at_batch_one_only(tmp_path):
    df = load(build_batch_sweep(tmp_path, with_predictions=False))
    left, _ = speedup_vs_batch(df).axes
    curve = next(line for line in left.get_lines() if line.get_label() == "vanilla predicted")
    assert list(curve.get_xdata()) == [1] and list(curve.get_ydata()) == [1.7]
    assert not any(k.startswith("vanilla predicted B*") for k in _vlines(left))


def test_speedup_vs_batch_needs_a_speculative_method(tmp_path):
    df = load(build_batch_sweep(tmp_path, with_predictions=False))
    with pytest.raises(ValueError, match="no speculative method"):
        speedup_vs_batch(df[df["method"] == "autoregressive"])
