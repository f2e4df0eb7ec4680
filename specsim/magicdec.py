"""MagicDec (Chen et al. 2024, arXiv 2408.11049): speculative decoding at batch size B on long contexts, where
a decode step reads the KV cache of B sequences of L tokens as well as the weights, and a self-speculative
draft that keeps a fixed sparse KV budget K (StreamingLLM) stays cheap while B·L grows: the speedup rises.

A minimal batch pricing, kept apart on purpose: it should be reconciled with the batch cost model t(B, n) of
specsim.cost (branch batch-sim), which replaces ``BatchCost`` when merged. Per decode forward, with tensor
parallelism over ``tp`` GPUs (weights and KV heads split, two all-reduces per layer of B·n·h activations):

    t(B, n, L) = max(memory, compute) + all-reduce
        memory     = (W + B·L·kv_bytes_per_token) / (tp · BW)
        compute    = 2·P·B·n / (tp · FLOP/s)
        all-reduce = 2·layers · 2(tp − 1)/tp · B·n·h·bytes / link BW      (ring all-reduce)
    S(B) = τ(α, γ) · t(B, 1, L) / (γ · t(B, 1, K) + t(B, γ + 1, L))     (chain of γ, i.i.d. α, Leviathan)
"""

from __future__ import annotations

from dataclasses import dataclass

from specsim.cost import ModelShape
from specsim.expected import chain_expected_tokens


@dataclass(frozen=True)
class BatchCost:
    model: ModelShape
    bandwidth: float  # bytes/s achieved per GPU
    flops: float  # FLOP/s achieved per GPU
    tp: int = 1  # tensor-parallel GPUs
    link: float = 0.0  # bytes/s per GPU for the all-reduce (NVLink); 0 = no all-reduce priced
    overhead_s: float = 0.0  # per forward

    memory_bytes: float = 0.0  # per GPU; 0 = unchecked

    def fits(self, batch: int, kv_tokens: int) -> bool:
        """Weights and B sequences of KV fit in the GPUs' memory (activations and workspace ignored)."""
        need = self.model.weight_bytes + batch * kv_tokens * self.model.kv_bytes_per_token
        return self.memory_bytes <= 0 or need <= self.tp * self.memory_bytes

    def time(self, batch: int, n: int, kv_tokens: int) -> float:
        m = self.model
        memory = (m.weight_bytes + batch * kv_tokens * m.kv_bytes_per_token) / (self.tp * self.bandwidth)
        compute = 2.0 * m.params * batch * n / (self.tp * self.flops)
        reduce = 0.0
        if self.tp > 1 and self.link > 0:
            ring = 2 * (self.tp - 1) / self.tp  # a ring all-reduce moves 2(tp − 1)/tp of the message per GPU
            volume = 2 * m.n_layers * ring * batch * n * m.hidden_size * m.bytes_per_param
            reduce = volume / self.link
        return self.overhead_s + max(memory, compute) + reduce


def self_spec_speedup(cost: BatchCost, batch: int, context: int, budget: int, gamma: int,
                      alpha: float) -> float:
    """S(B) of MagicDec's self-speculation: the target drafts γ tokens over a KV budget of ``budget`` tokens
    (StreamingLLM: sink + window) and verifies γ + 1 over its full ``context``."""
    tau = float(chain_expected_tokens(alpha, gamma))
    step = gamma * cost.time(batch, 1, budget) + cost.time(batch, gamma + 1, context)
    return tau * cost.time(batch, 1, context) / step
