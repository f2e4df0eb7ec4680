"""Acceptance statistics of real decoding, in the simulator's units (p = target, q = draft).

tau (k̄) counts the bonus token: tokens a target forward yields = accepted drafts + 1 (autoregressive: 1).
By depth: α_d = P(a child at depth d is accepted | the accepted node at depth d−1 had children), the
per-depth curve of specsim's acceptance models. By rank: Sequoia's positional vector [0, p_1, …, p_W, p_none]:
p_i = P(the child of sampling rank i−1 is the one accepted), counted at every accepted node with children.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specsim.tree import Tree


def _grow(counts: list[int], size: int) -> None:
    counts.extend([0] * (size - len(counts)))


@dataclass
class AcceptStats:
    steps: int = 0
    hist: list[int] = field(default_factory=list)  # hist[k]: steps that accepted k draft tokens
    depth_tried: list[int] = field(default_factory=list)  # [d-1]: accepted nodes at depth d-1 with children
    depth_accepted: list[int] = field(default_factory=list)  # [d-1]: of those, a child accepted
    rank_accepted: list[int] = field(default_factory=list)  # [r]: the accepted child had rank r
    rank_none: int = 0  # an accepted node had children but none was accepted
    nodes: int = 0  # verified tree nodes (root included), summed over the steps: the verification budget

    def record(self, tree: Tree, path: tuple[int, ...]) -> None:
        """One verification: ``path`` = accepted nodes, root first (before any EOS / length truncation)."""
        self.steps += 1
        self.nodes += tree.size
        _grow(self.hist, len(path))
        self.hist[len(path) - 1] += 1
        children, ranks = tree.children, tree.ranks
        for d, node in enumerate(path):
            if not children[node]:
                break
            _grow(self.depth_tried, d + 1)
            _grow(self.depth_accepted, d + 1)
            self.depth_tried[d] += 1
            if d + 1 < len(path):
                self.depth_accepted[d] += 1
                r = ranks[path[d + 1]]
                _grow(self.rank_accepted, r + 1)
                self.rank_accepted[r] += 1
            else:
                self.rank_none += 1

    def merge(self, other: AcceptStats) -> None:
        self.steps += other.steps
        self.nodes += other.nodes
        self.rank_none += other.rank_none
        for mine, theirs in (
            (self.hist, other.hist),
            (self.depth_tried, other.depth_tried),
            (self.depth_accepted, other.depth_accepted),
            (self.rank_accepted, other.rank_accepted),
        ):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def tau(self) -> float:
        """Mean tokens per target forward, bonus included."""
        return sum((k + 1) * c for k, c in enumerate(self.hist)) / self.steps if self.steps else 0.0

    @property
    def verified_nodes(self) -> float:
        """Mean nodes the target verified per step (root included): the step's verification budget."""
        return self.nodes / self.steps if self.steps else 0.0

    def by_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepted, self.depth_tried)]

    def by_rank(self) -> list[float]:
        """[0, p_1, …, p_W, p_none] (Sequoia's layout); [] when no node ever had children."""
        total = sum(self.rank_accepted) + self.rank_none
        if not total:
            return []
        return [0.0] + [c / total for c in self.rank_accepted] + [self.rank_none / total]
