"""EAGLE draft heads (Li et al. 2024a "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty";
Li et al. 2025 "EAGLE-3: Scaling up Inference Acceleration ... via Training-Time Test"), p = target, q = head.

Row i of the head reads a feature h_i of token x_i and the embedding e_{i+1} of the token one step ahead and
outputs g_i, its guess of the target's feature f_{i+1}; the logits of q(x_{i+2}) come from g_i. At
committed positions h_i is the target's (EAGLE-1: f_i, the last hidden state before the LM head; EAGLE-3:
fc(low ++ mid ++ high layer outputs)); at draft positions it is the head's own g of the parent node.
- eagle1: x = fc(e ++ h) (2H → H, bias) → one Llama decoder layer (without the first input norm, as EAGLE-1)
  → the target's frozen LM head on g.
- eagle3: residual h; attention reads norm_e(e) ++ norm_h(h) (2H wide q/k/v); MLP; final norm → its own LM
  head over a draft vocabulary (d2t[i]: target id = i + d2t[i], EAGLE-3's map; the identity by default).
- Either may draft over a reduced vocabulary at inference (``restrict_vocabulary``: its LM head's rows of the
  given target ids, d2t; EAGLE-1's frozen LM head included): q is 0 elsewhere, verification stays lossless.
The embedding (and EAGLE-1's LM head) are the target's, frozen, held as buffers, never saved.
One layer, explicit K/V: ``project`` gives rotated q, k, v of rows, ``attend`` mixes them with any key set
and additive mask, so the training rollout and the drafter's tree share the same code. For decoding on CPU,
``pack`` gives the linears (LM head included) oneDNN-prepacked weights, as the target's lean forward has
(methods.core.fast_llama): a draft level is weight-bandwidth bound, like a target forward of a few rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from methods.core.fast_llama import attention, pack_weight, packed_linear, packing_works


@dataclass(frozen=True)
class EagleConfig:
    variant: str  # eagle1 | eagle3
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # the LM head's rows (eagle3's trained draft vocabulary; eagle1: vocab_size, or
    # fewer where restricted at inference: EagleHead.restrict_vocabulary)
    feature_layers: tuple[int, ...] = ()  # eagle3: target decoder layers fused by fc (() = last hidden)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_positions: int = 8192  # rotary table length

    def __post_init__(self) -> None:
        assert self.variant in ("eagle1", "eagle3"), f"unknown EAGLE variant {self.variant!r}"
        assert 1 <= self.draft_vocab_size <= self.vocab_size
        assert len(set(self.feature_layers)) == len(self.feature_layers), "feature layers must be distinct"

    @property
    def n_features(self) -> int:
        return max(1, len(self.feature_layers))

    @classmethod
    def for_target(cls, target, variant: str, feature_layers=(), draft_vocab_size: int | None = None):
        c = target.config
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(variant, c.hidden_size, c.intermediate_size, c.num_attention_heads,
                   c.num_key_value_heads or c.num_attention_heads, hd, c.vocab_size,
                   draft_vocab_size or c.vocab_size, tuple(int(x) for x in feature_layers), float(theta),
                   float(c.rms_norm_eps))

    def to_dict(self) -> dict:
        return asdict(self)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_table(theta: float, head_dim: int, n: int) -> torch.Tensor:
    """(n, 2, d) cos and sin of the rotary angles at positions 0..n-1 (Llama's rotate-half layout)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv  # (n, d/2)
    ang = torch.cat([ang, ang], -1)
    return torch.stack([ang.cos(), ang.sin()], 1)


def rotate(x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., T, n, d) at positions pos (..., T), from a rope_table."""
    cs = table[pos].to(x.dtype)  # (..., T, 2, d)
    cos, sin = cs[..., 0, None, :], cs[..., 1, None, :]
    d = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., d:], x[..., :d]], -1) * sin


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        H, n, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        width = H if cfg.variant == "eagle1" else 2 * H  # the attention's input
        self.fc = nn.Linear(cfg.n_features * H + (H if cfg.variant == "eagle1" else 0), H,
                            bias=cfg.variant == "eagle1")
        # q, k, v in one projection and gate, up in another: fewer small matmuls per draft level (the
        # checkpoint layout splits them, methods.heads.eagle.checkpoint)
        self.qkv_proj = nn.Linear(width, (n + 2 * kv) * d, bias=False)
        self.o_proj = nn.Linear(n * d, H, bias=False)
        self.post_norm = nn.Parameter(torch.ones(H))
        self.gate_up_proj = nn.Linear(H, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.register_buffer("rope", rope_table(cfg.rope_theta, d, cfg.max_positions), persistent=False)
        self.register_buffer("embed", embed.detach().clone(), persistent=False)  # (V, H) the target's
        if cfg.variant == "eagle3":
            self.embed_norm = nn.Parameter(torch.ones(H))
            self.hidden_norm = nn.Parameter(torch.ones(H))
            self.norm = nn.Parameter(torch.ones(H))
            self.lm_head = nn.Parameter(lm_head.detach().clone()[: cfg.draft_vocab_size])  # (Vd, H)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            self.register_buffer("lm_head", lm_head.detach().clone()[: cfg.draft_vocab_size],
                                 persistent=False)  # (V, H) frozen
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=False)
        self.packed: dict[str, torch.Tensor] = {}  # name → prepacked weight (``pack``; inference only)

    @torch.no_grad()
    def pack(self) -> bool:
        """Prepack the linears' weights for inference where oneDNN packing works for their device and dtype
        (call after the last ``.to``; training must not follow). Returns whether it did."""
        w = self.qkv_proj.weight
        if w.device.type != "cpu" or not packing_works(w.dtype):
            self.packed = {}
            return False
        names = ("fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        self.packed = {n: pack_weight(getattr(self, n).weight.detach()) for n in names}
        self.packed["lm_head"] = pack_weight(self.lm_head.detach().to(w.dtype))
        return True

    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        w = self.packed.get(name)
        if w is None:
            return getattr(self, name)(x)
        bias = getattr(self, name).bias
        y = packed_linear(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias

    # ---- pieces --------------------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The committed rows' h from the target's features (..., k H): EAGLE-3's fc, EAGLE-1's identity."""
        return self._lin("fc", features) if self.cfg.variant == "eagle3" else features

    def project(self, h: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor):
        """Rows (..., T): residual (..., T, H) and rotated q (..., T, n, d), k, v (..., T, kv, d)."""
        c, e = self.cfg, self.embed[tokens]
        if c.variant == "eagle1":
            res = self._lin("fc", torch.cat([e.to(h.dtype), h], -1))
            x = res
        else:
            res = h
            x = torch.cat([rms_norm(e.to(h.dtype), self.embed_norm, c.rms_eps),
                           rms_norm(h, self.hidden_norm, c.rms_eps)], -1)
        shape, n, kv = x.shape[:-1], c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = self._lin("qkv_proj", x).split([n, kv, kv], -1)
        q = q.reshape(*shape, c.num_heads, c.head_dim)
        k = k.reshape(*shape, c.num_kv_heads, c.head_dim)
        v = v.reshape(*shape, c.num_kv_heads, c.head_dim)
        return res, rotate(q, pos, self.rope), rotate(k, pos, self.rope), v

    def attend(self, res, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """g of the query rows: q (B, T, n, d) over keys k, v (B, S, kv, d) under the additive mask (T, S)
        (None = causal, S = T); residual + attention, then the MLP block."""
        c = self.cfg
        rep = c.num_heads // c.num_kv_heads
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # (B, kv, S, d)
        if k.dtype in (torch.bfloat16, torch.float16) and mask is not None:
            # a decode cache in the head's reduced dtype (methods.heads.eagle.state.kv_cache_dtype): float32
            # queries over it as the target's engines attend (the float32-accumulating kernel)
            a = attention(q.transpose(1, 2).float(), kt, vt, mask.float(), c.head_dim ** -0.5, rep > 1)
            return self.block(res, a.transpose(1, 2))
        # else the attention in k's dtype: a float32 decode cache, where CPU SDPA is several times faster
        # than in bfloat16 (methods.core.fast_llama does the same for the target), or the training's
        qt = q.transpose(1, 2).to(k.dtype)  # (B, n, T, d)
        if rep > 1:
            kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
        m = None if mask is None else mask.to(qt.dtype)
        a = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m, is_causal=mask is None)
        return self.block(res, a.transpose(1, 2))

    def block(self, res: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """g from the residual (..., T, H) and the attention's output heads a (..., T, n, d): residual +
        o_proj(a), then the MLP block."""
        c = self.cfg
        x = res + self._lin("o_proj", a.reshape(*res.shape[:-1], -1).to(res.dtype))
        y = rms_norm(x, self.post_norm, c.rms_eps)
        gate, up = self._lin("gate_up_proj", y).chunk(2, -1)
        return x + self._lin("down_proj", F.silu(gate) * up)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft logits over the TARGET vocabulary (..., V); EAGLE-3's draft vocabulary is scattered to its
        target ids, the rest get -inf."""
        c = self.cfg
        z = self._head_logits(g) if c.variant == "eagle1" else self.draft_logits(g)  # (..., Vd)
        if c.draft_vocab_size == c.vocab_size and not self.d2t.any():
            return z
        out = z.new_full((*z.shape[:-1], c.vocab_size), float("-inf"))
        return out.index_copy(-1, torch.arange(c.draft_vocab_size, device=z.device) + self.d2t, z)

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's logits over its draft vocabulary (..., Vd): draft id i is target id i + d2t[i]."""
        return self._head_logits(rms_norm(g, self.norm, self.cfg.rms_eps))

    def draft_ids(self) -> torch.Tensor:
        """(Vd,) the target ids of the draft vocabulary (all V unless reduced)."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.lm_head.device) + self.d2t

    @torch.no_grad()
    def restrict_vocabulary(self, ids: torch.Tensor) -> None:
        """Draft over the target ids ``ids`` (ascending, distinct) only, at inference (before ``pack``): the
        LM head keeps their rows, d2t maps draft id i to ids[i] (EAGLE-3's map), q is 0 elsewhere. A smaller
        LM head per draft level (its largest matmul on a small target: the zoo's 4096 x 384 is 42% of a
        level's weights); the drafts change only where q's top choices fall outside ``ids``. A head whose
        vocabulary is already reduced (a trained EAGLE-3 draft vocabulary) is refused."""
        c = self.cfg
        if c.draft_vocab_size != c.vocab_size or self.d2t.any():
            raise ValueError(f"the head's draft vocabulary is already reduced ({c.draft_vocab_size} of "
                             f"{c.vocab_size}): method.params.draft_vocab applies to full-vocabulary heads")
        ids = ids.to(self.lm_head.device, torch.long)
        n = ids.numel()
        if not (1 <= n <= c.vocab_size and bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0
                and int(ids[-1]) < c.vocab_size):
            raise ValueError(f"a draft vocabulary is 1..{c.vocab_size} ascending target ids, got {n}")
        rows = self.lm_head.detach()[ids].clone()
        if isinstance(self.lm_head, nn.Parameter):
            self.lm_head = nn.Parameter(rows, requires_grad=False)
        else:
            self.lm_head = rows  # EAGLE-1's frozen buffer
        self.d2t = ids - torch.arange(n, device=ids.device)
        self.cfg = replace(c, draft_vocab_size=n)
        self.packed = {}  # pack again for the new LM head

    def _head_logits(self, x: torch.Tensor) -> torch.Tensor:
        w = self.packed.get("lm_head")
        if w is not None:
            out = packed_linear(x.reshape(-1, x.shape[-1]), w)  # (rows, V); rows may be 0 (a depth, no roots)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return x @ self.lm_head.to(x.dtype).T

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """g over causal rows (B, T): h (B, T, H), tokens (B, T) = x_{i+1}, pos (B, T) or (T,)."""
        return self.attend(*self.project(h, tokens, pos), None)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
