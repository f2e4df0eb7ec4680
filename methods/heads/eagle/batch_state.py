"""The EAGLE head's KV cache over a batch of rows (issue 16; the batched counterpart of
methods.heads.eagle.state.HeadCache, used by methods.drafters.eagle.BatchEagle; p = target, q = head).

(R, cap, kv, d) K/V (the head's bf16 / fp16 where the float32-accumulating kernel attends over it, as in the
one-sequence cache: methods.heads.eagle.state.kv_cache_dtype; else float32): row b's committed rows at slots
0..lengths[b]-1 and its pending draft rows right after them (the batched target engine's layout). Committed
rows arrive ragged (each row's accepted tokens with the target's hidden states, methods.core.batch_loop) and
are appended in ONE head forward over the rows that have any, padded to the longest; a draft level is ONE head
forward over the level's fed nodes of every row (B, f), with one pending-ancestor relation shared by the rows
where they draft the same tree (static trees), one per row where each row's nodes have parents of their own
(EAGLE-2's dynamic frontiers). Attention masks are built on the host in numpy and cross to the device once per
forward, as in the one-sequence cache.
"""

from __future__ import annotations

import numpy as np
import torch

from methods.heads.eagle.head import EagleHead
from methods.heads.eagle.state import grow_ancestors, kv_cache_dtype


class BatchHeadCache:
    """The head's K/V for up to ``max_rows`` rows (slots 0..B-1, the batch loop's order)."""

    def __init__(self, head: EagleHead, max_rows: int, capacity: int = 256, mixed_ok: bool = True) -> None:
        self.head, self.max_rows, self.capacity = head, max_rows, capacity
        c = head.cfg
        self.kv = c.num_kv_heads * c.head_dim
        p = head.qkv_proj.weight
        self.kv_dtype = kv_cache_dtype(head, mixed_ok)
        self.k = torch.zeros(max_rows, capacity, self.kv, dtype=self.kv_dtype, device=p.device)
        self.v = torch.zeros_like(self.k)
        self.lengths = np.zeros(0, dtype=np.int64)  # committed rows per active row (host)
        self.last = torch.zeros(max_rows, c.hidden_size, dtype=p.dtype, device=p.device)  # g of the last one
        self.anc = np.zeros((0, 0), dtype=bool)  # (P, P) pending ancestor-or-self shared by every row, or
        # (B, P, P): one per row

    @property
    def rows(self) -> int:
        return self.lengths.size

    @property
    def pending(self) -> int:
        return self.anc.shape[-1]

    def join(self, k: int) -> None:
        assert self.pending == 0 and self.rows + k <= self.max_rows
        self.lengths = np.concatenate([self.lengths, np.zeros(k, dtype=np.int64)])

    def leave(self, slot: int) -> None:
        """Row ``slot`` leaves; the last row moves into its slot."""
        assert self.pending == 0
        last = self.rows - 1
        if slot != last:
            n = int(self.lengths[last])
            self.k[slot, :n], self.v[slot, :n] = self.k[last, :n], self.v[last, :n]
            self.last[slot] = self.last[last]
            self.lengths[slot] = n
        self.lengths = self.lengths[:last].copy()

    def _ensure(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = max(needed, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], cap, old.shape[2])
            new[:, : self.capacity] = old
            setattr(self, name, new)
        self.capacity = cap

    def _write(self, rows: np.ndarray, cols: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V (N, kv) of the (rows[i], cols[i]) slots, in one index_copy_ each."""
        flat = torch.from_numpy(rows * self.capacity + cols).to(self.k.device)
        self.k.view(-1, self.kv).index_copy_(0, flat, k.reshape(-1, self.kv).to(self.kv_dtype))
        self.v.view(-1, self.kv).index_copy_(0, flat, v.reshape(-1, self.kv).to(self.kv_dtype))

    def _keys(self, rows: np.ndarray, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(G, width, kv, d) K/V of ``rows``: a view when they are the first G slots (the steady state)."""
        c = self.head.cfg
        if np.array_equal(rows, np.arange(rows.size)):
            k, v = self.k[: rows.size, :width], self.v[: rows.size, :width]
        else:
            idx = torch.from_numpy(rows).to(self.k.device)
            k, v = self.k[idx, :width], self.v[idx, :width]
        shape = (rows.size, width, c.num_kv_heads, c.head_dim)
        return k.view(shape), v.view(shape)

    def append(self, rows: list[int], h: list[torch.Tensor], tokens: list[torch.Tensor]) -> None:
        """Commit rows: for each row rows[i], h[i] (n_i, H) head-space inputs and tokens[i] (n_i,) = x_{j+1}
        (n_i ≥ 1), causally after its committed rows, in one head forward padded to the largest n_i."""
        assert self.pending == 0
        head, dev = self.head, self.last.device
        r = np.asarray(rows, dtype=np.int64)
        n = np.asarray([x.shape[0] for x in h], dtype=np.int64)
        m, lens = int(n.max()), self.lengths[r]
        width = int((lens + n).max())
        self._ensure(width)
        hp = torch.zeros(r.size, m, h[0].shape[-1], dtype=h[0].dtype, device=dev)
        tp = torch.zeros(r.size, m, dtype=torch.long, device=dev)
        for i, (x, t) in enumerate(zip(h, tokens)):
            hp[i, : x.shape[0]], tp[i, : x.shape[0]] = x, t
        ar = np.arange(m)
        valid = ar[None] < n[:, None]  # (G, m)
        # each query sees its row's committed slots up to itself (pads: up to the row's last new row)
        top = lens[:, None] + np.minimum(ar[None], n[:, None] - 1)  # (G, m) last visible slot
        pos = torch.from_numpy(np.minimum(top, head.cfg.max_positions - 1)).to(dev)
        res, q, k, v = head.project(hp, tp, pos)
        gi, ji = np.nonzero(valid)
        sel = (torch.from_numpy(gi).to(dev), torch.from_numpy(ji).to(dev))
        self._write(r[gi], lens[gi] + ji, k[sel], v[sel])
        mask = np.where(np.arange(width)[None, None] <= top[:, :, None], np.float32(0), np.float32(-np.inf))
        kk, vv = self._keys(r, width)
        g = head.attend(res, q, kk, vv, torch.from_numpy(mask[:, None]).to(dev))  # (G, m, H)
        self.last[torch.from_numpy(r).to(dev)] = g[torch.arange(r.size, device=dev),
                                                   torch.from_numpy(n - 1).to(dev)].to(self.last.dtype)
        self.lengths[r] = lens + n

    def feed(self, h: torch.Tensor, tokens: torch.Tensor, depth: int, parents: np.ndarray) -> torch.Tensor:
        """Draft rows at ``depth`` on every active row: h (B, f, H) the parents' g, tokens (B, f), ``parents``
        the pending row of each one's parent (-1: a child of the root): (f,) the same for every row, or (B,
        f) each row's own. Returns g (B, f, H); the rows become pending (P..P+f-1 after each row's committed
        ones)."""
        head, P, (b, f) = self.head, self.pending, tokens.shape
        lens = self.lengths
        width = int(lens.max()) + P + f
        self._ensure(width)
        dev = h.device
        pos = torch.from_numpy(np.repeat(lens[:, None] - 1 + depth, f, 1)).to(dev)
        res, q, k, v = head.project(h, tokens, pos)
        ar = np.arange(b)
        self._write(np.repeat(ar, f), (lens[:, None] + P + np.arange(f)).reshape(-1), k, v)
        self.anc = grown = grow_ancestors(self.anc, parents)
        cols = np.arange(width)
        mask = np.where(cols[None] < lens[:, None], np.float32(0), np.float32(-np.inf))  # (B, W) committed
        mask = np.repeat(mask[:, None], f, 1)  # (B, f, W)
        pend = np.where(grown[..., P:, :], np.float32(0), np.float32(-np.inf))  # (f or B f, P + f)
        pcols = (lens[:, None] + np.arange(P + f))[:, None]  # (B, 1, P + f) each row's pending slots
        mask[ar[:, None, None], np.arange(f)[None, :, None], pcols] = pend
        kk, vv = self._keys(ar, width)
        return head.attend(res, q, kk, vv, torch.from_numpy(mask[:, None]).to(dev))

    def drop_pending(self) -> None:
        self.anc = np.zeros((0, 0), dtype=bool)
