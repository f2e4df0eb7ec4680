"""Verification of a draft tree against the target — pure functions chosen by config (p = target, q = draft).

Leviathan et al. 2023, Alg. 1 (chain rejection sampling with the bonus token); SpecInfer (Miao et al. 2024,
multi-step speculative sampling, children drawn with replacement, or each from its own draft's law in a
merged tree of several drafts); Sequoia (Chen et al. 2024, without
replacement); recursive rejection for deterministic drafts (q one-hot: EAGLE-2/3, lookahead, n-gram, top-k);
Medusa's typical acceptance (Cai et al. 2024) — LOSSY. p: (N, V) processed target probabilities, row i = law
of the token after node i's path; randomness from a torch.Generator or any `sampling.Randomness`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from methods.core.drafter import Draft
from methods.core.sampling import Randomness, as_randomness
from specsim.config import Verifier
from specsim.tree import Tree

Source = torch.Generator | Randomness


class VerifyError(ValueError):
    """The draft does not fit the configured verifier (shape, missing q, a tree for the chain verifier)."""


@dataclass(frozen=True)
class VerifyResult:
    accepted: tuple[int, ...]  # node path, root first (len = accepted drafts + 1)
    next_token: int  # the bonus / corrected token: the next root


# ---- shared math -------------------------------------------------------------------------------------
def _tol(x: Tensor) -> float:
    """Residual masses at or below this are rounding noise (a few ulps of a row summing to 1)."""
    return 16 * torch.finfo(x.dtype).eps


def _ratio(px: Tensor, qx: Tensor) -> Tensor:
    """min(1, p(x)/q(x)); 1 when q(x) = 0 < p(x) (the limit), 0 when p(x) = 0. Never inf or NaN."""
    return (px / qx.clamp_min(torch.finfo(qx.dtype).tiny)).clamp(max=1.0)


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(p − q, 0)) row-wise, falling back to p where that mass is ~0.

    Why the fallback stays exact: the probability of rejecting a draft drawn from q is
    Σ_x q(x)(1 − min(1, p(x)/q(x))) = Σ_x max(p(x) − q(x), 0) — the very mass being normalised. A mass ≤ tol
    means p ≈ q and the branch that reads the residual is reached with probability ≤ tol (0 in exact
    arithmetic), so what it samples moves the output law by at most tol; p is the natural choice."""
    r = (p - q).clamp_min(0)
    m = r.sum(-1, keepdim=True)
    ok = m > _tol(p)
    return torch.where(ok, r / torch.where(ok, m, 1.0), p)


def _renorm(x: Tensor, fallback: Tensor) -> Tensor:
    m = x.sum(-1, keepdim=True)
    ok = m > _tol(x)
    return torch.where(ok, x / torch.where(ok, m, 1.0), fallback)


# ---- chain: the contract of docs/architecture.md ---------------------------------------------------
def chain_rejection(p: Tensor, q: Tensor, draft_tokens: Tensor, generator: Source) -> tuple[int, int]:
    """Leviathan Alg. 1 with the bonus token. p: (γ+1, V) target probs, q: (γ, V) draft probs, draft_tokens:
    (γ,) long, x_i drawn from q[i]. Accept x_i with probability min(1, p_i(x_i)/q_i(x_i)), left to right; at
    the first rejection n sample from norm(max(p_n − q_n, 0)); if all γ are accepted sample the bonus from
    p_γ. Returns (n_accepted, next_token). One host sync; vectorised over γ."""
    gamma = draft_tokens.shape[0]
    if p.dim() != 2 or q.dim() != 2 or p.shape[0] != gamma + 1 or q.shape != (gamma, p.shape[1]):
        raise VerifyError(f"chain_rejection: need p (γ+1, V), q (γ, V) for γ={gamma}; got "
                          f"p {tuple(p.shape)}, q {tuple(q.shape)}")
    idx = torch.arange(gamma, device=p.device)
    accept = _ratio(p[idx, draft_tokens], q[idx, draft_tokens])  # (γ,)
    then = torch.cat([_residual(p[:-1], q), p[-1:]])  # (γ+1, V): row n = law of the token after n accepts
    # the first *rejection* ends the run: coin j "succeeds" (rejects) with probability 1 − accept_j
    return as_randomness(generator).first_success(1 - accept, then, (True,) * (gamma + 1))


# ---- tree walk shared by the sampling verifiers -------------------------------------------------------
NodeRule = Callable[[Tensor, "Tensor | None", Tensor], tuple[Tensor, Tensor]]


def _walk(draft: Draft, p: Tensor, rng: Randomness, rule: NodeRule) -> VerifyResult:
    """Walk from the root: at each node, `rule(p_row, q_row, child_tokens)` gives the acceptance probability
    of every child *given all earlier siblings were rejected* and the residual to sample from when all are
    rejected; one `first_success` call per level decides (and draws the token when the walk ends there)."""
    tree, path, node = draft.tree, [0], 0
    while True:
        kids = tree.children[node]
        if not kids:  # a leaf (or the root alone): the bonus token from the target
            _, tok = rng.first_success(p.new_zeros(0), p[node][None], (True,))
            return VerifyResult(tuple(path), tok)
        q_row = None if draft.q is None else draft.q[node]
        accept, final = rule(p[node], q_row, draft.tokens[list(kids)])  # (k,), (V,)
        then = torch.cat([p[list(kids)], final[None]])  # (k+1, V): a leaf child ends with its bonus token
        terminal = tuple(not tree.children[c] for c in kids) + (True,)
        i, tok = rng.first_success(accept, then, terminal)
        if i < len(kids):
            node = kids[i]
            path.append(node)
        if terminal[i]:
            return VerifyResult(tuple(path), tok)


def _walk_draws(draft: Draft, p: Tensor, rng: Randomness) -> VerifyResult:
    """SpecInfer's multi-step speculative sampling over per-draw laws (``Draft.draws``: a merged tree of
    several drafts). At node u its children's draws x_j ~ q_j are tested in draw order: accept x_j w.p.
    min(1, p_j(x_j)/q_j(x_j)), on rejection p_{j+1} = norm(max(p_j − q_j, 0)); all rejected: sample
    p_{k+1}. Exact by induction (Miao et al. 2024, Thm. 4.2) because each draw is independent of the earlier
    ones given u's path and the order was fixed before drawing. A merged node's later draw of a token
    already rejected at u is accepted with probability 0 (rejecting x from q_j means p_j(x) < q_j(x), so
    p_{j+1}(x) = 0), yet it still shapes the residual, as it does in the unmerged tree; once accepted, the
    walk goes on with the children every proposer of the node drew below it."""
    tree, draws = draft.tree, draft.draws
    nodes = draws.node.tolist()
    by_parent: dict[int, list[int]] = {}
    for j, n in enumerate(nodes):
        by_parent.setdefault(tree.parents[n], []).append(j)
    path, node = [0], 0
    while True:
        js = by_parent.get(node)
        if not js:  # a leaf: the bonus token from the target
            _, tok = rng.first_success(p.new_zeros(0), p[node][None], (True,))
            return VerifyResult(tuple(path), tok)
        kids = [nodes[j] for j in js]
        accept, final = _per_draw_rule(p[node], draws.q[js].to(p.dtype), draft.tokens[kids])
        then = torch.cat([p[kids], final[None]])  # (k+1, V)
        terminal = tuple(not tree.children[c] for c in kids) + (True,)
        i, tok = rng.first_success(accept, then, terminal)
        if i < len(kids):
            node = kids[i]
            path.append(node)
        if terminal[i]:
            return VerifyResult(tuple(path), tok)


def _per_draw_rule(p: Tensor, qs: Tensor, xs: Tensor) -> tuple[Tensor, Tensor]:
    """Draw j from its own law qs[j] (k, V): the SpecInfer rule with q changing from draw to draw (a one-hot
    row gives the deterministic rule's update: x zeroed, renormalised)."""
    accept = []
    for x, q in zip(xs, qs):
        accept.append(_ratio(p[x], q[x]))
        p = _residual(p, q)
    return torch.stack(accept), p


def _specinfer_rule(p: Tensor, q: Tensor | None, xs: Tensor) -> tuple[Tensor, Tensor]:
    """Children i.i.d. from q: accept x_j w.p. min(1, p_j(x_j)/q(x_j)); on rejection p_{j+1} =
    norm(max(p_j − q, 0)), q unchanged (a later child is independent of the rejected one)."""
    accept = []
    for x in xs:
        accept.append(_ratio(p[x], q[x]))
        p = _residual(p, q)
    return torch.stack(accept), p


def _sequoia_rule(p: Tensor, q: Tensor | None, xs: Tensor) -> tuple[Tensor, Tensor]:
    """Children drawn without replacement: as SpecInfer, but after rejecting x the next child was drawn from
    q with x removed, so q ← norm(q with x zeroed) (Sequoia's Alg.; p is updated with the old q)."""
    accept = []
    for x in xs:
        accept.append(_ratio(p[x], q[x]))
        p = _residual(p, q)
        q = _renorm(q.index_fill(0, x.view(1), 0.0), q)
    return torch.stack(accept), p


def _deterministic_rule(p: Tensor, q: Tensor | None, xs: Tensor) -> tuple[Tensor, Tensor]:
    """One-hot q (tokens are a function of the context): accept x_j w.p. p_j(x_j); on rejection zero x_j
    and renormalise. A duplicate sibling then has p = 0 and is never accepted."""
    accept = []
    for x in xs:
        accept.append(p[x])
        p = _renorm(p.index_fill(0, x.view(1), 0.0), p)
    return torch.stack(accept), p


# ---- checks -------------------------------------------------------------------------------------------
def _check(name: str, draft: Draft, p: Tensor, needs_q: bool = False, chain: bool = False) -> None:
    N = draft.tree.size
    if p.dim() != 2 or p.shape[0] != N:
        raise VerifyError(f"verifier {name}: p must be (N, V) with N = tree size {N}, got {tuple(p.shape)}")
    if chain and draft.tree.width > 1:
        raise VerifyError(f"verifier chain needs a chain draft, got a tree of width {draft.tree.width}; "
                          "use specinfer (sampled trees), sequoia (without replacement) or deterministic")
    if needs_q and N > 1 and (name == "specinfer" or draft.q is None) and draft.draws is not None:
        _check_draws(name, draft, p)
    elif needs_q and N > 1:
        if draft.q is None:
            raise VerifyError(f"verifier {name} needs the draft probabilities q, but the drafter returned "
                              "q=None (a deterministic draft): use verifier=deterministic or greedy")
        if draft.q.shape != p.shape:
            raise VerifyError(f"verifier {name}: q {tuple(draft.q.shape)} must match p {tuple(p.shape)}")


def _check_draws(name: str, draft: Draft, p: Tensor) -> None:
    if name != "specinfer":
        raise VerifyError(f"verifier {name} reads one law per parent (Draft.q); a draft with per-draw laws "
                          "(Draft.draws, several draft models) needs verifier=specinfer")
    d = draft.draws
    if d.q.shape[-1] != p.shape[1]:
        raise VerifyError(f"verifier {name}: draws q {tuple(d.q.shape)} must have V = {p.shape[1]}")
    covered = set(d.node.tolist())
    if 0 in covered or covered != set(range(1, draft.tree.size)):
        raise VerifyError(f"verifier {name}: every non-root node needs at least one draw, and the root none "
                          f"(nodes 1..{draft.tree.size - 1}; draws cover {sorted(covered)})")


# ---- the verifiers (one signature) --------------------------------------------------------------------
def verify_greedy(draft: Draft, p: Tensor, generator: Source | None = None) -> VerifyResult:
    """Follow children whose token is argmax p[node] (ties: lowest index); next token = argmax at the deepest
    accepted node (ties between equal-depth duplicate paths: lowest node index). Lossless for temperature 0.
    Vectorised: no randomness, one host sync."""
    _check("greedy", draft, p)
    tree, tok = draft.tree, draft.tokens
    am = p.argmax(-1)  # (N,)
    if tree.width <= 1:  # chain fast path: nodes 0..γ in order
        n = torch.cumprod((tok[1:] == am[:-1]).int(), 0).sum()
        n_, nxt = torch.stack([n, am[n]]).tolist()
        return VerifyResult(tuple(range(n_ + 1)), nxt)
    dev = p.device
    parents = torch.as_tensor(tree.parents, device=dev).clamp_min(0)
    match = (tok == am[parents]) | (torch.arange(tree.size, device=dev) == 0)  # (N,)
    anc = torch.as_tensor(tree.ancestor_mask, device=dev)  # (N, N)
    ok = ~(anc & ~match).any(-1)  # every node on the path matches
    depth = torch.as_tensor(tree.depths, device=dev)
    best = torch.where(ok, depth, -1).argmax()
    best_, nxt = torch.stack([best, am[best]]).tolist()
    return VerifyResult(tree.path_to(best_), nxt)


def argmax_host(x: Tensor) -> np.ndarray:
    """Argmax over the last axis of scores (..., V) as a host array, the first maximum on ties (torch's and
    numpy's rule). On CPU through numpy: torch's multi-row CPU argmax over V = 4096 took ~100 µs, numpy's
    5 µs; on an accelerator on the device, so that only the indices cross to the host."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return x.detach().numpy().argmax(-1)
    return x.argmax(-1).cpu().numpy()


def argmax_rows(x: Tensor) -> list[int]:
    """Row-wise argmax of (N, V) scores as a list (``argmax_host``)."""
    return argmax_host(x).tolist()


def greedy_path(tree: Tree, tokens: list[int], argmax: list[int]) -> tuple[tuple[int, ...], int]:
    """``verify_greedy`` on the host from the rows' argmax (lists): the same path and next token (deepest
    all-matching node, ties to the lowest index), for the one-sequence loop at temperature 0 — no (N, V)
    one-hot law, no per-step tensors of the tree; one pass over the nodes (parents precede children)."""
    parents, depths = tree.parents, tree.depths
    if tree.width <= 1:  # a chain: nodes 0..γ in order
        n = 0
        while n + 1 < len(tokens) and tokens[n + 1] == argmax[n]:
            n += 1
        return tuple(range(n + 1)), argmax[n]
    ok, best = [True] + [False] * (len(tokens) - 1), 0
    for i in range(1, len(tokens)):
        par = parents[i]
        if ok[par] and tokens[i] == argmax[par]:
            ok[i] = True
            if depths[i] > depths[best]:
                best = i
    return tree.path_to(best), argmax[best]


def _on_chain(draft: Draft, p: Tensor, generator: Source, one_hot: bool = False) -> VerifyResult:
    """A chain draft (nodes 0..γ in order; q rows 0..γ-1 drew nodes 1..γ) through the vectorised
    chain_rejection: with one child per node, SpecInfer, Sequoia and Leviathan coincide, and the
    deterministic rule is Leviathan with one-hot q. One host sync instead of one per level."""
    gamma = draft.tree.size - 1
    xs = draft.tokens[1:]
    if one_hot:
        q = torch.zeros(gamma, p.shape[1], dtype=p.dtype, device=p.device).scatter_(1, xs[:, None], 1.0)
    else:
        q = draft.q[:gamma] if draft.q is not None else p.new_zeros(0, p.shape[1])
    n, tok = chain_rejection(p, q, xs, generator)
    return VerifyResult(tuple(range(n + 1)), tok)


def verify_chain(draft: Draft, p: Tensor, generator: Source) -> VerifyResult:
    """Leviathan Alg. 1 on a chain draft. Lossless."""
    _check("chain", draft, p, needs_q=True, chain=True)
    return _on_chain(draft, p, generator)


def verify_specinfer(draft: Draft, p: Tensor, generator: Source) -> VerifyResult:
    """SpecInfer multi-step speculative sampling; children of node i drawn i.i.d. (with replacement) from
    q[i] — or, with ``Draft.draws`` (a merged tree of several drafts), each child from its own law(s).
    Lossless."""
    _check("specinfer", draft, p, needs_q=True)
    if draft.draws is not None:
        return _walk_draws(draft, p, as_randomness(generator))
    if draft.tree.width <= 1:
        return _on_chain(draft, p, generator)
    return _walk(draft, p, as_randomness(generator), _specinfer_rule)


def verify_sequoia(draft: Draft, p: Tensor, generator: Source) -> VerifyResult:
    """Sequoia: children of node i drawn without replacement from q[i]. Lossless."""
    _check("sequoia", draft, p, needs_q=True)
    if draft.tree.width <= 1:
        return _on_chain(draft, p, generator)
    return _walk(draft, p, as_randomness(generator), _sequoia_rule)


def verify_deterministic(draft: Draft, p: Tensor, generator: Source) -> VerifyResult:
    """Recursive rejection for deterministic drafts (q one-hot; draft.q is ignored). Lossless."""
    _check("deterministic", draft, p)
    if draft.tree.width <= 1:
        return _on_chain(draft, p, generator, one_hot=True)
    return _walk(draft, p, as_randomness(generator), _deterministic_rule)


def verify_typical(
    draft: Draft, p: Tensor, generator: Source, *, epsilon: float = 0.09, delta: float = 0.3
) -> VerifyResult:
    """Medusa typical acceptance — LOSSY (does not preserve the target's law at temperature > 0).

    Node x under parent u passes when p[u](x) > min(ε, δ·exp(−H(p[u]))) (Medusa's posterior_threshold ε and
    posterior_alpha δ, defaults 0.09 / 0.3); the accepted path is the deepest all-passing path, ties broken
    by the largest Σ log p along it (Medusa), then lowest index. The next token is sampled from p at the last
    node restricted to the same typical set (argmax always kept). With one-hot p (temperature 0) this is
    exactly greedy. Departure: exact entropy (Medusa adds 1e-5 inside the log)."""
    _check("typical", draft, p)
    tree, dev = draft.tree, p.device
    parents = torch.as_tensor(tree.parents, device=dev).clamp_min(0)
    threshold = torch.clamp(delta * torch.exp(-torch.special.entr(p).sum(-1)), max=epsilon)  # (N,)
    px = p[parents, draft.tokens]  # (N,) probability of each node under its parent's row
    is_root = torch.arange(tree.size, device=dev) == 0
    passes = (px > threshold[parents]) | is_root
    anc = torch.as_tensor(tree.ancestor_mask, device=dev)  # (N, N)
    ok = ~(anc & ~passes).any(-1)
    loglik = (anc.to(p.dtype) * torch.where(is_root, 0.0, px.clamp_min(1e-30).log())).sum(-1)  # (N,)
    depth = torch.as_tensor(tree.depths, device=dev)
    deepest = torch.where(ok, depth, -1)
    best = torch.where(deepest == deepest.max(), loglik, float("-inf")).argmax()
    row = p[best]
    typical = (row > threshold[best]) | (torch.arange(row.shape[0], device=dev) == row.argmax())
    _, tok = as_randomness(generator).first_success(p.new_zeros(0), (row * typical)[None], (True,))
    return VerifyResult(tree.path_to(int(best)), tok)


VERIFIERS: dict[Verifier, Callable[..., VerifyResult]] = {
    Verifier.greedy: verify_greedy,
    Verifier.chain: verify_chain,
    Verifier.specinfer: verify_specinfer,
    Verifier.sequoia: verify_sequoia,
    Verifier.deterministic: verify_deterministic,
    Verifier.typical: verify_typical,
}


# method.params keys (Medusa's names) that set a verifier's keyword arguments, per verifier
VERIFIER_PARAMS: dict[Verifier, dict[str, str]] = {
    Verifier.typical: {"posterior_threshold": "epsilon", "posterior_alpha": "delta"},
}


def verifier_params(kind: Verifier | str, method_params: Mapping) -> dict[str, float]:
    """The keyword arguments of verifier ``kind`` set in ``method.params`` (typical acceptance's
    posterior_threshold ε / posterior_alpha δ); other verifiers take none, and keys of other verifiers are
    ignored (a medusa preset carries the typical keys whatever verifier a run picks)."""
    names = VERIFIER_PARAMS.get(Verifier(kind), {})
    return {kw: float(method_params[key]) for key, kw in names.items() if key in method_params}


def verify(kind: Verifier | str, draft: Draft, p: Tensor, generator: Source, **params: float) -> VerifyResult:
    """Dispatch to the configured verifier; `params` go to it by name (only typical takes any: epsilon,
    delta), so a misspelt parameter raises TypeError instead of being swallowed."""
    return VERIFIERS[Verifier(kind)](draft, p, generator, **params)


# ---- exact acceptance at one node (the calibration's star trees, methods.measurement.calibrate) ----------
NODE_RULES: dict[Verifier, NodeRule] = {
    Verifier.specinfer: _specinfer_rule,
    Verifier.sequoia: _sequoia_rule,
    Verifier.deterministic: _deterministic_rule,
}


def rank_law(kind: Verifier | str, p: Tensor, q: Tensor | None, xs: Tensor) -> Tensor:
    """The law of the accepted child's rank at one node whose children are ``xs`` (k,) in order, the
    verifier's coin flips integrated out: P(rank i) = a_i Π_{j<i} (1 − a_j), a_j the node rule's acceptance of
    child j given the earlier siblings rejected (what ``_walk`` flips). p: (V,) the target law at the node,
    q: (V,) the law the children were drawn from (None for a one-hot rule). Returns (k,); none accepted is
    1 − its sum. Exact given the children: it is the expectation of the rank's indicator over the flips,
    so its mean over draws equals the flipped verifier's and its variance is smaller (Rao-Blackwell)."""
    kind = Verifier(kind)
    if kind not in NODE_RULES:
        raise VerifyError(f"rank_law: no per-node rule for verifier {kind.value} (one of "
                          f"{', '.join(v.value for v in NODE_RULES)})")
    if xs.numel() == 0:
        return p.new_zeros(0)
    accept, _ = NODE_RULES[kind](p, q, xs)
    reached = torch.cumprod(torch.cat([accept.new_ones(1), 1 - accept[:-1]]), 0)  # all earlier rejected
    return reached * accept
