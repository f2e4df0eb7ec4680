"""FastLlama's whole forward (embedding → decoder layers → final norm) as ONE torch.compile graph (inductor).

At decode sizes (1-16 new nodes) a tiny model's forward is dispatch-bound: ~25 oneDNN linears at 10-15 µs of
set-up each, and ~15 small eager ops per layer (RMSNorm's five, RoPE's four, casts, the residual adds). The
compiled graph fuses the small ops into a few C++ loops, folds the residual adds into the linears, prepacks
the weights itself (inductor's freezing: the weights become constants) and, with ``mode="max-autotune"``,
picks inductor's own C++ micro-GEMMs where they beat oneDNN. The C++ wrapper (``cpp_wrapper``) replaces the
Python one that calls the kernels.

The math is FastLlama's (the same float32 RMSNorm and attention dtype, RoPE table, fused projections), so
logits agree to float rounding (tests/methods/test_compiled_llama.py). Shapes are dynamic (the KV length, the
number of new nodes), so one model compiles a few graphs once (n = 1 and n > 1, with and without a mask):
tens of seconds, then reused by inductor's on-disk cache in later processes. The KV cache is written inside
the graph (``index_copy_`` into the preallocated buffers at the write position) and attention reads the
buffers' first start + n slots. Only full forwards of fewer than ``BLOCKED_MIN_ROWS`` nodes run compiled
(prefills keep the eager blocked attention); partial forwards (self-drafting) and feature taps stay eager.

One compiled forward per model, shared by every engine on it (a drafter rebuilt per pass reuses it), and
rebuilt when the model's weights change in place (the constants are copies).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

# inductor options for this graph only (other torch.compile users in the process keep theirs): weights as
# constants (freezing: prepacked oneDNN linears), the C++ wrapper (the Python one costs ~0.3 ms a call on the
# zoo target). Not max_autotune: its C++ micro-GEMMs won on some projections, but it took ~60 s per shape to
# compile under load and was not faster end to end on the draft (benchmarks/compiled_forward.py)
OPTIONS = {"freezing": True, "cpp_wrapper": True}
RECOMPILE_LIMIT = 64  # graphs per code object: every model's forward shares _Stack.forward's


def compile_works() -> bool:
    """Inductor on this machine: a CPU build with a C++ compiler (inductor writes and builds C++ kernels)."""
    import shutil

    return hasattr(torch, "compile") and any(shutil.which(c) for c in ("g++", "c++", "clang++"))


class _Stack(nn.Module):
    """The forward as a module whose parameters are the model's weights (so that freezing folds them)."""

    def __init__(self, fast):
        super().__init__()

        def p(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach(), requires_grad=False)

        layers = fast._plain
        self.embed, self.norm = p(fast.embed), p(fast.norm)
        self.ln_in = nn.ParameterList([p(lay.ln_in) for lay in layers])
        self.w_qkv = nn.ParameterList([p(lay.w_qkv) for lay in layers])
        self.w_o = nn.ParameterList([p(lay.w_o) for lay in layers])
        self.ln_post = nn.ParameterList([p(lay.ln_post) for lay in layers])
        self.w_gate_up = nn.ParameterList([p(lay.w_gate_up) for lay in layers])
        self.w_down = nn.ParameterList([p(lay.w_down) for lay in layers])
        self.register_buffer("rope", fast._rope_table)  # (C, 2, 1, D)
        self.n_heads, self.n_kv, self.head_dim = fast.n_heads, fast.n_kv, fast.head_dim
        self.eps, self.scale, self.norm_shape = fast.eps, fast.scale, fast._norm_shape
        self.attn_dtype = fast.attn_dtype

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * F.rms_norm(x.float(), self.norm_shape, eps=self.eps).to(x.dtype)

    def forward(self, ids: torch.Tensor, position: torch.Tensor, mask: torch.Tensor | None,
                kbufs: list[torch.Tensor], vbufs: list[torch.Tensor], start: int) -> torch.Tensor:
        """FastLlama.forward over (1, Hkv, capacity, D) cache buffers whose first ``start`` slots are
        filled; the n new nodes' K/V are written at start..start+n-1. Returns (n, H) after the final norm."""
        n, d, hq = ids.shape[0], self.head_dim, self.n_heads
        k_end, adt = (self.n_heads + self.n_kv) * d, self.attn_dtype
        gqa = self.n_heads != self.n_kv
        x = F.embedding(ids, self.embed)
        table = self.rope[position]
        cos, sin = table[:, 0], table[:, 1]
        slots = torch.arange(start, start + n, device=ids.device)
        for i in range(len(self.w_qkv)):
            qkv = F.linear(self._rms(x, self.ln_in[i]), self.w_qkv[i])
            t = qkv[:, :k_end].view(n, -1, d)
            qk = (t * cos + t.roll(d // 2, -1) * sin).to(adt).view(1, n, -1, d).transpose(1, 2)
            v = qkv[:, k_end:].to(adt).view(1, n, -1, d).transpose(1, 2)
            kbufs[i].index_copy_(2, slots, qk[:, hq:])
            vbufs[i].index_copy_(2, slots, v)
            keys, values = kbufs[i][:, :, : start + n], vbufs[i][:, :, : start + n]
            att = F.scaled_dot_product_attention(qk[:, :hq], keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=gqa)
            x = x + F.linear(att.transpose(1, 2).reshape(n, -1).to(x.dtype), self.w_o[i])
            gate, up = F.linear(self._rms(x, self.ln_post[i]), self.w_gate_up[i]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, self.w_down[i])
        return self._rms(x, self.norm)


# model → (weights' version stamp, compiled forward): one per model, shared by its engines
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_forward(model: PreTrainedModel, fast, stamp: int) -> Callable[..., torch.Tensor]:
    """The model's compiled ``_Stack`` (built lazily: inductor compiles on the first call of each shape
    family), rebuilt when ``stamp`` (the weights' version counters) moved."""
    hit = _COMPILED.get(model)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    fn = _compile(_Stack(fast).eval())
    _COMPILED[model] = (stamp, fn)
    return fn


def _compile(module: nn.Module) -> Callable[..., torch.Tensor]:
    import torch._inductor.config as inductor_config

    graph = torch.compile(module, dynamic=True, options=dict(OPTIONS))

    def run(*args) -> torch.Tensor:
        # dynamo reads inductor's ``freezing`` when it traces (a first call of a shape family): the weights
        # become constants only if it is on then (``options`` reach inductor only, after tracing). Set and
        # restored around each call, so other torch.compile users keep theirs (config.patch: ~0.1 ms a call)
        before = inductor_config.freezing
        inductor_config.freezing = True
        try:
            return graph(*args)
        finally:
            inductor_config.freezing = before

    return run
