"""t(B, n) on this device: the target p's forward over B rows × n new tokens after a KV cache of ``context``
tokens per row, timed on the grid the batch cost model (specsim.batch) is fitted to and validated on.

The timed forward is the batched decode loop's own verify forward (methods.core.batch_engine.BatchEngine,
tree attention per row, the lean Llama forward on CPU) before any loop bookkeeping: every row has the same
context length, each row verifies a chain of n nodes (a tree of n nodes costs the same forward, only its
mask differs), and the nodes are dropped after each forward, so every repetition sees the same KV length.
The batched decode loop's own work per step outside the forward (verification, commit, per-row host
bookkeeping) is timed by running that loop (methods.core.batch_loop.decode_batch, autoregressively) at each
B and read from its timers (:func:`time_ar_loop`); loop0 + loop_row · B is fitted to it (:func:`fit_loop`),
and the same run's 1-token forwards price the autoregressive step's forward (:func:`with_ar`). The draft
model's fit gets its loop terms from the same loop run speculatively with it (:func:`time_draft_loop`): what
that step costs beyond the autoregressive step and beyond the draft's forwards at its grid's price.
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
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from methods.measurement.profiles import cache_root, key_document
from specsim.batch import BATCH_FIT_FORMAT, BatchFit, HeadFit, fit_batch_cost
from specsim.config import RunConfig, TreeKind
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


def time_consecutive(model: Any, batch: int, context: int, k: int = 8, rounds: int = 10, seed: int = 0,
                     before: Any = None, before_n: int = 32) -> list[float]:
    """Seconds of the 1st..k-th 1-token forward in a row over ``batch`` rows of ``context`` cached tokens,
    each run of k after a ``before_n``-token forward of another engine (what the grid's rotation does
    between cells), median per position over ``rounds``: whether the grid's one untimed forward before the
    timed one reaches the steady state of a decode loop's back-to-back steps. ``before``: that other
    engine's model (default ``model``); the target before its draft model is the batched loop's order."""
    from specsim.tree import Tree

    other_model = model if before is None else before
    engine = _engine(model, batch, context, 1, seed)
    other = _engine(other_model, batch, context, before_n, seed + 1)
    g = torch.Generator().manual_seed(seed + 3)
    x = torch.randint(0, int(model.config.vocab_size), (batch, 1), generator=g)
    x_other = torch.randint(0, int(other_model.config.vocab_size), (batch, before_n), generator=g)
    one, chain = [Tree.chain(0)], [Tree.chain(before_n - 1)]
    times = np.zeros((rounds, k))
    for r in range(rounds):
        other.forward_trees(x_other, chain)
        other.drop_pending()
        for i in range(k):
            t0 = time.perf_counter()
            engine.forward_trees(x, one)
            times[r, i] = time.perf_counter() - t0
            engine.drop_pending()
    return [float(v) for v in np.median(times, axis=0)]


def _loop_steps(model: Any, sides: dict[str, Callable[[int], Any]], batches: Sequence[int], context: int,
                steps: int, reps: int, seed: int, on_run: Callable[[str, int], None] | None = None,
                texts: Sequence[torch.Tensor] | None = None) -> dict[tuple[str, int], list[Any]]:
    """(side, B) → the BatchResults of ``reps`` runs of the batched decode loop on ``model`` (the first round
    warms up): B random prompts of ``context`` tokens — or the first B of ``texts`` (token ids, cycled),
    where a drafter's work depends on what it accepts — decoded ``steps`` tokens each (no EOS) by each side
    (name → its batched drafter at B rows), sides and batches interleaved round by round. ``on_run(side, B)``
    is called after every run, the warm-up's first."""
    from methods.core.batch_engine import BatchEngine
    from methods.core.batch_loop import decode_batch
    from methods.core.loop import DecodeOptions

    g = torch.Generator().manual_seed(seed + 2)
    vocab = int(model.config.vocab_size)
    if texts:
        prompts = {b: [texts[i % len(texts)] for i in range(b)] for b in batches}
        context = max(int(x.numel()) for x in texts)
    else:
        prompts = {b: [torch.randint(0, vocab, (context + 1,), generator=g) for _ in range(b)]
                   for b in batches}
    engines = {b: BatchEngine(model, b, capacity=context + 2 * steps + 2) for b in batches}
    drafters = {(name, b): make(b) for name, make in sides.items() for b in batches}
    opts = DecodeOptions(max_new_tokens=steps)
    out: dict[tuple[str, int], list[Any]] = {key: [] for key in drafters}
    for r in range(reps + 1):
        for (name, b), side in drafters.items():
            res = decode_batch(engines[b], side, prompts[b], opts, torch.Generator())
            if on_run is not None:
                on_run(name, b)
            if r:
                out[(name, b)].append(res)
    return out


def _per_step(results: Sequence[Any], seconds: Callable[[Any], float]) -> float:
    return statistics.median(seconds(r) / r.n_steps for r in results)


def _outside(r: Any) -> float:
    return r.time_total_s - r.time_prefill_s - r.time_forward_s


def _rows(results: Sequence[Any]) -> float:
    """Active rows per step over the runs (rows leave a static batch as they finish: a speculative batch's
    later steps run fewer rows than it started with)."""
    return statistics.median(r.row_steps / r.n_steps for r in results)


@dataclass(frozen=True)
class LoopStep:
    """The batched loop's autoregressive step at one B, medians over runs: seconds per step outside the
    target forward and in it, and the mean cached tokens per row at its forwards."""

    outside_s: float
    forward_s: float
    context: float


def time_ar_loop(model: Any, batches: Sequence[int], context: int, steps: int = 16, reps: int = 3,
                 seed: int = 0) -> dict[int, LoopStep]:
    """B → the batched decode loop's autoregressive step (its own timers, medians over ``reps`` runs):
    (total − prefill − forward) / steps outside the target forward, forward / steps in it. Prompts of
    ``context`` + 1 tokens, no EOS: step k attends to context + k cached tokens per row."""
    from methods.core.batch_drafter import batched
    from methods.drafters.autoregressive import Autoregressive

    sides = {"ar": lambda b: batched(Autoregressive(), b)}
    runs = _loop_steps(model, sides, batches, context, steps, reps, seed)
    out = {}
    for b in batches:
        rs = runs[("ar", b)]
        mean_ctx = statistics.mean(context + (r.n_steps - 1) / 2 for r in rs)
        out[b] = LoopStep(_per_step(rs, _outside), _per_step(rs, lambda r: r.time_forward_s), mean_ctx)
    return out


def loop_steps(contexts: Sequence[int], least: int = 16) -> int:
    """Steps of the calibration's autoregressive loop: from the grid's first context across its range (the
    code workload's 128 → 192: the loop's forwards attend to the contexts the runs do), at least ``least``."""
    return max(least, max(contexts) - contexts[0])


@dataclass(frozen=True)
class DraftLoopStep:
    """The batched loop's speculative step with a draft model at one B against its autoregressive step at the
    same B (same loop, interleaved), seconds per step, medians over runs. ``beyond_s`` is what the draft fit's
    loop terms price (the speculative step outside its target forward = the autoregressive step's outside +
    the draft's forwards at the grid's price + ``beyond_s``); the rest splits it for the reader:

    - ``host_s``: the draft timer less the draft's forwards less the autoregressive step's draft timer (top-k,
      the catch-up's inputs, the draft cache's commit);
    - ``forwards_s`` against ``grid_s``: the draft's forwards as the loop times them and as the draft's grid
      fit prices the same calls (rows, width, cached tokens): the first forwards after a target forward find
      the draft's weights and KV evicted (at B = 32 the catch-up took ~1.9x the grid's back-to-back forward);
    - ``verify_s``: the step's time outside its forward and its draft timer, less the autoregressive step's
      (verifying B trees, rows leaving at different steps: their KV moved into the freed slots)."""

    outside_s: float  # the speculative step: total − prefill − target forward
    draft_s: float  # its draft timer (propose + feedback)
    forwards_s: float  # the draft model's forwards in it
    grid_s: float  # the same forwards priced by the draft's grid fit
    ar_outside_s: float  # the autoregressive step's outside, and its draft timer
    ar_draft_s: float
    verify_forward_s: float = 0.0  # the speculative step's target forward (a chain of γ + 1 per row)
    # the speculative step's active rows per step (its rows leave as they finish; 0: not recorded, B) and
    # the autoregressive step's outside at that many rows (the AR runs' line over B; nan: ar_outside_s)
    rows: float = 0.0
    ar_at_rows_s: float = float("nan")

    @classmethod
    def of(cls, spec: Sequence[Any], ar: Sequence[Any], forwards: Sequence[tuple[float, float]] | None = None
           ) -> DraftLoopStep:
        """Medians per step over the speculative runs ``spec`` (BatchResults), their draft forwards
        (``forwards``: per run, (seconds timed, grid price); None: a drafter without forwards of a draft
        model, a head) and the autoregressive runs ``ar``."""
        draft_timer = lambda r: r.time_draft_s  # noqa: E731
        forwards = forwards or [(0.0, 0.0)] * len(spec)
        fwd = statistics.median(f / r.n_steps for (f, _), r in zip(forwards, spec))
        grid = statistics.median(g / r.n_steps for (_, g), r in zip(forwards, spec))
        rows = _rows(spec) if all(hasattr(r, "row_steps") for r in spec) else 0.0
        return cls(_per_step(spec, _outside), _per_step(spec, draft_timer), fwd, grid,
                   _per_step(ar, _outside), _per_step(ar, draft_timer),
                   _per_step(spec, lambda r: r.time_forward_s), rows)

    @property
    def ar_rows_s(self) -> float:
        """The autoregressive step's outside at the speculative step's rows."""
        return self.ar_outside_s if np.isnan(self.ar_at_rows_s) else self.ar_at_rows_s

    @property
    def beyond_s(self) -> float:
        return self.outside_s - self.ar_rows_s - self.grid_s

    @property
    def host_s(self) -> float:
        return self.draft_s - self.forwards_s - self.ar_draft_s

    @property
    def verify_s(self) -> float:
        return (self.outside_s - self.draft_s) - (self.ar_rows_s - self.ar_draft_s)


def at_rows(steps: dict[int, DraftLoopStep]) -> dict[int, DraftLoopStep]:
    """``steps`` (B → the speculative step against the AR step at B) with the AR step's outside read at
    the speculative step's active rows, on the line fitted to the AR steps over B (:func:`fit_loop`): what
    a step of that many rows pays outside its forward without drafting. A static batch's speculative rows
    finish steps apart (at B = 32 on the zoo the steps ran ~22-25 rows on average), the AR rows together."""
    if len(steps) < 2 or not all(s.rows > 0 for s in steps.values()):
        return steps
    ar0, ar_row = fit_loop({b: s.ar_outside_s for b, s in steps.items()})
    return {b: replace(s, ar_at_rows_s=ar0 + ar_row * s.rows) for b, s in steps.items()}


def loop_terms(steps: dict[int, DraftLoopStep]) -> dict[float, float]:
    """What a fit's loop terms are fitted to: rows per step → ``beyond_s`` (B where the rows were not
    recorded)."""
    return {(s.rows or float(b)): s.beyond_s for b, s in steps.items()}


def time_draft_loop(target: Any, drafter: Any, fit: BatchFit | None, batches: Sequence[int], context: int,
                    steps: int = 16, reps: int = 3, seed: int = 0, texts: Sequence[torch.Tensor] | None = None
                    ) -> dict[int, DraftLoopStep]:
    """B → the batched loop's speculative step with ``drafter`` (a draft model drafting its tree level by
    level on its own batched engine) against the autoregressive step, both run in one loop and timed by its
    timers (:class:`DraftLoopStep`); the draft's forwards (its engine's ``extend`` calls) are timed there
    and priced by ``fit`` (the draft's grid fit) call by call at the rows, width and cached tokens each ran
    with, as the simulator prices a level: the catch-up forward (the committed tokens the draft cache lacks,
    its root last; ``extend(last=)``) at 1 token, the first level's root — its extra accepted token, which
    rows need when they accepted the whole chain, is the loop's, in ``beyond_s``. Priced from the loop
    rather than from the grid alone: the grid times a forward after an untimed copy of itself, the loop
    after the target's forward, whose weights and KV evict the draft's. ``fit`` None: a drafter without a
    draft model's engine (MTP, EAGLE heads): the whole step beyond the AR step is ``beyond_s``. The AR step
    is read at the speculative step's active rows (:func:`at_rows`). ``texts``: prompts (token ids) instead
    of random ones (``_loop_steps``)."""
    from methods.core.batch_drafter import batched
    from methods.drafters.autoregressive import Autoregressive

    acc: dict[int, list[float]] = {}  # B → [seconds in the draft's forwards, their grid price] this run
    per_run: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}  # B → acc of each run

    def draft_side(b: int) -> Any:
        side = batched(drafter, b)
        if fit is None:
            return side
        engine = side.engine  # the draft model's BatchEngine: a drafter without one is not a draft model
        acc[b] = [0.0, 0.0]
        inner = engine.extend

        def extend(tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            rows, n = tokens.shape
            n = 1 if kwargs.get("last") is not None else n  # the catch-up: its tree level's 1 fed token
            cached = statistics.fmean(engine.lengths[:rows]) + engine.pending
            t0 = time.perf_counter()
            out = inner(tokens, *args, **kwargs)
            acc[b][0] += time.perf_counter() - t0
            acc[b][1] += float(fit.time(rows, n, cached))
            return out

        engine.extend = extend  # this instance only: a timer around the draft's forwards
        return side

    def probe(name: str, b: int) -> None:
        if name == "draft" and fit is not None:
            per_run[b].append((acc[b][0], acc[b][1]))
            acc[b] = [0.0, 0.0]

    sides = {"ar": lambda b: batched(Autoregressive(), b), "draft": draft_side}
    runs = _loop_steps(target, sides, batches, context, steps, reps, seed, on_run=probe, texts=texts)
    out = {}
    for b in batches:
        # the warm-up run's forwards left out, as _loop_steps leaves out its result
        out[b] = DraftLoopStep.of(runs[("draft", b)], runs[("ar", b)], per_run[b][1:] or None)
    return at_rows(out)


def fit_loop(loop: dict[Any, float]) -> tuple[float, float]:
    """(loop0, loop_row) ≥ 0: least squares of loop0 + loop_row · B on the timed loop (B → seconds; a
    negative time, a draft fit over-reading the loop's forwards, counts as 0). The loop's 1-token forward
    (:func:`with_ar`) is fitted the same way."""
    keys = sorted(loop)
    b = np.array(keys, float)
    t = np.maximum(np.array([loop[x] for x in keys], float), 0.0)
    if len(b) < 2:
        return float(t.mean()), 0.0
    slope, icpt = np.polyfit(b, t, 1)
    if slope < 0:
        return float(t.mean()), 0.0
    if icpt < 0:
        return 0.0, float((b @ t) / (b @ b))
    return float(icpt), float(slope)


# BatchEngine's forward: 4 = attention in batch_engine.attention_dtype over a cache in cache_dtype (a bf16
# model on a CPU without AMX: float32 attention over a bf16 cache, methods.core.mixed_attention); 3 = KV and
# attention in attention_dtype (float32 on CPUs without AMX, else the model's); 2 = in the model's dtype
ENGINE_VERSION = 4
# whose step was timed: the target p, the draft model q (vanilla), or a head drafter's (MTP, EAGLE) step
ROLES = ("target", "draft", "head")


def batch_key(cfg: RunConfig, role: str = "target") -> str:
    """What t(B, n) depends on: the model's weights and dtype, the device, torch's threads and version,
    the batched engine's version (not the drafter nor the workload: the context is a variable of the fit);
    ``role`` "draft": the draft model's forward (its own fit, next to the target's); "head": the method's
    head drafter's step (its drafter, params and tree too)."""
    assert role in ROLES, role
    doc = key_document(cfg)
    doc = {"format": BATCH_FIT_FORMAT, "engine": ENGINE_VERSION,
           **{k: doc[k] for k in ("model", "device", "threads", "torch")}}
    if role == "head":
        doc.update(drafter=cfg.method.drafter, params=cfg.method.params, tree=cfg.tree)
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:12]
    who = {"target": "", "draft": "draft-", "head": f"head-{cfg.method.name}-"}[role]
    return f"batch-{who}{cfg.model.name}-{cfg.model.dtype}-{digest}"


def batch_profile_path(cfg: RunConfig, cache: Path | None = None, role: str = "target") -> Path:
    return (cache or cache_root()) / "profiles" / f"{batch_key(cfg, role)}.json"


def save_batch_fit(fit: BatchFit, path: Path, grid: dict[tuple[int, ...], float],
                   loop: dict[int, float] | None = None, ar: dict[int, LoopStep] | None = None,
                   draft: dict[int, DraftLoopStep] | None = None) -> Path:
    """``ar``: the loop's autoregressive steps the fit's 1-token forward was fitted to (B, seconds in the
    forward, mean cached tokens per row), kept beside the grid; ``draft``: the loop's speculative steps the
    draft fit's loop terms were fitted to (B, then :class:`DraftLoopStep`'s fields in order)."""
    doc = {"format": BATCH_FIT_FORMAT, "fit": fit.to_json(),
           "grid": [[*k, t] for k, t in sorted(grid.items())],
           "loop": [[b, t] for b, t in sorted((loop or {}).items())],
           "loop_forward": [[b, s.forward_s, s.context] for b, s in sorted((ar or {}).items())],
           "draft_loop": [[b, *astuple(s)] for b, s in sorted((draft or {}).items())]}
    return atomic_write_json(path, doc)


def load_batch_fit(cfg: RunConfig, cache: Path | None = None, role: str = "target") -> BatchFit | None:
    """The stored fit of ``cfg``'s device and model (``role``: its target's or its draft model's forward),
    or None (none yet, unreadable, older format)."""
    return _load_stored(batch_profile_path(cfg, cache, role), "fit", BatchFit)


def _load_stored(path: Path, key: str, kind: Any) -> Any:
    """``kind.from_json(doc[key])`` of the stored document at ``path``, or None (none yet, unreadable, older
    format)."""
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
        return kind.from_json(doc[key]) if doc.get("format") == BATCH_FIT_FORMAT else None
    except (ValueError, TypeError, KeyError):
        return None


def head_levels(cfg: RunConfig, tree: Any) -> int:
    """The levels a head drafter's step runs, what :class:`HeadFit` is timed over: a dynamic tree (EAGLE-2/3)
    expands every one of its ``tree.depth`` levels whatever the depth of the tree it keeps (the cost model
    prices that expansion, specsim.cost.CostModel.draft_tree), a static ``tree`` its own depth."""
    return int(cfg.tree.depth) if TreeKind(cfg.tree.kind) == TreeKind.dynamic else int(tree.depth)


def calibrate_head(cfg: RunConfig, target: Any, drafter: Any, levels: int, texts: Sequence[torch.Tensor],
                   batches: Sequence[int] = GRID_BATCHES, steps: int = 64, reps: int = 3,
                   cache: Path | None = None) -> tuple[HeadFit, dict[int, DraftLoopStep], Path]:
    """Time a head ``drafter`` (MTP, EAGLE; its tree ``levels`` deep) in the batched loop on ``target``
    against the autoregressive step, interleaved (:func:`time_draft_loop` without a draft fit), decoding
    ``texts`` (the workload's prompts: the heads' catch-up grows with what the rows accept), and fit its
    step beyond the AR step at the same rows: step0 + step_row · rows (:func:`loop_terms`); store it."""
    runs = time_draft_loop(target, drafter, None, batches, 0, steps, reps=reps, seed=cfg.seed, texts=texts)
    step0, step_row = fit_loop(loop_terms(runs))
    fit = HeadFit(step0, step_row, int(levels))
    path = batch_profile_path(cfg, cache, "head")
    doc = {"format": BATCH_FIT_FORMAT, "head": fit.to_json(),
           "draft_loop": [[b, *astuple(s)] for b, s in sorted(runs.items())]}
    return fit, runs, atomic_write_json(path, doc)


def load_head_fit(cfg: RunConfig, cache: Path | None = None) -> HeadFit | None:
    """The stored head step of ``cfg``'s method on this device (:func:`calibrate_head`), or None."""
    return _load_stored(batch_profile_path(cfg, cache, "head"), "head", HeadFit)


def calibrate_batch(cfg: RunConfig, model: Any, contexts: Sequence[int],
                    batches: Sequence[int] = GRID_BATCHES, sizes: Sequence[int] = GRID_TOKENS,
                    reps: int = 5, warmup: int = 1, cache: Path | None = None, role: str = "target",
                    target: Any = None, drafter: Any = None
                    ) -> tuple[BatchFit, dict[tuple[int, int, int], float], Path]:
    """Time the grid of ``model`` (``cfg``'s target, or its draft model with ``role="draft"``), fit
    specsim.batch's form to it (its context_tokens: the first of ``contexts``) and the loop's time outside
    the forwards at the first context — the target's: :func:`time_ar_loop`; the draft's, given the ``target``
    model and the ``drafter`` on ``model``: what :func:`time_draft_loop`'s speculative step costs beyond
    the autoregressive step and the draft's forwards at the grid's price (``DraftLoopStep.beyond_s``), over
    the grid's contexts as the target's loop runs (:func:`loop_steps`) — store them; returns (fit, grid,
    path)."""
    grid = time_grid(model, batches, sizes, contexts, reps, warmup, cfg.seed)
    fit = fit_batch_cost(grid, contexts[0])
    ar: dict[int, LoopStep] = {}
    draft: dict[int, DraftLoopStep] = {}
    if role == "target":
        ar = time_ar_loop(model, batches, contexts[0], loop_steps(contexts), reps=reps, seed=cfg.seed)
        loop = {b: s.outside_s for b, s in ar.items()}
        fit = with_ar(fit, ar)
    elif drafter is not None:
        draft = time_draft_loop(target, drafter, fit, batches, contexts[0], loop_steps(contexts), reps=reps,
                                seed=cfg.seed)
        loop = loop_terms(draft)
    else:
        loop = {}
    if loop:
        fit = with_loop(fit, loop)
    return fit, grid, save_batch_fit(fit, batch_profile_path(cfg, cache, role), grid, loop, ar, draft)


def with_loop(fit: BatchFit, loop: dict[Any, float]) -> BatchFit:
    """``fit`` with the loop's time outside the forward fitted to ``loop`` (rows → seconds per step)."""
    loop0, loop_row = fit_loop(loop)
    return replace(fit, loop0=loop0, loop_row=loop_row)


def with_ar(fit: BatchFit, ar: dict[int, LoopStep]) -> BatchFit:
    """``fit`` whose 1-token forward is the loop's own (``ar``: B → its autoregressive step, time_ar_loop):
    ar0 + ar_row · B fitted to the loop's forwards at their mean context (one context for every B), the
    grid's kv term carrying it to other contexts. The grid's 1-token cell is timed back to back with an
    untimed copy of itself between the other cells; what the loop's step costs is what prices its steps."""
    if not ar:
        return fit
    ar0, ar_row = fit_loop({b: s.forward_s for b, s in ar.items()})
    return replace(fit, ar0=ar0, ar_row=ar_row, ar_context=statistics.mean(s.context for s in ar.values()))
