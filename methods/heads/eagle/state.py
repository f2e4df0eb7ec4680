"""The EAGLE head's KV cache during decoding and its tree forwards (p = target, q = head).

Committed rows i = 0..t-2 (t committed tokens, root x_{t-1}) read the target's feature of x_i and the token
x_{i+1}; their K/V persist across steps. Draft nodes are fed level by level: a depth-d node reads its
parent's g (the committed last row's for depth 1) and its own token, at position t-2+d, and attends the
committed rows, its fed ancestors and itself. Drafted rows are dropped after each step: the accepted tokens
come back with the target's own features and are appended as committed rows (EAGLE's scheme).

Cost: a draft level is ONE head forward over all of its fed nodes. K/V live in preallocated buffers (committed
rows, then the pending draft rows), so a level writes its rows in place instead of concatenating the whole
cache, and the pending rows' ancestor relation is a (P, P) bool array on the host: a new row's visible set is
its parent's row of it plus itself, no per-node Python. The level's attention mask is built there in numpy
and crosses to the device once (as the batched engine builds its indices): a dozen small tensor ops a level
were ~0.1 ms on CPU, as much as one of the head's matmuls.
"""

from __future__ import annotations

import numpy as np
import torch

from methods.heads.eagle.head import EagleHead


class HeadCache:
    def __init__(self, head: EagleHead, capacity: int = 256) -> None:
        self.head = head
        self.capacity = capacity  # initial rows; the buffers double when full
        self.k: torch.Tensor | None = None  # (1, capacity, kv, d): committed rows, then pending rows
        self.v: torch.Tensor | None = None
        self.length = 0  # committed rows
        self.last: torch.Tensor | None = None  # (H,) g of the last committed row: q of the root's children
        self.anc = np.zeros((0, 0), dtype=bool)  # (P, P) pending row j is an ancestor-or-self of row i

    @property
    def pending(self) -> int:
        return self.anc.shape[0]

    def reset(self) -> None:
        self.length, self.last = 0, None
        self.drop_pending()

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Store rows k, v (1, n, kv, d) after the committed and pending ones; returns their first index."""
        at, n = self.length + self.pending, k.shape[1]
        if self.k is None or at + n > self.k.shape[1]:
            cap = max(self.capacity, 2 * (at + n))
            # float32 K/V: the attention runs in it (EagleHead.attend), fast on CPU whatever the head's dtype
            bk = k.new_empty(1, cap, *k.shape[2:], dtype=torch.float32)
            bv = v.new_empty(1, cap, *v.shape[2:], dtype=torch.float32)
            if self.k is not None:
                bk[:, :at], bv[:, :at] = self.k[:, :at], self.v[:, :at]
            self.k, self.v = bk, bv
        self.k[:, at : at + n], self.v[:, at : at + n] = k, v
        return at

    def append(self, h: torch.Tensor, tokens: torch.Tensor) -> None:
        """Commit rows: h (n, H) the head-space input (fused features), tokens (n,) = x_{i+1}."""
        self.drop_pending()
        head, L, n = self.head, self.length, h.shape[0]
        pos = torch.arange(L, L + n, device=h.device)
        res, q, k, v = head.project(h[None], tokens[None], pos)
        self._write(k, v)
        mask = None
        if L > 0:  # causal over the new rows, everything committed before
            mask = torch.zeros(n, L + n, device=h.device)
            mask[:, L:] = torch.full((n, n), float("-inf"), device=h.device).triu(1)
        g = head.attend(res, q, self.k[:, : L + n], self.v[:, : L + n], mask)[0]  # (n, H)
        self.length, self.last = L + n, g[-1]

    def feed(self, h: torch.Tensor, tokens: torch.Tensor, depth: int, parents) -> torch.Tensor:
        """Draft rows at ``depth``: h (n, H) the parents' g, tokens (n,), ``parents`` (n,) ints (numpy or a
        tensor): the pending row of each row's parent (-1: a child of the root, no pending ancestor). Returns
        g (n, H); the rows become pending (rows P..P+n-1)."""
        head, L, P, n = self.head, self.length, self.pending, h.shape[0]
        pos = torch.full((n,), L - 1 + depth, device=h.device)
        res, q, k, v = head.project(h[None], tokens[None], pos)
        self._write(k, v)
        parents = parents.cpu().numpy() if torch.is_tensor(parents) else np.asarray(parents)
        grown = np.zeros((P + n, P + n), dtype=bool)  # (P + n, P + n): the new rows' ancestors, then self
        grown[:P, :P] = self.anc
        has = parents >= 0
        if P and has.any():
            grown[P:][has, :P] = self.anc[parents[has]]
        grown[np.arange(P, P + n), np.arange(P, P + n)] = True
        self.anc = grown
        mask = np.zeros((n, L + P + n), dtype=np.float32)  # committed rows visible; pending: ancestors only
        mask[:, L:][~grown[P:]] = -np.inf
        m = torch.from_numpy(mask).to(h.device)
        return head.attend(res, q, self.k[:, : L + P + n], self.v[:, : L + P + n], m)[0]

    def drop_pending(self) -> None:
        self.anc = np.zeros((0, 0), dtype=bool)
