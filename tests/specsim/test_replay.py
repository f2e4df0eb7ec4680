"""τ's law at temperature 0 from the greedy loop replayed on recorded trajectories (specsim.replay): exact
cases where the positional vector's independence misprices it, agreement with the vector where positions are
independent, and the steps the trajectory's end would cut."""

from __future__ import annotations

import numpy as np
import pytest

from specsim.acceptance import PositionalAcceptance
from specsim.expected import accepted_length_law, expected_tokens
from specsim.replay import (
    RankRuns,
    accepted_drafts,
    flips_integrated,
    hit_vectors,
    lengths_law,
    loop_law,
    steady_lengths,
)
from specsim.tau_error import steady_steps
from specsim.tree import Tree


def _tau(law: np.ndarray) -> float:
    return float(np.dot(np.arange(law.size), law))


def test_runs_of_hits_are_priced_as_the_loop_walks_them():
    """Three hits then a miss, over and over: a chain of 4 rooted at a run's start accepts 3 and the next step
    starts at the next run (τ = 4 at every step), while the vector (p_1 = 3/4 at every depth, independent)
    reads 1 + .75 + .75² + .75³ + .75⁴ = 3.05."""
    ranks = [0, 0, 0, -1] * 10
    runs = RankRuns(((tuple(ranks),),))
    law = loop_law(runs, Tree.chain(4))
    assert _tau(law) == pytest.approx(4.0) and law[4] == pytest.approx(1.0)
    vector = expected_tokens(Tree.chain(4), PositionalAcceptance((0.0, 0.75, 0.25)))
    assert vector == pytest.approx(3.05078125)


def test_the_loop_roots_more_steps_where_the_text_is_hard():
    """Half the trajectory always right, half always wrong: every position-weighted figure reads the halves
    alike (p_1 = 1/2), but the loop takes 4 positions a step in the easy half (chain of 3: 3 drafts + bonus)
    and 1 in the hard one, so 4× as many of its steps are hard: τ = (10·4 + 38·1) / 48 = 1.625 (the last two
    hard steps are the end's), not the vector's 1 + .5 + .25 + .125 = 1.875."""
    ranks = [0] * 40 + [-1] * 40
    law = loop_law(RankRuns(((tuple(ranks),),)), Tree.chain(3))
    assert _tau(law) == pytest.approx((10 * 4 + 38 * 1) / 48)
    assert expected_tokens(Tree.chain(3), PositionalAcceptance((0.0, 0.5, 0.5))) == pytest.approx(1.875)


def test_independent_positions_agree_with_the_positional_vector():
    """Ranks drawn independently at every position: the replay is the vector's law up to sampling error,
    for a chain and for a tree with siblings (rank 1 accepted where rank 0 was not)."""
    rng = np.random.default_rng(0)
    p = np.array([0.6, 0.2, 0.2])  # rank 0, rank 1, none
    prompts = tuple((tuple(int(r) for r in rng.choice([0, 1, -1], size=4000, p=p)),) for _ in range(5))
    runs = RankRuns(prompts)
    model = PositionalAcceptance((0.0, 0.6, 0.2, 0.2))
    for tree in (Tree.chain(4), Tree.kary(2, 3), Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])):
        assert _tau(loop_law(runs, tree)) == pytest.approx(expected_tokens(tree, model), rel=0.02)


def test_depths_past_the_recorded_read_the_deepest_law_at_a_later_root():
    """Two recorded depths; a chain of 3 reads depth 3 from the depth-2 law rooted one position later."""
    depth1, depth2 = (0, 0, 0, 0), (0, -1, 0, 0)
    runs = (depth1, depth2)
    kids = [{int(Tree.chain(3).ranks[c]): c for c in Tree.chain(3).children[v]} for v in range(4)]
    # root 0: depth 1 hit, depth 2 hit (depth2[0]), depth 3 = depth2[1] miss -> 2 drafts
    assert accepted_drafts(runs, 0, Tree.chain(3), kids) == 2
    # root 2: depth2[2] hit, then depth2[3] hit -> 3 drafts
    assert accepted_drafts(runs, 2, Tree.chain(3), kids) == 3


def test_steps_the_trajectorys_end_would_cut_are_not_counted():
    """Every draft right: a chain of 4 over 12 positions takes steps of 5 at 0 and 5, then 2 positions are
    left (fewer than 4): that step is the end's, not counted; τ = 5."""
    law = loop_law(RankRuns(((tuple([0] * 12),),)), Tree.chain(4))
    assert _tau(law) == pytest.approx(5.0)
    assert loop_law(RankRuns(((tuple([0] * 12),),)), Tree.chain(0))[1] == 1.0


def test_json_round_trip():
    runs = RankRuns((((0, -1, 2), (1, 0)), ((0,), ())))
    assert RankRuns.from_json(runs.to_json()) == runs and runs.depths == 2


def test_the_loops_own_lengths_give_its_law_on_the_steady_steps():
    """Generations of 10 tokens with a tree 3 deep: a step with fewer than 3 tokens left was cut by the end
    (it could accept at most what was left), so it is not counted, as a measured τ does not count it."""
    one = [4, 4, 1, 3]  # 4 + 4 = 8 done: the third step had 2 left (cut); the fourth had 1 left (cut)
    assert steady_lengths(one, 10, 3) == [4, 4]
    two = [1, 2, 4, 2, 4]  # 1, 3, 7 done: the fourth step had 3 left (kept), the fifth 1 (cut)
    assert steady_lengths(two, 10, 3) == [1, 2, 4, 2]
    assert steady_steps(two, 10, 3) == [(0, 1), (1, 2), (3, 4), (7, 2)]  # each with the tokens before it
    law = lengths_law([one, two], 10, 3)
    assert law.tolist() == pytest.approx([0, 1 / 6, 2 / 6, 0, 3 / 6]) and _tau(law) == pytest.approx(17 / 6)


def test_hit_vectors_are_the_ranks_the_trajectories_took():
    """Per depth, [0, p_1..p_W, p_none] of the recorded ranks; −1 and ranks past W count as none."""
    runs = RankRuns(((((0, 0, 1, -1, 5)), (0, -1, -1, -1, -1)),))
    assert hit_vectors(runs, 2) == [[0.0, 0.4, 0.2, 0.4], [0.0, 0.2, 0.0, 0.8]]


def test_flips_integrated_moves_the_replay_to_the_exact_level():
    """The replay's law shifted by the exact vector's i.i.d. law minus its own ranks': unchanged where the
    two vectors agree (temperature 0), τ moved by the difference of the two i.i.d. τ otherwise, a pmf."""
    tree = Tree.chain(3)
    runs = RankRuns(((tuple([0, -1, 0, 0, -1, 0, 0, 0, -1, -1] * 6),),))
    law = loop_law(runs, tree)
    hits = PositionalAcceptance(tuple(hit_vectors(runs, 1)[0]))  # p_1 = 0.6
    assert np.allclose(flips_integrated(law, tree, hits, hits), law)
    exact = PositionalAcceptance((0.0, 0.5, 0.5))
    moved = flips_integrated(law, tree, hits, exact)
    shift = _tau(accepted_length_law(tree, exact)) - _tau(accepted_length_law(tree, hits))
    assert moved.sum() == pytest.approx(1.0) and moved.min() >= 0 and moved[0] == 0
    assert _tau(moved) == pytest.approx(_tau(law) + shift) and shift < 0
