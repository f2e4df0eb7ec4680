"""A lean forward for Hugging Face Llama models (gpt-fast style): the same weights, plain tensor functions.

Per decode step a tiny model spends most of its time in framework overhead (module hooks, output capturing,
config look-ups, mask preparation); this forward runs the identical math — RMSNorm in float32 as HF does,
RoPE from a precomputed cos/sin table, SDPA with the engine's float additive mask — with Q/K/V and gate/up
projections fused into one matmul each. The fused weights are the model's storage: each HF Linear's weight
is re-pointed to a view of the fused tensor, so nothing is duplicated and the HF model keeps working.
Logits agree with the HF forward to float rounding (tests/methods/test_engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


def supports(model: PreTrainedModel) -> bool:
    """Plain Llama layout only (no biases, SiLU MLP, one tensor-parallel slice)."""
    c = model.config
    return (
        c.model_type == "llama"
        and not getattr(c, "attention_bias", False)
        and not getattr(c, "mlp_bias", False)
        and getattr(c, "hidden_act", "silu") == "silu"
        and getattr(c, "pretraining_tp", 1) == 1
    )


@torch.no_grad()
def _fuse(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """One (sum out, in) weight; each Linear's weight becomes a row-slice view of it (no extra memory).
    Already fused (a second engine on the same model) → the same tensor, so in-place weight loads reach
    every engine."""
    first, cols = linears[0].weight, linears[0].weight.shape[1]
    rows = sum(lin.weight.shape[0] for lin in linears)
    storage = first.untyped_storage()
    offsets = [0]
    for lin in linears:
        offsets.append(offsets[-1] + lin.weight.numel())
    fused_before = storage.nbytes() == rows * cols * first.element_size() and all(
        lin.weight.untyped_storage().data_ptr() == storage.data_ptr() and lin.weight.storage_offset() == off
        for lin, off in zip(linears, offsets)
    )
    if fused_before:
        return first.new_empty(0).set_(storage, 0, (rows, cols))
    fused = torch.cat([lin.weight.data for lin in linears], dim=0)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start : start + rows]
        start += rows
    return fused


@dataclass(frozen=True)
class _Layer:
    ln_in: torch.Tensor  # (H,)
    w_qkv: torch.Tensor  # ((Hq + 2 Hkv) D, H)
    w_o: torch.Tensor  # (H, Hq D)
    ln_post: torch.Tensor  # (H,)
    w_gate_up: torch.Tensor  # (2 I, H)
    w_down: torch.Tensor  # (H, I)


class FastLlama:
    """``attn_dtype``: dtype of the KV cache and the attention math (None = the model's). On CPU, float32
    attention is several times faster than bfloat16 (PyTorch's bf16 SDPA kernels there are slow) and more
    accurate; the projections stay in the model's dtype."""

    def __init__(self, model: PreTrainedModel, attn_dtype: torch.dtype | None = None):
        assert supports(model), f"{type(model).__name__} is not a plain Llama"
        cfg, base = model.config, model.model
        self.attn_dtype = attn_dtype or model.dtype
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps, self.scale = cfg.rms_norm_eps, self.head_dim**-0.5
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        self.layers = []
        for layer in base.layers:
            att, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = _fuse([att.q_proj, att.k_proj, att.v_proj]), _fuse([mlp.gate_proj, mlp.up_proj])
            self.layers.append(_Layer(layer.input_layernorm.weight, qkv, att.o_proj.weight,
                                      layer.post_attention_layernorm.weight, gate_up, mlp.down_proj.weight))
        positions = torch.arange(cfg.max_position_embeddings, device=model.device)[None]
        with torch.no_grad():  # HF's own rotary module: the same rope type, scaling and dtype cast
            cos, sin = base.rotary_emb(self.embed[:1][None], positions)
        self.cos, self.sin = cos[0], sin[0]  # (C, D)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(x.dtype)

    def forward(
        self, ids: torch.Tensor, position: torch.Tensor, mask: torch.Tensor | None, kv: list
    ) -> torch.Tensor:
        """ids, position: (n,); mask: (1, 1, n, L) additive in attn_dtype, or None (attend to everything); kv:
        the cache layers (``update(k, v)`` appends and returns the (1, Hkv, L, D) views). Returns (n, H) after
        the final norm."""
        n, d = ids.shape[0], self.head_dim
        cos, sin = self.cos[position], self.sin[position]  # (n, D)
        x = F.embedding(ids, self.embed)  # (n, H)
        hq, k_end = self.n_heads, (self.n_heads + self.n_kv) * d
        gqa, adt = self.n_heads != self.n_kv, self.attn_dtype
        cast = adt != x.dtype
        for layer, cache in zip(self.layers, kv):
            qkv = F.linear(self._rms(x, layer.ln_in), layer.w_qkv)  # (n, (Hq + 2Hkv) D)
            qk = _rope(qkv[:, :k_end].view(n, -1, d), cos, sin)  # (n, Hq + Hkv, D): one rotation for both
            v = qkv[:, k_end:].view(n, -1, d)
            if cast:
                qk, v = qk.to(adt), v.to(adt)
            qk, v = qk.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, heads, n, D)
            keys, values = cache.update(qk[:, hq:], v)  # (1, Hkv, L, D)
            att = F.scaled_dot_product_attention(qk[:, :hq], keys, values, attn_mask=mask,
                                                 scale=self.scale, enable_gqa=gqa)  # (1, Hq, n, D)
            att = att[0].transpose(0, 1).reshape(n, -1)  # (n, Hq D)
            x = x + F.linear(att.to(x.dtype) if cast else att, layer.w_o)
            gate, up = F.linear(self._rms(x, layer.ln_post), layer.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.w_down)
        return self._rms(x, self.norm)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (n, heads, D) rotated at its positions (cos, sin: (n, D)), HF's rotate_half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
