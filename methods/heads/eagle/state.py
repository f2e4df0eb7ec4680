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
import torch.nn.functional as F

from methods.core.fast_llama import attention
from methods.core.mixed_attention import cache_dtype
from methods.heads.eagle.head import EagleHead


class HeadCache:
    def __init__(self, head: EagleHead, capacity: int = 256, mixed_ok: bool = True) -> None:
        self.head = head
        self.capacity = capacity  # initial rows; the buffers double when full
        # K/V storage: the head's bf16 / fp16 where its attention can run through the float32-accumulating
        # kernel (kv_cache_dtype; ``mixed_ok`` False: float32 always, for comparison), else float32
        self.kv_dtype = kv_cache_dtype(head, mixed_ok)
        self._scale = head.cfg.head_dim ** -0.5
        self.k: torch.Tensor | None = None  # (1, capacity, kv, d): committed rows, then pending rows
        self.v: torch.Tensor | None = None
        self.length = 0  # committed rows
        self.last: torch.Tensor | None = None  # (H,) g of the last committed row: q of the root's children
        self.anc = np.zeros((0, 0), dtype=bool)  # (P, P) pending row j is an ancestor-or-self of row i
        c = head.cfg
        self._k_end, self._hq = (c.num_heads + c.num_kv_heads) * c.head_dim, c.num_heads
        self._gqa = c.num_heads != c.num_kv_heads
        # (positions, 2, 1, d): cos and sin with its first half negated (rotate_half(x) * sin = roll(x, d/2) *
        # sin_rot, the same products: methods.core.fast_llama), in the table's dtype as ``rotate`` casts it
        cos, sin = head.rope[:, 0], head.rope[:, 1]
        half = c.head_dim // 2
        self._rope = torch.stack([cos, torch.cat([-sin[:, :half], sin[:, half:]], -1)], 1)[:, :, None]

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
            bk = k.new_empty(1, cap, *k.shape[2:], dtype=self.kv_dtype)
            bv = v.new_empty(1, cap, *v.shape[2:], dtype=self.kv_dtype)
            if self.k is not None:
                bk[:, :at], bv[:, :at] = self.k[:, :at], self.v[:, :at]
            self.k, self.v = bk, bv
        self.k[:, at : at + n], self.v[:, at : at + n] = k, v
        return at

    def append(self, h: torch.Tensor, tokens: torch.Tensor) -> None:
        """Commit rows: h (n, H) the head-space input (fused features), tokens (n,) = x_{i+1}."""
        self.drop_pending()
        L, n = self.length, h.shape[0]
        mask = None  # one row sees every row: no mask
        if n > 1:  # causal over the new rows, everything committed before
            mask = np.zeros((n, L + n), dtype=np.float32)
            mask[:, L:][np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf
        g = self._rows(h, tokens, self._rope[L : L + n], mask)  # (n, H)
        self.length, self.last = L + n, g[-1]

    def feed(self, h: torch.Tensor, tokens: torch.Tensor, depth: int, parents) -> torch.Tensor:
        """Draft rows at ``depth``: h (n, H) the parents' g, tokens (n,), ``parents`` (n,) ints (numpy or a
        tensor): the pending row of each row's parent (-1: a child of the root, no pending ancestor). Returns
        g (n, H); the rows become pending (rows P..P+n-1)."""
        L, P, n = self.length, self.pending, h.shape[0]
        parents = parents.cpu().numpy() if torch.is_tensor(parents) else np.asarray(parents)
        grown = grow_ancestors(self.anc, parents)
        mask = None  # committed rows visible; pending: ancestors only (a chain's one row: all, no mask)
        if not grown[P:].all():
            mask = np.zeros((n, L + P + n), dtype=np.float32)
            mask[:, L:][~grown[P:]] = -np.inf
        g = self._rows(h, tokens, self._rope[L - 1 + depth, None], mask)  # written after the P pending rows
        self.anc = grown
        return g

    def _rows(self, h: torch.Tensor, tokens: torch.Tensor, rope: torch.Tensor, mask: np.ndarray | None
              ) -> torch.Tensor:
        """g (n, H) of rows h (n, H), tokens (n,) at the rotary rows ``rope`` ((n or 1, 2, 1, d)), written
        after the committed and pending K/V, attending them under the additive ``mask`` (n, all rows):
        ``EagleHead.project`` + ``attend`` (the training layout) in fewer ops, for one sequence at decode
        time (q and k rotated together, one fused norm kernel, no casts that are no-ops, the mask built on
        the host): a draft level's small tensor ops cost as much as its matmuls on CPU."""
        head, c, n, d = self.head, self.head.cfg, h.shape[0], self.head.cfg.head_dim
        e = head.embed[tokens].to(h.dtype)
        if c.variant == "eagle1":
            res = x = head._lin("fc", torch.cat([e, h], -1))
        else:
            res = h
            x = torch.cat([_norm(e, head.embed_norm, c.rms_eps), _norm(h, head.hidden_norm, c.rms_eps)], -1)
        qkv = head._lin("qkv_proj", x)  # (n, (nq + 2 kv) d)
        qk = qkv[:, : self._k_end].view(n, -1, d)
        qk = qk * rope[:, 0] + qk.roll(d // 2, -1) * rope[:, 1]  # (n, nq + kv, d) in the head's dtype
        at = self._write(qk[None, :, self._hq :], qkv[None, :, self._k_end :].view(1, n, -1, d))
        keys, values = self.k[:, : at + n].transpose(1, 2), self.v[:, : at + n].transpose(1, 2)
        q = qk[:, : self._hq].float().transpose(0, 1)[None]  # (1, nq, n, d): the attention in float32
        # the target engines' attention (methods.core.fast_llama): a reduced-precision cache through the
        # float32-accumulating kernel, a float32 one through PyTorch's SDPA
        m = None if mask is None else torch.from_numpy(mask).to(q.device)[None, None]  # (1, 1, n, W)
        a = attention(q, keys, values, m, self._scale, self._gqa)
        x = res + head._lin("o_proj", a[0].transpose(0, 1).reshape(n, -1).to(res.dtype))
        gate, up = head._lin("gate_up_proj", _norm(x, head.post_norm, c.rms_eps)).chunk(2, -1)
        return x + head._lin("down_proj", F.silu(gate) * up)

    def drop_pending(self) -> None:
        self.anc = np.zeros((0, 0), dtype=bool)


def kv_cache_dtype(head: EagleHead, mixed_ok: bool = True) -> torch.dtype:
    """The head's K/V storage dtype, by the target engines' rule (``mixed_attention.cache_dtype`` under
    float32 attention, read off the head's weights): its own bf16 / fp16 on CPU where the float32-accumulating
    kernel is built (``mixed_ok`` False: never), else float32. Lossless as the target's cache: K and V are
    computed in the head's dtype (qkv_proj, then the rotation). A float32 head keeps float32 K/V and SDPA."""
    return cache_dtype(head.qkv_proj.weight, torch.float32, True, mixed_ok)


def grow_ancestors(anc: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """The pending rows' (..., P + n, P + n) ancestor-or-self relation after n new rows whose ``parents``
    (..., n) are pending rows (-1: a child of the root, no pending ancestor): ``anc`` (..., P, P), then each
    new row's parent's ancestors, then itself. Leading axes (a batch's rows, each with its own relation)
    broadcast: an ``anc`` shared by every row grows into one per row when ``parents`` differ per row."""
    P, n = anc.shape[-1], parents.shape[-1]
    has = parents >= 0
    # one relation (one sequence, or rows drafting one tree): plain indexing, ~13 against ~38 µs a level for
    # the broadcast form below (P = 6, n = 4; a one-sequence EAGLE draft runs it every level)
    if anc.ndim == 2 and parents.ndim == 1:
        grown = np.zeros((P + n, P + n), dtype=bool)
        grown[:P, :P] = anc
        if P and has.any():
            grown[P:][has, :P] = anc[parents[has]]
        grown[np.arange(P, P + n), np.arange(P, P + n)] = True
        return grown
    lead = np.broadcast_shapes(anc.shape[:-2], parents.shape[:-1])
    grown = np.zeros((*lead, P + n, P + n), dtype=bool)
    grown[..., :P, :P] = anc
    if P and has.any():
        index = np.broadcast_to(parents.clip(0), (*lead, n))[..., None]  # (..., n, 1): the parents' rows
        rows = np.take_along_axis(np.broadcast_to(anc, (*lead, P, P)), index, -2)  # (..., n, P)
        grown[..., P:, :P] = rows & has[..., None]
    grown[..., np.arange(P, P + n), np.arange(P, P + n)] = True
    return grown


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``methods.heads.eagle.head.rms_norm`` as one fused kernel (float32, as HF's: bit-equal,
    tests/methods/test_engine.py)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * w
