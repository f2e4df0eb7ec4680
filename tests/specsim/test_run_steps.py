"""The step of a finite generation (specsim.run_steps): the generation's cut last steps priced as drafted."""

from __future__ import annotations

import numpy as np
import pytest

from specsim.cost import CostModel, DraftCost, MeasuredCost
from specsim.expected import forwards_to_generate, room_visits
from specsim.run_steps import run_shares
from specsim.tree import Tree, cut


def _cost(ratio: float = 0.5) -> CostModel:
    return CostModel(MeasuredCost((1, 8), (1.0, 1.7)), DraftCost(ratio=ratio))


def test_room_visits_count_the_runs_forwards():
    law = np.array([0.0, 0.3, 0.25, 0.2, 0.15, 0.1])
    for n in (1, 5, 13, 48):
        u = room_visits(law, n)
        assert u[0] == 0 and u[n] == 1
        assert u.sum() == pytest.approx(forwards_to_generate(law, n))
    # every step emits 2: the steps start at 5, 3, 1 tokens left
    assert room_visits(np.array([0.0, 0.0, 1.0]), 5).tolist() == [0, 1, 0, 1, 0, 1]


def test_a_generation_shorter_than_the_tree_drafts_what_its_room_lets():
    """N = 3 and every draft accepted (τ 5 on a chain of 4): the one step starts with 3 tokens left. EAGLE
    drafts 2 levels there (the room's last token is the bonus), a draft model 3: half and three quarters of
    the full step's draft, and a verify of 3 and 4 nodes instead of 5."""
    chain, law = Tree.chain(4), np.array([0.0, 0, 0, 0, 0, 1.0])
    cost = _cost()
    eagle = run_shares(cost, chain, law, 3, 1)  # EAGLE leaves the room's last token to the bonus
    draft_model = run_shares(cost, chain, law, 3, 0)  # a draft model drafts the room itself
    assert eagle.draft == pytest.approx(0.5) and draft_model.draft == pytest.approx(0.75)
    t = cost.target.time
    assert eagle.verify == pytest.approx(t(3) / t(5)) and draft_model.verify == pytest.approx(t(4) / t(5))


def test_a_long_generation_cuts_only_its_last_steps():
    """N = 48, τ 5 every step: 10 steps, the last one (3 tokens left) cut to 2 levels of 4: draft 9.5 / 10."""
    chain, law = Tree.chain(4), np.array([0.0, 0, 0, 0, 0, 1.0])
    assert run_shares(_cost(), chain, law, 48, 1).draft == pytest.approx(9.5 / 10)
    assert run_shares(_cost(), chain, law, 10_000, 1).draft > 0.9999


def test_cut_keeps_the_levels_the_room_lets():
    tree = Tree.from_parents([-1, 0, 0, 1, 1, 3, 5])
    assert cut(tree, 0).size == 1 and cut(tree, 1).parents == (-1, 0, 0)
    assert cut(tree, 2).parents == (-1, 0, 0, 1, 1) and cut(tree, 9) is tree
    assert cut(tree, 3).ranks == tree.ranks[:6]


def test_a_dynamic_drafters_expansion_is_cut_at_the_room_too():
    """EAGLE-2 expands its k best nodes at every level whatever the kept tree's depth (CostModel.draft_tree):
    with 3 tokens left it expands 2 of its 4 levels."""
    from dataclasses import replace

    cost = replace(_cost(), draft_tree=Tree.beams(2, 4))
    kept, law = Tree.from_parents([-1, 0, 0, 1]), np.array([0.0, 0, 0, 1.0])
    assert run_shares(cost, kept, law, 3, 1).draft == pytest.approx(0.5)
