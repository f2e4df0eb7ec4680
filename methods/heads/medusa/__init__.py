"""Medusa (Cai et al., 2024): K extra heads on the target's last hidden state predict tokens t+2..t+K+1.

heads (the module), train (Medusa-1 on a frozen target, Medusa-2 joint option), store (trained heads cached
like the zoo), checkpoint (our layout and the published FasterDecoding/Medusa layout), tree (Medusa's greedy
tree from measured per-head top-k accuracies). The drafter is methods.drafters.medusa. p = target, q = heads.
"""

from methods.heads.medusa.checkpoint import LoadedHeads, load_heads, save_heads, save_published
from methods.heads.medusa.heads import HeadsConfig, MedusaHeads, ResBlock
from methods.heads.medusa.tree import MedusaTree, expected_tokens, greedy_tree

__all__ = [
    "HeadsConfig",
    "LoadedHeads",
    "MedusaHeads",
    "MedusaTree",
    "ResBlock",
    "expected_tokens",
    "greedy_tree",
    "load_heads",
    "save_heads",
    "save_published",
]
