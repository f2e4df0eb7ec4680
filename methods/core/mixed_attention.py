"""Attention of a few float32 queries over a bfloat16 / float16 KV cache, accumulated in float32, on CPU.

Why: a batched decode step reads every row's cache (zoo target, B = 16, ~190 keys: ~57 MB of float32 K/V
per step, more than the weights). A reduced-precision model's keys and values are computed in its own dtype
(the projections, then RoPE), so storing them in that dtype loses nothing; but PyTorch's CPU SDPA in bf16 is
slow without AMX (``batch_engine.attention_dtype``) and the float32 SDPA's one-query path runs far below the
memory bandwidth (AMD EPYC, one thread: ~5.5 ms per B = 16 step over 6 layers against ~2.9 ms to merely read
the float32 cache). This kernel reads the half-size cache once, converts each key/value row to float32 in
registers, and computes softmax(q kᵀ · scale + mask) v in float32: the float32 SDPA's result over the same
(exactly representable) values to float rounding (summation order; the exponential is the compiler's
vectorised one).

Built on first use with torch.utils.cpp_extension (C++, ``-O3 -march=native``; a few tens of seconds once,
then loaded from torch's extension cache). Nothing is downloaded; where it cannot be built (no compiler, no
ninja, a non-x86 CPU) ``available()`` is False and callers keep their float32 cache and PyTorch's SDPA.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

static inline float to_f(float x) { return x; }
static inline float to_f(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
static inline float to_f(at::Half x) { return static_cast<float>(x); }

// q (R, Hq, M, D) float32 contiguous; k, v (R, Hkv, W, D) with unit stride on D; mask (R, 1, M, W) float32
// with unit stride on W (or undefined); out (R, Hq, M, D) float32. Query head h reads KV head h / (Hq / Hkv).
template <typename T>
static void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                double scale_d, at::Tensor& out) {
  const int64_t R = q.size(0), Hq = q.size(1), M = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), W = k.size(2), group = Hq / Hkv;
  const float scale = static_cast<float>(scale_d);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const bool masked = mask.defined();
  const float* mp = masked ? mask.data_ptr<float>() : nullptr;
  const int64_t ms0 = masked ? mask.stride(0) : 0, ms2 = masked ? mask.stride(2) : 0;
  at::parallel_for(0, R * Hq, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> s(W), acc(D), qf(D);
    for (int64_t idx = lo; idx < hi; ++idx) {
      const int64_t r = idx / Hq, h = idx % Hq, hk = h / group;
      const T* kb = kp + r * ks0 + hk * ks1;
      const T* vb = vp + r * vs0 + hk * vs1;
      for (int64_t m = 0; m < M; ++m) {
        const float* qrow = qp + ((r * Hq + h) * M + m) * D;
        for (int64_t d = 0; d < D; ++d) qf[d] = qrow[d] * scale;
        const float* mrow = masked ? mp + r * ms0 + m * ms2 : nullptr;
        float mx = -FLT_MAX;
        for (int64_t w = 0; w < W; ++w) {
          const T* kr = kb + w * ks2;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qf[d] * to_f(kr[d]);
          if (masked) dot += mrow[w];
          s[w] = dot;
          mx = dot > mx ? dot : mx;
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t w = 0; w < W; ++w) {
          const float e = std::exp(s[w] - mx);
          s[w] = e;
          sum += e;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t w = 0; w < W; ++w) {
          const float p = s[w];
          if (p == 0.f) continue;  // a masked column (exp underflows to 0): nothing to add
          const T* vr = vb + w * vs2;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += p * to_f(vr[d]);
        }
        float* orow = op + ((r * Hq + h) * M + m) * D;
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < D; ++d) orow[d] = acc[d] * inv;
      }
    }
  });
}

at::Tensor attend(at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v: (rows, heads, n, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q: float32");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v: one dtype");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k, v: unit stride on the head dim");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3), "shapes");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads: a multiple of the KV heads");
  q = q.contiguous();
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = mask->to(at::kFloat).expand({q.size(0), 1, q.size(2), k.size(2)});
    if (m.stride(3) != 1) m = m.contiguous();
  }
  auto out = at::empty(q.sizes(), q.options());
  switch (k.scalar_type()) {
    case at::kBFloat16: run<at::BFloat16>(q, k, v, m, scale, out); break;
    case at::kHalf: run<at::Half>(q, k, v, m, scale, out); break;
    case at::kFloat: run<float>(q, k, v, m, scale, out); break;
    default: TORCH_CHECK(false, "k, v: bfloat16, float16 or float32");
  }
  return out;
}
"""

_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]
_lock = threading.Lock()
_module = None
_failed: str | None = None


def _build():
    global _module, _failed
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("SPECSIM_MIXED_ATTENTION", "1") == "0":
            _failed = "disabled by SPECSIM_MIXED_ATTENTION=0"
            return None
        if platform.machine().lower() not in ("x86_64", "amd64"):
            _failed = f"not built on {platform.machine()}"
            return None
        try:
            from torch.utils.cpp_extension import load_inline

            # the name carries the source, flags, torch and CPU: a build for another machine or source is
            # never loaded from torch's shared extension cache
            tag = "|".join([_SOURCE, *_FLAGS, torch.__version__, torch.backends.cpu.get_cpu_capability(),
                            _cpu_model()])
            name = "specsim_mixed_attention_" + hashlib.sha256(tag.encode()).hexdigest()[:12]
            _module = load_inline(name, cpp_sources=[_SOURCE], functions=["attend"], extra_cflags=_FLAGS,
                                  verbose=False)
        except Exception as e:  # no compiler / ninja / headers: callers keep float32 caches and SDPA
            _failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("mixed-precision attention kernel not built (%s); float32 KV caches instead", _failed)
        return _module


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def available() -> bool:
    """Whether the kernel is built (building it on the first call)."""
    return _build() is not None


def why_not() -> str | None:
    """Why the kernel is unavailable (after ``available()`` returned False)."""
    return _failed


def mixed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) v in float32: q (rows, Hq, m, D) float32; keys, values (rows, Hkv, W, D)
    bfloat16 / float16 / float32 views (unit stride on D; GQA: query head h reads KV head h // (Hq / Hkv),
    HF's repeat_kv order); mask (rows, 1, m, W) additive or None. Returns (rows, Hq, m, D) float32."""
    module = _build()
    assert module is not None, f"mixed attention kernel unavailable: {_failed}"
    return module.attend(q, keys, values, mask, float(scale))
