"""Sweep layout helpers: completion marker, failure records, job listing, newest sweep."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.sweep import (
    REQUIRED_KEYS,
    Status,
    completed,
    find_runs,
    job_status,
    latest_sweep,
    list_sweeps,
    read_status,
    record_failure,
    summary,
    write_json_atomic,
)


def test_completed_matches_fabricated_status(sweeps):
    for job, status in sweeps.measure.status.items():
        assert completed(sweeps.measure.path / job) == (status == "ok"), job


def test_read_status_classifies_each_kind(sweeps):
    for job, status in sweeps.measure.status.items():
        assert read_status(sweeps.measure.path / job).status == status, job


def test_metrics_without_contract_keys_or_not_an_object_is_corrupt(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"tau": 2.0}))
    st_ = read_status(run)
    assert st_.status == Status.corrupt and "task" in st_.error
    (run / "metrics.json").write_text("[1, 2]")
    assert read_status(run).status == Status.corrupt
    assert not completed(run)


def test_metrics_with_failed_status_field_is_failed(tmp_path):
    run = tmp_path / "run"
    write_json_atomic(run / "metrics.json", {**dict.fromkeys(REQUIRED_KEYS, "x"), "status": "failed",
                                             "error": "OOM"})
    assert read_status(run).status == Status.failed and read_status(run).error == "OOM"
    assert not completed(run)


def test_record_failure_then_retry_success(tmp_path):
    run = tmp_path / "job"
    try:
        raise RuntimeError("draft model missing")
    except RuntimeError as e:
        path = record_failure(run, e)
    data = json.loads(path.read_text())
    assert data["error_type"] == "RuntimeError" and "draft model missing" in data["traceback"]
    st_ = read_status(run)
    assert st_.status == Status.failed and "draft model missing" in st_.error
    assert not completed(run)
    # the retry of a failed job succeeds: metrics.json (written last) wins over the stale failure record
    write_json_atomic(run / "metrics.json", {k: 0 for k in REQUIRED_KEYS})
    assert completed(run)


def test_write_json_atomic_leaves_no_temp_files_and_converts_numpy(tmp_path):
    path = write_json_atomic(tmp_path / "a" / "metrics.json", {"x": np.float32(1.5), "h": np.arange(3)})
    assert json.loads(path.read_text()) == {"x": 1.5, "h": [0, 1, 2]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["metrics.json"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=200))
def test_any_metrics_bytes_are_classified_not_raised(tmp_path, content):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.json").write_bytes(content)
    st_ = read_status(run)
    assert st_.status in (Status.ok, Status.corrupt, Status.failed)
    assert completed(run) == (st_.status == Status.ok)


def test_job_status_lists_every_job_with_overrides(sweeps):
    records = job_status(sweeps.measure.path)
    assert {r["job"]: r["status"] for r in records} == sweeps.measure.status
    for r in records:
        assert sorted(r["overrides"].split(",")) == sorted(r["job"].split(","))
        assert (r["error"] is None) == (r["status"] == "ok")
    counts = summary(sweeps.measure.path)
    for status in (Status.ok, Status.failed, Status.corrupt, Status.missing):
        assert counts[status] == list(sweeps.measure.status.values()).count(status)


def test_find_runs_stops_at_run_dirs_and_dedupes(sweeps):
    all_runs = find_runs(sweeps.root)
    n_jobs = sum(len(s.status) for s in (sweeps.measure, sweeps.leviathan, sweeps.sequoia))
    assert len(all_runs) == n_jobs
    assert not any(".hydra" in r.parts for r in all_runs)
    one = sweeps.measure.path / sweeps.measure.ok_jobs()[0]
    assert find_runs([sweeps.measure.path, one]) == find_runs(sweeps.measure.path)
    assert find_runs(one) == [one.resolve()]
    with pytest.raises(FileNotFoundError):
        find_runs(sweeps.root / "nope")


def test_latest_and_list_sweeps_follow_marker_mtime(sweeps, tmp_path):
    paths = [s.path for s in (sweeps.measure, sweeps.leviathan, sweeps.sequoia)]
    assert set(list_sweeps(sweeps.root)) == {p.resolve() for p in paths}
    root = tmp_path / "multirun"
    for i, name in enumerate(["b", "a", "c"]):
        (root / name).mkdir(parents=True)
        marker = root / name / "multirun.yaml"
        marker.write_text("{}")
        os.utime(marker, (1000 + i, 1000 + i))
    assert latest_sweep(root) == (root / "c").resolve()
    assert [p.name for p in list_sweeps(root)] == ["c", "a", "b"]


def test_latest_sweep_without_markers_uses_newest_child(tmp_path):
    for i, name in enumerate(["x", "y"]):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (2000 - i, 2000 - i))
    assert latest_sweep(tmp_path) == (tmp_path / "x").resolve()
    with pytest.raises(FileNotFoundError):
        latest_sweep(tmp_path / "x")
    assert not list_sweeps(Path(tmp_path / "y"))
