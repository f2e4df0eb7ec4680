"""The mixed-precision attention kernel (float32 queries over a bf16 / fp16 / float32 cache) against PyTorch's
float32 SDPA over the same values: GQA, ragged masks (fully masked columns), several queries, strided views of
a larger cache buffer, as the batched engine passes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from methods.core import mixed_attention
from methods.core.fast_llama import attention


def test_the_kernel_builds_on_this_machine():
    assert mixed_attention.available(), mixed_attention.why_not()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("hq,hkv,d", [(6, 6, 64), (4, 2, 16), (4, 4, 32), (2, 1, 128), (3, 1, 24)],
                         ids=["mha", "gqa", "d32", "d128", "generic-d"])  # D = 16, 32, 64, 128: AVX-512 path
def test_kernel_equals_float32_sdpa_over_the_same_values(dtype, m, hq, hkv, d):
    g = torch.Generator().manual_seed(0)
    rows, cap, width = 5, 40, 29
    k_buf = torch.randn(rows + 1, hkv, cap, d, generator=g).to(dtype)  # views of a larger buffer (the engine)
    v_buf = torch.randn(rows + 1, hkv, cap, d, generator=g).to(dtype)
    keys, values = k_buf[:rows, :, :width], v_buf[:rows, :, :width]
    q = torch.randn(rows, hq, m, d, generator=g)
    lens = torch.tensor([3, 29 - m, 10, 0, 17])  # row b sees its first lens[b] columns and its own m nodes
    col, first = torch.arange(width)[None, None], lens[:, None, None]
    seen = (col < first) | ((col >= first) & (col <= first + torch.arange(m)[None, :, None]))
    mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[:, None]  # (rows, 1, m, W)
    scale = d**-0.5
    want = F.scaled_dot_product_attention(q, keys.float(), values.float(), attn_mask=mask, scale=scale,
                                          enable_gqa=hq != hkv)
    got = mixed_attention.mixed_attention(q, keys, values, mask, scale)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    # no mask: every column
    want = F.scaled_dot_product_attention(q, keys.float(), values.float(), scale=scale, enable_gqa=hq != hkv)
    torch.testing.assert_close(mixed_attention.mixed_attention(q, keys, values, None, scale), want,
                               atol=2e-6, rtol=2e-5)


def test_fast_llama_attention_takes_the_kernel_for_a_reduced_cache_and_upcasts_long_forwards(monkeypatch):
    """fast_llama.attention: float32 queries over a bf16 cache run the kernel for short forwards (a decode
    step, a tree) and the float32 path over upcast keys for long ones (a prefill): both equal float32 SDPA."""
    g = torch.Generator().manual_seed(1)
    calls = []
    real = mixed_attention.mixed_attention
    monkeypatch.setattr("methods.core.fast_llama.mixed_attention", lambda *a: calls.append(a) or real(*a))
    for m, kernel in ((2, True), (70, False)):
        keys = torch.randn(2, 2, m + 5, 16, generator=g).bfloat16()
        values = torch.randn(2, 2, m + 5, 16, generator=g).bfloat16()
        q = torch.randn(2, 4, m, 16, generator=g)
        causal = torch.ones(m, m + 5, dtype=torch.bool).tril(5)
        mask = torch.where(causal, 0.0, torch.finfo(torch.float32).min)[None, None].expand(2, 1, m, m + 5)
        calls.clear()
        got = attention(q, keys, values, mask, 0.25, True)
        want = F.scaled_dot_product_attention(q, keys.float(), values.float(), attn_mask=mask, scale=0.25,
                                              enable_gqa=True)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
        assert bool(calls) == kernel
