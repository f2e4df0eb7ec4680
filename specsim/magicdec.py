"""MagicDec (Chen et al. 2024, arXiv 2408.11049): speculative decoding at batch size B on long contexts, where
a decode step reads the KV cache of B sequences of L tokens as well as the weights, and a self-speculative
draft that keeps a fixed sparse KV budget K (StreamingLLM) stays cheap while B·L grows: the speedup rises.

Priced with the one batch cost model, specsim.batch.BatchRoofline t(B, n) (weights once per forward, B rows
of KV, B·n tokens of GEMM and attention FLOPs, tensor parallelism over ``tp`` GPUs with its ring
all-reduces by bandwidth); the draft is the same target over a context of K cached tokens. Each forward may
also pay a fixed ``per_forward_s`` (the all-reduces' own latency, :func:`collective_latency_s`), which weighs
most at small batch:

    S(B) = τ(α, γ) · (t(B, 1; L) + f) / (γ · (t(B, 1; K) + f) + t(B, γ + 1; L) + f)   (chain of γ, i.i.d. α)
"""

from __future__ import annotations

from specsim.batch import BatchRoofline
from specsim.expected import chain_expected_tokens


def collective_latency_s(n_layers: int, latency_us: float, per_layer: int = 2, fixed: int = 0) -> float:
    """Seconds of all-reduce latency one tensor-parallel forward pays beyond its bytes: ``per_layer`` calls
    per decoder layer (after the attention output and after the MLP) plus ``fixed`` more (a vocab-parallel
    argmax), each ``latency_us``."""
    assert n_layers >= 0 and per_layer >= 0 and fixed >= 0 and latency_us >= 0, "counts and latency >= 0"
    return (per_layer * n_layers + fixed) * latency_us * 1e-6


def forward_times(cost: BatchRoofline, batch: int, context: int, budget: int, gamma: int,
                  per_forward_s: float = 0.0) -> tuple[float, float, float]:
    """Seconds of one baseline forward (1 token over ``context``), one draft forward (1 token over the
    ``budget``) and the verification (γ + 1 tokens over ``context``), each with ``per_forward_s``."""
    full, sparse = cost.at_context(context), cost.at_context(budget)
    f = float(per_forward_s)
    return (float(full.time(batch, 1)) + f, float(sparse.time(batch, 1)) + f,
            float(full.time(batch, gamma + 1)) + f)


def self_spec_speedup(cost: BatchRoofline, batch: int, context: int, budget: int, gamma: int,
                      alpha: float, per_forward_s: float = 0.0) -> float:
    """S(B) of MagicDec's self-speculation: the target drafts γ tokens over a KV budget of ``budget`` tokens
    (StreamingLLM: sink + window) and verifies γ + 1 over its full ``context``; every forward (the baseline's,
    each draft's and the verification) adds ``per_forward_s``."""
    ar, draft, verify = forward_times(cost, batch, context, budget, gamma, per_forward_s)
    return float(chain_expected_tokens(alpha, gamma)) * ar / (gamma * draft + verify)


def verify_ratio_for(cost: BatchRoofline, batch: int, context: int, budget: int, gamma: int, alpha: float,
                     speedup: float, per_forward_s: float = 0.0) -> float:
    """A diagnostic, never an input: the verification's time, in baseline forwards, that would give
    ``speedup`` at ``alpha`` with the drafts priced as modelled: (τ / S · t_AR − γ · t_draft) / t_AR. The
    model's own ratio is t(B, γ + 1; L) / t(B, 1; L), near 1 where the KV cache dominates."""
    ar, draft, _ = forward_times(cost, batch, context, budget, gamma, per_forward_s)
    step = float(chain_expected_tokens(alpha, gamma)) / speedup * ar
    return (step - gamma * draft) / ar
