"""Sequoia DP: brute force over all trees, the reference's loops, monotonicity, and the published demo."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specsim
from specsim import Tree, expected_tokens, sequoia

# Sequoia's published demo: its acceptance vector, configuration and the tree its optimiser chose
DEMO = Path(__file__).parent / "data" / "sequoia_demo.json"
MAX_M, MAX_L = 8, 5


def _plane_trees(n: int):
    """Every rooted ordered tree with n nodes, as nested tuples of children (rank order)."""
    if n == 1:
        yield ()
        return
    yield from _forests(n - 1)


def _forests(n: int):
    if n == 0:
        yield ()
        return
    for k in range(1, n + 1):
        for first in _plane_trees(k):
            for rest in _forests(n - k):
                yield (first, *rest)


def _levels(t) -> int:
    return 1 + max((_levels(c) for c in t), default=0)


def _width(t) -> int:
    return max([len(t), *(_width(c) for c in t)])


def _value(t, p) -> float:
    return 1.0 + sum(p[i + 1] * _value(c, p) for i, c in enumerate(t))


def _to_tree(t) -> Tree:
    parents, queue = [-1], [(t, 0)]
    for sub, node in queue:  # breadth-first, grows while iterated
        for c in sub:
            parents.append(node)
            queue.append((c, len(parents) - 1))
    return Tree.from_parents(parents)


@pytest.fixture(scope="module")
def all_trees():
    return {m: [(t, _levels(t), _width(t)) for t in _plane_trees(m)] for m in range(1, MAX_M + 1)}


@st.composite
def vectors(draw, max_width=4):
    """[0, p_1, …, p_W, p_none] with exact zeros allowed (the reference's NaN corner)."""
    w = draw(st.integers(1, max_width))
    raw = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.01, 1.0)), min_size=w + 1, max_size=w + 1))
    raw = np.asarray(raw) + (0 if sum(raw) > 0 else 1)
    return np.concatenate([[0.0], raw / raw.sum()])


@settings(max_examples=25, deadline=None)
@given(vectors())
def test_dp_equals_brute_force_over_all_trees(all_trees, v):
    W = len(v) - 2
    table = sequoia.solve(v, MAX_M, MAX_L)
    for m in range(1, MAX_M + 1):
        for l in range(1, MAX_L + 1):
            fit = [_value(t, v) for t, lev, wid in all_trees[m] if lev <= l and wid <= W]
            if not fit:
                assert table.best[m, l] == -np.inf
                continue
            assert table.best[m, l] == pytest.approx(max(fit), rel=1e-5)
            tree = table.tree(m, l)
            assert tree.size == m and tree.depth + 1 <= l and tree.width <= W
            assert expected_tokens(tree, v) == pytest.approx(max(fit), rel=1e-5)


def test_enumeration_matches_catalan_and_tree_values(all_trees):
    catalan = [1, 1, 2, 5, 14, 42, 132, 429]
    assert [len(all_trees[m]) for m in range(1, MAX_M + 1)] == catalan
    v = np.array([0, 0.5, 0.2, 0.1, 0.2])
    for t, _, wid in all_trees[5]:
        if wid <= 3:
            assert expected_tokens(_to_tree(t), v) == pytest.approx(_value(t, v))


@settings(max_examples=10, deadline=None)
@given(vectors(max_width=5))
def test_vectorised_dp_is_bitwise_the_loop_recursion(v):
    assert np.array_equal(sequoia.solve(v, 9, 4).values, sequoia.solve_naive(v, 9, 4))


@settings(max_examples=20, deadline=None)
@given(vectors(max_width=6))
def test_more_budget_or_depth_never_lowers_the_optimum(v):
    best = sequoia.solve(v, 40, 6).best  # (41, 7)
    ok = np.isfinite(best)
    both_m = ok[1:] & ok[:-1]
    assert (best[1:][both_m] >= best[:-1][both_m] - 1e-6).all()
    both_l = ok[:, 1:] & ok[:, :-1]
    assert (best[:, 1:][both_l] >= best[:, :-1][both_l] - 1e-6).all()
    assert (ok[:, 1:] >= ok[:, :-1]).all()  # a deeper limit never makes a size infeasible


@settings(max_examples=15, deadline=None)
@given(vectors(max_width=5), st.integers(1, 20), st.integers(2, 6))
def test_optimal_tree_contract(v, budget, max_levels):
    W = len(v) - 2
    capacity = sum(W**i for i in range(max_levels))
    if budget > capacity:
        with pytest.raises(ValueError, match="no tree"):
            sequoia.optimal_tree(v, budget, max_levels)
        return
    res = sequoia.optimal_tree(v, budget, max_levels)
    assert res.tree.size == budget and res.levels == res.tree.depth + 1 <= max_levels
    assert res.expected_tokens == pytest.approx(expected_tokens(res.tree, v))
    if budget > 1:
        smaller = sequoia.optimal_tree(v, budget - 1, max_levels)
        assert res.expected_tokens >= smaller.expected_tokens - 1e-6


def test_reproduces_the_reference_demo():
    demo = json.loads(DEMO.read_text())
    v, cfg, ref = demo["acceptance_rate_vector"], demo["demo_config"], demo["demo_tree"]
    choice = specsim.sequoia.select(
        v, cfg["max_depth"], cfg["valid_budget"], cfg["target_time"], cfg["draft_time"]
    )
    ref_tree = Tree.from_successors(ref["Successors"])
    assert choice.budget == ref["size"] and choice.levels == max(ref["depth"]) + 1
    assert choice.tree == ref_tree
    assert list(choice.tree.depths) == ref["depth"]
    assert choice.tree.ancestor_mask.astype(int).tolist() == ref["mask"]
    # the demo tree is a chain, so k̄ is the chain closed form in p_1, and the reference's objective
    assert choice.expected_tokens == pytest.approx(specsim.chain_expected_tokens(v[1], choice.budget - 1))
    i = cfg["valid_budget"].index(choice.budget)
    time = (choice.levels * cfg["draft_time"] + cfg["target_time"][i]) / choice.expected_tokens
    assert choice.time_per_token == pytest.approx(time, rel=1e-6)
    assert choice.speedup == pytest.approx(cfg["target_time"][0] / time, rel=1e-6)


def test_select_is_the_brute_force_minimum_for_either_step_charge():
    v = np.array([0, 0.6, 0.15, 0.08, 0.05, 0.12])
    budgets, times, draft = [1, 2, 4, 8, 16], [1.0, 1.0, 1.05, 1.1, 1.4], 0.08
    for root_step in (True, False):
        best = sequoia.solve(v, 16, 8).best
        grid = [
            ((levels - (not root_step)) * draft + t) / best[b, levels]
            for b, t in zip(budgets, times) for levels in range(1, 9) if np.isfinite(best[b, levels])
        ]
        choice = sequoia.select(v, 8, budgets, times, draft, root_step=root_step)
        assert choice.time_per_token == pytest.approx(min(grid), rel=1e-6)
        steps = choice.levels - (not root_step)
        assert choice.time_per_token == pytest.approx(
            (steps * draft + times[budgets.index(choice.budget)]) / choice.expected_tokens, rel=1e-5
        )


def test_zero_first_rank_stays_well_defined():
    """p_1 = 0 makes the reference compute 0 · (−inf) = NaN; here an impossible subtree stays impossible."""
    v = np.array([0, 0.0, 0.6, 0.3, 0.1])
    table = sequoia.solve(v, 12, 4)
    assert not np.isnan(table.values).any()
    tree = table.tree(12, 4)
    assert tree.size == 12 and expected_tokens(tree, v) == pytest.approx(table.best[12, 4], rel=1e-6)
