"""Self-speculation in the cost model: a shared-cache verify pass (LayerSkip) reuses the draft's layers
[0, E) for the nodes the draft fed: (1 - ρ_v)·t(n) + ρ_v·t(leaves); ρ_v = 0 is the plain t(n)."""

from __future__ import annotations

import pytest

from specsim.cost import CostModel, DraftCost, MeasuredCost
from specsim.tree import Tree

T = MeasuredCost.from_mapping({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4})


def test_chain_verify_reuses_the_drafted_nodes():
    cost = CostModel(T, DraftCost(ratio=1 / 3), verify_reuse=1 / 3)
    chain = Tree.chain(3)  # 4 nodes: the draft fed 3 of them; the last draft token is the one fresh node
    assert cost.tree_verify_time(chain) == pytest.approx(2 / 3 * 1.6 + 1 / 3 * 1.0)
    assert cost.step_time(chain) == pytest.approx(3 * (1 / 3) + 2 / 3 * 1.6 + 1 / 3)


def test_no_reuse_is_the_plain_forward():
    tree = Tree.kary(2, 2)
    assert CostModel(T, DraftCost()).tree_verify_time(tree) == pytest.approx(float(T.time(tree.size)))
    assert CostModel(T, DraftCost(), 0.5).tree_verify_time(Tree.chain(0)) == 1.0  # nothing drafted


def test_calibrated_saving_replaces_the_layer_share():
    """A measured shared-cache saving (verify_saving, t_AR units) prices the verify; ρ_v is then unused."""
    chain = Tree.chain(3)
    cost = CostModel(T, DraftCost(ratio=0.3), verify_reuse=0.9, verify_saving=0.05)
    assert cost.tree_verify_time(chain) == pytest.approx(1.6 - 0.05 * 1.0)
    assert cost.tree_verify_time(Tree.chain(0)) == 1.0  # nothing drafted: nothing to reuse
