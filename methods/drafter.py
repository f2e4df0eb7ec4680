"""The one Drafter protocol every method implements, and the Draft it proposes.

Loop contract (p = target, q = draft): the committed sequence is x_1..x_t; the target's KV cache holds
x_1..x_{t-1}; the draft tree's root (node 0) is x_t. The loop runs ONE target forward over all tree nodes
(tree attention, positions = t-1 + depth), a config-chosen verifier walks the tree, the accepted path's
KV is committed and the bonus/corrected token becomes the next root. The autoregressive baseline is the
drafter whose tree is the root alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specsim.tree import Tree


@dataclass(frozen=True)
class Draft:
    """A proposed draft tree.

    tree:   structure; node 0 is the root (= last committed token).
    tokens: (N,) long, token id of every node; tokens[0] is the root token.
    q:      (N, V) float or None. Row i is the (processed) draft distribution from which the children of
            node i were drawn; rows of leaves are unused. None = deterministic draft (one-hot q: greedy
            drafts, n-gram lookups, top-k expansions), verified by the deterministic rule.
    """

    tree: Tree
    tokens: torch.Tensor
    q: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.tokens.dim() == 1 and self.tokens.numel() == self.tree.size, (
            f"tokens {tuple(self.tokens.shape)} do not match tree size {self.tree.size}"
        )
        assert self.q is None or self.q.shape[0] == self.tree.size, "q needs one row per node"


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may read when proposing.

    tokens:   (t,) long, all committed tokens (prompt + generated); tokens[-1] is the root.
    hidden:   (t', H) target last-layer hidden states of committed tokens not yet shown to the drafter
              (only when ``needs_hidden_states``), else None.
    generator: the run's torch.Generator (drafters that sample must use it).
    """

    tokens: torch.Tensor
    hidden: torch.Tensor | None
    generator: torch.Generator
    max_new: int  # tokens the run may still emit; a drafter should not propose deeper than this


@dataclass(frozen=True)
class StepFeedback:
    """What verification decided, given back to the drafter.

    accepted: node indices of the accepted path, root first (len = accepted drafts + 1).
    next_token: the bonus / corrected token (the next root).
    """

    draft: Draft
    accepted: tuple[int, ...]
    next_token: int


@runtime_checkable
class Drafter(Protocol):
    needs_hidden_states: bool

    def reset(self, prompt: torch.Tensor) -> None:
        """Start a new prompt ((t,) long)."""

    def propose(self, ctx: DraftContext) -> Draft:
        """Propose a draft tree rooted at ctx.tokens[-1]."""

    def feedback(self, fb: StepFeedback) -> None:
        """Called after every verification (update caches, online learning, statistics)."""


def root_only(root_token: int, device: torch.device | str = "cpu") -> Draft:
    """The empty proposal: the autoregressive step."""
    return Draft(Tree.chain(0), torch.tensor([root_token], dtype=torch.long, device=device))
