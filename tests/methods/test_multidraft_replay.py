"""specsim.multidraft against the real thing: K drafts' trees merged by methods.drafters.specinfer.merge and
verified by methods.core.verify, in a synthetic world where every position s has its own laws p_s and q_{k,s}
(independent of the tokens before it, so the replay's use of positions is exact there). Greedy: the replay's
τ equals the verifier's at every root. Sampled (MSS): the replay's law of τ matches a Monte Carlo of the
verifier within its sampling error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from methods.core.drafter import Draft
from methods.core.verify import verify_greedy, verify_specinfer
from methods.drafters.specinfer import merge, union_tree
from specsim.multidraft import Replay, accepted_law, member_and_union, member_ranks, split_union
from specsim.tree import Tree

V, K, N = 8, 3, 14  # vocabulary, drafts, positions
TREE = Tree.from_paths([[0], [0, 0], [0, 1], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]])  # a branch at depth 2


def _world(seed: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N+1, V) target laws, (K, N+1, V) draft laws (each draft near p, and drafts near each other), and the
    trajectory's tokens y (N+1,) (y[s] follows position s: p_s's argmax, or a draw at temperature > 0)."""
    g = torch.Generator().manual_seed(seed)
    logit_p = 2.5 * torch.randn(N + 1, V, generator=g)
    shared = torch.randn(N + 1, V, generator=g)
    logit_q = logit_p[None] + shared[None] + 0.8 * torch.randn(K, N + 1, V, generator=g)
    if temperature == 0:
        return logit_p, logit_q, logit_p.argmax(-1)
    p, q = logit_p.softmax(-1), logit_q.softmax(-1)
    return p, q, torch.multinomial(p, 1, generator=g)[:, 0]


def _member_draft(q: torch.Tensor, t: int, sampled: bool, g: torch.Generator) -> Draft:
    """Draft k's tree from root position t: node v's children come from q at position t + depth(v)."""
    depths = TREE.depths
    tokens = [0]
    for v in range(1, TREE.size):
        row = q[t + depths[TREE.parents[v]]]
        tok = torch.multinomial(row, 1, generator=g).item() if sampled else int(row.argsort(descending=True)[
            TREE.ranks[v]])
        tokens.append(tok)
    rows = torch.stack([q[t + int(d)] for d in depths]) if sampled else None
    return Draft(TREE, torch.tensor(tokens), rows / rows.sum(-1, keepdim=True) if sampled else None)


def _real_tau(p: torch.Tensor, q: torch.Tensor, t: int, sampled: bool, g: torch.Generator) -> int:
    merged = merge([_member_draft(q[k], t, sampled, g) for k in range(K)], sampled).draft
    rows = torch.stack([p[t + int(d)] for d in merged.tree.depths])  # the target after each node
    if sampled:
        res = verify_specinfer(merged, rows, g)
    else:
        res = verify_greedy(merged, torch.zeros_like(rows).scatter_(-1, rows.argmax(-1, keepdim=True), 1.0))
    return len(res.accepted)  # accepted drafts + the bonus token


def test_split_union_inverts_the_drafters_union():
    for tree in (TREE, Tree.chain(4), Tree.from_paths([[0], [1], [0, 0], [2]])):
        assert split_union(union_tree(tree, K), K) == tree
        assert member_and_union(union_tree(tree, K), K) == (tree, union_tree(tree, K))
        assert member_and_union(tree, K) == (tree, union_tree(tree, K))  # given the member tree itself


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_replay_is_exact(seed):
    logit_p, logit_q, y = _world(seed, 0.0)
    ranks = member_ranks(y[:N].numpy(), [logit_q[k, :N].numpy() for k in range(K)], width=V)
    law = accepted_law(Replay(ranks=(ranks,)), TREE)
    depth = TREE.depth
    real, t = [], 0  # the loop: each step rooted where the last one ended, while the tree's depth is left
    while t <= N - depth:
        real.append(_real_tau(logit_p, logit_q, t, False, torch.Generator()))
        t += real[-1]
    expect = np.bincount(real, minlength=depth + 2) / len(real)
    np.testing.assert_allclose(law, expect)
    assert 1.5 < np.dot(np.arange(law.size), law)  # the world is not trivial: drafts are often right


def test_greedy_replay_walks_the_loop_not_every_root():
    """Both drafts right three positions running, then wrong, over and over: the loop roots each step after
    a miss and accepts 3 of a chain of 4 (τ = 4 every step); every root weighed alike would read
    (4 + 3 + 2 + 1) / 4 = 2.5."""
    ranks = np.array([[0, 0], [0, 0], [0, 0], [-1, -1]] * 10)
    law = accepted_law(Replay(ranks=(ranks,)), Tree.chain(4))
    assert law[4] == pytest.approx(1.0)


@pytest.mark.slow
def test_sampled_replay_matches_the_verifier(tmp_path):
    p, q, _ = _world(5, 1.0)
    replay = Replay(p_rows=(p[:N].double().numpy(),), q_rows=(q[:, :N].permute(1, 0, 2).double().numpy(),))
    doc = replay.to_json(str(tmp_path / "rows.npz"))  # whole laws beside the profile, float16
    assert Replay.from_json(doc).members == K
    np.testing.assert_allclose(Replay.from_json(doc).p_rows[0], replay.p_rows[0], atol=1e-3)
    law = accepted_law(replay, TREE, reps=400, seed=1)
    roots = range(N - TREE.depth + 1)
    g = torch.Generator().manual_seed(3)
    real = np.array([_real_tau(p, q, t, True, g) for t in roots for _ in range(400)], dtype=float)
    tau = np.dot(np.arange(law.size), law)
    se = real.std() / np.sqrt(real.size) * np.sqrt(2)  # both sides are Monte Carlo of equal size
    assert abs(tau - real.mean()) < 4 * se, (tau, real.mean(), se)
    expect = np.bincount(real.astype(int), minlength=law.size) / real.size
    assert np.abs(law - expect).max() < 0.03
    # the replay keeps the drafts' correlation: a per-depth product of marginals would not give this law
    assert tau > 1.3
