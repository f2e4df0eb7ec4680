"""t(B, n) on this device: the target p's forward over B rows × n new tokens after a KV cache of ``context``
tokens per row, timed on the grid the batch cost model (specsim.batch) is fitted to and validated on.

The timed forward is the batched decode loop's own verify forward (methods.core.batch_engine.BatchEngine,
tree attention per row, the lean Llama forward on CPU) before any loop bookkeeping: every row has the same
context length, each row verifies a chain of n nodes (a tree of n nodes costs the same forward, only its
mask differs), and the nodes are dropped after each forward, so every repetition sees the same KV length.
The fitted coefficients are stored next to the device profiles (<cache>/profiles/batch-<key>.json),
keyed by the target model, device, threads and torch version (:func:`batch_key`), with their own format
number: the single-row profile format is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from methods.measurement.profiles import cache_root, key_document
from specsim.batch import BATCH_FIT_FORMAT, BatchFit, fit_batch_cost
from specsim.config import RunConfig
from specsim.io import atomic_write_json, read_json

GRID_BATCHES = (1, 2, 4, 8, 16, 32)
GRID_TOKENS = (1, 2, 4, 8, 16, 32)


def _engine(model: Any, batch: int, context: int, n_max: int, seed: int) -> Any:
    """A BatchEngine holding ``batch`` rows of ``context`` committed (random) tokens each."""
    from methods.core.batch_engine import BatchEngine

    engine = BatchEngine(model, max_rows=batch, capacity=context + n_max + 1)
    engine.add(batch)
    g = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    for first in range(0, batch, 4):  # a few rows per prefill: a 32 × 512-token forward's activations are big
        rows = slice(first, min(first + 4, batch))
        ids = [torch.randint(0, vocab, (context,), generator=g) for _ in range(rows.start, rows.stop)]
        engine.prefill(ids, rows=rows)
    return engine


def time_grid(model: Any, batches: Sequence[int], sizes: Sequence[int], contexts: Sequence[int],
              reps: int = 5, warmup: int = 1, seed: int = 0,
              stat: Callable[[list[float]], float] = statistics.median) -> dict[tuple[int, int, int], float]:
    """(B, n, context) → ``stat`` (median) of ``reps`` verify forwards (methods.core.batch_engine's
    ``forward_trees``, a chain of n nodes per row, then dropped) over B rows of ``context`` committed tokens.
    Every cell is timed once per round and the rounds rotate the cells' order, so a load that comes and
    goes on a shared machine hits every cell alike; each timed forward follows an untimed one of the same
    shape (warm caches, as in a decode loop's back-to-back steps)."""
    from specsim.tree import Tree

    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    engines = {(b, c): _engine(model, b, c, max(sizes), seed) for b in batches for c in contexts}
    g = torch.Generator().manual_seed(seed + 1)
    vocab = int(model.config.vocab_size)
    ids = {(b, n): torch.randint(0, vocab, (b, n), generator=g) for b in batches for n in sizes}
    trees = {n: [Tree.chain(n - 1)] for n in sizes}
    cells = [(b, n, c) for c in contexts for b in batches for n in sizes]
    times: dict[tuple[int, int, int], list[float]] = {cell: [] for cell in cells}
    for r in range(warmup + reps):
        shift = (r * 7) % len(cells)
        for b, n, c in cells[shift:] + cells[:shift]:
            engine, x, tree = engines[(b, c)], ids[(b, n)], trees[n]
            engine.forward_trees(x, tree)  # untimed, same shape
            engine.drop_pending()
            sync()
            t0 = time.perf_counter()
            engine.forward_trees(x, tree)
            sync()
            dt = time.perf_counter() - t0
            engine.drop_pending()
            if r >= warmup:
                times[(b, n, c)].append(dt)
    return {cell: stat(v) for cell, v in times.items()}


ENGINE_VERSION = 2  # BatchEngine's forward: 2 = KV cache and attention in the model's dtype (bf16 on CPU)
ROLES = ("target", "draft")  # whose forward was timed: the target p, or the draft model q (vanilla)


def batch_key(cfg: RunConfig, role: str = "target") -> str:
    """What t(B, n) depends on: the model's weights and dtype, the device, torch's threads and version,
    the batched engine's version (not the drafter nor the workload: the context is a variable of the fit);
    ``role`` "draft": the draft model's forward (its own fit, next to the target's)."""
    assert role in ROLES, role
    doc = key_document(cfg)
    doc = {"format": BATCH_FIT_FORMAT, "engine": ENGINE_VERSION,
           **{k: doc[k] for k in ("model", "device", "threads", "torch")}}
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:12]
    who = "" if role == "target" else "draft-"
    return f"batch-{who}{cfg.model.name}-{cfg.model.dtype}-{digest}"


def batch_profile_path(cfg: RunConfig, cache: Path | None = None, role: str = "target") -> Path:
    return (cache or cache_root()) / "profiles" / f"{batch_key(cfg, role)}.json"


def save_batch_fit(fit: BatchFit, path: Path, grid: dict[tuple[int, ...], float]) -> Path:
    doc = {"format": BATCH_FIT_FORMAT, "fit": fit.to_json(),
           "grid": [[*k, t] for k, t in sorted(grid.items())]}
    return atomic_write_json(path, doc)


def load_batch_fit(cfg: RunConfig, cache: Path | None = None, role: str = "target") -> BatchFit | None:
    """The stored fit of ``cfg``'s device and model (``role``: its target's or its draft model's forward),
    or None (none yet, unreadable, older format)."""
    path = batch_profile_path(cfg, cache, role)
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
        return BatchFit.from_json(doc["fit"]) if doc.get("format") == BATCH_FIT_FORMAT else None
    except (ValueError, TypeError, KeyError):
        return None


def calibrate_batch(cfg: RunConfig, model: Any, contexts: Sequence[int],
                    batches: Sequence[int] = GRID_BATCHES, sizes: Sequence[int] = GRID_TOKENS,
                    reps: int = 5, warmup: int = 1, cache: Path | None = None, role: str = "target"
                    ) -> tuple[BatchFit, dict[tuple[int, int, int], float], Path]:
    """Time the grid of ``model`` (``cfg``'s target, or its draft model with ``role="draft"``), fit
    specsim.batch's form to it (its context_tokens: the first of ``contexts``), store both; returns (fit,
    grid, path)."""
    grid = time_grid(model, batches, sizes, contexts, reps, warmup, cfg.seed)
    fit = fit_batch_cost(grid, contexts[0])
    return fit, grid, save_batch_fit(fit, batch_profile_path(cfg, cache, role), grid)
