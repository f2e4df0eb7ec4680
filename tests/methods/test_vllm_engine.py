"""engine=vllm's pieces that need no vLLM: which methods it runs and how they map to vLLM's speculative
methods, its counters (tau from drafts and accepted tokens), the profile priced with vLLM's own steps, and
the peer benchmark's clean exit where vLLM is not installed. vLLM itself is exercised by
benchmarks/vs_vllm.py and run.py engine=vllm in .venv-vllm, never in the test suite's required path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from methods.measurement.profiles import Profile, to_measured_cost
from methods.measurement.vllm_engine import (
    INSTALL_HINT,
    VLLM_METHODS,
    Counters,
    Generation,
    VllmEngine,
    available,
    intel_openmp,
    plan_for,
    preload_intel_openmp,
    step_counters,
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


def _stats(drafts: int, accepted: int, decoded: int, prefilled: int = 0):
    """vLLM's per-step stats: a speculative record only where some sequence drafted."""
    spec = SimpleNamespace(num_drafts=drafts, num_draft_tokens=4 * drafts, num_accepted_tokens=accepted,
                           num_accepted_tokens_per_pos=[accepted, 0, 0, 0]) if drafts else None
    it = SimpleNamespace(num_generation_tokens=decoded + accepted + prefilled,
                         inter_token_latencies_iter=[0.01] * decoded)
    return SimpleNamespace(spec_decoding_stats=spec), it


def test_steps_without_an_ngram_match_count_in_tau_and_the_step_time():
    # one sequence: the prefill, 2 steps that drafted (1 accepted each) and 2 whose lookup found nothing
    steps = [_stats(0, 0, 0, prefilled=1), _stats(1, 1, 1), _stats(0, 0, 1), _stats(1, 1, 1), _stats(0, 0, 1)]
    total = Counters()
    for scheduler, iteration in steps:
        total = total.plus(step_counters(scheduler, iteration))
    assert (total.drafts, total.accepted, total.seq_steps, total.engine_steps) == (2, 2, 4, 5)
    assert total.tau == pytest.approx(1 + 2 / 4)  # 6 tokens after the prefill's in 4 target forwards
    assert total.by_position == [1.0, 0.0, 0.0, 0.0]  # per step that drafted, as vLLM reports it
    gen = Generation([[7] * 7], seconds=1.0, counters=total)
    assert spec_step_s(gen, 1) == pytest.approx(1.0 / 5)  # 5 engine steps; drafts + prefill said 3
    assert Counters(drafts=5, accepted=5).tau == 2.0  # no steps counted (a fake): every step drafted


def test_engine_counts_each_steps_stats_through_its_stat_recorder():
    engine = VllmEngine.__new__(VllmEngine)
    engine._seen = Counters()
    seen = []
    manager = SimpleNamespace(record=lambda **kw: seen.append(kw))
    engine.llm = SimpleNamespace(llm_engine=SimpleNamespace(logger_manager=manager))
    engine._watch_spec_stats()
    scheduler, iteration = _stats(1, 3, 2)
    manager.record(scheduler_stats=scheduler, iteration_stats=iteration, engine_idx=0)
    got = engine.counters()
    assert (got.drafts, got.accepted, got.seq_steps, got.engine_steps) == (1, 3, 2, 1)
    assert seen[0]["iteration_stats"] is iteration  # vLLM's own loggers still get the step


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


@pytest.mark.skipif(available(), reason="checks the config-time error where vLLM is absent")
def test_engine_vllm_without_vllm_fails_at_config_time_with_the_install_hint(run_module, run_config):
    """A sweep over engine=specsim,vllm in a venv without vLLM: the vllm job stops before any work, saying
    which Python lacks it and how to get one that has it."""
    cfg = run_config("task=measure", "engine=vllm", "method=vanilla", "model=micro")
    with pytest.raises(run_module.ConfigError, match=r"engine.name: engine=vllm needs vLLM .*\.venv-vllm"):
        run_module.check_runnable(cfg)
    run_module.check_runnable(run_config("task=measure", "engine=specsim", "method=vanilla", "model=micro"))


def test_benchmark_report_prints_the_table_and_one_json_line_with_ratios_at_batch_1_and_16(capsys):
    """vs_vllm's report on made-up paths: a row per path and batch, then one JSON object whose ratios
    compare the engines at both batch sizes (the goal at batch 1; at 16 vLLM's plain path may be its best)."""
    import json
    from types import SimpleNamespace

    from benchmarks.vs_vllm import Path_, report

    def path(name, engine, batch, tok_s, outputs, drafts=0, accepted=0, steps=0):
        n = sum(map(len, outputs))
        return Path_(name, engine, batch, [n / tok_s], n, outputs, drafts, accepted, steps)

    same, other = [[1, 2, 3]] * 2, [[1, 2, 3], [9, 9, 9]]
    results = [path("vllm plain", "vllm", 1, 200, same), path("vllm draft_model", "vllm", 1, 400, same, 2, 4),
               path("specsim autoregressive", "specsim", 1, 220, other, steps=6),
               path("specsim best: staged", "specsim", 1, 560, other, steps=2),
               path("vllm plain", "vllm", 16, 2000, same),
               path("vllm draft_model", "vllm", 16, 1800, same, 2, 4),
               path("specsim batched autoregressive", "specsim", 16, 1000, same, steps=6),
               path("specsim batched vanilla", "specsim", 16, 1500, same, steps=4)]
    args = SimpleNamespace(workload="code", dtype="float32", gamma=4, max_new=3, num_prompts=2,
                           batch_sizes=[1, 16])
    report(results, [], args, None)
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert sum(line.startswith(("vllm ", "specsim ")) for line in lines) == len(results)
    assert out["best_specsim_vs_best_vllm_spec_b1"] == pytest.approx(560 / 400, abs=1e-3)
    assert out["goal_met"] is False
    assert out["engines_plain_equal_rate"] == 0.5  # one of the two prompts differs
    assert out["best_specsim_b16"] == "specsim batched vanilla"
    assert out["best_vllm_spec_b16"] == "vllm draft_model"
    assert out["best_specsim_vs_best_vllm_spec_b16"] == pytest.approx(1500 / 1800, abs=1e-3)
    assert out["best_specsim_vs_best_vllm_b16"] == pytest.approx(1500 / 2000, abs=1e-3)  # vLLM's best: plain
    assert out["specsim_plain_vs_vllm_plain_b16"] == pytest.approx(0.5)
    assert out["vllm draft_model b1"]["tau"] == 3.0 and out["specsim batched vanilla b16"]["tau"] == 1.5
    assert out["specsim best: staged b1"]["equal_to_plain"] == 1.0  # against specsim's own plain output


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not (available() and _cuda()), reason="needs vLLM (a CUDA build) and a CUDA device")
def test_engine_vllm_measures_on_the_gpu(cli, tmp_path):
    """The same command as on CPU, on a GPU machine with vLLM installed: vLLM decodes on CUDA and the run
    writes the measurement beside the prediction (specsim's profile calibrated on the same device)."""
    import json

    run_dir = tmp_path / "run"
    proc = cli(["engine=vllm", "method=prompt_lookup", "model=micro", "workload.num_prompts=4",
                "workload.max_new_tokens=32", "workload.batch_size=2", f"hydra.run.dir={run_dir}"],
               cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((run_dir / "metrics.json").read_text())
    assert m["engine"] == "vllm" and m["vllm_device"] == "cuda"
    assert m["tau"] >= 1.0 and m["n_drafts"] > 0 and m["tokens_per_s"] > 0
    assert m["predicted_tau"] >= 1.0 and m["predicted_speedup"] > 0
    assert m["greedy_equal_rate"] >= 0.5  # bf16 near-ties may flip a few prompts; most decode identically


def test_benchmark_goes_on_when_one_vllm_path_fails_to_start(monkeypatch, capsys):
    """An engine vLLM cannot start (its EAGLE-3 warm-up overflowed the stack on the zoo) leaves the other
    paths running, and the table and the JSON line name it with the reason."""
    import json
    from types import SimpleNamespace

    from benchmarks import vs_vllm
    from methods.measurement import vllm_engine

    started = []

    class Fake:  # the second engine (vLLM's n-gram path, after plain) fails to start
        def __init__(self, target_dir, plan, settings):
            started.append(plan)
            if len(started) == 2:
                raise RuntimeError("Engine core initialization failed. See root cause above.\nmore")

    monkeypatch.setattr(vllm_engine, "VllmEngine", Fake)
    args = SimpleNamespace(dtype="float32", enforce_eager=True, gamma=4, ngram=3, eagle="off")
    engines, failed = vs_vllm.vllm_engines(args, SimpleNamespace(target_dir="t", draft_dir="d"))
    assert sorted(engines) == ["vllm draft_model", "vllm plain"]
    reason = "RuntimeError: Engine core initialization failed. See root cause above."
    assert failed == {"vllm ngram": reason} and len(started) == 3
    run_args = SimpleNamespace(workload="code", dtype="float32", gamma=4, max_new=3, num_prompts=2,
                               batch_sizes=[1])
    vs_vllm.report([], [], run_args, None, failed)
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("vllm ngram") and "FAILED to start" in line for line in lines)
    assert json.loads(lines[-1])["vllm_failed"] == failed
