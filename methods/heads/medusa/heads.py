"""Medusa heads (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"), p = target, q = heads.

From the target's last hidden state h_t (after the final norm, so lm_head(h_t) gives p(x_{t+1})), head k
(k = 1..K) predicts x_{t+1+k}: logits_k = W_k · ResBlock^L(h_t), ResBlock(x) = x + SiLU(A x + b). A and b
start at zero so every block is the identity and head k starts as the target's LM head (W_k ← lm_head).
Departure: Medusa zero-inits A only (b keeps nn.Linear's random init); we zero b too so init is exact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class HeadsConfig:
    """Shape of a set of Medusa heads (what a checkpoint must match)."""

    num_heads: int = 4  # K
    num_layers: int = 1  # ResBlocks per head (Medusa's medusa_num_layers)
    hidden_size: int = 384
    vocab_size: int = 4096

    def __post_init__(self) -> None:
        assert self.num_heads >= 1, f"num_heads must be >= 1, got {self.num_heads}"
        assert self.num_layers >= 0, f"num_layers must be >= 0, got {self.num_layers}"

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class ResBlock(nn.Module):
    """x + SiLU(A x + b), identity at init (A = 0, b = 0)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads; ``heads[k-1]`` predicts the token k+1 positions after the hidden state's token.

    State-dict keys are ``heads.{k}.{j}.linear.{weight,bias}`` (j < L) and ``heads.{k}.{L}.weight`` — the
    published layout with a ``heads.`` prefix (see methods.heads.medusa.checkpoint).
    """

    def __init__(self, cfg: HeadsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.heads = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)],
                nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False),
            )
            for _ in range(cfg.num_heads)
        )

    @classmethod
    def from_lm_head(cls, cfg: HeadsConfig, lm_head_weight: torch.Tensor) -> MedusaHeads:
        """Heads whose final projections start as copies of the target's LM head ((V, H) weight)."""
        assert tuple(lm_head_weight.shape) == (cfg.vocab_size, cfg.hidden_size), (
            f"lm_head weight {tuple(lm_head_weight.shape)} != (vocab, hidden) "
            f"{(cfg.vocab_size, cfg.hidden_size)}"
        )
        heads = cls(cfg).to(device=lm_head_weight.device, dtype=lm_head_weight.dtype)
        with torch.no_grad():
            for head in heads.heads:
                head[-1].weight.copy_(lm_head_weight)
        return heads

    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> logits (K, ..., V)."""
        return torch.stack([head(hidden) for head in self.heads], dim=0)

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Logits of head k (1-based, predicts k+1 ahead) only: (..., H) -> (..., V)."""
        assert 1 <= k <= self.num_heads, f"head {k} out of 1..{self.num_heads}"
        return self.heads[k - 1](hidden)
