"""The EAGLE head's KV cache during decoding and its tree forwards (p = target, q = head).

Committed rows i = 0..t-2 (t committed tokens, root x_{t-1}) read the target's feature of x_i and the token
x_{i+1}; their K/V persist across steps. Draft nodes are fed level by level: a depth-d node reads its
parent's g (the committed last row's for depth 1) and its own token, at position t-2+d, and attends the
committed rows, its fed ancestors and itself. Drafted rows are dropped after each step: the accepted tokens
come back with the target's own features and are appended as committed rows (EAGLE's scheme).
"""

from __future__ import annotations

import torch

from methods.heads.eagle.head import EagleHead


class HeadCache:
    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self.k: torch.Tensor | None = None  # (1, L, kv, d) committed rows
        self.v: torch.Tensor | None = None
        self.last: torch.Tensor | None = None  # (H,) g of the last committed row: q of the root's children
        self.pk: list[torch.Tensor] = []  # pending (draft) rows' k (1, n, kv, d) per fed level
        self.pv: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def reset(self) -> None:
        self.k = self.v = self.last = None
        self.pk, self.pv = [], []

    def append(self, h: torch.Tensor, tokens: torch.Tensor) -> None:
        """Commit rows: h (n, H) the head-space input (fused features), tokens (n,) = x_{i+1}."""
        head, L = self.head, self.length
        pos = torch.arange(L, L + h.shape[0], device=h.device)
        res, q, k, v = head.project(h[None], tokens[None], pos)
        if L == 0:
            keys, vals, mask = k, v, None
        else:
            keys, vals = torch.cat([self.k, k], 1), torch.cat([self.v, v], 1)
            mask = _mask(torch.ones(h.shape[0], L, dtype=torch.bool, device=h.device),
                         torch.tril(torch.ones(h.shape[0], h.shape[0], dtype=torch.bool, device=h.device)))
        g = head.attend(res, q, keys, vals, mask)[0]  # (n, H)
        self.k, self.v, self.last = keys, vals, g[-1]
        self.pk, self.pv = [], []

    def feed(self, h: torch.Tensor, tokens: torch.Tensor, depth: int, see: torch.Tensor) -> torch.Tensor:
        """Draft rows at ``depth``: h (n, H) the parents' g, tokens (n,); ``see`` (n, P) bool: which pending
        rows (in feeding order) each attends (its ancestors). Returns g (n, H); their K/V become pending."""
        head, L, n = self.head, self.length, h.shape[0]
        pos = torch.full((n,), L - 1 + depth, device=h.device)
        res, q, k, v = head.project(h[None], tokens[None], pos)
        keys = torch.cat([self.k, *self.pk, k], 1)
        vals = torch.cat([self.v, *self.pv, v], 1)
        eye = torch.eye(n, dtype=torch.bool, device=h.device)
        mask = _mask(torch.ones(n, L, dtype=torch.bool, device=h.device), see, eye)
        self.pk.append(k)
        self.pv.append(v)
        return head.attend(res, q, keys, vals, mask)[0]

    def drop_pending(self) -> None:
        self.pk, self.pv = [], []


def _mask(*blocks: torch.Tensor) -> torch.Tensor:
    ok = torch.cat(blocks, dim=1)
    return torch.zeros(ok.shape, device=ok.device).masked_fill(~ok, float("-inf"))
