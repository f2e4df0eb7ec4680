"""A lean forward for Hugging Face Llama models (gpt-fast style): the same weights, plain tensor functions.

Per decode step a tiny model spends most of its time in framework overhead (module hooks, output capturing,
config look-ups, mask preparation); this forward runs the identical math — RMSNorm in float32 as HF does,
RoPE from a precomputed cos/sin table, SDPA with the engine's float additive mask — with Q/K/V and gate/up
projections fused into one matmul each. The fused weights are the model's storage: each HF Linear's weight
is re-pointed to a view of the fused tensor, so nothing is duplicated and the HF model keeps working.
Logits agree with the HF forward to float rounding (tests/methods/test_engine.py).

On CPU the projections (and the LM head) run on **oneDNN-prepacked** copies of the weights (what
torch.compile's freezing does on CPU): in bfloat16 bit-identical to ``F.linear`` and 1.5-2x faster at decode
sizes (n = 1..16 rows); in float32 equal to float rounding and ~3x faster for n > 1. The copies cost the
projection weights' memory once more (skipped above ``PACK_LIMIT_BYTES``) and are rebuilt when the model's
weights change in place (parameter version counters, checked once per forward).

oneDNN's linear costs ~10 µs per call whatever the size, so a tiny projection on a few rows (a small draft
model's at batch 1) runs instead as one float32 BLAS ``mm`` on a float32 (in, out) copy of the weight (the
weight itself, transposed, for a float32 model), 2x faster there: ``SMALL_MACS`` rows x weight elements at
most. The float32 products of bfloat16 values are exact, so the result is the bf16 linear's to the order of
the float32 sums, rounded to bf16 (equal to float rounding, like the prepacked path).

``compile=True``: full forwards of fewer than ``BLOCKED_MIN_ROWS`` nodes (decode steps, trees, draft chains)
run as one inductor graph instead (methods.core.compiled_llama); prefills, partial forwards and feature taps
stay on this eager path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from methods.core.compiled_llama import compile_works, compiled_forward
from methods.core.mixed_attention import mixed_attention


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


PACK_LIMIT_BYTES = 4 << 30  # prepacked copies only for models whose projections fit twice in memory easily


def _packed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


# multiply-accumulates per call (rows x weight elements) up to which the packed path's projection runs as a
# float32 mm instead (module docstring); measured on AVX-512 EPYCs, thread CPU time, one thread. bf16, on the
# zoo draft's projections (128 hidden): the mm is faster up to ~2e5 (1 << 16 sent 2-4 row draft forwards to
# oneDNN); the zoo target's smallest projection (384 x 384 = 147456 elements) stays packed even on one row,
# where the mm's float32 weight (twice the bytes) measured slower in the decode loop
SMALL_MACS = {torch.bfloat16: 1 << 17, torch.float32: 1 << 18}


class _Dual(NamedTuple):
    """A small projection: its packed weight and (in, out) float32 copy (or view), and the most rows a
    call may have to take the mm path."""

    packed: torch.Tensor
    t32: torch.Tensor
    rows: int


def _dual(w: torch.Tensor) -> torch.Tensor | _Dual:
    rows = SMALL_MACS.get(w.dtype, 0) // w.numel()
    if rows < 1:
        return _pack(w)
    return _Dual(_pack(w), w.t() if w.dtype == torch.float32 else w.t().float().contiguous(), rows)


def _dual_linear(x: torch.Tensor, w: torch.Tensor | _Dual) -> torch.Tensor:
    """The packed linear, or the float32 mm for a ``_Dual`` weight on at most its ``rows`` rows."""
    if type(w) is _Dual:
        if x.shape[0] <= w.rows:
            return torch.mm(x.float(), w.t32).to(x.dtype)  # no-op casts for float32
        w = w.packed
    return _packed_linear(x, w)


# for other small inference-only modules that run next to the target (EAGLE heads)
packed_linear, pack_weight = _packed_linear, _pack


def packing_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN-prepacked linears work (and agree with ``F.linear``) on this CPU for ``dtype``."""
    return (dtype in (torch.bfloat16, torch.float32) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and _probe(dtype))


def can_pack(model: PreTrainedModel) -> bool:
    """CPU, bf16/fp32, a oneDNN build whose packed linear works on this CPU and agrees with ``F.linear``
    (probed once on a small weight), and projections under ``PACK_LIMIT_BYTES``."""
    if model.device.type != "cpu" or model.dtype not in (torch.bfloat16, torch.float32):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    weights = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                  if isinstance(m, torch.nn.Linear))
    return weights <= PACK_LIMIT_BYTES and _probe(model.dtype)


_PROBED: dict[torch.dtype, bool] = {}


def _probe(dtype: torch.dtype) -> bool:
    if dtype not in _PROBED:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(96, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(dtype)
        try:
            got, want = _packed_linear(x, _pack(w)).float(), F.linear(x, w).float()
            ok = torch.allclose(got, want, atol=1e-2, rtol=1e-2)
        except RuntimeError:  # e.g. no kernel for this dtype on this CPU
            ok = False
        _PROBED[dtype] = ok
    return _PROBED[dtype]


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
    w_qkv: torch.Tensor | _Dual  # ((Hq + 2 Hkv) D, H) (packed: packed or _Dual, also below)
    w_o: torch.Tensor | _Dual  # (H, Hq D)
    ln_post: torch.Tensor  # (H,)
    w_gate_up: torch.Tensor | _Dual  # (2 I, H)
    w_down: torch.Tensor | _Dual  # (H, I)


class FastLlama:
    """``attn_dtype``: dtype of the KV cache and the attention math (None = the model's). On CPU, float32
    attention is several times faster than bfloat16 (PyTorch's bf16 SDPA kernels there are slow) and more
    accurate; the projections stay in the model's dtype. ``pack``: prepacked oneDNN projections (None = where
    ``can_pack``)."""

    def __init__(self, model: PreTrainedModel, attn_dtype: torch.dtype | None = None,
                 pack: bool | None = None, compile: bool = False):
        assert supports(model), f"{type(model).__name__} is not a plain Llama"
        self.model = model
        cfg, base = model.config, model.model
        self.attn_dtype = attn_dtype or model.dtype
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps, self.scale = cfg.rms_norm_eps, self.head_dim**-0.5
        self._norm_shape = (cfg.hidden_size,)
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        self._plain = []  # one _Layer per decoder layer, over the model's own (fused) weights
        for layer in base.layers:
            att, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = _fuse([att.q_proj, att.k_proj, att.v_proj]), _fuse([mlp.gate_proj, mlp.up_proj])
            self._plain.append(_Layer(layer.input_layernorm.weight, qkv, att.o_proj.weight,
                                      layer.post_attention_layernorm.weight, gate_up, mlp.down_proj.weight))
        self._lm_head = model.get_output_embeddings().weight
        self.packed = can_pack(model) if pack is None else pack
        self.linear: Callable[..., torch.Tensor] = F.linear
        self.layers, self.lm_head = self._plain, self._lm_head
        # the HF parameters (not the fused tensors: a Parameter re-pointed with .data keeps its own version
        # counter), whose in-place updates must reach the packed copies and the compiled graph's constants.
        # Inference tensors (a model loaded under inference_mode) have no version counter: their updates
        # cannot be seen.
        self._watched = [p for p in model.parameters() if not p.is_inference()]
        if self.packed:
            self.linear = _dual_linear
            self._repack()
        # the whole forward as one inductor graph for short full forwards (methods.core.compiled_llama),
        # except for a model whose every projection takes the float32 mm path at one row (a small draft): the
        # graph's linears are oneDNN's, and there the eager forward measured faster (zoo draft, load)
        all_mm = self.packed and all(type(w) is _Dual for lay in self.layers
                                     for w in (lay.w_qkv, lay.w_o, lay.w_gate_up, lay.w_down))
        self.compiled = compile and model.device.type == "cpu" and compile_works() and not all_mm
        self._kv_like = torch.empty(1, self.n_kv, 0, self.head_dim, dtype=self.attn_dtype,
                                    device=model.device)  # BufferLayer.reserve's allocation pattern
        positions = torch.arange(cfg.max_position_embeddings, device=model.device)[None]
        with torch.no_grad():  # HF's own rotary module: the same rope type, scaling and dtype cast
            cos, sin = base.rotary_emb(self.embed[:1][None], positions)
        self.cos, self.sin = cos[0], sin[0]  # (C, D)
        half = self.head_dim // 2  # rotate_half(x) * sin = roll(x, D/2) * (sin with its first half negated)
        self.sin_rot = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)  # (C, D)
        # (C, 2, 1, D): cos and sin_rot in one gather per forward, already broadcast over the heads
        self._rope_table = torch.stack([self.cos, self.sin_rot], dim=1)[:, :, None]

    def _stamp(self) -> int:
        return sum(p._version for p in self._watched)

    @torch.no_grad()
    def _repack(self) -> None:
        self._version = self._stamp()
        self.layers = [_Layer(lay.ln_in, _dual(lay.w_qkv), _dual(lay.w_o), lay.ln_post, _dual(lay.w_gate_up),
                              _dual(lay.w_down)) for lay in self._plain]
        self.lm_head = _dual(self._lm_head)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(n, H) final hidden states → (n, V) logits in the model's dtype (LM head; packed if packing)."""
        return self.linear(h, self.lm_head)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # HF's x * rsqrt(mean(x²) + eps) in float32 as one fused kernel (bit-equal, tests/methods/test_engine)
        return w * F.rms_norm(x.float(), self._norm_shape, eps=self.eps).to(x.dtype)

    def forward(
        self, ids: torch.Tensor, position: torch.Tensor, mask: torch.Tensor | None, kv: list,
        taps: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """ids, position: (n,); mask: (1, 1, n, L) additive in attn_dtype, or None (attend to everything); kv:
        the cache layers (``update(k, v)`` appends and returns the (1, Hkv, L, D) views). Returns (n, H) after
        the final norm. ``taps``: for each key i, the output (n, H) of decoder layer i (0-based, before the
        final norm) is stored under i. Fewer than ``BLOCKED_MIN_ROWS`` nodes without taps run compiled
        when ``compiled`` (kv: layers with ``reserve``, methods.core.engine.BufferLayer)."""
        if self.compiled and taps is None and ids.shape[0] < BLOCKED_MIN_ROWS:
            return self._compiled_forward(ids, position, mask, kv)
        x = self.layers_forward(self.embed_tokens(ids), position, mask, kv, taps=taps)
        return self.final_norm(x)

    def _compiled_forward(self, ids: torch.Tensor, position: torch.Tensor, mask: torch.Tensor | None,
                          kv: list) -> torch.Tensor:
        n, start = ids.shape[0], kv[0].length
        bufs = [layer.reserve(n, self._kv_like) for layer in kv]  # (kbuf, vbuf, the layer's write slot)
        assert all(s == start for _, _, s in bufs), f"cache layers at {[s for _, _, s in bufs]}, not {start}"
        fn = compiled_forward(self.model, self, self._stamp())
        return fn(ids, position, mask, [k for k, _, _ in bufs], [v for _, v, _ in bufs], start)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) ids → (n, H) the input of decoder layer 0."""
        return F.embedding(ids, self.embed)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """(n, H) residual stream after the last layer run → the input of the LM head."""
        return self._rms(x, self.norm)

    def layers_forward(
        self, x: torch.Tensor, position: torch.Tensor, mask: torch.Tensor | None, kv: list,
        sub: SubLayers | None = None, taps: dict[int, torch.Tensor] | None = None, rows: int = 1,
    ) -> torch.Tensor:
        """The residual stream x (n, H) through decoder layers ``sub`` (all by default: layers [start, stop)
        minus the skipped attention / MLP sub-layers, whose residual passes through unchanged and whose
        layer's cache gets no KV when its attention is skipped). Returns the (n, H) residual, no final
        norm: the input of layer ``stop`` (self-speculation resumes from it). ``rows`` > 1: x holds
        ``rows`` sequences of n / rows nodes each, row-major (methods.core.batch_engine): position is flat
        like x, the mask (rows, 1, n / rows, L) and the cache's ``update`` takes and returns (rows, ...)."""
        if self.packed and self._stamp() != self._version:  # the model's weights changed in place
            self._repack()
        n, d = x.shape[0], self.head_dim
        m = n // rows  # nodes per row
        linear = self.linear
        table = self._rope_table[position]
        cos, sin = table[:, 0], table[:, 1]  # (n, 1, D) each, broadcast over the heads
        hq, k_end = self.n_heads, (self.n_heads + self.n_kv) * d
        gqa, adt = self.n_heads != self.n_kv, self.attn_dtype
        cast = adt != x.dtype
        start, stop = (0, len(self.layers)) if sub is None else sub.bounds(len(self.layers))
        skip_attn, skip_mlp = (_NONE, _NONE) if sub is None else (sub.skip_attn, sub.skip_mlp)
        for i in range(start, stop):
            layer, cache = self.layers[i], kv[i]
            if i not in skip_attn:
                qkv = linear(self._rms(x, layer.ln_in), layer.w_qkv)  # (n, (Hq + 2Hkv) D)
                qk = _rope(qkv[:, :k_end].view(n, -1, d), cos, sin)  # (n, Hq + Hkv, D): one rotation for both
                v = qkv[:, k_end:].view(n, -1, d)
                if cast:
                    qk, v = qk.to(adt), v.to(adt)
                qk, v = qk.view(rows, m, -1, d).transpose(1, 2), v.view(rows, m, -1, d).transpose(1, 2)
                keys, values = cache.update(qk[:, hq:], v)  # (rows, Hkv, L, D)
                att = attention(qk[:, :hq], keys, values, mask, self.scale, gqa)  # (rows, Hq, m, D)
                att = att.transpose(1, 2).reshape(n, -1)  # (n, Hq D)
                x = x + linear(att.to(x.dtype) if cast else att, layer.w_o)
            if i not in skip_mlp:
                gate, up = linear(self._rms(x, layer.ln_post), layer.w_gate_up).chunk(2, dim=-1)
                x = x + linear(F.silu(gate) * up, layer.w_down)
            if taps is not None and i in taps:
                taps[i] = x
        return x


_NONE: frozenset[int] = frozenset()


@dataclass(frozen=True)
class SubLayers:
    """A subset of the decoder's sub-layers, for self-drafting (LayerSkip's early exit after layer
    ``stop``: Elhoushi et al. 2024; Draft & Verify's skipped attention / MLP sub-layers: Zhang et al. 2023):
    layers [start, stop) (stop None = the last), minus the attention of ``skip_attn`` and the MLP of
    ``skip_mlp`` (0-based layer indices)."""

    start: int = 0
    stop: int | None = None
    skip_attn: frozenset[int] = frozenset()
    skip_mlp: frozenset[int] = frozenset()

    def bounds(self, n_layers: int) -> tuple[int, int]:
        stop = n_layers if self.stop is None else self.stop
        assert 0 <= self.start <= stop <= n_layers, f"layers [{self.start}, {stop}) outside 0..{n_layers}"
        return self.start, stop

    def writes_kv(self, n_layers: int) -> list[int]:
        """Layers whose cache this forward appends to (their attention runs)."""
        return [i for i in range(*self.bounds(n_layers)) if i not in self.skip_attn]

    @property
    def is_full(self) -> bool:
        return self.start == 0 and self.stop is None and not self.skip_attn and not self.skip_mlp


# Long forwards (a prefill: m new nodes over a mask that is causal among them) on CPU in float32 (the engine's
# CPU attention dtype): attention by query blocks, each over the keys up to its last node only. PyTorch's CPU
# flash kernel with a float mask reads and exponentiates the whole (m, W) score matrix; at m = 127 (the
# benchmark prompts' prefill) this was ~3x faster (under load, min of interleaved runs). Short forwards
# (decode steps, draft trees) keep the flash kernel: equal or faster there.
BLOCKED_MIN_ROWS = 64  # new nodes per sequence from which the blocked path is taken
ATTN_BLOCK = 32  # query rows per block


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              scale: float, gqa: bool) -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) v for q (rows, Hq, m, D), keys/values (rows, Hkv, W, D), mask (rows, 1,
    m, W) additive or None (attend to everything). Keys/values in a reduced dtype under float32 queries (the
    engines' bf16 cache, ``mixed_attention.cache_dtype``): methods.core.mixed_attention for short
    forwards, upcast for long ones. The mask's contract (every engine's): new node i (0-based among the m)
    attends to no key column past W - m + i — its own slot, nodes are appended in an order where parents
    precede children — so the blocked path skips columns that are masked anyway."""
    if keys.dtype != q.dtype:  # a reduced-precision cache under float32 attention (cache_dtype)
        if q.shape[2] < BLOCKED_MIN_ROWS:
            return mixed_attention(q, keys, values, mask, scale)
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a prefill: once per forward, then as below
    if mask is None or q.shape[2] < BLOCKED_MIN_ROWS or q.device.type != "cpu" or q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return blocked_attention(q, keys, values, mask, scale)


def blocked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, block: int = ATTN_BLOCK) -> torch.Tensor:
    """``attention`` by blocks of ``block`` query rows, each over the key columns up to its last row's own
    slot (W - m + end): the columns skipped are masked for every row of the block (the mask's contract), so
    the result is the full softmax's to float rounding."""
    m, width = q.shape[2], keys.shape[2]
    if keys.shape[1] != q.shape[1]:  # GQA: each KV head repeated for its query heads (HF's repeat_kv order)
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    out = []
    for a in range(0, m, block):
        b = min(m, a + block)
        w = width - m + b  # keys this block's rows may attend to
        scores = torch.matmul(q[:, :, a:b], keys[:, :, :w].transpose(-1, -2)).mul_(scale)
        scores.add_(mask[:, :, a:b, :w])
        out.append(torch.matmul(torch.softmax(scores, dim=-1), values[:, :, :w]))
    return torch.cat(out, dim=2)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """x (n, heads, D) rotated at its positions (cos, sin_rot: (n, 1, D)), HF's rotate_half convention:
    rotate_half(x) * sin = roll(x, D/2) * sin_rot (``FastLlama.sin_rot``: sin, its first half negated), the
    same products bit for bit in two ops fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_rot
