"""Monte-Carlo simulation of tree verification, a check on the closed forms of specsim.expected.

Each sample walks down the draft tree as verification does (Leviathan et al. 2023; SpecInfer/Sequoia for
trees): at the current accepted node the acceptance model draws which candidate is accepted
(``AcceptanceModel.sample_ranks``: sequential Bernoulli trials for α models, a categorical draw over
``[p_1, …, p_W, p_none]`` for Sequoia's vector); a rank the tree did not draft ends the step.
τ = accepted drafts + 1 (the bonus token).
"""

from __future__ import annotations

import numpy as np

from specsim.acceptance import AcceptanceLike, as_acceptance
from specsim.tree import Tree


def simulate_tau(tree: Tree, acceptance: AcceptanceLike, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n,) int samples of τ for one verification of ``tree`` each, drawn with ``rng``."""
    model = as_acceptance(acceptance)
    width = max(tree.ranks) + 1
    kids = np.full((tree.size, width + 1), -1, dtype=np.int64)  # (N, R+1) child id by rank, -1 = not drafted
    for v in range(1, tree.size):
        kids[tree.parents[v], tree.ranks[v]] = v
    has_kids = (kids >= 0).any(axis=1)  # (N,)
    node = np.zeros(n, dtype=np.int64)  # current accepted node of each sample
    alive = np.full(n, has_kids[0])
    for _ in range(tree.depth):
        idx = np.flatnonzero(alive)
        if idx.size == 0:
            break
        cur = node[idx]
        # the model draws the accepted rank among `width` candidates (width = none of them)
        nxt = kids[cur, model.sample_ranks(tree.depths[cur] + 1, width, rng)]
        ok = nxt >= 0
        node[idx[ok]] = nxt[ok]
        alive[idx] = ok & has_kids[np.maximum(nxt, 0)]
    return tree.depths[node] + 1


def empirical_law(samples: np.ndarray, max_tau: int) -> np.ndarray:
    """(max_tau + 1,) frequencies ``f[k]`` of τ = k (same indexing as accepted_length_law)."""
    return np.bincount(samples, minlength=max_tau + 1)[: max_tau + 1] / len(samples)
