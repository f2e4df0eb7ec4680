"""t(B, n) on this device: the target p's forward over B rows × n new tokens after a KV cache of ``context``
tokens per row, timed on the grid the batch cost model (specsim.batch) is fitted to and validated on.

The timed forward is the lean Llama forward of the decode engine (methods.core.fast_llama) run on B rows
at once (what a batched verify forward costs before any loop bookkeeping): every row has the same context
length, the n new tokens attend causally (a chain; a tree of n nodes costs the same forward, only its mask
differs), and their KV is written at the same slots every repetition, so each sees the same KV length.
The fitted coefficients are stored next to the device profiles (<cache>/profiles/batch-<key>.json),
keyed by the profile key of the run (model, device, threads, torch), with their own format number: the
single-row profile format is unchanged.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from methods.core.fast_llama import _rope
from methods.measurement.profiles import cache_root, profile_key
from specsim.batch import BATCH_FIT_FORMAT, BatchFit, fit_batch_cost
from specsim.config import RunConfig
from specsim.io import atomic_write_json, read_json

GRID_BATCHES = (1, 2, 4, 8, 16, 32)
GRID_TOKENS = (1, 2, 4, 8, 16, 32)


class _BatchedLean:
    """B rows through methods.core.fast_llama's lean Llama layers (its oneDNN-prepacked projections and
    float32 attention on CPU), over preallocated (B, Hkv, context + n, D) KV buffers: the math of a batched
    verify forward, for timing only (the batched engine of the decode loop is methods.core's). Projections
    run once on the B·n rows; attention per row over its own cache; logits for every row and token."""

    def __init__(self, fast: Any, batch: int, context: int, n_max: int, seed: int):
        self.fast, self.batch, self.context = fast, batch, context
        f = fast
        shape = (batch, f.n_kv, context + n_max, f.head_dim)
        g = torch.Generator().manual_seed(seed)
        self.k = [torch.randn(shape, generator=g).to(f.attn_dtype) for _ in f.layers]
        self.v = [torch.randn(shape, generator=g).to(f.attn_dtype) for _ in f.layers]
        self.vocab = int(f.embed.shape[0])

    def mask(self, n: int) -> torch.Tensor:
        m = torch.zeros(1, 1, n, self.context + n, dtype=self.fast.attn_dtype)
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        m[0, 0, :, self.context:].masked_fill_(causal, torch.finfo(m.dtype).min)
        return m

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        f, (b, n), d, c = self.fast, ids.shape, self.fast.head_dim, self.context
        x = f.embed_tokens(ids.reshape(-1))  # (B·n, H)
        pos = torch.arange(c, c + n).repeat(b)
        cos, sin = f.cos[pos], f.sin[pos]
        hq, k_end = f.n_heads, (f.n_heads + f.n_kv) * d
        for layer, kb, vb in zip(f.layers, self.k, self.v):
            qkv = f.linear(f._rms(x, layer.ln_in), layer.w_qkv)
            qk = _rope(qkv[:, :k_end].view(b * n, -1, d), cos, sin).to(f.attn_dtype)
            v = qkv[:, k_end:].view(b, n, -1, d).to(f.attn_dtype)
            qk = qk.view(b, n, -1, d).transpose(1, 2)  # (B, heads, n, D)
            kb[:, :, c:c + n] = qk[:, hq:]
            vb[:, :, c:c + n] = v.transpose(1, 2)
            att = torch.nn.functional.scaled_dot_product_attention(
                qk[:, :hq], kb[:, :, :c + n], vb[:, :, :c + n], attn_mask=mask, scale=f.scale,
                enable_gqa=f.n_heads != f.n_kv)  # (B, Hq, n, D)
            att = att.transpose(1, 2).reshape(b * n, -1).to(x.dtype)
            x = x + f.linear(att, layer.w_o)
            gate, up = f.linear(f._rms(x, layer.ln_post), layer.w_gate_up).chunk(2, dim=-1)
            x = x + f.linear(torch.nn.functional.silu(gate) * up, layer.w_down)
        return f.logits(f.final_norm(x))


def time_grid(model: Any, batches: Sequence[int], sizes: Sequence[int], contexts: Sequence[int],
              reps: int = 5, warmup: int = 1, seed: int = 0) -> dict[tuple[int, int, int], float]:
    """(B, n, context) → median seconds of ``reps`` forwards of B rows × n tokens after ``context`` cached
    tokens per row. Every cell is timed once per round and the rounds rotate the cells' order, so a load
    that comes and goes on a shared machine hits every cell alike; each timed forward follows an untimed
    one of the same shape (warm caches, as in a decode loop's back-to-back steps)."""
    from methods.core.fast_llama import FastLlama

    fast = FastLlama(model, torch.float32 if model.device.type == "cpu" else None)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    leans = {(b, c): _BatchedLean(fast, b, c, max(sizes), seed) for b in batches for c in contexts}
    g = torch.Generator().manual_seed(seed)
    vocab = int(fast.embed.shape[0])
    ids = {(b, n): torch.randint(0, vocab, (b, n), generator=g).to(model.device)
           for b in batches for n in sizes}
    masks = {(n, c): leans[(batches[0], c)].mask(n) for n in sizes for c in contexts}
    cells = [(b, n, c) for c in contexts for b in batches for n in sizes]
    times: dict[tuple[int, int, int], list[float]] = {cell: [] for cell in cells}
    with torch.inference_mode():
        for r in range(warmup + reps):
            shift = (r * 7) % len(cells)
            for b, n, c in cells[shift:] + cells[:shift]:
                lean, x, mask = leans[(b, c)], ids[(b, n)], masks[(n, c)]
                lean.forward(x, mask)  # untimed, same shape
                sync()
                t0 = time.perf_counter()
                lean.forward(x, mask)
                sync()
                if r >= warmup:
                    times[(b, n, c)].append(time.perf_counter() - t0)
    return {cell: statistics.median(v) for cell, v in times.items()}


def batch_profile_path(cfg: RunConfig, cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "profiles" / f"batch-{profile_key(cfg)}.json"


def save_batch_fit(fit: BatchFit, path: Path, grid: dict[tuple[int, ...], float]) -> Path:
    doc = {"format": BATCH_FIT_FORMAT, "fit": fit.to_json(),
           "grid": [[*k, t] for k, t in sorted(grid.items())]}
    return atomic_write_json(path, doc)


def load_batch_fit(cfg: RunConfig, cache: Path | None = None) -> BatchFit | None:
    """The stored fit of ``cfg``'s device and model, or None (none yet, unreadable, older format)."""
    path = batch_profile_path(cfg, cache)
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
        return BatchFit.from_json(doc["fit"]) if doc.get("format") == BATCH_FIT_FORMAT else None
    except (ValueError, TypeError, KeyError):
        return None


def calibrate_batch(cfg: RunConfig, model: Any, contexts: Sequence[int],
                    batches: Sequence[int] = GRID_BATCHES, sizes: Sequence[int] = GRID_TOKENS,
                    reps: int = 5, warmup: int = 1,
                    cache: Path | None = None) -> tuple[BatchFit, dict[tuple[int, int, int], float], Path]:
    """Time the grid, fit specsim.batch's form to it (its context_tokens: the first of ``contexts``), store
    both; returns (fit, grid, path)."""
    grid = time_grid(model, batches, sizes, contexts, reps, warmup, cfg.seed)
    fit = fit_batch_cost(grid, contexts[0])
    return fit, grid, save_batch_fit(fit, batch_profile_path(cfg, cache), grid)
