"""task=measure on model=random_tiny: the metrics contract (docs/architecture.md), the baseline in the
same run, samples."""

from __future__ import annotations

import json

import pytest
import torch

from methods.data.workloads import load_prompts
from methods.measurement.measure import measure
from methods.models import load_models

SMALL = ("task=measure", "model=random_tiny", "workload.num_prompts=2", "workload.prompt_tokens=24",
         "workload.max_new_tokens=10", "warmup=1", "calibration.prompts=2", "calibration.new_tokens=8",
         "calibration.depth_prompts=1", "calibration.reps=2", "calibration.warmup=1",
         "calibration.max_reps=0", "calibration.width=4",
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
    assert m["backbone"] == "random_tiny target"  # no drafter of these changes the model
    assert sum(m["accept_hist"]) == m["n_target_forwards"] <= m["n_tokens"] == m["baseline_n_tokens"]
    tokens_per_forward = sum((k + 1) * c for k, c in enumerate(m["accept_hist"])) / m["n_target_forwards"]
    assert m["tau"] == pytest.approx(tokens_per_forward)
    # independent oracle of the tokens: the target's own greedy continuation by plain HF forwards
    models = load_models(cfg.model, cfg.device, cfg.model.dtype)
    prompts = load_prompts(cfg.workload, models.tokenizer, cfg.seed)
    for prompt, sample in zip(prompts, result.samples):
        assert sample["token_ids"] == _greedy(models.target, prompt.token_ids, len(sample["token_ids"]))
        assert len(sample["token_ids"]) == 10 or sample["stop"] == "eos"
    assert sum(sum(s["accepted_lengths"]) for s in result.samples) >= m["n_tokens"]
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
    _assert_tau_error_of_the_samples(m, result.samples, cfg.workload.max_new_tokens, method)
    json.dumps(m, allow_nan=False)  # metrics.json must be plain JSON


def _assert_tau_error_of_the_samples(m: dict, samples: list[dict], max_new: int, method: str) -> None:
    """tau_se_rel is τ's relative standard error over the samples' steady steps (each prompt's steps whose
    draft the generation's end did not cut): recomputed here by hand, the larger of the step-wise and the
    prompt-wise error."""
    depth = m["tree_depth"]
    steady = []
    for s in samples:
        kept, done = [], 0
        for a in s["accepted_lengths"]:
            if max_new - done >= depth:
                kept.append(a)
            done += min(a, max_new - done)
        steady.append(kept)
    flat = [a for p in steady for a in p]
    tau = sum(flat) / len(flat)
    steps = (sum((a - tau) ** 2 for a in flat) / (len(flat) - 1) / len(flat)) ** 0.5
    tokens, n_steps = [sum(p) for p in steady], [len(p) for p in steady]
    prompts = (sum((t - tau * k) ** 2 for t, k in zip(tokens, n_steps)) / (len(steady) * (len(steady) - 1))
               ) ** 0.5 / (sum(n_steps) / len(steady))
    expected = max(steps, prompts) / tau
    assert m["tau_se_rel"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    if method == "autoregressive":  # every step accepts the root alone: no spread at all
        assert m["tau_se_rel"] == 0.0


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


def _fake_medusa2(tmp_path, monkeypatch):
    """ensure_medusa stubbed: identity heads and a 'tuned' target = the run's target with noise added (what
    Medusa-2's joint training would leave), saved where a built entry keeps them. Returns the tuned model."""
    import copy

    import numpy as np

    from methods.heads.medusa import store
    from methods.heads.medusa.checkpoint import save_heads
    from methods.heads.medusa.heads import HeadsConfig, MedusaHeads

    tuned_models = []

    def ensure(target, tokenizer, cfg):
        entry = tmp_path / "medusa" / "fake-key"
        lm = target.get_output_embeddings().weight.detach()
        heads = MedusaHeads.from_lm_head(HeadsConfig(cfg.num_heads, 1, lm.shape[1], lm.shape[0]), lm)
        save_heads(heads, entry / "heads")
        tuned = copy.deepcopy(target)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in tuned.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp_min(1e-3))
        tuned.save_pretrained(entry / "target")
        tuned_models.append(tuned.eval())
        return store.BuiltMedusa(entry, entry / "heads", entry / "target", np.ones((cfg.num_heads, 2)), {})

    monkeypatch.setattr(store, "ensure_medusa", ensure)
    return tuned_models


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding by full recomputation with HF forwards: the independent reference."""
    ids = torch.tensor(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(input_ids=ids[None]).logits[0, -1].argmax().view(1)])
    return ids[len(prompt):].tolist()


def test_medusa2_both_sides_decode_its_tuned_backbone(run_config, tmp_path, monkeypatch):
    """Medusa-2 is lossless against its jointly tuned target, a different model: the method and the same-run
    baseline both decode that backbone (outputs = the tuned model's own greedy continuation, by HF forwards),
    metrics.json names it, and the run's target object is left untouched (it used to be overwritten in
    place, so whatever shared it decoded a modified model unannounced)."""
    from methods.drafters.registry import build_drafter
    from methods.measurement import measure as measure_module
    from methods.models import load_models

    monkeypatch.setenv("SPECSIM_CACHE", str(tmp_path / "cache"))
    tuned = _fake_medusa2(tmp_path, monkeypatch)
    loaded = []

    def load(*args, **kwargs):
        loaded.append(load_models(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(measure_module, "load_models", load)
    cfg = run_config(*SMALL, "method=medusa", "tree=chain", "tree.gamma=2", "method.params.num_heads=2",
                     "+method.params.heads=train", "+method.params.joint=true", "workload.max_new_tokens=8")
    result = measure(cfg, show_progress=False)
    m = result.metrics
    assert m["backbone"] == "medusa-2 tuned target fake-key" and m["greedy_equal_rate"] == 1.0
    original = load_models(cfg.model, cfg.device, cfg.model.dtype).target  # the same seeded random model
    for k, v in loaded[0].target.state_dict().items():
        assert torch.equal(v, original.state_dict()[k]), f"the run's target was modified: {k}"
    prompts = measure_module.load_prompts(cfg.workload, loaded[0].tokenizer, cfg.seed)
    for prompt, s in zip(prompts, result.samples):
        ref = _greedy(tuned[-1], prompt.token_ids, len(s["token_ids"]))
        assert s["token_ids"] == ref and ref != _greedy(original, prompt.token_ids, len(ref))
    drafter = build_drafter(cfg.method, None, loaded[0], measure_module.SamplingParams(0))
    assert drafter.backbone is not None and drafter.backbone.model is not loaded[0].target


class _Clock:
    """A fake perf_counter for the decode loop: only the target's forwards take time (1 s each, prefill
    included); drafting, verification and bookkeeping are free. The timers then have exact values."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_timers_and_speedups_on_a_fake_clock(run_config, tmp_path, monkeypatch):
    """Hand-computed figures: with 1 s per target forward and nothing else costing time, the baseline pays
    one prefill per prompt plus one forward per token, the method one prefill plus one forward per step; so
    decode_speedup = tokens / method forwards, speedup = (prompts + baseline forwards) / (prompts + method
    forwards), and the draft time is 0 (the draft model's forwards are free here)."""
    from methods.core import engine as engine_module
    from methods.core import loop as loop_module
    from methods.measurement import cost_table, staleness
    from methods.measurement import measure as measure_module

    monkeypatch.setenv("SPECSIM_CACHE", str(tmp_path))
    # the profile must stay cached from the real-clock run: on a busy machine scattered timings are not cached
    # and a t(1) off the run's marks the profile stale, and the second run would then calibrate on the fake
    # clock, where every timed interval is 0
    monkeypatch.setattr(cost_table, "MAX_TIMING_DISPERSION", float("inf"))
    monkeypatch.setattr(staleness, "mark_stale", lambda *args: False)
    cfg = run_config(*SMALL, "method=vanilla", "warmup=0")
    measure(cfg, show_progress=False)  # calibrate the profile on the real clock first (cached in tmp_path)
    assert any((tmp_path / "profiles").glob("*.json")), "the real-clock run cached no profile"
    clock, target_model = _Clock(), [None]  # the model of the loop's target engine (not the draft's)
    for name in ("forward_tree", "prefill"):
        real = getattr(engine_module.ModelEngine, name)

        def timed(self, *args, _real=real, **kwargs):
            if self.model is target_model[0]:
                clock.now += 1.0
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(engine_module.ModelEngine, name, timed)
    monkeypatch.setattr(loop_module, "time", clock)
    real_decode = loop_module.decode

    def decode(target, *args, **kwargs):
        target_model[0] = target.model
        return real_decode(target, *args, **kwargs)

    monkeypatch.setattr(measure_module, "decode", decode)
    m = measure(cfg, show_progress=False).metrics
    prompts, fw, base_fw = m["num_prompts"], m["n_target_forwards"], m["baseline_n_target_forwards"]
    assert base_fw == m["baseline_n_tokens"] == m["n_tokens"] >= fw  # greedy: the same tokens
    assert (m["time_prefill_s"], m["baseline_time_prefill_s"]) == (prompts, prompts)
    assert (m["time_verify_s"], m["time_draft_s"]) == (fw, 0.0)
    assert (m["time_total_s"], m["baseline_time_s"]) == (prompts + fw, prompts + base_fw)
    assert m["decode_speedup"] == pytest.approx(m["n_tokens"] / fw)
    assert m["speedup"] == pytest.approx((prompts + base_fw) / (prompts + fw))


@pytest.mark.parametrize("continuous", [False, True], ids=["static", "continuous"])
def test_measure_batched(run_config, continuous):
    """workload.batch_size > 1: batched speculative vs batched autoregressive in one run, every row equal to
    the target's greedy continuation alone."""
    cfg = run_config(*SMALL, "method=vanilla", "workload.num_prompts=3", "workload.batch_size=2",
                     f"workload.continuous={continuous}")
    result = measure(cfg, show_progress=False)
    m = result.metrics
    assert set(CONTRACT) <= set(m)
    assert m["batch_size"] == 2 and m["continuous"] is continuous
    # the simulator at B = 2 (specsim.batch), the one-sequence prediction kept beside it
    assert m["prediction_batch_size"] == 2 and m["batch_cost_source"] in ("fit", "roofline growth")
    assert m["predicted_speedup"] > 0 and m["predicted_speedup_batch1"] > 0 and m["predicted_tau"] >= 1
    assert m["predicted_t_step_s"] > 0 and m["ar_tokens_per_s"] == pytest.approx(2 / m["predicted_t_ar_s"])
    # the run's mean step: its rows leave a static batch as they finish (continuous batching refills them)
    # (equal where every step runs B rows, up to rounding: 1e-9)
    assert 1 <= m["predicted_mean_rows"] <= 2
    assert m["predicted_t_step_s"] <= m["predicted_t_step_full_s"] * (1 + 1e-9)
    assert m["predicted_decode_speedup_b_rows"] <= m["predicted_decode_speedup"] * (1 + 1e-9)
    assert m["greedy_equal_rate"] == 1.0 and m["n_tokens"] == m["baseline_n_tokens"]
    assert 0 < m["time_forward_s"] < m["time_total_s"] and 0 < m["outside_forward_fraction"] < 1
    models = load_models(cfg.model, cfg.device, cfg.model.dtype)
    prompts = load_prompts(cfg.workload, models.tokenizer, cfg.seed)
    assert len(result.samples) == 3
    for prompt, sample in zip(prompts, result.samples):
        assert sample["token_ids"] == _greedy(models.target, prompt.token_ids, len(sample["token_ids"]))


def test_the_sequential_rule_stops_once_tau_is_precise(run_config):
    """workload.tau_se_target > 0: prompts are decoded (each beside its baseline) until τ's relative standard
    error is at most the target, never fewer than MIN_PROMPTS; num_prompts is the cap. Autoregressive τ is
    exactly 1 (no spread), so it stops at MIN_PROMPTS; off (0), every prompt is decoded."""
    from specsim.tau_error import MIN_PROMPTS

    base = (*SMALL, "method=autoregressive", f"workload.num_prompts={MIN_PROMPTS + 2}")
    on = measure(run_config(*base, "workload.tau_se_target=0.01"), show_progress=False)
    off = measure(run_config(*base), show_progress=False)
    assert len(on.samples) == on.metrics["num_prompts"] == MIN_PROMPTS
    assert on.metrics["baseline_n_tokens"] == on.metrics["n_tokens"]  # the baseline stopped with it
    assert len(off.samples) == MIN_PROMPTS + 2


def test_the_sequential_rule_decodes_to_the_cap_when_tau_stays_noisy(run_config, monkeypatch):
    """The rule is asked after every prompt with all the prompts decoded so far; never satisfied, it decodes
    num_prompts."""
    import methods.measurement.measure as m

    asked = []
    def rule(lengths, target, clusters=None):
        asked.append((len(lengths), list(clusters)))
        return False

    monkeypatch.setattr(m, "precise_enough", rule)
    cfg = run_config(*SMALL, "method=vanilla", "workload.num_prompts=3", "workload.tau_se_target=0.012")
    result = measure(cfg, show_progress=False)
    sizes = [n for n, _ in asked]
    assert len(result.samples) == 3 and len(asked) == 3 and sizes == sorted(sizes) and sizes[-1] <= 3
    # each prompt's source module goes with its lengths (τ's error clusters by module)
    from analysis.validation_report import prompt_module

    modules = [prompt_module(s["prompt_id"]) for s in result.samples]
    assert all(len(c) == n for n, c in asked) and set(asked[-1][1]) <= set(modules)
