"""The step of a finite generation: the mean over its steps, the generation's cut last steps included.

A generation of N tokens starts u(r) steps with r tokens left (specsim.expected.room_visits). There the
decode loop lets a drafter draft at most the room (``ctx.max_new``): min(D, r − spare) levels of its tree
of depth D, ``spare`` (the method preset's ``method.room_spare``) = 1 for the drafters that leave the room's
last token to the target's bonus token (EAGLE, Medusa, MTP: ``ctx.max_new − 1``), 0 for those that draft the
room itself. A step cut so drafts and verifies fewer nodes. τ_N (specsim.expected.tokens_per_forward)
already counts the cut's tokens; its cost is
    t_draft,N = Σ_r u(r) · t_draft(tree cut at min(D, r − spare)) / Σ_r u(r),   t_verify,N likewise,
which the full step over-prices by the cut steps' share: 5-7% of the draft on EAGLE's Sequoia-32 trees at
N = 48 (τ 4-5: ~10 steps, the last one or two cut).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from specsim.cost import CostModel
from specsim.expected import room_visits
from specsim.tree import Tree, cut


@dataclass(frozen=True)
class RunShares:
    """The run's mean draft and verify per step over the full step's (1.0 where nothing is cut)."""

    draft: float
    verify: float


def room_mean(law: np.ndarray, n_tokens: int, depth: int, spare: int,
              at_depth: Callable[[int], np.ndarray | float]) -> np.ndarray | float:
    """The mean of ``at_depth(d)`` over the steps of a generation of ``n_tokens`` (module docstring), d the
    levels drafted at each step's room: min(``depth``, r − ``spare``); rooms from the τ law ``law``."""
    u = room_visits(law, n_tokens)[1:]
    depths = np.minimum(depth, np.maximum(np.arange(1, n_tokens + 1) - spare, 0))
    values = {int(d): np.asarray(at_depth(int(d)), dtype=float) for d in np.unique(depths)}
    total = sum(u[depths == d].sum() * v for d, v in values.items())
    out = total / u.sum()
    return float(out) if np.ndim(out) == 0 else out


def run_shares(cost: CostModel, tree: Tree, law: np.ndarray, n_tokens: int, spare: int) -> RunShares:
    """The mean draft and verify of a generation of ``n_tokens`` (module docstring) over those of a full
    step of ``tree`` under ``cost``, the rooms from the τ law ``law`` (its k >= 1 entries). A dynamic
    drafter's expansion (``cost.draft_tree``) is cut at the same depth. Shares, so that a drafter whose full
    step is priced elsewhere (a timed scale, its own member trees, an exit law) keeps that price, scaled
    alike."""
    most = max(tree.depth, 0 if cost.draft_tree is None else cost.draft_tree.depth)  # the levels drafted

    def step(d: int) -> np.ndarray:  # (draft, verify) of a step drafting d levels
        at = cost if cost.draft_tree is None else replace(cost, draft_tree=cut(cost.draft_tree, d))
        kept = cut(tree, d)
        return np.array([at.draft_time(kept), at.tree_verify_time(kept)])

    mean = room_mean(law, n_tokens, most, spare, step)
    full_draft, full_verify = cost.draft_time(tree), cost.tree_verify_time(tree)
    return RunShares(float(mean[0]) / full_draft if full_draft > 0 else 1.0,
                     float(mean[1]) / full_verify if full_verify > 0 else 1.0)
