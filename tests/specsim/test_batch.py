"""The batch cost model t(B, n), the speedup at batch B and the break-even batch B* (specsim.batch)."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsim import batch
from specsim.batch import Anchored, BatchCostModel, BatchFit, BatchRoofline, first_loss, fit_batch_cost
from specsim.cost import MeasuredCost, ModelShape, Roofline
from specsim.predict import simulate
from specsim.tree import Tree

HARDWARE = ["a100", "h100", "cpu", "l40_offload"]


@pytest.fixture
def seven_b(run_config):
    """run_config(method, *overrides) on Llama-2-7B's shape."""
    return lambda *o: run_config("model=llama2_7b", *o)


@pytest.mark.parametrize("hw", HARDWARE)
def test_batch_one_is_the_single_row_roofline(run_config, hw):
    cfg = run_config(f"hardware={hw}", "model=llama2_7b", "workload.context_tokens=1000")
    shape, ctx = ModelShape.target(cfg.model), cfg.workload.context_tokens
    single, batched = Roofline.from_config(cfg.hardware, shape, ctx), BatchRoofline.from_config(
        cfg.hardware, shape, ctx)
    n = np.array([1, 2, 7, 64, 512])
    np.testing.assert_allclose(batched.time(1, n), single.time(n), rtol=1e-12)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 512), n=st.integers(1, 256), ctx=st.integers(0, 4096))
def test_roofline_grows_with_rows_tokens_and_context(b, n, ctx):
    from specsim.config import HardwareConfig, ModelConfig

    shape = ModelShape.target(ModelConfig(params=6.7e9, n_layers=32, hidden_size=4096, n_heads=32,
                                          n_kv_heads=32))
    r = BatchRoofline.from_config(HardwareConfig(memory_bandwidth_gbs=2039, peak_tflops=312), shape, ctx)
    t = r.time(b, n)
    assert r.time(b + 1, n) >= t and r.time(b, n + 1) >= t
    longer = BatchRoofline.from_config(HardwareConfig(memory_bandwidth_gbs=2039, peak_tflops=312), shape,
                                       ctx + 100)
    assert longer.time(b, n) >= t


def test_small_batches_ride_the_weight_reads_large_ones_are_compute_bound(seven_b):
    cfg = seven_b("hardware=a100", "workload.context_tokens=0")
    r = BatchRoofline.from_config(cfg.hardware, ModelShape.target(cfg.model), 0)
    assert r.time(4, 4) == r.time(1, 1)  # 16 tokens: memory-bound, as free as one
    ridge = r.ridge_tokens()
    assert 50 < ridge < 1000  # A100: ~100 FLOP per byte at 2 bytes per parameter
    big = 64 * ridge
    memory, compute, _ = r.parts(big, 1)
    assert compute > 10 * memory
    assert r.time(2 * big, 1) / r.time(big, 1) == pytest.approx(2.0, rel=0.01)  # linear in B·n


def test_kv_reads_grow_with_rows_times_context(seven_b):
    cfg = seven_b("hardware=h100")
    shape = ModelShape.target(cfg.model)
    short = BatchRoofline.from_config(cfg.hardware, shape, 128)
    long = BatchRoofline.from_config(cfg.hardware, shape, 2048)  # 1 GB of KV per row (no GQA)
    assert long.time(1, 1) / short.time(1, 1) < 1.2  # one row: the weights dominate
    assert long.time(64, 1) / short.time(64, 1) > 3  # 64 rows: 64 GB of KV against 13.5 of weights


def test_batch_fit_recovers_its_own_form():
    truth = BatchFit(t0=1e-3, w=2e-3, kv=3e-8, tok=2e-4, att=1e-7, context_tokens=160, form="sum")
    grid = {(b, n, c): float(truth.time(b, n, c)) for b in (1, 2, 4, 8, 16, 32) for n in (1, 4, 16, 32)
            for c in (160, 512)}
    fit = fit_batch_cost(grid, 160)
    assert fit.form == "sum" and fit.rel_error_max < 1e-3
    b, n = np.array([3, 24]), np.array([7, 9])
    np.testing.assert_allclose(fit.time(b, n, 300), truth.time(b, n, 300), rtol=1e-3)
    assert BatchFit.from_json(fit.to_json()) == fit


def test_batch_fit_picks_the_max_form_for_a_roofline():
    truth = BatchFit(t0=1e-4, w=5e-3, kv=1e-8, tok=1e-5, att=1e-9, context_tokens=256, form="max")
    grid = {(b, n): float(truth.time(b, n)) for b in (1, 2, 4, 8, 16, 32, 64) for n in (1, 2, 8, 32)}
    fit = fit_batch_cost(grid, 256)
    assert fit.form == "max" and fit.rel_error_median < 0.01


def test_anchored_profile_is_the_profile_at_batch_one_and_grows_with_the_fit():
    profile = MeasuredCost((1, 4, 16), (3e-3, 3.3e-3, 4.5e-3))
    fit = BatchFit(t0=1e-3, w=1e-3, kv=1e-8, tok=1e-4, att=0.0, context_tokens=160, form="sum")
    cost = Anchored(profile, fit)
    n = np.array([1, 4, 16])
    np.testing.assert_allclose(cost.time(1, n), profile.time(n))
    np.testing.assert_allclose(cost.time(8, n) / cost.time(1, n), fit.time(8, n) / fit.time(1, n))
    slower = dataclasses.replace(fit, t0=3 * fit.t0, w=3 * fit.w, kv=3 * fit.kv, tok=3 * fit.tok)  # busier
    np.testing.assert_allclose(Anchored(profile, slower).time(8, n), cost.time(8, n))


def test_first_loss_interpolates_in_log_batch():
    assert first_loss([1.5, 1.2, 0.8], [1, 2, 4]) == pytest.approx(2 * 2 ** 0.5)  # halfway in log B
    assert first_loss([0.9, 0.5], [1, 2]) == 1.0
    assert first_loss([2.0, 1.5], [1, 2]) is None


@pytest.mark.parametrize("method", ["vanilla", "medusa", "eagle"])
@pytest.mark.parametrize("hw", ["a100", "h100"])
def test_batch_one_prediction_is_the_single_row_one(seven_b, method, hw):
    cfg = seven_b(f"method={method}", f"hardware={hw}")
    p = batch.predict_at_batch(cfg, batch_size=1, with_break_even=False)
    single = simulate(cfg)
    assert p.predicted_speedup == pytest.approx(single.predicted_speedup, rel=1e-9)
    assert p.predicted_tau == pytest.approx(single.predicted_tau, rel=1e-9)


@pytest.mark.parametrize("method", ["vanilla", "medusa", "eagle"])
@pytest.mark.parametrize("hw", ["a100", "h100"])
def test_speedup_falls_with_batch_and_a_break_even_exists(seven_b, method, hw):
    cfg = seven_b(f"method={method}", f"hardware={hw}")
    curve = batch.speedup_curve(cfg, [1, 4, 16, 64, 256, 1024])
    speedups = [s for _, _, s, _ in curve]
    assert speedups[0] > 1 and all(np.diff(speedups) <= 1e-12)
    b_star = batch.break_even_batch(cfg)
    assert b_star is not None and 1 < b_star < batch.MAX_SEARCH_BATCH
    lo, hi = (batch.predict_at_batch(cfg, batch_size=b, with_break_even=False).predicted_speedup
              for b in (int(b_star) - 1 if b_star >= 2 else 1, int(np.ceil(b_star)) + 1))
    assert lo >= 1 > hi


def test_break_even_moves_the_right_way_with_draft_cost_and_acceptance(seven_b):
    base = ("method=vanilla", "hardware=a100", "method.draft_cost_ratio=0.05",
            "method.acceptance.alpha=0.7")
    b0 = batch.break_even_batch(seven_b(*base))
    dearer = batch.break_even_batch(seven_b(*base, "method.draft_cost_ratio=0.2"))
    better = batch.break_even_batch(seven_b(*base, "method.acceptance.alpha=0.85"))
    assert dearer < b0 < better
    longer = batch.break_even_batch(seven_b(*base, "workload.context_tokens=4000"))
    assert longer is None or longer > b0  # KV reads keep long contexts memory-bound (MagicDec)


def test_a_static_batch_waits_for_its_slowest_row(seven_b):
    """predicted_decode_speedup prices max_new_tokens per row: at B = 1 the one-sequence finite-generation
    prediction; a static batch steps until its slowest row is done (fewer tokens per forward than τ, falling
    with B), continuous batching refills rows (one row's mean)."""
    cfg = seven_b("method=vanilla", "hardware=a100", "workload.max_new_tokens=64")
    one = batch.predict_at_batch(cfg, batch_size=1, with_break_even=False)
    assert one.predicted_decode_speedup == pytest.approx(simulate(cfg).predicted_decode_speedup, rel=1e-9)
    static = [batch.predict_at_batch(cfg, batch_size=b, with_break_even=False) for b in (2, 8, 32)]
    assert all(a.batch_forwards < b.batch_forwards for a, b in zip(static, static[1:]))
    assert all(p.predicted_decode_speedup < p.predicted_speedup for p in static)
    cont = batch.predict_at_batch(seven_b("method=vanilla", "hardware=a100", "workload.max_new_tokens=64",
                                          "workload.continuous=true"), batch_size=8, with_break_even=False)
    assert cont.batch_forwards == pytest.approx(one.batch_forwards)
    assert cont.batch_forwards < static[1].batch_forwards


def test_autoregressive_never_breaks_even(seven_b):
    cfg = seven_b("method=autoregressive", "hardware=a100")
    assert batch.break_even_batch(cfg) is None
    assert batch.predict_at_batch(cfg, batch_size=16).predicted_speedup == 1.0


def test_sequoia_shrinks_its_tree_as_the_batch_grows(seven_b):
    cfg = seven_b("method=sequoia", "hardware=a100", "tree=sequoia")
    rows = batch.best_budget_by_batch(cfg, [1, 4, 16, 64, 256])
    budgets = [r["budget"] for r in rows]
    assert budgets[0] > budgets[-1] and all(np.diff(budgets) <= 0)
    assert all(r["speedup"] >= 1.0 for r in rows)


def test_dynamic_tree_budget_shrinks_with_batch(seven_b):
    cfg = seven_b("method=eagle2", "hardware=a100", "tree=dynamic")
    budgets = [r["budget"] for r in batch.best_budget_by_batch(cfg, [1, 16, 256])]
    assert budgets[0] > budgets[-1]


def test_draft_roofline_is_batched_too(seven_b):
    cfg = seven_b("method=vanilla", "hardware=a100", "method.draft_cost=roofline")
    cost = BatchCostModel.from_config(cfg)
    tree = Tree.chain(4)
    assert cost.at(512).draft_time(tree) > 2 * cost.at(1).draft_time(tree)


def test_ratio_priced_draft_grows_as_the_target_step(seven_b):
    cfg = seven_b("method=vanilla", "hardware=a100", "method.draft_cost_ratio=0.1")
    cost = BatchCostModel.from_config(cfg)
    for b in (1, 64, 1024):
        at = cost.at(b)
        assert at.draft_time(Tree.chain(3)) == pytest.approx(0.3 * at.ar_time)


def test_simulate_reports_the_batch_when_batch_size_is_above_one(run_module, run_config):
    cfg = run_config("task=simulate", "method=vanilla", "hardware=a100", "model=llama2_7b",
                     "workload.batch_size=16")
    result = run_module.execute(cfg, None)
    metrics = result.metrics
    assert any("break-even batch" in line for line in result.summary)
    assert metrics["batch_size"] == 16
    assert metrics["predicted_speedup"] == pytest.approx(
        batch.predict_at_batch(cfg, with_break_even=False).predicted_speedup)
    assert metrics["predicted_speedup_batch1"] == pytest.approx(simulate(cfg).predicted_speedup)
    assert metrics["break_even_batch"] == pytest.approx(batch.break_even_batch(cfg))
    assert set(metrics["speedup_by_batch"]) == {str(b) for b in batch.BATCHES}


def test_rows_of_different_prompts_match_a_monte_carlo():
    """Rows drawn from prompts of different acceptance: a static batch's forwards are the max over rows
    whose forwards follow the mixture of the prompts' laws (Monte Carlo: pick a prompt per row, step under its
    law); the spread makes the slowest row slower than one shared law of the same mean would."""
    from specsim.expected import batch_forwards

    laws = [np.array([0.0, 0.6, 0.2, 0.1, 0.05, 0.05]), np.array([0.0, 0.1, 0.1, 0.2, 0.2, 0.4])]
    rng = np.random.default_rng(3)
    rows, batch_rows, n = 24000, 8, 48
    which = rng.integers(0, 2, size=rows)
    steps = np.where(which[:, None] == 0, rng.choice(6, p=laws[0], size=(rows, n)),
                     rng.choice(6, p=laws[1], size=(rows, n)))
    forwards = ((np.cumsum(steps, axis=1) < n).sum(axis=1) + 1).reshape(-1, batch_rows)
    got = batch.mixture_batch_forwards(laws, n, batch_rows)
    assert got == pytest.approx(forwards.max(axis=1).mean(), rel=0.01)
    assert batch.mixture_batch_forwards([laws[0]], n, 8) == pytest.approx(batch_forwards(laws[0], n, 8))
    pooled = (laws[0] + laws[1]) / 2
    assert got > batch_forwards(pooled, n, batch_rows)
    assert batch.mixture_batch_forwards(laws, n, 1) == pytest.approx(forwards[:, 0].mean(), rel=0.01)


def test_prompt_laws_shrink_sampling_noise_and_keep_real_spread():
    """Per-prompt histograms drawn from ONE law spread only by sampling noise: the laws shrink to the
    centre; prompts drawn from two laws keep (most of) their difference, centred on the model's law."""
    rng = np.random.default_rng(0)
    law = np.array([0.0, 0.3, 0.3, 0.2, 0.2])

    def hists(p, prompts, steps):
        return [np.bincount(rng.choice(5, p=p, size=steps) - 1, minlength=4).tolist() for _ in range(prompts)]

    same = batch.prompt_laws(hists(law, 40, 20), law)
    spread = np.std([x @ np.arange(5) for x in same])
    assert spread < 0.1 and all(x.sum() == pytest.approx(1) and (x >= 0).all() for x in same)
    lo, hi = np.array([0.0, 0.6, 0.3, 0.1, 0.0]), np.array([0.0, 0.05, 0.15, 0.3, 0.5])
    two = batch.prompt_laws(hists(lo, 20, 200) + hists(hi, 20, 200), law)
    taus = np.array([x @ np.arange(5) for x in two])
    assert taus[20:].mean() - taus[:20].mean() > 0.8 * (hi @ np.arange(5) - lo @ np.arange(5))
    assert taus.mean() == pytest.approx(law @ np.arange(5), abs=0.1)  # centred (up to the clipping at 0)
    assert batch.prompt_laws([[3, 1]], law) == [law]  # one prompt: no spread to measure


def test_per_prompt_histograms_lengthen_a_static_batch(seven_b):
    """predict_at_batch with calibration's per-prompt histograms: the same τ, more forwards for a static
    batch (its slowest row), the same prediction at B = 1 up to the re-centring."""
    cfg = seven_b("method=vanilla", "hardware=a100", "workload.max_new_tokens=64", "tree.gamma=4")
    rng = np.random.default_rng(0)
    hists = [np.bincount(rng.choice(6, p=p, size=40), minlength=6).tolist()[:5]
             for p in ([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.05, 0.05, 0.1, 0.1, 0.2, 0.5]) for _ in range(10)]
    plain = batch.predict_at_batch(cfg, batch_size=16, with_break_even=False)
    mixed = batch.predict_at_batch(cfg, batch_size=16, with_break_even=False, prompt_hists=hists)
    assert mixed.predicted_tau == plain.predicted_tau and mixed.batch_forwards > plain.batch_forwards
    assert mixed.predicted_decode_speedup < plain.predicted_decode_speedup


def test_a_draft_fit_prices_the_draft_step_at_batch(seven_b):
    """A measured draft t(B, n) fit replaces 'the draft grows like the target': a draft whose forward is
    flat in B (overhead-bound) leaves the step cheaper at B = 32 than one growing with B; at B = 1 both are
    the single-row prediction."""
    cfg = seven_b("method=vanilla", "hardware=a100", "method.draft_cost=ratio", "method.draft_cost_ratio=0.2")
    flat = BatchFit(1e-3, 0.0, 0.0, 0.0, 0.0, 160)  # t0 only: the same at every B
    steep = BatchFit(1e-5, 0.0, 0.0, 1e-4, 0.0, 160)  # per token: grows with B
    at = {name: [batch.predict_at_batch(cfg, batch_size=b, with_break_even=False, draft_fit=f)
                 for b in (1, 32)] for name, f in (("flat", flat), ("steep", steep), ("none", None))}
    assert at["flat"][0].predicted_speedup == pytest.approx(at["none"][0].predicted_speedup)
    assert at["steep"][0].predicted_speedup == pytest.approx(at["none"][0].predicted_speedup)
    assert at["flat"][1].t_step_s < at["steep"][1].t_step_s
    assert at["flat"][1].predicted_speedup > at["steep"][1].predicted_speedup


def test_the_batched_loop_is_priced_by_the_fit_and_the_loop_not_by_the_profile():
    """On a measured device a step at B >= 2 is the batched engine's forward at the fit's context plus the
    batched loop's own time (loop0 + loop_row·B), whatever the one-sequence profile reads; B = 1 is the
    profile (the one-sequence loop decodes a batch of one)."""
    profile = MeasuredCost((1, 4, 16), (3e-3, 3.3e-3, 4.5e-3))
    fit = BatchFit(t0=4e-3, w=0.0, kv=1e-8, tok=1e-4, att=0.0, context_tokens=160, form="sum",
                   loop0=2e-4, loop_row=3e-5)
    cost = batch.BatchedLoop(profile, fit)
    n = np.array([1, 4, 16])
    np.testing.assert_allclose(cost.time(1, n), profile.time(n))
    for b in (2, 16):
        np.testing.assert_allclose(cost.time(b, n), fit.time(b, n) + 2e-4 + 3e-5 * b)
    faster = MeasuredCost((1, 4, 16), (1e-3, 1.1e-3, 1.5e-3))  # another engine's steps: not read at B > 1
    np.testing.assert_allclose(batch.BatchedLoop(faster, fit).time(8, n), cost.time(8, n))
    longer = dataclasses.replace(fit, context_tokens=512)
    assert batch.BatchedLoop(profile, longer).time(8, 1) > cost.time(8, 1)  # KV reads grow with the context


def test_a_measured_device_prices_the_loop_at_the_workloads_context_and_the_draft_per_level(run_config):
    """BatchCostModel with a profile and fits: the target fit is read at workload.context_tokens, and the
    draft step at B >= 2 is one draft-fit forward per tree level plus the draft fit's own loop time."""
    cfg = run_config("model=zoo", "hardware=cpu", "method=vanilla", "tree=chain", "tree.gamma=4",
                     "workload.context_tokens=300", "method.draft_cost_ratio=0.2")
    profile = MeasuredCost((1, 5), (3e-3, 3.2e-3))
    fit = BatchFit(4e-3, 0.0, 1e-8, 1e-4, 0.0, 160, "sum", loop0=2e-4, loop_row=3e-5)
    draft = BatchFit(6e-4, 0.0, 1e-9, 1e-5, 0.0, 160, "sum", loop0=5e-4, loop_row=2e-5)
    cost = BatchCostModel.from_config(cfg, profile, fit, draft)
    tree = Tree.chain(4)
    at16 = cost.at(16)
    assert at16.ar_time == pytest.approx(fit.time(16, 1, 300) + fit.loop_time(16))
    want = 4 * draft.time(16, 1, 300) + draft.loop_time(16)
    assert at16.draft_time(tree) == pytest.approx(want)
    one = cost.at(1)  # B = 1: the one-sequence profile and its draft ratio
    assert one.ar_time == pytest.approx(3e-3)
    assert one.draft_time(tree) == pytest.approx(4 * 0.2 * 3e-3)
    p = batch.predict_at_batch(cfg, profile, fit, tree=tree, batch_size=16, draft_fit=draft,
                               with_break_even=False)
    assert p.t_step_s == pytest.approx(p.t_verify_s + p.t_draft_s)
    assert p.t_draft_s == pytest.approx(want)


def test_the_fit_tells_the_one_query_kv_read_from_the_trees():
    """Forwards of n >= 2 tokens read the cache at another rate (kv_tree) than 1-token ones: a grid made
    with one is fitted back, and a fit without it prices both alike."""
    truth = BatchFit(t0=1e-3, w=2e-3, kv=1e-9, tok=5e-5, att=0.0, context_tokens=160, form="sum",
                     kv_tree=3e-9)
    grid = {(b, n, c): float(truth.time(b, n, c)) for b in (1, 2, 4, 8, 16, 32) for n in (1, 2, 4, 8)
            for c in (128, 192)}
    fit = fit_batch_cost(grid, 128)
    assert fit.rel_error_max < 0.01 and fit.kv_tree == pytest.approx(3e-9, rel=0.05)
    plain = dataclasses.replace(truth, kv_tree=None)
    assert plain.time(16, 2) - plain.time(16, 1) < truth.time(16, 2) - truth.time(16, 1)


def test_the_one_token_forward_is_priced_by_the_loops_own_line_where_timed():
    """ar_context > 0: t(B, 1) is the loop-timed line ar0 + ar_row·B at ar_context cached tokens, the kv
    term carrying it to other contexts; forwards of n >= 2 tokens keep the grid's terms; ar_context 0: the
    grid's terms price n = 1 too."""
    grid = BatchFit(t0=1e-3, w=2e-3, kv=1e-9, tok=5e-5, att=0.0, context_tokens=160, form="sum", kv_tree=3e-9)
    loop = dataclasses.replace(grid, ar0=1.5e-3, ar_row=2e-4, ar_context=140.0)
    for b in (1, 4, 16):
        assert loop.time(b, 1, 140) == pytest.approx(1.5e-3 + 2e-4 * b)
        assert loop.time(b, 1, 200) == pytest.approx(1.5e-3 + 2e-4 * b + 1e-9 * b * 60)
        assert loop.time(b, 1) == pytest.approx(1.5e-3 + 2e-4 * b + 1e-9 * b * 20)  # the fit's context
        for n in (2, 5):
            assert loop.time(b, n) == pytest.approx(grid.time(b, n))
        assert grid.time(b, 1) != pytest.approx(loop.time(b, 1))
    np.testing.assert_allclose(loop.time(np.array([2, 8]), np.array([1, 4])),
                               [loop.time(2, 1), grid.time(8, 4)])
    assert BatchFit.from_json(loop.to_json()) == loop


def _measured_device(run_config, method: str = "vanilla", *overrides: str):
    """(cfg, profile, target fit, draft fit) of a measured device whose batched steps grow with the rows."""
    cfg = run_config("model=zoo", "hardware=cpu", f"method={method}", "workload.context_tokens=160",
                     "workload.max_new_tokens=48", "method.acceptance.kind=iid",
                     "method.acceptance.alpha=0.7", *overrides)
    profile = MeasuredCost((1, 5), (3e-3, 3.2e-3))
    fit = BatchFit(2e-3, 0.0, 1e-8, 4e-4, 0.0, 160, "sum", loop0=2e-4, loop_row=3e-5)
    draft = BatchFit(3e-4, 0.0, 1e-9, 6e-5, 0.0, 160, "sum", loop0=4e-4, loop_row=5e-5)
    return cfg, profile, fit, draft


def test_a_static_batch_prices_each_step_at_the_rows_still_decoding(run_config):
    """A static batch's rows finish steps apart; its later steps run only the rows not done yet, and the
    batched loop pays for those (forward, loop, draft: all grow with the rows). The run's expected time is
    Σ over steps of E[step at B_s rows], B_s ~ Binomial(B, P(F ≥ s)): checked against rows drawn at random
    (Monte Carlo). The old pricing, every step at B rows, reads the run dearer (the zoo's vanilla sweep:
    the speculative forward +9…+16% at B ≥ 8)."""
    from specsim.acceptance import from_config
    from specsim.expected import accepted_length_law, forwards_law

    cfg, profile, fit, draft = _measured_device(run_config, "vanilla", "tree=chain", "tree.gamma=4")
    tree, b, n = Tree.chain(4), 8, 48
    p = batch.predict_at_batch(cfg, profile, fit, tree=tree, batch_size=b, draft_fit=draft,
                               with_break_even=False)
    cost = BatchCostModel.from_config(cfg, profile, fit, draft)
    step = {k: cost.rows(k).step_time(tree) for k in range(1, b + 1)}
    pmf = forwards_law(accepted_length_law(tree, from_config(cfg.method.acceptance)), n)
    rng = np.random.default_rng(0)
    f = rng.choice(len(pmf), size=(20000, b), p=pmf / pmf.sum())  # each row's forwards
    rows = (f[:, :, None] >= np.arange(1, n + 1)).sum(1)  # (trials, steps): rows still decoding
    table = np.array([0.0] + [step[k] for k in range(1, b + 1)])
    run = table[rows].sum(1).mean()
    assert p.batch_forwards * p.t_run_step_s == pytest.approx(run, rel=0.01)
    assert p.batch_forwards == pytest.approx(f.max(1).mean(), rel=0.01)
    assert p.predicted_decode_speedup == pytest.approx(n * p.t_ar_s / run, rel=0.01)
    assert p.t_run_step_s == pytest.approx(p.t_run_verify_s + p.t_run_draft_s)
    assert p.mean_rows == pytest.approx(rows.sum(1).mean() / f.max(1).mean(), rel=0.01) and p.mean_rows < b
    assert p.t_run_step_s < p.t_step_s and p.t_run_verify_s < p.t_verify_s  # fewer rows: cheaper steps
    assert p.predicted_decode_speedup > n * p.t_ar_s / (p.batch_forwards * p.t_step_s)
    cont = batch.predict_at_batch(run_config("model=zoo", "hardware=cpu", "method=vanilla",
                                             "workload.continuous=true"), profile, fit, tree=tree,
                                  batch_size=b, draft_fit=draft, with_break_even=False)
    assert cont.t_run_step_s == pytest.approx(cont.t_step_s)  # continuous batching refills its rows


def test_the_last_row_of_a_batch_is_a_step_of_the_batched_loop(run_config):
    """cost.rows(1) is one row of the batched loop (fit + loop terms, the draft fit's forwards), at(1) the
    one-sequence loop's profile (a batch of one is decoded alone)."""
    cfg, profile, fit, draft = _measured_device(run_config, "vanilla", "tree=chain", "tree.gamma=4")
    cost = BatchCostModel.from_config(cfg, profile, fit, draft)
    assert cost.at(1).ar_time == pytest.approx(3e-3)
    assert cost.rows(1).ar_time == pytest.approx(fit.time(1, 1) + fit.loop_time(1))
    assert cost.rows(1).draft_time(Tree.chain(4)) == pytest.approx(4 * draft.time(1, 1) + draft.loop_time(1))
    assert cost.rows(8).step_time(Tree.chain(4)) == pytest.approx(cost.at(8).step_time(Tree.chain(4)))


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_a_head_fit_prices_the_head_drafters_step_at_batch(run_config, method):
    """A head drafter's step timed in the batched loop (HeadFit: step0 + step_row · rows for a tree of
    `levels` levels) prices its draft at B ≥ 2, one level's share per level; B = 1 stays the profile's
    ratio; without it the draft grows as the target's t(B, 1) (the zoo's EAGLE at B = 16: predicted 0.649,
    measured 0.560)."""
    cfg, profile, fit, _ = _measured_device(run_config, method, "method.draft_cost_ratio=0.2")
    head = batch.HeadFit(1e-3, 4e-4, levels=3)
    tree = Tree.from_parents([-1, 0, 0, 1, 2, 3])  # 3 levels
    with_head = BatchCostModel.from_config(cfg, profile, fit, head_fit=head)
    grown = BatchCostModel.from_config(cfg, profile, fit)
    for b in (2, 16):
        assert with_head.at(b).draft_time(tree) == pytest.approx(1e-3 + 4e-4 * b)
        assert with_head.at(b).draft_time(Tree.chain(1)) == pytest.approx((1e-3 + 4e-4 * b) / 3)
        assert with_head.at(b).draft_time(tree) != pytest.approx(grown.at(b).draft_time(tree))
    assert with_head.at(1).draft_time(tree) == pytest.approx(grown.at(1).draft_time(tree))
    assert with_head.at(1).draft_time(tree) == pytest.approx(3 * 0.2 * 3e-3)
    assert with_head.rows(1).draft_time(tree) == pytest.approx(1e-3 + 4e-4)
    p = batch.predict_at_batch(cfg, profile, fit, tree=tree, batch_size=16, head_fit=head,
                               with_break_even=False)
    assert p.t_draft_s == pytest.approx(1e-3 + 4e-4 * 16)
    assert batch.HeadFit.from_json(head.to_json()) == head
    # the roofline (no measured device) has no batched loop to read a head fit against
    assert BatchCostModel.from_config(cfg, head_fit=head).head is None


def test_a_recorded_law_prices_the_kept_trees_at_batch(run_config):
    """A dynamic drafter's kept trees (specsim.trees.recorded_law) give τ, the static batch's forwards and B*
    at every B, the static DP tree (same size and depth) only sizing the step: one kept tree recorded is
    priced as that tree itself. The DP tree's own τ is an upper bound (the zoo's EAGLE-2 at B = 4: 3.81
    predicted against 3.33 measured)."""
    from specsim.acceptance import from_config
    from specsim.trees import recorded_law

    cfg, profile, fit, _ = _measured_device(run_config, "eagle2", "tree=dynamic",
                                            "method.draft_cost_ratio=0.2")
    dp, kept = Tree.from_parents([-1, 0, 0, 1]), Tree.from_parents([-1, 0, 0, 2])  # same size and depth
    law = recorded_law({kept: 3}, from_config(cfg.method.acceptance))
    for b in (1, 4, 16):
        p = batch.predict_at_batch(cfg, profile, fit, tree=dp, batch_size=b, law=law)
        own = batch.predict_at_batch(cfg, profile, fit, tree=kept, batch_size=b)
        static = batch.predict_at_batch(cfg, profile, fit, tree=dp, batch_size=b)
        assert p.predicted_tau == pytest.approx(own.predicted_tau) != pytest.approx(static.predicted_tau)
        assert p.batch_forwards == pytest.approx(own.batch_forwards) != pytest.approx(static.batch_forwards)
        assert p.predicted_decode_speedup == pytest.approx(own.predicted_decode_speedup)
        assert p.t_step_s == pytest.approx(static.t_step_s)
        assert p.break_even_batch is not None and p.break_even_batch == pytest.approx(own.break_even_batch)
    assert static.break_even_batch != pytest.approx(own.break_even_batch)
    with pytest.raises(AssertionError):  # a law prices a given tree's steps, not one sized at each B
        batch.speedup_curve(cfg, [4], BatchCostModel.from_config(cfg, profile, fit), law=law)


def test_a_timed_dynamic_draft_is_the_draft_at_one_grown_with_the_target_or_the_head_fits(run_config):
    """A dynamic drafter's timed draft per step (``draft_s``, methods.measurement.profiles.dynamic_draft_s)
    is its draft at B = 1, grows as the target's t(B, 1) at B ≥ 2 without a head fit, and gives way to
    the head fit's batched step where one was timed; without it the draft is priced by its levels."""
    cfg, profile, fit, _ = _measured_device(run_config, "eagle2", "tree=dynamic",
                                            "method.draft_cost_ratio=0.2")
    tree, d = Tree.from_parents([-1, 0, 0, 1]), 2.5e-3
    cost = BatchCostModel.from_config(cfg, profile, fit)
    head = batch.HeadFit(1e-3, 4e-4, levels=cfg.tree.depth)
    for b in (1, 4, 16):
        p = batch.predict_at_batch(cfg, profile, fit, tree=tree, batch_size=b, draft_s=d,
                                   with_break_even=False)
        levels = batch.predict_at_batch(cfg, profile, fit, tree=tree, batch_size=b, with_break_even=False)
        assert p.t_draft_s == pytest.approx(d * cost.at(b).ar_time / cost.at(1).ar_time)
        assert p.t_draft_s != pytest.approx(levels.t_draft_s) and p.t_verify_s == levels.t_verify_s
        with_head = batch.predict_at_batch(cfg, profile, fit, tree=tree, batch_size=b, draft_s=d,
                                           head_fit=head, with_break_even=False)
        assert with_head.t_draft_s == pytest.approx(d if b == 1 else head.time(b))
    # a draft model's own batched forward keeps its pricing
    assert cost.with_draft_step(d) is not cost
    with_model = BatchCostModel.from_config(cfg, profile, fit, draft_fit=fit)
    assert with_model.with_draft_step(d) is with_model
