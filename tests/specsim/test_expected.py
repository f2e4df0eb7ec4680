"""Closed forms of k̄ and of the law of τ, checked against each other and against Monte Carlo."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsim import (
    DepthVectorAcceptance,
    IIDAcceptance,
    PositionalAcceptance,
    PowerAcceptance,
    TableAcceptance,
    Tree,
    accepted_length_law,
    chain_expected_tokens,
    empirical_law,
    expected_tokens,
    simulate_tau,
)
from specsim.acceptance import from_config
from specsim.config import AcceptanceConfig, AcceptanceKind

alphas = st.floats(0.0, 0.99)
gammas = st.integers(0, 12)

DEMO_LIKE = (0.0, 0.55, 0.15, 0.08, 0.05, 0.03, 0.14)  # [0, p_1..p_5, p_none]

MODELS = [
    IIDAcceptance(0.7),
    PowerAcceptance(0.85, 0.9),
    TableAcceptance((0.8, 0.6, 0.5)),
    PositionalAcceptance(DEMO_LIKE),
    DepthVectorAcceptance((DEMO_LIKE, (0.0, 0.3, 0.2, 0.1, 0.4), (0.0, 0.2, 0.8))),  # widths 5, 3, 1
]
TREES = [
    Tree.chain(5),
    Tree.kary(2, 3),
    Tree.from_paths([[0], [1], [0, 0], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3, 0]]),
    Tree.from_paths([[0, 0], [2], [0, 3, 1]]),  # rank gaps: ranks 1 and 0→1, 0→2 absent
]


@given(alphas, gammas)
def test_chain_closed_form_equals_tree_sum(alpha, gamma):
    tree_value = expected_tokens(Tree.chain(gamma), IIDAcceptance(alpha))
    assert chain_expected_tokens(alpha, gamma) == pytest.approx(tree_value, rel=1e-9)
    assert chain_expected_tokens(alpha, gamma) == pytest.approx(sum(alpha**k for k in range(gamma + 1)))


@given(gammas)
def test_chain_closed_form_limit_alpha_to_one(gamma):
    assert chain_expected_tokens(1.0, gamma) == gamma + 1
    assert chain_expected_tokens(1.0 - 1e-7, gamma) == pytest.approx(gamma + 1, rel=1e-5)
    arr = chain_expected_tokens(np.array([0.5, 1.0]), gamma)
    assert arr[1] == gamma + 1 and arr[0] == pytest.approx(2 - 0.5**gamma)


@given(alphas, gammas)
def test_chain_law_is_truncated_geometric(alpha, gamma):
    pmf = accepted_length_law(Tree.chain(gamma), IIDAcceptance(alpha))
    want = [0.0] + [alpha ** (k - 1) * (1 - alpha) for k in range(1, gamma + 1)] + [alpha**gamma]
    np.testing.assert_allclose(pmf, want, atol=1e-12)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.kind)
@pytest.mark.parametrize("tree", TREES, ids=repr)
def test_law_sums_to_one_and_its_mean_is_k_bar(model, tree):
    pmf = accepted_length_law(tree, model)
    assert pmf.sum() == pytest.approx(1.0) and (pmf >= 0).all() and pmf[0] == 0
    assert (pmf * np.arange(len(pmf))).sum() == pytest.approx(expected_tokens(tree, model))


def test_raw_vector_is_the_positional_model():
    t = TREES[2]
    assert expected_tokens(t, list(DEMO_LIKE)) == expected_tokens(t, PositionalAcceptance(DEMO_LIKE))
    p = DEMO_LIKE
    # root + 4 root children + (0,0),(0,1),(0,2) + (1,0),(3,0) + (0,0,0), by hand from the layout
    by_hand = 1 + p[1] + p[2] + p[3] + p[4] + p[1] * (p[1] + p[2] + p[3]) + p[2] * p[1] + p[4] * p[1]
    by_hand += p[1] * p[1] * p[1]
    assert expected_tokens(t, np.asarray(p)) == pytest.approx(by_hand)


def _standard_error(pmf: np.ndarray, n: int) -> float:
    """Standard error of the mean of n draws of τ, from the exact law (sample std can be 0)."""
    k = np.arange(len(pmf))
    return float(np.sqrt((pmf * k**2).sum() - (pmf * k).sum() ** 2) / np.sqrt(n))


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.kind)
@pytest.mark.parametrize("tree", TREES, ids=repr)
def test_monte_carlo_agrees_with_closed_forms(model, tree):
    n = 20_000
    tau = simulate_tau(tree, model, n, np.random.default_rng(1))
    pmf = accepted_length_law(tree, model)
    assert abs(tau.mean() - expected_tokens(tree, model)) < 5 * _standard_error(pmf, n)
    freq = empirical_law(tau, len(pmf) - 1)
    tol = 5 * np.sqrt(pmf * (1 - pmf) / n) + 2e-3
    assert (np.abs(freq - pmf) < tol).all(), (freq, pmf)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=14), alphas, st.integers(0, 2**31))
def test_monte_carlo_on_random_trees(raw, alpha, seed):
    parents = [-1] + [r % i for i, r in enumerate(raw, start=1)]
    tree = Tree.from_parents(parents)
    n = 6_000
    model = IIDAcceptance(alpha)
    tau = simulate_tau(tree, model, n, np.random.default_rng(seed))
    se = _standard_error(accepted_length_law(tree, model), n)
    assert abs(tau.mean() - expected_tokens(tree, model)) < 5 * se + 1e-12


def test_iid_rank_marginals_and_derived_vector():
    a = 0.6
    m = IIDAcceptance(a)
    np.testing.assert_allclose(m.prob(np.ones(4, int), np.arange(4)), [a * (1 - a) ** r for r in range(4)])
    v = m.positional_vector(5)
    assert v[0] == 0 and v[1:].sum() == pytest.approx(1.0) and v[-1] == pytest.approx((1 - a) ** 5)
    power = PowerAcceptance(0.8, 0.5)
    np.testing.assert_allclose(power.prob(np.arange(1, 4), np.zeros(3, int)), [0.8, 0.4, 0.2])
    table = TableAcceptance((0.9, 0.5))
    np.testing.assert_allclose(table.prob(np.arange(1, 5), np.zeros(4, int)), [0.9, 0.5, 0.5, 0.5])


def test_from_config_builds_each_kind():
    assert from_config(AcceptanceConfig(kind=AcceptanceKind.iid, alpha=0.5)) == IIDAcceptance(0.5)
    assert from_config(AcceptanceConfig(kind=AcceptanceKind.power, alpha=0.5, decay=0.9)) == PowerAcceptance(
        0.5, 0.9
    )
    assert from_config(AcceptanceConfig(kind=AcceptanceKind.table, by_depth=[0.5, 0.4])).kind == "table"
    vec = from_config(AcceptanceConfig(kind=AcceptanceKind.vector, vector=list(DEMO_LIKE)))
    assert vec == PositionalAcceptance(DEMO_LIKE) and vec.width == 5


def test_depth_vectors_are_per_depth_positional_models():
    """Depth d reads its own vector (deeper depths the last one); equal vectors = the positional model."""
    head2 = (0.0, 0.3, 0.2, 0.5)
    m = DepthVectorAcceptance((DEMO_LIKE, head2))
    np.testing.assert_allclose(m.prob(np.array([1, 1, 2, 2, 3, 2]), np.array([0, 1, 0, 1, 1, 2])),
                               [0.55, 0.15, 0.3, 0.2, 0.2, 0.0])
    np.testing.assert_allclose(m.positional_vector(), DEMO_LIKE)  # depth 1: what Sequoia's DP is given
    same = DepthVectorAcceptance((DEMO_LIKE, DEMO_LIKE, DEMO_LIKE))
    for tree in TREES:
        positional = expected_tokens(tree, PositionalAcceptance(DEMO_LIKE))
        assert expected_tokens(tree, same) == pytest.approx(positional)
        assert expected_tokens(tree, m) < expected_tokens(tree, PositionalAcceptance(DEMO_LIKE))
    cfg = AcceptanceConfig(kind=AcceptanceKind.depth_vector, by_depth_vectors=[list(DEMO_LIKE), list(head2)])
    assert from_config(cfg) == m


# ---- a generation of N tokens: the last step's cut ---------------------------------------------------------
def test_forwards_to_generate_a_fixed_step_is_the_ceiling():
    from specsim.expected import forwards_to_generate, tokens_per_forward

    for k in (1, 3, 5):
        law = np.zeros(k + 1)
        law[k] = 1.0
        for n in (1, 7, 48):
            assert forwards_to_generate(law, n) == pytest.approx(-(-n // k))
    assert tokens_per_forward(np.array([0.0, 1.0]), 48) == pytest.approx(1.0)


def test_forwards_to_generate_matches_monte_carlo_and_tends_to_tau():
    from specsim.expected import forwards_to_generate, tokens_per_forward

    law = np.array([0.0, 0.3, 0.2, 0.2, 0.1, 0.2])
    tau = float(np.dot(np.arange(law.size), law))
    rng = np.random.default_rng(0)
    steps = rng.choice(law.size, p=law, size=(20000, 48))  # 48 steps always reach 48 tokens
    forwards = (np.cumsum(steps, axis=1) < 48).sum(axis=1) + 1
    assert forwards_to_generate(law, 48) == pytest.approx(forwards.mean(), rel=0.01)
    assert tokens_per_forward(law, 48) < tau  # the cut wastes the last step's extra tokens
    assert tokens_per_forward(law, 20000) == pytest.approx(tau, rel=1e-3)
    assert tokens_per_forward(law, 0) == pytest.approx(tau)


def test_forwards_law_and_the_static_batch_match_monte_carlo():
    """The law of the forwards a row needs for 48 tokens (its mean is forwards_to_generate), and a static
    batch's forwards: the max over its rows (a batch steps until its slowest row is done)."""
    from specsim.expected import batch_forwards, forwards_law, forwards_to_generate

    law = np.array([0.0, 0.3, 0.2, 0.2, 0.1, 0.2])
    pmf = forwards_law(law, 48)
    assert pmf.sum() == pytest.approx(1.0) and pmf[0] == 0.0
    assert float(np.dot(np.arange(pmf.size), pmf)) == pytest.approx(forwards_to_generate(law, 48))
    assert batch_forwards(law, 48, 1) == pytest.approx(forwards_to_generate(law, 48))
    rng = np.random.default_rng(1)
    steps = rng.choice(law.size, p=law, size=(16000, 48))
    forwards = ((np.cumsum(steps, axis=1) < 48).sum(axis=1) + 1).reshape(-1, 8)  # 2000 batches of 8 rows
    assert np.bincount(forwards.ravel(), minlength=49)[:49] / forwards.size == pytest.approx(pmf, abs=0.01)
    assert batch_forwards(law, 48, 8) == pytest.approx(forwards.max(axis=1).mean(), rel=0.01)
    by_batch = [batch_forwards(law, 48, b) for b in (1, 2, 8, 32)]
    assert all(a < b for a, b in zip(by_batch, by_batch[1:])) and by_batch[-1] <= 48
    one = np.array([0.0, 0.0, 1.0])  # a fixed step: every row needs the same forwards, whatever B
    assert batch_forwards(one, 48, 32) == pytest.approx(24.0)
