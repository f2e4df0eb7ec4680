"""Sequential multi-token prediction (MTP) modules, DeepSeek-V3 style (DeepSeek-AI 2024, section 2.2), on a
frozen target p (the embedding and LM head are the target's own, shared and frozen).

Module k = 1..D at position i reads the previous depth's hidden state h^{k-1}_i (h^0: the target's last
hidden state, after its final norm) and the embedding of token x_{i+k}:
    h'_i = M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(x_{i+k}))],   h^k = TRM_k(h'),   q_k = LMHead(RMSNorm(h^k))
and q_k(· | i) predicts x_{i+k+1}. TRM_k is one Llama decoder block with causal attention over the module's
window of positions. Departure: the attention span is a window of ``window`` positions (trained on windows of
that length, recomputed at draft time without a KV cache of the module's own), not the whole sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding


@dataclass(frozen=True)
class MTPConfig:
    depths: int
    window: int
    hidden_size: int
    n_heads: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def for_target(cls, target, depths: int, window: int) -> MTPConfig:
        c = target.config
        theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        return cls(depths, window, c.hidden_size, c.num_attention_heads, c.intermediate_size, c.vocab_size,
                   c.rms_norm_eps, theta)

    def llama(self) -> LlamaConfig:
        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.n_heads,
                           num_key_value_heads=self.n_heads, intermediate_size=self.intermediate_size,
                           vocab_size=self.vocab_size, rms_norm_eps=self.rms_eps, num_hidden_layers=1,
                           max_position_embeddings=max(64, self.window), rope_theta=self.rope_theta,
                           attn_implementation="sdpa")

    def to_dict(self) -> dict:
        return asdict(self)


class MTPModule(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        lc = cfg.llama()
        self.norm_h, self.norm_e = LlamaRMSNorm(cfg.hidden_size, cfg.rms_eps), LlamaRMSNorm(cfg.hidden_size,
                                                                                          cfg.rms_eps)
        self.proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = LlamaDecoderLayer(lc, layer_idx=0)
        self.norm_out = LlamaRMSNorm(cfg.hidden_size, cfg.rms_eps)


class MTPModules(nn.Module):
    """D sequential modules over the target's frozen embedding (V, H) and LM head (V, H)."""

    def __init__(self, cfg: MTPConfig, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().clone(), persistent=False)
        self.mods = nn.ModuleList(MTPModule(cfg) for _ in range(cfg.depths))
        self.rotary = LlamaRotaryEmbedding(cfg.llama())

    @property
    def num_heads(self) -> int:  # the calibration's depth count, as Medusa's heads
        return self.cfg.depths

    def step(self, k: int, h_prev: torch.Tensor, tokens: torch.Tensor, allowed: torch.Tensor | None = None,
             pos: torch.Tensor | None = None) -> torch.Tensor:
        """h^k (B, T, H) of module k (1-based) from h^{k-1} (B, T, H) and x_{i+k} (B, T): causal attention
        over the T positions (at most ``window`` back). A draft tree passes its own ``allowed`` (T, T) bool
        (row attends to column) and position ids ``pos`` (T,) instead: tree attention, every node reading
        its shared prefix and its own ancestors only."""
        m = self.mods[k - 1]
        w = m.proj.weight
        e = nn.functional.embedding(tokens, self.embed).to(w.dtype)
        x = m.proj(torch.cat([m.norm_h(h_prev.to(w.dtype)), m.norm_e(e)], dim=-1))  # (B, T, H)
        t = x.shape[1]
        if allowed is None:
            i, j = torch.arange(t)[:, None], torch.arange(t)[None]
            allowed = (j <= i) & (j > i - self.cfg.window)
        pos = (torch.arange(t) if pos is None else pos).to(x.device)[None]
        mask = torch.zeros(t, t, dtype=x.dtype).masked_fill(~allowed.cpu(), float("-inf"))
        mask = mask[None, None].to(x.device)
        return m.block(x, attention_mask=mask, position_embeddings=self.rotary(x, pos), position_ids=pos)

    def logits(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """q_k logits (..., V) from h^k (..., H)."""
        m = self.mods[k - 1]
        return nn.functional.linear(m.norm_out(h), self.lm_head.to(h.dtype))

    def trainable(self) -> list[nn.Parameter]:
        return list(self.mods.parameters())

    def n_params(self) -> int:
        return sum(p.numel() for p in self.trainable())
