"""One tree type for every draft shape (chain, k-ary, Medusa paths, Sequoia, dynamic EAGLE-2 trees).

Node 0 is the root: the last committed token, which the target re-reads and which always "counts 1" in
k̄. Every other node is a draft token. ``parents[i] < i`` (topological order), so an ancestor mask and
position ids (prefix length + depth) follow directly. ``ranks[i]`` is the node's position among its
siblings in the drafter's sampling order (0 = the draft's first / most likely choice): Sequoia's positional
acceptance model and Medusa's top-k choice index both read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]
    ranks: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        parents = tuple(int(p) for p in self.parents)
        assert parents and parents[0] == -1, "parents[0] must be -1 (the root)"
        for i, p in enumerate(parents[1:], start=1):
            assert 0 <= p < i, f"node {i} has parent {p}: parents must precede children"
        object.__setattr__(self, "parents", parents)
        ranks = tuple(int(r) for r in self.ranks) if self.ranks else _sibling_order(parents)
        assert len(ranks) == len(parents), "ranks and parents differ in length"
        object.__setattr__(self, "ranks", ranks)

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def from_parents(cls, parents: Sequence[int], ranks: Sequence[int] | None = None) -> Tree:
        return cls(tuple(parents), tuple(ranks) if ranks is not None else ())

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> Tree:
        """Medusa's layout: each path is a tuple of top-k choice indices, one per depth, e.g. (0, 1)
        = second choice of head 2 under the first choice of head 1. Every prefix of a path must be a
        path too (it is added if missing). Nodes are numbered breadth-first, siblings by choice."""
        nodes = {()}
        for path in paths:
            path = tuple(int(c) for c in path)
            assert all(c >= 0 for c in path), f"negative choice in path {path}"
            nodes.update(path[:d] for d in range(1, len(path) + 1))
        order = sorted(nodes, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(order)}
        parents = [-1] + [index[p[:-1]] for p in order[1:]]
        ranks = [0] + [p[-1] for p in order[1:]]
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def chain(cls, gamma: int) -> Tree:
        """Root plus γ draft tokens in a line."""
        assert gamma >= 0, "gamma must be >= 0"
        return cls(tuple(range(-1, gamma)))

    @classmethod
    def beams(cls, k: int, depth: int) -> Tree:
        """k chains of ``depth`` nodes below the root: the nodes a drafter that expands its k best nodes at
        every level feeds (EAGLE-2's dynamic tree: the root, then k nodes per level), whatever it keeps."""
        assert k >= 1 and depth >= 0
        parents = [-1] + [0] * min(k, depth * k)
        for d in range(1, depth):
            parents += list(range(1 + (d - 1) * k, 1 + d * k))
        return cls(tuple(parents))

    @classmethod
    def kary(cls, k: int, depth: int) -> Tree:
        """Full k-ary tree of the given depth below the root (k^1 + … + k^depth draft nodes)."""
        assert k >= 1 and depth >= 0
        paths = [()]
        frontier = [()]
        for _ in range(depth):
            frontier = [p + (c,) for p in frontier for c in range(k)]
            paths.extend(frontier)
        return cls.from_paths(paths[1:]) if depth else cls((-1,))

    @classmethod
    def from_successors(cls, successors: Sequence[Sequence[int]]) -> Tree:
        """Sequoia's layout (lists of children per node, node 0 = root)."""
        parents = [-1] * len(successors)
        ranks = [0] * len(successors)
        for node, children in enumerate(successors):
            for r, c in enumerate(children):
                parents[c] = node
                ranks[c] = r
        return cls(tuple(parents), tuple(ranks))

    # ---- derived structure --------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of nodes including the root (Sequoia's budget counts the same nodes)."""
        return len(self.parents)

    @cached_property
    def depths(self) -> np.ndarray:
        d = np.zeros(self.size, dtype=np.int64)
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    @property
    def depth(self) -> int:
        """Largest node depth, the root at 0 (a chain of γ drafts has depth γ)."""
        return int(self.depths.max())

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node, in sampling order (by rank)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            kids[self.parents[i]].append(i)
        return tuple(tuple(sorted(k, key=lambda c: self.ranks[c])) for k in kids)

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """(N, N) bool: mask[i, j] is True when j is i or an ancestor of i (what i may attend to)."""
        m = np.eye(self.size, dtype=bool)
        for i in range(1, self.size):
            m[i] |= m[self.parents[i]]
        return m

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.children) if not k)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-leaf node paths (node indices, root included)."""
        return tuple(self.path_to(leaf) for leaf in self.leaves)

    def path_to(self, node: int) -> tuple[int, ...]:
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return tuple(reversed(path))

    @cached_property
    def choice_paths(self) -> tuple[tuple[int, ...], ...]:
        """Medusa's layout back: for every non-root node, the ranks along its path."""
        return tuple(tuple(self.ranks[n] for n in self.path_to(i)[1:]) for i in range(1, self.size))

    @cached_property
    def width(self) -> int:
        """Largest number of children of any node."""
        return max((len(k) for k in self.children), default=0)

    def level_sizes(self) -> np.ndarray:
        return np.bincount(self.depths, minlength=self.depth + 1)

    def __repr__(self) -> str:
        return f"Tree(size={self.size}, depth={self.depth}, width={self.width})"


def subtree(tree: Tree, keep: list[int]) -> Tree:
    """The tree restricted to the ascending node list ``keep`` (closed under ancestors: node 0 and every kept
    node's parent are kept), nodes renumbered in order, ranks unchanged."""
    new_index = {old: new for new, old in enumerate(keep)}
    assert keep and keep[0] == 0, "the root must be kept"
    parents = [-1] + [new_index[tree.parents[i]] for i in keep[1:]]
    return Tree.from_parents(parents, [tree.ranks[i] for i in keep])


def cut(tree: Tree, depth: int) -> Tree:
    """``tree`` without its nodes deeper than ``depth`` (>= 0), ``tree`` itself where none is: what a drafter
    drafts with that much room (parents precede children, so the kept nodes are closed under ancestors)."""
    if tree.depth <= depth:
        return tree
    return subtree(tree, [i for i in range(tree.size) if tree.depths[i] <= depth])


def _sibling_order(parents: Sequence[int]) -> tuple[int, ...]:
    seen: dict[int, int] = {}
    ranks = [0]
    for p in parents[1:]:
        ranks.append(seen.get(p, 0))
        seen[p] = ranks[-1] + 1
    return tuple(ranks)
