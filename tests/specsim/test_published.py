"""specsim.overheads (launch model) and specsim.published (α from τ, errors, the table): pure maths on small
inputs; the presets themselves are composed in tests/test_published_presets.py."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsim import IIDAcceptance, MeasuredCost, Tree, chain_expected_tokens, expected_tokens
from specsim.overheads import (
    KernelCount,
    LaunchBound,
    Runtime,
    eager_score_bytes,
    head_shape,
    step_overhead_s,
)
from specsim.published import markdown, misses, relative_error, setting_from, solve_alpha, table_row

FLAT = MeasuredCost((1,), (1e-3,))  # a 1 ms forward whatever n
EAGER = Runtime("eager", graph=False, host_us_per_kernel=10.0, kernel_floor_us=2.0)
GRAPH = Runtime("graph", graph=True, host_us_per_kernel=0.0, kernel_floor_us=2.0, graph_launch_us=5.0)


def test_kernel_count_is_per_layer_plus_fixed():
    assert KernelCount(55, 25).of(32) == 55 * 32 + 25
    assert KernelCount(55, 25).of(0) == 25


def test_eager_forward_is_the_larger_of_host_and_device():
    few = LaunchBound(FLAT, kernels=10, runtime=EAGER, bandwidth=1e12)  # host 0.1 ms < device 1.02 ms
    many = LaunchBound(FLAT, kernels=1000, runtime=EAGER, bandwidth=1e12)  # host 10 ms > device 3 ms
    assert few.time(1) == pytest.approx(1e-3 + 10 * 2e-6)
    assert many.time(1) == pytest.approx(1000 * 10e-6)


def test_graph_forward_pays_one_launch_and_the_kernel_floors():
    g = LaunchBound(FLAT, kernels=1000, runtime=GRAPH, bandwidth=1e12)
    assert g.time(1) == pytest.approx(5e-6 + 1e-3 + 1000 * 2e-6)
    assert g.time(1) < LaunchBound(FLAT, kernels=1000, runtime=EAGER, bandwidth=1e12).time(1)


def test_tree_mask_costs_bytes_over_bandwidth_and_only_for_trees():
    bw, ctx, layers = 1e9, 100, 4
    lb = LaunchBound(FLAT, kernels=0, runtime=GRAPH, bandwidth=bw, context_tokens=ctx, mask_layers=layers)
    assert lb.time(1) == pytest.approx(5e-6 + 1e-3)  # one token: no mask
    n = 16
    assert lb.time(n) - lb.time(1) == pytest.approx(2.0 * n * (ctx + n) * layers / bw)
    t = lb.time(np.array([1, 8, 64]))
    assert np.all(np.diff(t) > 0)


def test_step_overhead_counts_kv_gathers_and_bookkeeping():
    assert step_overhead_s(EAGER, n_layers=32, fixed_kernels=30) == pytest.approx((64 + 30) * 10e-6)
    assert step_overhead_s(GRAPH, n_layers=32, fixed_kernels=30) == pytest.approx((64 + 30) * 2e-6)


def test_step_overhead_takes_a_framework_gather_count_and_prices_syncs():
    r = Runtime("eager", graph=False, host_us_per_kernel=10.0, kernel_floor_us=2.0, sync_us=6.0)
    assert step_overhead_s(r, n_layers=32, fixed_kernels=46, gather_kernels=2, syncs=10) == pytest.approx(
        (2 + 46) * 10e-6 + 10 * 6e-6)
    assert step_overhead_s(r, 32, 30) == pytest.approx((64 + 30) * 10e-6)  # defaults: 2 per layer, no sync
    assert step_overhead_s(EAGER, 32, 30, syncs=5) == step_overhead_s(EAGER, 32, 30)  # sync_us 0: unpriced


def test_runtime_reads_sync_us_and_refuses_negative_costs():
    r = Runtime.from_mapping("e", {"graph": False, "host_us_per_kernel": 7.5, "kernel_floor_us": 2.9,
                                   "sync_us": 5.8})
    assert r.sync_us == 5.8
    plain = Runtime.from_mapping("e", {"graph": False, "host_us_per_kernel": 7.5, "kernel_floor_us": 2.9})
    assert plain.sync_us == 0
    with pytest.raises(AssertionError):
        Runtime("bad", graph=False, host_us_per_kernel=1.0, kernel_floor_us=1.0, sync_us=-1.0)


def test_eager_score_bytes_counts_the_passes():
    assert eager_score_bytes() == 28  # half-precision scores, float32 mask and softmax (Medusa's attention)
    assert eager_score_bytes(2, 2) == 2 + 4 + 4 + 4 + 4 + 2  # all half precision
    assert eager_score_bytes(4, 4) == 2 * eager_score_bytes(2, 2)


def test_eager_scores_cost_bytes_per_head_over_bandwidth_and_only_for_trees():
    bw, ctx, layers, heads = 1e9, 100, 4, 8
    plain = LaunchBound(FLAT, kernels=0, runtime=GRAPH, bandwidth=bw, context_tokens=ctx, mask_layers=layers)
    eager = LaunchBound(FLAT, kernels=0, runtime=GRAPH, bandwidth=bw, context_tokens=ctx, mask_layers=layers,
                        score_heads=heads, score_bytes=28.0)
    assert eager.time(1) == plain.time(1)  # one token: no tree, no scores priced
    n = 16
    assert eager.time(n) - plain.time(n) == pytest.approx(28.0 * heads * n * (ctx + n) * layers / bw)


def test_heads_priced_at_a_fixed_token_count():
    from specsim.cost import ModelShape, Roofline

    shape = ModelShape(1e9, 2.0, 1, 4096, 32, 32)
    base = Roofline(shape, bandwidth=1e9, flops=1e10, overhead_s=0.0, context_tokens=0)  # compute-bound at 64
    lb = LaunchBound(base, kernels=0, runtime=GRAPH, bandwidth=1e9)
    at64 = LaunchBound(base, kernels=0, runtime=GRAPH, bandwidth=1e9, tokens=64)
    assert at64.time(1) == pytest.approx(lb.time(64)) and lb.time(64) > lb.time(1)


def test_head_shape_counts_its_parameters():
    h, v, i = 4096, 32000, 11008
    eagle = head_shape(h, v, layers=1, intermediate=i, extra_params=2.0 * h * h)
    assert eagle.params == pytest.approx(4 * h * h + 3 * h * i + h * v + 2 * h * h)
    medusa = head_shape(h, v, lm_heads=4, extra_params=4.0 * h * h)
    assert medusa.params == pytest.approx(4 * (h * v + h * h))
    assert medusa.weight_bytes == pytest.approx(2 * medusa.params)


def test_relative_error_and_missing_figures():
    assert relative_error(3.3, 3.0) == pytest.approx(0.1)
    assert relative_error(2.7, 3.0) == pytest.approx(-0.1)
    assert math.isnan(relative_error(2.0, None))
    assert math.isnan(relative_error(float("nan"), 2.0))


@settings(max_examples=25, deadline=None)
@given(alpha=st.floats(0.05, 0.95), gamma=st.integers(1, 8))
def test_solve_alpha_inverts_the_chain_closed_form(alpha, gamma):
    tau = float(chain_expected_tokens(alpha, gamma))
    chain = Tree.chain(gamma)
    solved = solve_alpha(lambda a: expected_tokens(chain, IIDAcceptance(a)), tau)
    assert solved == pytest.approx(alpha, abs=1e-6)


def test_solve_alpha_refuses_a_tau_the_tree_cannot_reach():
    chain = Tree.chain(2)  # τ <= 3
    with pytest.raises(ValueError, match="outside"):
        solve_alpha(lambda a: expected_tokens(chain, IIDAcceptance(a)), 3.5)


RUNTIMES = {
    "kernels": {"hf_llama_eager": {"per_layer": 55, "fixed": 25}},
    "runtimes": {"eager": {"graph": False, "host_us_per_kernel": 7.5, "kernel_floor_us": 2.9},
                 "graph": {"graph": True, "host_us_per_kernel": 0.0, "kernel_floor_us": 2.9}},
    "step_fixed_kernels": 30,
}


def test_setting_from_merges_paper_and_row_and_reads_tau_only_when_asked():
    paper = {"setting": {"target_runtime": "eager", "draft_runtime": "graph", "draft": "model"}}
    row = {"id": "r", "published": {"speedup": 3.0, "tau": 4.0},
           "setting": {"draft": "eagle_head", "head_kernels": 10, "tau_from_published": True}}
    s = setting_from(paper, RUNTIMES, row)
    assert (s.draft, s.head_kernels, s.tau) == ("eagle_head", 10, 4.0)
    assert s.target_runtime.name == "eager" and not s.target_runtime.graph and s.draft_runtime.graph
    assert setting_from(paper, RUNTIMES, {"id": "r", "published": {"tau": 4.0}}).tau is None


def test_setting_reads_the_opt_in_step_terms_and_defaults_to_the_generic_model():
    paper = {"setting": {"target_runtime": "eager", "draft_runtime": "eager", "draft": "medusa_heads",
                         "medusa_heads": 4, "head_kernels": 4, "head_tokens": 64, "step_fixed_kernels": 46,
                         "gather_kernels": 2, "step_syncs": 10, "score_bytes": 28}}
    s = setting_from(paper, RUNTIMES, {"id": "r", "published": {}})
    assert (s.head_tokens, s.step_fixed_kernels, s.gather_kernels, s.step_syncs, s.score_bytes) == (
        64, 46, 2, 10, 28.0)
    plain = setting_from({"setting": {"target_runtime": "eager", "draft_runtime": "eager"}}, RUNTIMES,
                         {"id": "r", "published": {}})
    assert (plain.head_tokens, plain.step_fixed_kernels, plain.gather_kernels, plain.step_syncs,
            plain.score_bytes) == (0, 30, None, 0, 0.0)


def test_table_row_markdown_and_misses():
    from specsim.published import Forecast

    f = Forecast(speedup=3.3, tau=4.0, t_ar_ms=10.0, t_step_ms=12.0, tree_size=26, tree_depth=5, alpha=0.7,
                 roofline_speedup=3.6)
    ok = table_row("P", {"id": "near", "published": {"speedup": 3.0}}, f)
    far = table_row("P", {"id": "far", "published": {"speedup": 2.0, "baseline_ms": 20.0}}, f)
    assert ok["speedup_error"] == pytest.approx(0.1) and math.isnan(ok["ar_error"])
    assert ok["tau_at_published"] == pytest.approx(3.0 * 12.0 / 10.0)  # S = τ · t_AR / t_step, solved for τ
    assert far["ar_error"] == pytest.approx(-0.5)
    assert [r["row"] for r in misses([ok, far])] == ["far"]
    text = markdown([ok, far])
    assert "| P | near | 3.00 | 3.30 | +10% | 3.60 |" in text and "–" in text and "-50%" in text


# ---- MagicDec's batch pricing: specsim.batch.BatchRoofline with tensor parallelism ----------------------
def _batch_cost(**kw):
    from specsim.batch import BatchRoofline
    from specsim.cost import ModelShape

    shape = ModelShape(6.738e9, 2.0, 32, 4096, 32, 32)  # Llama-2-7B: 0.5 MB of KV per token
    return BatchRoofline(shape, bandwidth=1.6e12, flops=1.9e14, overhead_s=0.0, context_tokens=1000, **kw)


def test_batch_cost_adds_kv_bytes_per_sequence_and_splits_over_tensor_parallel_gpus():
    one, eight = _batch_cost(), _batch_cost(tp=8)
    kv = 2 * 32 * 4096 * 2.0
    assert one.time(4, 1) - one.time(0, 1) == pytest.approx(4 * 1000 * kv / 1.6e12)
    assert eight.time(4, 1) == pytest.approx(one.time(4, 1) / 8)  # no link: no all-reduce priced
    linked = _batch_cost(tp=8, link=3e11)
    ring = 2 * 32 * (2 * 7 / 8) * 4 * 1 * 4096 * 2.0 / 3e11  # two ring all-reduces per layer
    assert linked.time(4, 1) - eight.time(4, 1) == pytest.approx(ring)
    assert one.at_context(2000).time(4, 1) - one.time(4, 1) == pytest.approx(4 * 1000 * kv / 1.6e12)


def test_batch_cost_checks_memory():
    c = _batch_cost(tp=1, memory_bytes=80e9)
    assert c.fits(1, 1000) and not c.fits(256, 32000)
    assert _batch_cost(tp=8, memory_bytes=80e9).fits(32, 32000) and not c.fits(32, 32000)


def test_one_batch_pricing_for_magicdec():
    """MagicDec's speedup is priced by the batch cost model the measured batched runs use (no second copy):
    at tp = 1 its verify step is BatchRoofline.time itself."""
    from specsim.expected import chain_expected_tokens
    from specsim.magicdec import self_spec_speedup

    c = _batch_cost()
    tau = float(chain_expected_tokens(0.8, 3))
    want = tau * c.at_context(16000).time(8, 1) / (
        3 * c.at_context(256).time(8, 1) + c.at_context(16000).time(8, 4))
    assert self_spec_speedup(c, 8, 16000, budget=256, gamma=3, alpha=0.8) == pytest.approx(want)


def test_collective_latency_counts_calls_per_layer_and_fixed():
    from specsim.magicdec import collective_latency_s

    assert collective_latency_s(32, 10.0, per_layer=2, fixed=2) == pytest.approx(66 * 10e-6)
    assert collective_latency_s(32, 0.0) == 0.0
    with pytest.raises(AssertionError):
        collective_latency_s(32, -1.0)


def test_a_per_forward_cost_lowers_self_speculation_most_at_small_batch():
    """Each of the γ + 1 forwards of a step pays it, the baseline once per token: S falls, and falls most
    where the forwards are cheap (small batch). At 0 the formula is the plain one."""
    from specsim.magicdec import self_spec_speedup

    c = _batch_cost(tp=8)
    plain = [self_spec_speedup(c, b, 16000, 256, 3, 0.8) for b in (8, 128)]
    paid = [self_spec_speedup(c, b, 16000, 256, 3, 0.8, per_forward_s=1e-3) for b in (8, 128)]
    assert self_spec_speedup(c, 8, 16000, 256, 3, 0.8, per_forward_s=0.0) == plain[0]
    assert all(p < q for p, q in zip(paid, plain))
    assert paid[0] / plain[0] < paid[1] / plain[1]


def test_sparse_kv_self_speculation_gains_with_batch_on_long_contexts():
    """MagicDec's claim as a property of the model: a fixed draft KV budget makes S grow with B once the KV
    cache outweighs the weights; self-speculation cannot win at B = 1 when the draft reads every weight."""
    from specsim.magicdec import self_spec_speedup

    c = _batch_cost(tp=8)
    s = [self_spec_speedup(c, b, 16000, budget=256, gamma=3, alpha=0.8) for b in (1, 8, 32, 128)]
    assert all(np.diff(s) > 0)
    no_sparsity = self_spec_speedup(c, 1, 256, budget=256, gamma=3, alpha=0.8)
    assert no_sparsity < 1
