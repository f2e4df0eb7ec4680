"""build_tree for every tree kind, simulate(), and Sequoia's hardware finding (offloading wants big trees)."""

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

import specsim
from specsim import (
    CostModel,
    DraftCost,
    IIDAcceptance,
    MeasuredCost,
    PowerAcceptance,
    Tree,
    build_tree,
    expected_tokens,
    sequoia,
    simulate,
)
from specsim.config import (
    AcceptanceConfig,
    AcceptanceKind,
    HardwareConfig,
    MethodConfig,
    ModelConfig,
    RunConfig,
    TreeConfig,
    TreeKind,
    validate,
)

# datasheet numbers of conf/hardware/a100_80gb.yaml and l40_offload.yaml
A100 = HardwareConfig(name="a100", memory_bandwidth_gbs=2039.0, peak_tflops=312.0, memory_gb=80.0)
L40_OFFLOAD = HardwareConfig(
    name="l40_offload", memory_bandwidth_gbs=864.0, peak_tflops=181.0, memory_gb=48.0, offload=True,
    pcie_gbs=25.0,
)
ZOO = ModelConfig()  # 13.8M params, bf16
LLAMA7B = ModelConfig(
    name="llama2_7b", params=6.74e9, n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=32,
    intermediate_size=11008, vocab_size=32000, draft_params=68e6, draft_n_layers=2, draft_hidden_size=768,
)
SEQUOIA_VECTOR = [0.0, 0.634, 0.108, 0.057, 0.022, 0.019, 0.015, 0.0045, 0.003, 0.012, 0.0045, 0.0075, 0.0]
SEQUOIA_VECTOR[-1] = 1 - sum(SEQUOIA_VECTOR)
MEDUSA = MethodConfig(name="medusa", drafter="medusa", draft_fixed_ratio=0.09, draft_steps="one",
                      acceptance=AcceptanceConfig(kind=AcceptanceKind.power, alpha=0.6, decay=0.8))
SEQUOIA = MethodConfig(name="sequoia", drafter="draft_model", draft_cost="roofline",
                       acceptance=AcceptanceConfig(kind=AcceptanceKind.vector, vector=SEQUOIA_VECTOR))
SEQUOIA_TREE = TreeConfig(
    name="sequoia", kind=TreeKind.sequoia, budgets=[2**i for i in range(10)], max_levels=16
)


def _cfg(method, hardware, model, tree=SEQUOIA_TREE) -> RunConfig:
    return validate(RunConfig(method=method, hardware=hardware, model=model, tree=tree))


@pytest.mark.parametrize("model", [ZOO, LLAMA7B], ids=lambda m: m.name)
@pytest.mark.parametrize("method", [MEDUSA, SEQUOIA], ids=lambda m: m.name)
def test_offloading_picks_a_bigger_tree_and_a_higher_speedup(method, model):
    on_gpu = simulate(_cfg(method, A100, model))
    offload = simulate(_cfg(method, L40_OFFLOAD, model))
    assert offload.tree_size > on_gpu.tree_size
    assert offload.predicted_speedup > on_gpu.predicted_speedup
    assert offload.t_ar_s > 10 * on_gpu.t_ar_s  # PCIe streaming dominates every forward
    assert offload.t_verify_s == pytest.approx(offload.t_ar_s, rel=0.01)  # flat t(n): size is free


@pytest.mark.parametrize(("slope", "ratio"), [(0.0, 0.4), (0.03, 0.4), (0.03, 0.8), (0.01, 0.05)])
def test_sequoia_tree_is_the_cheapest_per_token_at_the_simulators_own_price(slope, ratio):
    """Oracle: every (budget, levels) of the grid, its DP-optimal tree priced by the simulator itself
    (CostModel.step_time / k̄, one draft step per level below the root): the chosen tree is the cheapest.
    The selection used to charge one more draft step than this price and picked other trees (here: deeper
    ones, or a drafted tree slower than plain decoding). t(n) = 1 + slope·(n − 1), draft step ratio·t(1)."""
    method = MethodConfig(name="vanilla", drafter="draft_model", draft_cost_ratio=ratio,
                          acceptance=SEQUOIA.acceptance)
    tree_cfg = TreeConfig(name="sequoia", kind=TreeKind.sequoia, budgets=[1, 2, 4, 8, 16, 32, 64],
                          max_levels=12)
    cfg = _cfg(method, A100, LLAMA7B, tree_cfg)
    profile = MeasuredCost((1, 64), (1.0, 1.0 + 63 * slope))
    cost = CostModel.from_config(cfg, profile)
    chosen = simulate(cfg, profile=profile)
    table = sequoia.solve(SEQUOIA_VECTOR, 64, 12)
    prices = [cost.step_time(t) / expected_tokens(t, SEQUOIA_VECTOR)
              for b in tree_cfg.budgets for levels in range(1, 13) if np.isfinite(table.best[b, levels])
              for t in [table.tree(b, levels)]]
    assert chosen.t_step_s / chosen.predicted_tau == pytest.approx(min(prices), rel=1e-5)
    assert chosen.tree_size in tree_cfg.budgets and chosen.tree_levels <= 12


@pytest.mark.parametrize("kind", list(TreeKind))
def test_simulate_every_tree_kind(kind):
    tree_cfg = TreeConfig(name=kind.value, kind=kind, paths=[[0], [1], [0, 0], [0, 1], [0, 0, 0]],
                          budgets=[1, 4, 16, 64], total_tokens=20, depth=4, top_k=4)
    method = MethodConfig(name="vanilla", drafter="draft_model", draft_cost_ratio=0.05)
    p = simulate(validate(RunConfig(method=method, tree=tree_cfg, hardware=A100)))
    d = p.to_dict()
    json.dumps(d)  # JSON-able
    assert all(not isinstance(v, dict) for v in d.values())  # flat
    for key in ("task", "method", "tree", "hardware", "workload", "model", "seed", "predicted_tau",
                "predicted_speedup", "tree_size", "tree_depth"):
        assert key in d
    assert sum(p.tau_law) == pytest.approx(1.0)
    assert p.t_step_s == pytest.approx(p.t_draft_s + p.t_verify_s)
    # a generation of max_new_tokens: no more tokens per forward than τ, the speedup scaled alike
    assert 1.0 <= p.tokens_per_forward <= p.predicted_tau + 1e-12
    # ... over the mean of its steps, the cut last ones drafting and verifying less (specsim.run_steps)
    assert p.t_draft_run_s <= p.t_draft_s + 1e-15 and p.t_verify_run_s <= p.t_verify_s + 1e-15
    ratio = p.tokens_per_forward / p.predicted_tau * p.t_step_s / (p.t_draft_run_s + p.t_verify_run_s)
    assert p.predicted_decode_speedup / p.predicted_speedup == pytest.approx(ratio)
    if kind == TreeKind.none:
        assert p.predicted_tau == 1.0 and p.predicted_speedup == pytest.approx(1.0) and p.tree_size == 1
    if kind == TreeKind.chain:
        assert p.predicted_tau == pytest.approx(specsim.chain_expected_tokens(0.7, tree_cfg.gamma))
    if kind == TreeKind.dynamic:
        assert p.tree_size == tree_cfg.total_tokens + 1 and p.tree_depth <= tree_cfg.depth
        assert p.tree_width <= tree_cfg.top_k


@pytest.mark.parametrize(("total_tokens", "depth", "top_k"), [(6, 3, 2), (5, 2, 3), (6, 6, 1)])
def test_dynamic_tree_is_the_best_of_its_size(total_tokens, depth, top_k):
    """Oracle: brute force over every tree of total_tokens + 1 nodes (each node's parent any earlier node),
    at most ``depth`` edges deep and ``top_k`` children per node, scored by the positional vector; the
    dynamic preset's tree reaches the best k̄. top_k 1 is the chain: k̄ = (1 − p^(n+1)) / (1 − p) by hand."""
    tree_cfg = TreeConfig(kind=TreeKind.dynamic, total_tokens=total_tokens, depth=depth, top_k=top_k)
    model = PowerAcceptance(0.8, 0.9)
    tree = build_tree(tree_cfg, model, CostModel(MeasuredCost((1,), (1.0,)), DraftCost()))
    vector = specsim.acceptance_vector(model, top_k)
    n = total_tokens + 1
    best = 0.0
    for parents in itertools.product(*[range(i) for i in range(1, n)]):
        t = Tree.from_parents((-1, *parents))
        if t.depth <= depth and t.width <= top_k:
            best = max(best, expected_tokens(t, vector))
    assert tree.size == n and tree.depth <= depth and tree.width <= top_k
    assert expected_tokens(tree, vector) == pytest.approx(best, rel=1e-6)
    if top_k == 1:
        p1 = vector[1]
        assert best == pytest.approx((1 - p1 ** (n)) / (1 - p1), rel=1e-9)


def test_simulate_uses_a_given_tree_and_a_measured_profile():
    cfg = _cfg(SEQUOIA, A100, ZOO)
    tree = Tree.kary(2, 2)
    profile = MeasuredCost((1, 8, 64), (1e-3, 1.2e-3, 4e-3))
    p = simulate(cfg, profile=profile, tree=tree)
    assert p.tree_size == tree.size and p.cost_source == "measured"
    assert p.t_ar_s == 1e-3 and p.t_verify_s == pytest.approx(float(profile.time(7)))
    assert p.predicted_tau == pytest.approx(expected_tokens(tree, SEQUOIA_VECTOR))


def test_iid_acceptance_derives_the_sequoia_vector():
    v = specsim.acceptance_vector(IIDAcceptance(0.7))
    assert v[0] == 0 and v[1] == pytest.approx(0.7) and v[1:].sum() == pytest.approx(1.0)
    assert np.all(np.diff(v[1:-1]) < 0)


def test_specsim_imports_no_torch_and_no_hydra():
    code = "import sys, specsim, specsim.predict; print(sorted({'torch', 'hydra'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_method_without_a_drafter_predicts_plain_decoding(cli, tmp_path, run_config):
    """method=autoregressive with a tree preset: nothing is drafted, so k̄ = 1 and the speedup is 1 (the
    tree preset used to be priced as if drafted: tree=chain predicted 2.28x)."""
    proc = cli(["task=simulate", "method=autoregressive", "tree=chain", f"hydra.run.dir={tmp_path / 'run'}"],
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (m["tree"], m["predicted_tau"], m["predicted_speedup"], m["tree_size"]) == ("chain", 1.0, 1.0, 1)
    for tree in ("kary", "medusa", "sequoia"):
        p = simulate(run_config("task=simulate", "method=autoregressive", f"tree={tree}"))
        assert (p.predicted_tau, p.predicted_speedup, p.tree_size, p.t_draft_s) == (1.0, 1.0, 1, 0.0)
