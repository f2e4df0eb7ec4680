"""Smoke test of benchmarks/vs_transformers.py (specsim vs transformers' generate, assisted generation and
prompt lookup): one prompt, a few tokens, one repetition on the random tiny Llama pair in float32, where every
lossless path must reproduce HF greedy exactly. Timings are not asserted (a shared machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "vs_transformers.py"
RATIOS = ("ar_vs_hf_greedy", "vanilla_vs_hf_assisted", "pld_vs_hf_pld", "best_vs_hf_greedy")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, str]:
    args = ["--model", "random_tiny", "--workload", "code", "--num-prompts", "1", "--max-new-tokens", "12",
            "--reps", "1", "--dtype", "float32", "--chain-gammas", "2", "--pld-gammas", "4",
            "--sequoia-budgets", "6", "--calibration-prompts", "1", "--medusa", "off"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path_factory.mktemp("bench"),
                          env={**os.environ, "HYDRA_FULL_ERROR": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), proc.stdout


@pytest.mark.slow
def test_last_line_is_the_json_summary_with_the_ratios(result):
    summary, _ = result
    for key in (*RATIOS, "best_method", "all_outputs_equal", "dtype", "device", "tokens_per_s", "equal_rate"):
        assert key in summary, f"missing {key!r} in {sorted(summary)}"
    for key in RATIOS:
        assert summary[key] > 0, (key, summary[key])
    assert summary["dtype"] == "float32" and summary["num_prompts"] == 1
    assert set(summary["targets_met"]) == set(RATIOS)


@pytest.mark.slow
def test_every_path_reproduces_hf_greedy_in_float32(result):
    summary, _ = result
    assert summary["all_outputs_equal"] is True, summary["equal_rate"]
    assert set(summary["equal_rate"].values()) == {1.0}
    assert set(summary["equal_rate_vs_specsim_ar"].values()) == {1.0}


@pytest.mark.slow
def test_table_lists_every_path_and_the_best_is_a_timed_one(result):
    summary, stdout = result
    names = list(summary["tokens_per_s"])
    assert {"hf greedy", "specsim autoregressive"} <= set(names)
    assert any(n.startswith("hf assisted") for n in names)
    assert any(n.startswith("hf prompt_lookup") for n in names)
    table = stdout.strip().splitlines()[:-1]
    for name in names:
        assert any(line.startswith(name) for line in table), f"{name} not in the table"
    assert summary["best_method"] in {n.removeprefix("best? ") for n in names}
    # autoregressive decoding takes one target forward per token; HF greedy too (counted with a hook)
    assert summary["tau"]["specsim autoregressive"] == 1.0 and summary["tau"]["hf greedy"] == 1.0
