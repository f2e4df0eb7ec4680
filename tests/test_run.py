"""`python run.py …` end to end (subprocesses, run dirs in tmp_path): outputs follow the run-output contract,
a failed run leaves nothing behind (every bad input: tests/test_bad_inputs.py), sweeps skip finished jobs
and record failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from specsim.io import read_json, read_jsonl

REPO = Path(__file__).resolve().parents[1]
IDENTITY = ("task", "method", "tree", "hardware", "workload", "model", "seed")
SIMULATE_KEYS = ("predicted_tau", "predicted_speedup", "tree_size", "tree_depth")


def _simulate(cli, tmp_path: Path, name: str, *overrides: str) -> tuple[dict, str]:
    run_dir = tmp_path / name
    proc = cli(["task=simulate", *overrides, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_json(run_dir / "metrics.json"), proc.stdout


def test_simulate_writes_the_contract(cli, tmp_path):
    metrics, stdout = _simulate(cli, tmp_path, "run", "method=medusa", "tree=sequoia", "hardware=a100")
    for key in IDENTITY + SIMULATE_KEYS:
        assert key in metrics, f"metrics.json lacks {key}"
    assert list(metrics)[: len(IDENTITY)] == list(IDENTITY)  # identity first: readable by eye
    assert (metrics["task"], metrics["method"], metrics["tree"], metrics["hardware"]) == (
        "simulate", "medusa", "sequoia", "a100")
    assert metrics["tree_size"] >= 2 and metrics["predicted_tau"] > 1 and metrics["predicted_speedup"] > 0
    # the inputs that produced the prediction, as flat dotted keys
    assert metrics["hardware.memory_bandwidth_gbs"] == 2039.0 and metrics["method.acceptance.kind"] == "power"
    assert all(not isinstance(v, (dict, list)) or k in ("tau_law", "acceptance_vector", "tree_parents",
               "tree_ranks") for k, v in metrics.items()), "metrics.json is one flat object"
    run_dir = tmp_path / "run"
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert not (run_dir / "samples.jsonl").exists()  # simulate has no samples
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]
    assert "predicted speedup" in stdout and str(run_dir / "metrics.json") in stdout


def test_offloading_picks_a_bigger_tree_and_a_higher_speedup(cli, tmp_path):
    """Sequoia's finding: with weights streamed over PCIe, t(n) is flat, so the optimal tree grows."""
    common = ("method=medusa", "tree=sequoia")
    a100, _ = _simulate(cli, tmp_path, "a100", *common, "hardware=a100")
    offload, _ = _simulate(cli, tmp_path, "offload", *common, "hardware=l40_offload")
    assert offload["tree_size"] > a100["tree_size"]
    assert offload["predicted_speedup"] > a100["predicted_speedup"]


def test_simulate_never_imports_torch(tmp_path):
    """task=simulate runs on a machine without torch: run.py must import it only for measure/calibrate."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['run.py', 'task=simulate', 'hydra.run.dir={tmp_path / 'run'}']\n"
        f"runpy.run_path({str(REPO / 'run.py')!r}, run_name='__main__')\n"
        "assert 'torch' not in sys.modules, 'task=simulate imported torch'\n"
        "print('TORCH-FREE')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and "TORCH-FREE" in proc.stdout, proc.stderr[-3000:]


# Bad configs (a clear message, no traceback, nothing written, before any work): tests/test_bad_inputs.py.


def test_default_run_dir_is_named_by_task_and_time(cli, tmp_path):
    proc = cli(["task=simulate"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [metrics] = list(tmp_path.glob("outputs/*/*/*/metrics.json"))
    assert metrics.relative_to(tmp_path).parts[:2] == ("outputs", "simulate")


def test_failed_run_in_default_location_leaves_no_dirs(cli, tmp_path):
    """Without hydra.run.dir the run dir is outputs/<task>/<date>/<time>: the parents go too."""
    proc = cli(["task=simulate", "method.acceptance.alpha=2"], cwd=tmp_path)
    assert proc.returncode == 2 and "method.acceptance.alpha" in proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_sweep_skips_finished_jobs_and_records_failures(cli, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "task=simulate", "method=vanilla,medusa", "method.acceptance.alpha=0.6,1.5",
            f"hydra.sweep.dir={sweep}"]
    first = cli(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]  # one bad job does not stop the sweep
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == [  # named by the overrides, sorted by key
        f"method.acceptance.alpha={a},method={m},task=simulate"
        for a in ("0.6", "1.5") for m in ("medusa", "vanilla")]
    done = [p for p in jobs if (p / "metrics.json").is_file()]
    failed = [p for p in jobs if (p / "failed.json").is_file()]
    assert [p.name for p in done] == [p.name for p in jobs[:2]] and failed == jobs[2:]
    assert "method.acceptance.alpha" in read_json(failed[0] / "failed.json")["error"]
    stamps = {p: (p / "metrics.json").stat().st_mtime_ns for p in done}

    second = cli(args, cwd=tmp_path)  # the re-run of an interrupted sweep
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count("[skip]") == 2
    assert {p: (p / "metrics.json").stat().st_mtime_ns for p in done} == stamps  # untouched, not redone
    assert sorted(p for p in sweep.iterdir() if p.is_dir()) == jobs  # nothing duplicated


@pytest.mark.slow
def test_parallel_launcher_runs_the_grid(cli, tmp_path):
    sweep = tmp_path / "sweep"
    proc = cli(["-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2", "task=simulate",
                "method=vanilla,prompt_lookup", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = sorted(read_json(p)["method"] for p in sweep.glob("*/metrics.json"))
    assert found == ["prompt_lookup", "vanilla"]


# ---- the measure seam, in process (the engine is another issue's) ---------------------------------------
def test_measure_writes_metrics_and_samples(run_module, run_config, tmp_path, monkeypatch):
    """run.py hands task=measure to methods.measurement.measure.measure(cfg) and writes both files from its
    result."""
    rows = [{"prompt_id": 0, "token_ids": [5, 6], "text": "ab", "accepted_lengths": [2]}]
    seen = []

    def fake_measure(cfg):
        seen.append(cfg)
        metrics = {"tau": 2.0, "speedup": 1.5, "accept_hist": [0, 1]}
        return types.SimpleNamespace(metrics=metrics, samples=rows)

    fake = types.SimpleNamespace(measure=fake_measure)
    monkeypatch.setitem(sys.modules, "methods.measurement.measure", fake)
    cfg = run_config("task=measure", "method=vanilla")
    result = run_module.execute(cfg, tmp_path)
    run_module.write_outputs(tmp_path, run_module.run_metrics(cfg, result.metrics), result.samples)
    assert seen == [cfg]
    metrics = read_json(tmp_path / "metrics.json")
    assert (metrics["task"], metrics["method"]) == ("measure", "vanilla")
    assert (metrics["tau"], metrics["accept_hist"]) == (2.0, [0, 1])
    assert read_jsonl(tmp_path / "samples.jsonl") == rows
    assert any("speedup 1.50x" in line for line in result.summary)


def test_the_summary_sets_each_speedup_beside_its_own_prediction(run_module):
    """The decode-only speedup (no prefill) is compared with the prediction of the decode alone, not with the
    steady-state one (the default run once printed 1.32x decode-only beside a steady 1.47x: 1.43x is its
    prediction)."""
    m = {"tau": 2.8, "predicted_tau": 2.9, "tokens_per_s": 900.0, "baseline_tokens_per_s": 700.0,
         "speedup": 1.26, "decode_speedup": 1.32, "predicted_speedup_this_device": 1.47,
         "predicted_decode_speedup_this_device": 1.43}
    line = run_module._measure_lines(m, "cpu")[1]
    assert "1.32x decode only (predicted 1.43x decode only on this device)" in line and "1.47" not in line
    no_decode = {k: v for k, v in m.items() if "decode" not in k}  # an engine run without the split
    assert "speedup 1.26x (predicted 1.47x on this device)" in run_module._measure_lines(no_decode, "cpu")[1]


def test_the_summary_sets_the_measured_tau_s_standard_error_beside_the_prediction(run_module):
    """The default's measured τ carries its prompts' sampling error (several percent at a few prompts): the
    summary gives it, the prediction's signed error, and that error in standard errors."""
    m = {"tau": 2.810, "predicted_tau": 3.083, "tau_se_rel": 0.052, "num_prompts": 8}
    line = run_module._measure_lines(m, "cpu")[0]
    assert line == "tau 2.810 ± 5.2% (s.e. over 8 prompts), predicted 3.083 (+9.7%, +1.9 s.e.)"
    no_se = run_module._measure_lines({**m, "tau_se_rel": None}, "cpu")[0]
    assert no_se == "tau 2.810, predicted 3.083 (+9.7%)"
    autoregressive = {"tau": 1.0, "predicted_tau": 1.0, "tau_se_rel": 0.0, "num_prompts": 8}
    assert run_module._measure_lines(autoregressive, "cpu")[0] == "tau 1.000, predicted 1.000 (+0.0%)"


def test_the_default_calibration_reads_as_many_tokens_as_the_workload_generates(run_config):
    """conf/config.yaml: calibration.new_tokens follows workload.max_new_tokens (the positions the run
    decodes); an explicit calibration.new_tokens still wins."""
    assert run_config().calibration.new_tokens == run_config().workload.max_new_tokens == 64
    assert run_config("workload.max_new_tokens=20").calibration.new_tokens == 20
    assert run_config("workload.max_new_tokens=20", "calibration.new_tokens=8").calibration.new_tokens == 8
    assert run_config("experiment=validation").calibration.new_tokens == 48


def test_results_never_overwrite_identity(run_module, run_config):
    cfg = run_config("task=simulate", "method=medusa")
    results = {"method": "something else", "predicted_tau": 2.0}
    metrics = run_module.run_metrics(cfg, results, "leviathan_table")
    assert metrics["method"] == "medusa" and metrics["experiment"] == "leviathan_table"
    assert json.loads(json.dumps(metrics)) == metrics


def test_remove_run_dir_prunes_only_empty_parents_inside_cwd(run_module, tmp_path):
    keep = tmp_path / "outputs" / "simulate" / "2024-01-01" / "10-00-00"
    keep.mkdir(parents=True)
    failed = tmp_path / "outputs" / "simulate" / "2024-01-02" / "11-00-00"
    (failed / ".hydra").mkdir(parents=True)
    run_module._remove_run_dir(failed, tmp_path)
    assert not (tmp_path / "outputs" / "simulate" / "2024-01-02").exists()
    assert keep.is_dir()
    outside = tmp_path / "elsewhere" / "run"
    outside.mkdir(parents=True)
    run_module._remove_run_dir(outside, tmp_path / "outputs")  # not below cwd: only the run dir goes
    assert not outside.exists() and (tmp_path / "elsewhere").is_dir()
