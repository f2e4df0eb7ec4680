"""Tree: constructors (parents, Medusa paths, chain, k-ary, Sequoia successors) and derived structure."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specsim import Tree


@st.composite
def parent_lists(draw, max_size=12):
    n = draw(st.integers(1, max_size))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


def test_from_parents_counts_ranks_in_sibling_order():
    t = Tree.from_parents([-1, 0, 0, 1, 0, 1])
    assert t.size == 6 and t.depth == 2
    assert t.ranks == (0, 0, 1, 0, 2, 1)
    assert t.children[0] == (1, 2, 4) and t.children[1] == (3, 5)
    assert list(t.depths) == [0, 1, 1, 2, 1, 2]
    assert t.leaves == (2, 3, 4, 5) and t.width == 3


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 1]])
def test_from_parents_rejects_bad_parents(parents):
    with pytest.raises(AssertionError):
        Tree.from_parents(parents)


def test_chain_and_kary_shapes():
    for gamma in range(0, 6):
        c = Tree.chain(gamma)
        assert c.size == gamma + 1 and c.depth == gamma and c.width == (1 if gamma else 0)
    for k in range(1, 4):
        for d in range(0, 4):
            t = Tree.kary(k, d)
            assert t.size == sum(k**i for i in range(d + 1))
            assert t.depth == d
            assert list(t.level_sizes()) == [k**i for i in range(d + 1)]


def test_from_paths_adds_prefixes_and_numbers_breadth_first():
    t = Tree.from_paths([[0, 1], [1], [0, 0, 2]])
    # nodes: (), (0), (1), (0,0), (0,1), (0,0,2): (0,0) is added as a prefix
    assert t.size == 6
    assert t.choice_paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 2))
    assert t.parents == (-1, 0, 0, 1, 1, 3)
    assert t.ranks == (0, 0, 1, 0, 1, 2)


@given(parent_lists())
def test_ancestor_mask_matches_paths(parents):
    t = Tree.from_parents(parents)
    m = t.ancestor_mask
    assert m.shape == (t.size, t.size) and m.dtype == bool
    for i in range(t.size):
        assert set(np.flatnonzero(m[i])) == set(t.path_to(i))
        assert len(t.path_to(i)) == t.depths[i] + 1
    assert len(t.paths) == len(t.leaves)
    assert all(p[0] == 0 and p[-1] in t.leaves for p in t.paths)


@given(parent_lists())
def test_choice_paths_round_trip_to_the_same_shape(parents):
    t = Tree.from_parents(parents)
    back = Tree.from_paths(t.choice_paths)
    assert back.size == t.size
    assert sorted(back.choice_paths) == sorted(t.choice_paths)
    assert list(back.level_sizes()) == list(t.level_sizes())


def test_from_successors_reads_sequoia_layout():
    t = Tree.from_successors([[1, 2], [3], [], []])
    assert t.parents == (-1, 0, 0, 1) and t.ranks == (0, 0, 1, 0)
