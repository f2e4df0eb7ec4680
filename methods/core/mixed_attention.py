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
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float to_f(float x) { return x; }
static inline float to_f(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
static inline float to_f(at::Half x) { return static_cast<float>(x); }

// s[0:W] <- exp(s - mx) (vectorised by the compiler); returns their sum
static inline float softmax(float* s, int64_t W, float mx) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t w = 0; w < W; ++w) {
    const float e = std::exp(s[w] - mx);
    s[w] = e;
    sum += e;
  }
  return sum;
}

// q (R, Hq, M, D) float32 contiguous; k, v (R, Hkv, W, D) with unit stride on D; mask (R, 1, M, W) float32
// with unit stride on W (or undefined); out (R, Hq, M, D) float32. Query head h reads KV head h / (Hq / Hkv).
// ``Row`` computes one (row, head, query): scores into s, softmax, the weighted sum of values into o.
struct Args {
  int64_t W, D;
  float scale;
};

template <typename T>
struct Generic {  // any D: loops the compiler vectorises
  static void row(const float* q, const T* kb, int64_t ks, const T* vb, int64_t vs, const float* mrow,
                  const Args& a, float* s, float* o) {
    const int64_t W = a.W, D = a.D;
    float mx = -FLT_MAX;
    for (int64_t w = 0; w < W; ++w) {
      const T* kr = kb + w * ks;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += q[d] * to_f(kr[d]);
      if (mrow) dot += mrow[w];
      s[w] = dot;
      mx = dot > mx ? dot : mx;
    }
    const float inv = 1.f / softmax(s, W, mx);
    std::fill(o, o + D, 0.f);
    for (int64_t w = 0; w < W; ++w) {
      const float p = s[w];
      if (p == 0.f) continue;  // a masked column (exp underflows to 0): nothing to add
      const T* vr = vb + w * vs;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * to_f(vr[d]);
    }
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
};

#if defined(__AVX512F__)
static inline __m512 ld(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 ld(const at::BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
static inline __m512 ld(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// the four lanes' sums of a0..a3, in that order
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23));
  __m512 y = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // per 128-bit lane: a0 a1 a2 a3
  y = _mm512_add_ps(y, _mm512_shuffle_f32x4(y, y, 0x4E));
  y = _mm512_add_ps(y, _mm512_shuffle_f32x4(y, y, 0xB1));
  return _mm512_castps512_ps128(y);
}

template <typename T, int NC>
struct Wide {  // D = 16 NC: q and the output accumulator in registers, four keys' dot products at once
  static void row(const float* q, const T* kb, int64_t ks, const T* vb, int64_t vs, const float* mrow,
                  const Args& a, float* s, float* o) {
    const int64_t W = a.W;
    __m512 qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
    int64_t w = 0;
    constexpr int64_t line = 64 / sizeof(T);  // elements per cache line
    for (; w + 4 <= W; w += 4) {
      const T* k0 = kb + w * ks;
      // stream the values these keys will weigh (read after the softmax) and the keys ahead alongside the
      // keys: more cache lines in flight than the hardware prefetcher keeps
      for (int64_t j = 0; j < 4; ++j) {
        for (int64_t e = 0; e < 16 * NC; e += line) {
          _mm_prefetch(reinterpret_cast<const char*>(vb + (w + j) * vs + e), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(k0 + (8 + j) * ks + e), _MM_HINT_T0);
        }
      }
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int c = 0; c < NC; ++c) {
        a0 = _mm512_fmadd_ps(qv[c], ld(k0 + 16 * c), a0);
        a1 = _mm512_fmadd_ps(qv[c], ld(k0 + ks + 16 * c), a1);
        a2 = _mm512_fmadd_ps(qv[c], ld(k0 + 2 * ks + 16 * c), a2);
        a3 = _mm512_fmadd_ps(qv[c], ld(k0 + 3 * ks + 16 * c), a3);
      }
      _mm_storeu_ps(s + w, sum4(a0, a1, a2, a3));
    }
    for (; w < W; ++w) {
      __m512 a0 = _mm512_setzero_ps();
      for (int c = 0; c < NC; ++c) a0 = _mm512_fmadd_ps(qv[c], ld(kb + w * ks + 16 * c), a0);
      s[w] = _mm512_reduce_add_ps(a0);
    }
    float mx = -FLT_MAX;
    if (mrow) {
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < W; ++j) { s[j] += mrow[j]; mx = s[j] > mx ? s[j] : mx; }
    } else {
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < W; ++j) mx = s[j] > mx ? s[j] : mx;
    }
    const float inv = 1.f / softmax(s, W, mx);
    __m512 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < W; ++j) {
      const float p = s[j];
      if (p == 0.f) continue;
      const __m512 pv = _mm512_set1_ps(p);
      const T* vr = vb + j * vs;
      for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(pv, ld(vr + 16 * c), acc[c]);
    }
    const __m512 iv = _mm512_set1_ps(inv);
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], iv));
  }
};
#endif

template <typename T, typename Row>
static void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                double scale_d, at::Tensor& out) {
  const int64_t R = q.size(0), Hq = q.size(1), M = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), W = k.size(2), group = Hq / Hkv;
  const Args args{W, D, static_cast<float>(scale_d)};
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
    std::vector<float> s(W + 4), qf(D);
    for (int64_t idx = lo; idx < hi; ++idx) {
      const int64_t r = idx / Hq, h = idx % Hq, hk = h / group;
      const T* kb = kp + r * ks0 + hk * ks1;
      const T* vb = vp + r * vs0 + hk * vs1;
      for (int64_t m = 0; m < M; ++m) {
        const float* qrow = qp + ((r * Hq + h) * M + m) * D;
        for (int64_t d = 0; d < D; ++d) qf[d] = qrow[d] * args.scale;
        const float* mrow = masked ? mp + r * ms0 + m * ms2 : nullptr;
        Row::row(qf.data(), kb, ks2, vb, vs2, mrow, args, s.data(), op + ((r * Hq + h) * M + m) * D);
      }
    }
  });
}

template <typename T>
static void dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& m,
                     double scale, at::Tensor& out) {
#if defined(__AVX512F__)
  switch (q.size(3)) {
    case 16: return run<T, Wide<T, 1>>(q, k, v, m, scale, out);
    case 32: return run<T, Wide<T, 2>>(q, k, v, m, scale, out);
    case 64: return run<T, Wide<T, 4>>(q, k, v, m, scale, out);
    case 128: return run<T, Wide<T, 8>>(q, k, v, m, scale, out);
    default: break;
  }
#endif
  run<T, Generic<T>>(q, k, v, m, scale, out);
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
    case at::kBFloat16: dispatch<at::BFloat16>(q, k, v, m, scale, out); break;
    case at::kHalf: dispatch<at::Half>(q, k, v, m, scale, out); break;
    case at::kFloat: dispatch<float>(q, k, v, m, scale, out); break;
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

            _ninja_on_path()

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


def _ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the project's ninja (a dependency) lives in the
    environment's scripts folder, which is not on PATH when the venv's Python is run without activating it."""
    try:
        import ninja
    except ImportError:  # a system ninja, if any, is found as it is
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


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


def cache_dtype(model: PreTrainedModel, attn_dtype: torch.dtype, fast: bool, mixed: bool = True
                ) -> torch.dtype:
    """The KV cache's storage dtype under attention in ``attn_dtype`` (``model``: anything with a ``dtype``
    and a ``device``: a model, or a module's weight, as EAGLE's head cache passes): the model's bf16 / fp16
    where the attention is float32 on CPU over the lean forward (``fast``) and the mixed-precision kernel is
    built (methods.core.mixed_attention; ``mixed`` False: never); else ``attn_dtype``. Lossless: the lean
    forward computes keys and values in the model's dtype (projections, RoPE), so the cache holds the float32
    cache's values in half the bytes, and the kernel accumulates in float32 like the float32 SDPA. A B = 16
    zoo decode step reads ~57 MB of float32 K/V at ~190 keys; the kernel over the bf16 cache took ~1.4-1.5
    ms per step's 6 layers against the float32 SDPA's ~5.3 (AMD EPYC, one thread, load). The one-sequence
    engine (methods.core.engine.ModelEngine) stores its cache by the same rule, so a row in a batch and the
    same prompt alone attend alike, bit for bit; there it took t(1) 1.19x, t(13) 1.10x less CPU time than over
    the float32 cache (zoo target, context 200, interleaved, load ~4), the draft model's t(1) 1.09x. Float32
    models keep the float32 cache and SDPA, exact."""
    reduced = model.dtype in (torch.bfloat16, torch.float16)
    if mixed and fast and reduced and attn_dtype == torch.float32 and model.device.type == "cpu" \
            and available():
        return model.dtype
    return attn_dtype
