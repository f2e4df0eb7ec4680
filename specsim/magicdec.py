"""MagicDec (Chen et al. 2024, arXiv 2408.11049): speculative decoding at batch size B on long contexts, where
a decode step reads the KV cache of B sequences of L tokens as well as the weights, and a self-speculative
draft that keeps a fixed sparse KV budget K (StreamingLLM) stays cheap while B·L grows: the speedup rises.

Priced with the one batch cost model, specsim.batch.BatchRoofline t(B, n) (weights once per forward, B rows
of KV, B·n tokens of GEMM and attention FLOPs, tensor parallelism over ``tp`` GPUs with its ring
all-reduces); the draft is the same target over a context of K cached tokens:

    S(B) = τ(α, γ) · t(B, 1; L) / (γ · t(B, 1; K) + t(B, γ + 1; L))     (chain of γ, i.i.d. α, Leviathan)
"""

from __future__ import annotations

from specsim.batch import BatchRoofline
from specsim.expected import chain_expected_tokens


def self_spec_speedup(cost: BatchRoofline, batch: int, context: int, budget: int, gamma: int,
                      alpha: float) -> float:
    """S(B) of MagicDec's self-speculation: the target drafts γ tokens over a KV budget of ``budget`` tokens
    (StreamingLLM: sink + window) and verifies γ + 1 over its full ``context``."""
    full, sparse = cost.at_context(context), cost.at_context(budget)
    tau = float(chain_expected_tokens(alpha, gamma))
    step = gamma * sparse.time(batch, 1) + full.time(batch, gamma + 1)
    return tau * full.time(batch, 1) / step
