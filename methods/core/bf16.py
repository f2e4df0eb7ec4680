"""Whether this machine multiplies bfloat16 matrices fast; the dtype to use where bf16 is a speed choice.

The zoo trains under bf16 autocast and decodes in bf16 because on CPUs with AVX512-BF16 (or AMX) bf16 matrix
products run ~2-2.5x faster than float32. On a CPU without them (AVX2 only) PyTorch's bf16 GEMM takes a slow
path: measured on a 2-core AMD EPYC with AVX2 (2026-11-28), a (64 x 384) @ (384 x 1536) product took 5.2 ms
in bf16 against 1.0 ms in float32, and (1024 x 1024)^2 120x longer, which made the zoo's 1,500 target
training steps take ~9 hours instead of ~6 minutes. Where bf16 was chosen for speed (training autocast,
the zoo's inference dtype ``auto``), such a machine uses float32; a dtype asked for by name is kept.

How it is decided: on an x86 CPU, by what torch's CPU probe reports (AVX512-BF16 or AMX tiles: fast;
neither: slow), which no load on the machine can change; elsewhere (ARM, CUDA aside) by timing a product in
both dtypes, one thread, interleaved, best of several. Until the twenty-third session every CPU was timed,
with torch's thread count as it was: on the 2-core machine, loaded by two sweep drivers and a benchmark, a
run's product in bf16 once measured more than 1.5x float32's (spin-waiting threads), and one row of a bf16
validation sweep silently decoded in float32 (its profile too).

``SPECSIM_BF16=fast`` or ``slow`` overrides both (reproducing another machine's choice).
"""

from __future__ import annotations

import functools
import os
import platform
import time

import torch

ENV = "SPECSIM_BF16"
# bf16 counts as fast when its product takes at most this many times float32's (a fast bf16 path is
# faster than float32; a slow one several times slower, so the threshold is not delicate)
SLOWDOWN_LIMIT = 1.5


X86 = ("x86_64", "amd64", "x86", "i386", "i686")


def cpu_bf16_support() -> bool | None:
    """What torch's CPU probe says of this x86 CPU: True with AVX512-BF16 or AMX tiles (bf16 products run
    natively), False with neither; None where it cannot tell (another architecture, or a torch without the
    probe): then the product is timed."""
    names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    probes = [getattr(torch.cpu, name, None) for name in names]
    if platform.machine().lower() not in X86 or any(p is None for p in probes):
        return None
    return any(bool(p()) for p in probes)


@functools.cache
def measured_slowdown(device: str = "cpu", rounds: int = 7) -> float:
    """Time of a (64 x 384) @ (384 x 1536) bf16 product over float32's on ``device``: each dtype's best of
    ``rounds``, the two interleaved, on one thread (torch's thread count restored after), so that neither a
    slow phase of a shared machine nor spin-waiting threads hit one dtype alone (~10 ms on a CPU with a slow
    bf16 path)."""
    g = torch.Generator().manual_seed(0)
    products = {}
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(64, 384, generator=g).to(device=device, dtype=dt)
        b = torch.randn(384, 1536, generator=g).to(device=device, dtype=dt)

        def product(a=a, b=b):
            out = a @ b
            if out.device.type == "cuda":
                torch.cuda.synchronize()

        products[dt] = product
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = {dt: float("inf") for dt in products}
        for fn in products.values():
            fn()  # warm-up: first calls pick kernels and allocate
        for _ in range(rounds):
            for dt, fn in products.items():
                t = time.perf_counter()
                fn()
                best[dt] = min(best[dt], time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / best[torch.float32]


def bf16_is_fast(device: str | torch.device = "cpu") -> bool:
    """True where bf16 matrix products are fast: CUDA devices always (their bf16 tensor cores are the fast
    path), an x86 CPU with AVX512-BF16 or AMX (``cpu_bf16_support``), another CPU where its bf16 product is
    not slower than float32's by more than ``SLOWDOWN_LIMIT``."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("fast", "slow"):
        return forced == "fast"
    if forced:
        raise ValueError(f"${ENV}={forced!r}: allowed 'fast', 'slow' or unset (measured)")
    dev = torch.device(device)
    if dev.type == "cuda":
        return True
    if dev.type == "cpu" and (known := cpu_bf16_support()) is not None:
        return known
    return measured_slowdown(dev.type) <= SLOWDOWN_LIMIT


def speed_dtype(preferred: str, device: str | torch.device = "cpu") -> str:
    """``preferred`` unless it is bfloat16 and this device's bf16 products are slow: then float32."""
    if preferred == "bfloat16" and not bf16_is_fast(device):
        return "float32"
    return preferred
