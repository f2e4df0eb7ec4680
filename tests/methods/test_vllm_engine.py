"""engine=vllm's pieces that need no vLLM: which methods it runs and how they map to vLLM's speculative
methods, its counters (tau from drafts and accepted tokens), the profile priced with vLLM's own steps, and
the peer benchmark's clean exit where vLLM is not installed. vLLM itself is exercised by
benchmarks/vs_vllm.py and run.py engine=vllm in .venv-vllm, never in the test suite's required path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from methods.measurement.profiles import Profile, to_measured_cost
from methods.measurement.vllm_engine import (
    INSTALL_HINT,
    VLLM_METHODS,
    Counters,
    Generation,
    available,
    intel_openmp,
    plan_for,
    preload_intel_openmp,
)
from methods.measurement.vllm_measure import draft_cost_inside, engine_profile, spec_step_s

REPO = Path(__file__).resolve().parents[2]


def test_plans_map_specsim_methods_to_vllm_ones():
    assert plan_for("autoregressive", 4, None).config() is None
    draft = plan_for("draft_model", 4, "/ckpt/draft").config()
    assert draft == {"method": "draft_model", "num_speculative_tokens": 4, "model": "/ckpt/draft"}
    ngram = plan_for("prompt_lookup", 3, None, {"min_ngram": 2, "max_ngram": 5}).config()
    assert ngram == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                     "prompt_lookup_max": 5}


def test_unsupported_methods_and_missing_drafts_are_clear_errors():
    runs = "engine=vllm runs autoregressive, draft_model, eagle, eagle3, prompt_lookup"
    with pytest.raises(ValueError, match=runs):
        plan_for("medusa", 4, None)
    with pytest.raises(ValueError, match="draft checkpoint"):
        plan_for("draft_model", 4, None)
    assert set(VLLM_METHODS) >= {"autoregressive", "draft_model", "prompt_lookup"}


def test_counters_give_tau_and_acceptance_by_position():
    before = Counters(10, 40, 20, [8, 6, 4, 2])
    after = Counters(30, 120, 80, [24, 22, 20, 14])
    step = after.minus(before)
    assert (step.drafts, step.draft_tokens, step.accepted) == (20, 80, 60)
    assert step.accepted_per_pos == [16, 16, 16, 12]
    assert step.tau == pytest.approx(1 + 60 / 20)
    assert step.by_position == [0.8, 0.8, 0.8, 0.6]
    assert Counters().tau == 1.0 and Counters().by_position == []
    assert Counters().plus(step).accepted_per_pos == step.accepted_per_pos  # ragged lengths pad with zeros


def _profile() -> Profile:
    return Profile((0.0, 0.6, 0.2, 0.2), (0.6, 0.5), t_ar_s=2e-3, t_n_ratios={1: 1.0, 4: 1.2, 8: 1.5},
                   draft_ratio=0.25, model="zoo", drafter="draft_model", workload="code", device="cpu",
                   dtype="bfloat16", width=2, n_positions=100, created="now", verify_overhead_ratio=0.05)


def test_eagle_plans_name_the_exported_head():
    eagle3 = plan_for("eagle3", 3, "/cache/eagle/k/vllm").config()
    assert eagle3 == {"method": "eagle3", "num_speculative_tokens": 3, "model": "/cache/eagle/k/vllm"}
    with pytest.raises(ValueError, match="eagle needs the draft checkpoint"):
        plan_for("eagle", 3, None)


def test_draft_cost_inside_speculation_is_the_spec_step_beyond_the_verify():
    """T_spec = t(1)·r(γ+1) + γ·c: the solve returns c, and the profile built on it prices the step back to
    T_spec (specsim's own loop overhead left out: vLLM's is in c)."""
    prof = _profile()
    t1, gamma = 10e-3, 3  # r(4) = 1.2 in the profile
    t_spec = t1 * 1.2 + gamma * 2e-3
    assert draft_cost_inside(prof, t1, t_spec, gamma, per_token=True) == pytest.approx(2e-3)
    assert draft_cost_inside(prof, t1, t_spec, gamma, per_token=False) == pytest.approx(6e-3)
    assert draft_cost_inside(prof, t1, t1, gamma, per_token=True) == 0.0  # never negative
    mine = engine_profile(prof, {"t1_s": t1, "spec_step_s": t_spec}, gamma, per_token=True)
    assert mine.t_ar_s == t1 and mine.verify_overhead_ratio == 0.0 and mine.extra["engine"] == "vllm"
    assert mine.draft_time_s == pytest.approx(2e-3)
    again = mine.with_t1(2 * t1)  # re-anchored on a run's own t(1): every cost scales with it
    step = to_measured_cost(again).time(gamma + 1) + gamma * again.draft_time_s
    assert step == pytest.approx(2 * t_spec)


def test_spec_step_counts_one_draft_per_sequence_per_step_plus_the_prefill():
    gen = Generation([[1] * 10, [2] * 10], seconds=1.1, counters=Counters(drafts=20))
    assert spec_step_s(gen, 2) == pytest.approx(1.1 / 11)


def test_intel_openmp_preload_keeps_other_libraries(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/x/libtcmalloc.so:/y/libgomp.so.1")
    lib = preload_intel_openmp()
    got = __import__("os").environ["LD_PRELOAD"].split(":")
    if lib is None:  # no libiomp5 in this environment: nothing changes
        assert intel_openmp() is None and got == ["/x/libtcmalloc.so", "/y/libgomp.so.1"]
    else:
        assert got == [lib, "/x/libtcmalloc.so"]


@pytest.mark.skipif(available(), reason="checks the message shown where vLLM is absent")
def test_benchmark_without_vllm_says_how_to_install_and_exits_cleanly():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "vs_vllm.py")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert INSTALL_HINT in proc.stdout and '"vllm": "not installed"' in proc.stdout
