"""task=measure on model=random_tiny: DESIGN.md's metrics contract, the baseline in the same run, samples."""

from __future__ import annotations

import json

import pytest

from methods.measurement.measure import measure

SMALL = ("task=measure", "model=random_tiny", "workload.num_prompts=2", "workload.prompt_tokens=24",
         "workload.max_new_tokens=10", "warmup=1", "calibration.prompts=2", "calibration.new_tokens=8",
         "calibration.depth_prompts=1", "calibration.reps=2", "calibration.warmup=1", "calibration.width=4",
         "tree.budgets=[1,2,4,8]")
CONTRACT = ("tau", "tokens_per_s", "baseline_tokens_per_s", "speedup", "accept_hist", "acceptance_by_depth",
            "acceptance_by_rank", "n_target_forwards", "time_draft_s", "time_verify_s", "predicted_tau",
            "predicted_speedup", "greedy_equal_rate", "lossless", "dtype", "device")


@pytest.mark.parametrize("method", ["autoregressive", "vanilla", "prompt_lookup"])
def test_measure_greedy_contract(run_config, method):
    cfg = run_config(*SMALL, f"method={method}")
    result = measure(cfg, show_progress=False)
    m = result.metrics
    assert set(CONTRACT) <= set(m)
    assert m["greedy_equal_rate"] == 1.0  # fp32, temperature 0: every lossless method reproduces greedy
    assert m["dtype"] == "float32" and m["device"] == "cpu" and m["lossless"] is True
    assert sum(m["accept_hist"]) == m["n_target_forwards"] <= m["n_tokens"] == m["baseline_n_tokens"]
    tokens_per_forward = sum((k + 1) * c for k, c in enumerate(m["accept_hist"])) / m["n_target_forwards"]
    assert m["tau"] == pytest.approx(tokens_per_forward)
    assert m["speedup"] == pytest.approx(m["tokens_per_s"] / m["baseline_tokens_per_s"])
    assert 0 < m["time_prefill_s"] < m["time_total_s"]
    assert 0 < m["baseline_time_prefill_s"] < m["baseline_time_s"]
    decode_rate = lambda n, total, pre: n / (total - pre)  # noqa: E731
    assert m["decode_speedup"] == pytest.approx(
        decode_rate(m["n_tokens"], m["time_total_s"], m["time_prefill_s"])
        / decode_rate(m["baseline_n_tokens"], m["baseline_time_s"], m["baseline_time_prefill_s"]))
    assert m["time_draft_s"] >= 0 and m["time_verify_s"] > 0
    if method == "autoregressive":
        assert m["tau"] == 1.0 and m["accept_hist"] == [m["n_target_forwards"]] and m["predicted_tau"] == 1.0
    else:  # predicted from the drafter's measured profile (calibrated once, cached): this CPU and the preset
        assert m["tau"] >= 1.0 and m["predicted_tau"] >= 1.0
        assert m["predicted_tau"] == m["predicted_tau_this_device"]  # hardware=cpu: the measured profile
        assert m["predicted_speedup_this_device"] > 0 and m["predicted_speedup_hardware"] > 0
        assert len(m["profile_acceptance_vector"]) == 4 + 2 and m["profile_path"].endswith(".json")
    assert len(result.samples) == 2
    for s in result.samples:
        assert {"prompt_id", "token_ids", "text", "accepted_lengths"} <= set(s)
        assert len(s["token_ids"]) <= 10 and isinstance(s["text"], str)
    json.dumps(m)  # metrics.json must be plain JSON


def test_measure_sampling_run(run_config):
    """Temperature 1 with chain rejection sampling: the run completes and reports its acceptance."""
    cfg = run_config(*SMALL, "method=vanilla", "method.verifier=chain", "workload.temperature=1.0", "seed=3")
    m = measure(cfg, show_progress=False).metrics
    assert m["n_tokens"] > 0 and m["tau"] >= 1.0
    assert len(m["acceptance_by_depth"]) >= 1 and 0.0 <= m["acceptance_by_depth"][0] <= 1.0


@pytest.mark.slow
def test_run_py_writes_metrics_and_samples(cli, tmp_path):
    proc = cli([*SMALL, "method=prompt_lookup", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["task"] == "measure" and metrics["method"] == "prompt_lookup" and "tau" in metrics
    lines = (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 2 and "accepted_lengths" in json.loads(lines[0])


def test_typical_acceptance_reads_its_thresholds_from_the_method(run_config):
    """posterior_threshold 1 and a huge posterior_alpha make the typical threshold min(ε, δ·e^{-H}) = 1: no
    draft token passes, in measure's decode and in calibration's depth run and star trees. With the
    defaults (ε 0.09, δ 0.3) the near-uniform random target (threshold ≈ 0.3/V < p ≈ 1/V) accepts nearly
    everything."""
    cfg = run_config(*SMALL, "method=medusa_typical", "tree=chain", "tree.gamma=2",
                     "+method.params.heads=init", "method.params.num_heads=2",
                     "method.params.posterior_threshold=1.0", "method.params.posterior_alpha=1e9",
                     "workload.temperature=1.0", "workload.max_new_tokens=9")
    m = measure(cfg, show_progress=False).metrics
    assert m["accept_hist"][0] == m["n_target_forwards"] == m["n_tokens"] and m["tau"] == 1.0
    # calibration's star trees: no child passes (p_none = 1), at every depth
    assert [v[-1] for v in m["profile_acceptance_vectors_by_depth"]] == [1.0, 1.0]
