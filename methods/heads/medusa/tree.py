"""Medusa's greedy tree construction (Cai et al., 2024, §2.3.3 / eval/gen_results.py), p = target, q = heads.

``accuracy[d, r]`` is the measured probability that the rank-r candidate (top-(r+1)) of head d+1 is the
token the target emits d+1 positions after the root. Treating heads as independent, the node reached by the
choice path (r_1, …, r_d) is accepted with probability Π_i accuracy[i-1, r_i], and a tree's expected accepted
tokens is 1 (the root's bonus) + the sum of its nodes' values. Pure NumPy (no torch).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specsim.tree import Tree


@dataclass(frozen=True)
class MedusaTree:
    tree: Tree
    paths: tuple[tuple[int, ...], ...]  # choice paths in the order they were added
    expected_tokens: float  # 1 + Σ node values (root counts 1, like specsim's k̄)


def path_value(accuracy: np.ndarray, path: Sequence[int]) -> float:
    """Π_i accuracy[i, path[i]]: probability that the whole choice path is accepted."""
    return float(np.prod([accuracy[i, r] for i, r in enumerate(path)]))


def expected_tokens(tree: Tree, accuracy: np.ndarray) -> float:
    """k̄ of any tree whose ranks are Medusa top-k indices: 1 + Σ_{nodes} path_value."""
    accuracy = _check(accuracy)
    assert tree.depth <= accuracy.shape[0], f"tree depth {tree.depth} > {accuracy.shape[0]} heads"
    assert max(tree.ranks) < accuracy.shape[1], f"rank {max(tree.ranks)} beyond top-{accuracy.shape[1]}"
    return 1.0 + sum(path_value(accuracy, p) for p in tree.choice_paths)


def greedy_tree(
    accuracy: np.ndarray,
    budget: int,
    max_depth: int | None = None,
    max_child: Sequence[int] | None = None,
) -> MedusaTree:
    """Grow a tree of ``budget`` nodes (root included, like Sequoia's budget) one node at a time, always
    adding the frontier node of largest path value. The frontier of a tree is, for each node, its next
    sibling (rank + 1) and its first child (rank 0), so trees stay prefix- and sibling-closed (ranks are
    contiguous) — Medusa's rule. When every row of ``accuracy`` is non-increasing in rank, values never
    increase along either move, so each step takes the largest value of all nodes not yet in the tree and
    the result maximises expected_tokens over all closed trees of that size (tests check this by brute
    force). ``max_child[d]`` caps the candidates of head d+1 (default: all measured ranks)."""
    accuracy = _check(accuracy)
    heads, ranks = accuracy.shape
    max_depth = heads if max_depth is None else min(max_depth, heads)
    caps = list(max_child) if max_child is not None else [ranks] * heads
    assert len(caps) >= max_depth and all(1 <= c <= ranks for c in caps[:max_depth]), (
        f"max_child {caps} must give 1..{ranks} candidates for each of {max_depth} heads"
    )
    assert budget >= 1, f"budget counts the root, must be >= 1, got {budget}"
    added: list[tuple[int, ...]] = []
    total = 1.0
    # heap of (-value, path); ties resolved by the smaller path (shallower, lower ranks) for determinism
    frontier = [(-path_value(accuracy, (0,)), (0,))] if max_depth >= 1 else []
    while frontier and len(added) < budget - 1:
        neg, path = heapq.heappop(frontier)
        added.append(path)
        total -= neg
        d, r = len(path) - 1, path[-1]
        if r + 1 < caps[d]:
            sib = path[:-1] + (r + 1,)
            heapq.heappush(frontier, (-path_value(accuracy, sib), sib))
        if d + 1 < max_depth:
            child = path + (0,)
            heapq.heappush(frontier, (-path_value(accuracy, child), child))
    tree = Tree.from_paths(added) if added else Tree.chain(0)
    return MedusaTree(tree, tuple(added), total)


def _check(accuracy: np.ndarray) -> np.ndarray:
    accuracy = np.asarray(accuracy, dtype=np.float64)
    assert accuracy.ndim == 2, f"accuracy is (heads, ranks), got shape {accuracy.shape}"
    assert np.all((accuracy >= 0) & (accuracy <= 1)), "accuracies must lie in [0, 1]"
    return accuracy
