"""Draft-tree shapes of every ``tree`` preset, built for the simulator.

chain (Leviathan et al. 2023), k-ary, Medusa paths (Cai et al. 2024), Sequoia (Chen et al. 2024: DP-optimal
for the positional vector, (budget, depth) chosen from t(n) and the draft time), dynamic (EAGLE-2, Li et al.
2024b: without recorded trees, approximated by the best static tree of its budget, see ``build_tree``; with
the trees the drafter actually kept, priced as their mixture, see ``recorded_law``), none (plain decoding).
Notation: p = target, q = draft.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from specsim import sequoia
from specsim.acceptance import AcceptanceLike, DepthVectorAcceptance, PositionalAcceptance, as_acceptance
from specsim.config import TreeConfig, TreeKind
from specsim.cost import CostModel
from specsim.expected import accepted_length_law
from specsim.tree import Tree

DERIVED_WIDTH = 32  # ranks kept when a Sequoia vector is derived from an α model ((1 − α)^32 is negligible)


def acceptance_vector(acceptance: AcceptanceLike, width: int | None = None) -> np.ndarray:
    """Sequoia's ``[0, p_1, …, p_W, p_none]`` for any acceptance model. A measured vector is used as is
    (cut to ``width`` ranks if given). For α models the vector is derived at depth 1: p_i = α(1 − α)^(i−1)
    (sequential trials, see specsim.acceptance) — exact for i.i.d. α, optimistic for deeper levels of a
    decaying α_d since the DP assumes one vector at every depth."""
    model = as_acceptance(acceptance)
    if isinstance(model, PositionalAcceptance):
        return model.positional_vector(width)
    return model.positional_vector(width or DERIVED_WIDTH)


def sequoia_choice(
    tree_cfg: TreeConfig, acceptance: AcceptanceLike, cost: CostModel
) -> sequoia.SequoiaChoice:
    """Sequoia's hardware-aware selection over ``tree_cfg.budgets`` and at most ``tree_cfg.max_levels``
    levels (root included): target time t(budget) from the cost model (roofline or measured), draft time
    per step from the method (a single-pass drafter's cost is a constant added to every drafted tree's
    target time instead). A tree is charged what specsim.predict prices it at: one draft step per level
    below the root (levels − 1; the reference charges one more), and no drafter cost for the root alone.
    The draft's cost per node (``DraftCost.per_node``) rides on the budget: a tree of b nodes drafts b − 1."""
    budgets = [int(b) for b in tree_cfg.budgets]
    per_step, constant = cost.draft.per_depth(cost.ar_time)
    drafted = np.asarray(budgets) > 1  # the root alone drafts nothing: DraftCost.time is 0 there
    nodes = cost.draft.per_node(cost.ar_time) * (np.asarray(budgets, dtype=float) - 1)
    target_times = np.asarray(cost.verify_time(budgets), dtype=float) + (constant + nodes) * drafted  # (K,)
    return sequoia.select(
        acceptance_vector(acceptance), tree_cfg.max_levels, budgets, target_times.tolist(), per_step,
        root_step=False, baseline_time=cost.ar_time,
    )


def build_tree(tree_cfg: TreeConfig, acceptance: AcceptanceLike, cost: CostModel) -> Tree:
    """The tree a ``tree`` preset describes.

    ``dynamic`` (EAGLE-2) re-ranks its tree per context from draft confidences, which the simulator does
    not have; it is approximated by the best static tree of total_tokens + 1 nodes within depth + 1
    levels and top_k children per node: an upper bound on what any context-free tree of that size gets
    under the positional model, which the drafter's q-ranked trees need not reach (EAGLE heads whose q
    under-states deep acceptance keep wide shallow trees). Where the kept trees were recorded, price them
    instead (``recorded_law``); this tree then only sizes the step (same node count and depth).
    """
    kind = TreeKind(tree_cfg.kind)
    if kind == TreeKind.none:
        return Tree((-1,))
    if kind == TreeKind.chain:
        return Tree.chain(tree_cfg.gamma)
    if kind == TreeKind.kary:
        return Tree.kary(tree_cfg.k, tree_cfg.depth)
    if kind == TreeKind.medusa:
        return Tree.from_paths(tree_cfg.paths)
    if kind == TreeKind.sequoia:
        return sequoia_choice(tree_cfg, acceptance, cost).tree
    if kind == TreeKind.dynamic:
        k, d = tree_cfg.top_k, tree_cfg.depth
        capacity = d + 1 if k == 1 else (k ** (d + 1) - 1) // (k - 1)  # nodes of the full k-ary tree
        budget = min(tree_cfg.total_tokens + 1, capacity)
        return sequoia.optimal_tree(acceptance_vector(acceptance, k), budget, d + 1).tree
    raise ValueError(f"tree.kind: unknown {kind!r}")


def kept_acceptance(tried: np.ndarray, accepted: np.ndarray) -> DepthVectorAcceptance:
    """The (depth, rank) acceptance of the nodes a dynamic drafter KEPT: ``tried[d-1, r]`` counts its kept
    depth-d rank-r nodes whose parent was accepted, ``accepted[d-1, r]`` those of them accepted; p_r(d) is
    their ratio (0 where never tried). The positional vectors of a static tree's calibration average every
    node at (depth, rank); EAGLE-2 keeps a node when its cumulative q is high, and q predicts acceptance
    beyond (depth, rank): its kept nodes are accepted more often (code: priced τ −5% with the static
    vectors). Conditional rates of siblings tried in different steps can sum past 1 (rank 1 tried only
    where q was flat): such a depth's vector is scaled to sum to 1, the most a greedy walk accepts."""
    tried, accepted = np.asarray(tried, dtype=float), np.asarray(accepted, dtype=float)
    assert tried.shape == accepted.shape and tried.ndim == 2, (tried.shape, accepted.shape)
    assert (accepted <= tried).all(), "more acceptances than tries"
    p = np.divide(accepted, tried, out=np.zeros_like(tried), where=tried > 0)  # (D, W)
    p = p / np.maximum(p.sum(1, keepdims=True), 1.0)
    return DepthVectorAcceptance(tuple((0.0, *row, max(0.0, 1.0 - row.sum())) for row in p))


@dataclass(frozen=True)
class RecordedTrees(Mapping):
    """A dynamic drafter's kept trees → how often each was proposed, and optionally the acceptance of the
    nodes it kept, measured on those same steps (``kept_acceptance``): ``recorded_law`` prices the trees
    with it instead of the static calibration's vectors."""

    counts: Mapping[Tree, int]
    acceptance: DepthVectorAcceptance | None = field(default=None)
    # (s, D): the drafter's draft time per step is s times a chain of D drafts' of the same method, timed in
    # the loop on the same steps' prompts (methods.measurement.dynamic_shapes.draft_scale); None: not timed
    draft_scale: tuple[float, int] | None = field(default=None)
    # the law of τ of the loop that kept them (its steady steps, specsim.replay.lengths_law): where given,
    # τ is the loop's own, not the trees' priced node by node; None: not recorded
    loop: tuple[float, ...] | None = field(default=None)

    def __getitem__(self, tree: Tree) -> int:
        return self.counts[tree]

    def __iter__(self) -> Iterator[Tree]:
        return iter(self.counts)

    def __len__(self) -> int:
        return len(self.counts)


def recorded_law(shapes: Mapping[Tree, int], acceptance: AcceptanceLike) -> np.ndarray:
    """The law of τ of a dynamic (EAGLE-2) drafter from the trees it actually kept: ``shapes`` maps each
    kept tree (its parents and sibling ranks: rank r = q's top-r child) to how often it was proposed, and
    the result is their frequency-weighted mixture of ``accepted_length_law`` under the positional
    (depth, rank) model, so Σ_k k·law[k] is the mean over the recorded trees of k̄ = Σ_v P(v accepted).
    The trees are taken as given (their shape comes from q alone); acceptance from ``acceptance``, or, where
    ``shapes`` is a ``RecordedTrees`` with the kept nodes' own acceptance, from that (see kept_acceptance).
    Where ``shapes`` carries the recording loop's own law (``loop``), that law is returned: pricing each kept
    tree node by node multiplies (depth, rank) rates as if independent, and both acceptance (easy and hard
    stretches) and q's choice of tree (it grows deep where it is confident, which is where it is right) are
    not: EAGLE-3's 8-node dynamic tree on code read τ −8% (zoo7, T = 0) and EAGLE-2's acceptance term −3.7%
    on average, priced so."""
    total = sum(int(n) for n in shapes.values())
    assert shapes and total > 0, "need at least one recorded tree"
    loop = getattr(shapes, "loop", None)
    if loop is not None:  # the loop's own law on the steps that kept the trees
        return np.asarray(loop, dtype=float)
    own = getattr(shapes, "acceptance", None)
    acceptance = own if own is not None else acceptance
    law = np.zeros(max(t.depth for t in shapes) + 2)
    for tree, n in shapes.items():
        one = accepted_length_law(tree, acceptance)
        law[: one.size] += int(n) * one
    return law / total
