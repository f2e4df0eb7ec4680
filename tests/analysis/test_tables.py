"""Pivots and Markdown/LaTeX rendering."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import analysis
from analysis import tables


@pytest.fixture(scope="module")
def measured(sweeps) -> pd.DataFrame:
    return analysis.load(sweeps.measure.path)


def _mean(sweep, method, tree, workload, key="speedup"):
    vals = [m[key] for m in sweep.metrics.values()
            if m is not None and (m["method"], m["tree"], m["workload"]) == (method, tree, workload)]
    return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else float("nan")


def test_pivot_averages_seeds_of_finished_runs(sweeps, measured):
    table = tables.pivot(measured, index=["method", "tree"], columns="workload", values="speedup")
    assert list(table.columns) == ["code", "grounded"]
    assert "medusa" not in table.index.get_level_values("method")  # failed/corrupt runs do not enter
    for (method, tree), row in table.iterrows():
        for workload in table.columns:
            assert row[workload] == pytest.approx(_mean(sweeps.measure, method, tree, workload)[0])


def test_pivot_several_values_and_groupby(measured):
    table = tables.pivot(measured, index="method", columns="workload", values=["tau", "speedup"])
    assert set(table.columns) == {(v, w) for v in ("tau", "speedup") for w in ("code", "grounded")}
    header = tables.to_markdown(table).splitlines()[0]
    assert header == "| method | tau / workload=code | tau / workload=grounded | speedup / workload=code " \
                     "| speedup / workload=grounded |"
    grouped = tables.pivot(measured, index="method", values="tau")
    ok = measured[measured["status"] == "ok"]
    assert grouped.loc["vanilla", "tau"] == pytest.approx(ok.loc[ok["method"] == "vanilla", "tau"].mean())


def test_to_markdown_pivots_and_renders(sweeps, measured):
    md = tables.to_markdown(measured, index=["method", "tree"], columns="workload", values="tau",
                            floatfmt=".2f")
    lines = md.strip().splitlines()
    assert lines[0] == "| method | tree | workload=code | workload=grounded |"  # named column level
    assert lines[1] == "| :--- | :--- | ---: | ---: |"
    assert len(lines) == 2 + 4  # 2 methods × 2 trees
    mean, _ = _mean(sweeps.measure, "prompt_lookup", "chain", "code", "tau")
    assert f"| prompt_lookup | chain | {mean:.2f} |" in md


def test_to_markdown_plain_frame_nan_and_pipes():
    df = pd.DataFrame({"name": ["a|b", "c"], "x": [1.23456, np.nan], "n": [3, 4]})
    md = tables.to_markdown(df, floatfmt=".1f")
    assert "| a\\|b | 1.2 | 3 |" in md and f"| c | {tables.DASH} | 4 |" in md


def test_to_latex_escapes_and_wraps(measured):
    tex = tables.to_latex(measured, index="method", columns="workload", values="speedup",
                          caption="Speedup (ρ_draft)", label="tab:speedup")
    assert tex.startswith("\\begin{table}") and "\\begin{tabular}{lrr}" in tex
    assert "prompt\\_lookup" in tex and "\\caption{Speedup (ρ\\_draft)}" in tex
    assert "\\label{tab:speedup}" in tex
    assert tex.count("\\\\") == 1 + 2  # header + 2 methods
    bare = tables.to_latex(pd.DataFrame({"a": [1.0]}))
    assert bare.startswith("\\begin{tabular}{r}") and "\\toprule" in bare and "\\bottomrule" in bare


def test_mean_std_cells(sweeps, measured):
    cells = tables.mean_std(measured, index="method", columns="workload", values="tau", floatfmt=".2f")
    ok = measured[measured["status"] == "ok"]
    sub = ok[(ok["method"] == "vanilla") & (ok["workload"] == "code")]["tau"]
    assert cells.loc["vanilla", "code"] == f"{sub.mean():.2f} ± {sub.std():.2f}"
    single = tables.mean_std(ok[ok["seed"] == 0], index=["method", "tree"], columns="workload", values="tau")
    seed0 = ok[ok["seed"] == 0]
    one = seed0[(seed0["method"] == "vanilla") & (seed0["tree"] == "chain") & (seed0["workload"] == "code")]
    assert single.loc[("vanilla", "chain"), "code"] == f"{one['tau'].iloc[0]:.2f}"


def test_save_table_writes_md_and_tex(tmp_path, measured):
    table = tables.pivot(measured, index="method", columns="tree", values="tau")
    md, tex = tables.save_table(table, tmp_path / "out" / "tau", caption="τ")
    assert md.read_text() == tables.to_markdown(table)
    assert "\\caption{τ}" in tex.read_text()
