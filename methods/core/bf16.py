"""Whether this machine multiplies bfloat16 matrices fast; the dtype to use where bf16 is a speed choice.

The zoo trains under bf16 autocast and decodes in bf16 because on CPUs with AVX512-BF16 (or AMX) bf16 matrix
products run ~2-2.5x faster than float32. On a CPU without them (AVX2 only) PyTorch's bf16 GEMM takes a slow
path: measured on a 2-core AMD EPYC with AVX2 (2026-11-28), a (64 x 384) @ (384 x 1536) product took 5.2 ms
in bf16 against 1.0 ms in float32, and (1024 x 1024)^2 120x longer, which made the zoo's 1,500 target
training steps take ~9 hours instead of ~6 minutes. Where bf16 was chosen for speed (training autocast,
the zoo's inference dtype ``auto``), such a machine uses float32; a dtype asked for by name is kept.

``SPECSIM_BF16=fast`` or ``slow`` overrides the measurement (reproducing another machine's choice).
"""

from __future__ import annotations

import functools
import os
import time

import torch

ENV = "SPECSIM_BF16"
# bf16 counts as fast when its product takes at most this many times float32's (a fast bf16 path is
# faster than float32; a slow one several times slower, so the threshold is not delicate)
SLOWDOWN_LIMIT = 1.5


def _best_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm-up: first calls pick kernels and allocate
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@functools.cache
def measured_slowdown(device: str = "cpu") -> float:
    """Time of a (64 x 384) @ (384 x 1536) bf16 product over float32's on ``device`` (best of 5 each;
    ~10 ms on a CPU with a slow bf16 path)."""
    g = torch.Generator().manual_seed(0)
    times = {}
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(64, 384, generator=g).to(device=device, dtype=dt)
        b = torch.randn(384, 1536, generator=g).to(device=device, dtype=dt)

        def product(a=a, b=b):
            out = a @ b
            if out.device.type == "cuda":
                torch.cuda.synchronize()

        times[dt] = _best_seconds(product)
    return times[torch.bfloat16] / times[torch.float32]


def bf16_is_fast(device: str | torch.device = "cpu") -> bool:
    """True where bf16 matrix products are not slower than float32 by more than ``SLOWDOWN_LIMIT`` (CUDA
    devices always: their bf16 tensor cores are the fast path)."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("fast", "slow"):
        return forced == "fast"
    if forced:
        raise ValueError(f"${ENV}={forced!r}: allowed 'fast', 'slow' or unset (measured)")
    dev = torch.device(device)
    if dev.type == "cuda":
        return True
    return measured_slowdown(dev.type) <= SLOWDOWN_LIMIT


def speed_dtype(preferred: str, device: str | torch.device = "cpu") -> str:
    """``preferred`` unless it is bfloat16 and this device's bf16 products are slow: then float32."""
    if preferred == "bfloat16" and not bf16_is_fast(device):
        return "float32"
    return preferred
