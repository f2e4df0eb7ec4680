"""Expected accepted tokens k̄ (τ, the bonus token included) of a draft tree, and its full law.

Leviathan et al. (2023) give the chain closed form k̄ = (1 − α^{γ+1}) / (1 − α). For any tree and any
acceptance model (specsim.acceptance) the accepted path is a walk from the root: at an accepted node the
child of rank r is accepted with ``prob(depth, rank)`` or the walk stops. τ = depth of the last accepted
node + 1, so k̄ = Σ_nodes P(node on the accepted path) (the root counts 1) — Sequoia's objective.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specsim.acceptance import AcceptanceLike, IIDAcceptance, as_acceptance
from specsim.cost import CostModel
from specsim.tree import Tree


def chain_expected_tokens(alpha: float | np.ndarray, gamma: int | np.ndarray) -> float | np.ndarray:
    """k̄ of a chain of γ drafts with i.i.d. α: (1 − α^{γ+1}) / (1 − α), → γ + 1 as α → 1."""
    a = np.asarray(alpha, dtype=float)
    g = np.asarray(gamma, dtype=float)
    near_one = np.abs(1.0 - a) < 1e-9
    with np.errstate(divide="ignore", invalid="ignore"):
        closed = (1.0 - a ** (g + 1.0)) / (1.0 - a)
    out = np.where(near_one, g + 1.0, closed)
    return float(out) if out.ndim == 0 else out


def edge_probs(tree: Tree, acceptance: AcceptanceLike) -> np.ndarray:
    """(N,) P(node accepted | parent accepted); the root's entry is 1."""
    model = as_acceptance(acceptance)
    q = np.ones(tree.size)
    if tree.size > 1:
        q[1:] = model.prob(tree.depths[1:], np.asarray(tree.ranks[1:]))
    return q


def path_probs(tree: Tree, acceptance: AcceptanceLike) -> np.ndarray:
    """(N,) P(node is on the accepted path) = product of its (and its ancestors') edge marginals."""
    q = edge_probs(tree, acceptance)
    reach = np.ones(tree.size)
    for i in range(1, tree.size):  # parents precede children
        reach[i] = reach[tree.parents[i]] * q[i]
    return reach


def expected_tokens(tree: Tree, acceptance: AcceptanceLike) -> float:
    """k̄ of any tree: Σ_v P(v accepted), root = 1. ``acceptance`` is a model (specsim.acceptance) or a
    raw Sequoia vector ``[0, p_1, …, p_W, p_none]`` (child of 0-based rank r accepted with p[r + 1])."""
    return float(path_probs(tree, acceptance).sum())


def accepted_length_law(tree: Tree, acceptance: AcceptanceLike) -> np.ndarray:
    """(depth + 2,) pmf of τ: ``pmf[k] = P(τ = k)``, k = 0 … depth + 1 (``pmf[0] = 0``; τ >= 1).

    The walk ends at v with P(v accepted) · (1 − Σ_children P(child | v)), and then τ = depth(v) + 1.
    """
    q = edge_probs(tree, acceptance)
    reach = path_probs(tree, acceptance)
    go_on = np.zeros(tree.size)
    np.add.at(go_on, np.asarray(tree.parents[1:], dtype=np.int64), q[1:])
    stop = reach * np.clip(1.0 - go_on, 0.0, 1.0)
    pmf = np.zeros(tree.depth + 2)
    np.add.at(pmf, tree.depths + 1, stop)
    return pmf


def forwards_to_generate(law: np.ndarray, n_tokens: int) -> float:
    """E[target forwards] to emit ``n_tokens`` when a step emits k tokens with ``law[k]`` (k >= 1, bonus
    included) independently, and the last step's tokens beyond ``n_tokens`` are cut (a decode loop with
    max_new_tokens): F(n) = 1 + Σ_k law[k] · F(n − k), F(n <= 0) = 0. A finite generation emits fewer
    tokens per forward than τ: the last step's accepted drafts past the budget are wasted."""
    law = np.asarray(law, dtype=float)
    assert n_tokens >= 0 and law.ndim == 1 and law.size >= 2, (n_tokens, law.shape)
    ks = np.arange(law.size)
    f = np.zeros(n_tokens + 1)
    for n in range(1, n_tokens + 1):
        f[n] = 1.0 + float((law * f[np.maximum(n - ks, 0)]).sum())
    return float(f[n_tokens])


def forwards_law(law: np.ndarray, n_tokens: int) -> np.ndarray:
    """(n_tokens + 1,) pmf of the number of target forwards F that emit ``n_tokens`` (steps emitting k tokens
    with ``law[k]``, independently; the last step cut at the budget): ``pmf[s] = P(F = s)``. Its mean is
    :func:`forwards_to_generate`."""
    law = np.asarray(law, dtype=float)
    assert n_tokens >= 1 and law.ndim == 1 and law.size >= 2, (n_tokens, law.shape)
    left = np.zeros(n_tokens + 1)  # P(n tokens still to emit after s steps), n = 0 … n_tokens
    left[n_tokens] = 1.0
    pmf = np.zeros(n_tokens + 1)
    for s in range(1, n_tokens + 1):  # every step emits >= 1 token: at most n_tokens steps
        nxt = np.zeros_like(left)
        for k in range(1, law.size):
            nxt[: max(n_tokens + 1 - k, 0)] += law[k] * left[k:]
            nxt[0] += law[k] * left[1 : min(k, n_tokens + 1)].sum()  # overshoot: cut at the budget
        pmf[s] = nxt[0]
        nxt[0] = 0.0
        left = nxt
    return pmf


def room_visits(law: np.ndarray, n_tokens: int) -> np.ndarray:
    """(n_tokens + 1,) expected steps of a generation of ``n_tokens`` that start with r tokens left
    (r = 0 … n_tokens; entry 0 is 0), steps emitting k tokens with ``law[k]`` independently, the last one cut
    at the budget: u(N) = 1, u(r) = Σ_k law[k] · u(r + k) (a step started at r + k that emits k < r + k
    leaves r). Σ_r u(r) = :func:`forwards_to_generate`: the rooms the run's steps see, the cut last ones
    (r below the tree's depth) among them."""
    law = np.asarray(law, dtype=float)
    assert n_tokens >= 1 and law.ndim == 1 and law.size >= 2, (n_tokens, law.shape)
    u = np.zeros(n_tokens + 1)
    u[n_tokens] = 1.0
    for r in range(n_tokens - 1, 0, -1):
        k = np.arange(1, min(law.size, n_tokens - r + 1))
        u[r] = float((law[k] * u[r + k]).sum())
    return u


def batch_forwards(law: np.ndarray, n_tokens: int, batch: int) -> float:
    """E[max over ``batch`` rows of their forwards] to emit ``n_tokens`` each: a static batch steps until its
    slowest row is done (rows decoded alone need :func:`forwards_to_generate`; batch = 1 is that)."""
    cdf = np.cumsum(forwards_law(law, n_tokens))
    return float(np.sum(1.0 - np.clip(cdf[:-1], 0.0, 1.0) ** int(batch)))


def tokens_per_forward(law: np.ndarray, n_tokens: int) -> float:
    """Tokens emitted per target forward by a generation of ``n_tokens`` (→ τ as n_tokens → ∞)."""
    if n_tokens <= 0:
        return float(np.dot(np.arange(len(law)), law))
    return n_tokens / forwards_to_generate(law, n_tokens)


@dataclass(frozen=True)
class GammaChoice:
    gamma: int
    expected_tokens: float
    speedup: float


def optimal_gamma(acceptance: float | AcceptanceLike, cost: CostModel, max_gamma: int = 32) -> GammaChoice:
    """Chain length γ in 0..max_gamma maximising S(γ) = k̄(γ) · t_AR / t_step(γ) under ``cost``.
    A float ``acceptance`` is an i.i.d. α. γ = 0 is plain decoding (S = 1)."""
    model = IIDAcceptance(float(acceptance)) if np.isscalar(acceptance) else as_acceptance(acceptance)
    best = GammaChoice(0, 1.0, cost.speedup(Tree.chain(0), 1.0))
    for gamma in range(1, max_gamma + 1):
        chain = Tree.chain(gamma)
        k = expected_tokens(chain, model)
        s = cost.speedup(chain, k)
        if s > best.speedup:
            best = GammaChoice(gamma, k, s)
    return best
