"""Figures render headless and save as both PNG and PDF."""

from __future__ import annotations

import sys

import pandas as pd
import pytest

import analysis
from analysis import plots
from analysis.compare import prediction_error


@pytest.fixture(scope="module")
def measured(sweeps) -> pd.DataFrame:
    return analysis.load(sweeps.measure.path)


def _check_saved(paths, base):
    assert [p.name for p in paths] == [f"{base.name}.png", f"{base.name}.pdf"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths[1].read_bytes()[:5] == b"%PDF-"


def test_bars_save_png_and_pdf(tmp_path, measured):
    for fn in (plots.speedup_bars, plots.tau_bars):
        fig = fn(measured)
        assert len(fig.axes) == 2  # one panel per workload
        assert fig.axes[0].get_ylabel() == plots.LABELS[fn.__name__.split("_")[0]]
        base = tmp_path / "figs" / fn.__name__
        _check_saved(plots.save(fig, base), base)


def test_bars_fall_back_to_predictions_for_simulate_sweeps(sweeps):
    df = analysis.load(sweeps.leviathan.path)
    fig = plots.speedup_bars(df, x="tree.gamma", hue="method.draft_cost_ratio", col="method.acceptance.alpha")
    assert fig.axes[0].get_ylabel() == plots.LABELS["predicted_speedup"]
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["method.acceptance.alpha = 0.6", "method.acceptance.alpha = 0.8"]


def test_predicted_vs_measured_reports_mape(tmp_path, measured):
    fig = plots.predicted_vs_measured(measured, bands=(0.05, 0.1))
    err = prediction_error(measured[measured["status"] == "ok"])
    titles = [ax.get_title() for ax in fig.axes]
    n = int(err["tau_rel_error"].notna().sum())
    assert titles == [f"τ: MAPE {err['tau_abs_rel_error'].mean():.1%} (n={n})",
                      f"speedup: MAPE {err['speedup_abs_rel_error'].mean():.1%} (n={n})"]
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "±10%" in legend and "±5%" in legend and "y = x" in legend
    base = tmp_path / "pvm"
    _check_saved(plots.save(fig, str(base) + ".png"), base)  # a format suffix is stripped


def test_predicted_vs_measured_needs_measurements(sweeps):
    with pytest.raises(ValueError, match="tau"):
        plots.predicted_vs_measured(analysis.load(sweeps.leviathan.path))


def test_heatmap_annotates_every_cell(tmp_path, measured):
    fig = plots.heatmap(measured, x="workload", y="method", value="speedup")
    ax = fig.axes[0]
    assert len(ax.texts) == 2 * 2
    assert ax.get_xlabel() == "workload" and ax.get_ylabel() == "method"
    _check_saved(plots.save(fig, tmp_path / "heat"), tmp_path / "heat")


def test_lines_per_hardware(tmp_path, sweeps):
    df = analysis.load(sweeps.sequoia.path)
    fig = plots.lines(df, x="tree_size", y="predicted_tau", hue="hardware")
    ax = fig.axes[0]
    assert len(ax.lines) >= 2
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"cpu", "a100"}
    _check_saved(plots.save(fig, tmp_path / "scaling"), tmp_path / "scaling")


def test_no_pyplot_figures_are_left_open(measured):
    plots.speedup_bars(measured)
    plt = sys.modules.get("matplotlib.pyplot")
    assert plt is None or plt.get_fignums() == []
