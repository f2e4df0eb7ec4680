"""Sequoia's tree optimiser (Chen et al. 2024): the DP over the positional acceptance vector and the
hardware-aware choice of (budget, depth), with the reference implementation's conventions.

Vector ``[0, p_1, …, p_W, p_none]`` (p_none dropped): the child of rank i is the accepted one with p_i.
Units: the DP and the selection count *levels* (the root included: a chain of γ drafts has γ + 1 levels), as
the reference does; ``Tree.depth`` counts edges (levels − 1). Names say which: ``max_levels``, ``levels``.
T[m][l][b] = best k̄ of a tree with exactly m nodes, at most l levels (root included) and b root children:
T[1][l][0] = 1;  T[m][l][b] = max_{1<=y<m} T[y][l][b-1] + p_b · max_b' T[m-y][l-1][b']  (the b-th child
gets the other m − y nodes). Same recursion, tie-breaking (first max) and float32 as the reference.
Departure: where p_b = 0 meets an impossible subtree the reference computes 0 · (−inf) = NaN, which can
poison its table (p_1 = 0); here an impossible subtree simply stays impossible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specsim.expected import expected_tokens
from specsim.tree import Tree


def _ranks(acceptance_vector: Sequence[float] | np.ndarray, dtype: type) -> np.ndarray:
    """(W + 1,) [0, p_1, …, p_W]: the reference drops the last entry (p_none)."""
    v = np.asarray(acceptance_vector, dtype=np.float64).ravel()
    assert v.size >= 3, "acceptance vector layout is [0, p_1, …, p_W, p_none]"
    assert (v >= 0).all(), "acceptance probabilities must be >= 0"
    return v[:-1].astype(dtype)


@dataclass(frozen=True)
class SequoiaTable:
    """Solved DP. ``values[m, l, b]`` = T[m][l][b] (−inf: no such tree); ``scaled[m, l, b]`` =
    p_b · max_b' T[m][l][b'] (the gain of hanging the best (m, l) subtree as the b-th child)."""

    p: np.ndarray  # (W + 1,) [0, p_1, …, p_W]
    values: np.ndarray  # (B + 1, L + 1, W + 1)
    scaled: np.ndarray  # (B + 1, L + 1, W + 1)

    @property
    def best(self) -> np.ndarray:
        """(B + 1, L + 1) best k̄ with exactly m nodes and at most l levels (the reference's results)."""
        return self.values.max(axis=2)

    def split(self, m: int, l: int, b: int) -> int:
        """Nodes y kept by the first b − 1 children's part of the optimum (m, l, b): first argmax."""
        cand = self.values[1:m, l, b - 1] + self.scaled[m - 1 : 0 : -1, l - 1, b]  # (m − 1,) y = 1..m−1
        return int(np.argmax(cand)) + 1

    def tree(self, m: int, l: int) -> Tree:
        """The optimal tree of (m nodes, <= l levels), numbered breadth-first and children by rank as the
        reference's grow map (``Successors``)."""
        if not np.isfinite(self.best[m, l]):
            raise ValueError(f"no tree with {m} nodes in {l} levels and width {len(self.p) - 1}")
        states = [(m, l, int(np.argmax(self.values[m, l])))]
        parents, ranks = [-1], [0]
        for node in range(m):  # the list grows while we walk it: breadth-first order
            size, levels, b = states[node]
            children = []
            while b > 0:  # peel the last child off, then solve the first b − 1 children's part
                y = self.split(size, levels, b)
                children.append((size - y, levels - 1, int(np.argmax(self.values[size - y, levels - 1]))))
                size, b = y, b - 1
            for rank, child in enumerate(reversed(children)):
                states.append(child)
                parents.append(node)
                ranks.append(rank)
        return Tree.from_parents(parents, ranks)


def solve(acceptance_vector: Sequence[float] | np.ndarray, max_budget: int, max_levels: int,
          dtype: type = np.float32) -> SequoiaTable:
    """Fill T for m <= max_budget, l <= max_levels. T[m] depends only on rows y < m, so each m is one
    vectorised max over (y, l, b): O(B² · L · W) work in B NumPy calls. The last few tables are kept (the
    batch simulator re-selects a tree at many batch sizes for one vector); callers never write to them."""
    p = _ranks(acceptance_vector, dtype)
    key = (p.tobytes(), np.dtype(dtype).str, int(max_budget), int(max_levels))
    if key not in _SOLVED:
        while len(_SOLVED) >= _KEEP_SOLVED:
            _SOLVED.pop(next(iter(_SOLVED)))
        _SOLVED[key] = _solve(p, max_budget, max_levels, dtype)
    return _SOLVED[key]


_SOLVED: dict[tuple, SequoiaTable] = {}
_KEEP_SOLVED = 8


def _solve(p: np.ndarray, max_budget: int, max_levels: int, dtype: type) -> SequoiaTable:
    W, B, L = len(p) - 1, max_budget, max_levels
    assert B >= 1 and L >= 1, "need max_budget >= 1 and max_levels >= 1"
    T = np.full((B + 1, L + 1, W + 1), -np.inf, dtype=dtype)
    PM = np.full_like(T, -np.inf)
    T[1, 1:, 0] = 1.0
    buf = np.empty((max(B - 1, 1), max(L - 1, 1), W), dtype=dtype)
    for m in range(1, B + 1):
        if m >= 2 and L >= 2:
            cand = buf[: m - 1, : L - 1]  # (m − 1, L − 1, W): y, l = 2..L, b = 1..W
            np.add(T[1:m, 2:, :W], PM[m - 1 : 0 : -1, 1:L, 1:], out=cand)
            T[m, 2:, 1:] = cand.max(axis=0)
        best = T[m].max(axis=1)  # (L + 1,)
        ok = np.isfinite(best)  # keep −inf (no tree) even when p_b = 0: 0 · −inf would be NaN
        PM[m, ok] = best[ok, None] * p[None, :]
    return SequoiaTable(p, T, PM)


def solve_naive(acceptance_vector: Sequence[float] | np.ndarray, max_budget: int, max_levels: int,
                dtype: type = np.float32) -> np.ndarray:
    """The same recursion as plain loops in the reference's order (for tests and the benchmark)."""
    p = _ranks(acceptance_vector, dtype)
    W = len(p) - 1
    T = np.full((max_budget + 1, max_levels + 1, W + 1), -np.inf, dtype=dtype)
    T[1, 1:, 0] = 1.0
    for m in range(2, max_budget + 1):
        for l in range(2, max_levels + 1):
            for b in range(1, W + 1):
                best = -np.inf
                for y in range(1, m):
                    sub = T[m - y, l - 1].max()
                    if T[y, l, b - 1] > -np.inf and sub > -np.inf:
                        best = max(best, T[y, l, b - 1] + p[b] * sub)
                T[m, l, b] = best
    return T


@dataclass(frozen=True)
class SequoiaTree:
    tree: Tree
    expected_tokens: float
    budget: int
    levels: int  # levels including the root (tree.depth + 1)


def optimal_tree(acceptance_vector: Sequence[float] | np.ndarray, budget: int, max_levels: int
                 ) -> SequoiaTree:
    """The k̄-optimal tree with exactly ``budget`` nodes (root included) and at most ``max_levels`` levels."""
    tree = solve(acceptance_vector, budget, max_levels).tree(budget, max_levels)
    return SequoiaTree(tree, expected_tokens(tree, acceptance_vector), budget, tree.depth + 1)


@dataclass(frozen=True)
class SequoiaChoice:
    budget: int
    levels: int  # levels including the root (tree.depth + 1)
    expected_tokens: float
    speedup: float  # baseline_time / time_per_token
    time_per_token: float  # (draft steps · draft_time + target_time) / k̄
    tree: Tree


def select(acceptance_vector: Sequence[float] | np.ndarray, max_levels: int, budgets: Sequence[int],
           target_times: Sequence[float], draft_time: float, *, root_step: bool = True,
           baseline_time: float | None = None) -> SequoiaChoice:
    """Hardware-aware (budget, levels): minimise (steps(l) · draft_time + target_times[i]) / T*[budgets[i]][l]
    over budgets and l <= max_levels levels (root included). steps(l) = l with ``root_step`` (the
    reference's charge, one draft step per level counting the root's) and l − 1 without (one step per level
    below the root: what the simulator's DraftCost prices a tree of l levels at). Ties keep the earlier
    budget, then the fewer levels, as the reference. The speedup is ``baseline_time`` (default
    target_times[0], the reference's choice) / the best time."""
    assert len(budgets) == len(target_times) and budgets, "one target time per budget"
    table = solve(acceptance_vector, max(budgets), max_levels)
    dtype = table.values.dtype.type
    ac = table.best[np.asarray(budgets)]  # (K, L + 1)
    steps = np.arange(max_levels + 1) - (0 if root_step else 1)  # (L + 1,) draft steps of l levels
    num = (steps[None, :] * float(draft_time) + np.asarray(target_times, float)[:, None]).astype(dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(ac > 0, num / ac, np.inf)  # (K, L + 1); −inf = no such tree (the reference skips)
    i, levels = np.unravel_index(int(np.argmin(x)), x.shape)  # row-major: first budget, then fewest levels
    if not np.isfinite(x[i, levels]):
        raise ValueError(f"no tree fits any budget of {list(budgets)} within {max_levels} levels")
    budget = int(budgets[i])
    tree = table.tree(budget, int(levels))
    base = float(target_times[0] if baseline_time is None else baseline_time)
    k = expected_tokens(tree, acceptance_vector)
    return SequoiaChoice(budget, int(levels), k, base / float(x[i, levels]), float(x[i, levels]), tree)
