"""analysis.load on fabricated runs: a single run, a sweep, a parent of sweeps, lists, broken runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

import analysis
from analysis.load import BOOKKEEPING, IDENTITY, flatten, load_samples, read_config


def _by_job(df: pd.DataFrame) -> dict[str, pd.Series]:
    return {row["job"]: row for _, row in df.iterrows()}


def test_single_run_dir_gives_one_row_with_metrics_and_config(sweeps):
    job = sweeps.measure.ok_jobs()[0]
    expected = sweeps.measure.metrics[job]
    df = analysis.load(sweeps.measure.path / job)
    assert len(df) == 1
    row = df.iloc[0]
    for key in ("task", "method", "tree", "workload", "seed", "tau", "speedup", "predicted_tau",
                "method.draft_cost_ratio", "hardware.name"):
        assert row[key] == expected[key], key
    assert row["accept_hist"] == expected["accept_hist"]  # nested values stay Python objects
    assert row["acceptance_by_depth"] == expected["acceptance_by_depth"]
    assert row["status"] == "ok" and pd.isna(row["error"])
    assert Path(row["run_dir"]) == (sweeps.measure.path / job).resolve()
    assert Path(row["sweep_dir"]) == sweeps.measure.path.resolve()
    # a list-valued config input only .hydra/config.yaml has
    assert list(row["tree.budgets"]) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_sweep_dir_one_row_per_job_and_broken_runs_flagged(sweeps):
    df = analysis.load(sweeps.measure.path)
    assert len(df) == len(sweeps.measure.status)
    rows = _by_job(df)
    assert {j: r["status"] for j, r in rows.items()} == sweeps.measure.status
    for job in sweeps.measure.ok_jobs():
        assert rows[job]["tau"] == pytest.approx(sweeps.measure.metrics[job]["tau"])
    broken = df[df["status"] != "ok"]
    assert broken["tau"].isna().all() and broken["error"].notna().all()
    failed = df[df["status"] == "failed"].iloc[0]
    assert "no heads" in failed["error"]
    assert "JSONDecodeError" in df[df["status"] == "corrupt"].iloc[0]["error"]
    # identity of runs without metrics comes from Hydra's choices, inputs from config.yaml
    assert set(broken["method"]) == {"medusa"} and set(broken["task"]) == {"measure"}
    assert (broken["workload.max_new_tokens"] == 64).all()


def test_include_failed_false_keeps_only_ok(sweeps):
    df = analysis.load(sweeps.measure.path, include_failed=False)
    assert sorted(df["job"]) == sweeps.measure.ok_jobs()
    assert (df["status"] == "ok").all()


def test_parent_of_sweeps_and_lists(sweeps):
    all_sweeps = (sweeps.measure, sweeps.leviathan, sweeps.sequoia)
    df = analysis.load(sweeps.root)
    assert len(df) == sum(len(s.status) for s in all_sweeps)
    assert set(df["sweep_dir"]) == {str(s.path.resolve()) for s in all_sweeps}
    one = sweeps.leviathan.path / sweeps.leviathan.ok_jobs()[0]
    listed = analysis.load([sweeps.leviathan.path, sweeps.sequoia.path, one])
    assert len(listed) == len(sweeps.leviathan.status) + len(sweeps.sequoia.status)
    assert listed["run_dir"].is_unique


def test_column_order_identity_first_bookkeeping_last(sweeps):
    df = analysis.load(sweeps.leviathan.path)
    assert list(df.columns[: len(IDENTITY)]) == list(IDENTITY)
    assert list(df.columns[-len(BOOKKEEPING):]) == list(BOOKKEEPING)
    dotted = [c for c in df.columns if "." in c]
    assert dotted == sorted(dotted)


def test_config_false_skips_hydra_yaml(sweeps):
    df = analysis.load(sweeps.measure.path, config=False)
    assert "tree.budgets" not in df.columns  # only config.yaml has list inputs
    assert df.loc[df["status"] == "failed", "method"].isna().all()
    assert (df.loc[df["status"] == "ok", "method.draft_cost_ratio"].notna()).all()


def test_metrics_json_wins_over_config_yaml(measure_sweep):
    job = measure_sweep.ok_jobs()[0]
    run = measure_sweep.path / job
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["method.draft_cost_ratio"] = 0.123
    (run / "metrics.json").write_text(json.dumps(metrics))
    assert analysis.load(run).iloc[0]["method.draft_cost_ratio"] == 0.123
    assert read_config(run)["method.draft_cost_ratio"] != 0.123


@pytest.mark.parametrize("content", ["", "{", "null", '"text"', "\x00\xff"])
def test_corrupt_metrics_flagged_not_raised(measure_sweep, content):
    run = measure_sweep.path / measure_sweep.ok_jobs()[0]
    (run / "metrics.json").write_text(content, errors="surrogateescape")
    df = analysis.load(measure_sweep.path)
    row = df[df["run_dir"] == str(run.resolve())].iloc[0]
    assert row["status"] == "corrupt" and pd.isna(row["tau"])
    assert (df["status"] == "ok").sum() == len(measure_sweep.ok_jobs()) - 1


def test_unresolvable_interpolation_and_broken_yaml_do_not_crash(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    cfg = {"task": "simulate", "out": "${hydra:runtime.output_dir}",
           "tree": {"gamma": 4, "n": "${tree.gamma}"}}
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / ".hydra" / "hydra.yaml").write_text("hydra: [unclosed")
    row = analysis.load(run).iloc[0]
    assert row["out"] == "${hydra:runtime.output_dir}" and row["tree.gamma"] == 4
    assert row["status"] == "missing"


def test_empty_dir_and_missing_path(tmp_path):
    df = analysis.load(tmp_path)
    assert df.empty and "status" in df.columns and "run_dir" in df.columns
    with pytest.raises(FileNotFoundError):
        analysis.load(tmp_path / "absent")


def test_flatten_keeps_lists_and_empty_dicts():
    flat = flatten({"a": {"b": 1, "c": [1, 2], "d": {}}, "e": "x"})
    assert flat == {"a.b": 1, "a.c": [1, 2], "a.d": {}, "e": "x"}


def test_load_samples_skips_cut_off_lines(measure_sweep):
    df = load_samples(measure_sweep.path)
    assert len(df) == 2 * len(measure_sweep.ok_jobs())
    run = measure_sweep.path / measure_sweep.ok_jobs()[0]
    with (run / "samples.jsonl").open("a") as f:
        f.write('{"prompt_id": 9, "token_')
    again = load_samples(run)
    assert list(again["prompt_id"]) == [0, 1] and set(again["run_dir"]) == {str(run.resolve())}


def test_analysis_imports_neither_hydra_nor_torch():
    code = ("import sys, analysis, analysis.plots, analysis.tables, analysis.compare, analysis.sweep; "
            "bad = [m for m in ('hydra', 'torch', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_sweep_axes_are_the_varied_overrides(sweeps):
    assert analysis.sweep_axes(analysis.load(sweeps.measure.path)) == ["method", "tree", "workload", "seed"]
    levi = analysis.load(sweeps.leviathan.path)
    assert analysis.sweep_axes(levi) == ["method.acceptance.alpha", "tree.gamma", "method.draft_cost_ratio"]
    assert analysis.sweep_axes(analysis.load(sweeps.sequoia.path)) == ["hardware", "tree.budgets"]
    one = levi[levi["tree.gamma"] == 2]
    assert "tree.gamma" not in analysis.sweep_axes(one)
