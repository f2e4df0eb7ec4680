"""Cost model: roofline regimes, measured tables, Leviathan's speedup, optimal γ."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsim import (
    CostModel,
    DraftCost,
    IIDAcceptance,
    MeasuredCost,
    ModelShape,
    PositionalAcceptance,
    Roofline,
    Tree,
    chain_expected_tokens,
    expected_tokens,
    optimal_gamma,
)
from specsim.config import HardwareConfig, MethodConfig, ModelConfig, RunConfig

A100 = HardwareConfig(name="a100", memory_bandwidth_gbs=2039.0, peak_tflops=312.0, memory_gb=80.0)
LLAMA7B = ModelConfig(
    name="llama2_7b", params=6.74e9, n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=32
)
FLAT = MeasuredCost((1,), (1.0,))  # t(n) = 1 for every n


def test_roofline_is_memory_bound_then_compute_bound():
    r = Roofline.from_config(A100, ModelShape.target(LLAMA7B), context_tokens=0)
    weights = LLAMA7B.params * LLAMA7B.bytes_per_param / (A100.memory_bandwidth_gbs * 1e9 * 0.8)
    assert r.time(1) == pytest.approx(A100.overhead_ms * 1e-3 + weights, rel=1e-3)
    assert r.time(8) == r.time(1)  # a few tokens ride along the weight reads
    slope = (r.time(4096) - r.time(2048)) / 2048
    attention = 4 * 32 * 4096 * (2048 + 4096)  # 4 · layers · hidden · (n1 + n2): Δ[n · n] / Δn
    assert slope == pytest.approx((2 * LLAMA7B.params + attention) / (312e12 * 0.6), rel=1e-6)
    n = np.array([1, 16, 64, 256, 1024])
    assert (np.diff(r.time(n)) >= 0).all()


def test_kv_reads_and_offloading():
    shape = ModelShape.target(LLAMA7B)
    short = Roofline.from_config(A100, shape, context_tokens=0)
    long = Roofline.from_config(A100, shape, context_tokens=4096)
    kv = 2 * 32 * 32 * 128 * 2 * 4096  # K and V, layers, kv heads, head dim, bytes, tokens
    assert long.time(1) - short.time(1) == pytest.approx(kv / (A100.memory_bandwidth_gbs * 1e9 * 0.8))
    off = HardwareConfig(name="l40_offload", memory_bandwidth_gbs=864.0, peak_tflops=181.0, offload=True,
                         pcie_gbs=25.0)
    r = Roofline.from_config(off, shape, context_tokens=512)
    assert r.time(1) >= shape.weight_bytes / 25e9
    assert r.time(512) == r.time(1)  # PCIe hides the compute of a 512-token tree
    with pytest.raises(AssertionError):
        Roofline.from_config(HardwareConfig(offload=True, pcie_gbs=0.0), shape, 0)


def test_measured_table_interpolates_linearly_and_extrapolates_the_last_slope():
    m = MeasuredCost.from_mapping({8: 2.0, 1: 1.0, 32: 5.0})
    assert m.time(1) == 1.0 and m.time(8) == 2.0 and m.time(32) == 5.0
    assert m.time(4) == pytest.approx(1.0 + 3 / 7)
    assert m.time(64) == pytest.approx(5.0 + 32 * 3 / 24)
    np.testing.assert_allclose(m.time(np.array([1, 20])), [1.0, 3.5])


@settings(max_examples=50, deadline=None)
@given(st.floats(0.0, 0.99), st.integers(1, 12), st.floats(0.0, 1.0))
def test_speedup_reduces_to_leviathan_for_a_chain_with_flat_t(alpha, gamma, rho):
    cost = CostModel(FLAT, DraftCost(ratio=rho))
    chain = Tree.chain(gamma)
    k = expected_tokens(chain, IIDAcceptance(alpha))
    assert cost.speedup(chain, k) == pytest.approx(chain_expected_tokens(alpha, gamma) / (1 + gamma * rho))


@settings(max_examples=40, deadline=None)
@given(st.floats(0.05, 0.95), st.floats(0.0, 0.5), st.floats(0.001, 0.5), st.sampled_from([0, 1]))
def test_speedup_falls_as_draft_cost_rises(alpha, rho, extra, kind):
    target = FLAT if kind == 0 else Roofline.from_config(A100, ModelShape.target(LLAMA7B), 512)
    cheap, dear = CostModel(target, DraftCost(ratio=rho)), CostModel(target, DraftCost(ratio=rho + extra))
    for tree in (Tree.chain(4), Tree.kary(2, 3)):
        k = expected_tokens(tree, IIDAcceptance(alpha))
        assert dear.speedup(tree, k) < cheap.speedup(tree, k)
    assert optimal_gamma(alpha, dear).speedup <= optimal_gamma(alpha, cheap).speedup


def test_optimal_gamma_is_the_argmax_and_moves_with_rho():
    for alpha in (0.5, 0.8, 0.9):
        for rho in (0.02, 0.1, 0.3):
            cost = CostModel(FLAT, DraftCost(ratio=rho))
            s = [chain_expected_tokens(alpha, g) / (1 + g * rho) for g in range(0, 33)]
            best = optimal_gamma(alpha, cost)
            assert best.gamma == int(np.argmax(s)) and best.speedup == pytest.approx(max(s))
    cheap = optimal_gamma(0.8, CostModel(FLAT, DraftCost(ratio=0.01)))
    dear = optimal_gamma(0.8, CostModel(FLAT, DraftCost(ratio=0.3)))
    assert cheap.gamma > dear.gamma


def test_draft_cost_modes():
    tree = Tree.kary(2, 3)  # levels of 1, 2, 4, 8 nodes: 3 draft steps over 1, 2, 4 nodes
    t1 = 2.0
    assert DraftCost(ratio=0.1).time(tree, t1) == pytest.approx(3 * 0.1 * t1)
    assert DraftCost(ratio=0.1, one_pass=True, fixed_ratio=0.05).time(tree, t1) == pytest.approx(0.15 * t1)
    assert DraftCost(ratio=0.1, fixed_ratio=0.5).time(Tree.chain(0), t1) == 0.0
    q = MeasuredCost((1, 2, 4), (1.0, 1.5, 2.5))
    assert DraftCost(model=q).time(tree, t1) == pytest.approx(1.0 + 1.5 + 2.5)
    assert DraftCost(ratio=0.1).per_depth(t1) == pytest.approx((0.2, 0.0))
    assert DraftCost(ratio=0.1, one_pass=True, fixed_ratio=0.05).per_depth(t1) == pytest.approx((0.0, 0.3))


def test_cost_model_from_config_prices_the_draft_model_on_its_roofline():
    cfg = RunConfig(hardware=A100, model=LLAMA7B)
    cfg.model.draft_params, cfg.model.draft_n_layers, cfg.model.draft_hidden_size = 68e6, 2, 768
    cfg.method = MethodConfig(name="vanilla", draft_cost="roofline")
    cost = CostModel.from_config(cfg)
    chain = Tree.chain(4)
    q = cost.draft.model
    assert q is not None and cost.draft_time(chain) == pytest.approx(4 * q.time(1))
    assert 0 < q.time(1) < cost.ar_time / 10  # a 68M draft is much cheaper than the 7B target
    cfg.method = MethodConfig(name="vanilla", draft_cost_ratio=0.05)
    ratio = CostModel.from_config(cfg)
    assert ratio.draft_time(chain) == pytest.approx(4 * 0.05 * ratio.ar_time)
    measured = CostModel.from_config(cfg, profile=FLAT)
    assert measured.ar_time == 1.0 and measured.target.source == "measured"


def test_staged_second_stage_divides_the_draft_steps():
    """Staged SD: the draft model settles tokens_per_forward levels per forward; its lookups stay fixed."""
    chain, t1 = Tree.chain(4), 2.0
    plain = DraftCost(ratio=0.1, fixed_ratio=0.02)
    staged = DraftCost(ratio=0.1, fixed_ratio=0.02, tokens_per_forward=2.0)
    assert plain.time(chain, t1) == pytest.approx(4 * 0.1 * t1 + 0.02 * t1)
    assert staged.time(chain, t1) == pytest.approx(2 * 0.1 * t1 + 0.02 * t1)
    assert staged.per_depth(t1) == pytest.approx((0.1, 0.04))
    cfg = RunConfig(method=MethodConfig(name="staged", draft_cost_ratio=0.1, draft_tokens_per_forward=2.0))
    assert CostModel.from_config(cfg, profile=FLAT).draft_time(chain) == pytest.approx(0.2)


def test_lookahead_verify_forward_carries_the_extra_tokens():
    """Lookahead: τ is priced on a chain, the verify forward on the chain plus the extra tokens; the root
    alone (nothing drafted) carries none."""
    linear = MeasuredCost((1, 100), (1.0, 100.0))  # t(n) = n
    cfg = RunConfig(method=MethodConfig(name="lookahead", verify_extra_tokens=51))
    cost = CostModel.from_config(cfg, profile=linear)
    assert cost.verify_tokens(Tree.chain(4)) == 56 and cost.verify_tokens(Tree.chain(0)) == 1
    assert cost.step_time(Tree.chain(4)) == pytest.approx(56.0)
    assert cost.speedup(Tree.chain(4), 2.0) == pytest.approx(2.0 / 56.0)


def test_a_measured_draft_level_is_priced_by_the_nodes_it_feeds():
    """With a per-width table, each level costs t_q(w) for w = the nodes of the level above that have
    children (the draft model is fed those only); a chain pays t_q(1) per level."""
    from specsim.cost import DraftCost, MeasuredCost
    from specsim.tree import Tree

    levels = MeasuredCost.from_mapping({1: 1.0, 2: 1.5, 4: 2.5})
    cost = DraftCost(ratio=0.3, model=levels, fed_width=True)
    tree = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # fed: 1, 2, 1 nodes
    assert cost.widths(tree) == [1, 2, 1]
    assert cost.time(tree, t1=1.0) == pytest.approx(1.0 + 1.5 + 1.0)
    assert cost.time(Tree.chain(3), t1=1.0) == pytest.approx(3.0)
    assert DraftCost(ratio=0.3).widths(tree) == [1, 3, 3]  # every node of the level (the roofline's count)


def test_a_dynamic_tree_drafts_every_level_it_expands_whatever_it_keeps():
    """EAGLE-2's drafter feeds the root, then its top_k best nodes at each of depth levels, and keeps
    total_tokens of all it drafted: the draft is priced on that expansion (Tree.beams), not on the kept
    tree, which may be shallower (the zoo: a kept tree 2 deep of a 3-level expansion)."""
    from specsim.config import TreeConfig, TreeKind

    assert Tree.beams(4, 3).parents == (-1, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8)
    assert Tree.beams(3, 1).parents == (-1, 0, 0, 0) and Tree.beams(2, 0).parents == (-1,)
    cfg = RunConfig(hardware=A100, model=LLAMA7B)
    cfg.method = MethodConfig(name="eagle2", draft_cost_ratio=0.1)
    cfg.tree = TreeConfig(name="dynamic", kind=TreeKind.dynamic, total_tokens=12, depth=3, top_k=4)
    q = MeasuredCost((1, 4), (1.0, 2.0))  # a level fed 1 node: 1 s, fed 4 nodes: 2 s
    kept = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1]])  # 2 deep
    for draft_levels, expected in ((None, 3 * 0.1), (q, 1.0 + 2.0 + 2.0)):
        cost = CostModel.from_config(cfg, profile=FLAT, draft_levels=draft_levels)
        assert cost.draft_time(kept) == pytest.approx(expected)  # 3 levels fed 1, 4, 4 nodes
        assert cost.draft_time(Tree.chain(0)) == 0.0  # nothing drafted
    cfg.tree = TreeConfig(name="kary", kind=TreeKind.kary, k=2, depth=2)
    assert CostModel.from_config(cfg, profile=FLAT).draft_time(kept) == pytest.approx(2 * 0.1)


def test_the_draft_pays_a_constant_per_step_and_a_cost_per_node():
    """F + the levels + b per drafted node (calibrated from the drafter's loop on several tree shapes): a
    2-level tree of 8 nodes pays the constant once and b eight times; the root alone drafts nothing."""
    levels = MeasuredCost.from_mapping({1: 0.2, 2: 0.3, 4: 0.5})
    cost = DraftCost(model=levels, fed_width=True, fixed_ratio=0.4, node_ratio=0.02)
    tree = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [1, 1], [2, 0]])  # fed 1, then 3
    t1 = 2.0
    assert cost.time(tree, t1) == pytest.approx(0.2 + float(levels.time(3)) + (0.4 + 0.02 * 8) * t1)
    assert cost.time(Tree.chain(1), t1) == pytest.approx(0.2 + (0.4 + 0.02) * t1)
    assert cost.time(Tree.chain(0), t1) == 0.0
    assert cost.per_node(t1) == pytest.approx(0.04)
    cfg = RunConfig(method=MethodConfig(name="eagle", draft_cost_ratio=0.1, draft_node_ratio=0.05))
    assert CostModel.from_config(cfg, profile=FLAT).draft_time(Tree.kary(8, 1)) == pytest.approx(0.1 + 0.4)


def test_sequoia_selection_pays_the_drafts_cost_per_node():
    """Sequoia's hardware-aware choice charges each budget its drafted nodes' cost, as the step is priced:
    the chosen tree's time per token is its step time over its k̄, and a dear node shrinks the tree."""
    from specsim.config import TreeConfig, TreeKind
    from specsim.trees import build_tree, sequoia_choice

    vector = [0.0, 0.7, 0.15, 0.05, 0.03, 0.02, 0.05]
    tree_cfg = TreeConfig(kind=TreeKind.sequoia, budgets=[1, 2, 4, 8, 16, 32, 64], max_levels=6)
    target = MeasuredCost((1, 64), (1.0, 1.3))
    sizes = []
    for node in (0.0, 0.03):
        cost = CostModel(target, DraftCost(ratio=0.05, fixed_ratio=0.1, node_ratio=node))
        choice = sequoia_choice(tree_cfg, PositionalAcceptance(tuple(vector)), cost)
        tree = build_tree(tree_cfg, PositionalAcceptance(tuple(vector)), cost)
        assert tree.parents == choice.tree.parents
        k = expected_tokens(tree, vector)
        assert choice.time_per_token == pytest.approx(cost.step_time(tree) / k)
        sizes.append(tree.size)
    assert sizes[1] < sizes[0]
