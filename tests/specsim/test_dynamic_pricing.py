"""A dynamic (EAGLE-2) tree priced as the trees its drafter kept (specsim.trees.recorded_law): the frequency-
weighted mixture of each kept tree's law of τ under the positional (depth, rank) model, checked by hand."""

import numpy as np
import pytest

from specsim.acceptance import DepthVectorAcceptance
from specsim.expected import expected_tokens
from specsim.tree import Tree
from specsim.trees import RecordedTrees, kept_acceptance, recorded_law

MODEL = DepthVectorAcceptance(((0.0, 0.5, 0.2, 0.3), (0.0, 0.4, 0.1, 0.5)))  # [0, p_1, p_2, p_none] per depth
CHAIN = Tree.from_paths([[0], [0, 0]])  # q's top child, then its top child
WIDE = Tree.from_paths([[0], [1], [1, 0]])  # q's two best children, the second one expanded


def test_recorded_trees_are_priced_as_their_mixture_by_hand():
    # CHAIN: P(τ=1) = 1 − .5, P(τ=2) = .5 (1 − .4), P(τ=3) = .5 · .4
    # WIDE:  P(τ=1) = 1 − .5 − .2, P(τ=3) = .2 · .4, P(τ=2) = .5 + .2 (1 − .4)
    chain, wide = np.array([0, 0.5, 0.3, 0.2]), np.array([0, 0.3, 0.62, 0.08])
    law = recorded_law({CHAIN: 3, WIDE: 1}, MODEL)
    np.testing.assert_allclose(law, (3 * chain + wide) / 4)
    tau = float(np.dot(np.arange(law.size), law))
    assert tau == pytest.approx((3 * (1 + 0.5 + 0.5 * 0.4) + (1 + 0.5 + 0.2 + 0.2 * 0.4)) / 4)
    assert tau == pytest.approx((3 * expected_tokens(CHAIN, MODEL) + expected_tokens(WIDE, MODEL)) / 4)


def test_one_recorded_tree_is_that_tree_and_depths_pad():
    root = Tree((-1,))
    np.testing.assert_allclose(recorded_law({root: 2}, MODEL), [0, 1])
    law = recorded_law({root: 1, CHAIN: 1}, MODEL)  # the root alone: τ = 1, padded to CHAIN's depth
    np.testing.assert_allclose(law, [0, 0.75, 0.15, 0.1])
    assert law.sum() == pytest.approx(1)
    with pytest.raises(AssertionError):
        recorded_law({}, MODEL)


def test_kept_acceptance_is_the_ratio_per_depth_and_rank_and_prices_recorded_trees():
    tried = np.array([[10, 4], [5, 0]])
    accepted = np.array([[6, 1], [2, 0]])
    kept = kept_acceptance(tried, accepted)
    np.testing.assert_allclose(kept.vectors, [[0, 0.6, 0.25, 0.15], [0, 0.4, 0.0, 0.6]])
    # conditional rates of siblings tried in different steps may sum past 1: scaled to 1
    np.testing.assert_allclose(kept_acceptance([[2, 2]], [[2, 1]]).vectors, [[0, 2 / 3, 1 / 3, 0]])
    with pytest.raises(AssertionError):
        kept_acceptance([[1, 1]], [[2, 0]])
    # RecordedTrees carries its kept nodes' acceptance: recorded_law prices with it, not with the argument
    rec = RecordedTrees({CHAIN: 3, WIDE: 1}, kept)
    assert dict(rec) == {CHAIN: 3, WIDE: 1} and len(rec) == 2
    np.testing.assert_allclose(recorded_law(rec, MODEL), recorded_law({CHAIN: 3, WIDE: 1}, kept))
    assert not np.allclose(recorded_law(rec, MODEL), recorded_law({CHAIN: 3, WIDE: 1}, MODEL))
    plain = recorded_law({CHAIN: 1}, MODEL)
    np.testing.assert_allclose(recorded_law(RecordedTrees({CHAIN: 1}), MODEL), plain)


def test_the_recording_loops_own_law_prices_tau_where_recorded():
    """Where the record carries the loop's law on its steady steps, τ is that law, not the kept trees priced
    node by node (whose (depth, rank) rates multiply as if independent)."""
    kept = kept_acceptance(np.array([[10, 4], [5, 0]]), np.array([[6, 1], [2, 0]]))
    loop = (0.0, 0.2, 0.3, 0.5)
    rec = RecordedTrees({CHAIN: 3, WIDE: 1}, kept, loop=loop)
    np.testing.assert_allclose(recorded_law(rec, MODEL), loop)
    assert not np.allclose(recorded_law(RecordedTrees({CHAIN: 3, WIDE: 1}, kept), MODEL), loop)
