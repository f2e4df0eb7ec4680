"""τ of SpecInfer's merged token tree of K drafts (Miao et al. 2024), by replaying calibration trajectories.

p = target, q_k = draft model k (k = 1..K). Each draft fills the same member tree; the K trees are merged
(a node whose token a sibling already has joins it) and verified in one pass: greedily at temperature 0 (the
child equal to p's argmax), by multi-step speculative sampling (MSS) otherwise — at a merged node every
proposer's draw x_j ~ q_j is tested in draw order, accepted w.p. min(1, p_j(x_j)/q_j(x_j)), and on rejection
p_{j+1} = norm(max(p_j − q_j, 0)).

Why not a per-depth acceptance vector: below the root the merged path is alive through those drafts that
were right so far, and a draft that was right at depth d is far likelier to be right at d + 1 (easy text
comes in runs, and the drafts agree on it). Depth-wise marginals of the merged tree average that away and
price the union of K trees as K unrelated copies (quiet sweep: τ −31% to −74%). The model here keeps the
correlation by construction: along the target's own trajectories (the calibration split) it stores, per
position s and draft k, what k proposes there given the true prefix — the rank of the target's token in q_k
(temperature 0), or the whole laws q_k and p (temperature > 0) — and walks the
merged tree over consecutive positions, keeping the set of drafts still alive on the accepted path:

- temperature 0: exact. Draft k is alive at depth d iff its tree holds the first d trajectory tokens, i.e.
  the ranks of those tokens in q_k trace a path of the member tree; τ = 1 + max_k (its accepted depth).
- temperature > 0: the MSS walk simulated per position (``reps`` times) on the whole laws p and q_k: each
  alive draft draws its node's children from q_k, the draws are tested in merge order, and the drafts that
  drew the accepted token go on to its children. The accepted token's law is p (MSS is lossless), as the
  trajectory's own next token is, so the next position's p and q_k are taken from the trajectory: positions,
  not tokens, are replayed (the same approximation as every star tree measured along a trajectory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specsim.replay import child_by_rank, loop_steps
from specsim.tree import Tree


@dataclass(frozen=True)
class Replay:
    """Per-position proposals of K drafts along calibration trajectories, one array per prompt.

    ranks[i]: (T_i, K) int, the rank of the target's token in q_k at position s of prompt i (−1: beyond the
    ranks recorded) — temperature 0 (then the laws are empty)."""

    ranks: tuple[np.ndarray, ...] = ()
    # temperature > 0, whole laws: p_rows[i] (T_i, V) and q_rows[i] (T_i, K, V) — a small draft model's q
    # can be flat with a long tail (the zoo at T = 1: q's top 256 tokens hold 83% of p, Σ min(p, q) = 0.80
    # over the vocabulary, 0.54 over q's top 16), so a top-M cut misprices acceptance
    p_rows: tuple[np.ndarray, ...] = ()
    q_rows: tuple[np.ndarray, ...] = ()

    @property
    def greedy(self) -> bool:
        return bool(self.ranks)

    @property
    def members(self) -> int:
        return int((self.ranks or self.q_rows)[0].shape[1])

    def positions(self, i: int) -> int:
        return int((self.ranks or self.p_rows)[i].shape[0])

    def to_json(self, rows_file: str | None = None) -> dict:
        """JSON for a profile; whole laws go to ``rows_file`` (an .npz, float16), named in the JSON."""
        if self.greedy:
            return {"ranks": [r.tolist() for r in self.ranks]}
        assert rows_file, "whole laws need a rows file"
        arrays = {f"p{i}": x.astype(np.float16) for i, x in enumerate(self.p_rows)}
        arrays.update({f"q{i}": x.astype(np.float16) for i, x in enumerate(self.q_rows)})
        np.savez_compressed(rows_file, **arrays)
        return {"rows_file": str(rows_file), "prompts": len(self.p_rows)}

    @classmethod
    def from_json(cls, doc: dict) -> Replay:
        if "ranks" in doc:
            return cls(ranks=tuple(np.asarray(r, dtype=np.int64).reshape(len(r), -1) for r in doc["ranks"]))
        with np.load(doc["rows_file"]) as z:
            norm = [(z[f"p{i}"].astype(float), z[f"q{i}"].astype(float)) for i in range(doc["prompts"])]
        return cls(p_rows=tuple(p / p.sum(-1, keepdims=True) for p, _ in norm),
                   q_rows=tuple(q / q.sum(-1, keepdims=True) for _, q in norm))


def union_tree(tree: Tree, k: int) -> Tree:
    """K copies of ``tree`` under one root, first-level siblings interleaved (copy c's rank-r child gets rank
    r·K + c): the merged tree's node budget when no prefix is shared (what SpecInfer's step is priced at)."""
    if tree.size == 1 or k == 1:
        return tree
    return Tree.from_paths([(p[0] * k + c, *p[1:]) for c in range(k) for p in tree.choice_paths])


def member_and_union(tree: Tree, k: int) -> tuple[Tree, Tree]:
    """(member tree, merged budget) of a SpecInfer run given either: the union of k copies (the drafter's
    ``tree``) or the member tree itself (a Sequoia tree chosen before the drafter was built)."""
    member = split_union(tree, k)
    if union_tree(member, k) == tree:
        return member, tree
    return tree, union_tree(tree, k)


def split_union(tree: Tree, k: int) -> Tree:
    """The member tree of a union of k copies whose first-level siblings interleave (copy c's rank-r child has
    rank r·k + c: methods.drafters.specinfer.union_tree) — copy 0's paths, ranks divided back."""
    if k == 1 or tree.size == 1:
        return tree
    return Tree.from_paths([(p[0] // k, *p[1:]) for p in tree.choice_paths if p[0] % k == 0])


def _roots(n: int, depth: int) -> range:
    """Root positions whose whole walk (``depth`` drafts) stays inside a trajectory of n positions."""
    last = n - depth
    return range(0, last + 1) if last >= 0 else range(0, n)


def _greedy_walk(ranks: np.ndarray, t: int, tree: Tree, kids: list[dict[int, int]]) -> int:
    """Drafts accepted from root position t at temperature 0: the deepest member path the ranks trace."""
    alive = {k: 0 for k in range(ranks.shape[1])}
    d = 0
    while alive and t + d < ranks.shape[0]:
        row = ranks[t + d]
        alive = {k: kids[v][int(row[k])] for k, v in alive.items() if int(row[k]) in kids[v]}
        d += 1 if alive else 0
    return d


def _mss_node(alive: dict[int, tuple[int, ...]], tree: Tree, law: tuple[np.ndarray, np.ndarray],
              rng: np.random.Generator) -> dict[int, tuple[int, ...]]:
    """One merged node under MSS. ``alive``: each draft still on the accepted path → its member nodes that
    merged into this node (a draft that drew one token twice has two). The drafts' draws in merge order
    (draft by draft, node order) are tested in turn; the drafts that drew the accepted token go on to every
    child of theirs holding it; {} = every draw rejected."""
    p, qs = law
    draws = []  # (draft, member child, token)
    for k, nodes in sorted(alive.items()):
        kids = sorted(c for v in nodes for c in tree.children[v])
        if kids:
            xs = np.searchsorted(np.cumsum(qs[k]), rng.random(len(kids)) * qs[k].sum(), side="right")
            draws += [(k, c, int(min(x, qs.shape[1] - 1))) for c, x in zip(kids, xs)]
    for k, _, x in draws:
        if rng.random() * qs[k, x] < p[x]:  # accept w.p. min(1, p_j(x) / q_k(x))
            nxt: dict[int, tuple[int, ...]] = {}
            for k2, c2, x2 in draws:
                if x2 == x:
                    nxt[k2] = (*nxt.get(k2, ()), c2)
            return nxt
        r = np.maximum(p - qs[k], 0.0)
        p = r / r.sum() if r.sum() > 1e-12 else p
    return {}


def _sampled_walk(replay: Replay, i: int, t: int, tree: Tree, rng: np.random.Generator) -> int:
    alive: dict[int, tuple[int, ...]] = {k: (0,) for k in range(replay.members)}
    n, d = replay.positions(i), 0
    while alive and t + d < n:
        s = t + d
        alive = _mss_node(alive, tree, (replay.p_rows[i][s], replay.q_rows[i][s]), rng)
        d += 1 if alive else 0
    return d


def accepted_law(replay: Replay, tree: Tree, reps: int = 16, seed: int = 0) -> np.ndarray:
    """(tree.depth + 2,) pmf of τ (accepted drafts + the bonus token; pmf[0] = 0) of the merged tree of the
    replay's K drafts, each filling ``tree``. Temperature 0: over the steps of the greedy loop replayed on
    each trajectory from its first position, each step rooted where the last one ended and the steps the
    trajectory's end would cut left out (as specsim.replay.loop_law for one drafter). Every root position
    weighed alike instead reads τ low where acceptance comes in runs: a root inside an easy run walks only
    to the run's end, where the loop roots its steps after a miss, at a run's start (SpecInfer's 61-node
    tree on prose T = 0, 48 test prompts: τ −8.0%, s.e. 2.8%). Temperature > 0: over every root position
    (the sampled walk leaves the trajectory, so the loop cannot be replayed on it)."""
    counts = np.zeros(tree.depth + 2)
    if tree.size == 1:
        counts[1] = 1.0
        return counts
    if replay.greedy:  # the loop itself: each step rooted where the last one ended (specsim.replay.loop_law)
        kids, every = child_by_rank(tree), np.zeros_like(counts)
        for ranks in replay.ranks:
            for a, counted in loop_steps(ranks.shape[0], tree.depth,
                                         lambda t, ranks=ranks: _greedy_walk(ranks, t, tree, kids)):
                every[1 + a] += 1
                counts[1 + a] += counted  # a step the trajectory's end would cut is not counted
        counts = counts if counts.sum() > 0 else every  # trajectories shorter than the tree: every step
    else:
        rng = np.random.default_rng(seed)
        for i in range(len(replay.p_rows)):
            for t in _roots(replay.positions(i), tree.depth):
                for _ in range(reps):
                    counts[1 + _sampled_walk(replay, i, t, tree, rng)] += 1
    assert counts.sum() > 0, "the replay has no position"
    return counts / counts.sum()


def expected_tokens(replay: Replay, tree: Tree, reps: int = 16, seed: int = 0) -> float:
    """τ of the merged tree (see :func:`accepted_law`)."""
    law = accepted_law(replay, tree, reps, seed)
    return float(np.dot(np.arange(law.size), law))


def member_ranks(target_tokens: Sequence[int], logits_by_member: Sequence[np.ndarray], width: int
                 ) -> np.ndarray:
    """(T, K) rank of each position's target token in each draft's logits row (−1 beyond ``width``); ties by
    the lower token id, as a top-k that sorts stably."""
    tok = np.asarray(target_tokens)
    out = np.full((tok.size, len(logits_by_member)), -1, dtype=np.int64)
    for k, logits in enumerate(logits_by_member):
        x = np.asarray(logits)
        at = x[np.arange(tok.size), tok][:, None]
        ahead = (x > at).sum(1) + ((x == at) & (np.arange(x.shape[1])[None] < tok[:, None])).sum(1)
        out[:, k] = np.where(ahead < width, ahead, -1)
    return out
