"""analysis.validation_insample: a finished sweep's rows re-run on the calibration split with their own
profiles — the command line a row gets, the refusals to calibrate anew or to take another profile, and the
report's in-sample table (on copies of the committed small sweep of real runs)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import yaml

from analysis import validation_insample as vi
from analysis.sweep import FAILED, completed

REPO = Path(__file__).resolve().parents[2]
MICRO = REPO / "tests" / "data" / "validation_micro"
ROW = "vanilla__natural__code__T1"


def _sweep(tmp_path: Path, rows=(ROW,), name: str = "micro") -> Path:
    out = tmp_path / name
    for r in rows:
        shutil.copytree(MICRO / r, out / r)
    return out


def _edit_config(row_dir: Path, **calibration) -> None:
    path = row_dir / ".hydra" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    seed = calibration.pop("seed", None)
    cfg["calibration"].update(calibration)
    if seed is not None:
        cfg["seed"] = seed
    path.write_text(yaml.safe_dump(cfg))


def _edit_metrics(row_dir: Path, **changes) -> None:
    path = row_dir / "metrics.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _cache(tmp_path: Path, row_dir: Path, **profile) -> Path:
    """A cache root holding the row's profile file with ``profile``'s fields."""
    cache = tmp_path / "cache"
    (cache / "profiles").mkdir(parents=True, exist_ok=True)
    (cache / "profiles" / vi.profile_name(row_dir)).write_text(json.dumps(profile))
    return cache


def test_a_row_is_run_on_the_calibration_split_as_its_profile_was_calibrated(tmp_path):
    sweep = _sweep(tmp_path)
    row = sweep / ROW
    _edit_config(row, prompts=5, new_tokens=7, seed=3)  # read from the row's config, not assumed
    cache = _cache(tmp_path, row, t_ar_s=1.0)  # a profile without its loop's record: the config's tokens
    own = json.loads((row / "validation_row.json").read_text())["overrides"]
    got = vi.insample_overrides(row, cache)
    assert got[: len(own)] == own  # the row's method, workload, T, verifier, tree and sizes first
    assert got[len(own):] == ["workload.split=calibration", "workload.num_prompts=5",
                              "workload.max_new_tokens=7", "workload.tau_se_target=0", "seed=3",
                              "calibration.new_tokens=7", "calibration.cached_only=true"]
    # a loop drafter's acceptance was measured on every calibration prompt as long as the test generations;
    # the calibration's length stays the row's (it is in the profile key)
    cache = _cache(tmp_path, row, t_ar_s=1.0, extra={"loop_new_tokens": 9})
    loop = vi.insample_overrides(row, cache)
    assert "workload.max_new_tokens=9" in loop and "calibration.new_tokens=7" in loop
    (cache / "profiles" / "shapes.json").write_text(json.dumps({"new_tokens": 11}))
    _edit_metrics(row, dynamic_shapes_path="/elsewhere/profiles/shapes.json")  # a dynamic tree: its record's
    assert "workload.max_new_tokens=11" in vi.insample_overrides(row, cache)
    r = vi.insample_row(row, cache)
    assert r.row_id == ROW and r.overrides[-1] == "calibration.cached_only=true"
    assert vi.default_out(sweep) == tmp_path / "micro_insample"


def test_a_row_whose_profile_is_not_cached_is_refused_before_anything_runs(tmp_path):
    sweep = _sweep(tmp_path)
    out = tmp_path / "out"
    [o] = vi.run_insample([sweep / ROW], out, cache=tmp_path / "cache", python="/nonexistent/python")
    assert o.status == "refused" and "would calibrate anew" in o.error and o.row.row_id == ROW
    assert not out.exists()


def test_a_dry_run_lists_a_row_whose_profile_is_not_cached_as_refused(tmp_path):
    """A profile whose timings scattered is used by its row but never cached: the dry run says so instead of
    failing on the missing file."""
    sweep = _sweep(tmp_path)
    [line] = vi.dry_run_lines([sweep / ROW], tmp_path / "cache")
    assert line.startswith(f"{ROW} refused:") and "would calibrate anew" in line
    _edit_metrics(sweep / ROW, profile_t1_s=1.0)
    [line] = vi.dry_run_lines([sweep / ROW], _cache(tmp_path, sweep / ROW, t_ar_s=1.0))
    assert line.startswith(ROW) and "workload.split=calibration" in line


def _fake_python(tmp_path: Path, profile: str) -> str:
    """A stand-in for ``python run.py ...``: writes the sweep row's metrics.json into hydra.run.dir with
    ``profile`` as the profile it used, and records its command line."""
    script = tmp_path / "fake_python"
    src = json.loads((MICRO / ROW / "metrics.json").read_text())
    script.write_text(f"#!{sys.executable}\n" + f"""
import json, sys
from pathlib import Path
run_dir = Path(next(a for a in sys.argv if a.startswith("hydra.run.dir=")).split("=", 1)[1])
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / "metrics.json").write_text(json.dumps({{**{src!r}, "profile_path": {profile!r}}}))
(run_dir / "argv.json").write_text(json.dumps(sys.argv[1:]))
""")
    script.chmod(0o755)
    return str(script)


def test_a_profile_measured_again_and_a_run_that_took_another_profile_are_refused(tmp_path):
    sweep = _sweep(tmp_path)
    name = vi.profile_name(sweep / ROW)
    cache = tmp_path / "cache"
    (cache / "profiles").mkdir(parents=True)
    t1 = json.loads((sweep / ROW / "metrics.json").read_text())["profile_t1_s"]
    (cache / "profiles" / name).write_text(json.dumps({"t_ar_s": t1 * 1.01}))  # re-measured after the row
    out = tmp_path / "out"
    [o] = vi.run_insample([sweep / ROW], out, cache=cache, python="/nonexistent/python")
    assert o.status == "refused" and "another calibration than the row's" in o.error
    assert not out.exists()
    (cache / "profiles" / name).write_text(json.dumps({"t_ar_s": t1}))  # the row's own calibration
    other = _fake_python(tmp_path, f"/somewhere/profiles/another-{name}")
    [o] = vi.run_insample([sweep / ROW], out, cache=cache, python=other)
    assert o.status == "failed" and "another-" in o.error
    assert not completed(out / ROW) and (out / ROW / FAILED).is_file()
    assert (out / ROW / vi.REJECTED).is_file() and not (out / ROW / "metrics.json").exists()
    same = _fake_python(tmp_path, f"/another/cache/profiles/{name}")  # another root, the same file
    [o] = vi.run_insample([sweep / ROW], out, cache=cache, python=same)
    assert o.status == "done" and completed(out / ROW)
    argv = json.loads((out / ROW / "argv.json").read_text())
    assert argv[1] == "experiment=validation" and "calibration.cached_only=true" in argv
    [o] = vi.run_insample([sweep / ROW], out, cache=cache, python=other)  # resumable: done is done
    assert o.status == "skipped"
    _edit_metrics(out / ROW, profile_t1_s=t1 * 1.01)  # the same file, another calibration: refused
    assert "t(1)" in vi.check_same_profile(sweep / ROW, out / ROW) and not completed(out / ROW)
    [o] = vi.run_insample([sweep / ROW], out, cache=cache, python=same)  # a refused row runs again
    assert o.status == "done"
    [o] = vi.run_insample([sweep / ROW], out, cache=cache, python=other)
    assert o.status == "skipped"


def test_a_refused_row_does_not_stop_the_others(tmp_path):
    other = "vanilla__natural__code__T0"
    sweep = _sweep(tmp_path, rows=(other, ROW))
    name = vi.profile_name(sweep / ROW)
    assert vi.profile_name(sweep / other) != name  # its profile is not cached: refused
    t1 = json.loads((sweep / ROW / "metrics.json").read_text())["profile_t1_s"]
    cache = _cache(tmp_path, sweep / ROW, t_ar_s=t1)
    same = _fake_python(tmp_path, f"/another/cache/profiles/{name}")
    out = tmp_path / "out"
    got = {o.row.row_id: o for o in vi.run_insample([sweep / other, sweep / ROW], out, cache=cache,
                                                     python=same)}
    assert got[other].status == "refused" and "would calibrate anew" in got[other].error
    assert got[ROW].status == "done" and completed(out / ROW) and not (out / other).exists()


def test_the_report_sets_each_rows_in_sample_error_beside_the_test_splits(tmp_path):
    from analysis.validation_report import report

    rows = ("vanilla__natural__code__T0", ROW, "sequoia__sequoia8__code__T1")
    sweep = _sweep(tmp_path, rows)
    assert "## In-sample" not in report(sweep)  # no in-sample dir: no section
    inside = _sweep(tmp_path, rows[:2], "micro_insample")  # copies: in-sample τ = the test τ ...
    test_tau = {r: json.loads((sweep / r / "metrics.json").read_text())["predicted_tau"] for r in rows}
    _edit_metrics(inside / ROW, predicted_tau=test_tau[ROW] * 1.1)  # ... but one prediction 10% higher
    text = report(sweep)
    section = text.split("## In-sample")[1].split("## ")[0]
    assert "- rows: 2 (same profile and same predicted τ as the sweep's row: 1)" in section
    table = [ln for ln in section.splitlines() if ln.startswith("| vanilla")]
    assert len(table) == 2 and "sequoia8" not in section
    from analysis.validation_report import load_validation
    from analysis.validation_terms import errors

    test = errors(load_validation(sweep)).set_index("row_id")
    t0, t1 = sorted(table)  # T = 0 first
    err0 = test.loc["vanilla__natural__code__T0", "tau_err"]
    assert f"| {err0:+.1%} | – |" in t0 and t0.endswith(f"| {err0:+.1%} |")  # no s.e. at T = 0
    meas1, err1 = test.loc[ROW, "tau_meas"], test.loc[ROW, "tau_err"]
    assert f"| {test_tau[ROW] * 1.1 / meas1 - 1:+.1%} |" in t1 and t1.endswith(f"| {err1:+.1%} |")
    se1 = test.loc[ROW, "tau_combined_se_rel"]
    assert f"| {se1:.1%} |" in t1
    assert text.index("## In-sample") < text.index("## Terms")  # right after the summary
    assert "## In-sample" in report(sweep, insample=inside)
